"""Derived numbers of the prefill benchmark's JSON and every target applied to them.

One set of verdicts (:func:`checks`) feeds the targets table, the marks in the other
tables, "where breakgraph loses" and the console summary of the benchmark, so none of
them can disagree with another or with the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import targets as T
from .template import fill, num, pct

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
    if name in ("TARGET_PADDING_WASTE", "TARGET_HOST_OVER_DEVICE_32"):
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


# -- where breakgraph loses ---------------------------------------------------------------
def why_slower(row: dict) -> str:
    """Split breakgraph / exact graph into padding-and-packing and the breaks; blame the
    host when it cannot issue the call within the device time."""
    parts = []
    one = ratio(row, "bg_one_graph", "hf_graph")
    pad = padding(row)
    if one is not None:
        single = row.get("kind") == "single"
        parts.append(
            fill(
                "why.one_graph.single" if single else "why.one_graph",
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
    if any(c.met is False and c.target == "TARGET_CAPTURE_S_PER_EXTRA_BUCKET" for c in check_list):
        lines.append(fill("why.capture"))
    return lines
