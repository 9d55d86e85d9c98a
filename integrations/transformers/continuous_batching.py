"""Continuous batching of HF causal LMs under breakable graphs: ``enable_continuous_batching``.

transformers' continuous batching (``model.generate_batch``, the ``init_continuous_batching``
manager, ``transformers serve --continuous-batching``) serves streams of requests whose
steps mix prefill chunks and decode tokens. While enabled, each step of the model replays
one breakable graph per *query-token bucket*: everything is captured (embeddings,
projections, MLPs/MoE, norms, RoPE, ``lm_head``) except each layer's paged-cache access and
varlen attention, which runs as an eager break with the live step's exact lengths. No
KV-size graph keys, no upper-bound kernels, no ``flash_attn``.

transformers keeps everything it owns (scheduler, paged cache, logits processing, sampling,
request lifecycle). breakgraph takes over only the model's forward for the CB steps, through
the narrowest contract that works on transformers 5.17 to 5.24 (:mod:`.compat` lists every
name it reads, next to its probe):

* on the model *instance*, for the life of the handle: ``forward`` (a CB step goes to
  :class:`~.cb_step.StepRunner`, any other call to the original) and
  ``init_continuous_batching`` (every entry point goes through it: a copy of the caller's
  ``ContinuousBatchingConfig`` with transformers' own graphs off, then every bucket is
  captured before the manager serves); the model also gets a private copy of its config, so
  models sharing a config object are untouched;
* in transformers, while at least one model is enabled: an ``AttentionInterface`` entry,
  ``ContinuousBatchingManager.switch_to_cb_friendly_attn``
  keeps an enabled model's attention key (from 5.19 it refuses any other), and the step's
  index lists convert through numpy (:mod:`.index_lists`: transformers' ``input_outputs``
  module sees a view of torch whose ``tensor`` reads lists with numpy; equal tensors, for
  every CB manager of the process, in less than half the time);
* on each manager an enabled model creates (:mod:`.managers`): ``_create_batch_processor``,
  after which the manager waits until the buffer reset it issued has run (:func:`_settle`),
  and ``pause`` (5.18 on), whose end checks that the weights are where the graphs read them.

The eager experts loop's ``ExpertsInterface`` key is registered for good, as ``PrefillRunner``
registers it (removed with the last handle, it could be pulled from under a runner's forward
on another thread).

Every replacement goes through :mod:`breakgraph.patches` and is undone by ``disable()``.

Example::

    >>> import torch, transformers
    >>> from transformers import GenerationConfig
    >>> from transformers.generation.configuration_utils import ContinuousBatchingConfig
    >>> from breakgraph.integrations.transformers import enable_continuous_batching
    >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    >>> with enable_continuous_batching(model, backend="emulated") as handle:
    ...     outs = model.generate_batch(
    ...         [[1, 2, 3], [4, 5, 6, 7, 8]],
    ...         generation_config=GenerationConfig(max_new_tokens=4, do_sample=False,
    ...                                            eos_token_id=-1, pad_token_id=0),
    ...         continuous_batching_config=ContinuousBatchingConfig(
    ...             block_size=16, num_blocks=16, max_batch_tokens=16),
    ...         progress_bar=False)
    >>> [len(o.generated_tokens) for o in outs.values()]
    [4, 4]
    >>> handle.stats.replays > 0, type(handle).__name__, handle.enabled  # disabled on exit
    (True, 'ContinuousBatchingHandle', False)
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any

import torch

from breakgraph import distributed
from breakgraph.backends import select_backend
from breakgraph.buckets import validate_count
from breakgraph.debug import debug_enabled
from breakgraph.errors import InputError, ReplayError
from breakgraph.fingerprints import plain_setting
from breakgraph.ladder import BucketStats, LadderStats
from breakgraph.patches import PatchSet, SharedPatches

from . import block_table, compat, index_lists, index_rows
from .attention import switching
from .block_table import page_size
from .cb_step import CB_ATTENTION_KEY, StepRunner, paged_attention
from .compiled import check_compile_option
from .experts import EXPERTS_KEY, needs_experts_break
from .experts import register as register_experts
from .logits_head import checked_logits_after_head
from .managers import PauseWatch, retired_start, settle_after_reset, watch_pause
from .models import (
    DEFAULT_MAX_BATCH_TOKENS,
    check_async_batching,
    check_model,
    check_paged_heads,
    check_paged_window,
    check_sampled_tokens,
    check_step_compile,
    eager_steps,
    kept_weights,
)
from .models import resolve_attention as _resolve_attention

__all__ = [
    "enable_continuous_batching",
    "ContinuousBatchingHandle",
    "ContinuousBatchingStats",
    "BucketStats",
    "CB_ATTENTION_KEY",
]

_WHO = "enable_continuous_batching"
_REBUILD = "Call handle.disable() and enable_continuous_batching(model) again"

#: The statistics of a handle: the one ladder stats type (per query bucket: captures, replays,
#: padding, capture seconds, breaks; totals; eager steps by reason).
ContinuousBatchingStats = LadderStats

_lock = threading.RLock()  # enable and disable
# model -> a weak reference to its handle. Weak both ways: the model holds its handle (its
# patched init_continuous_batching is the handle's closure) and the handle the model, so a
# model dropped without disable() is collected with its handle, step runner and graphs; a
# strong value kept the model alive for good.
_enabled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# held to add or remove an entry of _enabled and to list its handles: a manager created on one
# thread lists them (_wants_block_table) while another thread enables or disables another model
# (iterating a dict that changes size raises). Never held for longer than that: _lock is held
# through a whole enable, which can wait for other ranks.
_registry = threading.Lock()


def _handle_of(model: Any) -> ContinuousBatchingHandle | None:
    """The enabled handle of ``model`` (keyed by the model object, never by its config)."""
    try:
        ref = _enabled.get(model)
    except TypeError:  # not weak-referenceable: never enabled
        return None
    return None if ref is None else ref()


def _install_shared(patches: PatchSet) -> None:
    """Replacements in transformers shared by every enabled model (see the module docstring)."""
    patches.item(compat.attention_registry()._global_mapping, CB_ATTENTION_KEY, paged_attention)
    manager = compat.manager_class()
    original = manager.__dict__["switch_to_cb_friendly_attn"]

    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if _handle_of(model) is not None:
            return None  # an enabled model keeps breakgraph's attention key
        return original(self, model, *args, **kwargs)

    patches.attribute(manager, "switch_to_cb_friendly_attn", switch_to_cb_friendly_attn)
    lists = index_lists.install(patches)  # the step's index lists through numpy (where probed)
    index_rows.install(patches, lists)  # and their rows computed in numpy
    block_table.install(patches, _wants_block_table)  # decode steps without the lists
    block_table.install_fill(patches)  # their tables written through numpy (host tables)


def _settle(device: torch.device) -> None:
    """Wait for the current stream once a manager of an enabled model has (re)created its
    batch processor (contract item 17), on its generation thread before the first step.

    That resets the static device buffers (input ids, sequence offsets, logits rows, cache
    indices) on the thread's current stream, while transformers uploads each step on a copy
    stream of its own, which waits for nothing issued before it. With the device far behind
    the host (a GPU busy with other work), the reset can land after the first upload, and
    that step then reads zeroed offsets and logits rows: the wrong first tokens of
    docs/continuous-batching.md's *Known problems*. Checked on an H200 with only the reset held
    back (``test_cuda_tokens_equal_generate_while_the_gpu_is_busy``): transformers alone
    returned wrong tokens and breakgraph without this wait failed, breakgraph with it passed.
    Once per processor, never per step; the reset's stream only, never a device-wide wait
    (which would break another thread's graph capture).

    Example (a CPU model: nothing to wait for)::

        >>> _settle(torch.device("cpu"))
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _wants_block_table(config: Any) -> bool:
    """Whether ``config`` is an enabled model's whose decode steps breakgraph reads through
    transformers' block table (:mod:`.block_table`)."""
    with _registry:
        handles = [ref() for ref in _enabled.values()]
    for handle in handles:
        if handle is not None and handle.model.config is config:
            return handle.runner.block_tables
    return False


_shared = SharedPatches(_install_shared)


class ContinuousBatchingHandle:
    """What :func:`enable_continuous_batching` returns: stats, the step runner, ``disable()``.

    Also a context manager: leaving the ``with`` block disables it.
    """

    def __init__(self, model, backend: str, kernel: str, query_buckets, debug: bool,
                 ranks=None, decode_graphs: bool = True, compile: Any = False) -> None:  # fmt: skip
        self.model = model
        self.backend, self.kernel, self.debug = backend, kernel, debug
        self.query_buckets = query_buckets
        self.ranks = ranks  # a RankGroup under tensor parallelism, else None
        self.device = next(model.parameters()).device
        self.enabled = False
        self.runner = StepRunner(model, backend=backend, kernel=kernel, debug=debug, ranks=ranks,
                                 query_buckets=query_buckets, who=_WHO,
                                 decode_graphs=decode_graphs, compile=compile)  # fmt: skip
        self._patches = PatchSet()
        self._managers: weakref.WeakSet = weakref.WeakSet()  # created while enabled
        self._weights = None  # the weights' memory the graphs read (models.kept_weights)
        self._pauses = PauseWatch(self._check_weights)  # manager.pause(): see .managers
        # held while a manager is created and by disable(): a manager made while another thread
        # disables is then either made stock (after) or retired by it (before), never left
        # configured for breakgraph's key on a model restored under it
        self._managing = threading.RLock()

    @property
    def stats(self) -> ContinuousBatchingStats:
        """Per query bucket: captures, replays, padding, capture seconds, breaks; totals."""
        return self.runner.stats

    @property
    def decode_graphs(self):
        """The pure-decode graphs (:class:`~.decode_graph.DecodeGraphs`: ``stats``,
        ``fallbacks`` by reason, ``off`` saying why they never run), or None where they are
        not used (``decode_graphs=False``, tensor parallelism, the reference kernel on CUDA)."""
        return self.runner.decode

    @property
    def runners(self) -> list:
        """The step runner (``.buckets``; ``.tokens.graph(bucket)``: a ``BreakableCUDAGraph``),
        as a one-element list: every manager of the model shares it."""
        return [self.runner] if self.enabled else []

    # -- enable / disable ----------------------------------------------------------------------
    def _enable(self) -> None:
        """Install everything; on any failure, nothing stays. Under the model's attention
        lock: not in the middle of a runner's attention switch (see ``attention.switching``)."""
        with switching(self.model):  # the probe's forwards on the model's own attention
            self._install()
        with _registry:
            _enabled[self.model] = weakref.ref(self)
        # collected while enabled (the model dropped without disable()): its share of the
        # shared replacements is given back, at the next enable or disable
        self._share = weakref.finalize(self, _shared.release_later)
        self.enabled = True

    def _install(self) -> None:
        model = self.model
        _shared.acquire()
        try:  # a model refused by the logits check too: the runner closed below
            self.runner.after_head = checked_logits_after_head(model, _WHO)
            config = model.config
            private = copy.copy(config)  # models sharing `config` keep their attention key
            for module in model.modules():
                if module.__dict__.get("config") is config:
                    self._patches.attribute(module, "config", private)
            if needs_experts_break(model):
                # registered for good, as PrefillRunner does around each forward: a key removed
                # with the last handle could be in use by a runner's forward on another thread
                register_experts()
                model.set_experts_implementation(EXPERTS_KEY)
            model.set_attn_implementation(CB_ATTENTION_KEY)
            self._patches.attribute(model, "forward", self._forward(model.forward))
            self._patches.attribute(
                model, "init_continuous_batching", self._init(model.init_continuous_batching)
            )
        except BaseException:
            self._patches.restore()
            _shared.release()
            self.runner.close()  # nothing captured yet; the compiled regions off the decoder
            raise

    def disable(self) -> None:
        """Restore the model and transformers exactly as before (idempotent; transformers'
        ``ExpertsInterface`` keeps breakgraph's experts keys, registered for good).

        Raises ``InputError`` while a manager created through this handle (or a persistent
        manager of the model) is running: stop it first. Managers created while enabled
        are destroyed; starting one again raises ``ReplayError``.
        """
        with self._managing, _lock:  # a creation under way first, other models meanwhile
            if not self.enabled:
                return
            managers = list(self._managers)
            cached = compat.cached_manager(self.model)
            running = [m for m in [*managers, cached] if m is not None and m.is_running()]
            if running:
                raise InputError(
                    "ContinuousBatchingHandle.disable: a continuous-batching manager of this model "
                    "is still running; call manager.stop() first."
                )
            if cached is not None:
                self.model.destroy_cached_continuous_batching_manager()
            for manager in managers:
                manager.destroy()
                manager.start = retired_start  # its cache was built for breakgraph's key
            self.runner.close()
            try:  # a restore that warns (-W error: other code replaced a patch) still disables
                with switching(self.model):  # not in a runner's attention switch
                    self._patches.restore()
            finally:
                with _registry:
                    del _enabled[self.model]
                self._share.detach()
                _shared.release()
                self.enabled = False
                if self.ranks is not None:
                    self.ranks.close()

    def __enter__(self) -> ContinuousBatchingHandle:
        """Refused once disabled: the block would generate with stock transformers (the
        graphs were released with ``disable()``, which is final), silently."""
        if not self.enabled:
            raise ReplayError(
                f"ContinuousBatchingHandle: `with handle:` after handle.disable(); the "
                f"{type(self.model).__name__} runs stock transformers now (no graphs), and a "
                f"disabled handle stays so: enable again with `with "
                f"enable_continuous_batching(model, ...) as handle:` (a new handle)."
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        self.disable()

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return (
            f"ContinuousBatchingHandle({type(self.model).__name__}, {state}, "
            f"backend={self.backend!r}, attention={self.kernel!r}, "
            f"buckets={list(self.runner.buckets)}, replays={self.stats.replays})"
        )

    # -- the two instance methods --------------------------------------------------------------
    def _forward(self, original):
        runner, cache_key, pauses = self.runner, compat.step_kwargs().read_index, self._pauses
        cache = compat.step_kwargs().cache

        def forward(*args, **kwargs):
            if cache_key in kwargs and not args:  # a continuous-batching step
                if pauses.moved is not None:  # a pause saw a weight replaced: graphs refuse
                    pauses.refuse(lambda: runner.serves_eagerly(cache=kwargs[cache]))
                return runner.forward(**kwargs)
            return original(*args, **kwargs)

        forward.__wrapped__ = original
        return forward

    def _init(self, original):
        def init_continuous_batching(generation_config=None, continuous_batching_config=None,
                                     *args, **kwargs):  # fmt: skip
            with self._managing:
                if self.enabled:
                    cached = compat.cached_manager(self.model)
                    if cached is not None:  # transformers returns it: one with graphs checks the
                        # weights; an eager one serves replaced ones (as when it was created)
                        if not self.runner.serves_eagerly(cached):
                            self._weights = kept_weights(self._weights, self.model, _WHO,
                                                         _REBUILD)  # fmt: skip
                        return original(generation_config, continuous_batching_config, *args,
                                        **kwargs)  # fmt: skip
                    config, eager = self._prepare(continuous_batching_config,
                                                  generation_config)  # fmt: skip
                    manager = original(generation_config, config, *args, **kwargs)
                    self._managers.add(manager)
                    settle_after_reset(self._patches, manager, self.device, _settle)
                    pauses = self._pauses  # an eager manager's pause raises nothing
                    watch_pause(self._patches, manager,
                                pauses.note if eager == "all" else pauses.leave)  # fmt: skip
                    if eager is not None:  # graphs off for all its steps, or for some
                        self.runner.graphs_off(manager, eager)
                    return manager
            # disabled on another thread since this call began: what the model has now (stock,
            # or a later handle's wrapper), outside this handle's lock
            current = self.model.init_continuous_batching
            return current(generation_config, continuous_batching_config, *args, **kwargs)

        init_continuous_batching.__wrapped__ = original
        return init_continuous_batching

    def _check_weights(self) -> None:
        """Raise ``ReplayError`` where a weight is no longer where the graphs read it."""
        if self._weights is not None and self.runner.buckets:
            kept_weights(self._weights, self.model, _WHO, _REBUILD)

    def _prepare(self, given, generation_config):
        """A copy of the caller's CB config for transformers (its own graphs and padding off,
        asynchronous steps on a single CUDA model unless the caller decided, and
        ``max_batch_tokens`` no larger than the captured buckets), and which of its steps run
        eagerly (:func:`.models.eager_steps`: None, or all, the mixed or the pure-decode ones),
        read from the config given or else the one in the generation config. Captures first."""
        try:
            config, eager = self._configure(given, generation_config)
            use_graphs = eager != "all"
            # graphs replay the weights' memory at capture: checked where captured, else taken;
            # an eager manager neither (taken there, it hid weights replaced since the capture)
            if use_graphs:
                captured = self._weights if self.runner.buckets else None
                self._weights = kept_weights(captured, self.model, _WHO, _REBUILD)
        except BaseException:
            if self.ranks is not None:  # the others raise, not pair with this rank's next call
                self.ranks.report_failure()
            raise
        if self.ranks is not None:  # every rank serves the same way, or all raise
            settings = (eager, config.max_batch_tokens, config.use_async_batching)
            self.ranks.agree(
                0,
                distributed.fingerprint(repr(plain_setting(settings))),  # np.False_ == False
                "continuous-batching settings",
                "pass the same ContinuousBatchingConfig and GenerationConfig on every rank",
            )
        if use_graphs:  # capture before serving, and compile the decode kernels
            tables = self.runner.block_tables and config.max_blocks_per_request != 0
            self.runner.plan(config.max_batch_tokens, page_size(config) if tables else 0)
        return config, eager

    def _configure(self, given, generation_config):
        """The config for transformers and which of its steps run eagerly (no exchange)."""
        from transformers import ContinuousBatchingConfig

        if given is None:  # transformers' own default (a config in the generation config: legacy)
            legacy = getattr(generation_config or self.model.generation_config,
                             "continuous_batching_config", None)  # fmt: skip
            given = legacy if isinstance(legacy, ContinuousBatchingConfig) else None
        config = copy.copy(given) if given is not None else ContinuousBatchingConfig()
        eager = eager_steps(config, _WHO)
        use_graphs = eager != "all"
        forks = block_table.forks(generation_config or self.model.generation_config)
        check_async_batching(config.use_async_batching, self.device, forks, _WHO)
        if use_graphs:
            check_step_compile(self.model, config, _WHO)
        config.use_cuda_graph = False  # transformers' whole-step graphs: never here
        # block tables serve the decode graphs only: none where pure-decode steps run eagerly
        if eager in ("all", "decode") or not self.runner.block_tables or forks:  # else as given
            config.max_blocks_per_request = 0  # every step with index lists
        elif config.max_blocks_per_request is not None:  # kept past transformers' gate: checked
            validate_count(config.max_blocks_per_request, 0,
                           f"{_WHO}: ContinuousBatchingConfig.max_blocks_per_request")  # fmt: skip
        for name in compat.CB_OPTIONAL_FIELDS:  # auto_switch_to_flash: keep breakgraph's key
            if hasattr(config, name):
                setattr(config, name, False)
        if config.use_async_batching is None:
            config.use_async_batching = self._async_by_default(use_graphs) and not forks
        if use_graphs:
            planned = self.runner.buckets
            default = planned[-1] if planned else self._default_max_batch_tokens()
            if config.max_batch_tokens is not None:  # transformers checks it only later; an
                # int: the ranks compare its repr (np.int64(16) on one rank, 16 on another)
                config.max_batch_tokens = validate_count(config.max_batch_tokens, 1,
                                                         f"{_WHO}: ContinuousBatchingConfig"
                                                         ".max_batch_tokens")  # fmt: skip
            config.max_batch_tokens = config.max_batch_tokens or default
        return config, eager

    def _async_by_default(self, use_graphs: bool) -> bool:
        """``use_async_batching`` when the caller left it unset: transformers' own rule for its
        graphs (on with graphs and no attention mask), applied to breakgraph's graphs. Under
        tensor parallelism it stays off (not run on GPUs there yet), and so it does for a
        manager that forks its requests (:meth:`_configure` says why)."""
        return use_graphs and self.device.type == "cuda" and self.ranks is None

    def _default_max_batch_tokens(self) -> int:
        return max(self.query_buckets) if self.query_buckets else DEFAULT_MAX_BATCH_TOKENS


def enable_continuous_batching(
    model: Any,
    backend: str | None = None,
    *,
    attention: str = "auto",
    query_buckets: tuple[int, ...] | None = None,
    debug: bool | None = None,
    tp_timeout: float = 300.0,
    decode_graphs: bool = True,
    compile: bool | dict = False,
) -> ContinuousBatchingHandle:
    """Run the model's continuous-batching steps as breakable graphs, one per query bucket.

    Args:
        model: a transformers causal LM of a supported family (dense: llama, qwen2, qwen3,
            mistral, gemma, phi3, olmo, olmo2, granite, starcoder2, stablelm, phi, glm,
            gemma3_text, cohere, smollm3, olmo3, ministral, exaone4, cohere2, glm4, helium,
            seed_oss, ernie4_5, hunyuan_v1_dense, apertus, arcee, nemotron, ministral3, jais2,
            hyperclovax, exaone, internlm3, iquestcoder, apertus1p5_text; MoE: qwen3_moe,
            mixtral, qwen2_moe, olmoe, glm4_moe, ernie4_5_moe, hunyuan_v1_moe, granitemoe,
            granitemoeshared, flex_olmo, gpt_oss, minimax_m2, afmoe, exaone_moe, solar_open,
            cohere2_moe, hy_v3, mellum, kolibri1, sarvam_moe, laguna) in eval mode.
        backend: ``"cuda"`` or ``"emulated"`` (CPU), as for :func:`breakgraph.capture`.
        attention: ``"auto"`` (FlashAttention varlen inside ATen on CUDA in bf16/fp16,
            else the exact per-sequence reference), ``"flash"`` or ``"reference"``.
        query_buckets: query-token counts to capture (default: 32, 128, 512, ... up to the
            first manager's ``max_batch_tokens``, which is always the largest bucket; 2048
            when its config leaves it unset). Positive ints.
        debug: capture graphs in breakgraph's debug mode (slow; see ``docs/debugging.md``).
            Under tensor parallelism it also checks, on every step, that all ranks run the
            same tokens with the same boundaries.
        tp_timeout: tensor parallelism only (detected from the model's DTensor
            parameters): seconds a rank waits for the others in a capture or in the
            per-step agreement before raising :class:`~breakgraph.RankFailedError`.
            Every rank must call this function, in the same order as its other
            process-group creations (it creates a gloo group).
        decode_graphs: run pure-decode steps (one query per sequence) as graphs with the
            paged-cache write and read inside, no break per layer (:mod:`.decode_graph`),
            where the model and cache allow it; captured while serving, when a step first
            needs a bucket with a new cache layout. Off under tensor parallelism.
        compile: ``torch.compile`` the decoder (True, or a dict of ``torch.compile`` keyword
            arguments) so that every captured segment and decode graph holds Inductor's fused
            kernels instead of a dozen small ones per norm, rotary and activation; attention
            stays outside the compile (a Dynamo graph break). Compiled once, when the first
            manager captures its largest bucket (tens of seconds; the token dimension is
            dynamic unless the dict sets ``dynamic``). Not under tensor parallelism.

    Returns a :class:`ContinuousBatchingHandle` (also a context manager). While it is
    enabled, CB managers of this model created afterwards (``generate_batch``,
    ``init_continuous_batching``, ``transformers serve``) run their steps as breakable graphs,
    captured when the manager is created, unless their ``ContinuousBatchingConfig`` says
    ``use_cuda_graph=False`` (eager steps through the same attention). On a CUDA model their
    steps are asynchronous by default (the host prepares step N+1 while the device runs step
    N), as transformers decides for its own graphs; pass ``use_async_batching=False`` to run
    them synchronously (under tensor parallelism that is the default). A plain
    ``model.generate()`` raises meanwhile; other models are untouched.

    Example::

        handle = enable_continuous_batching(model)
        outs = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=64))
        print(handle.stats)     # captures and replays per query bucket
        handle.disable()
    """
    check_model(model, _WHO)
    check_paged_window(model.config, _WHO)
    check_paged_heads(model, _WHO)
    check_sampled_tokens(model, _WHO)
    distributed.validate_timeout(tp_timeout, f"{_WHO}: tp_timeout")  # TP or not, as PrefillRunner
    with _lock:
        group = distributed.tensor_parallel_group(model, _WHO)
        ranks = None if group is None else distributed.RankGroup(group, timeout=tp_timeout)
        try:
            try:  # a rank that refuses tells the others (else they pair with its next call)
                options = _options(model, backend, attention, query_buckets, decode_graphs,
                                   compile, debug, tensor_parallel=group is not None)  # fmt: skip
            except BaseException:
                if ranks is not None:
                    ranks.report_failure()
                raise
            if ranks is not None:  # every rank enables the same way (or all raise)
                ranks.agree(
                    0,
                    distributed.fingerprint(repr(options)),
                    f"{_WHO} options",
                    f"call {_WHO} with the same arguments on every rank",
                )
            handle = ContinuousBatchingHandle(model, *options, ranks, decode_graphs=decode_graphs,
                                              compile=compile)  # fmt: skip
            handle._enable()
        except BaseException:
            if ranks is not None:
                ranks.close()
            raise
    return handle


def _options(model, backend, attention, query_buckets, decode_graphs, compile, debug,
             tensor_parallel: bool) -> tuple:  # fmt: skip
    """``enable_continuous_batching``'s checks: (backend, kernel, query buckets, debug)."""
    compat.require("continuous_batching", _WHO)
    parameter = next(model.parameters())
    chosen = select_backend(backend, _WHO).name
    kernel = _resolve_attention(attention, parameter.dtype, parameter.device, _WHO)
    if query_buckets is not None:
        from breakgraph.buckets import validate_buckets

        query_buckets = tuple(validate_buckets(query_buckets, f"{_WHO}: query_buckets"))
    if not isinstance(decode_graphs, bool):
        raise InputError(f"{_WHO}: decode_graphs must be True or False, got {decode_graphs!r}.")
    check_compile_option(compile, _WHO)
    debug = debug_enabled(debug, _WHO)  # resolved once: the per-step TP check reads it too
    if _handle_of(model) is not None:
        raise InputError(f"{_WHO}: continuous batching is already enabled for this model.")
    if compat.cached_manager(model) is not None:
        raise InputError(
            f"{_WHO}: the model holds a persistent CB manager created without breakgraph; "
            f"call model.destroy_cached_continuous_batching_manager() first."
        )
    key = compat.attention_key(model)
    if isinstance(key, str) and key.startswith("paged|"):  # 5.17: set by a live manager
        raise InputError(
            f"{_WHO}: a CB manager created without breakgraph is live on this model (its "
            f"attention implementation is {key!r}, and its stop() writes the one before "
            f"back, which would take breakgraph's out while enabled); stop it first (a "
            f"manager that never started restores nothing: start() it, then stop(block=True))."
        )
    if tensor_parallel and compile is not False:
        raise InputError(
            f"{_WHO}: compile is not supported under tensor parallelism (the ranks would "
            f"have to agree on every compile); leave it False."
        )
    return chosen, kernel, query_buckets, debug
