"""Continuous batching of HF causal LMs under breakable graphs: ``enable_continuous_batching``.

transformers 5.17's continuous batching (``model.generate_batch``, the
``init_continuous_batching`` manager, ``transformers serve --continuous-batching``)
serves streams of requests whose steps mix prefill chunks and decode tokens.
While enabled, each step of a model runs as one breakable graph per *query-token
bucket*: everything is captured (embeddings, projections, MLPs/MoE, norms, RoPE,
lm_head, logits processing, sampling) except each layer's paged-cache access and
varlen attention, which runs as an eager break with the live step's exact
lengths. No KV-size graph keys, no upper-bound kernels, no ``flash_attn``.

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
    >>> handle.stats.replays > 0
    True

It hooks in through ``AttentionInterface["paged|breakgraph"]``,
``ExpertsInterface[EXPERTS_KEY]`` (transformers' eager experts loop as an eager
break; ``grouped_mm``/``batched_mm`` experts stay captured), the model's
``set_attn_implementation`` / ``set_experts_implementation``, and three scoped patches
of transformers' CB internals, unavoidable in 5.17 and removed with the last handle
(see :mod:`.cb_hooks`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from breakgraph import distributed
from breakgraph.backends import select_backend
from breakgraph.debug import debug_enabled
from breakgraph.errors import InputError

from . import attention as _attention
from . import cb_hooks
from .cb_attention import CB_ATTENTION_KEY
from .experts import EXPERTS_KEY, needs_experts_break
from .prefill import UnsupportedModelError, _check_model

__all__ = [
    "enable_continuous_batching",
    "ContinuousBatchingHandle",
    "ContinuousBatchingStats",
    "BucketStats",
    "CB_ATTENTION_KEY",
]

_WHO = "enable_continuous_batching"


# -- statistics ----------------------------------------------------------------------------
@dataclass
class BucketStats:
    """Counters of one query-token bucket."""

    captures: int = 0
    replays: int = 0  # graph steps
    eager_steps: int = 0  # steps that ran eagerly (graphs off)
    capture_s: float = 0.0  # warm-up + capture, seconds
    breaks: int = 0  # eager breaks in the bucket's graph (attention layers + eager experts)


class ContinuousBatchingStats:
    """Per-bucket counters of every runner of a handle; ``str()`` prints a table.

    Example::

        >>> stats = ContinuousBatchingStats()
        >>> stats._record(64, captures=1, capture_s=0.25, breaks=22)
        >>> stats._record(64, replays=9)
        >>> (stats.captures, stats.replays, stats.eager_steps)
        (1, 9, 0)
        >>> print(stats)
        bucket  captures  replays  eager steps  capture s  breaks
            64         1        9            0       0.25      22
         total         1        9            0       0.25
    """

    def __init__(self) -> None:
        self.buckets: dict[int, BucketStats] = {}

    def _record(
        self,
        bucket: int,
        captures: int = 0,
        replays: int = 0,
        eager_steps: int = 0,
        capture_s: float = 0.0,
        breaks: int | None = None,
    ) -> None:
        entry = self.buckets.get(bucket)
        if entry is None:
            entry = self.buckets[bucket] = BucketStats()
        entry.captures += captures
        entry.replays += replays
        entry.eager_steps += eager_steps
        entry.capture_s += capture_s
        if breaks is not None:
            entry.breaks = breaks

    @property
    def captures(self) -> int:
        return sum(b.captures for b in self.buckets.values())

    @property
    def replays(self) -> int:
        return sum(b.replays for b in self.buckets.values())

    @property
    def eager_steps(self) -> int:
        return sum(b.eager_steps for b in self.buckets.values())

    @property
    def capture_s(self) -> float:
        return sum(b.capture_s for b in self.buckets.values())

    def __str__(self) -> str:
        rows = [("bucket", "captures", "replays", "eager steps", "capture s", "breaks")]
        for bucket, b in sorted(self.buckets.items()):
            rows.append(
                (bucket, b.captures, b.replays, b.eager_steps, f"{b.capture_s:.2f}", b.breaks)
            )
        total = (self.captures, self.replays, self.eager_steps, f"{self.capture_s:.2f}", "")
        rows.append(("total", *total))
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
        lines = ("  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in rows)
        return "\n".join(line.rstrip() for line in lines)

    def __repr__(self) -> str:
        return (
            f"ContinuousBatchingStats(captures={self.captures}, replays={self.replays}, "
            f"eager_steps={self.eager_steps}, buckets={sorted(self.buckets)})"
        )


# -- the handle ----------------------------------------------------------------------------
class ContinuousBatchingHandle:
    """What :func:`enable_continuous_batching` returns: stats, runners, ``disable()``.

    Also a context manager: leaving the ``with`` block disables it.
    """

    def __init__(self, model, backend, kernel, query_buckets, debug, ranks=None) -> None:
        self.model = model
        self.config = model.config.get_text_config()
        self.device = next(model.parameters()).device
        self.backend = backend
        self.kernel = kernel
        self.query_buckets = query_buckets
        self.debug = debug
        self.ranks = ranks  # a RankGroup under tensor parallelism, else None
        self.stats = ContinuousBatchingStats()
        self.enabled = False
        self._runners: weakref.WeakSet = weakref.WeakSet()
        self._choices: dict[int, tuple] = {}  # id(resolved CB config) -> (weakref, use_graphs)
        self._previous_attn = model.config._attn_implementation
        self._previous_experts = None

    @property
    def runners(self) -> list:
        """The live :class:`~.cb_runner.BreakgraphModelRunner` objects (one per CB manager)."""
        return list(self._runners)

    def disable(self) -> None:
        """Restore the model and transformers exactly as before (idempotent).

        A persistent CB manager created while enabled is destroyed (its graphs and KV
        cache belong to this handle); a manager whose generation loop is still running
        must be stopped first (``InputError``).
        """
        with cb_hooks.lock:
            if not self.enabled:
                return
            manager = getattr(self.model, "_cached_continuous_batching_manager", None)
            running = manager is not None and manager.is_running()
            if running or any(runner.in_use for runner in self._runners):
                raise InputError(
                    "ContinuousBatchingHandle.disable: a continuous-batching manager of this model "
                    "is still running; call manager.stop() first."
                )
            for runner in list(self._runners):
                runner.close()
            if manager is not None:
                self.model.destroy_cached_continuous_batching_manager()
            self.model.set_attn_implementation(self._previous_attn)
            if self._previous_experts is not None:
                self.model.set_experts_implementation(self._previous_experts)
            self._choices.clear()
            self.enabled = False
            cb_hooks.unregister(self)
            if self.ranks is not None:
                self.ranks.close()

    def __enter__(self) -> ContinuousBatchingHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.disable()

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return (
            f"ContinuousBatchingHandle({type(self.model).__name__}, {state}, "
            f"backend={self.backend!r}, attention={self.kernel!r}, {self.stats!r})"
        )

    # -- used by the patches ------------------------------------------------------------------
    def _use_graphs(self, cb_config) -> bool:
        """Read the caller's ``ContinuousBatchingConfig`` before transformers resolves it."""
        if cb_config.use_async_batching and self.device.type != "cuda":
            raise UnsupportedModelError(
                f"{_WHO}: asynchronous batching (use_async_batching=True) needs a CUDA model "
                f"(transformers overlaps host and device work with CUDA streams); leave it "
                f"unset or False here."
            )
        choice = cb_config.use_cuda_graph
        if choice is None:
            return True
        if isinstance(choice, bool):
            return choice
        if isinstance(choice, (tuple, list)) and len(choice) == 2:
            return bool(choice[0])  # (varlen, decode): every step here is a varlen step
        raise InputError(
            f"{_WHO}: ContinuousBatchingConfig.use_cuda_graph must be None, a bool or a "
            f"(varlen, decode) pair, got {choice!r}."
        )

    def _async_by_default(self, use_graphs: bool) -> bool:
        """``use_async_batching`` when the caller left it unset: transformers' own rule for its
        graphs (on with CUDA graphs and no attention mask), applied to breakgraph's graphs.
        Under tensor parallelism it stays off (not run on GPUs there yet)."""
        return use_graphs and self.device.type == "cuda" and self.ranks is None

    def _remember(self, resolved, use_graphs: bool) -> None:
        compiled = resolved.varlen_compile_config or resolved.decode_compile_config
        if use_graphs and compiled is not None:
            raise UnsupportedModelError(
                f"{_WHO}: torch.compile of the CB step (compile configs) cannot be combined with "
                f"breakgraph's graphs; pass ContinuousBatchingConfig(use_cuda_graph=False) to "
                f"compile instead."
            )
        alive = {key: entry for key, entry in self._choices.items() if entry[0]() is not None}
        alive[id(resolved)] = (weakref.ref(resolved), use_graphs)
        self._choices = alive  # one entry per live manager config

    def _new_runner(self, cb_config, **kwargs):
        from .cb_runner import BreakgraphModelRunner

        ref, use_graphs = self._choices.get(id(cb_config), (None, None))
        if ref is None or ref() is not cb_config:
            raise UnsupportedModelError(
                f"{_WHO}: this continuous-batching manager was configured before "
                f"enable_continuous_batching(); create a new one (destroy a persistent manager "
                f"with model.destroy_cached_continuous_batching_manager())."
            )
        if self.ranks is not None and any(runner.in_use for runner in self._runners):
            raise UnsupportedModelError(
                f"{_WHO}: under tensor parallelism one continuous-batching manager of a model "
                f"runs at a time (its steps agree over one group); stop the other one first."
            )
        runner = BreakgraphModelRunner(
            handle=self, use_graphs=use_graphs, cb_config=cb_config, **kwargs
        )
        self._runners.add(runner)
        return runner


def enable_continuous_batching(
    model: Any,
    backend: str | None = None,
    *,
    attention: str = "auto",
    query_buckets: tuple[int, ...] | None = None,
    debug: bool | None = None,
    tp_timeout: float = 300.0,
) -> ContinuousBatchingHandle:
    """Run the model's continuous-batching steps as breakable graphs, one per query bucket.

    Args:
        model: a transformers causal LM of a supported family (dense: llama, qwen2,
            qwen3, mistral, gemma; MoE: qwen3_moe, mixtral) in eval mode.
        backend: ``"cuda"`` or ``"emulated"`` (CPU), as for :func:`breakgraph.capture`.
        attention: ``"auto"`` (FlashAttention varlen inside ATen on CUDA in bf16/fp16,
            else the exact per-sequence reference), ``"flash"`` or ``"reference"``.
        query_buckets: query-token counts to capture (default: 32, 128, 512, ...);
            the CB config's ``max_batch_tokens`` is always the largest bucket.
        debug: capture graphs in breakgraph's debug mode (slow; see ``docs/debugging.md``).
            Under tensor parallelism it also checks, on every step, that all ranks
            scheduled the same requests with the same lengths.
        tp_timeout: tensor parallelism only (detected from the model's DTensor
            parameters): seconds a rank waits for the others in a capture or in the
            per-step agreement before raising :class:`~breakgraph.RankFailedError`.
            Every rank must call this function, in the same order as its other
            process-group creations (it creates a gloo group).

    Returns a :class:`ContinuousBatchingHandle` (also a context manager). While it is
    enabled, CB managers of this model created afterwards (``generate_batch``,
    ``init_continuous_batching``) run their steps as breakable graphs, unless their
    ``ContinuousBatchingConfig`` says ``use_cuda_graph=False`` (eager steps through
    the same attention). On a CUDA model their steps are asynchronous by default
    (``use_async_batching`` unset: the host prepares step N+1 while the device runs step
    N, both IO pairs sharing one graph per bucket), as transformers decides for its own
    graphs; pass ``use_async_batching=False`` to run them synchronously (under tensor
    parallelism that is the default). The model's attention implementation is
    ``"paged|breakgraph"`` until ``disable()``; a plain ``model.generate()`` raises
    meanwhile.

    Example::

        handle = enable_continuous_batching(model)
        outs = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=64))
        print(handle.stats)     # captures, replays and eager steps per query bucket
        handle.disable()
    """
    _check_model(model, _WHO)
    if attention not in ("auto", "flash", "reference"):
        raise InputError(
            f"{_WHO}: attention must be 'auto', 'flash' or 'reference', got {attention!r}."
        )
    parameter = next(model.parameters())
    can_flash = _attention.flash_available(parameter.dtype, parameter.device)
    if attention == "flash" and not can_flash:
        raise UnsupportedModelError(
            f"{_WHO}: attention='flash' needs a CUDA model in bf16/fp16 and torch's "
            f"FlashAttention varlen kernel; use attention='reference'."
        )
    cb_hooks.check_transformers(_WHO)
    debug = debug_enabled(debug)  # resolved once: the per-step TP check reads it too
    chosen = select_backend(backend).name
    kernel = "flash" if attention == "flash" or (attention == "auto" and can_flash) else "reference"
    with cb_hooks.lock:
        if cb_hooks.handle_for(model.config.get_text_config()) is not None:
            raise InputError(f"{_WHO}: continuous batching is already enabled for this model.")
        if getattr(model, "_cached_continuous_batching_manager", None) is not None:
            raise InputError(
                f"{_WHO}: the model holds a persistent CB manager created without breakgraph; "
                f"call model.destroy_cached_continuous_batching_manager() first."
            )
        group = distributed.tensor_parallel_group(model)
        ranks = None if group is None else distributed.RankGroup(group, timeout=tp_timeout)
        handle = None
        try:
            if ranks is not None:  # every rank enables the same way (or all raise)
                buckets = None if query_buckets is None else sorted({int(b) for b in query_buckets})
                ranks.agree(
                    0,
                    distributed.fingerprint(repr((chosen, kernel, buckets, debug))),
                    f"{_WHO} options",
                    f"call {_WHO} with the same arguments on every rank",
                )
            handle = ContinuousBatchingHandle(model, chosen, kernel, query_buckets, debug, ranks)
            cb_hooks.register(handle)  # installs the hooks with the first handle
            if needs_experts_break(model):
                handle._previous_experts = model.get_experts_implementation()
                model.set_experts_implementation(EXPERTS_KEY)
            model.set_attn_implementation(CB_ATTENTION_KEY)
        except BaseException:
            if handle is not None:
                if handle._previous_experts is not None:
                    model.set_experts_implementation(handle._previous_experts)
                cb_hooks.unregister(handle)
            if ranks is not None:
                ranks.close()
            raise
        handle.enabled = True
    return handle
