"""Continuous batching: the attention function and what its eager break reads on every step.

transformers' continuous batching (CB) calls the model with packed query tokens
of many requests (prefill chunks and decode tokens mixed) and a paged KV cache
(``PagedAttentionCache``): each attention layer writes the new keys and values at
``write_index``, reads back everything its sequences see at ``read_index``, and
runs varlen causal attention. The read length and the sequence boundaries change
on every step, so this part cannot be frozen into a graph. Here it is one
``@breakgraph.eager_on_graph`` break per layer that reads the live step's exact
metadata (:class:`CBStep`) through :func:`breakgraph.replay_context`; everything
around it is captured.

The function is registered as ``AttentionInterface["paged|breakgraph"]``; the
``paged|`` prefix tells CB to keep it, and since the key has no mask function the
model builds no attention mask.
"""

from __future__ import annotations

from typing import Any

import torch

import breakgraph
from breakgraph.errors import CaptureError, InputError, ReplayError

from .attention import FLASH_WRITES_IN_PLACE, flash_varlen, reference_attention

CB_ATTENTION_KEY = "paged|breakgraph"

_FULL, _SLIDING = "full_attention", "sliding_attention"


class KVLayout:
    """Key rows of one layer type in a step: per-sequence ``bounds`` (host), ``cu``
    (device int32 cumulative lengths) and ``max_len``."""

    __slots__ = ("bounds", "cu", "max_len")

    def __init__(self) -> None:
        self.bounds: list[tuple[int, int]] = []
        self.cu: torch.Tensor | None = None
        self.max_len = 0


class CBStep:
    """Host description of the live CB step: everything an attention break reads.

    One object per runner, refilled before every step (no allocation per layer):

    * ``queries``: query rows of each request (``bounds``, ``cu`` = CB's
      ``cu_seq_lens_q`` static buffer sliced to the real requests, exact ``max_len``);
    * ``keys[layer_type]``: key rows after the cache read, per ``"full_attention"``
      / ``"sliding_attention"``;
    * ``read_index`` / ``write_index``: per layer group, the exact cache indices
      (views of CB's static index buffers);
    * ``warmup``: the eager run before a capture; attention then touches no cache
      (a second write of the same step would corrupt sliding-window caches).
    """

    __slots__ = ("kernel", "queries", "keys", "read_index", "write_index", "warmup")

    def __init__(self, kernel: str, layer_types) -> None:
        self.kernel = kernel
        self.queries = KVLayout()
        self.keys = {layer_type: KVLayout() for layer_type in layer_types}
        self.read_index: list[torch.Tensor] = []
        self.write_index: list[torch.Tensor] = []
        self.warmup = False

    def refill(self, host_io: Any, device_io: Any, cache: Any) -> None:
        """Read the step that ``prepare_batch_tensors`` just staged: lengths from the host
        IO, views of the static index and length buffers from the device IO (the same
        object without asynchronous batching). No device sync."""
        queries, keys = self.queries, self.keys
        queries.bounds.clear()
        for layout in keys.values():
            layout.bounds.clear()
            layout.max_len = 0
        q_start, q_max = 0, 0
        k_start = dict.fromkeys(keys, 0)
        for future in host_io.requests_in_batch:
            length = future.query_length
            past = future.state.position_offset - length  # prepare_batch_tensors advanced it
            queries.bounds.append((q_start, q_start + length))
            q_start += length
            q_max = max(q_max, length)
            for layer_type, k_len in cache.get_seqlens_k(past, length).items():
                layout = keys[layer_type]
                layout.bounds.append((k_start[layer_type], k_start[layer_type] + k_len))
                k_start[layer_type] += k_len
                layout.max_len = max(layout.max_len, k_len)
        n = len(queries.bounds) + 1
        queries.max_len = q_max
        queries.cu = device_io.cumulative_seqlens_q[:n]
        for layer_type, layout in keys.items():
            layout.cu = device_io.cumulative_seqlens_k[layer_type][:n]
        sizes, q_size = host_io.true_read_sizes, host_io.num_q_tokens
        self.read_index = [device_io.read_index_storage[g, :n] for g, n in enumerate(sizes)]
        self.write_index = [device_io.write_index_storage[g, :q_size] for g in range(len(sizes))]


def current_step(who: str) -> CBStep:
    """The :class:`CBStep` of the step being run, captured or replayed."""
    try:
        step = breakgraph.replay_context()
    except ReplayError:
        step = None
    if not isinstance(step, CBStep):
        raise CaptureError(
            f"{who}: no continuous-batching step is active. The 'paged|breakgraph' attention "
            f"runs only inside the steps of a manager created while enable_continuous_batching() "
            f"was on."
        )
    return step


class PagedAttentionBreak:
    """One layer's cache write + read + varlen causal attention: the eager break.

    Built during the capture (or per eager step) from the layer's ``query``
    ``[1, Hq, T, D]`` and new ``key``/``value`` ``[1, Hkv, T, D]`` (RoPE applied);
    calling it returns ``[T, Hq, D]`` for the step in ``replay_context()``. Rows past
    the step's real tokens (bucket padding) hold finite values that nothing reads.
    """

    def __init__(self, module, query, key, value, cache, scaling: float, window, kernel: str):
        self.layer = module.layer_idx
        self.__qualname__ = self.__name__ = f"paged attention[layer {self.layer}]"
        self.q = query[0].transpose(0, 1)
        if self.q.stride(-1) != 1:
            self.q = self.q.contiguous()  # only if RoPE left an odd layout (not seen in practice)
        self.key, self.value, self.cache = key, value, cache
        self.new_k, self.new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        self.scaling, self.window, self.kernel = scaling, window, kernel
        self.layer_type = _SLIDING if window is not None else _FULL
        self.out = None
        if kernel == "flash" and FLASH_WRITES_IN_PLACE:
            self.out = torch.zeros(self.q.shape, dtype=self.q.dtype, device=self.q.device)

    def __call__(self) -> torch.Tensor:
        step: CBStep = breakgraph.replay_context()
        if step.warmup:
            k, v, keys = self.new_k, self.new_v, step.queries
        else:
            k, v = self.cache.update(
                self.key, self.value, self.layer, step.read_index, step.write_index
            )
            keys = step.keys[self.layer_type]
        queries = step.queries
        if self.kernel == "reference":
            return reference_attention(
                self.q, k, v, queries.bounds, self.scaling, self.window, keys.bounds
            )
        out = flash_varlen(
            self.q, k.contiguous(), v.contiguous(), queries.cu, keys.cu,
            queries.max_len, keys.max_len, self.scaling, self.window, self.out,
        )  # fmt: skip
        if self.out is None:
            out[queries.bounds[-1][1] :].zero_()  # rows the kernel skipped: uninitialised
        return out


@torch.compiler.disable
def paged_breakgraph_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cache: Any = None,
    **kwargs: Any,
):
    """The function registered as ``AttentionInterface["paged|breakgraph"]``."""
    if cache is None:
        raise InputError(
            "paged|breakgraph attention was called without a paged KV cache: the model is in "
            "breakgraph continuous-batching mode, which serves generate_batch() and the CB "
            "manager only. Call handle.disable() (or leave the `with` block) before "
            "model.generate() or a plain forward."
        )
    if softcap is not None:
        raise CaptureError("paged|breakgraph attention: attention softcapping is not supported.")
    if attention_mask is not None:
        raise CaptureError(
            "paged|breakgraph attention: the model built an attention mask; continuous batching "
            "with this key must run without one."
        )
    step = current_step("paged|breakgraph attention")
    layer = module.layer_idx
    cached_window = cache.sliding_windows[layer]
    if (sliding_window is not None) != (cached_window != 1) or (
        sliding_window is not None and sliding_window != cached_window
    ):
        raise CaptureError(
            f"paged|breakgraph attention: layer {layer} attends with sliding_window="
            f"{sliding_window} but the paged cache holds a window of {cached_window} tokens."
        )
    call = PagedAttentionBreak(
        module,
        query,
        key,
        value,
        cache,
        query.shape[-1] ** -0.5 if scaling is None else scaling,
        sliding_window,
        step.kernel,
    )
    return breakgraph.eager_on_graph(call)().unsqueeze(0), None
