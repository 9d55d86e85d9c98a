"""The attention function that turns every attention call of a HF model into an eager break.

It is registered in transformers' ``AttentionInterface`` under the plain key
``"breakgraph"`` and nowhere else: ``create_causal_mask`` then returns ``None``
before any data-dependent mask code runs, so nothing in transformers does host
work inside the captured segments. Everything around attention (embeddings,
norms, projections, RoPE, MLPs, lm_head) is captured; the attention itself runs
eagerly on every replay with the *exact* metadata of the live batch (sequence
boundaries, maximum length), read from :func:`breakgraph.replay_context`.

Kernels: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 inside ATen)
on CUDA in bf16/fp16; otherwise a per-sequence ``scaled_dot_product_attention``
reference (CPU, fp32), exact to the model's own attention.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

import breakgraph

ATTENTION_KEY = "breakgraph"

try:  # torch >= 2.9
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_HAS_WINDOW = "window_size" in inspect.signature(_varlen_attn).parameters
except ImportError:  # pragma: no cover - older torch
    _varlen_attn, _VARLEN_HAS_WINDOW = None, False


@dataclass
class PackedBatch:
    """Host description of one packed batch: what the eager attention reads on every replay.

    ``bounds`` are ``(start, end)`` token ranges of each sequence in the packed
    row, the padding tail included as a last dummy sequence so every row is written;
    ``cu_seqlens`` is the same on the device (int32), ``max_seqlen`` the longest.
    """

    bounds: list
    cu_seqlens: Optional[torch.Tensor]
    max_seqlen: int
    use_varlen: bool


def varlen_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the FlashAttention varlen kernel can serve this dtype and device."""
    return (
        _varlen_attn is not None
        and _VARLEN_HAS_WINDOW
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
    )


@breakgraph.eager_on_graph
def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float, window: Optional[int]) -> torch.Tensor:
    """Causal attention over the packed sequences of the live batch: the per-layer eager break.

    ``query`` is ``[1, Hq, N, D]``, ``key``/``value`` ``[1, Hkv, N, D]`` (RoPE applied,
    GQA not expanded); returns ``[1, N, Hq, D]``. ``window`` is the model's sliding
    window (a token sees itself and the ``window - 1`` tokens before it) or None.
    """
    batch: PackedBatch = breakgraph.replay_context()
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    if batch.use_varlen:
        out = _varlen_attn(
            q.contiguous(), k.contiguous(), v.contiguous(), batch.cu_seqlens, batch.cu_seqlens,
            batch.max_seqlen, batch.max_seqlen, scale=scaling,
            window_size=(-1 if window is None else window - 1, 0),
        )
    else:
        out = _reference_attention(q, k, v, batch.bounds, scaling, window)
    return out.unsqueeze(0)


def _reference_attention(q, k, v, bounds, scaling, window):
    """Per-sequence SDPA with a causal (and sliding-window) mask: exact, slow, any device."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for start, end in bounds:
        qs = q[start:end].transpose(0, 1)
        ks = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        vs = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        n = end - start
        i = torch.arange(n, device=q.device)
        distance = i[:, None] - i[None, :]
        mask = distance >= 0
        if window is not None:
            mask &= distance < window
        out[start:end] = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scaling
        ).transpose(0, 1)
    return out


class AttentionRecorder:
    """Collects the ``(layer, key, value)`` tensors seen while a bucket is captured.

    After a replay those capture-time tensors hold the batch's keys and values (they
    are segment outputs held by the graph), which is how ``PrefillOutput.cache(i)``
    reads the KV cache without an extra copy per layer.
    """

    def __init__(self) -> None:
        self.layers: list = []

    def record(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.layers.append((layer, key, value))


_recorder: Optional[AttentionRecorder] = None


def set_recorder(recorder: Optional[AttentionRecorder]) -> None:
    global _recorder
    _recorder = recorder


def breakgraph_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                         dropout: float = 0.0, sliding_window: Optional[int] = None,
                         softcap: Optional[float] = None, **kwargs: Any):
    """The function registered as ``AttentionInterface["breakgraph"]``."""
    if softcap is not None:
        raise breakgraph.CaptureError(
            "breakgraph attention: attention softcapping is not supported by the prefill runner."
        )
    if attention_mask is not None:
        raise breakgraph.CaptureError(
            "breakgraph attention: the model built an attention mask; the prefill runner "
            "packs prompts itself and needs the mask to be None (do not pass attention_mask)."
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if breakgraph.is_capturing() and _recorder is not None:
        _recorder.record(getattr(module, "layer_idx", len(_recorder.layers)), key, value)
    return packed_attention(query, key, value, scaling, sliding_window), None


def register() -> None:
    """Register the attention function in transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_KEY, breakgraph_attention)
