"""The one-graph variant of ``PrefillRunner``: the baseline with no breaks at all.

``OneGraphPrefillRunner`` is a ``PrefillRunner`` whose attention is recorded *inside* the
bucket's graph instead of running as an eager break: FlashAttention varlen over the
runner's static ``cu_seqlens`` buffer (``max_prompts + 2`` boundaries, no more than the
largest bucket + 2 with ``on_miss="raise"``; the entries after the live ones repeat the
end, so they are zero-length sequences), with the bucket size as
``max_seqlen``, an upper bound. One CUDA graph per bucket and not one break: the same packed
forward as breakgraph's, so the difference between the two is what the per-layer attention
breaks cost. The benchmarks measure breakgraph against it (``bench_prefill``'s
``bg_one_graph``, ``bench_tp``'s ``tp_full_graph``, ``break_anatomy``'s full graph and its
``+ cuts``, ``prefill_host_path``'s one-graph baseline).

It is no product: it relies on the kernel tolerating an upper-bound ``max_seqlen``, holds
at most ``max_prompts`` sequences, and needs the CUDA backend, bf16/fp16 weights and torch's
FlashAttention (``attention="flash"``, refused otherwise). It uses no hook of the library:
it registers its own attention function in transformers' ``AttentionInterface`` and, around
every forward of the runner (capture, warm-up, eager fallback), switches the model from
breakgraph's attention key to its own.

Usage (GPU)::

    from benchmarks.one_graph import OneGraphPrefillRunner

    one = OneGraphPrefillRunner(model, token_buckets=(64, 256), max_prompts=16)
    one.graph(64).num_breaks  # 0
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from breakgraph.integrations.transformers import PrefillRunner, default_token_buckets
from breakgraph.integrations.transformers.attention import LayerAttention

import breakgraph
from breakgraph.buckets import expected_padding
from breakgraph.errors import InputError

ONE_GRAPH_KEY = "breakgraph_one_graph"

#: (the runner's static cu_seqlens, cut after attention) during one of its forwards
_running: contextvars.ContextVar[tuple[torch.Tensor, bool] | None] = contextvars.ContextVar(
    "breakgraph_one_graph_runner", default=None
)


def one_graph_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
):
    """The function registered as ``AttentionInterface["breakgraph_one_graph"]``: the
    FlashAttention varlen kernel over every packed sequence, inside the graph (``s_aux``:
    attention sinks, as breakgraph's own attention applies them)."""
    state = _running.get()
    if state is None:
        raise breakgraph.CaptureError(
            "one_graph_attention was called outside a OneGraphPrefillRunner forward."
        )
    cu_seqlens, cut = state
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer = getattr(module, "layer_idx", 0)
    call = LayerAttention(layer, query, key, value, scale, sliding_window, "flash", sinks=s_aux)
    out = call.flash(cu_seqlens, query.shape[2])  # max_seqlen: the bucket, an upper bound
    if cut:
        breakgraph.break_graph()
    return out.unsqueeze(0), None


class OneGraphPrefillRunner(PrefillRunner):
    """A ``PrefillRunner`` whose attention is captured inside the graph (module docstring).

    Takes ``PrefillRunner``'s arguments (``attention`` must stay ``"flash"``, its default
    here) and ``cut_after_attention``: an empty ``breakgraph.break_graph()`` after every
    layer's attention, the cost of cutting the graph alone (same kernels, nothing eager).
    ``cache(i)`` of its outputs holds no layers (the attention keeps no keys or values).
    """

    def __init__(self, model: Any, *args: Any, cut_after_attention: bool = False, **kwargs: Any):
        attention = kwargs.setdefault("attention", "flash")
        if attention != "flash":
            raise InputError(
                f"OneGraphPrefillRunner: attention must be 'flash' (the kernel it captures), "
                f"got {attention!r}."
            )
        from transformers import AttentionInterface

        AttentionInterface.register(ONE_GRAPH_KEY, one_graph_attention)
        self.cut_after_attention = cut_after_attention
        kwargs.setdefault("single_prompt_graphs", False)  # its graphs have no break already
        super().__init__(model, *args, **kwargs)  # captures through installed() below

    def _padding_of(self, bucket: int) -> float:
        """The padding the default ladder's bucket of this size expects, so that MoE experts
        skip padding rows (or not) exactly as in the default runner: this variant usually has
        only the few buckets a benchmark uses, whose gaps are far larger."""
        return expected_padding(default_token_buckets(max(4096, bucket)), bucket)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """``PrefillRunner.installed`` (experts, tensor parallelism), with this variant's
        attention key instead of breakgraph's and its boundaries buffer visible to it."""
        with super().installed():
            breakgraph_key = self.model.config._attn_implementation
            self.model.set_attn_implementation(ONE_GRAPH_KEY)
            token = _running.set((self._steps.cu_seqlens, self.cut_after_attention))
            try:
                yield
            finally:
                _running.reset(token)
                self.model.set_attn_implementation(breakgraph_key)
