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

NODES = (16, 64, 256, 1024)
MODEL_LAYERS = (2, 8)


KINDS = ("kernels", "copies", "gemm", "triton", "model")


def _op(kind: str):
    """One node's work of ``kind`` (called ``nodes`` times inside the capture)."""
    if kind in ("kernels", "copies"):
        x, y = torch.zeros(128, device="cuda"), torch.zeros(128, device="cuda")
        count = [0]

        def op():
            count[0] += 1
            if kind == "copies" and count[0] % 4 == 0:
                y.copy_(x)
            else:
                x.add_(1.0)

        return op
    if kind == "gemm":  # cuBLAS, decode-shaped: 100 rows of bf16
        a = torch.randn(100, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(100, 256, device="cuda", dtype=torch.bfloat16)
        return lambda: torch.mm(a, w, out=out)
    if kind == "triton":  # breakgraph's decode kernel, 8 sequences of 64 keys
        from breakgraph.integrations.transformers.paged_decode import paged_decode

        q = torch.randn(8, 8, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(600, 2, 64, device="cuda", dtype=torch.bfloat16)
        index = torch.arange(512, device="cuda")
        cu_k = torch.arange(0, 513, 64, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        return lambda: paged_decode(q, k, k, index, cu_k, 0.125, out=out, splits=1)
    raise ValueError(kind)


def capture(op, repeats: int) -> tuple[torch.cuda.CUDAGraph, object]:
    """``op`` called ``repeats`` times in one graph (warmed up outside the capture first), and
    ``op`` itself: keep it, it holds the tensors the graph reads."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            op()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            op()
    torch.cuda.synchronize()
    return graph, op


def build(nodes: int, kind: str) -> tuple[torch.cuda.CUDAGraph, object]:
    """A graph of ``nodes`` nodes of ``kind`` (:func:`capture`)."""
    return capture(_op(kind), nodes)


def build_model(layers: int) -> tuple[torch.cuda.CUDAGraph, object]:
    """A decode-shaped stack of Llama-like layers in plain torch (bf16, 100 rows, hidden 2048:
    RMS norms, q/k/v/o and gated-MLP GEMMs, a rotary-like product, residual adds; no
    attention), captured whole (:func:`capture`): the node mix of a decode graph."""
    rows, hidden, inner = 100, 2048, 5632
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, hidden, **bf16)
    weights = [[torch.randn(hidden, n, **bf16) * 0.02 for n in (hidden, 512, 512, hidden)]
               + [torch.randn(hidden, 2 * inner, **bf16) * 0.02,
                  torch.randn(inner, hidden, **bf16) * 0.02] for _ in range(layers)]  # fmt: skip
    cos, sin = torch.randn(rows, hidden, **bf16), torch.randn(rows, hidden, **bf16)

    def norm(h):
        h32 = h.float()
        return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)

    def op():
        h = x
        for wq, wk, wv, wo, wgu, wd in weights:
            a = norm(h)
            q, k, v = a @ wq, a @ wk, a @ wv
            q = q * cos + torch.cat([-q[:, hidden // 2:], q[:, : hidden // 2]], -1) * sin
            h = h + (q + (k.sum() + v.sum()) * 0) @ wo
            gate, up = (norm(h) @ wgu).chunk(2, -1)
            h = h + (torch.nn.functional.silu(gate) * up) @ wd
        return h

    return capture(op, 1)


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

    built = {(kind, n): build(n, kind) for kind in KINDS[:-1] for n in NODES}
    built.update({("model", layers): build_model(layers) for layers in MODEL_LAYERS})
    graphs = {key: graph for key, (graph, _) in built.items()}  # `built` keeps their tensors
    other = torch.cuda.Stream()
    for graph in graphs.values():  # the first replays upload the graph
        for _ in range(3):
            graph.replay()
    torch.cuda.synchronize()
    times: dict[tuple, list[float]] = {key: [] for key in graphs}
    times["other stream"] = []  # the largest model graph, replayed on another stream
    for _ in range(args.reps):
        for key, graph in graphs.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            times[key].append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
        with torch.cuda.stream(other):
            start = time.perf_counter()
            graphs[("model", MODEL_LAYERS[-1])].replay()
            times["other stream"].append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    results = {"meta": environment(cuda=True), "reps": args.reps, "nodes": list(NODES)}

    def row(samples):
        q = statistics.quantiles(samples, n=4)
        return {"median_us": statistics.median(samples), "p25_us": q[0], "p75_us": q[2]}

    for kind in KINDS:
        sizes = MODEL_LAYERS if kind == "model" else NODES
        rows = {n: row(times[(kind, n)]) for n in sizes}
        results[kind] = {"by_size": rows}
        line = "  ".join(f"{n}: {r['median_us']:.0f}" for n, r in rows.items())
        if kind != "model":
            fixed, per_node = fit({n: r["median_us"] for n, r in rows.items()})
            results[kind].update(fixed_us=fixed, per_node_us=per_node)
            line += f"  -> {fixed:.1f} us + {per_node:.3f} us/node"
        print(f"{kind:8s} {line}" + ("  (by layers)" if kind == "model" else ""))
    results["model_other_stream"] = row(times["other stream"])
    print(f"model, {MODEL_LAYERS[-1]} layers, on another stream: "
          f"{results['model_other_stream']['median_us']:.0f}")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
