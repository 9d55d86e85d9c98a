"""Page sections on the cost of one break: per-break overhead and the anatomy of an
attention break (``bench_overhead`` and ``break_anatomy`` JSON)."""

from __future__ import annotations

from . import targets as T
from .template import fill, num, span, table

OVERHEAD_FILE = "h200-overhead.json"
BEFORE_DEBUG_FILE = "h200-overhead-before-debug.json"
ANATOMY_FILES = ("h200-break-anatomy.json", "h200-break-anatomy-repeat.json")


def _regimes(names: list[str]) -> str:
    quoted = [f"*{n}*" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def overhead_section(data: dict, before: dict | None = None) -> list[str]:
    rows = data["overhead"]
    target = T.TARGET_ADDED_US_PER_BREAK
    cells = [
        [
            f"{r['regime']} ({r['kernels_per_segment']} kernel(s) × {r['elements']} floats "
            "per segment)",
            r["breaks"],
            num(r["eager_us"], 1),
            num(r["full_graph_us"], 1),
            num(r["breakgraph_us"], 1),
            num(r["added_per_break_us"]),
            num(r["floor_per_break_us"]),
            "met" if r["added_per_break_us"] <= target else "missed",
        ]
        for r in rows
    ]
    header = [
        "regime",
        "breaks",
        "eager µs",
        "one graph µs",
        "breakgraph µs",
        "added per break µs",
        "floor per break µs",
        f"target ≤ {target:g} µs",
    ]
    margin = num(max(abs(r["added_per_break_us"] - r["floor_per_break_us"]) for r in rows))
    missed = [r for r in rows if r["added_per_break_us"] > target]
    gap = [r for r in missed if r["floor_per_break_us"] > target]  # any cut misses there
    own = [r for r in missed if r["floor_per_break_us"] <= target]  # breakgraph's own cost
    losses = [] if missed else [fill("overhead.met")]
    if gap:
        losses.append(
            fill(
                "overhead.losses",
                missed=_regimes([r["regime"] for r in gap]),
                floor_missed=span(r["floor_per_break_us"] for r in gap),
            )
        )
    if own:
        losses.append(
            fill(
                "overhead.losses.own",
                missed=_regimes([r["regime"] for r in own]),
                added=span(r["added_per_break_us"] for r in own),
                floor=span(r["floor_per_break_us"] for r in own),
            )
        )
    losses.append(fill("overhead.margin", margin=margin))
    meta = data["meta"]
    blocks = [
        fill(
            "overhead",
            file=OVERHEAD_FILE,
            gpu=meta["gpu"],
            torch=meta["torch"],
            date=meta["date"],
            target=f"{target:g}",
            trials=fill("overhead.trials", trials=meta["trials"]) + " " if "trials" in meta else "",
            table=table(header, cells),
            losses=" ".join(losses),
        )
    ]
    if before and any("debug_mode_per_break_us" in r for r in rows):
        old = {r["regime"]: r for r in before["overhead"]}

        def over(r: dict) -> str:
            added = r["added_per_break_us"]
            return f"{num(added)} ({added - r['floor_per_break_us']:+.2f})"

        debug_rows = [
            [r["regime"], over(old[r["regime"]]), over(r), num(r["debug_mode_per_break_us"])]
            for r in rows
            if r["regime"] in old
        ]
        header = [
            "regime",
            "before debug mode: added µs/break (over the floor)",
            "now, debug off (over the floor)",
            "now, debug on",
        ]
        blocks.append(
            fill(
                "overhead.debug",
                before_file=BEFORE_DEBUG_FILE,
                before_date=before["meta"]["date"],
                table=table(header, debug_rows),
            )
        )
    return blocks


def anatomy_section(runs: list[dict]) -> list[str]:
    """One table row per run and token count, so the run-to-run noise shows."""
    meta = runs[0]["meta"]
    rows, copy_back, faster = [], [], []
    for i, data in enumerate(runs, 1):
        for r in data["rows"]:
            per = r["us_per_break"]
            copy = per["breakgraph"] - per["eager_flash_no_copy"]
            copy_back.append(copy)
            if per["eager_flash_no_copy"] < per["cuts_only"]:
                faster.append((r["tokens"], per["cuts_only"] - per["eager_flash_no_copy"]))
            rows.append(
                [
                    i,
                    r["tokens"],
                    num(r["ms"]["full_graph"], 3),
                    num(per["cuts_only"]),
                    num(per["eager_flash_no_copy"]),
                    num(per["breakgraph"]),
                    num(copy),
                    num(r["ms"]["breakgraph"] / r["ms"]["full_graph"], 3),
                ]
            )
    header = [
        "run",
        "tokens",
        "full graph ms",
        "cuts only",
        "+ eager kernel",
        "breakgraph",
        "copy-back share",
        "breakgraph / full graph",
    ]
    faster_text = ""
    if faster:
        tokens = sorted({t for t, _ in faster})
        faster_text = fill(
            "anatomy.faster_eager",
            tokens=" and ".join(map(str, tokens)),
            delta=span(d for _, d in faster),
        )
    return [
        fill(
            "anatomy",
            model=meta["model"],
            breaks=meta["breaks"],
            runs=len(runs),
            table=table(header, rows),
            copy_back=span(copy_back),
            faster_eager=faster_text,
        )
    ]
