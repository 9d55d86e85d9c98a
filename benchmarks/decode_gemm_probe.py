"""How close a decode step's GEMMs come to HBM bandwidth, as the model has them and fused.

A pure-decode CB step reads every weight once for ``B`` rows (``B`` = the requests in the
step, about 100 in ``bench_cb``): its floor is the weight bytes over HBM bandwidth. The trace of
qwen2.5-3b-12l's step on the H200 (``cb_trace``) puts its dense GEMMs at 1.03 ms against a
0.52 ms weight floor: about half of the bandwidth. HF's decoder layers run seven GEMMs per
layer (q, k, v, o, gate, up, down); the k and v projections of a GQA model are small (256 or
1024 output rows), and small GEMMs reach less of the bandwidth. This script measures, on
random bf16 weights of each CB shape's layers (several layers, so the weights do not sit in
L2), one graph replaying the layers' GEMMs:

* ``separate``: the seven GEMMs as the model runs them;
* ``fused``: q/k/v as one GEMM and gate/up as one (what an engine that owns the weights runs);

and the tied or untied head (``head``: vocabulary x hidden) alone, for ``B`` in ``--rows``.
With ``--autotune``, also ``separate_autotuned`` and ``head_autotuned``: the same GEMMs, each
through ``torch.compile(mode="max-autotune-no-cudagraphs")`` at static shapes, where Inductor
times cuBLAS against its Triton GEMM templates for each shape and keeps the faster (what
``compile={"mode": "max-autotune-no-cudagraphs", "dynamic": False}`` would give a decoder).
Each variant is replayed ``--reps`` times, the variants taking turns; medians of CUDA-event
times per replay, reported per layer, with the achieved bytes per second and its share of
the card's HBM bandwidth (``roofline.CARDS``; ``--hbm-tbs`` for another card).

On an H200 (about 20 s)::

    source scripts/setup_device.sh
    python3 -m benchmarks.decode_gemm_probe --out "$OUT/decode-gemm.json"

Without CUDA it says so and exits 0 (nothing to measure).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch

from benchmarks import roofline

# (name, hidden, q heads, kv heads, head dim, intermediate, vocabulary, layers replayed)
SHAPES = (
    ("qwen2.5-3b-12l", 2048, 16, 2, 128, 11008, 151936, 4),
    ("llama3-8b-4l", 4096, 32, 8, 128, 14336, 128256, 2),
)


def layer_weights(hidden, heads, kv_heads, dim, inter, fused: bool) -> list[torch.Tensor]:
    """One layer's GEMM weights ``[out, in]`` in the order the layer runs them."""

    def w(out, inp):
        return torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * 0.02

    if fused:
        return [w((heads + 2 * kv_heads) * dim, hidden), w(hidden, heads * dim),
                w(2 * inter, hidden), w(hidden, inter)]  # fmt: skip
    kv = kv_heads * dim
    return [w(heads * dim, hidden), w(kv, hidden), w(kv, hidden), w(hidden, heads * dim),
            w(inter, hidden), w(inter, hidden), w(hidden, inter)]  # fmt: skip


def autotuned_linear():
    """``F.linear`` under Inductor's max-autotune, one compile per shape (static)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 256  # one entry per GEMM shape and row count
    torch._dynamo.config.accumulated_recompile_limit = 4096
    return torch.compile(torch.nn.functional.linear, mode="max-autotune-no-cudagraphs",
                         dynamic=False)  # fmt: skip


def build(rows: int, layers: list[list[torch.Tensor]], linear=None) -> torch.cuda.CUDAGraph:
    """One graph of every layer's GEMMs at ``rows`` rows (inputs of the right widths, reused)."""
    widths = {w.shape[1] for ws in layers for w in ws}
    inputs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in widths}
    linear = linear or torch.nn.functional.linear

    def run():
        for ws in layers:
            for w in ws:
                linear(inputs[w.shape[1]], w)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up: cuBLAS picks its kernels and workspace outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def time_graphs(graphs: dict, reps: int) -> dict[str, list[float]]:
    """Milliseconds per replay of each graph, the graphs taking turns."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for graph in graphs.values():
        graph.replay()  # first replay: uploads the graph
    torch.cuda.synchronize()
    for _ in range(reps):
        for name, graph in graphs.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return times


def probe(shape: tuple, rows_list, reps: int, hbm: float, autotune: bool = False) -> dict:
    name, hidden, heads, kv_heads, dim, inter, vocab, count = shape
    results = {"shape": name, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
               "head_dim": dim, "intermediate": inter, "vocab": vocab, "layers": count,
               "rows": {}}  # fmt: skip
    weights = {
        fused: [layer_weights(hidden, heads, kv_heads, dim, inter, fused) for _ in range(count)]
        for fused in (False, True)
    }
    head = [[torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02]]
    layer_bytes = sum(w.numel() * w.element_size() for w in weights[False][0])
    head_bytes = head[0][0].numel() * 2
    for rows in rows_list:
        graphs = {"separate": build(rows, weights[False]), "fused": build(rows, weights[True]),
                  "head": build(rows, head)}  # fmt: skip
        if autotune:
            linear = autotuned_linear()
            graphs["separate_autotuned"] = build(rows, weights[False], linear)
            graphs["head_autotuned"] = build(rows, head, linear)
        times = time_graphs(graphs, reps)
        row = {}
        for variant, ms in times.items():
            is_head = variant.startswith("head")
            div = 1 if is_head else count  # head: one GEMM; layers: per layer
            per, quartiles = statistics.median(ms) / div, statistics.quantiles(ms, n=4)
            size = head_bytes if is_head else layer_bytes
            row[variant] = {
                "ms_per_layer" if not is_head else "ms": per,
                "p25_p75_ms": [quartiles[0] / div, quartiles[2] / div],
                "floor_ms": size / hbm * 1e3,
                "bandwidth_share": size / hbm * 1e3 / per,
            }
        row["fused_over_separate"] = row["fused"]["ms_per_layer"] / row["separate"]["ms_per_layer"]
        results["rows"][rows] = row
        del graphs
    results["layer_bytes"], results["head_bytes"] = layer_bytes, head_bytes
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="decode-gemm.json")
    parser.add_argument("--rows", default="32,64,100,128")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--hbm-tbs", type=float, default=None,
                        help="HBM bandwidth for the shares, TB/s (default: the card's)")
    parser.add_argument("--autotune", action="store_true",
                        help="also each GEMM through Inductor's max-autotune (minutes)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_gemm_probe: no CUDA device here: nothing to measure")
        return 0
    rows = [int(r) for r in args.rows.split(",")]
    hbm = roofline.floor_peaks(args.hbm_tbs, None, torch.cuda.get_device_name())[0]
    out = {
        "meta": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "hbm_bytes_per_s": hbm,
            "reps": args.reps,
            "autotune": args.autotune,
            "date": datetime.date.today().isoformat(),
        },  # fmt: skip
        "shapes": [probe(shape, rows, args.reps, hbm, args.autotune)
                   for shape in SHAPES],
    }
    for shape in out["shapes"]:
        for r, row in shape["rows"].items():
            separate = row["separate"]
            print(
                f"{shape['shape']} rows {r}: separate {separate['ms_per_layer']:.4f} ms/layer "
                f"({separate['bandwidth_share']:.0%} of HBM), fused "
                f"{row['fused']['ms_per_layer']:.4f} ({row['fused']['bandwidth_share']:.0%}), "
                f"head {row['head']['ms']:.4f} ms ({row['head']['bandwidth_share']:.0%})"
            )
            if "separate_autotuned" in row:
                tuned, head = row["separate_autotuned"], row["head_autotuned"]
                print(f"  autotuned: separate {tuned['ms_per_layer']:.4f} ms/layer "
                      f"({tuned['bandwidth_share']:.0%}), head {head['ms']:.4f} ms "
                      f"({head['bandwidth_share']:.0%})")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
