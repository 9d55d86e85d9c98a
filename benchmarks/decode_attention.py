"""One layer's attention in a pure-decode CB step, three ways (CUDA only).

Every CB shape's heads, 32 / 100 / 256 sequences of 16–1152 cached keys each in a paged cache
whose slots are in random order (what transformers' allocator hands out after a while):

* ``gather_flash_causal``: what breakgraph's break did before: transformers' ``index_select``
  of every key and value the step reads (the *gather*), then FlashAttention-2's varlen kernel,
  causal, over the bucket's padded query rows;
* ``gather_flash_folded``: what it does now: the same gather, then the kernel without the mask
  over the real rows only, which lets it fold the query heads of a key head into one tile;
* ``triton_paged``: :func:`breakgraph.integrations.transformers.paged_decode.paged_decode`,
  which reads the cache through the index (no gather), one program per sequence and key head.

Variants take turns (9 rounds of 20 calls each, CUDA events); medians, lowest and highest in
µs. ``*_max_abs_diff`` is against the first variant (bf16). The JSON holds ``meta`` and one
row per ``shape/sequences``.

    python -m benchmarks.decode_attention --out decode-attention.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from breakgraph.integrations.transformers.attention import flash_varlen
from breakgraph.integrations.transformers.paged_decode import paged_decode

from benchmarks.environment import environment

#: (name, query heads, key heads, head size): the CB benchmark's shapes
SHAPES = (
    ("mixtral-1k-8l", 16, 4, 64),
    ("llama-1b", 32, 4, 64),
    ("qwen2.5-3b-12l", 16, 2, 128),
    ("llama3-8b-4l", 32, 8, 128),
    ("qwen3-0.6b", 16, 8, 128),
)
SEQUENCES = (32, 100, 256)
KEYS = (16, 1152)  # each sequence's cached keys: uniform in this range
ROUNDS, CALLS = 9, 20  # the variants take turns ROUNDS times, CALLS calls each
VARIANTS = ("gather_flash_causal", "gather_flash_folded", "triton_paged")


def one_case(q_heads: int, kv_heads: int, head_dim: int, seqs: int) -> dict:
    """Time the three variants on one random paged cache; return the JSON row."""
    dev, dt = "cuda", torch.bfloat16
    lens = torch.randint(KEYS[0], KEYS[1] + 1, (seqs,))
    total = int(lens.sum())
    slots = total + 4096
    k_cache = torch.randn(slots, kv_heads, head_dim, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    read_index = torch.randperm(slots, device=dev)[:total].to(torch.int32)
    cu_k = torch.zeros(seqs + 1, dtype=torch.int32, device=dev)
    cu_k[1:] = lens.cumsum(0).to(dev)
    cu_q = torch.arange(seqs + 1, dtype=torch.int32, device=dev)
    bucket = 1 << (seqs - 1).bit_length()
    q = torch.randn(bucket, q_heads, head_dim, device=dev, dtype=dt)
    max_k, scaling = int(lens.max()), head_dim**-0.5
    out = torch.zeros_like(q)
    cu_k_padded = torch.full((bucket + 1,), total, dtype=torch.int32, device=dev)
    cu_k_padded[: seqs + 1] = cu_k

    def gather():  # transformers' read of a full-attention layer
        return k_cache.index_select(0, read_index), v_cache.index_select(0, read_index)

    def gather_flash_causal():
        k, v = gather()
        o = flash_varlen(q, k, v, cu_q, cu_k, 1, max_k, scaling, None)
        o[seqs:].zero_()
        return o

    def gather_flash_folded():
        k, v = gather()
        r = flash_varlen(q[:seqs], k, v, cu_q, cu_k, 1, max_k, scaling, None, causal=False)
        return torch.nn.functional.pad(r, (0, 0, 0, 0, 0, bucket - seqs))

    def triton_paged():
        return paged_decode(q, k_cache, v_cache, read_index, cu_k_padded, scaling, out=out)

    functions = dict(zip(VARIANTS, (gather_flash_causal, gather_flash_folded, triton_paged)))
    row = {"hq": q_heads, "hkv": kv_heads, "d": head_dim, "seqs": seqs, "bucket": bucket,
           "keys": total, "kv_mib": 2 * total * kv_heads * head_dim * 2 / 2**20}  # fmt: skip
    reference = gather_flash_causal()[:seqs].float()
    for label, function in functions.items():
        got = function()
        row[label + "_max_abs_diff"] = (got[:seqs].float() - reference).abs().max().item()
        row[label + "_pad_zero"] = bool((got[seqs:] == 0).all())
    for _ in range(3):
        for function in functions.values():
            function()
    times = {label: [] for label in VARIANTS}
    for _ in range(ROUNDS):  # the variants take turns
        for label, function in functions.items():
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            for _ in range(CALLS):
                function()
            end.record()
            torch.cuda.synchronize()
            times[label].append(start.elapsed_time(end) / CALLS * 1000)
    for label, values in times.items():
        values.sort()
        row[label + "_us"] = {"median": values[len(values) // 2], "min": values[0],
                              "max": values[-1]}  # fmt: skip
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_attention: needs a CUDA GPU (FlashAttention-2 and Triton)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    results = {"meta": environment(cuda=True)}
    for name, q_heads, kv_heads, head_dim in SHAPES:
        for seqs in SEQUENCES:
            results[f"{name}/{seqs}"] = row = one_case(q_heads, kv_heads, head_dim, seqs)
            print(f"{name}/{seqs}", {k: row[k + "_us"]["median"] for k in VARIANTS}, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
