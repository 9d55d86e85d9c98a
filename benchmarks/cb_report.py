"""The continuous-batching section of docs/performance.md (from ``benchmarks/bench_cb.py``).

Used by ``benchmarks/report.py`` with every JSON of ``FILES`` that exists, one per
transformers release (the CI pin and the newest tested)::

    bash scripts/gpu_check.sh cb_bench "$OUT/cb-5.17.json"           # on the GPU, per release
    cp cb-5.17.json docs/results/h200-cb.json; cp cb-5.24.json docs/results/h200-cb-5.24.json
    python -m benchmarks.report                                       # the page and img/cb.png

or alone, to read a run: ``python -m benchmarks.cb_report cb-5.17.json cb-5.24.json``. With
several JSONs each model gets one table per transformers release. A JSON of the earlier
layout (schema 1: ``paged_sdpa``, ``whole_graph``; transformers 5.17 only) renders as it
always did (:func:`legacy_section`). The prose is in ``performance.md.in`` (``cb.*``).

The continuous-batching sections after the main tables live beside it: the host's side of a
step in :mod:`benchmarks.report_cb_host`, the decode path's changes in
:mod:`benchmarks.report_cb_decode`, a pure-decode step against its floor in
:mod:`benchmarks.report_decode_step`; they share this module's small helpers (``_release``,
``_run_of``, ``_cell``).
"""

from __future__ import annotations

import json
import os
import sys

from . import targets as T
from .template import fill, num, span, table

FILE = "h200-cb.json"  # transformers 5.17 (the CI pin)
FILES = (FILE, "h200-cb-5.24.json")  # the releases the page shows, oldest first
#: the whole bench again with a later tree, per release, beside that release's run in ``FILES``:
#: (file, the tree that ran it); a shape of the earlier run missing from a file is named with
#: :data:`AGAIN_MISSING_WHY` (say it again for a new file)
AGAIN_FILES = (
    ("h200-cb-again-5.17.json", "session 24's, whose decode graphs derive their write rows "
     "inside the graph and whose block-table fill keeps its numpy views"),
    ("h200-cb-again-5.24.json", "session 24's, whose decode graphs derive their write rows "
     "inside the graph and whose block-table fill keeps its numpy views"),
)  # fmt: skip
AGAIN_MISSING_WHY = "not run again"
#: a transformers release outside the declared range, tried on the H200 with hub kernels off:
#: the bench on some shapes, and the CUDA tests (``benchmarks.suite_times``' JSON)
TRIED_FILES = ("h200-cb-5.25.json", "h200-cuda-suite-times-5.25.json")
#: ``benchmarks/cb_prep_profile.py --block-table`` on the CPU, the newest declared release and the
#: tried one one after the other (the same hour: this host's speed drifts between hours)
#: the serve launcher's tests on CUDA (``-k serve``, a completion through real graphs among
#: them), per release: the declared ones, then the one tried
SERVE_FILES = ("h200-serve-tests-5.17.json", "h200-serve-tests-5.24.json",
               "h200-serve-tests-5.25.json")
TRIED_PREP_FILES = ("cpu-cb-prep-profile-tried-5.24.json", "cpu-cb-prep-profile-tried-5.25.json")


def schema(data: dict) -> int:
    return data["meta"].get("schema", 1)


def cb_section(*runs: dict) -> list:
    """The section from one or more bench_cb JSONs (one per transformers release)."""
    lines = []
    for data in runs:
        if schema(data) < 2:
            lines += legacy_section(data)
    current = [data for data in runs if schema(data) >= 2]
    if current:
        lines += section(current)
    return lines


# -- schema 2: per model, one table per transformers release --------------------------------
COLUMNS = (  # (header, key, format)
    ("tokens/s", "tokens_per_s", ".0f"),
    ("x floor", "over_roofline", ".1f"),
    ("TTFT mean s", "ttft_mean_s", ".2f"),
    ("TTFT p50 s", "ttft_p50_s", ".2f"),
    ("steps", "steps", "d"),
    ("ms/step", "wall_ms_per_step", ".1f"),
    ("prep ms", "host_prepare_ms_per_step", ".1f"),
    ("fwd ms", "forward_host_ms_per_step", ".1f"),
    ("breaks ms", "break_host_ms_per_step", ".2f"),
    ("cache upd ms", "cache_update_host_ms_per_step", ".2f"),
    ("device ms", "forward_device_ms_per_step", ".1f"),
    ("in forward", "gpu_forward_fraction", ".0%"),
    ("decode ms", "decode_step_ms", ".2f"),
    ("decode x floor", "decode_over_floor", ".1f"),
    ("graphs", "graphs", "d"),
    ("capture s", "capture_s", ".2f"),
    ("same tokens", "tokens_agree_with_stock", ".0%"),
)


def _cell(entry: dict, key: str, spec: str) -> str:
    value = entry.get(key)
    return "-" if value is None else format(value, spec)


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def _run_of(meta: dict, device_key: str = "device") -> dict:
    """The provenance every section names: the run's device, torch and date placeholders."""
    return {"device": meta[device_key], "torch": meta["torch"], "date": meta["date"]}


def _cpu_host(meta: dict) -> str:
    """A CPU-only run's host as its ``gpu`` field names it, without the "none (...)" wrapper:
    ``"none (2 CPU cores)"`` -> ``"2 CPU cores"``."""
    return meta["gpu"].removeprefix("none (").removesuffix(")")


def _release(data: dict) -> str:
    return data["meta"]["transformers"]


def section(runs: list) -> list:
    """Schema-2 runs: the workload, a tokens/s summary per release, then per model its floor
    and one table per release with the targets."""
    first = runs[0]["meta"]
    a = first["args"]
    variants = {}  # every variant of every run, first seen first: its one-line description
    for data in runs:
        for m in data["models"]:
            for name, v in m.get("variants", {}).items():
                variants.setdefault(name, v.get("what"))
    lines = [
        fill(
            "cb.intro",
            files=", ".join(f"transformers {_release(d)}: {d['meta']['device']}" for d in runs),
            dtype=first["dtype"],
            prompts=a["prompts"],
            min_len=a["min_len"],
            max_len=a["max_len"],
            new_tokens=a["new_tokens"],
            block_size=a["block_size"],
            num_blocks=a["num_blocks"],
            max_batch_tokens=a["max_batch_tokens"],
            variants="\n".join(f"- `{n}`: {w}" for n, w in variants.items() if w),
            rounds=a["rounds"],
            repeat=", ".join(f"`{v}`" for v in a["repeat"]),
            hbm=num(first["hbm_bytes_per_s"] / 1e12, 1),
            peak=num(first["peak_flops"] / 1e12, 0),
        ),
        "",
    ]
    if len(runs) > 1:
        lines += [fill("cb.versions", table=_versions_table(runs), **_losses(runs)), ""]
    for name in _model_names(runs):
        lines += _model_block(name, runs) + [""]
    return lines


def _stock_rival(variants: dict) -> str | None:
    """The faster of stock's forced-graph variants in one model entry, if it ran any."""
    graphs = [g for g in ("stock_graphs", "stock_graphs_async")
              if "tokens_per_s" in variants.get(g, {})]  # fmt: skip
    return max(graphs, key=lambda g: variants[g]["tokens_per_s"], default=None)


def _versus(now: dict, before: dict | None) -> dict:
    """The placeholders of a table, per shape of ``now``: breakgraph against stock ``sdpa``
    and against the faster of stock's forced-graph variants (each run's own faster one), with
    issue 23's targets; with ``before``, also the same ratios in that run (``"-"`` where it
    lacks one), the shapes either run lacks, and how far each side's tokens/s moved."""
    rows, vs_stock, vs_graphs, moved_bg, moved_stock, missing = [], [], [], [], [], []
    for m in now["models"]:
        v, ratios, spreads = m.get("variants", {}), m.get("ratios", {}), m.get("ratio_spread", {})
        bg = v.get("breakgraph", {})
        if "tokens_per_s" not in bg or "tokens_per_s" not in v.get("stock_sdpa", {}):
            why = bg.get("skipped") or bg.get("failed") or "breakgraph or stock sdpa not measured"
            missing.append(f"{m['model']} ({why})")
            continue
        old = _entry(before, m["model"]) if before else None
        old_v = (old or {}).get("variants", {})
        cells = []
        for rival, into in (("stock_sdpa", vs_stock), (_stock_rival(v), vs_graphs)):
            key = f"breakgraph_over_{rival}"
            if key not in ratios:
                cells += ["-", "-"] if before else ["-"]
                continue
            into.append(ratios[key])
            cells.append(f"{num(ratios[key])}× ({span(spreads[key])})")
            if before:  # the same ratio in the earlier run
                old_rival = "stock_sdpa" if rival == "stock_sdpa" else _stock_rival(old_v)
                old_ratio = (old or {}).get("ratios", {}).get(f"breakgraph_over_{old_rival}")
                cells.append("-" if old_ratio is None else f"{num(old_ratio)}×")
        rival = _stock_rival(v)
        rows.append([
            m["model"], num(v["stock_sdpa"]["tokens_per_s"], 0),
            f"{num(v[rival]['tokens_per_s'], 0)} (`{rival}`)" if rival else "-",
            f"{num(bg['tokens_per_s'], 0)} ({span(bg['rounds_tokens_per_s'], 0)})", *cells,
        ])  # fmt: skip
        if "tokens_per_s" in old_v.get("breakgraph", {}):
            moved_bg.append(bg["tokens_per_s"] / old_v["breakgraph"]["tokens_per_s"])
            moved_stock.append(v["stock_sdpa"]["tokens_per_s"]
                               / old_v["stock_sdpa"]["tokens_per_s"])  # fmt: skip
    measured = {m["model"] for m in now["models"]}
    absent = [m["model"] for m in (before or {}).get("models", []) if m["model"] not in measured]
    if absent:
        missing.append(f"{', '.join(absent)} ({AGAIN_MISSING_WHY})")
    nan = [float("nan")]
    return dict(
        table=table(_versus_header(before is not None), rows),
        missing="; ".join(missing) or "none",
        vs_stock=span(vs_stock or nan, 1),
        stock_limit=f"{T.TARGET_CB_VS_STOCK:g}",
        stock_met=sum(r >= T.TARGET_CB_VS_STOCK for r in vs_stock),
        stock_shapes=len(vs_stock),
        vs_graphs=span(vs_graphs or nan, 1),
        graphs_limit=f"{T.TARGET_CB_VS_STOCK_GRAPHS:g}",
        graphs_met=sum(r >= T.TARGET_CB_VS_STOCK_GRAPHS for r in vs_graphs),
        graphs_shapes=len(vs_graphs),
        moved_bg=span(moved_bg or nan, 2),
        moved_stock=span(moved_stock or nan, 2),
    )


def _versus_header(earlier: bool) -> list[str]:
    """The columns of :func:`_versus`' table; ``earlier``: with the earlier run's ratios."""
    after = ["earlier"] if earlier else []
    return ["model", "stock sdpa tokens/s", "stock graphs tokens/s",
            "breakgraph tokens/s (rounds)", "/ stock sdpa (rounds)", *after,
            "/ stock graphs (rounds)", *after]  # fmt: skip


def again_section(now: dict, before: dict | None, file: str, tree: str) -> str:
    """The whole bench again (``now``, read from ``file``: a later ``tree``) beside the same
    release's earlier run (``before``): :func:`_versus`, with issue 23's targets."""
    versus = _versus(now, before)
    meta = now["meta"]
    return fill(
        "cb.again",
        release=_release(now),
        before_date=before["meta"]["date"] if before else "-",
        file=file,
        tree=tree,
        **_run_of(meta),
        rounds=meta["args"]["rounds"],
        **versus,
    )


def _serve_runs(runs: list) -> str:
    """The serve tests' counts on CUDA per release (``suite_times`` JSON), and how long the
    completion through real graphs took."""
    if not runs:
        return "The serve launcher on the GPU: not run."
    parts = []
    for data, name in runs:
        counts = data["counts"]
        parts.append(f"{counts['passed']} passed, {counts['failed']} failed on "
                     f"{data['meta']['transformers']} (`{name}`)")  # fmt: skip
    cuda = [t["seconds"] for data, _ in runs for t in data["slowest"]
            if t["test"].endswith("answers_a_completion[cuda]")]  # fmt: skip
    return fill(
        "cb.tried_serve",
        runs="; ".join(parts),
        gpu=runs[0][0]["meta"]["gpu"],
        seconds=span(cuda, 1) if cuda else "-",
    ).strip()


def tried_section(run: dict, suite: dict | None, prep: list = (), serve: list = ()) -> str:
    """A transformers release outside the declared range, tried on the GPU: the CUDA tests'
    run on it (``suite``, :data:`TRIED_FILES`' second) and the bench on some shapes (``run``)
    with issue 23's targets; no earlier run to set it beside. ``prep``: transformers'
    preparation of a pure-decode step on the CPU, per release (:data:`TRIED_PREP_FILES`);
    ``serve``: ``(data, file)`` of the serve tests on CUDA per release (:data:`SERVE_FILES`)."""
    versus = _versus(run, None)
    for key in ("missing", "moved_bg", "moved_stock"):  # no earlier run: nothing moved
        versus.pop(key)
    meta = run["meta"]
    tests = "not run"
    if suite:
        counts = suite.get("counts", {})
        kinds = [k for k in ("passed", "failed", "skipped") if k in counts]
        tests = ", ".join(f"{counts[k]} {k}" for k in kinds)
        tests += f" (`{TRIED_FILES[1]}`, {num(suite['wall_s'], 1)} s with four workers)"
    return fill(
        "cb.tried",
        release=_release(run),
        file=TRIED_FILES[0],
        tests=tests,
        shapes=", ".join(m["model"] for m in run["models"]),
        **_run_of(meta),
        rounds=meta["args"]["rounds"],
        **versus,
        prep=_tried_prep(prep),
        serve=_serve_runs(list(serve)),
    )


def _tried_prep(runs: list) -> str:
    """The preparation of a pure-decode step per release (``cb_prep_profile``'s JSON, the
    same settings), one after the other on one host: all of it and its largest parts."""
    if len(runs) < 2:
        return "transformers' preparation of a step on this release: not measured."
    first, base, last = runs[0], runs[0]["decode_parts_ms"], runs[-1]["decode_parts_ms"]
    parts = ("block table", "scheduler", "other batch tensors", "update")
    moved = max(parts, key=lambda p: abs(last[p] - base[p]))
    rows = [[p, *(num(d["decode_parts_ms"][p], 2) for d in runs)] for p in parts]
    rows.insert(0, ["**all of the preparation**",
                    *(num(d["decode_parts_ms"]["prepare"], 2) for d in runs)])  # fmt: skip
    return fill(
        "cb.tried_prep",
        files=", ".join(f"`{name}`" for name in TRIED_PREP_FILES[: len(runs)]),
        device=_cpu_host(first["meta"]),
        torch=first["meta"]["torch"],
        date=first["meta"]["date"],
        rounds=first["settings"]["rounds"],
        requests=first["settings"]["requests"],
        steps=first["decode_steps"],
        median=num(first["decode_requests_median"], 0),
        table=table(["ms per pure-decode step", *(d["meta"]["transformers"] for d in runs)], rows),
        ratio=num(last["prepare"] / base["prepare"], 2),
        newest=runs[-1]["meta"]["transformers"],
        older=runs[0]["meta"]["transformers"],
        moved=f"{moved} {num(base[moved], 2)} → {num(last[moved], 2)} ms",
        passes=span([t for d in runs for t in d["pass_s"]["timed"]], 0),
    ).strip()


def _losses(runs: list) -> dict:
    """The numbers of the page's *where breakgraph loses* paragraph: breakgraph's pure-decode
    steps over their HBM floor, and where the synchronous variant beat the asynchronous one."""
    over, sync_wins = [], []
    for data in runs:
        for m in data["models"]:
            variants = m.get("variants", {})
            bg, sync = variants.get("breakgraph", {}), variants.get("breakgraph_sync", {})
            if "decode_over_floor" in bg:
                over.append(bg["decode_over_floor"])
            if sync.get("tokens_per_s", 0) > bg.get("tokens_per_s", float("inf")):
                sync_wins.append(f"{m['model']} on {_release(data)}")
    return {
        "over_low": num(min(over), 0) if over else "-",
        "over_high": num(max(over), 0) if over else "-",
        "sync_wins": ", ".join(sync_wins) or "no shape",
    }


def _model_names(runs: list) -> list:
    names = []
    for data in runs:
        names += [m["model"] for m in data["models"] if m["model"] not in names]
    return names


def _entry(data: dict, name: str) -> dict | None:
    return next((m for m in data["models"] if m["model"] == name), None)


def _why(entry: dict | None) -> str:
    """Why a model has no numbers in a run."""
    if entry is None:
        return "not in this run"
    return entry.get("skipped") or f"failed: {entry.get('failed')}"


def _versions_table(runs: list) -> str:
    rows = []
    for name in _model_names(runs):
        variants = []
        for data in runs:
            m = _entry(data, name) or {}
            variants += [v for v in m.get("variants", {}) if v not in variants]
        for variant in variants:
            cells = [f"{name}", f"`{variant}`"]
            for data in runs:
                v = ((_entry(data, name) or {}).get("variants") or {}).get(variant, {})
                cells.append("-" if "tokens_per_s" not in v else f"{v['tokens_per_s']:.0f}")
            rows.append(cells)
    return table(["model", "variant"] + [f"transformers {_release(d)}" for d in runs], rows)


def _model_block(name: str, runs: list) -> list:
    measured = [m for d in runs if (m := _entry(d, name)) is not None and "floor" in m]
    if not measured:
        why = "; ".join(f"transformers {_release(d)}: {_why(_entry(d, name))}" for d in runs)
        return [f"### {name}", "", f"Not measured ({why}).", ""]
    m, f = measured[0], measured[0]["floor"]
    releases = []
    for data in runs:
        entry = _entry(data, name)
        if entry is None or "floor" not in entry:
            releases.append(fill("cb.release.skipped", transformers=_release(data),
                                 why=_why(entry)))  # fmt: skip
            continue
        meta = data["meta"]
        rows = []
        for variant, v in entry["variants"].items():
            if "skipped" in v or "failed" in v:
                blank = [""] * (len(COLUMNS) - 1)
                why = f"skipped: {v['skipped']}" if "skipped" in v else f"failed: {v['failed']}"
                rows.append([f"`{variant}`", why, *blank])
            else:
                rows.append([f"`{variant}`"] + [_cell(v, k, spec) for _, k, spec in COLUMNS])
        releases.append(
            fill(
                "cb.release",
                transformers=_release(data),
                torch=meta["torch"],
                date=meta["date"],
                table=table(["variant"] + [h for h, _, _ in COLUMNS], rows),
                targets="\n".join(target_lines(entry)),
            )
        )
    return [
        fill(
            "cb.model",
            model=name,
            params=f"{m['params_m']:.0f}",
            prompt_tokens=m["prompt_tokens"],
            shape=m["shape"],
            floor=num(f["roofline_s"], 3),
            prefill=num(f["prefill_s"], 3),
            decode=num(f["decode_s"], 3),
            bound=num(f["bound_s"], 3),
            weights=num(f["weight_bytes_per_decode_step"] / 1e9),
            releases="\n\n".join(releases),
        )
    ]


def target_lines(m: dict) -> list:
    """Issue 23's targets for each breakgraph variant of one model entry, met or missed."""
    ratios, spreads, v = m["ratios"], m["ratio_spread"], m["variants"]
    rival = _stock_rival(v)
    lines = []
    for bg in (name for name in v if name.startswith("breakgraph") and "tokens_per_s" in v[name]):
        entry = v[bg]
        key = f"{bg}_over_stock_sdpa"
        if key in ratios:
            ok = ratios[key] >= T.TARGET_CB_VS_STOCK
            lines.append(fill(
                "cb.target.stock", variant=bg, ratio=num(ratios[key]), spread=span(spreads[key]),
                limit=f"{T.TARGET_CB_VS_STOCK:g}", verdict=_verdict(ok),
            ))  # fmt: skip
        key = f"{bg}_over_{rival}"
        if key in ratios:
            ok = ratios[key] >= T.TARGET_CB_VS_STOCK_GRAPHS
            lines.append(fill(
                "cb.target.graphs", variant=bg, rival=rival, ratio=num(ratios[key]),
                spread=span(spreads[key]), limit=f"{T.TARGET_CB_VS_STOCK_GRAPHS:g}",
                verdict=_verdict(ok), graphs=entry["graphs"], rival_graphs=v[rival]["graphs"],
            ))  # fmt: skip
        if "decode_over_floor" in entry:
            judged = entry["decode_requests"] >= T.TARGET_CB_DECODE_MIN_REQUESTS
            ok = entry["decode_over_floor"] <= T.TARGET_CB_DECODE_OVER_FLOOR
            lines.append(fill(
                "cb.target.decode", variant=bg, requests=entry["decode_requests"],
                keys=f"{entry['decode_context']:.0f}", ms=num(entry["decode_step_ms"]),
                over=num(entry["decode_over_floor"], 1), floor=num(entry["decode_floor_ms"], 3),
                limit=f"{T.TARGET_CB_DECODE_OVER_FLOOR:g}",
                min_requests=T.TARGET_CB_DECODE_MIN_REQUESTS,
                verdict=_verdict(ok) if judged else "not judged: fewer requests",
            ))  # fmt: skip
        lines.append(fill(
            "cb.target.capture", variant=bg, seconds=num(entry["capture_s"]),
            limit=f"{T.TARGET_CB_CAPTURE_S:g}",
            verdict=_verdict(entry["capture_s"] <= T.TARGET_CB_CAPTURE_S),
            breaks=entry.get("breaks_per_graph", "-"), eager=entry.get("eager_steps", 0),
            decode_graphs=_decode_graphs_note(entry),
        ))  # fmt: skip
    return lines


def _decode_graphs_note(entry: dict) -> str:
    """The pure-decode graphs a run captured while serving (runs from before them: nothing)."""
    if "decode_graph_captures" not in entry:
        return ""
    note = (f"; pure-decode graphs (no breaks) captured while serving: "
            f"{entry['decode_graph_captures']} in {num(entry['decode_graph_capture_s'])} s, "
            f"{entry['decode_graph_replays']} replays")  # fmt: skip
    if entry.get("decode_graph_off"):
        note += f" (off: {entry['decode_graph_off']})"
    return note


# -- schema 1 (the committed 5.17 run, until it is re-measured) -----------------------------
def legacy_section(data: dict) -> list:
    """The section from a schema-1 JSON (bench_cb before transformers 5.19: `paged_sdpa`,
    `whole_graph`), kept so the committed page renders until its JSON is re-measured."""
    a = data["meta"]["args"]
    lines = [
        "## Continuous batching (transformers `generate_batch` / manager)",
        "",
        f"`python benchmarks/bench_cb.py`: {a['prompts']} prompts of {a['min_len']}-{a['max_len']}"
        f" tokens submitted at once, {a['new_tokens']} greedy tokens each, block size "
        f"{a['block_size']}, {a['num_blocks']} blocks, max_batch_tokens {a['max_batch_tokens']}"
        f" ({data['meta']['dtype']}, random weights). (a) `paged_sdpa`: transformers' CB without"
        " flash_attn (dense mask, no graphs); (b) `breakgraph`: `enable_continuous_batching`, one"
        " graph per query bucket, attention an eager break per layer, synchronous steps"
        " (`use_async_batching=False`); (c) `whole_graph`:"
        " transformers' own whole-step CUDA graphs keyed by query x KV x max_seqlen_k with"
        " upper-bound lengths (torch's varlen kernel, async batching); (d) `generate`:"
        " `model.generate` one prompt at a time, measured on a few prompts and extrapolated;"
        " `breakgraph_async`: (b) with asynchronous batching, the default on CUDA (two IO"
        " pairs sharing one graph per bucket, in runs since the sharing; two graphs per bucket"
        " before)."
        " (c) captures lazily: its row is the second (warm) pass; breakgraph captures every"
        " bucket before serving. Time to first token counts from submission. *Same tokens"
        " as (a)*: the share of prompts whose greedy tokens all equal (a)'s. In bf16 on random"
        " weights the top logits are nearly tied, so any two implementations whose arithmetic"
        " differs (attention kernel, GEMM row count, batch composition) part ways after a few"
        " tokens; `python -m benchmarks.cb_agreement` measures that pairwise, against"
        " `model.generate` too (`docs/results/h200-cb-agreement.log`), and the tests check"
        " token equality in fp32.",
        "",
    ]
    for m in data["models"]:
        lines += [
            f"### {m['model']} ({m['params_m']:.0f}M parameters, "
            f"{m['prompt_tokens']} prompt tokens)",
            "",
            "| variant | tokens/s | TTFT mean s | TTFT p50 s | steps | host ms/step | graphs "
            "| capture s | same tokens as (a) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, v in m["variants"].items():
            if "skipped" in v:
                lines.append(f"| {name} | skipped: {v['skipped']} | | | | | | | |")
                continue
            run = v.get("warm", v)
            steps = run.get("steps", "-")
            host = run.get("host_prepare_ms_per_step")
            agree = v.get("tokens_agree_with_paged_sdpa")
            host = "-" if host is None else f"{host:.1f}"
            agree = "-" if agree is None else f"{100 * agree:.0f}%"
            lines.append(
                f"| {name} | {v['tokens_per_s']:.0f} | {v['ttft_mean_s']:.2f} "
                f"| {v['ttft_p50_s']:.2f} | {steps} | {host} | {v.get('graphs', '-')} "
                f"| {v.get('capture_s', 0.0):.2f} | {agree} |"
            )
        lines += [""] + legacy_target_lines(m) + [""]
    return lines


def legacy_target_lines(m: dict) -> list:
    """Issue 14's targets, met or missed, from a schema-1 model entry."""
    r, v = m["ratios"], m["variants"]
    spreads = m.get("ratio_spread", {})

    def rounds(key: str) -> str:  # the spread over rounds, where the run had several
        low_high = spreads.get(key)
        return f", rounds {low_high[0]:.2f}-{low_high[1]:.2f}" if low_high else ""

    eager, whole = T.TARGET_CB_THROUGHPUT_VS_EAGER, T.TARGET_CB_THROUGHPUT_VS_WHOLE_GRAPH
    fewest, capture = T.TARGET_CB_FEWER_GRAPHS, T.TARGET_CB_CAPTURE_S
    lines = []
    for bg in ("breakgraph", "breakgraph_async"):
        if f"{bg}_over_paged_sdpa" in r:
            ratio = r[f"{bg}_over_paged_sdpa"]
            lines.append(
                f"- {bg} throughput vs (a): {ratio:.2f}x (target >= {eager:g}x: "
                f"{_verdict(ratio >= eager)}{rounds(f'{bg}_over_paged_sdpa')})"
            )
        if f"{bg}_over_whole_graph" in r:
            ratio, fewer = r[f"{bg}_over_whole_graph"], r[f"whole_graph_graphs_over_{bg}"]
            lines.append(
                f"- {bg} throughput vs (c): {ratio:.2f}x (target >= {whole:g}x: "
                f"{_verdict(ratio >= whole)}{rounds(f'{bg}_over_whole_graph')}); graphs: "
                f"{v['whole_graph']['graphs']} for (c) "
                f"against {v[bg]['graphs']}, {fewer:.1f}x fewer (target >= {fewest:g}x: "
                f"{_verdict(fewer >= fewest)})"
            )
        if "capture_s" in v.get(bg, {}):
            seconds = v[bg]["capture_s"]
            lines.append(
                f"- {bg} capture time, all buckets: {seconds:.2f} s (target <= {capture:g} s: "
                f"{_verdict(seconds <= capture)}); {v[bg].get('breaks_per_graph', '-')} eager "
                f"breaks per graph, {v[bg].get('eager_steps', 0)} eager steps"
            )
    return lines


def write_cb_plot(data: dict, plt, save: dict, img: str) -> str:
    """Tokens/s per model and variant (log scale), from one JSON of either schema."""
    models = [m for m in data["models"] if "variants" in m]
    if schema(data) < 2:
        names = ["paged_sdpa", "breakgraph", "breakgraph_async", "whole_graph", "generate"]
    else:
        names = []
        for m in models:
            names += [v for v in m["variants"] if v not in names]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        values = [m["variants"].get(name, {}).get("tokens_per_s", 0) for m in models]
        if any(values):
            x = [i + (k - (len(names) - 1) / 2) * width for i in range(len(models))]
            ax.bar(x, values, width, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("generated tokens/s (log)")
    ax.set_xticks(list(range(len(models))), [m["model"] for m in models], fontsize=7)
    release = data["meta"].get("transformers", "")
    ax.set_title(f"continuous batching, H200, bf16, transformers {release}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(img, "cb.png")
    fig.savefig(path, **save)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    """Print the section rendered from the JSON files given (one per transformers release)."""
    paths = sys.argv[1:] if argv is None else argv
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    print("\n".join(cb_section(*runs)))


if __name__ == "__main__":
    main()


