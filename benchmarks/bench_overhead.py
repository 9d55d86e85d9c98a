"""Per-break overhead: K segments of fixed GPU work separated by ``break_graph()``.

Compares, in one run, a breakable graph against one plain CUDA graph holding the
same kernels (and eager, for scale), in three regimes: tiny kernels, many kernels
per segment, large tensors. Prints a table and writes JSON.

    python -m benchmarks.bench_overhead --out overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import breakgraph

from .environment import environment

REGIMES = {
    # name: (elements per tensor, kernels per segment, segments)
    "tiny kernels": (1024, 1, 32),
    "many kernels per segment": (1024, 64, 16),
    "large tensors": (32 * 2**20, 2, 8),
}


def segment_work(x: torch.Tensor, kernels: int) -> None:
    for _ in range(kernels):
        x.add_(0.001)


def build(kernels: int, segments: int, x: torch.Tensor, breaks: bool):
    def run():
        for s in range(segments):
            segment_work(x, kernels)
            if breaks and s < segments - 1:
                breakgraph.break_graph()

    return run


def time_replays(replay, repeats: int, trials: int) -> list:
    """Median-friendly samples: seconds per replay, each over `repeats` back-to-back replays."""
    for _ in range(10):
        replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(repeats):
            replay()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / repeats)
    return samples


def measure(name: str, elements: int, kernels: int, segments: int, trials: int) -> dict:
    x = torch.randn(elements, device="cuda")
    run_full, run_broken = build(kernels, segments, x, False), build(kernels, segments, x, True)
    # warm up, then capture both
    for _ in range(3):
        run_full()
    torch.cuda.synchronize()
    full = torch.cuda.CUDAGraph()
    with torch.cuda.graph(full):
        run_full()
    # the floor of any breakable graph: the same segments as separate plain CUDA graphs,
    # launched back to back with nothing between them
    pool = torch.cuda.graph_pool_handle()
    separate = []
    for _ in range(segments):
        segment = torch.cuda.CUDAGraph()
        with torch.cuda.graph(segment, pool=pool):
            segment_work(x, kernels)
        separate.append(segment)

    def run_separate():
        for segment in separate:
            segment.replay()

    broken = breakgraph.BreakableCUDAGraph()
    with breakgraph.capture(broken, backend="cuda"):
        run_broken()
    assert broken.num_breaks == segments - 1, broken
    debugged = breakgraph.BreakableCUDAGraph()  # debug mode: checks, timers, NVTX (for scale)
    with breakgraph.capture(debugged, backend="cuda", debug=True):
        run_broken()
    repeats = 200 if elements < 2**20 else 20
    t_eager = statistics.median(time_replays(run_full, repeats, trials))
    t_full = statistics.median(time_replays(full.replay, repeats, trials))
    t_broken = statistics.median(time_replays(broken.replay, repeats, trials))
    t_separate = statistics.median(time_replays(run_separate, repeats, trials))
    t_full2 = statistics.median(time_replays(full.replay, repeats, trials))  # noise estimate
    t_debug = statistics.median(time_replays(debugged.replay, repeats, trials))
    breaks = segments - 1
    return {
        "regime": name,
        "elements": elements,
        "kernels_per_segment": kernels,
        "segments": segments,
        "breaks": breaks,
        "eager_us": t_eager * 1e6,
        "full_graph_us": t_full * 1e6,
        "full_graph_again_us": t_full2 * 1e6,
        "breakgraph_us": t_broken * 1e6,
        "separate_graphs_us": t_separate * 1e6,
        "floor_per_break_us": (t_separate - min(t_full, t_full2)) / breaks * 1e6,
        "added_per_break_us": (t_broken - min(t_full, t_full2)) / breaks * 1e6,
        "noise_per_break_us": abs(t_full - t_full2) / breaks * 1e6,
        "debug_mode_per_break_us": (t_debug - min(t_full, t_full2)) / breaks * 1e6,
        "ratio_to_full_graph": t_broken / min(t_full, t_full2),
        "ratio_to_eager": t_broken / t_eager,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--trials", type=int, default=15)
    args = parser.parse_args()
    rows = [measure(name, *spec, trials=args.trials) for name, spec in REGIMES.items()]
    print(
        f"{'regime':<26}{'breaks':>7}{'eager us':>10}{'graph us':>10}{'bg us':>10}{'+us/break':>11}"
        f"{'floor':>8}{'noise':>8}{'debug':>8}"
    )
    for r in rows:
        print(
            f"{r['regime']:<26}{r['breaks']:>7}{r['eager_us']:>10.1f}{r['full_graph_us']:>10.1f}"
            f"{r['breakgraph_us']:>10.1f}{r['added_per_break_us']:>11.2f}{r['floor_per_break_us']:>8.2f}"
            f"{r['noise_per_break_us']:>8.2f}{r['debug_mode_per_break_us']:>8.2f}"
        )
    if args.out:
        meta = {**environment(cuda=True), "trials": args.trials}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "overhead": rows}, f, indent=2)


if __name__ == "__main__":
    main()
