"""Page section of the pytest-benchmark suite (``tests/benchmarks``) and its plot."""

from __future__ import annotations

from . import targets as T
from .template import fill, num, table

FILE = "h200-pytest-benchmark.json"


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


def suite_losses(overhead: dict, prefill: dict) -> list[str]:
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
                    fill(
                        "suite.loss.overhead",
                        regime=regime,
                        bg=num(per["breakgraph"]),
                        rival=num(per[rival]),
                        label=label,
                    )
                )
    for case, v in prefill.items():
        ratio = v["breakgraph"] / v["full_graph"]
        if ratio > T.TARGET_BG_VS_ONE_GRAPH:
            losses.append(fill("suite.loss.slower", case=case, pct=num(100 * (ratio - 1), 1)))
        if "compile_ro" in v and v["compile_ro"] < v["breakgraph"]:
            losses.append(
                fill(
                    "suite.loss.compile",
                    case=case,
                    compile_ms=num(v["compile_ro"]),
                    bg_ms=num(v["breakgraph"]),
                )
            )
    return losses


def suite_section(data: dict) -> list[str]:
    """The pytest-benchmark suite: medians by workload and variant."""
    overhead, copy, prefill, buckets = suite_tables(data)
    info = data.get("machine_info", {})
    cpu = (info.get("cpu") or {}).get("brand_raw", "-")
    label = ", ".join(f"{k} {info[k]}" for k in ("gpu", "torch", "transformers") if info.get(k))
    tables = []
    if overhead:
        rows = []
        for regime, v in overhead.items():
            full, run = v["full_graph"]
            per = lambda k: "-" if k not in v else num(added_per_break_us(v, k))  # noqa: B023, E731
            rows.append(
                [
                    regime,
                    num(full / run["repeats"] * 1e6, 1),
                    per("breakgraph"),
                    per("separate_graphs"),
                    per("peer"),
                    num(v["eager"][0] / run["repeats"] * 1e6, 1),
                    num(v["breakgraph"][0] / full),
                    num(v["eager"][0] / v["breakgraph"][0]),
                ]
            )
        header = [
            "regime",
            "one graph µs",
            "breakgraph +µs/break",
            "separate graphs +µs/break",
            "breakable-cuda-graphs +µs/break",
            "eager µs",
            "breakgraph / one graph",
            "eager / breakgraph",
        ]
        tables.append(table(header, rows))
    if copy:
        rows = [[n, num(v.get("fresh", 0)), num(v.get("in_place", 0))] for n, v in copy.items()]
        tables.append(
            table(["floats per break", "fresh result µs/break", "in place µs/break"], rows)
        )
    if prefill:
        rows = []
        for case, v in prefill.items():
            f = lambda k: num(v[k]) if k in v else "-"  # noqa: B023, E731
            eager = num(v["hf_eager"] / v["breakgraph"]) if "hf_eager" in v else "-"
            rows.append(
                [
                    case,
                    f("hf_eager"),
                    f("breakgraph"),
                    f("full_graph"),
                    f("compile_ro"),
                    num(v["breakgraph"] / v["full_graph"], 3),
                    eager,
                ]
            )
        header = [
            "prefill case",
            "HF eager ms",
            "breakgraph ms",
            "full graph ms",
            "compile ms",
            "bg / full",
            "eager / bg",
        ]
        tables.append(table(header, rows))
    if buckets:
        rows = [
            [i["buckets"], num(i["seconds"]), num(i["graph_bytes"] / 2**20, 0)] for i in buckets
        ]
        tables.append(table(["buckets", "capture s", "graph MiB"], rows))
    losses = suite_losses(overhead, prefill)
    if losses:
        tables.append("Where breakgraph loses in this run:\n\n" + "\n".join(losses))
    if overhead or prefill:
        tables.append("![benchmark suite](img/suite.png)")
    return [
        fill(
            "suite",
            when=str(data.get("datetime", "-"))[:16].replace("T", " "),
            cpu=cpu,
            label=f", {label}." if label else " (GPU and versions: see the sources above).",
            tables="\n\n".join(tables),
        )
    ]


def write_suite_plot(data: dict, plt, path: str, save: dict) -> None:
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
    fig.savefig(path, **save)
    plt.close(fig)
