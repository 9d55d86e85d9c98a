"""Turn the committed benchmark JSON into docs/performance.md and its plots.

Deterministic: the same JSON gives the same page (a test checks the committed page).

    python benchmarks/report.py                      # docs/results/h200-*.json -> docs/performance.md
    python benchmarks/report.py --pytest-benchmark bench.json   # also the pytest-benchmark suite
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(HERE, "..", "docs")
RESULTS = os.path.join(DOCS, "results")
SUITE_JSON = os.path.join(RESULTS, "h200-pytest-benchmark.json")


def _cb_report():
    """benchmarks/cb_report.py (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("cb_report", os.path.join(HERE, "cb_report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    floors = [r["floor_per_break_us"] for r in data["overhead"]]
    low, high = min(floors), max(floors)
    margin = max(abs(r["added_per_break_us"] - r["floor_per_break_us"]) for r in data["overhead"])
    before = _load("h200-overhead-before-debug.json")
    if before and any("debug_mode_per_break_us" in r for r in data["overhead"]):
        old = {r["regime"]: r for r in before["overhead"]}
        lines += [
            "",
            "Debug mode costs nothing when off: the same benchmark before debug mode existed",
            f"(`h200-overhead-before-debug.json`, {before['meta']['date']}) against this run, and the",
            "cost per break with `capture(debug=True)` (input checks, break timers, NVTX ranges):",
            "",
            "| regime | before debug mode: added µs/break (over the floor) | now, debug off (over the floor) | now, debug on |",
            "|---|---|---|---|",
        ]
        for r in data["overhead"]:
            if r["regime"] in old:
                o = old[r["regime"]]
                lines.append(
                    f"| {r['regime']} | {o['added_per_break_us']:.2f} "
                    f"({o['added_per_break_us'] - o['floor_per_break_us']:+.2f}) "
                    f"| {r['added_per_break_us']:.2f} ({r['added_per_break_us'] - r['floor_per_break_us']:+.2f}) "
                    f"| {r['debug_mode_per_break_us']:.2f} |"
                )
        lines += [
            "",
            "Absolute numbers move with the machine (the floor moved too); breakgraph's cost over the",
            "floor is what the code controls.",
        ]
    lines += [
        "",
        "![per-break overhead](img/overhead.png)",
        "",
        "Where it loses: when the GPU is the bottleneck (many kernels, large tensors) every cut",
        f"costs the GPU-side gap between two graph launches (the floor column, {low:.1f}–{high:.1f} µs here),",
        "whatever runs on the host. breakgraph's own cost over that floor is within",
        f"{margin:.2f} µs per break in all three regimes; with tiny kernels (host-bound) the whole",
        "break costs about one graph launch.",
        "",
    ]
    return lines


def prefill_section(data: dict, compiled_run: tuple | None = None) -> list:
    """The prefill tables; ``compiled_run`` = (label, data) supplies the torch.compile rows
    when the main run did not time them."""
    interleaved = any("spread" in r for m in data["models"] for r in m["rows"])
    method = (
        "medians of 200 synchronised runs per variant, the variants taking turns call by call,"
        " each turn in the next of all their orders, so that drift (clocks, temperature, a busy"
        " host) and the state left by the previous call hit them alike; *per round* is the"
        " lowest and highest breakgraph / full graph ratio over rounds of 10 turns (the noise)."
        if interleaved
        else "medians of 30 runs, each synchronised."
    )
    lines = [
        "## Prefill of transformers models (bf16, random weights)",
        "",
        f"`benchmarks/bench_prefill.py`, {method} Columns (ms):",
        "HF eager one prompt at a time (`sdpa`, `use_cache=False`); HF eager on the left-padded",
        "batch; **breakgraph** (`PrefillRunner`: attention as an eager break per layer with exact",
        "lengths); **full graph**: the same packed forward in ONE CUDA graph with attention captured",
        'using upper-bound lengths (`PrefillRunner(attention="captured")`: the same kernels, no',
        'breaks); `torch.compile(mode="reduce-overhead")` of the HF forward (single prompts, Llama;',
        "its own table below when the main run did not time it).",
        "Buckets 32, 128, 512, 2048 tokens; up to 16 prompts.",
        "",
    ]
    for m in data["models"]:
        lines += [
            f"### {m['model']} ({m['params_m']:.0f}M parameters)",
            "",
            f"![prefill latency, {m['model']}](img/prefill-{m['model']}.png)",
            "",
            "| workload | HF eager | HF eager, padded batch | breakgraph | full graph "
            "| breakgraph / full graph | per round | eager / breakgraph |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in m["rows"]:
            rounds = "{:.3f}–{:.3f}".format(*r["spread"]) if "spread" in r else "-"
            lines.append(
                f"| {r['workload']} | {_ms(r, 'hf_eager')} | {_ms(r, 'hf_eager_padded')} | {_ms(r, 'breakgraph')} "
                f"| {_ms(r, 'full_graph')} | {r['bg_over_full']:.3f} | {rounds} | {r['eager_over_bg']:.2f} |"
            )
        lines += target_lines(m)
        lines += break_cost_lines(m)
        lines += compile_lines(m, compiled_run)
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


TARGETS = "breakgraph / full graph ≤ 1.10 at 32 tokens and ≤ 1.05 from 128 up; eager / breakgraph ≥ 5 at 32 and 128"


def target_lines(m: dict) -> list:
    """The issue's targets, met or missed, read off the table above."""
    missed = []
    for r in m["rows"]:
        limit = 1.10 if r["tokens"] <= 32 else 1.05
        if r["bg_over_full"] > limit:
            missed.append(
                f"{r['workload']}: breakgraph / full graph {r['bg_over_full']:.3f} > {limit:.2f}"
            )
        if r["tokens"] <= 128 and r["workload"].startswith("single") and r["eager_over_bg"] < 5:
            missed.append(f"{r['workload']}: eager / breakgraph {r['eager_over_bg']:.2f} < 5")
    verdict = "all met" if not missed else "missed: " + "; ".join(missed)
    return ["", f"Targets ({TARGETS}): {verdict}."]


def compile_lines(m: dict, compiled_run: tuple | None) -> list:
    """torch.compile: reduce-overhead, and breakgraph with compiled segments against its twin."""
    label, rows = "", [r for r in m["rows"] if "bg_compiled" in r or "compile_ro" in r]
    if not rows and compiled_run:
        label, other = compiled_run
        match = [o for o in other["models"] if o["model"] == m["model"]]
        rows = [
            r
            for r in (match[0]["rows"] if match else [])
            if "bg_compiled" in r or "compile_ro" in r
        ]
        label = f" ({label}, where the variants alternated in a fixed order)"
    if not rows:
        return []
    lines = [
        "",
        f'torch.compile{label}: `torch.compile(mode="reduce-overhead")` of the HF forward, and',
        "`PrefillRunner(compile=True)` (Inductor-fused kernels inside the segments, attention still",
        "an eager break) against the same compiled forward in one CUDA graph (ms):",
        "",
        "| workload | HF eager | breakgraph | compile reduce-overhead | breakgraph compiled | full graph compiled "
        "| compiled ratio | per round | eager / breakgraph compiled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rounds = "{:.3f}–{:.3f}".format(*r["bgc_spread"]) if "bgc_spread" in r else "-"
        ratio = f"{r['bgc_over_fullc']:.3f}" if "bgc_over_fullc" in r else "-"
        speedup = f"{r['eager_over_bgc']:.2f}" if "eager_over_bgc" in r else "-"
        lines.append(
            f"| {r['workload']} | {_ms(r, 'hf_eager')} | {_ms(r, 'breakgraph')} | {_ms(r, 'compile_ro')} "
            f"| {_ms(r, 'bg_compiled')} | {_ms(r, 'full_compiled')} | {ratio} | {rounds} | {speedup} |"
        )
    return lines


def break_cost_lines(m: dict) -> list:
    """Is the host ahead of the GPU? Host time to issue a prefill against its device time."""
    rows = [r for r in m["rows"] if "bg_host_ms" in r]
    if not rows:
        return []
    lines = [
        "",
        "Host time to *issue* one prefill (median of 50, GPU idle at the start) against its time",
        "on the device. While the first stays under the second the host runs ahead, the",
        "attention breaks' host work is hidden, and what a break costs is the device-side gap",
        "at the segment boundaries plus the copy-back kernel.",
        "",
        "| workload | host: breakgraph ms | host: full graph ms | device: breakgraph ms | device: full graph ms |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['bg_host_ms']:.2f} | {r['full_host_ms']:.2f} "
            f"| {r['breakgraph']:.2f} | {r['full_graph']:.2f} |"
        )
    host = m.get("attention_break_host_us")
    if host:
        lines += [
            "",
            f"Host time of one attention break (debug-mode timers, NVTX ranges included, 128 "
            f"tokens): mean {host['mean']:.1f} µs, max {host['max']:.1f} µs over "
            f"{host['breaks']} layers.",
        ]
    return lines


def anatomy_section(runs: list) -> list:
    """benchmarks/break_anatomy.py: an attention break's cost split into its parts (one table
    row per run and token count, so the run-to-run noise shows)."""
    meta = runs[0]["meta"]
    lines = [
        "## Anatomy of an attention break",
        "",
        f"`benchmarks/break_anatomy.py`, {meta['model']}, {meta['breaks']} breaks, µs of device time added per",
        "break over the full graph (same medians and turn-taking as above). *Cuts only*: the full",
        "graph cut after every attention by an empty `break_graph()`, nothing eager: the cost of the",
        "segment boundary itself. *+ eager kernel*: the attention kernel launched eagerly between the",
        "segments, its result not copied back (timing only; this is what FlashAttention writing in",
        "place, `torch >= 2.12`, would cost). *breakgraph*: the real break, kernel plus copy-back.",
        "",
        "| run | tokens | full graph ms | cuts only | + eager kernel | breakgraph | copy-back share | breakgraph / full graph |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, data in enumerate(runs, 1):
        for r in data["rows"]:
            per = r["us_per_break"]
            copy = per["breakgraph"] - per["eager_flash_no_copy"]
            lines.append(
                f"| {i} | {r['tokens']} | {r['ms']['full_graph']:.3f} | {per['cuts_only']:.2f} "
                f"| {per['eager_flash_no_copy']:.2f} | {per['breakgraph']:.2f} | {copy:.2f} "
                f"| {r['ms']['breakgraph'] / r['ms']['full_graph']:.3f} |"
            )
    lines += [
        "",
        "The host is not the limit: it issues a prefill in about half the device time (tables",
        "above). A break costs device time: the boundary between two graphs, the attention kernel",
        "launched from the stream rather than from a graph, and the copy-back kernel. At 2048 tokens",
        "the eager kernel is *faster* than the captured one, which must launch a grid for the",
        "upper-bound batch (`max_prompts + 1` sequences).",
        "",
    ]
    return lines


def repeats_section(runs: list) -> list:
    """breakgraph / full graph of the same workloads over several runs on the H200: the noise."""
    lines = [
        "## Run to run",
        "",
        "breakgraph / full graph of the same workloads in separate runs on the H200 (fresh machine",
        "each time). Run 1 timed the variants in alternating blocks of 10 calls; runs 2 and 3 took",
        "turns call by call in a fixed order, so breakgraph always ran right after a 15–45 ms HF",
        "eager call; the final run (the tables above) cycles through all orders. The final run",
        "reads 1.5–3.5 points lower at 32 and 128 tokens than runs 2 and 3: we take the fixed order",
        "to have favoured the full graph, though each run also had a different machine.",
        "",
    ]
    header = "| model | workload | " + " | ".join(name for name, _ in runs) + " |"
    lines += [header, "|---|---|" + "---|" * len(runs)]
    table = {}
    for name, data in runs:
        for m in data["models"]:
            for r in m["rows"]:
                table.setdefault((m["model"], r["workload"]), {})[name] = r["bg_over_full"]
    for (model, workload), ratios in table.items():
        cells = " | ".join(f"{ratios[n]:.3f}" if n in ratios else "-" for n, _ in runs)
        lines.append(f"| {model} | {workload} | {cells} |")
    return lines + [""]


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


def suite_tables(data: dict) -> tuple:
    """pytest-benchmark JSON grouped for the page: ``overhead[regime][variant] = (median s,
    info)``, ``copy[elements][kind] = µs per break``, ``prefill[case][variant] = ms``,
    ``buckets = [info, ...]``."""
    overhead, copy, prefill, buckets = {}, {}, {}, []
    for b in data["benchmarks"]:
        info, median = b["extra_info"], b["stats"]["median"]
        if info["workload"] == "overhead":
            overhead.setdefault(info["regime"], {})[info["variant"]] = (median, info)
        elif info["workload"] == "copy-back":
            copy.setdefault(info["elements"], {})[info["kind"]] = (
                median / info["repeats"] / info["breaks"] * 1e6
            )
        elif info["workload"] == "prefill":
            prefill.setdefault(info["case"], {})[info["variant"]] = median * 1e3
        elif info["workload"] == "buckets":
            buckets.append(info)
    return overhead, copy, prefill, sorted(buckets, key=lambda i: i["buckets"])


def added_per_break_us(variants: dict, key: str) -> float | None:
    """µs a variant adds per break over the one-graph variant of the same overhead regime."""
    if key not in variants:
        return None
    full, info = variants["full_graph"]
    return (variants[key][0] - full) / info["breaks"] / info["repeats"] * 1e6


def suite_section(data: dict) -> list:
    """The pytest-benchmark suite (tests/benchmarks): medians by workload and variant."""
    overhead, copy, prefill, buckets = suite_tables(data)
    info = data.get("machine_info", {})
    cpu = (info.get("cpu") or {}).get("brand_raw", "-")
    label = ", ".join(f"{k} {info[k]}" for k in ("gpu", "torch", "transformers") if info.get(k))
    lines = [
        "## Benchmark suite (pytest-benchmark)",
        "",
        "`tests/benchmarks` (per-break and per-replay times divided out of each timed call); medians.",
        f"Run {str(data.get('datetime', '-'))[:16].replace('T', ' ')} UTC, host CPU {cpu}"
        + (f", {label}." if label else " (GPU and versions: the page header's run)."),
        "",
    ]
    if overhead:
        lines += [
            "| regime | one graph µs | breakgraph +µs/break | separate graphs +µs/break "
            "| breakable-cuda-graphs +µs/break | eager µs | breakgraph / one graph | eager / breakgraph |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for regime, v in overhead.items():
            full, info = v["full_graph"]
            per = lambda k: "-" if k not in v else f"{added_per_break_us(v, k):.2f}"  # noqa: E731
            lines.append(
                f"| {regime} | {full / info['repeats'] * 1e6:.1f} | {per('breakgraph')} | "
                f"{per('separate_graphs')} | {per('peer')} | "
                f"{v['eager'][0] / info['repeats'] * 1e6:.1f} | {v['breakgraph'][0] / full:.2f} "
                f"| {v['eager'][0] / v['breakgraph'][0]:.2f} |"
            )
        lines.append("")
    if copy:
        lines += [
            "| floats per break | fresh result µs/break | in place µs/break |",
            "|---|---|---|",
        ]
        lines += [
            f"| {n} | {v.get('fresh', 0):.2f} | {v.get('in_place', 0):.2f} |"
            for n, v in copy.items()
        ]
        lines.append("")
    if prefill:
        lines += [
            "| prefill case | HF eager ms | breakgraph ms | full graph ms | compile ms | bg / full | eager / bg |",
            "|---|---|---|---|---|---|---|",
        ]
        for case, v in prefill.items():
            f = lambda k: f"{v[k]:.2f}" if k in v else "-"  # noqa: E731
            eager = f"{v['hf_eager'] / v['breakgraph']:.2f}" if "hf_eager" in v else "-"
            lines.append(
                f"| {case} | {f('hf_eager')} | {f('breakgraph')} | {f('full_graph')} | "
                f"{f('compile_ro')} | {v['breakgraph'] / v['full_graph']:.3f} | {eager} |"
            )
        lines.append("")
    if buckets:
        lines += ["| buckets | capture s | graph MiB |", "|---|---|---|"]
        lines += [
            f"| {i['buckets']} | {i['seconds']:.2f} | {i['graph_bytes'] / 2**20:.0f} |"
            for i in buckets
        ]
        lines.append("")
    losses = suite_losses(overhead, prefill)
    if losses:
        lines += ["Where breakgraph loses in this run:", ""] + [f"- {x}" for x in losses] + [""]
    if overhead or prefill:
        lines += ["![benchmark suite](img/suite.png)", ""]
    return lines


def suite_losses(overhead: dict, prefill: dict) -> list:
    """Cases where breakgraph is slower than an alternative, stated from the numbers."""
    losses = []
    for regime, v in overhead.items():
        per = {k: added_per_break_us(v, k) for k in v if k != "eager"}
        for rival, label in (
            ("separate_graphs", "separate plain CUDA graphs"),
            ("peer", "breakable-cuda-graphs"),
        ):
            if rival in per and per["breakgraph"] > per[rival]:
                losses.append(
                    f"{regime}: {per['breakgraph']:.2f} µs per break against {per[rival]:.2f} "
                    f"for {label}"
                )
    for case, v in prefill.items():
        ratio = v["breakgraph"] / v["full_graph"]
        if ratio > 1.05:
            losses.append(f"prefill {case}: {100 * (ratio - 1):.1f}% slower than the full graph")
        if "compile_ro" in v and v["compile_ro"] < v["breakgraph"]:
            losses.append(
                f"prefill {case}: torch.compile reduce-overhead is faster "
                f"({v['compile_ro']:.2f} ms against {v['breakgraph']:.2f} ms)"
            )
    return losses


def write_suite_plot(data: dict, plt, save: dict) -> None:
    """Two panels: µs added per break by variant and regime; prefill ms by variant and case."""
    overhead, _, prefill, _ = suite_tables(data)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.4))
    variants = [
        ("breakgraph", "breakgraph"),
        ("separate_graphs", "separate graphs"),
        ("peer", "breakable-cuda-graphs"),
    ]
    for k, (key, label) in enumerate(variants):
        values = [added_per_break_us(v, key) or 0 for v in overhead.values()]
        left.bar([i + (k - 1) * 0.27 for i in range(len(values))], values, 0.27, label=label)
    left.set_xticks(range(len(overhead)), list(overhead), fontsize=7)
    left.set_ylabel("µs added per break")
    left.legend(fontsize=7)
    series = [
        ("hf_eager", "HF eager"),
        ("breakgraph", "breakgraph"),
        ("full_graph", "one CUDA graph"),
        ("compile_ro", "compile reduce-overhead"),
    ]
    for k, (key, label) in enumerate(series):
        values = [v.get(key, 0) for v in prefill.values()]
        right.bar([i + (k - 1.5) * 0.2 for i in range(len(values))], values, 0.2, label=label)
    right.set_yscale("log")
    right.set_ylabel("prefill ms (log)")
    right.set_xticks(
        range(len(prefill)), [f"{c} tokens" if str(c).isdigit() else c for c in prefill], fontsize=7
    )
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(DOCS, "img", "suite.png"), **save)
    plt.close(fig)


def write_plots(prefill: dict, overhead: dict, suite: str = SUITE_JSON) -> None:
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
        ax.bar(
            [i - 0.2 for i in x], [r["added_per_break_us"] for r in rows], 0.4, label="breakgraph"
        )
        ax.bar(
            [i + 0.2 for i in x],
            [r["floor_per_break_us"] for r in rows],
            0.4,
            label="separate CUDA graphs (floor)",
        )
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
        series = [
            ("hf_eager", "HF eager"),
            ("breakgraph", "breakgraph"),
            ("full_graph", "one CUDA graph"),
            ("bg_compiled", "breakgraph + compile"),
            ("compile_ro", "compile reduce-overhead"),
        ]
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
    if suite and os.path.exists(suite):
        with open(suite) as f:
            write_suite_plot(json.load(f), plt, save)
    cb = _load("h200-cb.json")
    if cb:
        _cb_report().write_cb_plot(cb, plt, save, DOCS)


def render(suite: str = SUITE_JSON) -> str:
    overhead, prefill, moe = (
        _load("h200-overhead.json"),
        _load("h200-prefill.json"),
        _load("h200-moe.json"),
    )
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
        run3 = _load("h200-prefill-run3.json")
        lines += prefill_section(prefill, ("run 3", run3) if run3 else None)
    anatomy = [
        a for a in (_load("h200-break-anatomy.json"), _load("h200-break-anatomy-repeat.json")) if a
    ]
    if anatomy:
        lines += anatomy_section(anatomy)
    runs = [(f"run {i}", _load(f"h200-prefill-run{i}.json")) for i in (1, 2, 3)]
    runs = [(name, data) for name, data in runs if data]
    if runs and prefill:
        lines += repeats_section(runs + [("final run", prefill)])
    if moe:
        lines += moe_section(moe)
    cb = _load("h200-cb.json")
    if cb:
        lines += _cb_report().cb_section(cb)
    if suite and os.path.exists(suite):
        lines += suite_section(json.load(open(suite)))
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(DOCS, "performance.md"))
    parser.add_argument(
        "--pytest-benchmark", default=SUITE_JSON, help="pytest-benchmark JSON of tests/benchmarks"
    )
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    with open(args.out, "w") as f:
        f.write(render(args.pytest_benchmark))
    if not args.no_plots:
        write_plots(_load("h200-prefill.json"), _load("h200-overhead.json"), args.pytest_benchmark)


if __name__ == "__main__":
    main()
