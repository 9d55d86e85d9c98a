"""The device floor of a continuous-batching workload: bytes over HBM bandwidth, FLOPs over peak.

Why: a tokens/s figure says nothing about how far a serving path is from the hardware. Issue
23 asks for each shape's roofline floor next to the measured time: weights and KV bytes read
per decode step over the HBM bandwidth (4.8 TB/s on an H200), prefill FLOPs over the dense
bf16 peak (about 990 TFLOP/s), and pure-decode steps within 2x of their HBM floor.

The model is a plain roofline, counted from the model's own parameters:

* a step reads every weight once (the input embedding only by rows, ``lm_head`` whole; a
  MoE layer only the experts its tokens route to: ``1 - (1 - k/E)**tokens`` of them on
  average under uniform routing) and the KV rows of its sequences; its time is at least
  ``max(bytes / bandwidth, flops / peak)``; a sliding-window layer reads at most its window
  of each sequence's keys;
* a prefill token costs ``2 x active parameters`` FLOPs, plus causal attention
  (``4 x layers x heads x head_dim`` per query-key pair); ``lm_head`` runs once per prompt
  (``logits_to_keep``);
* the workload's prefill takes at least ``ceil(prompt tokens / max_batch_tokens)`` steps;
  each request then decodes ``new_tokens - 1`` more steps, all requests together at best.

``roofline_s`` adds the prefill and decode phases (no overlap between them: the number issue
23 quotes, "~0.3 s" for its 3B-shaped run); ``bound_s`` is the strict lower bound
``max(all FLOPs / peak, all bytes / bandwidth)``. Both ignore kernel launch and host time,
so real steps never reach them.

Example::

    >>> shape = Shape(layers=2, heads=4, kv_heads=2, head_dim=16, dense_params=1000,
    ...               expert_params=0, experts=0, top_k=0, head_params=500, bytes_per_param=2)
    >>> shape.kv_bytes_per_token
    256
    >>> step = decode_step_floor(shape, requests=4, context=10)
    >>> step["bytes"]                   # weights (1000 + 500) * 2 + 4 * 10 * 256 KV bytes
    13240
    >>> floor = workload_floor(shape, [8, 8], new_tokens=3, max_batch_tokens=16)
    >>> floor["decode_steps"], floor["prefill_steps"]
    (2, 1)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

#: H200 SXM: HBM3e bandwidth and dense bf16 tensor-core peak (the floors' default where the card
#: is not known: the CPU, a card not in :data:`CARDS`).
H200_HBM_BYTES_PER_S = 4.8e12
H200_PEAK_FLOPS = 990e12
#: ``(part of torch.cuda.get_device_name(), HBM bytes/s, dense bf16 FLOP/s)`` of the cards the
#: benchmarks run on: a floor takes its card's bandwidth unless told otherwise (a run on an
#: H100 once took an H200's by default, and its floors were 30% too short)
CARDS = (
    ("H200", H200_HBM_BYTES_PER_S, H200_PEAK_FLOPS),
    ("H100 80GB HBM3", 3.35e12, 990e12),  # the SXM card
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
)


def card_peaks(name: str | None) -> tuple[float, float] | None:
    """``(HBM bytes/s, dense bf16 FLOP/s)`` of the card named ``name`` (a CUDA device name),
    or None for a card not in :data:`CARDS` (and for no card).

    >>> card_peaks("NVIDIA H100 80GB HBM3")
    (3350000000000.0, 990000000000000.0)
    >>> card_peaks("NVIDIA A10G") is None
    True
    """
    return next(((hbm, flops) for part, hbm, flops in CARDS if name and part in name), None)


def floor_peaks(hbm_tbs: float | None, peak_tflops: float | None, card: str | None) -> tuple:
    """A floor's ``(HBM bytes/s, peak FLOP/s)``: what the benchmark was told (TB/s, TFLOP/s;
    None: not told), else the card's (:func:`card_peaks`), else an H200's, with a warning on
    stderr where a GPU that is not in :data:`CARDS` ran it without a bandwidth given (a CPU
    run's floors are nominal).

    >>> floor_peaks(None, None, "NVIDIA H100 80GB HBM3")[0], floor_peaks(2.0, None, None)[0]
    (3350000000000.0, 2000000000000.0)
    """
    known = card_peaks(card)
    if known is None and card and hbm_tbs is None:
        print(f"warning: no HBM bandwidth known for {card!r}: the floors take an H200's; "
              f"pass --hbm-tbs", file=sys.stderr)  # fmt: skip
    hbm, flops = known or (H200_HBM_BYTES_PER_S, H200_PEAK_FLOPS)
    return (hbm if hbm_tbs is None else hbm_tbs * 1e12,
            flops if peak_tflops is None else peak_tflops * 1e12)  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """What the floor needs of a model: its attention geometry and parameter counts.

    ``dense_params``: every parameter a token passes through except the input embedding,
    ``lm_head`` and the routed experts; ``expert_params``: all routed experts of all
    layers; ``head_params``: ``lm_head``'s weight (read whole by every step, tied or not);
    ``sliding_layers`` of the ``layers`` attend to the last ``window`` keys only.
    """

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dense_params: int
    expert_params: int
    experts: int
    top_k: int
    head_params: int
    bytes_per_param: int
    sliding_layers: int = 0
    window: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token keeps in the cache (all layers)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.bytes_per_param

    def kv_read_bytes(self, context: float) -> float:
        """Bytes of keys and values one decode query reads over ``context`` keys (all
        layers; a sliding-window layer reads at most its window).

        >>> Shape(4, 4, 2, 16, 0, 0, 0, 0, 0, 2, sliding_layers=3, window=8).kv_read_bytes(100)
        15872.0
        """
        per_layer = self.kv_bytes_per_token / self.layers
        full = self.layers - self.sliding_layers
        return per_layer * (full * context + self.sliding_layers * min(context, self.window))

    def attended_pairs(self, queries: int) -> float:
        """Query-key pairs of one causal prompt of ``queries`` tokens, averaged over the
        layers (a sliding-window layer's queries see at most its window)."""
        whole = queries * (queries + 1) / 2
        if not self.sliding_layers:
            return whole
        w = min(self.window, queries)
        windowed = w * (w + 1) / 2 + (queries - w) * w
        full = self.layers - self.sliding_layers
        return (full * whole + self.sliding_layers * windowed) / self.layers

    def routed_fraction(self, tokens: int) -> float:
        """Expected share of the experts that ``tokens`` tokens read (uniform top-k routing)."""
        if not self.experts:
            return 0.0
        return 1.0 - (1.0 - self.top_k / self.experts) ** max(tokens, 0)

    def weight_bytes(self, tokens: int) -> float:
        """Weight bytes one step of ``tokens`` query tokens reads."""
        params = self.dense_params + self.head_params
        params += self.expert_params * self.routed_fraction(tokens)
        return params * self.bytes_per_param

    def active_params(self) -> float:
        """Parameters one token multiplies by (without ``lm_head``)."""
        share = self.top_k / self.experts if self.experts else 0.0
        return self.dense_params + self.expert_params * share

    def as_dict(self) -> dict:
        return asdict(self)


def shape_of(model) -> Shape:
    """The :class:`Shape` of a transformers causal LM (counted from its parameters)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    dense = experts = 0
    for name, parameter in model.named_parameters():  # shared (tied) tensors come once
        if parameter is embedding or parameter is head:
            continue
        if ".experts." in name:
            experts += parameter.numel()
        else:
            dense += parameter.numel()
    count = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    types, window = getattr(config, "layer_types", None), getattr(config, "sliding_window", None)
    if types:
        sliding = sum(kind == "sliding_attention" for kind in types)
    else:
        sliding = config.num_hidden_layers if window else 0
    return Shape(
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        dense_params=dense,
        expert_params=experts,
        experts=int(count or 0) if experts else 0,
        top_k=int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0,
        head_params=head.numel(),
        bytes_per_param=head.element_size(),
        sliding_layers=sliding,
        window=int(window or 0) if sliding else 0,
    )


def _attention_flops(shape: Shape, pairs: float) -> float:
    """QK^T and PV over ``pairs`` query-key pairs, every layer and head."""
    return 4.0 * shape.layers * shape.heads * shape.head_dim * pairs


def decode_step_floor(
    shape: Shape,
    requests: int,
    context: float,
    hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S,
    peak_flops: float = H200_PEAK_FLOPS,
) -> dict:
    """One pure decode step of ``requests`` sequences whose keys number ``context`` each
    (the new token included): bytes, FLOPs and the floor in milliseconds."""
    data = shape.weight_bytes(requests) + requests * shape.kv_read_bytes(context)
    flops = 2.0 * (shape.active_params() + shape.head_params) * requests
    keys = shape.kv_read_bytes(context) / shape.kv_bytes_per_token  # per layer, on average
    flops += _attention_flops(shape, requests * keys)
    seconds = max(data / hbm_bytes_per_s, flops / peak_flops)
    return {"bytes": round(data), "flops": flops, "floor_ms": 1e3 * seconds,
            "memory_bound": data / hbm_bytes_per_s >= flops / peak_flops}  # fmt: skip


def workload_floor(
    shape: Shape,
    prompt_lengths: Sequence[int],
    new_tokens: int,
    max_batch_tokens: int,
    hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S,
    peak_flops: float = H200_PEAK_FLOPS,
) -> dict:
    """The floor of serving ``prompt_lengths`` at once, ``new_tokens`` tokens each.

    Returns the phases (``prefill_s``, ``decode_s``), their sum ``roofline_s``, the strict
    lower bound ``bound_s`` and what they are made of (bytes, FLOPs, step counts).
    """
    prompt_tokens = sum(prompt_lengths)
    requests = len(prompt_lengths)
    prefill_steps = max(1, math.ceil(prompt_tokens / max_batch_tokens))
    prefill_flops = 2.0 * shape.active_params() * prompt_tokens
    prefill_flops += _attention_flops(shape, sum(shape.attended_pairs(n) for n in prompt_lengths))
    prefill_flops += 2.0 * shape.head_params * requests  # logits of each prompt's last token
    prefill_bytes = prefill_steps * shape.weight_bytes(min(prompt_tokens, max_batch_tokens))
    prefill_bytes += prompt_tokens * shape.kv_bytes_per_token  # the cache written once
    prefill_s = max(prefill_flops / peak_flops, prefill_bytes / hbm_bytes_per_s)

    decode_steps = max(0, new_tokens - 1)  # the first new token comes from the prefill
    decode_s = decode_bytes = decode_flops = 0.0
    for t in range(1, decode_steps + 1):
        step = decode_step_floor(shape, requests, prompt_tokens / requests + t,
                                 hbm_bytes_per_s, peak_flops)  # fmt: skip
        decode_s += step["floor_ms"] / 1e3
        decode_bytes += step["bytes"]
        decode_flops += step["flops"]
    bound_s = max(
        (prefill_flops + decode_flops) / peak_flops,
        (prefill_bytes + decode_bytes) / hbm_bytes_per_s,
    )
    return {
        "roofline_s": prefill_s + decode_s,
        "bound_s": bound_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prefill_flops": prefill_flops,
        "prefill_bytes": prefill_bytes,
        "decode_bytes": decode_bytes,
        "decode_flops": decode_flops,
        "prefill_steps": prefill_steps,
        "decode_steps": decode_steps,
        "weight_bytes_per_decode_step": shape.weight_bytes(requests),
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "hbm_bytes_per_s": hbm_bytes_per_s,
        "peak_flops": peak_flops,
    }
