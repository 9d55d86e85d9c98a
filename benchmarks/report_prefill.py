"""The prefill section of the performance page, from ``bench_prefill``'s JSON.

One set of derived numbers (:func:`checks`: every target, met or missed) feeds the
targets table, the marks in the other tables, "where breakgraph loses" and the console
summary of the benchmark, so none of them can disagree with another or with the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import targets as T
from .template import bullets, fill, num, pct, span, table

FILE = "h200-prefill-baselines.json"
MISSED = " ✗"

# (JSON key, column title), in table order
VARIANT_COLUMNS = (
    ("hf_eager", "HF eager"),
    ("hf_eager_padded", "HF eager, padded batch"),
    ("hf_graph", "exact-length graph"),
    ("breakgraph", "breakgraph"),
    ("bg_one_graph", "one graph"),
    ("compile_ro", "compile reduce-overhead"),
    ("bg_compiled", "breakgraph compiled"),
)
TITLES = dict(VARIANT_COLUMNS)
# the alternatives a user has; faster than breakgraph anywhere = a loss worth listing
ALTERNATIVES = ("hf_eager", "hf_eager_padded", "compile_ro")


# -- derived numbers ---------------------------------------------------------------------
def ratio(row: dict, a: str, b: str) -> float | None:
    ms = row.get("ms", {})
    return ms[a] / ms[b] if a in ms and b in ms else None


def singles(family: dict) -> list[dict]:
    return [r for r in family.get("rows", []) if r["kind"] == "single"]


def padding(row: dict) -> float | None:
    bucket = row.get("bucket")
    return (bucket - row["tokens"]) / bucket if bucket else None


def is_moe(family: dict) -> bool:
    return any(k in family["config"] for k in ("num_experts", "num_local_experts"))


def worst_padding(buckets: list[int], from_tokens: int = 0) -> tuple[float, int, int] | None:
    """(padding share, tokens, bucket) of the worst-padded size from ``from_tokens`` up to the
    largest bucket: one token more than a bucket, padded to the next one (or ``from_tokens``
    itself)."""
    ladder = sorted(buckets)
    sizes = [n for n in [from_tokens] + [b + 1 for b in ladder] if from_tokens <= n <= ladder[-1]]
    worst = None
    for n in sizes:
        bucket = next(b for b in ladder if b >= n)
        candidate = ((bucket - n) / bucket, n, bucket)
        if worst is None or candidate > worst:
            worst = candidate
    return worst


def capture_stats(runner: dict) -> dict:
    """The first captured bucket (it pays the warm-up) against the others."""
    captured = runner["capture_seconds"]
    extra = [s for _, s in captured[1:]]
    return {
        "buckets": len(captured),
        "first_bucket": captured[0][0],
        "first_s": captured[0][1],
        "extra_mean": sum(extra) / len(extra) if extra else None,
        "extra_max": max(extra) if extra else None,
    }


def mib(record: dict) -> float:
    return sum(record["graph_memory_bytes"].values()) / 2**20


def ladder_memory(family: dict) -> tuple[float, float, float] | None:
    """(ladder MiB, largest bucket alone MiB, ratio)."""
    if "runner" not in family or "largest_bucket_alone" not in family:
        return None
    ladder, alone = mib(family["runner"]), mib(family["largest_bucket_alone"])
    return (ladder, alone, ladder / alone) if alone > 0 else None


def first_call(family: dict) -> dict | None:
    """Time to serve every first-call length: compile_ro compiles and captures at each;
    breakgraph pays its construction once, then replays."""
    info = family.get("compile", {})
    if "compile_ro" not in info or "bg_compiled" not in info:
        return None
    ro, bg = info["compile_ro"]["lengths"], info["bg_compiled"]
    ro_s = sum(r["ready_s"] for r in ro)
    bg_s = bg["construction_s"] + sum(r["first_call_s"] for r in bg["lengths"])
    return {
        "lengths": len(ro),
        "ro_s": ro_s,
        "bg_s": bg_s,
        "construction_s": bg["construction_s"],
        "buckets": len(bg["buckets"]),
        "speedup": ro_s / bg_s,
        "ro_frames": sum(r["frames"] for r in ro),
    }


def host_over_device(row: dict, variant: str = "breakgraph") -> float | None:
    host = row.get("host", {}).get(variant)
    if not host or not host.get("device_ms"):
        return None
    return host["return_ms"] / host["device_ms"]


# -- targets -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """One target applied to one measurement. ``value`` None: not measured."""

    target: str  # the constant's name in benchmarks/targets.py
    family: str
    what: str
    value: float | None
    limit: float
    at_least: bool = False  # the value must reach the limit (else stay under it)
    details: dict = field(default_factory=dict, compare=False)

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.limit if self.at_least else self.value <= self.limit


def target_label(name: str) -> str:
    """What the target named ``name`` bounds (a table label, read from the constants now)."""
    short, padded = T.SHORT_PROMPT_TOKENS, T.PADDING_FROM_TOKENS
    return {
        "TARGET_BG_VS_EXACT_GRAPH_32": f"breakgraph / exact-length graph, ≤ {short} tokens",
        "TARGET_BG_VS_EXACT_GRAPH": f"breakgraph / exact-length graph, > {short} tokens",
        "TARGET_BGC_VS_COMPILE_RO": "breakgraph compiled / compile reduce-overhead",
        "TARGET_FIRST_CALL_SPEEDUP": "first-call time, compile reduce-overhead / breakgraph "
        "compiled",
        "TARGET_CAPTURE_S_PER_EXTRA_BUCKET": "capture s per bucket after the first",
        "TARGET_LADDER_MEMORY_RATIO": "graph memory, ladder / largest bucket alone",
        "TARGET_PADDING_WASTE": f"worst padding share of the default ladder, ≥ {padded} tokens",
        "TARGET_HOST_OVER_DEVICE_32": f"host / device time of prefill(), ≤ {short} tokens",
    }[name]


# the targets of the prefill section, in table order
TARGETS = (
    "TARGET_BG_VS_EXACT_GRAPH_32",
    "TARGET_BG_VS_EXACT_GRAPH",
    "TARGET_BGC_VS_COMPILE_RO",
    "TARGET_FIRST_CALL_SPEEDUP",
    "TARGET_CAPTURE_S_PER_EXTRA_BUCKET",
    "TARGET_LADDER_MEMORY_RATIO",
    "TARGET_PADDING_WASTE",
    "TARGET_HOST_OVER_DEVICE_32",
)


def limit_text(name: str) -> str:
    value = getattr(T, name)
    if name == "TARGET_PADDING_WASTE":
        return f"≤ {pct(value)}"
    if name == "TARGET_CAPTURE_S_PER_EXTRA_BUCKET":
        return f"≤ {value} s"
    if name == "TARGET_FIRST_CALL_SPEEDUP":
        return f"≥ {value:g}× over {T.TARGET_FIRST_CALL_LENGTHS} lengths"
    return f"≤ {value:g}"


def checks(data: dict) -> list[Check]:
    """Every target against every measurement that it applies to."""
    out = []
    for fam in data["families"]:
        name = fam["family"]
        for row in singles(fam):
            short = row["tokens"] <= T.SHORT_PROMPT_TOKENS
            target = "TARGET_BG_VS_EXACT_GRAPH_32" if short else "TARGET_BG_VS_EXACT_GRAPH"
            out.append(
                Check(
                    target,
                    name,
                    row["workload"],
                    ratio(row, "breakgraph", "hf_graph"),
                    getattr(T, target),
                    details={"row": row},
                )
            )
            if "compile" in fam:
                out.append(
                    Check(
                        "TARGET_BGC_VS_COMPILE_RO",
                        name,
                        row["workload"],
                        ratio(row, "bg_compiled", "compile_ro"),
                        T.TARGET_BGC_VS_COMPILE_RO,
                    )
                )
            if short:
                out.append(
                    Check(
                        "TARGET_HOST_OVER_DEVICE_32",
                        name,
                        row["workload"],
                        host_over_device(row),
                        T.TARGET_HOST_OVER_DEVICE_32,
                        details={"row": row},
                    )
                )
        if "compile" in fam:
            fc = first_call(fam)
            out.append(
                Check(
                    "TARGET_FIRST_CALL_SPEEDUP",
                    name,
                    "",
                    fc and fc["speedup"],
                    T.TARGET_FIRST_CALL_SPEEDUP,
                    at_least=True,
                    details=fc or {},
                )
            )
        runner = fam.get("runner")
        if runner:
            cap = capture_stats(runner)
            out.append(
                Check(
                    "TARGET_CAPTURE_S_PER_EXTRA_BUCKET",
                    name,
                    "",
                    cap["extra_mean"],
                    T.TARGET_CAPTURE_S_PER_EXTRA_BUCKET,
                    details=cap,
                )
            )
            worst = worst_padding(runner["buckets"], T.PADDING_FROM_TOKENS)
            out.append(
                Check(
                    "TARGET_PADDING_WASTE",
                    name,
                    "",
                    worst and worst[0],
                    T.TARGET_PADDING_WASTE,
                    details={"worst": worst},
                )
            )
            memory = ladder_memory(fam)
            out.append(
                Check(
                    "TARGET_LADDER_MEMORY_RATIO",
                    name,
                    "",
                    memory and memory[2],
                    T.TARGET_LADDER_MEMORY_RATIO,
                    details={"memory": memory},
                )
            )
    return out


def missed(check_list: list[Check], target: str, family: str, what: str = "") -> bool:
    return any(
        c.met is False and (c.target, c.family, c.what) == (target, family, what)
        for c in check_list
    )


def targets_table(check_list: list[Check] | None) -> str:
    rows = []
    for name in TARGETS:
        mine = [c for c in check_list or () if c.target == name]
        counts = [sum(c.met is v for c in mine) for v in (True, False, None)]
        measured = counts if check_list is not None else ["-"] * 3
        rows.append([target_label(name), f"`{name}`", limit_text(name), *measured])
    return table(["target", "constant", "limit", "met", "missed", "not measured"], rows)


# -- where breakgraph loses -----------------------------------------------------------------
def why_slower(row: dict) -> str:
    """Split breakgraph / exact graph into padding-and-packing and the breaks; blame the
    host when it cannot issue the call within the device time."""
    parts = []
    one = ratio(row, "bg_one_graph", "hf_graph")
    pad = padding(row)
    if one is not None:
        parts.append(
            fill(
                "why.one_graph",
                one_ratio=num(one, 3),
                bucket=row["bucket"],
                tokens=row["tokens"],
                padding=pct(pad or 0.0),
                break_ratio=num(ratio(row, "breakgraph", "bg_one_graph"), 3),
            )
        )
    elif pad is not None:
        parts.append(
            fill("why.bucket", bucket=row["bucket"], tokens=row["tokens"], padding=pct(pad))
        )
    host = row.get("host", {}).get("breakgraph", {})
    if host.get("device_ms") and host["return_ms"] > host["device_ms"]:
        parts.append(fill("why.host", host=num(host["return_ms"]), device=num(host["device_ms"])))
    return " ".join(parts)


def loss_lines(data: dict, check_list: list[Check]) -> list[str]:
    lines = []
    for c in check_list:
        if c.met is not False:
            continue
        limit = num(c.limit, 2)
        if c.target.startswith("TARGET_BG_VS_EXACT_GRAPH"):
            lines.append(
                fill(
                    "loss.bg_vs_exact",
                    family=c.family,
                    workload=c.what,
                    ratio=num(c.value, 3),
                    limit=limit,
                    why=why_slower(c.details["row"]),
                )
            )
        elif c.target == "TARGET_BGC_VS_COMPILE_RO":
            lines.append(
                fill(
                    "loss.bgc_vs_ro",
                    family=c.family,
                    workload=c.what,
                    ratio=num(c.value, 3),
                    limit=limit,
                )
            )
        elif c.target == "TARGET_FIRST_CALL_SPEEDUP":
            d = c.details
            lines.append(
                fill(
                    "loss.first_call",
                    family=c.family,
                    lengths=d["lengths"],
                    bg_s=num(d["bg_s"], 1),
                    construction_s=num(d["construction_s"], 1),
                    buckets=d["buckets"],
                    ro_s=num(d["ro_s"], 1),
                    speedup=num(c.value, 1),
                    target=f"{c.limit:g}",
                )
            )
        elif c.target == "TARGET_CAPTURE_S_PER_EXTRA_BUCKET":
            d = c.details
            lines.append(
                fill(
                    "loss.capture",
                    family=c.family,
                    mean=num(c.value, 3),
                    max=num(d["extra_max"], 3),
                    target=f"{c.limit:g}",
                    buckets=d["buckets"],
                )
            )
        elif c.target == "TARGET_LADDER_MEMORY_RATIO":
            ladder, alone, _ = c.details["memory"]
            lines.append(
                fill(
                    "loss.memory",
                    family=c.family,
                    ratio=num(c.value),
                    ladder=num(ladder, 0),
                    alone=num(alone, 0),
                    target=f"{c.limit:g}",
                )
            )
        elif c.target == "TARGET_PADDING_WASTE":
            _, tokens, bucket = c.details["worst"]
            lines.append(
                fill(
                    "loss.padding",
                    family=c.family,
                    waste=pct(c.value),
                    tokens=tokens,
                    bucket=bucket,
                    target=pct(c.limit),
                )
            )
        elif c.target == "TARGET_HOST_OVER_DEVICE_32":
            host = c.details["row"]["host"]["breakgraph"]
            first = host.get("to_first_replay_ms")
            lines.append(
                fill(
                    "loss.host",
                    family=c.family,
                    workload=c.what,
                    host=num(host["return_ms"]),
                    device=num(host["device_ms"]),
                    ratio=pct(c.value),
                    target=pct(c.limit),
                    first=num(first) if first is not None else "-",
                )
            )
    for fam in data["families"]:
        for row in fam.get("rows", []):
            rivals = ALTERNATIVES + (("hf_graph",) if row["kind"] == "batch" else ())
            for rival in rivals:
                r = ratio(row, rival, "breakgraph")
                if r is not None and r < 1:
                    lines.append(
                        fill(
                            "loss.faster",
                            family=fam["family"],
                            workload=row["workload"],
                            variant=TITLES[rival],
                            other_ms=num(row["ms"][rival]),
                            bg_ms=num(row["ms"]["breakgraph"]),
                        )
                    )
    return lines


# -- the page section --------------------------------------------------------------------
def ordered(data: dict) -> list[dict]:
    """Families in the catalogue's order (the run may have processed them in another)."""
    from .families import FAMILIES, SMOKE_FAMILIES

    known = list(FAMILIES) + list(SMOKE_FAMILIES)
    return sorted(
        data["families"],
        key=lambda f: known.index(f["family"]) if f["family"] in known else len(known),
    )


def cell_ms(row: dict, key: str) -> str:
    return num(row["ms"][key]) if key in row.get("ms", {}) else "-"


def cell_ratio(value: float | None, bad: bool = False, digits: int = 3) -> str:
    return "-" if value is None else num(value, digits) + (MISSED if bad else "")


def cell_spread(row: dict, pair: str) -> str:
    s = row.get("spread", {}).get(pair)
    return "-" if s is None else span(s, 3)


def headline(data: dict, check_list: list[Check]) -> str:
    sizes = data["settings"]["sizes"]
    rows = []
    for fam in ordered(data):
        by_tokens = {r["tokens"]: r for r in singles(fam)}
        cells = [fam["family"], num(fam["params_m"], 0)]
        for n in sizes:
            row = by_tokens.get(n)
            value = row and ratio(row, "breakgraph", "hf_graph")
            target = (
                "TARGET_BG_VS_EXACT_GRAPH_32"
                if n <= T.SHORT_PROMPT_TOKENS
                else "TARGET_BG_VS_EXACT_GRAPH"
            )
            bad = row is not None and missed(check_list, target, fam["family"], row["workload"])
            cells.append(cell_ratio(value, bad))
        batch = [r for r in fam.get("rows", []) if r["kind"] == "batch"]
        cells.append(
            cell_ratio(batch[0] and ratio(batch[0], "breakgraph", "hf_graph")) if batch else "-"
        )
        rows.append(cells)
    header = ["family", "M params"] + [f"{n} tokens" for n in sizes] + ["batch"]
    return table(header, rows)


def eager_paragraph(data: dict) -> str:
    short = [
        (fam, r)
        for fam in data["families"]
        for r in singles(fam)
        if r["tokens"] <= T.SHORT_PROMPT_TOKENS
    ]
    graph = [(f, ratio(r, "hf_eager", "hf_graph")) for f, r in short]
    graph = [(f, v) for f, v in graph if v is not None]
    bg = [v for v in (ratio(r, "hf_eager", "breakgraph") for _, r in short) if v is not None]
    dense = [v for f, v in graph if not is_moe(f)]
    if not graph or not bg:
        return ""
    return fill(
        "prefill.eager",
        short=T.SHORT_PROMPT_TOKENS,
        graph_over_eager=span([v for _, v in graph], 1),
        graph_over_eager_dense=span(dense, 1) if dense else "-",
        bg_over_eager=span(bg, 1),
    )


def family_table(fam: dict, check_list: list[Check]) -> str:
    header = (
        ["workload", "bucket (padding)"]
        + [t for _, t in VARIANT_COLUMNS]
        + [
            "breakgraph / exact graph",
            "per round",
            "breakgraph / one graph",
            "HF eager / breakgraph",
        ]
    )
    rows = []
    for row in fam.get("rows", []):
        target = (
            "TARGET_BG_VS_EXACT_GRAPH_32"
            if row["tokens"] <= T.SHORT_PROMPT_TOKENS
            else "TARGET_BG_VS_EXACT_GRAPH"
        )
        bad = row["kind"] == "single" and missed(check_list, target, fam["family"], row["workload"])
        bucket = "-" if row.get("bucket") is None else f"{row['bucket']} ({pct(padding(row))})"
        rows.append(
            [row["workload"], bucket]
            + [cell_ms(row, key) for key, _ in VARIANT_COLUMNS]
            + [
                cell_ratio(ratio(row, "breakgraph", "hf_graph"), bad),
                cell_spread(row, "breakgraph/hf_graph"),
                cell_ratio(ratio(row, "breakgraph", "bg_one_graph")),
                cell_ratio(ratio(row, "hf_eager", "breakgraph"), digits=2),
            ]
        )
    return table(header, rows)


def compile_part(data: dict, check_list: list[Check]) -> str:
    fams = [f for f in ordered(data) if "compile" in f]
    if not fams:
        reasons = sorted({s["reason"] for s in data.get("skipped", []) if s["what"] == "compile"})
        return fill(
            "prefill.compile.missing", reason="; ".join(reasons) or "no family was compiled"
        )
    rows, first_rows = [], []
    for fam in fams:
        for row in singles(fam):
            value = ratio(row, "bg_compiled", "compile_ro")
            bad = missed(check_list, "TARGET_BGC_VS_COMPILE_RO", fam["family"], row["workload"])
            rows.append(
                [
                    fam["family"],
                    row["workload"],
                    cell_ms(row, "compile_ro"),
                    cell_ms(row, "bg_compiled"),
                    cell_ms(row, "breakgraph"),
                    cell_ms(row, "hf_graph"),
                    cell_ratio(value, bad),
                    cell_spread(row, "bg_compiled/compile_ro"),
                ]
            )
        info = fam["compile"]
        bg_first = {
            r["tokens"]: r["first_call_s"] for r in info.get("bg_compiled", {}).get("lengths", [])
        }
        for r in info.get("compile_ro", {}).get("lengths", []):
            first_rows.append(
                [
                    fam["family"],
                    r["tokens"],
                    num(r["first_call_s"]),
                    num(r["ready_s"]),
                    r["frames"],
                    num(bg_first[r["tokens"]], 3) if r["tokens"] in bg_first else "-",
                ]
            )
        fc = first_call(fam)
        if fc:
            bad = missed(check_list, "TARGET_FIRST_CALL_SPEEDUP", fam["family"])
            first_rows.append(
                [
                    fam["family"],
                    f"all {fc['lengths']}",
                    "",
                    num(fc["ro_s"]),
                    fc["ro_frames"],
                    f"{num(fc['bg_s'])} (construction {num(fc['construction_s'])}): "
                    f"{num(fc['speedup'], 1)}× less{MISSED if bad else ''}",
                ]
            )
    compiled_names = ", ".join(f["family"] for f in fams)
    not_compiled = sorted({s["family"] for s in data.get("skipped", []) if s["what"] == "compile"})
    ro_calls = (
        span(
            [
                f["compile"]["compile_ro"]["calls_per_length"]
                for f in fams
                if "compile_ro" in f["compile"]
            ],
            0,
        )
        or "-"
    )
    return fill(
        "prefill.compile",
        families=compiled_names,
        target=f"{T.TARGET_BGC_VS_COMPILE_RO:g}",
        not_compiled=", ".join(not_compiled) or "none",
        table=table(
            [
                "family",
                "workload",
                "compile reduce-overhead ms",
                "breakgraph compiled ms",
                "breakgraph ms",
                "exact-length graph ms",
                "breakgraph compiled / compile reduce-overhead",
                "per round",
            ],
            rows,
        ),
        ro_calls=ro_calls,
        speedup_target=f"{T.TARGET_FIRST_CALL_SPEEDUP:g}",
        lengths_target=T.TARGET_FIRST_CALL_LENGTHS,
        first_calls=table(
            [
                "family",
                "prompt tokens",
                "compile reduce-overhead: first call s",
                "ready s",
                "frames compiled",
                "breakgraph compiled: first call s",
            ],
            first_rows,
        ),
    )


def capture_part(data: dict, check_list: list[Check]) -> str:
    rows = []
    for fam in ordered(data):
        runner = fam.get("runner")
        if not runner:
            continue
        name = fam["family"]
        cap = capture_stats(runner)
        memory = ladder_memory(fam)
        worst = worst_padding(runner["buckets"], T.PADDING_FROM_TOKENS)
        mark = lambda target: MISSED if missed(check_list, target, name) else ""  # noqa: E731
        buckets = sorted(runner["buckets"])
        rows.append(
            [
                name,
                f"{len(buckets)}: {buckets[0]}–{buckets[-1]}",
                num(runner["construction_s"]),
                f"{cap['first_bucket']}: {num(cap['first_s'], 3)}",
                "-"
                if cap["extra_mean"] is None
                else f"{num(cap['extra_mean'], 3)} / {num(cap['extra_max'], 3)}"
                + mark("TARGET_CAPTURE_S_PER_EXTRA_BUCKET"),
                num(mib(runner), 0),
                "-" if not memory else num(memory[1], 0),
                "-" if not memory else num(memory[2]) + mark("TARGET_LADDER_MEMORY_RATIO"),
                "-"
                if not worst
                else f"{pct(worst[0])} ({worst[1]} in {worst[2]}){mark('TARGET_PADDING_WASTE')}",
            ]
        )
    return fill(
        "prefill.capture",
        capture_target=f"{T.TARGET_CAPTURE_S_PER_EXTRA_BUCKET:g}",
        memory_target=f"{T.TARGET_LADDER_MEMORY_RATIO:g}",
        padding_target=pct(T.TARGET_PADDING_WASTE),
        padding_from=T.PADDING_FROM_TOKENS,
        table=table(
            [
                "family",
                "buckets",
                "construction s",
                "first bucket: capture s",
                "per extra bucket: mean / max s",
                "ladder graph MiB",
                "largest alone MiB",
                "ladder / alone",
                "worst padding",
            ],
            rows,
        ),
    )


def host_part(data: dict, check_list: list[Check]) -> str:
    rows = []
    for fam in ordered(data):
        for row in fam.get("rows", []):
            host = row.get("host", {})
            bg = host.get("breakgraph")
            if not bg:
                continue
            value = host_over_device(row)
            bad = missed(check_list, "TARGET_HOST_OVER_DEVICE_32", fam["family"], row["workload"])
            first = bg.get("to_first_replay_ms")
            other = lambda v, k: (
                num(host[v][k]) if v in host and host[v].get(k) is not None else "-"
            )  # noqa: E731
            rows.append(
                [
                    fam["family"],
                    row["workload"],
                    num(bg["return_ms"]),
                    "-" if first is None else num(first),
                    other("breakgraph", "device_ms"),
                    "-" if value is None else pct(value) + (MISSED if bad else ""),
                    other("bg_one_graph", "return_ms"),
                    other("hf_graph", "return_ms"),
                    other("hf_graph", "device_ms"),
                ]
            )
    return fill(
        "prefill.host",
        host_target=pct(T.TARGET_HOST_OVER_DEVICE_32),
        short=T.SHORT_PROMPT_TOKENS,
        table=table(
            [
                "family",
                "workload",
                "breakgraph: host to return ms",
                "host to first replay ms",
                "device ms",
                "host / device",
                "one graph: host to return ms",
                "exact graph: host to return ms",
                "exact graph: device ms",
            ],
            rows,
        ),
    )


def variants_list(data: dict) -> str:
    return "\n".join(f"- *{TITLES.get(k, k)}*: {v}." for k, v in data["variants"].items())


def not_measured(data: dict) -> str:
    items = [fill("item.skipped", **s) for s in data.get("skipped", [])]
    for fam in data["families"]:
        for what, error in fam.get("errors", {}).items():
            items.append(
                fill("item.error", family=fam["family"], what=what, error=error.replace("`", "'"))
            )
    return fill("prefill.skipped", items=bullets(items)) if items else ""


def section(data: dict | None) -> list[str]:
    """The prefill section as a list of Markdown blocks."""
    if data is None:
        return [fill("prefill.missing", file=FILE, targets=targets_table(None))]
    check_list = checks(data)
    meta, settings = data["meta"], data["settings"]
    lengths = f"{settings['batch_min_len']}–{settings['batch_max_len'] - 1}"
    blocks = [
        fill(
            "prefill.intro",
            file=FILE,
            gpu=meta.get("gpu") or meta.get("cpu", "-"),
            torch=meta["torch"],
            transformers=meta["transformers"],
            date=meta["date"],
            dtype=settings["dtype"],
            calls=settings["rounds"] * settings["iters"],
            warmup=settings["warmup"],
            iters=settings["iters"],
            sizes=", ".join(map(str, settings["sizes"])),
            batch_prompts=settings["batch_prompts"],
            batch_lengths=lengths,
            variants=variants_list(data),
            targets=targets_table(check_list),
            target_32=f"{T.TARGET_BG_VS_EXACT_GRAPH_32:g}",
            short=T.SHORT_PROMPT_TOKENS,
            target_long=f"{T.TARGET_BG_VS_EXACT_GRAPH:g}",
            headline=headline(data, check_list),
            eager=eager_paragraph(data),
        )
    ]
    skipped = not_measured(data)
    if skipped:
        blocks.append(skipped)
    for fam in ordered(data):
        blocks.append(
            fill(
                "prefill.family",
                family=fam["family"],
                params=num(fam["params_m"], 0),
                shape=fam["shape"],
                eager_batch_calls=settings["eager_batch_calls"],
                table=family_table(fam, check_list),
            )
        )
    blocks += [
        compile_part(data, check_list),
        capture_part(data, check_list),
        host_part(data, check_list),
    ]
    losses = loss_lines(data, check_list)
    blocks.append(
        fill("prefill.losses", losses=bullets(losses)) if losses else fill("prefill.losses.none")
    )
    return blocks


# -- console summary and plot ----------------------------------------------------------------
def summary_lines(data: dict) -> list[str]:
    """What bench_prefill prints at the end: the headline ratios, the verdicts, the losses."""
    check_list = checks(data)
    lines = [
        f"{data['meta'].get('gpu') or 'CPU'}, torch {data['meta']['torch']}, "
        f"{data['meta'].get('elapsed_s', 0):.0f} s"
    ]
    for fam in ordered(data):
        cells = []
        for row in fam.get("rows", []):
            exact = ratio(row, "breakgraph", "hf_graph")
            eager = ratio(row, "hf_eager", "breakgraph")
            cells.append(
                f"{row['workload'].split(' (')[0]}: "
                f"{num(exact, 3) if exact else '-'} / {num(eager, 1) if eager else '-'}"
            )
        lines.append(
            f"{fam['family']} (breakgraph / exact graph, eager / breakgraph): " + ", ".join(cells)
        )
        for what, error in fam.get("errors", {}).items():
            lines.append(f"  ERROR {what}: {error[:160]}")
    counts = [sum(c.met is v for c in check_list) for v in (True, False, None)]
    lines.append(f"targets: {counts[0]} met, {counts[1]} missed, {counts[2]} not measured")
    lines += [line[:300] for line in loss_lines(data, check_list)]
    lines += [
        f"skipped: {s['family']} {s['what']}: {s['reason'][:80]}" for s in data.get("skipped", [])
    ]
    return lines


def plot(data: dict, plt, path: str, save: dict) -> None:
    """One panel per prompt size: each variant's time over the exact-length graph's."""
    sizes = data["settings"]["sizes"]
    fams = ordered(data)
    series = ("breakgraph", "bg_one_graph", "compile_ro", "bg_compiled")
    fig, axes = plt.subplots(
        1, len(sizes), figsize=(4.2 * len(sizes), 3.8), sharey=True, squeeze=False
    )
    lowest = 1.0
    for ax, n in zip(axes[0], sizes):
        width = 0.8 / len(series)
        for k, key in enumerate(series):
            values = []
            for fam in fams:
                row = next((r for r in singles(fam) if r["tokens"] == n), None)
                values.append((row and ratio(row, key, "hf_graph")) or 0)
            lowest = min([lowest] + [v for v in values if v])
            offsets = [i + (k - (len(series) - 1) / 2) * width for i in range(len(fams))]
            ax.bar(offsets, values, width, label=TITLES[key])
        ax.axhline(
            T.bg_vs_exact_limit(n),
            color="grey",
            linestyle="--",
            linewidth=1,
            label="target (breakgraph)",
        )
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xticks(
            range(len(fams)), [f["family"] for f in fams], rotation=30, ha="right", fontsize=7
        )
        ax.set_title(f"{n} tokens", fontsize=9)
    axes[0][0].set_ylim(bottom=max(0.0, lowest - 0.1))
    axes[0][0].set_ylabel("time / exact-length graph")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, **save)
    plt.close(fig)
