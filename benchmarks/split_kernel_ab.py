"""The decode kernel's split count as a compile-time constant (before) against the grid's
third dimension and a plain argument (now): the same calls, taking turns (CUDA only).

Before, Triton compiled a split kernel and a combine kernel for each split count (2, 4, 8,
16) of each head shape; now one pair serves every count (``paged_decode``'s docstring). A
constant lets the compiler fold the share's arithmetic and unroll the combine's loads over
exactly ``splits`` rows; the argument costs a division on the device and a masked tile of
``MAX_SPLITS`` rows. This times what that costs: for each shape's heads (the CB shapes and
held-out ones), sequences and split count, the module before (``--before``: its source
file, e.g. from ``git show <commit>:integrations/transformers/paged_decode.py``) and the
current one, in turn (``ROUNDS`` rounds of ``CALLS`` calls each; µs per call between CUDA
events, launched from Python as an attention break launches them, and replayed from one CUDA
graph as a pure-decode graph does). Split 1 runs the unchanged single kernel: a control for
the noise. The JSON holds ``meta`` and one row per case with both trees' medians and ranges
and ``now_over_before`` (graph and launched).

First, in a process whose Triton cache starts empty (``TRITON_CACHE_DIR`` a new directory),
``warm_up`` of each tree for each CB shape's heads and both layouts (page 0 and 256) over the
CB buckets ``WARM_UP_BATCHES``, in turn (which tree goes first alternates; a launch of
another shape starts Triton before either): its seconds and the binaries it compiled
(``warm_up`` rows)::

    git show 7a08655:integrations/transformers/paged_decode.py > /tmp/paged_decode_before.py
    python -m benchmarks.split_kernel_ab --before /tmp/paged_decode_before.py --out ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import torch
from breakgraph.integrations.transformers import paged_decode as now_module

from benchmarks.decode_attention import (
    CALLS,
    HELD_OUT,
    SHAPES,
    _graph_of,
    _time_us,
    random_paged_cache,
)
from benchmarks.environment import environment

SEQUENCES = (8, 32, 100)
KEYS = (16, 4096)  # each sequence's cached keys: uniform in this range
SPLITS = (1, 2, 4, 8, 16)
ROUNDS = 9
#: the query buckets a CB manager of ``max_batch_tokens=2048`` captures (``default_query_buckets``)
WARM_UP_BATCHES = (32, 128, 512, 2048)
KERNELS = ("_paged_decode_kernel", "_paged_decode_split_kernel", "_paged_decode_combine_kernel")


def load_before(path: str):
    """The module at ``path`` (the kernels before), loaded under a name of its own."""
    spec = importlib.util.spec_from_file_location("paged_decode_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def binaries(module) -> int:
    """How many binaries Triton holds in this process for ``module``'s kernels."""
    total = 0
    for name in KERNELS:
        caches = getattr(getattr(module, name), "device_caches", {})  # Triton 3.2 on
        total += sum(len(entry[0]) for entry in caches.values())
    return total


def warm_up_times(before) -> list[dict]:
    """Each tree's ``warm_up`` per CB shape and page, in turn: seconds and binaries compiled."""
    device = torch.device("cuda")
    # start Triton with a shape no row uses (8 heads of 16), so neither tree pays for it
    q, cache = (torch.zeros(n, 8, 16, device=device, dtype=torch.bfloat16) for n in (2, 16))
    index = torch.zeros(16, dtype=torch.long, device=device)
    no_keys = torch.zeros(3, dtype=torch.int32, device=device)
    now_module.paged_decode(q, cache, cache, index, no_keys, 0.25, splits=1)
    torch.cuda.synchronize()
    rows, turn = [], 0
    for name, q_heads, kv_heads, head_dim in SHAPES:
        for page in (256, 0):
            trees = [("before", before), ("now", now_module)]
            for tree, module in trees if turn % 2 == 0 else trees[::-1]:
                count = binaries(module)
                start = time.perf_counter()
                splits = module.warm_up(q_heads, kv_heads, head_dim, WARM_UP_BATCHES,
                                        torch.bfloat16, device, page)  # fmt: skip
                torch.cuda.synchronize()
                rows.append({"shape": name, "page": page, "tree": tree, "splits": splits,
                             "s": time.perf_counter() - start,
                             "binaries": binaries(module) - count})  # fmt: skip
                print(f"warm_up {name:>16} page {page:>3} {tree:>6}: {rows[-1]['s']:.2f} s, "
                      f"{rows[-1]['binaries']} binaries, splits {splits}", flush=True)
            turn += 1
    return rows


def one_case(before, q_heads: int, kv_heads: int, head_dim: int, seqs: int) -> dict:
    """Both trees at every split count on one random paged cache: the rows for this case."""
    _, total, k_cache, v_cache, read_index, cu_k = random_paged_cache(
        kv_heads, head_dim, seqs, KEYS, torch.int64)  # int64, as the breaks read it  # fmt: skip
    q = torch.randn(seqs, q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    scaling = head_dim**-0.5
    rows = []
    for splits in SPLITS:
        calls = {
            tree: (lambda m=module, s=splits: m.paged_decode(
                q, k_cache, v_cache, read_index, cu_k, scaling, out=out, splits=s))
            for tree, module in (("before", before), ("now", now_module))
        }  # fmt: skip
        results = {tree: call().clone() for tree, call in calls.items()}
        diff = (results["now"].float() - results["before"].float()).abs().max().item()
        graphs = {tree: _graph_of(call) for tree, call in calls.items()}
        launched = {tree: [] for tree in calls}
        replayed = {tree: [] for tree in calls}
        for _ in range(ROUNDS):  # the trees take turns
            for tree, call in calls.items():
                launched[tree].append(_time_us(lambda c=call: [c() for _ in range(CALLS)]))
                replayed[tree].append(_time_us(graphs[tree].replay))
        row = {"heads": [q_heads, kv_heads, head_dim], "seqs": seqs, "keys": total,
               "splits": splits, "max_abs_diff": diff}  # fmt: skip
        for kind, measured in (("launched", launched), ("graph", replayed)):
            for tree, values in measured.items():
                row[f"{tree}_{kind}_us"] = {"median": statistics.median(values),
                                            "min": min(values), "max": max(values)}  # fmt: skip
            row[f"now_over_before_{kind}"] = (
                row[f"now_{kind}_us"]["median"] / row[f"before_{kind}_us"]["median"]
            )
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the paged_decode.py to compare with")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("split_kernel_ab: needs a CUDA GPU (Triton)", file=sys.stderr)
        return 2
    before = load_before(args.before)
    torch.manual_seed(0)
    results = {"meta": environment(cuda=True), "keys": list(KEYS), "rounds": ROUNDS,
               "calls": CALLS, "rows": []}  # fmt: skip
    results["warm_up"] = warm_up_times(before)
    for name, q_heads, kv_heads, head_dim in SHAPES + HELD_OUT[:2]:
        for seqs in SEQUENCES:
            for row in one_case(before, q_heads, kv_heads, head_dim, seqs):
                row["shape"] = name
                row["held_out"] = (name, q_heads, kv_heads, head_dim) in HELD_OUT
                results["rows"].append(row)
                print(f"{name:>16} {seqs:>3} seqs splits {row['splits']:>2}: now/before "
                      f"graph {row['now_over_before_graph']:.3f} launched "
                      f"{row['now_over_before_launched']:.3f} (before "
                      f"{row['before_graph_us']['median']:.1f} us) diff {row['max_abs_diff']:.3g}",
                      flush=True)  # fmt: skip
        with open(args.out, "w") as f:  # what is measured so far
            json.dump(results, f, indent=1)
    graph = [r["now_over_before_graph"] for r in results["rows"] if r["splits"] > 1]
    print(f"split rows, now/before in a graph: median {statistics.median(graph):.3f}, "
          f"{min(graph):.3f}-{max(graph):.3f}")
    for tree in ("before", "now"):
        warm = [r for r in results["warm_up"] if r["tree"] == tree]
        print(f"warm_up {tree}: {sum(r['s'] for r in warm):.1f} s, "
              f"{sum(r['binaries'] for r in warm)} binaries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
