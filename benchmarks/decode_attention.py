"""One layer's attention in a pure-decode CB step, three ways (CUDA only).

Every CB shape's heads, 32 / 100 / 256 sequences of 16–1152 cached keys each in a paged cache
whose slots are in random order (what transformers' allocator hands out after a while):

* ``gather_flash_causal``: what breakgraph's break did before: transformers' ``index_select``
  of every key and value the step reads (the *gather*), then FlashAttention-2's varlen kernel,
  causal, over the bucket's padded query rows;
* ``gather_flash_folded``: what it does now: the same gather, then the kernel without the mask
  over the real rows only, which lets it fold the query heads of a key head into one tile;
* ``triton_paged``: :func:`breakgraph.integrations.transformers.paged_decode.paged_decode`
  with ``splits=1``, which reads the cache through the index (no gather), one program per
  sequence and key head (what it did before the split);
* ``triton_paged_split``: the same with its default split (:func:`default_splits`): each
  sequence's keys shared by several programs, then one kernel combines their results.

``sweep_us`` times the kernel at every split count (1–16) and block of keys (64, 128) beside
the variants (keys ``<splits>-block<n>``), so the defaults can be checked against the best
setting of each case. ``HELD_OUT`` shapes (rows with ``"held_out": true``) were not among those
the defaults were picked on: the same cases, to check that the defaults carry over.

``THRESHOLD`` rows (``"threshold": true``, key ``<shape>/<sequences>-upto<L>``: keys uniform in
L/2..L, the longest in ``max_keys``) time only ``triton_paged`` and ``triton_paged_split``,
launched, at the lengths around the break path's split rule (``paged_decode.break_split``): an
attention break launches its kernels one at a time, so it splits only where the split's second
launch costs less than it saves. ``--threshold-only``
times only these rows, for the held-out shapes too, at ``--lengths`` (a finer grid around the
threshold)::

    python -m benchmarks.decode_attention --threshold-only --lengths 3072,4096,5120 --out t.json

Variants take turns (9 rounds of 20 calls each, CUDA events); medians, lowest and highest in
µs. Each is timed twice: ``<variant>_us`` launches the 20 calls from Python (a short kernel
is then bound by the host's launches, as in an attention break), ``<variant>_graph_us``
replays them captured in one CUDA graph (the device's time only, as inside a pure-decode
graph). ``*_max_abs_diff`` is against ``gather_flash_causal`` (bf16). The JSON holds ``meta``
and one row per ``shape/sequences``.

    python -m benchmarks.decode_attention --out decode-attention.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from breakgraph.integrations.transformers.attention import flash_varlen
from breakgraph.integrations.transformers.paged_decode import default_splits, paged_decode

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
#: shapes the split defaults were not picked on (rows marked ``held_out``)
HELD_OUT = (
    ("qwen2-1.5b", 12, 2, 128),
    ("qwen3-moe-30b", 32, 4, 128),
    ("gemma-2b", 8, 1, 256),
    ("gemma-2-2b", 8, 4, 256),
)
#: and a long-context case: few sequences of many keys each (row ``shape/8-long``)
LONG = (8, (4096, 16384))
#: the break path's split threshold: (sequences, longest keys) per shape of SHAPES
THRESHOLD = ((8, 32), (1024, 1536, 2048, 3072, 4096, 6144))
ROUNDS, CALLS = 9, 20  # the variants take turns ROUNDS times, CALLS calls each
VARIANTS = ("gather_flash_causal", "gather_flash_folded", "triton_paged", "triton_paged_split")
SWEEP = (1, 2, 4, 8, 16)  # split counts and blocks of keys the sweep times
BLOCKS = (64, 128)


def random_paged_cache(kv_heads: int, head_dim: int, seqs: int, keys,
                       index_dtype=torch.int32) -> tuple:  # fmt: skip
    """A bf16 paged cache on the GPU holding ``seqs`` sequences of ``keys[0]..keys[1]`` keys in
    random slots (4096 spare): ``(lens, total, k_cache, v_cache, read_index, cu_k)``."""
    dev, dt = "cuda", torch.bfloat16
    lens = torch.randint(keys[0], keys[1] + 1, (seqs,))
    total = int(lens.sum())
    slots = total + 4096
    k_cache = torch.randn(slots, kv_heads, head_dim, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    read_index = torch.randperm(slots, device=dev)[:total].to(index_dtype)
    cu_k = torch.zeros(seqs + 1, dtype=torch.int32, device=dev)
    cu_k[1:] = lens.cumsum(0).to(dev)
    return lens, total, k_cache, v_cache, read_index, cu_k


def one_case(q_heads: int, kv_heads: int, head_dim: int, seqs: int, keys=KEYS,
             variants=VARIANTS, sweep: bool = True) -> dict:  # fmt: skip
    """Time ``variants`` (and the sweep) on one random paged cache; return the JSON row."""
    dev, dt = "cuda", torch.bfloat16
    lens, total, k_cache, v_cache, read_index, cu_k = random_paged_cache(
        kv_heads, head_dim, seqs, keys)  # fmt: skip
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

    def split_by(splits, block_n=None):  # None: paged_decode's defaults
        def triton_paged():
            return paged_decode(q, k_cache, v_cache, read_index, cu_k_padded, scaling, out=out,
                                splits=splits, block_n=block_n)  # fmt: skip

        return triton_paged

    functions = dict(zip(VARIANTS, (gather_flash_causal, gather_flash_folded, split_by(1),
                                    split_by(None))))  # fmt: skip
    functions = {label: functions[label] for label in variants}
    for block in BLOCKS if sweep else ():  # the kernel at every split count and block of keys
        functions.update({f"splits_{n}-block{block}": split_by(n, block) for n in SWEEP})
    row = {"hq": q_heads, "hkv": kv_heads, "d": head_dim, "seqs": seqs, "bucket": bucket,
           "keys": total, "max_keys": max_k, "kv_mib": 2 * total * kv_heads * head_dim * 2 / 2**20,
           "default_splits": default_splits(bucket, kv_heads, q.device)}  # fmt: skip
    reference = gather_flash_causal()[:seqs].float()
    for label, function in functions.items():
        if label.startswith("splits_"):
            continue
        got = function()
        row[label + "_max_abs_diff"] = (got[:seqs].float() - reference).abs().max().item()
        row[label + "_pad_zero"] = bool((got[seqs:] == 0).all())
    for _ in range(3):
        for function in functions.values():
            function()
    graphs = {label: _graph_of(function) for label, function in functions.items()}
    times = {label: [] for label in functions}
    graph_times = {label: [] for label in functions}
    for _ in range(ROUNDS):  # the variants take turns, launched and then replayed in a graph
        for label, function in functions.items():
            times[label].append(_time_us(lambda: [function() for _ in range(CALLS)]))
            if graphs[label] is not None:
                graph_times[label].append(_time_us(graphs[label].replay))
    for suffix, measured in (("_us", times), ("_graph_us", graph_times)):
        for label, values in measured.items():
            if not values:
                continue
            values.sort()
            summary = {"median": values[len(values) // 2], "min": values[0], "max": values[-1]}
            if label.startswith("splits_"):
                row.setdefault("sweep" + suffix, {})[label.removeprefix("splits_")] = summary
            else:
                row[label + suffix] = summary
    return row


def _graph_of(function):
    """``CALLS`` calls of ``function`` captured in one CUDA graph (what a decode graph replays:
    no host launch per call), or None where the call cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        function()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                function()
    except RuntimeError:
        return None
    return graph


def _time_us(run) -> float:
    """µs per call of ``run`` (``CALLS`` calls) between CUDA events."""
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS * 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--replay-max-keys", metavar="JSON",
                        help="add each row's longest sequence to a run's file written before "
                             "rows recorded it (see replay_max_keys), then exit")  # fmt: skip
    parser.add_argument("--threshold-only", action="store_true",
                        help="only the threshold rows, for SHAPES and HELD_OUT (no sweep)")
    parser.add_argument("--lengths", default=",".join(map(str, THRESHOLD[1])),
                        help="the threshold rows' longest keys, comma-separated")  # fmt: skip
    args = parser.parse_args(argv)
    if args.replay_max_keys:
        with open(args.replay_max_keys) as f:
            data = replay_max_keys(json.load(f))
        _write(args.replay_max_keys, data)
        return 0
    if not args.out:
        parser.error("--out is required")
    lengths = tuple(int(n) for n in args.lengths.split(","))
    if not torch.cuda.is_available():
        print("decode_attention: needs a CUDA GPU (FlashAttention-2 and Triton)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    results = {"meta": environment(cuda=True)}
    results["meta"]["multiprocessors"] = torch.cuda.get_device_properties(0).multi_processor_count
    if args.threshold_only:
        _threshold(SHAPES, lengths, results, args.out)
        _threshold(HELD_OUT, lengths, results, args.out, held_out=True)
        return 0
    _sweep(SHAPES, results, args.out)
    _threshold(SHAPES, lengths, results, args.out)
    _sweep(HELD_OUT, results, args.out, held_out=True)
    return 0


def _threshold(shapes, lengths, results: dict, path: str, held_out: bool = False) -> None:
    """The ``THRESHOLD`` rows: the unsplit and the default split kernel, launched, for each
    sequence count and longest key count of ``lengths`` (keys uniform in L/2..L)."""
    pair = ("triton_paged", "triton_paged_split")
    for name, q_heads, kv_heads, head_dim in shapes:
        for seqs in THRESHOLD[0]:
            for longest in lengths:
                label = f"{name}/{seqs}-upto{longest}"
                results[label] = row = one_case(
                    q_heads, kv_heads, head_dim, seqs, (longest // 2, longest), pair, sweep=False
                )
                row["threshold"], row["longest"], row["held_out"] = True, longest, held_out
                print(label, {k: round(row[k + "_us"]["median"], 1) for k in pair}, flush=True)
        _write(path, results)


def _sweep(shapes, results: dict, path: str, held_out: bool = False) -> None:
    """Every variant and the sweep at each of ``SEQUENCES`` and the ``LONG`` case, per shape."""
    for name, q_heads, kv_heads, head_dim in shapes:
        cases = [(f"{name}/{seqs}", seqs, KEYS) for seqs in SEQUENCES]
        cases.append((f"{name}/{LONG[0]}-long", *LONG))
        for label, seqs, keys in cases:
            results[label] = row = one_case(q_heads, kv_heads, head_dim, seqs, keys)
            row["held_out"] = held_out
            print(label, {k: round(row[k + "_us"]["median"], 1) for k in VARIANTS},
                  {k: round(v["median"], 1) for k, v in row.get("sweep_graph_us", {}).items()},
                  flush=True)  # fmt: skip
        _write(path, results)


def replay_max_keys(data: dict) -> dict:
    """``data`` (a run's JSON) with each row's ``max_keys``, for runs from before rows recorded
    it: the run seeds the CPU generator once and draws each row's key counts from it (the only
    CPU draw per row; the caches are drawn on the GPU), so replaying the draws in the file's row
    order gives them back. Raises ``ValueError`` unless every replayed row's total equals its
    recorded ``keys``; ``meta["max_keys"]`` says the values were replayed.

    >>> replay_max_keys({"meta": {}})["meta"]["max_keys"]
    'replayed from the seed (every row total matched)'
    """
    generator = torch.Generator().manual_seed(0)  # what torch.manual_seed(0) seeds on the CPU
    for case, row in data.items():
        if case == "meta":
            continue
        if row.get("threshold"):
            keys = (row["longest"] // 2, row["longest"])
        else:
            keys = LONG[1] if case.endswith("-long") else KEYS
        lens = torch.randint(keys[0], keys[1] + 1, (row["seqs"],), generator=generator)
        if int(lens.sum()) != row["keys"]:
            raise ValueError(f"{case}: replayed {int(lens.sum())} keys, the run recorded "
                             f"{row['keys']}; not this run's draws")  # fmt: skip
        row["max_keys"] = int(lens.max())
    data["meta"]["max_keys"] = "replayed from the seed (every row total matched)"
    return data


def _write(path: str, results: dict) -> None:
    """Write what is measured so far (a run stopped by a time limit keeps it)."""
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
