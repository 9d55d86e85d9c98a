"""The prefill section of the performance page (and the benchmark's console summary) from
``bench_prefill``'s JSON: tables and plot from code, prose from ``performance.md.in``,
verdicts from :mod:`.prefill_checks`."""

from __future__ import annotations

import statistics

from breakgraph.buckets import default_token_buckets

from . import targets as T
from .prefill_checks import (
    TARGETS,
    TITLES,
    VARIANT_COLUMNS,
    Check,
    capture_stats,
    checks,
    first_call,
    host_over_device,
    is_moe,
    ladder_memory,
    limit_text,
    loss_lines,
    mib,
    missed,
    padding,
    ratio,
    singles,
    target_label,
    worst_padding,
)
from .template import bullets, fill, num, pct, span, table

FILE = "h200-prefill-baselines.json"
NEIGHBOURS_FILE = "h200-prefill-host-path-neighbours.json"  # prefill_host_path --neighbours
PACKED_ONLY_FILE = "h200-prefill-baselines-packed-only.json"  # before single-prompt graphs
COMPILE_FILE = "h200-prefill-compile.json"  # a run for the torch.compile variants only
TRIED_FILE = "h200-prefill-baselines-5.25.json"  # a release outside the declared range, tried
NEWEST_FILE = "h200-prefill-baselines-5.24.json"  # the same benchmark on the newest transformers
OTHER_CARD_FILE = "h100-prefill-baselines.json"  # the same benchmark on an H100, four families
#: the benchmark on families held out of its default (``families.HELD_OUT_FAMILIES``: gpt-oss)
HELD_OUT_FILES = ("h100-prefill-gpt-oss-5.17.json", "h100-prefill-gpt-oss-5.24.json")
#: two of those families again on an H100, after the LM head's rows were sliced per bucket
LM_HEAD_FILE = "h100-prefill-lmhead.json"
#: that run's illegal memory access again: its last five families, a device-wide sync per read
REPRODUCED_FILE = "h200-prefill-baselines-5.24-b.json"
TORCH_ISSUE = "pytorch/pytorch#193402"  # graphs on one stream share its cuBLAS workspace
#: the attempts that did not reproduce it (one family, compile variants on)
REPRO_FILES = (
    "h200-prefill-compile-5.24-blocking.json",
    "h200-prefill-compile-5.17-alone.json",
    "h200-prefill-probe-5.24.txt",
)
#: the same five families once more, after both fixes (breakgraph's reset on its own stream, the
#: baseline freeing the cuBLAS workspaces before its capture)
FIXED_FILE = "h200-prefill-repro-5.24-fixed.json"
#: ``prefill_host_path --compare``: the code before (old) and after (new) the step's copy moved
#: into the graphs, each tree in a process of its own, in both orders, unpinned and on one core
UPLOAD_FILES = (
    ("h200-prefill-host-path-upload-new-first.json", "new tree first"),
    ("h200-prefill-host-path-upload-old-first.json", "old tree first"),
    ("h200-prefill-host-path-upload-pinned-new-first.json", "one core (taskset), new first"),
    ("h200-prefill-host-path-upload-pinned-old-first.json", "one core (taskset), old first"),
)
#: ``prefill_host_path --compare`` around a device prompt's copy into a view of the host buffer
#: made once per length (old: a slice per call), in both orders, on one core
VIEW_FILES = (
    ("h200-prefill-host-path-views-new-first.json", "one core (taskset), new first"),
    ("h200-prefill-host-path-views-old-first.json", "one core (taskset), old first"),
)
COPY_ISSUE_FILE = "h200-copy-issue.json"  # one 32-id device-to-host copy, ways of issuing it
BACK_TO_BACK_FILE = "h200-prefill-back-to-back.json"  # queued against synchronous calls
BACK_TO_BACK_EVENT_FILE = "h200-prefill-back-to-back-event.json"  # the read event in the graph
MOE_PADDING_FILE = "h200-prefill-moe-padding.json"  # grouped experts skipping padding rows
HOST_LINES_FILE = "h200-prefill-host-lines.json"  # prefill_host_lines --device cuda
MISSED = " ✗"


# -- the page section --------------------------------------------------------------------
def targets_table(check_list: list[Check] | None) -> str:
    rows = []
    for name in TARGETS:
        mine = [c for c in check_list or () if c.target == name]
        counts = [sum(c.met is v for c in mine) for v in (True, False, None)]
        measured = counts if check_list is not None else ["-"] * 3
        rows.append([target_label(name), f"`{name}`", limit_text(name), *measured])
    return table(["target", "constant", "limit", "met", "missed", "not measured"], rows)


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


def correctness_table(fam: dict) -> str:
    """Each variant's worst agreement with HF eager over the workloads."""
    found = fam.get("correctness")
    if not found:
        return ""
    rows = []
    for key, title in VARIANT_COLUMNS:
        seen = [v[key] for v in found.values() if key in v]
        if seen:
            rows.append(
                [
                    title,
                    num(max(c["max_abs_diff"] for c in seen), 3),
                    pct(min(c["argmax_agree"] for c in seen)),
                ]
            )
    return fill(
        "prefill.correctness",
        table=table(["variant", "max abs Δlogit", "greedy tokens agree"], rows),
    )


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
                    f"{num(fc['bg_s'])} (construction {num(fc['construction_s'])}); "
                    f"ratio {num(fc['speedup'], 1)}{MISSED if bad else ''}",
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


def compile_run_section(data: dict) -> list[str]:
    """A run made for the torch.compile variants (``--compile-families``): its compile part."""
    meta = data["meta"]
    fams = [f["family"] for f in ordered(data) if "compile" in f]
    intro = fill(
        "prefill.compile_run",
        file=COMPILE_FILE,
        gpu=meta.get("gpu") or meta.get("cpu", "-"),
        torch=meta["torch"],
        transformers=meta["transformers"],
        date=meta["date"],
        families=", ".join(fams) or "no family",
        breakdown=compile_breakdown(data),
    )
    return [intro, compile_part(data, checks(data))]


def newest_release_section(
    data: dict | None, older: dict | None, fixed: dict | None = None
) -> list[str]:
    """The same benchmark on the newest transformers supported: its targets and the headline
    ratios, against the main run's (``older``) ratio range per prompt size; ``fixed``: the
    rerun of the faulting families after the fixes (:data:`FIXED_FILE`)."""
    if data is None:
        return []
    meta, check_list = data["meta"], checks(data)

    def bg_over_exact(run: dict | None, n: int) -> list[float]:
        rows = [r for fam in (run or {}).get("families", []) for r in singles(fam)]
        values = [ratio(r, "breakgraph", "hf_graph") for r in rows if r["tokens"] == n]
        return [v for v in values if v is not None]

    lines = []
    for n in data["settings"]["sizes"]:
        now, before = bg_over_exact(data, n), bg_over_exact(older, n)
        if now:
            lines.append(
                f"- {n} tokens: breakgraph / exact-length graph {span(now, 3)} on transformers "
                f"{meta['transformers']}"
                + (f", {span(before, 3)} on {older['meta']['transformers']}" if before else "")
            )
    # every skip but the compile variants of families not asked for (listed in the main run)
    notes = [f"- {item['family']}, {item['what']}: {item['reason']}"
             for item in data.get("skipped", []) if item.get("what") != "compile"]  # fmt: skip
    return [
        fill(
            "prefill.newest",
            file=NEWEST_FILE,
            **_run_fields(meta),
            older=(older or {}).get("meta", {}).get("transformers", "-"),
            compiled=", ".join(data["settings"].get("compile_families", [])) or "no family",
            targets=targets_table(check_list),
            headline=headline(data, check_list),
            ratios=bullets(lines),
            notes=bullets(notes) or "(none)",
            repro_files=", ".join(f"`{name}`" for name in REPRO_FILES),
            reproduced_file=REPRODUCED_FILE,
            torch_issue=TORCH_ISSUE,
            after_fixes=after_fixes(fixed),
        )
    ]


def _run_fields(meta: dict) -> dict:
    """A run's GPU, torch, transformers and date, as the sections' templates name them."""
    return {"gpu": meta.get("gpu") or "-", "torch": meta["torch"],
            "transformers": meta["transformers"], "date": meta["date"]}  # fmt: skip


def _bg_over_exact(run: dict | None, family: str, n: int) -> float | None:
    """breakgraph / exact-length graph of ``family``'s single prompt of ``n`` tokens."""
    fam = next((f for f in (run or {}).get("families", []) if f["family"] == family), None)
    row = next((r for r in singles(fam) if r["tokens"] == n), None) if fam else None
    return None if row is None else ratio(row, "breakgraph", "hf_graph")


def _beside(data: dict, runs: list, label) -> dict:
    """The placeholders that set ``data``'s families beside ``runs`` (``data`` first): a table
    of breakgraph / exact-length graph per family and prompt size, one column per run headed
    ``label(run)`` (``-`` where a run lacks the family), ``data``'s worst ratio against its
    target, and its targets met and missed (the misses as text, "none" when all were met)."""
    rows, own = [], []
    for fam in data["families"]:
        for n in data["settings"]["sizes"]:
            cells = [_bg_over_exact(run, fam["family"], n) for run in runs]
            rows.append([fam["family"], str(n), *("-" if c is None else num(c, 3) for c in cells)])
            own += [cells[0]] if cells[0] is not None else []
    check_list = checks(data)
    missed = [c for c in check_list if c.met is False]
    return {
        **_run_fields(data["meta"]),
        "families": ", ".join(f["family"] for f in data["families"]),
        "table": table(["family", "tokens", *map(label, runs)], rows),
        "worst": num(max(own), 3),
        "target": f"{T.TARGET_BG_VS_EXACT_GRAPH:g}",
        "met": sum(c.met is True for c in check_list),
        "missed": len(missed),
        "misses": "; ".join(f"{c.family}, {target_label(c.target)}: {num(c.value, 3)} "
                            f"({limit_text(c.target)})" for c in missed) or "none",
    }  # fmt: skip


def tried_release_section(data: dict | None, *older: dict | None) -> list[str]:
    """The benchmark on a release outside the declared range (:data:`TRIED_FILE`), on the
    families it ran, beside the same families on the releases of ``older`` (the main run and
    the newest supported): breakgraph / exact-length graph per prompt size, and its targets."""
    if data is None:
        return []
    runs = [data, *(run for run in older if run is not None)]
    return [fill("prefill.tried", file=TRIED_FILE,
                 **_beside(data, runs, lambda r: f"transformers {r['meta']['transformers']}"))]


def other_card_section(data: dict | None, main: dict | None) -> list[str]:
    """The benchmark on another card (:data:`OTHER_CARD_FILE`), on the families it ran, beside
    the main run's (``main``) on its card: breakgraph / exact-length graph per prompt size,
    this card's targets, and the capture time per extra bucket it missed."""
    if data is None:
        return []
    runs = [data] + ([main] if main is not None else [])
    return [fill("prefill.other_card", file=OTHER_CARD_FILE, main_file=FILE,
                 main_gpu=(main or {}).get("meta", {}).get("gpu") or "-",
                 **_beside(data, runs, lambda r: r["meta"].get("gpu") or "-"))]


def held_out_section(runs: list) -> list[str]:
    """The benchmark on a held-out family (:data:`HELD_OUT_FILES`, one run per transformers
    release, those that exist): each run's table, its agreement with HF eager and its
    targets; the baseline is HF's eager attention where transformers has no SDPA."""
    blocks = []
    for name, data in runs:
        check_list = checks(data)
        missed = [c for c in check_list if c.met is False]
        for fam in data["families"]:
            worst = {key: max((w[key]["max_abs_diff"] for w in fam.get("correctness", {}).values()
                               if key in w), default=None)
                     for key in ("breakgraph", "bg_one_graph", "hf_eager_padded")}  # fmt: skip
            blocks.append(fill(
                "prefill.held_out", file=name, family=fam["family"], **_run_fields(data["meta"]),
                shape=fam.get("shape", "-"), table=family_table(fam, check_list),
                correctness=correctness_table(fam), met=sum(c.met is True for c in check_list),
                missed=len(missed), misses="; ".join(
                    f"{c.what + ', ' if c.what else ''}{target_label(c.target)}: "
                    f"{num(c.value, 3)} ({limit_text(c.target)})" for c in missed) or "none",
                bg_diff=num(worst["breakgraph"], 2) if worst["breakgraph"] is not None else "-",
                padded_diff=num(worst["hf_eager_padded"], 2)
                if worst["hf_eager_padded"] is not None else "-",
                not_measured=sum(c.met is None for c in check_list),
                errors="; ".join(f"{k}: {v}" for k, v in fam.get("errors", {}).items()) or "none",
            ))  # fmt: skip
    return blocks


def lm_head_section(after: dict | None, before: dict | None) -> list[str]:
    """The families of ``after`` (:data:`LM_HEAD_FILE`) beside the same families in ``before``
    (:data:`OTHER_CARD_FILE`, the same card a day earlier): breakgraph's and the exact-length
    graph's milliseconds per workload, and their ratio, before and after the LM head ran over
    ``min(bucket, max_prompts)`` rows (one in a single-prompt graph) instead of
    ``max_prompts``."""
    if after is None or before is None:
        return []
    rows = []
    for fam in after["families"]:
        old = next((f for f in before["families"] if f["family"] == fam["family"]), None)
        for new_row in fam["rows"]:
            old_row = next((r for r in (old or {}).get("rows", [])
                            if r["workload"] == new_row["workload"]), None)  # fmt: skip
            cells = []
            for row in (old_row, new_row):
                ms = (row or {}).get("ms", {})
                bg, exact = ms.get("breakgraph"), ms.get("hf_graph")
                cells += ["-", "-", "-"] if bg is None or exact is None else [
                    num(bg, 3), num(exact, 3), num(bg / exact, 3)]
            rows.append([fam["family"], new_row["workload"], *cells])
    header = ["family", "workload", "breakgraph ms, before", "exact graph ms, before",
              "ratio, before", "breakgraph ms, after", "exact graph ms, after", "ratio, after"]
    return [fill("prefill.lm_head", file=LM_HEAD_FILE, before_file=OTHER_CARD_FILE,
                 before_date=before["meta"]["date"], **_run_fields(after["meta"]),
                 table=table(header, rows))]  # fmt: skip


def after_fixes(data: dict | None) -> str:
    """What the rerun of the five families after both fixes read: whether every variant's
    correctness read came back (a fault ends the process, leaving families unread)."""
    if data is None:
        return "Neither fix has run on the GPU yet."
    families = data["families"]
    variants = sorted({v for fam in families for case in fam.get("correctness", {}).values()
                       for v in case})  # fmt: skip
    read = sum(len(case) for fam in families for case in fam.get("correctness", {}).values())
    compiled = [fam["family"] for fam in families if fam.get("compile")]
    meta = data["meta"]
    return (
        f"With both fixes the five families ran again in one process on transformers "
        f"{meta['transformers']} ({meta['date']}, `{FIXED_FILE}`): {len(families)} families, "
        f"{read} correctness reads of {len(variants)} variants ({', '.join(variants)}), "
        f"the compile variants of {', '.join(compiled) or 'no family'} included, and no fault. "
        "One clean run does not prove the cause: before the fixes the fault came in both "
        "multi-family runs and in none of the single-family ones."
    )


def compile_breakdown(data: dict) -> str:
    """Where the first compiled call's time goes, for the first family with the timers
    (``compile_s``, recorded since 2026-12-01); empty for older runs."""
    for fam in ordered(data):
        info = fam.get("compile") or {}
        bg, ro = info.get("bg_compiled") or {}, info.get("compile_ro") or {}
        spent = (bg.get("dynamo") or {}).get("compile_s")
        ro_lengths = [r for r in ro.get("lengths", []) if "compile_s" in r]
        if not spent or len(ro_lengths) < 2:
            continue
        rest = [s for _, s in bg["capture_seconds"][1:]]
        first_ro, second_ro = ro_lengths[0]["compile_s"], ro_lengths[1]["compile_s"]
        return fill(
            "prefill.compile.breakdown",
            bg_compile=num(spent["compile_s"], 1),
            bg_first=num(bg["capture_seconds"][0][1], 1),
            bg_dynamo=num(spent["dynamo_s"], 1),
            bg_frames=bg["dynamo"]["frames"],
            bg_aot=num(spent["aot_autograd_s"], 1),
            bg_inductor=num(spent["inductor_s"], 1),
            bg_load=num(spent["inductor_module_load_s"], 1),
            bg_rest_ms=num(1000 * sum(rest) / len(rest), 0) if rest else "-",
            ro_compile=num(first_ro["compile_s"], 1),
            ro_dynamo=num(first_ro["dynamo_s"], 1),
            ro_aot=num(first_ro["aot_autograd_s"], 1),
            ro_inductor=num(first_ro["inductor_s"], 1),
            ro_compile_2=num(second_ro["compile_s"], 1),
        )
    return ""


#: benchmarks/capture_time.py runs: before (every variant), then later code, each with its tag
CAPTURE_FILES = ("h200-capture-time-llama.json", "h200-capture-time-mistral.json")
CAPTURE_LATER_FILES = (
    ("h200-capture-time-after.json", "after"),
    ("h200-capture-time-now.json", "now"),
    ("h200-capture-time-tune.json", "now, one tuning warm-up"),
    ("h200-capture-time-tune1.json", "now, one timed tuning replay"),
    # session 12: main and branch settle-copy-only in turn, main first (four processes)
    ("h200-capture-time-main-a.json", "main, in turn (1)"),
    ("h200-capture-time-settle-a.json", "settle on the copy only, in turn (1)"),
    ("h200-capture-time-main-b.json", "main, in turn (2)"),
    ("h200-capture-time-settle-b.json", "settle on the copy only, in turn (2)"),
    # session 12: tuning with and without its warm-up replay, in turn (four processes)
    ("h200-capture-time-tune-default-1.json", "in turn (1)"),
    ("h200-capture-time-tune-no_tune_warmup-1.json", "in turn (1)"),
    ("h200-capture-time-tune-default-2.json", "in turn (2)"),
    ("h200-capture-time-tune-no_tune_warmup-2.json", "in turn (2)"),
)


def _after_captures(first: dict, second: dict) -> str:
    """Construction time after the packed ladder's captures (the single-prompt ladder, then
    tuning) and how many routes tuning made, per runner; "-" for runs that did not record it."""
    if "after_captures_s" not in first:
        return "-"
    return " / ".join(
        f"{num(r['after_captures_s'], 2)} ({len(r['routed'])})" for r in (first, second)
    )


def capture_floor(runs: list[dict], baselines: dict | None) -> str:
    """The host floor of a default ladder's construction: two captured forwards per bucket,
    each costing about HF eager's host-bound forward at the shortest measured length (from
    ``baselines``, bench_prefill's JSON), for the first family of ``runs``."""
    if not runs or not runs[0]["results"] or baselines is None:
        return ""
    name = runs[0]["results"][0]["family"]
    family = next((f for f in baselines["families"] if f["family"] == name), None)
    rows = [r for r in (family or {}).get("rows", []) if r["kind"] == "single"]
    if not rows or "hf_eager" not in rows[0]["ms"]:
        return ""
    row = min(rows, key=lambda r: r["tokens"])
    buckets = len(default_token_buckets())
    eager = row["ms"]["hf_eager"]
    return fill(
        "prefill.capture_floor",
        tokens=row["tokens"],
        eager=num(eager, 1),
        family=name,
        layers=family["config"].get("num_hidden_layers", "-"),
        floor_ms=num(2 * eager, 0),
        target_ms=num(1000 * T.TARGET_CAPTURE_S_PER_EXTRA_BUCKET, 0),
        floor_s=num(2 * eager * buckets / 1000, 1),
        target_s=num(T.TARGET_LADDER_CAPTURE_S, 0),
        buckets=buckets,
    )


def capture_split_section(
    runs: list[dict], later: list[tuple[str, str, dict]], baselines: dict | None = None
) -> list[str]:
    """``benchmarks/capture_time.py``: construction time per variant, first and second runner;
    ``later``: ``(file, tag, data)`` of runs of later code, tagged in the variant column;
    ``baselines`` (bench_prefill's JSON) for the host floor (:func:`capture_floor`)."""
    rows = []
    for data, tag in [(d, "") for d in runs] + [(data, tag) for _, tag, data in later]:
        for r in data["results"]:
            first, second = r["first"], r["second"]
            rows.append(
                [
                    r["family"],
                    f"`{r['variant']}`" + (f", {tag}" if tag else ""),
                    num(first["construction_s"], 2),
                    num(1000 * first["rest_mean_s"], 0),
                    num(second["construction_s"], 2),
                    num(1000 * second["rest_mean_s"], 0),
                    _after_captures(first, second),
                ]
            )
    if not rows:
        return []
    meta = runs[0]["meta"]
    header = [
        "family",
        "variant",
        "first runner s",
        "ms per extra bucket",
        "second runner s",
        "ms per extra bucket",
        "after the captures s (routes), first / second",
    ]
    names = [*CAPTURE_FILES, *(name for name, _, _ in later)]
    return [
        fill(
            "prefill.capture_split",
            files="`, `".join(names),
            gpu=meta.get("gpu") or "-",
            torch=meta["torch"],
            transformers=meta["transformers"],
            date=", ".join(sorted({d["meta"]["date"] for d in [*runs, *(d for *_, d in later)]})),
            table=table(header, rows),
            floor=capture_floor(runs, baselines),
        )
    ]


def neighbours_lines(trees: list | None) -> list[str]:
    """``prefill_host_path --neighbours``: each workload's ratios alone and beside a neighbour."""
    lines = []
    for fam in (trees or [{}])[0].get("families", []):
        for row in fam["rows"]:
            beside = row.get("neighbours")
            if not beside:
                continue
            eager, churn = beside["beside hf_eager"], beside["beside host_churn"]
            host = row["host_us"].get("entry -> launch, probe only")
            lines.append(
                f"{fam['family']}, {row['tokens']} tokens: entry to launch {num(host, 1)} µs; "
                f"breakgraph / exact graph {num(row['bg/exact'], 3)} alone, "
                f"{num(eager['bg/exact'], 3)} beside HF eager, {num(churn['bg/exact'], 3)} beside "
                f"host work; breakgraph / one graph {num(row['bg/one_graph'], 3)}, "
                f"{num(eager['bg/one_graph'], 3)}, {num(churn['bg/one_graph'], 3)}"
            )
    return lines


def upload_lines(runs: list[tuple[str, list]]) -> list[str]:
    """``prefill_host_path --compare`` runs (``(tag, [old, new])``): per run and workload, the
    host time from entry to launch (device prompts; host prompts where measured), old → new,
    and breakgraph / exact graph; then the verdict on ``TARGET_HOST_PATH_US`` for the new tree
    (the median over the runs of each workload)."""
    lines, new_device, new_host, old_device, old_host = [], {}, {}, {}, {}
    for tag, (old, new) in runs:
        before = {(f["family"], r["tokens"]): r for f in old["families"] for r in f["rows"]}
        for fam in new["families"]:
            for row in fam["rows"]:
                key = (fam["family"], row["tokens"])
                prev = before.get(key)
                if prev is None:
                    continue
                launch = "entry -> launch, probe only"
                text = (
                    f"{tag}, {key[0]}, {key[1]} tokens: entry to launch "
                    f"{num(prev['host_us'][launch], 1)} → {num(row['host_us'][launch], 1)} µs"
                )
                new_device.setdefault(key, []).append(row["host_us"][launch])
                old_device.setdefault(key, []).append(prev["host_us"][launch])
                on_host, was = row.get("host_us, host prompt"), prev.get("host_us, host prompt")
                if on_host and was:
                    text += (
                        f" (host prompt {num(was[launch], 1)} → {num(on_host[launch], 1)} µs)"
                    )
                    new_host.setdefault(key, []).append(on_host[launch])
                    old_host.setdefault(key, []).append(was[launch])
                text += (
                    f"; breakgraph / exact graph {num(prev['bg/exact'], 3)} → "
                    f"{num(row['bg/exact'], 3)}"
                )
                lines.append(text)
    target = T.TARGET_HOST_PATH_US
    for what, values, olds in (
        ("device prompts", new_device, old_device),
        ("host prompts", new_host, old_host),
    ):
        medians = {k: statistics.median(v) for k, v in values.items()}
        if not medians:
            continue
        before = [statistics.median(v) for v in olds.values()]
        met = sum(m <= target for m in medians.values())
        worst = max(medians, key=medians.get)
        lines.append(
            f"new tree, {what}: the median over the runs is within {target:g} µs on {met} of "
            f"{len(medians)} workloads (from {num(min(medians.values()), 1)} to "
            f"{num(medians[worst], 1)} µs, the most on {worst[0]} at {worst[1]} tokens; the "
            f"old tree's medians: {num(min(before), 1)} to {num(max(before), 1)} µs)"
            + ("" if met == len(medians) else MISSED)
        )
    return lines


def copy_issue_table(data: dict | None) -> str:
    """Microseconds to issue one small device-to-host copy, per way of issuing it (rows) and
    process (columns: the median of its rounds)."""
    if data is None:
        return "(not measured)"
    runs = data["processes"]
    ways = list(runs[0]["us"])
    rows = [[way] + [num(run["us"][way][0], 1) for run in runs] for way in ways]
    return table(["way of issuing it"] + [f"process {i + 1} µs" for i in range(len(runs))], rows)


def view_numbers(views: list, copy_issue: dict | None) -> dict:
    """The prose's numbers around the cached id views: the loop's costs per way of issuing
    the copy (median over the processes), the slowest process against the fastest, and the
    ``commit`` stage of device-prompt calls, old and new tree (median and range)."""
    out = dict.fromkeys(("loop_slice", "loop_view", "loop_ctypes", "ctypes_saving",
                         "process_factor", "commit_old", "commit_new"), "-")  # fmt: skip
    if copy_issue is not None:
        runs = copy_issue["processes"]
        way = {k: statistics.median(r["us"][k][0] for r in runs) for k in runs[0]["us"]}
        out.update(
            loop_slice=num(way["pinned slice+copy_"], 1),
            loop_view=num(way["pinned view copy_"], 1),
            loop_ctypes=num(way["ctypes cudaMemcpyAsync pinned"], 1),
            ctypes_saving=num(way["pinned view copy_"] - way["ctypes cudaMemcpyAsync pinned"], 1),
        )
        factors = [max(r["us"][k][0] for r in runs) / min(r["us"][k][0] for r in runs)
                   for k in runs[0]["us"]]  # fmt: skip
        out["process_factor"] = f"{num(min(factors), 1)}–{num(max(factors), 1)}"
    for tree, key in ((0, "commit_old"), (1, "commit_new")):
        values = [r["host_us"]["commit"] for _, pair in views for f in pair[tree]["families"]
                  for r in f["rows"]]  # fmt: skip
        if values:
            out[key] = (f"{num(statistics.median(values), 1)} "
                        f"({num(min(values), 1)}–{num(max(values), 1)})")  # fmt: skip
    return out


def queued_lines(data: dict | None) -> list[str]:
    """Back-to-back calls against synchronous ones, old and new tree (ms per call, the median
    over the processes of each tree)."""
    if data is None:
        return []
    lines = []
    runs = data["runs"]
    families = [k for k in next(iter(runs.values())) if k != "tree"]
    for family in families:
        cells = []
        for mode in ("queued", "synchronous"):
            per = {
                tree: statistics.median(
                    r[family][mode] for tag, r in runs.items() if tag.startswith(tree)
                )
                for tree in ("old", "new")
            }
            cells.append(
                f"{mode} {num(per['old'], 3)} → {num(per['new'], 3)} ms per call "
                f"({num(per['new'] / per['old'], 3)}×)"
            )
        lines.append(f"{family}: " + "; ".join(cells))
    return lines


def padding_lines(data: dict | None) -> list[str]:
    """Grouped experts with and without the padding mask: per family and prompt length,
    breakgraph / exact graph old → new (the median over each tree's runs)."""
    if data is None:
        return []
    runs = data["runs"]
    families = sorted({fam for run in runs.values() for fam in run})
    lines = []
    for family in families:
        cells = []
        tokens = sorted({t for run in runs.values() for t in run.get(family, {})}, key=int)
        for t in tokens:
            per = {}
            for tree in ("old", "new"):
                ratios = [
                    run[family][t]["breakgraph"] / run[family][t]["hf_graph"]
                    for tag, run in runs.items()
                    if tag.startswith(tree) and t in run.get(family, {})
                ]
                per[tree] = statistics.median(ratios) if ratios else None
            if per["old"] is not None and per["new"] is not None:
                cells.append(f"{t} tokens {num(per['old'], 3)} → {num(per['new'], 3)}")
        lines.append(f"{family}: breakgraph / exact graph, " + ", ".join(cells))
    return lines


def host_lines_lines(data: dict | None) -> list[str]:
    """``prefill_host_lines`` on the GPU machine: per family, the host path from entry to
    launch, its largest statements and the launch itself (µs, median over its calls)."""
    if data is None:
        return []
    lines = []
    for family, variants in data["families"].items():
        parts = []
        for variant, times in variants.items():
            steps = {k: v for k, v in times.items() if k not in ("entry -> launch",)}
            top = sorted(
                ((k, v) for k, v in steps.items() if not k.startswith("launch")),
                key=lambda kv: -kv[1],
            )[:2]
            parts.append(
                f"{variant}: entry to launch {num(times['entry -> launch'], 1)} µs (largest: "
                + ", ".join(f"{k} {num(v, 1)}" for k, v in top)
                + f"; the launch itself {num(times.get('launch (replay to return)', 0), 1)})"
            )
        lines.append(f"{family}: " + "; ".join(parts))
    return lines


def before_after_lines(before: dict | None, after: dict) -> list[str]:
    """Per family: breakgraph / exact graph of each single prompt, and the construction time,
    in ``before`` (packed graphs only) and ``after``."""
    if before is None:
        return []
    old = {f["family"]: f for f in before["families"]}
    lines = []
    for fam in ordered(after):
        prev = old.get(fam["family"])
        if prev is None or "runner" not in fam or "runner" not in prev:
            continue

        def singles(f: dict) -> dict:
            return {
                r["tokens"]: r["ms"]["breakgraph"] / r["ms"]["hf_graph"]
                for r in f.get("rows", [])
                if r["kind"] == "single" and {"breakgraph", "hf_graph"} <= set(r["ms"])
            }

        a, b = singles(prev), singles(fam)
        ratios = ", ".join(f"{n}: {num(a[n], 3)} → {num(b[n], 3)}" for n in sorted(a) if n in b)
        build = (
            f"built in {num(prev['runner']['construction_s'], 1)} → "
            f"{num(fam['runner']['construction_s'], 1)} s"
        )
        lines.append(f"{fam['family']}: breakgraph / exact graph at {ratios} tokens; {build}")
    return lines


def section(
    data: dict | None,
    neighbours: list | None = None,
    packed_only: dict | None = None,
    upload: list | None = None,
    queued: dict | None = None,
    queued_event: dict | None = None,
    moe_padding: dict | None = None,
    host_lines: dict | None = None,
    views: list | None = None,
    copy_issue: dict | None = None,
) -> list[str]:
    """The prefill section as a list of Markdown blocks (``neighbours``: the
    ``prefill_host_path --neighbours`` results; ``packed_only``: the run before single-prompt
    graphs, for the losses' before/after; ``upload``: ``(tag, [old, new])`` host path runs
    around the step's copy moving into the graphs; ``queued``: the back-to-back run)."""
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
            elapsed=num(meta.get("elapsed_s", 0), 0),
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
                correctness=correctness_table(fam),
            )
        )
    blocks += [
        compile_part(data, check_list),
        capture_part(data, check_list),
        host_part(data, check_list),
    ]
    losses = loss_lines(data, check_list)
    blocks.append(
        fill(
            "prefill.losses",
            losses=bullets(losses),
            neighbours=items(neighbours_lines(neighbours)) or "(not measured)",
            before_after=items(before_after_lines(packed_only, data)) or "(not measured)",
            upload=items(upload_lines(upload or [])) or "(not measured)",
            upload_files="`, `".join(name for name, _ in UPLOAD_FILES),
            views=items(upload_lines(views or [])) or "(not measured)",
            view_files="`, `".join(name for name, _ in VIEW_FILES),
            copy_issue=copy_issue_table(copy_issue),
            copy_issue_file=COPY_ISSUE_FILE,
            **view_numbers(views or [], copy_issue),
            queued=items(queued_lines(queued)) or "(not measured)",
            queued_file=BACK_TO_BACK_FILE,
            queued_event=items(queued_lines(queued_event)) or "(not measured)",
            queued_event_file=BACK_TO_BACK_EVENT_FILE,
            padding=items(padding_lines(moe_padding)) or "(not measured)",
            padding_file=MOE_PADDING_FILE,
            host_lines=items(host_lines_lines(host_lines)) or "(not measured)",
            host_lines_file=HOST_LINES_FILE,
        )
        if losses
        else fill("prefill.losses.none")
    )
    return blocks


def items(lines: list[str]) -> str:
    """Markdown list items, one per line (plain lines would run into one paragraph)."""
    return bullets(f"- {line}" for line in lines)


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
