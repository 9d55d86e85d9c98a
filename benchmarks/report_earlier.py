"""Page sections of the runs before issue 13: breakgraph against its own one-graph variant
with explicit buckets (``h200-prefill*.json``), run to run, and the MoE experts run."""

from __future__ import annotations

from . import targets as T
from .template import fill, num, span, table

FILE = "h200-prefill.json"
RUN_FILES = ("h200-prefill-run1.json", "h200-prefill-run2.json", "h200-prefill-run3.json")
MOE_FILE = "h200-moe.json"


def _ms(row: dict, key: str) -> str:
    return num(row[key]) if key in row else "-"


def verdict(m: dict) -> str:
    """The targets of the time, met or missed, read off the model's rows."""
    misses = []
    for r in m["rows"]:
        limit = T.bg_vs_one_graph_limit(r["tokens"])
        if r["bg_over_full"] > limit:
            misses.append(
                fill(
                    "earlier.miss.one_graph",
                    workload=r["workload"],
                    ratio=num(r["bg_over_full"], 3),
                    limit=num(limit),
                )
            )
        single = r["workload"].startswith("single")
        if (
            single
            and r["tokens"] <= T.EAGER_TARGET_MAX_TOKENS
            and r["eager_over_bg"] < T.TARGET_EAGER_OVER_BG
        ):
            misses.append(
                fill(
                    "earlier.miss.eager",
                    workload=r["workload"],
                    ratio=num(r["eager_over_bg"]),
                    limit=f"{T.TARGET_EAGER_OVER_BG:g}",
                )
            )
    return "all met" if not misses else "missed: " + "; ".join(misses)


def model_table(m: dict) -> str:
    header = [
        "workload",
        "HF eager",
        "HF eager, padded batch",
        "breakgraph",
        "one graph",
        "breakgraph / one graph",
        "per round",
        "eager / breakgraph",
    ]
    rows = [
        [
            r["workload"],
            _ms(r, "hf_eager"),
            _ms(r, "hf_eager_padded"),
            _ms(r, "breakgraph"),
            _ms(r, "full_graph"),
            num(r["bg_over_full"], 3),
            span(r["spread"], 3) if "spread" in r else "-",
            num(r["eager_over_bg"]),
        ]
        for r in m["rows"]
    ]
    return table(header, rows)


def host_block(m: dict) -> str:
    rows = [r for r in m["rows"] if "bg_host_ms" in r]
    if not rows:
        return ""
    header = [
        "workload",
        "host: breakgraph ms",
        "host: one graph ms",
        "device: breakgraph ms",
        "device: one graph ms",
    ]
    cells = [
        [
            r["workload"],
            num(r["bg_host_ms"]),
            num(r["full_host_ms"]),
            num(r["breakgraph"]),
            num(r["full_graph"]),
        ]
        for r in rows
    ]
    host = m.get("attention_break_host_us")
    break_host = (
        fill(
            "earlier.break_host",
            mean=num(host["mean"], 1),
            max=num(host["max"], 1),
            breaks=host["breaks"],
        )
        if host
        else ""
    )
    return fill("earlier.host", table=table(header, cells), break_host=break_host)


def compiled_block(m: dict, compiled_run: tuple[str, dict] | None) -> str:
    keys = ("bg_compiled", "compile_ro")
    label, rows = "", [r for r in m["rows"] if any(k in r for k in keys)]
    if not rows and compiled_run:
        name, other = compiled_run
        match = [o for o in other["models"] if o["model"] == m["model"]]
        rows = [r for r in (match[0]["rows"] if match else []) if any(k in r for k in keys)]
        label = f" ({name}, where the variants alternated in a fixed order)"
    if not rows:
        return ""
    header = [
        "workload",
        "HF eager",
        "breakgraph",
        "compile reduce-overhead",
        "breakgraph compiled",
        "one graph compiled",
        "compiled ratio",
        "per round",
        "eager / breakgraph compiled",
    ]
    cells = [
        [
            r["workload"],
            _ms(r, "hf_eager"),
            _ms(r, "breakgraph"),
            _ms(r, "compile_ro"),
            _ms(r, "bg_compiled"),
            _ms(r, "full_compiled"),
            num(r["bgc_over_fullc"], 3) if "bgc_over_fullc" in r else "-",
            span(r["bgc_spread"], 3) if "bgc_spread" in r else "-",
            num(r["eager_over_bgc"]) if "eager_over_bgc" in r else "-",
        ]
        for r in rows
    ]
    return fill("earlier.compiled", label=label, table=table(header, cells))


def model_block(m: dict, compiled_run: tuple[str, dict] | None) -> str:
    buckets = sorted(m["capture_s_per_bucket"], key=int)
    per_bucket = ", ".join(
        f"{b}: {num(float(m['capture_s_per_bucket'][b]))} s / "
        f"{num(float(m['graph_mib_per_bucket'][b]), 0)} MiB"
        for b in buckets
    )
    total = sum(float(v) for v in m["graph_mib_per_bucket"].values())
    correct = m["correctness_batch"]
    return fill(
        "earlier.model",
        model=m["model"],
        params=num(m["params_m"], 0),
        table=model_table(m),
        target_32=num(T.TARGET_BG_VS_ONE_GRAPH_32),
        short=T.SHORT_PROMPT_TOKENS,
        target_long=num(T.TARGET_BG_VS_ONE_GRAPH),
        eager_target=f"{T.TARGET_EAGER_OVER_BG:g}",
        eager_tokens=T.EAGER_TARGET_MAX_TOKENS,
        verdict=verdict(m),
        n_buckets=len(buckets),
        capture_s=num(m["capture_s"], 1),
        per_bucket=per_bucket,
        total_mib=num(total, 0),
        alone_mib=num(m["graph_mib_largest_only"], 0),
        max_diff=num(correct["max_abs_diff"], 3),
        agree=num(100 * correct["argmax_agree"], 0),
        host=host_block(m),
        compiled=compiled_block(m, compiled_run),
    )


def runs_block(runs: list[tuple[str, dict]], final: dict) -> str:
    """breakgraph / one graph per workload and run; how far the final run is from the
    call-by-call fixed-order runs (the second and third) on short prompts."""
    all_runs = runs + [("final run", final)]
    ratios: dict[tuple[str, str], dict[str, float]] = {}
    tokens: dict[tuple[str, str], int] = {}
    for name, data in all_runs:
        for m in data["models"]:
            for r in m["rows"]:
                ratios.setdefault((m["model"], r["workload"]), {})[name] = r["bg_over_full"]
                tokens[(m["model"], r["workload"])] = r["tokens"]
    rows = [
        [model, workload] + [num(v[n], 3) if n in v else "-" for n, _ in all_runs]
        for (model, workload), v in ratios.items()
    ]
    fixed = [name for name, _ in runs[1:3]]
    eager = [
        r["hf_eager"]
        for name, data in runs[1:3]
        for m in data["models"]
        for r in m["rows"]
        if r["workload"].startswith("single")
    ]
    deltas = [
        100 * (v[n] - v["final run"])
        for key, v in ratios.items()
        if key[1].startswith("single") and tokens[key] <= T.EAGER_TARGET_MAX_TOKENS
        for n in fixed
        if n in v and "final run" in v
    ]
    if not deltas or not eager:
        return ""
    if all(d > 0 for d in deltas):
        direction, shown = "lower", deltas
    elif all(d < 0 for d in deltas):
        direction, shown = "higher", [-d for d in deltas]
    else:
        direction, shown = "lower (negative: higher)", deltas
    return fill(
        "earlier.runs",
        eager_ms=span(eager, 0),
        tokens=T.EAGER_TARGET_MAX_TOKENS,
        delta=span(shown, 1),
        direction=direction,
        table=table(["model", "workload"] + [n for n, _ in all_runs], rows),
    )


def moe_block(data: dict) -> str:
    header = [
        "experts implementation",
        "one whole CUDA graph",
        "breakgraph breaks",
        "HF eager ms",
        "breakgraph ms",
        "max abs diff",
        "greedy agree",
    ]
    cells, sentences, params = [], [], []
    for name, r in data["moe"].items():
        experts = name.split("=")[1]
        params.append(r["params_m"])
        cells.append(
            [
                experts,
                r["whole_graph_capture"][:90],
                r["breaks"],
                num(r["hf_eager_ms"]),
                num(r["breakgraph_ms"]),
                num(r["correctness"]["max_abs_diff"], 3),
                f"{100 * r['correctness']['argmax_agree']:.0f}%",
            ]
        )
        if r["whole_graph_capture"].startswith("succeeded"):
            sentences.append(fill("earlier.moe.captured", experts=experts, breaks=r["breaks"]))
        else:
            error = r["whole_graph_capture"].removeprefix("failed: ").split(":")[0]
            sentences.append(
                fill("earlier.moe.failed", experts=experts, error=f"`{error}`", breaks=r["breaks"])
            )
    return fill(
        "earlier.moe",
        params=span(params, 0),
        table=table(header, cells),
        rows="\n\n".join(sentences),
    )


def section(final: dict | None, runs: list[tuple[str, dict]], moe: dict | None) -> list[str]:
    if final is None:
        return [moe_block(moe)] if moe else []
    meta = final["meta"]
    first = final["models"][0]
    interleaved = any("spread" in r for m in final["models"] for r in m["rows"])
    blocks = [
        fill(
            "earlier",
            file=FILE,
            gpu=meta["gpu"],
            torch=meta["torch"],
            transformers=meta.get("transformers", "-"),
            date=meta["date"],
            buckets=", ".join(sorted(first["capture_s_per_bucket"], key=int)),
            method=fill("earlier.method.turns" if interleaved else "earlier.method.plain"),
        )
    ]
    compiled_run = next(((n, d) for n, d in runs if n == "run 3"), None)
    blocks += [model_block(m, compiled_run) for m in final["models"]]
    if runs:
        block = runs_block(runs, final)
        if block:
            blocks.append(block)
    if moe:
        blocks.append(moe_block(moe))
    return blocks
