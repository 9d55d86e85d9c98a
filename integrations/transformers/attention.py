"""The attention function that turns every attention call of a HF model into an eager break.

It is registered in transformers' ``AttentionInterface`` under the plain key
``"breakgraph"`` and nowhere else: ``create_causal_mask`` then returns ``None``
before any data-dependent mask code runs, so nothing in transformers does host
work inside the captured segments. Everything around attention (embeddings,
norms, projections, RoPE, MLPs, lm_head) is captured; the attention itself runs
eagerly on every replay with the *exact* metadata of the live batch (sequence
boundaries, maximum length), read from :func:`breakgraph.replay_context`.

Kernels: on CUDA in bf16/fp16, a batch of one prompt runs
``scaled_dot_product_attention`` with ``is_causal`` over the whole bucket, the very
call HF's own ``sdpa`` attention makes (cuDNN's Hopper kernel on an H200: 2-3x faster
than the varlen kernel at a few hundred tokens; the padding rows come after the prompt,
so causality keeps them out of its rows); several packed prompts run FlashAttention-2's
varlen kernel inside ATen (what ``torch.nn.attention.varlen.varlen_attn`` calls; no
``flash_attn`` package). Otherwise (CPU, fp32) a per-sequence
``scaled_dot_product_attention`` reference, exact to the model's own attention.

The break of each layer is a small callable built once at capture with its views
of the capture-time ``q``/``k``/``v`` prepared, so a replay pays one kernel launch
and one copy per layer. Its output is a view of one buffer per layer shared by all
buckets (they never run at the same time), so a dense bucket ladder does not hold
one attention output per bucket.

The runner's state reaches the attention function through a ``ContextVar`` set for
the length of one forward (capture, warm-up or eager fallback) and reset by token:
it is per thread and per task, and nested runners restore each other's state.
Transformers selects the attention implementation per model, so one model serves one
runner at a time.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import breakgraph
from breakgraph.memory import borrowed

from .errors import UnsupportedModelError

ATTENTION_KEY = "breakgraph"

_flash = getattr(torch.ops.aten, "_flash_attention_forward", None)
_flash = getattr(_flash, "default", None)
_FLASH_HAS_WINDOW = _flash is not None and "window_size_left" in str(_flash._schema)
# torch >= 2.12 (the op behind varlen_attn_out): writes into a given output, so the break
# returns the very tensor the graph reads and copy-back costs nothing
_flash_into = getattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace", None)
_flash_into = getattr(_flash_into, "default", None)
FLASH_WRITES_IN_PLACE = _flash_into is not None
if FLASH_WRITES_IN_PLACE:  # the same op through its Python binding: a C function, where the
    # OpOverload adds ~1.5 us of Python per call, once per layer on every replay
    _flash_into = getattr(torch, "_flash_attention_forward_no_dropout_inplace", _flash_into)


@dataclass
class PackedBatch:
    """Host description of one packed batch: what the eager attention reads on every replay.

    ``bounds`` are ``(start, end)`` token ranges of each sequence in the packed
    row, the padding tail included as a last dummy sequence so every row is
    written; ``cu_seqlens`` holds the same boundaries on the device (int32) and
    ``max_seqlen`` the longest sequence. ``one_prompt``: the row holds one prompt
    from row 0 (and maybe a padding tail), so causal attention over the whole row
    is exact for the prompt's rows. ``live_tokens``: the rows the prompts fill (the padding
    tail after them); eager MoE experts run on these rows only (see :mod:`.experts`).

    Example (two prompts of 3 and 2 tokens in a bucket of 8)::

        >>> import torch
        >>> from breakgraph.integrations.transformers import PackedBatch
        >>> batch = PackedBatch([(0, 3), (3, 5), (5, 8)],
        ...                     torch.tensor([0, 3, 5, 8], dtype=torch.int32), 3, live_tokens=5)
        >>> batch.bounds[-1], batch.one_prompt  # the padding tail is the last "sequence"
        ((5, 8), False)
    """

    bounds: list
    cu_seqlens: torch.Tensor | None
    max_seqlen: int
    one_prompt: bool = False
    live_tokens: int | None = None


def flash_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the FlashAttention varlen kernel can serve this dtype and device."""
    return _FLASH_HAS_WINDOW and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


@dataclass
class RunnerState:
    """What the registered attention function needs from the runner during one forward.

    ``kernel`` is ``"flash"`` or ``"reference"``. ``outputs`` maps a layer to its
    shared attention-output buffer (kept by the runner across buckets). ``layers``
    collects ``(layer, key, value)`` and ``calls`` the breaks seen during a capture.
    """

    kernel: str
    outputs: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    inline: bool = False  # one prompt from row 0: attention recorded in the graph, no break

    def output_for(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        """``[N, Hq, D]`` for ``layer``: a view of the shared buffer (grown at capture)."""
        n = like.shape[0]
        buffer = self.outputs.get(layer)
        if buffer is None or buffer.shape[0] < n or buffer.shape[1:] != like.shape[1:]:
            if not breakgraph.is_capturing():  # an eager fallback longer than every bucket
                return torch.empty(like.shape, dtype=like.dtype, device=like.device)
            with torch.inference_mode(False):
                buffer = self.outputs[layer] = torch.empty(
                    like.shape, dtype=like.dtype, device=like.device
                )
        return buffer[:n]


_running: contextvars.ContextVar[RunnerState | None] = contextvars.ContextVar(
    "breakgraph_prefill_runner", default=None
)


@contextlib.contextmanager
def running(state: RunnerState) -> Iterator[RunnerState]:
    """Make ``state`` the one the attention function sees, for the ``with`` block."""
    token = _running.set(state)
    try:
        yield state
    finally:
        _running.reset(token)


class LayerAttention:
    """Causal attention of one layer over the packed sequences: the eager break.

    Built at capture from ``query`` ``[1, Hq, N, D]`` and ``key``/``value``
    ``[1, Hkv, N, D]`` (RoPE applied, GQA not expanded); calling it writes
    ``[N, Hq, D]`` into ``out`` and returns ``out``, for the batch described by
    ``breakgraph.replay_context()``. ``window`` is the sliding window (a token sees
    itself and ``window - 1`` tokens before it) or None. :meth:`whole_row` is the same
    attention for one prompt from row 0, with no host input: it is recorded in the graph.

    Example (the reference kernel: two sequences, rows 0-2 and 3-7)::

        >>> import torch, breakgraph
        >>> from breakgraph.integrations.transformers import LayerAttention, PackedBatch
        >>> q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
        >>> attend = LayerAttention(0, q, k, v, 16**-0.5, None, "reference", torch.empty(8, 4, 16))
        >>> batch = PackedBatch([(0, 3), (3, 8)], torch.tensor([0, 3, 8], dtype=torch.int32), 5)
        >>> with breakgraph.context_scope(batch):  # what a replay's context holds
        ...     out = attend()
        >>> second = torch.nn.functional.scaled_dot_product_attention(
        ...     q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], is_causal=True, enable_gqa=True)
        >>> attend.__name__, torch.allclose(out[3:], second[0].transpose(0, 1), atol=1e-5)
        ('attention[layer 0]', True)
    """

    def __init__(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        window: int | None,
        kernel: str,
        out: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ):
        self.__qualname__ = self.__name__ = f"attention[layer {layer}]"
        self.q, self.k, self.v = (t[0].transpose(0, 1) for t in (query, key, value))
        self.scaling, self.window, self.kernel, self.sinks = scaling, window, kernel, sinks
        self.contiguous = all(t.stride(-1) == 1 for t in (self.q, self.k, self.v))
        self.out = out
        # one prompt filling the row from 0: plain causal SDPA is exact (the window never
        # binds when it spans the whole row); sinks need FlashAttention's log-sum-exp
        rows = self.q.shape[0]
        self.whole_row_causal = (
            kernel == "flash" and (window is None or window >= rows) and sinks is None
        )
        self.gqa = self.q.shape[1] != self.k.shape[1]
        self._head_major()
        self._out, self._out_head_major = None, None

    def _head_major(self) -> None:
        # ``[1, H, N, D]`` views for SDPA, made once (a view costs host time on every replay)
        self.q4, self.k4, self.v4 = (t.transpose(0, 1)[None] for t in (self.q, self.k, self.v))

    def __call__(self) -> torch.Tensor:
        batch: PackedBatch = breakgraph.replay_context()
        if self.kernel == "flash":
            if batch.one_prompt and self.whole_row_causal:
                return self.causal_sdpa(self.out)
            return self.flash(batch.cu_seqlens, batch.max_seqlen, self.out)
        return reference_attention(
            self.q, self.k, self.v, batch.bounds, self.scaling, self.window, out=self.out,
            sinks=self.sinks,
        )  # fmt: skip

    def whole_row(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal (sliding-window) attention over the whole row as ONE sequence: exact for the
        rows of a prompt that starts at row 0, since the rows after it (the padding tail) are
        never attended to by earlier rows. It reads nothing from the host, so a graph records
        it: the single-prompt graphs of ``PrefillRunner`` have no break at all."""
        if self.whole_row_causal:
            return self.causal_sdpa(out)
        n = self.q.shape[0]
        if self.kernel == "flash":  # a window shorter than the row: FlashAttention's window
            cu = torch.arange(0, 2 * n, n, dtype=torch.int32, device=self.q.device)  # [0, n]
            return self.flash(cu, n, out)
        return reference_attention(
            self.q, self.k, self.v, [(0, n)], self.scaling, self.window, out=out, sinks=self.sinks
        )

    def causal_sdpa(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal SDPA over every row (HF's own ``sdpa`` call): ``[N, Hq, D]``, into ``out``."""
        result = F.scaled_dot_product_attention(
            self.q4, self.k4, self.v4, is_causal=True, scale=self.scaling, enable_gqa=self.gqa
        )
        if out is None:
            return result[0].transpose(0, 1)
        if out is not self._out:
            self._out, self._out_head_major = out, out.transpose(0, 1)[None]
        self._out_head_major.copy_(result)
        return out

    def flash(
        self, cu_seqlens: torch.Tensor, max_seqlen: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        q, k, v = self.q, self.k, self.v
        if not self.contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return flash_varlen(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
            self.scaling, self.window, out, sinks=self.sinks,
        )  # fmt: skip

    def borrow(self) -> None:
        """Read ``q``/``k``/``v`` through borrowed aliases (see breakgraph.memory)."""
        self.q, self.k, self.v = (borrowed(t) for t in (self.q, self.k, self.v))
        self._head_major()


def flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling, window, out=None,
                 causal=True, sinks=None, rows=None) -> torch.Tensor:  # fmt: skip
    """Causal varlen attention with ATen's FlashAttention-2 kernel: ``[Tq, Hq, D]`` out.

    ``q`` is ``[Tq, Hq, D]``, ``k``/``v`` ``[Tk, Hkv, D]`` (GQA not expanded);
    sequence ``i`` owns query rows ``cu_q[i]:cu_q[i+1]`` and key rows
    ``cu_k[i]:cu_k[i+1]``; when it has more keys than queries (a KV cache), its
    queries are the *last* positions of its keys (bottom-right causal alignment).
    Rows past ``cu_q[-1]`` are not written. With ``out``, the result is written there
    (in place on torch >= 2.12, else copied) and ``out`` is returned.

    ``causal=False`` (no window only): every query sees all of its sequence's keys. With one
    query per sequence that is the same attention (the query is the last position), and the
    kernel then folds the query heads of each key head into one tile (FlashAttention's
    ``seqlenq_ngroups_swapped``, which a causal or windowed call turns off): a decode step
    runs one tile per key head instead of one per query head.

    ``sinks`` (``[Hq]``, attention sinks as gpt-oss has them) scale the first ``rows`` rows
    (default: all) by the kernel's log-sum-exp: :func:`apply_sinks`.
    """
    if window is None:
        is_causal, left, right = causal, -1, (0 if causal else -1)
    else:  # a sliding window: local attention, bottom-right aligned
        is_causal, left, right = False, window - 1, 0
    if out is not None and FLASH_WRITES_IN_PLACE:
        lse = _flash_into(
            out, q, k, v, cu_q, cu_k, max_q, max_k, 0.0, is_causal, False,
            scale=scaling, window_size_left=left, window_size_right=right,
        )  # fmt: skip
        return out if sinks is None else apply_sinks(out, lse, sinks, rows)
    result, lse = _flash(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, is_causal, False,
        scale=scaling, window_size_left=left, window_size_right=right,
    )[:2]  # fmt: skip
    if out is None:
        return result if sinks is None else apply_sinks(result, lse, sinks, rows)
    out.copy_(result)
    return out if sinks is None else apply_sinks(out, lse, sinks, rows)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                rows: int | None = None) -> torch.Tensor:  # fmt: skip
    """Attention sinks (gpt-oss): one learned logit per query head that joins every row's
    softmax and adds no value, so ``out`` ``[T, Hq, D]`` (the attention without it) shrinks by
    ``exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)``, ``lse`` ``[Hq, T]`` being the
    log-sum-exp of each row's scaled scores (FlashAttention's varlen layout). In place, on the
    first ``rows`` rows (default: all; rows past them have no log-sum-exp of their own), and
    ``lse`` is overwritten (the kernel's, fresh for each call: no allocation per layer).

    >>> import torch
    >>> out, lse = torch.ones(3, 2, 4), torch.zeros(2, 3)
    >>> apply_sinks(out, lse, torch.tensor([0.0, float("-inf")]))[0, :, 0]  # sink e^0, none
    tensor([0.5000, 1.0000])
    """
    rows = out.shape[0] if rows is None else rows
    if lse.shape != (out.shape[1], out.shape[0]):
        raise breakgraph.BackendError(
            f"attention sinks: FlashAttention returned a log-sum-exp of shape "
            f"{tuple(lse.shape)}, not [heads, rows] = {[out.shape[1], out.shape[0]]}; this "
            f"torch's kernel lays it out another way. Serve the model with attention='reference'."
        )
    scale = lse[:, :rows].sub_(sinks[:, None]).sigmoid_()
    out[:rows].mul_(scale.t().unsqueeze(-1))
    return out


def reference_attention(q, k, v, bounds, scaling, window, kv_bounds=None, out=None,
                        sinks=None):  # fmt: skip
    """Per-sequence SDPA with a causal (and sliding-window) mask: exact, slow, any device.

    ``bounds`` are the query rows of each sequence and ``kv_bounds`` its key rows
    (default: the same rows); with more keys than queries, the queries are the last
    positions of the keys. Rows outside ``bounds`` are zero. With ``out`` the result is
    written there. ``sinks`` (``[Hq]``): attention sinks, as :func:`apply_sinks`.
    """
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q) if out is None else out.zero_()
    for (start, end), (k_start, k_end) in zip(bounds, kv_bounds or bounds):
        qs = q[start:end].transpose(0, 1)
        ks = k[k_start:k_end].transpose(0, 1).repeat_interleave(groups, dim=0)
        vs = v[k_start:k_end].transpose(0, 1).repeat_interleave(groups, dim=0)
        i = torch.arange(end - start, device=q.device) + (k_end - k_start) - (end - start)
        distance = i[:, None] - torch.arange(k_end - k_start, device=q.device)[None, :]
        mask = distance >= 0
        if window is not None:
            mask &= distance < window
        out[start:end] = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scaling
        ).transpose(0, 1)
        if sinks is not None:  # the scores' log-sum-exp per head and row: [Hq, end - start]
            scores = (qs.float() @ ks.float().transpose(1, 2)) * scaling
            lse = scores.masked_fill(~mask, float("-inf")).logsumexp(-1)
            apply_sinks(out[start:end], lse, sinks.float())
    return out


def refuse_mask_and_softcap(who: str, attention_mask: Any, softcap: Any, why: str) -> None:
    """What breakgraph's attention functions cannot serve: softcapping, and a mask the model
    built (the breaks read exact sequence boundaries instead; ``why`` says whose)."""
    if softcap is not None:
        raise breakgraph.CaptureError(f"{who}: attention softcapping is not supported.")
    if attention_mask is not None:
        raise breakgraph.CaptureError(
            f"{who}: the model built an attention mask, which must be None here: {why}."
        )


def check_sinks(who: str, layer: Any, sinks: torch.Tensor, query: torch.Tensor) -> None:
    """At capture: attention sinks are one logit per query head of ``query`` ``[1, Hq, N, D]``."""
    if sinks.shape != (query.shape[1],):
        raise UnsupportedModelError(
            f"{who}: layer {layer} passes attention sinks (s_aux) of shape "
            f"{tuple(sinks.shape)}, not one per query head ({query.shape[1]}); breakgraph "
            f"serves sinks as gpt-oss has them. Serve this model without breakgraph."
        )


class _NotPassed:
    def __repr__(self) -> str:
        return "NOT_PASSED"


#: the default of the attention functions' ``sliding_window``: the layer passed none
NOT_PASSED: Any = _NotPassed()


def layer_window(module: Any, sliding_window: Any, check: bool = False) -> int | None:
    """The sliding window of ``module``'s attention call: the ``sliding_window`` its layer
    passed (None: no window, as EXAONE 4 passes for its full layers while its modules all keep
    the config's window), else, where it passed none (:data:`NOT_PASSED`), the one its config
    implies (:func:`config_window`), or where that cannot say the one the module keeps. Such a
    model's own forward applies the window through the mask, which breakgraph's attention does
    not read: Qwen2-MoE's sliding layers (which keep ``self.sliding_window``) attended to every
    key before this was read, and so would Phi-3.5-MoE's (which keep none; a family left out
    for its RoPE). With ``check`` (at capture: once per layer and graph, never on a replay) the
    window must be the one the config implies, else :class:`~.errors.UnsupportedModelError`:
    the model's own forward masks by its config, and a layer that passes one window while its
    mask applies another would be served a wrong answer, silently.

    >>> import types
    >>> keeps = types.SimpleNamespace(sliding_window=4)
    >>> layer_window(keeps, NOT_PASSED), layer_window(keeps, None), layer_window(keeps, 8)
    (4, None, 8)
    """
    if sliding_window is not NOT_PASSED and not check:  # eager steps: every layer, every step
        return sliding_window
    layer, config = getattr(module, "layer_idx", None), getattr(module, "config", None)
    implied = config_window(config, layer)
    window = sliding_window
    if window is NOT_PASSED:  # the model's own forward masks by its config: read the same
        window = implied
        if window is NOT_PASSED:
            window = getattr(module, "sliding_window", None) or None  # 0: Qwen2-MoE's "off"
    if check and implied is not NOT_PASSED and implied != window:
        kind = getattr(config, "layer_types", None)
        kind = f"layer_types[{layer}] = {kind[layer]!r}, " if kind else "no layer_types, "
        raise UnsupportedModelError(
            f"breakgraph attention: layer {layer} of this {config.model_type!r} model "
            f"attends with sliding window {window}, but its config implies {implied} "
            f"({kind}sliding_window = {getattr(config, 'sliding_window', None)!r}); its own "
            f"forward masks by the config, so breakgraph's answer would differ. Serve it "
            f"without breakgraph and report the family (its attention passes the window "
            f"another way)."
        )
    return window


def config_window(config: Any, layer: Any) -> Any:
    """The window ``config`` gives ``layer``, as transformers' masks apply it: by its
    ``layer_types`` (``"sliding_attention"``: ``sliding_window``; ``"full_attention"``: None), or
    without them ``sliding_window`` on every layer (Mistral, Mixtral, Phi-3, Qwen3-MoE: one mask
    function for the model). :data:`NOT_PASSED` where it cannot say: no config or layer index,
    another kind of layer, a list too short.

    >>> import types
    >>> config = types.SimpleNamespace(sliding_window=4, layer_types=["sliding_attention",
    ...                                                               "full_attention"])
    >>> config_window(config, 0), config_window(config, 1), config_window(config, 2)
    (4, None, NOT_PASSED)
    """
    if config is None or not isinstance(layer, int):
        return NOT_PASSED
    window = getattr(config, "sliding_window", None) or None
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return window
    if not isinstance(kinds, (list, tuple)) or not 0 <= layer < len(kinds):
        return NOT_PASSED
    return {"sliding_attention": window, "full_attention": None}.get(kinds[layer], NOT_PASSED)


@torch.compiler.disable  # with PrefillRunner(compile=...), Dynamo's graph breaks here too
def breakgraph_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = NOT_PASSED,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
):
    """The function registered as ``AttentionInterface["breakgraph"]``: each layer's attention
    as a :class:`LayerAttention` break, only inside a :class:`~.prefill.PrefillRunner`'s forwards.
    ``s_aux``: the layer's attention sinks (gpt-oss), one logit per query head.

    Example::

        >>> import torch
        >>> from breakgraph.integrations.transformers import breakgraph_attention
        >>> q = torch.randn(1, 2, 4, 8)
        >>> breakgraph_attention(None, q, q, q, None)  # no runner is running
        Traceback (most recent call last):
        breakgraph.errors.CaptureError: ...
    """
    state = _running.get()
    if state is None:
        raise breakgraph.CaptureError(
            "breakgraph attention was called outside a PrefillRunner; the runner sets the "
            "model's attention implementation only while it captures or runs."
        )
    refuse_mask_and_softcap(
        "breakgraph attention", attention_mask, softcap,
        "the prefill runner packs prompts itself (do not pass attention_mask)",
    )  # fmt: skip
    layer = getattr(module, "layer_idx", len(state.layers))
    capturing = breakgraph.is_capturing()
    if capturing:
        state.layers.append((layer, key, value))
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    window = layer_window(module, sliding_window, check=capturing)
    if capturing and s_aux is not None:
        check_sinks("breakgraph attention", layer, s_aux, query)
    call = LayerAttention(layer, query, key, value, scale, window, state.kernel, sinks=s_aux)
    call.out = state.output_for(layer, call.q)
    if state.inline:  # a single-prompt graph: recorded, not a break
        return call.whole_row(call.out).unsqueeze(0), None
    if not capturing:  # warm-up or eager fallback: a decoration per layer would cost 7 us
        return call().unsqueeze(0), None
    state.calls.append(call)
    return breakgraph.eager_on_graph(call)().unsqueeze(0), None


# id(config) -> (a weak reference to the config, its RLock); by id: configs are unhashable
_switching: dict = {}
_switching_made = threading.Lock()


@contextlib.contextmanager
def switching(model: Any) -> Iterator[None]:
    """Hold the lock of ``model``'s attention setting for the block: held by :func:`switched`
    and by continuous batching while it swaps the model's config (``enable_continuous_batching``,
    ``disable()``). Unheld there, a swap in the middle of a runner's block split the block
    between two configs: the runner's restore went to the other config (enabled meanwhile: the
    original config kept ``"breakgraph"`` for good and the enabled model got SDPA back; disabled
    meanwhile: the restore of the removed CB key raised), and its forward changed attention
    halfway.

    The lock belongs to the config object, not the model: the key is a setting of the config,
    and models built from one config object share it (``from_config(cfg)`` twice). With a lock
    per model, two runners of two such models on two threads switched each other's forward
    back to SDPA halfway (wrong logits, silently) and left ``"breakgraph"`` for good. A config
    swapped while this waited (continuous batching) is looked up again."""
    while True:
        config = model.config
        with _switching_made:
            entry = _switching.get(id(config))
            if entry is None or entry[0]() is not config:  # new: the collected configs' go
                for key in [key for key, (ref, _) in _switching.items() if ref() is None]:
                    del _switching[key]
                entry = _switching[id(config)] = (weakref.ref(config), threading.RLock())
        with entry[1]:
            if model.config is config:
                yield
                return


@contextlib.contextmanager
def switched(model: Any) -> Iterator[None]:
    """``model`` on breakgraph's attention for the block, then back to what it had; one block
    per config at a time (:func:`switching`, re-entered by its thread). The implementation is a
    setting of the model's config: two runners' eager fallbacks or captures on two threads,
    unordered, let the first to finish switch the other's forward back to SDPA halfway (its
    packed prompts then attended to each other, silently) and the last restore ``"breakgraph"``
    for good (the model's own calls then raised). Replays never switch, so they never wait here."""
    with switching(model):
        original = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_KEY)
        try:
            yield
        finally:
            model.set_attn_implementation(original)


def register() -> None:
    """Register the attention function in transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_KEY, breakgraph_attention)
