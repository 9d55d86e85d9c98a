"""``PrefillRunner``: graph-speed prefill of unmodified HuggingFace causal LMs.

Prompts of different lengths are packed into one token row (no padding between
prompts) with per-prompt ``position_ids``; the row is padded to a token bucket
whose tail is a dummy sequence. One breakable graph per bucket captures the whole
forward except attention, which runs as an eager break per layer with the exact
boundaries of the live batch (see :mod:`.attention`). Each prompt's last hidden
state is gathered on the device (``logits_to_keep`` with an index tensor), so the
graph produces ``[min(bucket, max_prompts), vocab]`` logits (a single-prompt graph
``[1, vocab]`` when not compiled), not ``[tokens, vocab]``.

The default bucket ladder is dense (:func:`default_token_buckets`: at most 7 tokens
or 12.5 % of padding), and cheap: the model is warmed up once, buckets are captured
largest first into one pool, and every bucket after the first releases the memory its
breaks read back to that pool (see :mod:`breakgraph.memory`), so the ladder costs
about as much graph memory as its largest bucket.

The host path of one prefill: the prompts' ids, positions, last-token indices and
sequence boundaries are written into one pinned host buffer, which the graph's first node
copies to the device buffer whose views are the buckets' static inputs (see
:mod:`.prefill_buffers`). No host sync, no copy issued by the host, one graph launch.

Example::

    >>> import torch, transformers
    >>> from breakgraph.integrations.transformers import PrefillRunner
    >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    >>> runner = PrefillRunner(model, token_buckets=(16, 32), max_prompts=4, backend="emulated")
    >>> out = runner.prefill([torch.randint(128, (5,)), torch.randint(128, (9,))])
    >>> out.logits.shape
    torch.Size([2, 128])
    >>> runner.close()
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

import breakgraph
from breakgraph import distributed
from breakgraph.buckets import (
    Action,
    expected_padding,
    validate_buckets,
    validate_count,
    validate_flag,
)
from breakgraph.debug import debug_enabled
from breakgraph.errors import InputError, ReplayError
from breakgraph.ladder_stats import combined
from breakgraph.memory import borrowed, weak_method
from breakgraph.runner import BucketedRunner

from . import attention as _attention
from . import compat
from .compiled import CompiledForward, check_compile_option
from .experts import PaddingRows, experts_for_prefill, needs_experts_break, padding_rows
from .models import (
    SUPPORTED_MODEL_TYPES,
    UnsupportedModelError,
    default_token_buckets,
    moved_error,
    resolve_attention,
    token_vocabulary,
    weights_anchor,
)
from .models import check_model as _check_model
from .prefill_buffers import StepBuffers, as_prompt_list, prompt_lengths
from .prefill_output import PrefillOutput
from .rope import StaticRope
from .tensor_parallel import graph_safe_tensor_parallel

__all__ = [
    "PrefillRunner",
    "PrefillOutput",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "default_token_buckets",
]


class PrefillRunner:
    """Prefill batches of variable-length prompts through captured breakable graphs.

    Args:
        model: a transformers causal LM (``SUPPORTED_MODEL_TYPES``, a ``*ForCausalLM``
            class) in eval mode.
        token_buckets: total-token sizes to capture; a batch pads to the smallest that
            fits. Default: :func:`default_token_buckets` up to 4096 tokens (or the
            model's ``max_position_embeddings``).
        max_prompts: most prompts in one batch. A graph's batch holds at most as many
            prompts as the largest bucket has tokens, so with ``on_miss="raise"`` a larger
            value costs nothing (the buffers hold that many).
        backend: ``"cuda"`` or ``"emulated"`` (see :func:`breakgraph.capture`).
        on_miss: ``"raise"`` (default) or ``"eager"`` when a batch has more tokens
            than the largest bucket (``"eager"`` runs the forward without a graph).
        attention: ``"auto"`` (FlashAttention varlen on CUDA in bf16/fp16, and for a
            batch of one prompt the causal SDPA call of HF's own attention; else the
            per-sequence reference), ``"flash"`` (the same) or ``"reference"``.
        pad_token_id: token id written into the bucket tail.
        warmup: eager runs of the forward before the first (largest) bucket is captured.
        compile: ``torch.compile`` the decoder's layers and other modules one by one
            (True, or a dict of ``torch.compile`` keyword arguments) so segments hold fused
            kernels; attention and MoE experts stay eager breaks (Dynamo breaks its graph
            there too). Every bucket is warmed up through the compiled forward, but each
            Dynamo frame compiles once, at the first (largest) bucket: the token dimension
            is dynamic from that first compile (``dynamic=True`` unless the dict sets
            ``dynamic``; ``dynamic=False`` compiles every bucket) and the others reuse it.
            See :mod:`.compiled`.
        debug: capture in debug mode (see :mod:`breakgraph.debug`): input checks on
            every replay, and ``runner.graph(bucket).report()`` gives each attention
            break's host time per replay. Slow; off by default (``$BREAKGRAPH_DEBUG``).
        progress: print a line per captured bucket to stderr (the ``breakgraph`` logger
            gets the same lines at INFO level).
        tp_collectives: for a tensor-parallel model (detected from its DTensor
            parameters; see ``docs/tensor-parallel.md``): ``"captured"`` records the
            row-parallel all-reduces inside the segments; ``"eager"`` runs each one as an
            eager break (SGLang's piecewise choice).
        tp_timeout: seconds a rank waits for the others (capture steps and the per-call
            agreement) before raising :class:`~breakgraph.RankFailedError`.
        tune_buckets: after capture, time every bucket and send each batch to the fastest
            bucket that holds it (:meth:`~breakgraph.runner.BucketedRunner.tune`: some
            padded sizes are slower than larger ones). Each bucket is timed with one prompt
            filling it, so with the single-prompt attention kernel. CUDA, one process only;
            its replays (one warm-up and one timed per bucket) are device time, 0.85 s of a
            22-layer 1B model's default ladder on an H200 (``tune_buckets=False`` skips them).
        single_prompt_graphs: also capture, per bucket, a graph with no break for a batch
            of ONE prompt: its attention is recorded in the graph (causal attention over the
            whole row is exact for a prompt that starts at row 0; see
            :meth:`~.attention.LayerAttention.whole_row`). One graph launch instead of one
            per layer: the per-layer host work of the breaks is gone, which matters most when
            the host is busy or its caches are cold (another model, a tokenizer, a scheduler
            between calls). Same pool, so about the same memory; capture takes longer (one
            more capture per bucket, without breaks). Default: on with the CUDA backend in one
            process, off on the emulated backend and under tensor parallelism (not allowed
            there). MoE experts that run transformers' eager loop stay breaks.

    Under tensor parallelism every rank must call ``prefill`` with the same prompts; each
    call agrees the bucket and checks the prompt lengths (and, in debug mode, the ids)
    across ranks in one small all-reduce, and returns full-vocabulary logits on every rank.

    The model is left as it was: the attention (and eager MoE experts) implementation is
    switched to breakgraph's only while capturing or running eagerly through the runner.
    One runner per model at a time (transformers selects attention per model).
    """

    def __init__(
        self,
        model: Any,
        token_buckets: Sequence[int] | None = None,
        max_prompts: int = 16,
        *,
        backend: str | None = None,
        on_miss: str = "raise",
        attention: str = "auto",
        pad_token_id: int = 0,
        warmup: int = 2,
        compile: Any = False,
        debug: bool | None = None,
        progress: bool = False,
        tp_collectives: str = "captured",
        tp_timeout: float = 300.0,
        tune_buckets: bool = True,
        single_prompt_graphs: bool | None = None,
    ):
        _check_model(model)
        if tp_collectives not in ("captured", "eager"):
            raise InputError(
                f"PrefillRunner: tp_collectives must be 'captured' or 'eager', got "
                f"{tp_collectives!r}."
            )
        if single_prompt_graphs is not None and not isinstance(single_prompt_graphs, bool):
            raise InputError(
                f"PrefillRunner: single_prompt_graphs must be None (the default: on with the "
                f"CUDA backend in one process), True or False, got {single_prompt_graphs!r}."
            )
        check_compile_option(compile, "PrefillRunner")
        if on_miss not in ("raise", "eager"):  # checked here: the ladder would name itself
            raise InputError(f"PrefillRunner: on_miss must be 'raise' or 'eager', got {on_miss!r}.")
        validate_flag(progress, "PrefillRunner: progress")
        validate_flag(tune_buckets, "PrefillRunner: tune_buckets")
        distributed.validate_timeout(tp_timeout, "PrefillRunner: tp_timeout")  # TP or not
        max_prompts = validate_count(max_prompts, 1, "PrefillRunner: max_prompts")  # plain ints
        warmup = validate_count(warmup, 0, "PrefillRunner: warmup")
        limit = getattr(model.config, "max_position_embeddings", None)
        if token_buckets is None:
            token_buckets = default_token_buckets(min(4096, limit or 4096))
        token_buckets = validate_buckets(token_buckets, "PrefillRunner: token_buckets")
        self._token_buckets = tuple(token_buckets)  # sorted by validate_buckets
        longest = token_buckets[-1]
        if limit is not None and longest > limit:
            raise UnsupportedModelError(
                f"PrefillRunner: bucket {longest} exceeds max_position_embeddings={limit}."
            )
        parameter = next(model.parameters())
        self.model = model
        self.device, self.dtype = parameter.device, parameter.dtype
        self._device_type = self.device.type  # read per call (see _no_autocast)
        backend_name = breakgraph.backends.select_backend(backend, "PrefillRunner").name
        self.attention = resolve_attention(
            attention, self.dtype, self.device, "PrefillRunner", backend=backend_name
        )
        self.max_prompts = max_prompts
        self.vocab_size = token_vocabulary(model)  # the ids its embedding holds
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, numbers.Integral) or not (
            0 <= pad_token_id < self.vocab_size
        ):
            raise InputError(
                f"PrefillRunner: pad_token_id must be a token id of the vocabulary "
                f"(an int in 0..{self.vocab_size - 1}), got {pad_token_id!r}; a model without a "
                f"pad token (config.pad_token_id None) can keep the default, 0."
            )
        compiled = compile is not False  # True or a dict (an empty one: torch's defaults)
        self._forward_model = model  # compiled below, once nothing but a capture can fail
        moe = hasattr(model.config, "output_router_logits")  # no router logits for MoE models
        self._extra = {"output_router_logits": False} if moe else {}  # (their aux loss syncs)
        self._borrow = backend_name == "cuda"
        # a graph's batch holds at most `longest` prompts; with on_miss="raise" no other batch
        # runs, and room for more costs time and memory for nothing (10**6: 4.6 s, 600 MB)
        capacity = max_prompts if on_miss == "eager" else min(max_prompts, longest)
        self._steps = StepBuffers(
            longest, capacity, self.device, pad_token_id, marks_in_graph=backend_name == "cuda"
        )
        # grouped_mm experts skip a bucket's padding rows (see .experts); not under
        # torch.compile, which would trace the mask's context variable, nor where grouped_mm
        # cannot be captured (the eager loop runs as breaks then: needs_experts_break)
        grouped = compat.experts_key(model) == "grouped_mm" and not needs_experts_break(model)
        self._skip_padding = not compiled and grouped
        self._row_ids = torch.arange(longest, device=self.device) if self._skip_padding else None
        self._single_head_rows = not compiled  # compiled, a size of 1 compiles a frame again
        self._outputs: dict = {}  # layer -> shared attention output buffer (all buckets)
        # (bucket, single prompt?) -> [(layer, key, value)] seen at capture
        self._layers: dict = {}
        self._step = 0
        self._one_prompt_batches: dict = {}  # (tokens, bucket) -> its PackedBatch
        self._closed = False
        self._lock = threading.Lock()  # held by a prefill, cache(i) and close()
        self._weights = weights_anchor(model)  # the weights' memory the graphs read
        # dynamic/longrope RoPE held static (its original frequencies, copied once: the
        # graphs read them for life); a longer prompt is refused per call (_validate)
        self._rope = StaticRope(model, self.device)  # .limit None: every length is served
        self._single: BucketedRunner | None = None  # single-prompt graphs (built below)
        # tensor parallelism: the ranks agree every capture step and every call
        self.tp_collectives = tp_collectives
        self._check_ids = debug_enabled(debug, "PrefillRunner")
        group = distributed.tensor_parallel_group(model, "PrefillRunner")
        self.ranks = None if group is None else distributed.RankGroup(group, timeout=tp_timeout)
        if self.ranks is not None:
            try:  # before any collective: the settings decide their sizes and number
                self.ranks.agree_settings("PrefillRunner", {
                    "token_buckets": token_buckets, "max_prompts": max_prompts,
                    "warmup": warmup, "pad_token_id": pad_token_id, "on_miss": on_miss,
                    "attention": self.attention, "tp_collectives": tp_collectives,
                    "compile": compiled, "debug": self._check_ids, "backend": backend_name,
                    "model dtype": self.dtype,  # None is off under TP, as False: the same
                    "single_prompt_graphs": single_prompt_graphs is True,
                })  # fmt: skip
                self.ranks.check_graph_mixing(tp_collectives == "eager",
                                              "PrefillRunner(tp_collectives='eager')")
            except BaseException:  # no one gets a runner whose constructor raised to close
                self.ranks.close()
                raise
        if single_prompt_graphs is None:
            single_prompt_graphs = backend_name == "cuda" and self.ranks is None
        if single_prompt_graphs and self.ranks is not None:
            self.ranks.close()
            raise InputError(
                "PrefillRunner: single_prompt_graphs=True is not supported under tensor "
                "parallelism; leave it at None (off there)."
            )
        _attention.register()
        # the runners hold this one's methods weakly: bound, they would make a reference cycle
        # (self -> runner -> method -> self) that keeps a dropped runner's graphs and their
        # pool memory until Python's cyclic collector runs (see breakgraph.memory)
        forward, capture_batch = weak_method(self._forward), weak_method(self._capture_batch)
        try:
            if compiled:  # dynamic tokens (see .compiled); off the model in close()/_abandon()
                self._forward_model = CompiledForward(model, compile, backend_name)
            self._runner = BucketedRunner(
                forward,
                token_buckets,
                static_inputs=self._steps,
                on_miss=on_miss,
                ranks=self.ranks,
                slice_outputs=False,
                warmup=warmup,
                warmup_each=compiled,
                backend=backend,
                capture_context=capture_batch,
                debug=debug,
                progress=progress,
            )
            if single_prompt_graphs:  # same buckets, same inputs, the same pool (on the
                # emulated backend too, whose pools count their graphs as torch does: the CPU
                # tests check the sharing); after the packed ladder, whose capture built every
                # bucket's attention plan outside a capture
                self._single = BucketedRunner(
                    functools.partial(forward, inline=True),
                    token_buckets,
                    static_inputs=self._steps,
                    on_miss=on_miss,
                    slice_outputs=False,
                    warmup=1,
                    backend=backend,
                    pool=self._runner.graph(token_buckets[-1]).pool(),
                    capture_context=capture_batch,
                    debug=debug,
                    progress=progress,
                )
            if tune_buckets and self.ranks is None:
                self._runner.tune()
        except BaseException:  # no one gets this runner to close: nothing is left half-built
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Undo a failed constructor: graphs (pool memory), torch.compile's mark on the model
        (it must end as it was), the rank group's gloo group."""
        for runner in (getattr(self, "_runner", None), self._single):
            if runner is not None:
                runner.close()
        if isinstance(self._forward_model, CompiledForward):
            self._forward_model.close()
        if self.ranks is not None:
            if self.ranks.keeps_memory:  # a failed NCCL step: its graphs stay until exit, with
                # what they read; the ladder keeps the runner's methods, which hold this one
                # only weakly, so its buffers and model are kept here
                self.ranks.keep_until_exit(self)
            self.ranks.close()

    # -- the captured forward ------------------------------------------------------------
    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        last_index: torch.Tensor | None = None,  # only an eager batch's (StepBuffers.wide_inputs)
        inline: bool = False,
    ) -> torch.Tensor:
        state = _attention.RunnerState(self.attention, self._outputs, inline=inline)
        capturing = breakgraph.is_capturing()
        collectives = (
            distributed.all_reduce_as_breaks()
            if self.tp_collectives == "eager"
            else contextlib.nullcontext()
        )
        self._steps.upload()  # in a graph: its first node (the host only writes the buffer)
        if last_index is not None:  # an eager batch longer than the buffer (its wide_inputs)
            last_index.copy_(self._steps.last_index)
        padding = None  # grouped_mm experts: which rows are padding (see .experts)
        if self._skip_padding:
            padding = self._padding_rows(input_ids.shape[1])
        with (
            self.installed(),
            padding_rows(padding),
            _attention.running(state),
            collectives,
            torch.no_grad(),
            self._no_autocast(),
        ):
            logits = self._forward_model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,  # a bucket of n rows holds at most n prompts: n LM-head rows
                logits_to_keep=(self._steps.last_index if last_index is None else last_index)[
                    : 1 if inline and self._single_head_rows else input_ids.shape[1]  # single: 1
                ],
                **self._extra,
            ).logits
        if not capturing:
            return logits
        if self._borrow:  # this bucket's memory goes back to the pool for the next capture
            for call in state.calls:
                call.borrow()
            state.layers[:] = [(i, borrowed(k), borrowed(v)) for i, k, v in state.layers]
            logits = borrowed(logits)
        self._layers[input_ids.shape[1], inline] = state.layers
        return logits

    def _padding_rows(self, rows: int) -> PaddingRows | None:
        """The padding rows of a forward over ``rows`` (a bucket): a call pads to it from any
        length above the next smaller bucket, half that gap on average. None for an eager batch
        longer than every bucket (no padding)."""
        if rows > self._row_ids.shape[0]:
            return None
        return PaddingRows(self._row_ids[:rows], self._steps.last_index, self._padding_of(rows))

    def _padding_of(self, bucket: int) -> float:
        """How many padding rows a call of ``bucket`` has on average (its ladder's gap)."""
        return expected_padding(self._token_buckets, bucket)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Switch the model to breakgraph attention (and MoE experts, through transformers'
        ``ExpertsInterface``: the eager loop to eager breaks, ``grouped_mm`` to its version
        that skips padding rows, see :mod:`.experts`; a vocab-parallel embedding to its
        graph-safe lookup, see :mod:`.tensor_parallel`; dynamic and longrope RoPE to static,
        see :mod:`.rope`) for the block, then back; one runner's block per model at a time
        (:func:`.attention.switched`)."""
        with (
            _attention.switched(self.model),
            self._rope.held(),
            experts_for_prefill(self.model, self._skip_padding),
            graph_safe_tensor_parallel(self.model),
        ):
            yield

    def _capture_batch(self, size: int) -> _attention.PackedBatch:
        """During capture of a bucket and before its timed replays (:meth:`tune`): one prompt
        of random ids filling it (:meth:`StepBuffers.stage_capture`). One prompt: the
        single-prompt kernel's plan (cuDNN) is built at capture, not at first use."""
        return self._steps.packed_batch(self._steps.stage_capture(size, self.vocab_size), 1)

    # -- serving ---------------------------------------------------------------------------
    @property
    def buckets(self) -> tuple:
        return self._runner.buckets

    @property
    def stats(self):
        """The counters (:class:`~breakgraph.ladder.LadderStats`) of the graph ladder under the
        :class:`~breakgraph.runner.BucketedRunner` this runner composes, its single-prompt
        graphs' counted in (:func:`~breakgraph.ladder_stats.combined`)."""
        if self._single is None:
            return self._runner.stats
        return combined(self._runner.stats, self._single.stats)

    def graph(self, bucket: int, *, single_prompt: bool = False) -> breakgraph.BreakableCUDAGraph:
        """The breakable graph of ``bucket``: ``print(runner.graph(64).report())`` shows its
        segments and attention breaks (with host time per break when ``debug=True``);
        ``single_prompt=True``: the bucket's graph for one prompt (no attention break)."""
        if self._closed:  # checked here: the ladder's errors would name the ladder
            raise ReplayError("PrefillRunner.graph: the runner is closed; build a new one.")
        if not isinstance(bucket, numbers.Integral) or bucket not in self._token_buckets:
            raise InputError(f"PrefillRunner.graph: no bucket {bucket!r}; buckets: "  # tensor(16)
                             f"{self._token_buckets}.")  # fmt: skip
        bucket = int(bucket)
        if validate_flag(single_prompt, "PrefillRunner.graph: single_prompt"):
            if self._single is None:
                raise InputError(
                    "PrefillRunner.graph: this runner has no single-prompt graphs "
                    "(single_prompt_graphs was off)."
                )
            return self._single.graph(bucket)
        return self._runner.graph(bucket)

    def graphs(self) -> dict[tuple[int, bool], breakgraph.BreakableCUDAGraph]:
        """Every graph a call may replay, keyed ``(bucket, single_prompt)``: each bucket's packed
        graph and, with single-prompt graphs, its single-prompt one (for tools that wrap or
        inspect replays, e.g. ``benchmarks/prefill_host_path.py``).

        Example::

            for (bucket, single), g in runner.graphs().items():
                print(bucket, single, g.num_breaks)
        """
        graphs = {(b, False): self._runner.graph(b) for b in self.buckets}
        if self._single is not None:
            graphs.update({(b, True): self._single.graph(b) for b in self.buckets})
        return graphs

    def prefill(self, prompts: Iterable[torch.Tensor], *, owned: bool = True) -> PrefillOutput:
        """Prefill ``prompts`` (1-D LongTensors) together; see :class:`PrefillOutput`.

        ``owned=False`` returns logits that live in graph memory (no copy), valid until the
        next prefill. One call at a time: a call from another thread waits (the buckets share
        the staging buffers and the K/V that ``cache(i)`` reads).
        """
        with self._lock:
            if self._closed:
                raise ReplayError(
                    "PrefillRunner.prefill: the runner is closed; build a new PrefillRunner."
                )
            if torch.is_autocast_enabled(self._device_type):  # 0.2 us (device.type: 0.4 more)
                with self._no_autocast():
                    return self._prefill(prompts, owned)
            return self._prefill(prompts, owned)

    def _no_autocast(self) -> torch.autocast:
        """Autocast off: the graphs compute in the model's dtype (a replay, like a CUDA graph's,
        ignores the caller's autocast), so the eager parts must too: the attention breaks, the
        eager fallback, the warm-ups and captures. Under ``torch.autocast`` the breaks ran in
        half precision inside fp32 graphs, the eager fallback returned bf16 logits where the
        graphs return fp32, and a runner built under autocast captured half-precision segments.
        Load the model in bf16 or fp16 to run the graphs in it."""
        return torch.autocast(self._device_type, enabled=False)

    def _prefill(self, prompts: Iterable[torch.Tensor], owned: bool) -> PrefillOutput:
        """:meth:`prefill`, under the lock, on a runner that is not closed."""
        steps = self._steps
        # under TP any failure before the agreement (the prompts' iterator raising, say) fails the
        # peers too: a rank that raised unseen paired their calls with its next ones, off by one
        try:
            weights, name, address = self._weights  # see models.weights_anchor
            if weights[name].data_ptr() != address:
                raise moved_error(self.model, self.dtype, self.device, "PrefillRunner.prefill")
            if owned is not True and owned is not False:
                raise InputError(
                    f"PrefillRunner.prefill: owned must be True or False, got {owned!r}."
                )
            if not isinstance(prompts, list):
                prompts = as_prompt_list(prompts)
            lengths = self._validate(prompts)
            staged = steps.write_ids(prompts, lengths, self.vocab_size)
            same_on_all_ranks = 0
            if self.ranks is not None:  # lengths always (free); ids in debug mode (a host copy)
                same_on_all_ranks = distributed.fingerprint(
                    lengths, *(prompts if self._check_ids else ())
                )
        except BaseException:
            if self.ranks is not None:
                self.ranks.report_failure()  # the other ranks raise instead of waiting
            raise
        total = sum(lengths)
        decision = self._runner.decide(total, same_on_all_ranks)
        action = decision.action
        if action is Action.RAISE:
            raise InputError(
                f"PrefillRunner.prefill: {total} tokens exceed the largest token bucket "
                f"{self.buckets[-1]}; build the runner with larger token_buckets, split the "
                f"batch, or pass on_miss='eager' to run such batches without a graph."
            )
        self._step += 1  # outputs of earlier prefills are invalid from here on, even on failure
        n = len(lengths)
        try:
            if action is Action.EAGER:
                logits, bounds = self._prefill_eagerly(prompts, lengths, staged, decision.reason)
                graph = None
            else:
                bucket = decision.bucket
                bounds = steps.commit(prompts, lengths, bucket)
                single = n == 1 and self._single is not None
                if n == 1:  # the common case: one batch description per (length, bucket)
                    batch = self._one_prompt_batches.get((total, bucket))
                    if batch is None:
                        batch = steps.packed_batch(bounds, 1)
                        self._one_prompt_batches[total, bucket] = batch
                else:
                    batch = steps.packed_batch(bounds, n)
                runner = self._single if single else self._runner  # the ladder's decision
                try:
                    logits = runner.replay(bucket, batch, total)[0, :n]
                finally:  # what was launched reads the staging buffer, even if a break raised
                    steps.launched()
                graph = (bucket, single)
        except BaseException as exc:  # under TP the others may wait in a collective: see there
            if self.ranks is not None:
                self.ranks.failed_mid_call(exc, "PrefillRunner.prefill")
            raise
        return PrefillOutput(self, logits.clone() if owned else logits, bounds[:n], self._step,
                             graph, owned)  # fmt: skip

    def _prefill_eagerly(self, prompts: list, lengths: list, staged: bool, reason: str) -> tuple:
        """A batch no bucket serves: the same forward, without a graph."""
        total = sum(lengths)
        if staged:
            bounds = self._steps.commit(prompts, lengths, total)
            inputs = self._steps.allocate(total)
        else:  # its own ids and positions; the boundaries still go through the step buffers
            inputs = self._steps.wide_inputs(prompts, lengths)
            bounds = self._steps.commit_boundaries(lengths)
        batch = self._steps.packed_batch(bounds, len(lengths))
        try:
            logits = self._runner.run_eagerly(inputs, batch, reason)
        finally:
            self._steps.launched()
        return logits[0, : len(lengths)], bounds

    def _validate(self, prompts: list) -> list[int]:
        """The prompts' lengths, or ``InputError`` (:func:`.prefill_buffers.prompt_lengths`); a
        method of its own, which the host-path benchmarks time (``benchmarks/prefill_host_*``)."""
        lengths = prompt_lengths(prompts, self.max_prompts)
        limit = self._rope.limit
        if limit is not None and max(lengths) > limit:  # see .rope
            raise self._rope.too_long(lengths)
        return lengths

    def close(self) -> None:
        """Release graphs and buffers; the model is exactly as before. Outputs of earlier
        prefills keep their logits; their ``cache(i)`` raises. Waits for a prefill running on
        another thread."""
        with self._lock:
            self._closed = True
            self._runner.close()
            if self._single is not None:
                self._single.close()
            if isinstance(self._forward_model, CompiledForward):
                self._forward_model.close()  # torch.compile's mark off the model
            self._layers.clear()
            self._outputs.clear()
            if self.ranks is not None:
                self.ranks.close()
