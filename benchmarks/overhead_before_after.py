"""Per-break overhead of two versions of breakgraph in one process, taking turns.

Issue 12 restructured the capture/replay path; its rule is that per-break overhead stays
the same within noise. This loads an earlier version of the package under another name
(``breakgraph_before``, from a folder holding its ``breakgraph/``) beside the current one,
captures the same segments with both (the regimes of ``bench_overhead``), and times their
replays in turns (the order rotates every trial), with one plain CUDA graph of the same
kernels as the floor.

Usage (GPU)::

    mkdir -p /tmp/before && git archive daefd8e breakgraph | tar -x -C /tmp/before
    python -m benchmarks.overhead_before_after --before /tmp/before --out before-after.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

import breakgraph

from .bench_overhead import REGIMES, segment_work
from .environment import environment


def load_before(folder: str):
    """The package in ``folder/breakgraph`` imported as ``breakgraph_before``."""
    root = os.path.join(folder, "breakgraph")
    spec = importlib.util.spec_from_file_location(
        "breakgraph_before", os.path.join(root, "__init__.py"), submodule_search_locations=[root]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["breakgraph_before"] = module
    spec.loader.exec_module(module)
    return module


def capture_with(package, x: torch.Tensor, kernels: int, segments: int):
    graph = package.BreakableCUDAGraph()
    with package.capture(graph, backend="cuda"):
        for s in range(segments):
            segment_work(x, kernels)
            if s < segments - 1:
                package.break_graph()
    return graph


def measure(before, name: str, elements: int, kernels: int, segments: int, trials: int) -> dict:
    x = torch.randn(elements, device="cuda")
    for _ in range(3):
        segment_work(x, kernels * segments)
    torch.cuda.synchronize()
    full = torch.cuda.CUDAGraph()
    with torch.cuda.graph(full):
        for _ in range(segments):
            segment_work(x, kernels)
    variants = {
        "full_graph": full.replay,
        "after": capture_with(breakgraph, x, kernels, segments).replay,
        "before": capture_with(before, x, kernels, segments).replay,
    }
    repeats = 200 if elements < 2**20 else 20
    samples: dict = {k: [] for k in variants}
    names = list(variants)
    for replay in variants.values():
        for _ in range(10):
            replay()
    torch.cuda.synchronize()
    for trial in range(trials):
        order = names[trial % 3 :] + names[: trial % 3]
        for key in order:
            replay = variants[key]
            start = time.perf_counter()
            for _ in range(repeats):
                replay()
            torch.cuda.synchronize()
            samples[key].append((time.perf_counter() - start) / repeats * 1e6)
    med = {k: statistics.median(v) for k, v in samples.items()}
    breaks = segments - 1
    per_break = {k: (med[k] - med["full_graph"]) / breaks for k in ("before", "after")}
    spread = {
        k: (min(samples[k]) - med["full_graph"]) / breaks for k in ("before", "after")
    }  # fmt: skip
    return {
        "regime": name,
        "breaks": breaks,
        "full_graph_us": med["full_graph"],
        "before_us": med["before"],
        "after_us": med["after"],
        "added_per_break_before_us": per_break["before"],
        "added_per_break_after_us": per_break["after"],
        "best_trial_per_break_us": spread,
        "after_minus_before_per_break_us": per_break["after"] - per_break["before"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="folder holding the earlier breakgraph/")
    parser.add_argument("--out")
    parser.add_argument("--trials", type=int, default=21)
    args = parser.parse_args()
    before = load_before(args.before)
    rows = [measure(before, name, *spec, trials=args.trials) for name, spec in REGIMES.items()]
    print(f"{'regime':<26}{'breaks':>7}{'before us/break':>17}{'after us/break':>16}{'diff':>8}")
    for r in rows:
        print(
            f"{r['regime']:<26}{r['breaks']:>7}{r['added_per_break_before_us']:>17.2f}"
            f"{r['added_per_break_after_us']:>16.2f}{r['after_minus_before_per_break_us']:>8.2f}"
        )
    if args.out:
        meta = {**environment(cuda=True), "trials": args.trials, "before": args.before}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
