"""Turn the committed benchmark JSON into docs/performance.md and its plots.

Deterministic: the same JSON gives the same page (a test checks the committed page).

    python benchmarks/report.py                      # docs/results/h200-*.json -> docs/performance.md
    python benchmarks/report.py --pytest-benchmark bench.json   # also the pytest-benchmark suite
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(HERE, "..", "docs")
RESULTS = os.path.join(DOCS, "results")
SUITE_JSON = os.path.join(RESULTS, "h200-pytest-benchmark.json")


def _load(name: str):
    path = os.path.join(RESULTS, name)
    return json.load(open(path)) if os.path.exists(path) else None


def _ms(row: dict, key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "-"


def overhead_section(data: dict) -> list:
    lines = [
        "## Per-break overhead",
        "",
        "K segments of fixed GPU work separated by `break_graph()` against ONE CUDA graph holding",
        "the same kernels (`benchmarks/bench_overhead.py`). *floor* is the same segments as separate",
        "plain `torch.cuda.CUDAGraph`s launched back to back with nothing between them: the cost of",
        "cutting a graph at all, which any breakable graph pays. Medians of 15 trials.",
        "",
        "| regime | breaks | eager µs | one graph µs | breakgraph µs | added per break µs | floor per break µs | target ≤ 2 µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["overhead"]:
        ok = "met" if r["added_per_break_us"] <= 2.0 else "missed"
        lines.append(
            f"| {r['regime']} ({r['kernels_per_segment']} kernel(s) × {r['elements']} floats per segment) "
            f"| {r['breaks']} | {r['eager_us']:.1f} | {r['full_graph_us']:.1f} | {r['breakgraph_us']:.1f} "
            f"| {r['added_per_break_us']:.2f} | {r['floor_per_break_us']:.2f} | {ok} |"
        )
    lines += [
        "",
        "![per-break overhead](img/overhead.png)",
        "",
        "Where it loses: when the GPU is the bottleneck (many kernels, large tensors) every cut",
        "costs the GPU-side gap between two graph launches (the floor column, 2.3–5.2 µs here),",
        "whatever runs on the host. breakgraph's own cost over that floor is within ±0.7 µs per",
        "break in all three regimes; with tiny kernels (host-bound) the whole break costs one graph",
        "launch (≈ 2 µs).",
        "",
    ]
    return lines


def prefill_section(data: dict) -> list:
    lines = [
        "## Prefill of transformers models (bf16, random weights)",
        "",
        "`benchmarks/bench_prefill.py`, medians of 30 runs, each synchronised. Columns (ms):",
        "HF eager one prompt at a time (`sdpa`, `use_cache=False`); HF eager on the left-padded",
        "batch; **breakgraph** (`PrefillRunner`: attention as an eager break per layer with exact",
        "lengths); **full graph**: the same packed forward in ONE CUDA graph with attention captured",
        "using upper-bound lengths (`PrefillRunner(attention=\"captured\")`: the same kernels, no",
        "breaks); `torch.compile(mode=\"reduce-overhead\")` of the HF forward (single prompts, Llama).",
        "Buckets 32, 128, 512, 2048 tokens; up to 16 prompts.",
        "",
    ]
    for m in data["models"]:
        lines += [
            f"### {m['model']} ({m['params_m']:.0f}M parameters)",
            "",
            f"![prefill latency, {m['model']}](img/prefill-{m['model']}.png)",
            "",
            "| workload | HF eager | HF eager, padded batch | breakgraph | full graph | compile reduce-overhead | breakgraph / full graph | eager / breakgraph |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in m["rows"]:
            lines.append(
                f"| {r['workload']} | {_ms(r, 'hf_eager')} | {_ms(r, 'hf_eager_padded')} | {_ms(r, 'breakgraph')} "
                f"| {_ms(r, 'full_graph')} | {_ms(r, 'compile_ro')} | {r['bg_over_full']:.3f} | {r['eager_over_bg']:.2f} |"
            )
        compiled = [r for r in m["rows"] if "bg_compiled" in r]
        if compiled:
            lines += [
                "",
                "With `PrefillRunner(compile=True)` (Inductor-fused kernels inside the segments, attention",
                "still an eager break) against the same compiled forward in one CUDA graph:",
                "",
                "| workload | breakgraph compiled | full graph compiled | ratio | eager / breakgraph compiled |",
                "|---|---|---|---|---|",
            ]
            for r in compiled:
                lines.append(
                    f"| {r['workload']} | {r['bg_compiled']:.2f} | {r['full_compiled']:.2f} "
                    f"| {r['bgc_over_fullc']:.3f} | {r['eager_over_bgc']:.2f} |"
                )
        per_bucket = ", ".join(
            f"{b}: {float(m['capture_s_per_bucket'][b]):.2f} s / {float(m['graph_mib_per_bucket'][b]):.0f} MiB"
            for b in sorted(m["capture_s_per_bucket"], key=int)
        )
        total = sum(float(v) for v in m["graph_mib_per_bucket"].values())
        lines += [
            "",
            f"Capture (4 buckets, warm-up included): {m['capture_s']:.1f} s; per bucket (capture time /",
            f"graph-pool growth): {per_bucket}. All buckets share one pool: {total:.0f} MiB in all,",
            f"against {m['graph_mib_largest_only']:.0f} MiB for the largest bucket alone.",
            f"Correctness (16-prompt batch vs each prompt run alone in HF eager): max |Δlogit| "
            f"{m['correctness_batch']['max_abs_diff']:.3f}, greedy tokens agree "
            f"{100 * m['correctness_batch']['argmax_agree']:.0f}%.",
            "",
        ]
    return lines


def moe_section(data: dict) -> list:
    lines = [
        "## MoE (Qwen3-MoE shape, 0.4B parameters, 512-token prompt)",
        "",
        "| experts implementation | one whole CUDA graph | breakgraph breaks | HF eager ms | breakgraph ms | max abs diff | greedy agree |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in data["moe"].items():
        lines.append(
            f"| {name.split('=')[1]} | {r['whole_graph_capture'][:90]} | {r['breaks']} | {r['hf_eager_ms']:.2f} "
            f"| {r['breakgraph_ms']:.2f} | {r['correctness']['max_abs_diff']:.3f} | {100 * r['correctness']['argmax_agree']:.0f}% |"
        )
    lines += [
        "",
        "transformers' `eager` experts loop (`nonzero` plus a Python loop over active experts) cannot",
        "be captured whole; breakgraph makes each experts call an eager break of its own. The",
        "default `grouped_mm` experts are sync-free and stay captured (one break per layer).",
        "",
    ]
    return lines


def suite_section(data: dict) -> list:
    """The pytest-benchmark suite (tests/benchmarks): medians by workload and variant."""
    rows = {}
    for b in data["benchmarks"]:
        info = b["extra_info"]
        rows.setdefault(info["workload"], []).append((info, b["stats"]["median"]))
    lines = ["## Benchmark suite (pytest-benchmark)", "",
             "`tests/benchmarks` (per-break and per-replay times divided out of each timed call); medians.",
             ""]
    overhead = {}
    for info, median in rows.get("overhead", []):
        overhead.setdefault(info["regime"], {})[info["variant"]] = (median, info)
    if overhead:
        lines += ["| regime | one graph µs | breakgraph +µs/break | separate graphs +µs/break | breakable-cuda-graphs +µs/break | eager µs |",
                  "|---|---|---|---|---|---|"]
        for regime, v in overhead.items():
            full, info = v["full_graph"]
            per = lambda k: (f"{(v[k][0] - full) / info['breaks'] / info['repeats'] * 1e6:.2f}"  # noqa: E731
                             if k in v else "-")
            lines.append(f"| {regime} | {full / info['repeats'] * 1e6:.1f} | {per('breakgraph')} | "
                         f"{per('separate_graphs')} | {per('peer')} | "
                         f"{v['eager'][0] / info['repeats'] * 1e6:.1f} |")
        lines.append("")
    copy = {}
    for info, median in rows.get("copy-back", []):
        copy.setdefault(info["elements"], {})[info["kind"]] = median / info["repeats"] / info["breaks"] * 1e6
    if copy:
        lines += ["| floats per break | fresh result µs/break | in place µs/break |", "|---|---|---|"]
        lines += [f"| {n} | {v.get('fresh', 0):.2f} | {v.get('in_place', 0):.2f} |" for n, v in copy.items()]
        lines.append("")
    prefill = {}
    for info, median in rows.get("prefill", []):
        prefill.setdefault(info["case"], {})[info["variant"]] = median * 1e3
    if prefill:
        lines += ["| prefill case | HF eager ms | breakgraph ms | full graph ms | compile ms | bg / full |",
                  "|---|---|---|---|---|---|"]
        for case, v in prefill.items():
            f = lambda k: f"{v[k]:.2f}" if k in v else "-"  # noqa: E731
            lines.append(f"| {case} | {f('hf_eager')} | {f('breakgraph')} | {f('full_graph')} | "
                         f"{f('compile_ro')} | {v['breakgraph'] / v['full_graph']:.3f} |")
        lines.append("")
    buckets = sorted(rows.get("buckets", []), key=lambda r: r[0]["buckets"])
    if buckets:
        lines += ["| buckets | capture s | graph MiB |", "|---|---|---|"]
        lines += [f"| {i['buckets']} | {i['seconds']:.2f} | {i['graph_bytes'] / 2**20:.0f} |" for i, _ in buckets]
        lines.append("")
    return lines


def write_plots(prefill: dict, overhead: dict) -> None:
    """PNG plots next to the page (needs matplotlib, the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.join(DOCS, "img"), exist_ok=True)
    save = dict(dpi=110, metadata={"Software": None})
    if overhead:
        rows = overhead["overhead"]
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["added_per_break_us"] for r in rows], 0.4, label="breakgraph")
        ax.bar([i + 0.2 for i in x], [r["floor_per_break_us"] for r in rows], 0.4,
               label="separate CUDA graphs (floor)")
        ax.axhline(2.0, color="grey", linestyle="--", linewidth=1, label="2 µs target")
        ax.set_xticks(list(x), [r["regime"] for r in rows])
        ax.set_ylabel("µs added per break")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(DOCS, "img", "overhead.png"), **save)
        plt.close(fig)
    for m in (prefill or {}).get("models", []):
        rows = m["rows"]
        fig, ax = plt.subplots(figsize=(6.4, 3.4))
        labels = [r["workload"].replace(" (", "\n(") for r in rows]
        x = range(len(rows))
        series = [("hf_eager", "HF eager"), ("breakgraph", "breakgraph"), ("full_graph", "one CUDA graph"),
                  ("bg_compiled", "breakgraph + compile"), ("compile_ro", "compile reduce-overhead")]
        width = 0.16
        for k, (key, label) in enumerate(series):
            values = [r.get(key, 0) for r in rows]
            if any(values):
                ax.bar([i + (k - 2) * width for i in x], values, width, label=label)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log)")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(f"{m['model']} prefill, H200, bf16", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(DOCS, "img", f"prefill-{m['model']}.png"), **save)
        plt.close(fig)


def render(suite: str = SUITE_JSON) -> str:
    overhead, prefill, moe = _load("h200-overhead.json"), _load("h200-prefill.json"), _load("h200-moe.json")
    meta = (prefill or overhead)["meta"]
    lines = [
        "# Performance",
        "",
        f"Measured on {meta['gpu']}, torch {meta['torch']}, transformers {meta.get('transformers', '-')},"
        f" {meta['date']}. Generated by `python benchmarks/report.py` from `docs/results/*.json`;",
        "reproduce the JSON on a GPU machine with `bash scripts/gpu_check.sh` (or the two",
        "benchmark scripts it calls); the pytest-benchmark suite in `tests/benchmarks` runs with",
        "`RUN_SUITE=1 bash scripts/gpu_check.sh` and lands here through",
        "`python benchmarks/report.py --pytest-benchmark <json>`. Ratios matter; absolute times",
        "drift between machines.",
        "",
    ]
    if overhead:
        lines += overhead_section(overhead)
    if prefill:
        lines += prefill_section(prefill)
    if moe:
        lines += moe_section(moe)
    if suite and os.path.exists(suite):
        lines += suite_section(json.load(open(suite)))
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(DOCS, "performance.md"))
    parser.add_argument("--pytest-benchmark", default=SUITE_JSON, help="pytest-benchmark JSON of tests/benchmarks")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    with open(args.out, "w") as f:
        f.write(render(args.pytest_benchmark))
    if not args.no_plots:
        write_plots(_load("h200-prefill.json"), _load("h200-overhead.json"))


if __name__ == "__main__":
    main()
