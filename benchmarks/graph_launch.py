"""What one ``cudaGraphLaunch`` costs the host, by the graph's number of nodes.

A pure-decode CB step replays one decode graph (:mod:`breakgraph.integrations.transformers.
decode_graph`): 547 nodes for qwen2.5-3b-12l (12 layers, the model's eager kernels), 246 under
``compile=True`` (``benchmarks/cb_trace.py`` counts the kernels each launch starts). The trace of
such a step shows the launch call itself holding the host for 0.55-0.70 ms (0.38-0.45 ms
compiled): host time the step cannot hide when the host, not the device, sets the pace. This
script measures the launch alone, on graphs of ``N`` tiny kernels (an in-place add on 128
floats each, so the device part is negligible), and fits ``fixed + per_node x N``:

* ``kernels``: ``N`` kernel nodes in one chain;
* ``copies``: the same chain with every fourth node a device-to-device copy (a memcpy node,
  as ``Tensor.copy_`` between like tensors captures), to see whether node kinds matter.

Each replay is timed on the host from the call to its return, with the device idle before it
(a sync between replays, outside the timed span), ``--reps`` times per graph, the graphs
taking turns; medians and the spread (25th-75th percentile) in µs.

On an H200 (about 15 s)::

    source scripts/setup_device.sh
    python3 -m benchmarks.graph_launch --out "$OUT/graph-launch.json"

Without CUDA it says so and exits 0 (nothing to measure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

NODES = (16, 64, 128, 256, 512, 1024)


def build(nodes: int, copies: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of ``nodes`` tiny nodes (in-place adds; with ``copies`` every fourth a copy)."""
    x = torch.zeros(128, device="cuda")
    y = torch.zeros(128, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        x.add_(1.0)
        y.copy_(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(nodes):
            if copies and i % 4 == 3:
                y.copy_(x)
            else:
                x.add_(1.0)
    torch.cuda.synchronize()
    return graph, x


def fit(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares ``fixed + per_node x N`` over ``{N: µs}``."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
    return my - slope * mx, slope


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_launch: no CUDA device, nothing to measure")
        return 0
    from benchmarks.environment import environment

    graphs = {(kind, n): build(n, kind == "copies")[0] for kind in ("kernels", "copies")
              for n in NODES}  # fmt: skip
    for graph in graphs.values():  # the first replays upload the graph
        for _ in range(3):
            graph.replay()
    torch.cuda.synchronize()
    times: dict[tuple, list[float]] = {key: [] for key in graphs}
    for _ in range(args.reps):
        for key, graph in graphs.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            times[key].append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    results = {"meta": environment(cuda=True), "reps": args.reps, "nodes": list(NODES)}
    for kind in ("kernels", "copies"):
        rows = {}
        for n in NODES:
            q = statistics.quantiles(times[(kind, n)], n=4)
            rows[n] = {"median_us": statistics.median(times[(kind, n)]), "p25_us": q[0],
                       "p75_us": q[2]}  # fmt: skip
        fixed, per_node = fit({n: r["median_us"] for n, r in rows.items()})
        results[kind] = {"by_nodes": rows, "fixed_us": fixed, "per_node_us": per_node}
        print(f"{kind:8s} " + "  ".join(f"{n}: {r['median_us']:.0f}" for n, r in rows.items())
              + f"  -> {fixed:.1f} us + {per_node:.3f} us/node")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
