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
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from . import targets as T
from .template import bullets, fill, num, pct, span, table

FILE = "h200-cb.json"  # transformers 5.17 (the CI pin)
FILES = (FILE, "h200-cb-5.24.json")  # the releases the page shows, oldest first
#: the whole bench again with a later tree on the newest release, beside that release's run in
#: ``FILES``; and why shapes of that run are absent from it (what happened to this file's run:
#: say it again for a new file)
AGAIN_FILE = "h200-cb-again-5.24.json"
AGAIN_MISSING_WHY = "the device call's time limit ended the run before them"
#: one model, breakgraph's variants only, 3 rounds, per release: the CB forward's host time split
HOST_SPLIT_FILES = ("h200-cb-host-split-5.17.json", "h200-cb-host-split-5.24.json")
#: ``bench_cb --prep-lists``: transformers' index lists converted to tensors, per release
PREP_LISTS_FILES = ("h200-cb-prep-lists-5.17.json", "h200-cb-prep-lists-5.24.json")
#: ``benchmarks/cb_prep_profile.py`` on the CPU: a pure-decode step's preparation by part
PREP_PARTS_FILES = ("cpu-cb-prep-profile-5.17.json", "cpu-cb-prep-profile-5.24.json",
                    "cpu-cb-prep-profile-table-5.17.json", "cpu-cb-prep-profile-table-5.24.json",
                    "cpu-cb-prep-profile-fill-5.17.json", "cpu-cb-prep-profile-fill-5.24.json")
#: ``bench_cb --prep-lists``, transformers' lists converted by torch.tensor (old: the tree before
#: ``index_lists``) and through numpy (new), the trees in turn: (file, tree, turn)
NUMPY_LISTS_FILES = (
    ("h200-cb-numpy-lists-new-1-5.17.json", "numpy", 1),
    ("h200-cb-numpy-lists-old-1-5.17.json", "torch.tensor", 1),
    ("h200-cb-numpy-lists-new-2-5.17.json", "numpy", 2),
    ("h200-cb-numpy-lists-old-2-5.17.json", "torch.tensor", 2),
    ("h200-cb-numpy-lists-new-5.24.json", "numpy", 1),
    ("h200-cb-numpy-lists-old-5.24.json", "torch.tensor", 1),
)
#: The release from which transformers keeps its block-table decode path for its flash kernels
#: (``ensure_decode_fast_path_is_available``), and the oldest release breakgraph supports
FAST_PATH_SINCE, OLDEST = "5.19", "5.17"
#: benchmarks/cb_trace.py's summaries (the traces lie beside it)
TRACE_FILE = "h200-cb-trace-5.17/summary.json"
#: ``cb_trace`` over a window of pure-decode steps (``--skip`` past the prefills)
TRACE_DECODE_FILE = "h200-cb-trace-decode-5.17/summary.json"
#: the same window after pure-decode steps dropped the causal mask (the folded kernel)
TRACE_DECODE_FOLD_FILE = "h200-cb-trace-decode-fold-5.17/summary.json"
#: ``bench_cb --prep-lists``, the causal decode call (the tree before) and the one without the
#: mask, in turn: (file, tree, turn)
DECODE_FOLD_FILES = (
    ("h200-cb-decode-fold-causal-1-5.17.json", "causal", 1),
    ("h200-cb-decode-fold-folded-1-5.17.json", "no mask", 1),
    ("h200-cb-decode-fold-causal-2-5.17.json", "causal", 2),
    ("h200-cb-decode-fold-folded-2-5.17.json", "no mask", 2),
)
#: ``bench_cb --prep-lists``, decode steps through the gather and the folded kernel (old) and
#: reading the cache in place with ``paged_decode`` (new), in turn: (file, tree, turn)
PAGED_DECODE_FILES = (
    ("h200-cb-paged-decode-new-1-5.17.json", "in place", 1),
    ("h200-cb-paged-decode-old-1-5.17.json", "gather", 1),
    ("h200-cb-paged-decode-new-2-5.17.json", "in place", 2),
    ("h200-cb-paged-decode-old-2-5.17.json", "gather", 2),
)
#: ``benchmarks/decode_attention.py``: one layer's decode attention, three ways
DECODE_ATTENTION_FILE = "h200-decode-attention.json"
#: ``bench_cb --variants breakgraph,breakgraph_breaks``, the two taking turns in one process:
#: pure-decode steps as one graph (decode graphs) against a break per layer; (file, label)
DECODE_GRAPHS_FILES = (
    ("h200-cb-decode-graphs-5.17.json", "A"),
    ("h200-cb-decode-graphs-b-5.17.json", "B"),
    ("h200-cb-decode-graphs-5.24.json", "C"),
    ("h200-cb-decode-graphs-d-5.17.json", "D"),  # the code after the review (final)
)
#: ``cb_trace --variants breakgraph,breakgraph_breaks`` over pure-decode steps, per model
DECODE_GRAPHS_TRACE_FILES = (
    "h200-cb-trace-decode-graphs-5.17/summary.json",
    "h200-cb-trace-decode-graphs-llama-1b-5.17/summary.json",
)

#: ``bench_cb --variants breakgraph,breakgraph_compiled``, the two taking turns in one process:
#: ``enable_continuous_batching(compile=True)`` against the default; (file, label)
COMPILED_FILES = (
    ("h200-cb-compiled-5.17.json", "A"),
    ("h200-cb-compiled-5.24.json", "B"),
    ("h200-cb-compiled-32-5.24.json", "C"),  # 32 requests
    ("h200-cb-compiled-b-5.17.json", "D"),  # the two dense shapes on 5.17
    ("h200-cb-compiled-e-5.24.json", "E"),  # B's one loss again, 5 rounds (session 17)
)
#: ``cb_trace --variants breakgraph,breakgraph_compiled`` over pure-decode steps
COMPILED_TRACE_FILE = "h200-cb-trace-compiled-5.24/summary.json"

#: ``benchmarks/decode_attention.py`` with the split sweep (graph-replayed timings)
SPLIT_SWEEP_FILE = "h200-decode-attention-split.json"
#: ``bench_cb --variants breakgraph,breakgraph_unsplit``, taking turns in one process:
#: ``paged_decode``'s split and blocks of 128 keys against the kernel before; (file, label)
SPLIT_FILES = (
    ("h200-cb-split-5.17.json", "A"),
    ("h200-cb-split-long-5.17.json", "B"),  # 16 long prompts
    ("h200-cb-split-long-5.24.json", "C"),
)
#: ``bench_cb --variants breakgraph,breakgraph_lists``, taking turns in one process: pure-decode
#: steps through transformers' block table against its per-key index lists; (file, label)
BLOCK_TABLE_FILES = (
    ("h200-cb-block-table-5.17.json", "A"),
    ("h200-cb-block-table-5.24.json", "B"),
)
#: ``bench_cb --variants breakgraph,breakgraph_tx_fill,breakgraph_lists,breakgraph_compiled``,
#: taking turns in one process (``gpu_check.sh`` RUN_BLOCK_TABLE): the block table written
#: through numpy against transformers' own fill, with index lists and compiled beside; (file,
#: label). D ran on an H100 (the device tool's card that call)
TABLE_FILL_FILES = (
    ("h200-cb-table-fill-5.17.json", "C"),
    ("h100-cb-table-fill-5.24.json", "D"),
)
#: ``cb_trace`` of ``breakgraph`` and ``breakgraph_compiled`` over pure-decode steps, per run
TABLE_FILL_TRACE_FILES = ("h200-cb-trace-block-table-5.17/summary.json",
                          "h100-cb-trace-block-table-5.24/summary.json")  # fmt: skip
#: ``benchmarks/graph_launch.py`` and ``benchmarks/decode_launch_probe.py`` (H200)
GRAPH_LAUNCH_FILE = "h200-graph-launch.json"
LAUNCH_PROBE_FILE = "h200-decode-launch-probe.json"
#: HBM bytes/s of the cards the CB runs used; bench_cb's floors assume an H200's
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}
#: multiprocessors of the GPU the sweep ran on, where its JSON does not say (an H200's)
H200_MULTIPROCESSORS = 132


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


def again_section(now: dict, before: dict | None) -> str:
    """The whole bench again (``now``, a later tree) beside the same release's earlier run
    (``before``): per shape breakgraph against stock ``sdpa`` and against the faster of stock's
    forced-graph variants (each run's own faster one), with issue 23's targets, and how far
    each side's tokens/s moved between the runs (a ratio moves with its baseline too)."""
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
                cells += ["-", "-"]
                continue
            into.append(ratios[key])
            cells.append(f"{num(ratios[key])}× ({span(spreads[key])})")
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
    meta, nan = now["meta"], [float("nan")]
    return fill(
        "cb.again",
        release=_release(now),
        before_date=before["meta"]["date"] if before else "-",
        file=AGAIN_FILE,
        **_run_of(meta),
        rounds=meta["args"]["rounds"],
        missing="; ".join(missing) or "none",
        table=table(["model", "stock sdpa tokens/s", "stock graphs tokens/s",
                     "breakgraph tokens/s (rounds)", "/ stock sdpa (rounds)", "earlier",
                     "/ stock graphs (rounds)", "earlier"], rows),  # fmt: skip
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
    graphs = [s for s in ("stock_graphs", "stock_graphs_async") if "tokens_per_s" in v.get(s, {})]
    rival = max(graphs, key=lambda s: v[s]["tokens_per_s"], default=None)
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


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


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


def host_split_section(runs: list) -> str:
    """The forward's host time split (breaks, transformers' cache update inside them), per
    release and variant, and the cache update per layer call: where a release's forward is
    slower on the host."""
    rows, per_call = [], {}
    for data in runs:
        m = data["models"][0]
        layers = m["config"]["num_hidden_layers"]
        for variant, v in m["variants"].items():
            if "tokens_per_s" not in v:
                continue
            spread = v.get("rounds_tokens_per_s") or [v["tokens_per_s"]]
            rows.append([
                _release(data), f"`{variant}`",
                f"{v['tokens_per_s']:.0f} ({min(spread):.0f}–{max(spread):.0f})",
                *(_cell(v, key, ".2f") for key in (
                    "wall_ms_per_step", "host_prepare_ms_per_step", "forward_host_ms_per_step",
                    "break_host_ms_per_step", "cache_update_host_ms_per_step",
                    "forward_device_ms_per_step", "decode_step_ms",
                )),
            ])  # fmt: skip
            per_call.setdefault(_release(data), []).append(
                v["cache_update_host_ms_per_step"] / layers * 1e3
            )
    first, last = runs[0], runs[-1]
    gain = [  # the cache update's extra host time, as a share of the newer release's step
        (w["cache_update_host_ms_per_step"] - v["cache_update_host_ms_per_step"])
        / w["wall_ms_per_step"]
        for name, v in first["models"][0]["variants"].items()
        if (w := last["models"][0]["variants"].get(name)) and "tokens_per_s" in v
        and "tokens_per_s" in w
    ]  # fmt: skip
    return fill(
        "cb.host_split",
        old=_release(first),
        new=_release(last),
        share=pct(statistics.median(gain)) if gain else "-",
        model=first["models"][0]["model"],
        files=", ".join(f"`{name}`" for name in HOST_SPLIT_FILES),
        **_run_of(first["meta"]),
        rounds=first["meta"]["args"]["rounds"],
        table=table(
            ["transformers", "variant", "tokens/s (rounds)", "ms/step", "prep ms", "fwd ms",
             "breaks ms", "cache upd ms", "device ms", "decode ms"],
            rows,
        ),  # fmt: skip
        per_call="; ".join(
            f"transformers {release}: {', '.join(num(x, 0) for x in values)} µs"
            for release, values in per_call.items()
        ),
    )


def prep_lists_section(runs: list) -> str:
    """transformers' step preparation and the conversion of its index lists inside it, per
    release, model and variant (``bench_cb --prep-lists``)."""
    rows, lists, of_prep, of_step, ns, entries = [], [], [], [], [], []
    for data in runs:
        for m in data["models"]:
            for variant, v in m["variants"].items():
                if "host_prepare_lists_ms_per_step" not in v:
                    continue
                ms, prep = v["host_prepare_lists_ms_per_step"], v["host_prepare_ms_per_step"]
                step = v["wall_ms_per_step"]
                lists.append(ms)
                of_prep.append(ms / prep)
                of_step.append(ms / step)
                ns.append(v.get("host_prepare_ns_per_list_entry", 0.0))
                entries.append(v.get("host_prepare_list_entries_per_step", 0.0))
                rows.append([
                    _release(data), m["model"], f"`{variant}`", num(v["tokens_per_s"], 0),
                    num(step, 1), num(prep, 1), num(ms, 1), pct(ms / prep), pct(ms / step),
                ])  # fmt: skip
    if not rows:
        return ""
    first = runs[0]
    return fill(
        "cb.prep_lists",
        files=", ".join(f"`{name}`" for name in PREP_LISTS_FILES),
        **_run_of(first["meta"]),
        table=table(
            ["transformers", "model", "variant", "tokens/s", "ms/step", "prep ms", "lists ms",
             "of prep", "of step"],
            rows,
        ),  # fmt: skip
        low=num(min(lists), 1),
        high=num(max(lists), 1),
        share_low=pct(min(of_prep)),
        share_high=pct(max(of_prep)),
        step_low=pct(min(of_step)),
        step_high=pct(max(of_step)),
        ns=f"{num(min(ns), 0)}–{num(max(ns), 0)}",
        long_list=_long_list(),
        fast_path_since=FAST_PATH_SINCE,
        oldest=OLDEST,
        entries=f"{num(min(entries), 0)}–{num(max(entries), 0)}",
    )


def _in_turn(runs: list, tree_header: str) -> tuple:
    """Rows of bench_cb runs of two trees in turn (``runs``: ``(data, tree, turn)``), and one
    bullet per run: breakgraph against stock graphs where the run has them."""
    rows, ratios = [], []
    for data, tree, turn in runs:
        for m in data["models"]:
            stock = m["variants"].get("stock_graphs", {}).get("tokens_per_s")
            for variant, v in m["variants"].items():
                if "tokens_per_s" not in v or not variant.startswith("breakgraph"):
                    continue
                rows.append([
                    _release(data), m["model"], tree, str(turn), f"`{variant}`",
                    num(v["tokens_per_s"], 0), num(v["wall_ms_per_step"], 1),
                    num(v["host_prepare_ms_per_step"], 1),
                    _cell(v, "host_prepare_lists_ms_per_step", ".1f"),
                    _cell(v, "decode_step_ms", ".2f"),
                    _cell(v, "decode_forward_device_ms", ".2f"),
                    f"{num(v['tokens_per_s'] / stock, 2)}×" if stock else "-",
                ])  # fmt: skip
                if stock and variant == "breakgraph":
                    spread = v.get("rounds_tokens_per_s") or [v["tokens_per_s"]]
                    ratios.append((tree, v["tokens_per_s"] / stock, min(spread) / stock,
                                   max(spread) / stock))  # fmt: skip
    header = ["transformers", "model", tree_header, "turn", "variant", "tokens/s", "ms/step",
              "prep ms", "lists ms", "decode ms", "decode device ms",
              "over stock graphs"]  # fmt: skip
    bullets_ = bullets([
        f"- {tree_header} {tree}: breakgraph / stock graphs {num(r, 2)}× (rounds "
        f"{num(low, 2)}–{num(high, 2)})"
        for tree, r, low, high in ratios
    ]) or "(not measured)"  # fmt: skip
    return table(header, rows), bullets_


def numpy_lists_section(runs: list) -> str:
    """The same workload with transformers' lists converted by ``torch.tensor`` (the tree
    before) and through numpy (``index_lists``), in turn: ``runs`` holds ``(data, tree,
    turn)``."""
    rows, stock = _in_turn(runs, "lists by")
    first = runs[0][0]
    return fill(
        "cb.numpy_lists",
        files=", ".join(f"`{name}`" for name, _, _ in NUMPY_LISTS_FILES),
        **_run_of(first["meta"]),
        table=rows,
        stock=stock,
    )


def prep_parts_section(runs: list) -> str:
    """transformers' preparation of a pure-decode step by part (``cb_prep_profile``), one
    column pair per release: ms (mean over the steps) and its share of the preparation."""
    names = ("index lists", "block table", "list conversion", "other batch tensors",
             "scheduler", "other preparation")  # fmt: skip
    rows = []
    for name in (*names, "prepare", "update"):
        row = [{"prepare": "**all of the preparation**", "update": "update (after the forward)"}
               .get(name, name)]  # fmt: skip
        for data in runs:
            parts = data["decode_parts_ms"]
            value = parts.get(name, 0.0)  # "block table": not timed before that mode existed
            share = "" if name == "update" else f" ({pct(value / parts['prepare'])})"
            row.append(f"{num(value, 2)}{share}")
        rows.append(row)
    lists = [d for d in runs if not d["settings"].get("block_table")]
    tables = [d for d in runs if d["settings"].get("block_table") and not _numpy_fill(d)]
    numpy = [d for d in runs if _numpy_fill(d)]
    parts = [d["decode_parts_ms"] for d in lists]
    first, settings = runs[0], runs[0]["settings"]
    low, high = settings["prompt_lengths"]
    overhead = [statistics.median(d["pass_s"]["timed"]) / statistics.median(d["pass_s"]["plain"])
                for d in runs]  # fmt: skip
    return fill(
        "cb.prep_parts",
        files=", ".join(f"`{name}`" for name in PREP_PARTS_FILES),
        **_run_of(first["meta"], "gpu"),
        requests=settings["requests"],
        prompts=f"{low}–{high}",
        new_tokens=settings["new_tokens"],
        rounds=settings["rounds"],
        least=settings["min_requests"],
        steps=", ".join(f"{d['decode_steps']} steps of {num(d['decode_requests_median'], 0)} "
                        f"requests at the median on {d['meta']['transformers']}" for d in runs),
        overhead=span(overhead, 2),
        table=table(["part"] + [f"{d['meta']['transformers']}, {_prep_mode(d)} ms (share)"
                                for d in runs], rows),  # fmt: skip
        lists_share=span([(p["index lists"] + p["list conversion"]) / p["prepare"] * 100
                          for p in parts], 0),  # fmt: skip
        without=span([p["prepare"] - p["index lists"] - p["list conversion"] for p in parts], 1),
        scheduler=", ".join(f"{num(d['decode_parts_ms']['scheduler'], 2)} ms on "
                            f"{d['meta']['transformers']}" for d in lists),  # fmt: skip
        with_table=", ".join(_against_lists(d, lists) for d in tables) or "(not measured)",
        fill_us=span([d["decode_parts_ms"]["block table"] / d["decode_requests_median"] * 1e3
                      for d in tables] or [float("nan")], 0),  # fmt: skip
        fill_share=span([d["decode_parts_ms"]["block table"] / d["decode_parts_ms"]["prepare"]
                         * 100 for d in tables] or [float("nan")], 0),  # fmt: skip
        with_numpy=", ".join(_against_lists(d, lists) for d in numpy) or "(not measured)",
        numpy_us=span([d["decode_parts_ms"]["block table"] / d["decode_requests_median"] * 1e3
                       for d in numpy] or [float("nan")], 0),  # fmt: skip
        numpy_share=span([d["decode_parts_ms"]["block table"] / d["decode_parts_ms"]["prepare"]
                          * 100 for d in numpy] or [float("nan")], 0),  # fmt: skip
    )


def _numpy_fill(data: dict) -> bool:
    """Whether a profile's block tables were written through breakgraph's numpy fill."""
    return data["settings"].get("table_fill") == "numpy"


def _prep_mode(data: dict) -> str:
    if not data["settings"].get("block_table"):
        return "lists"
    return "block table, numpy fill" if _numpy_fill(data) else "block table"


def _against_lists(data: dict, lists: list) -> str:
    """A block-table profile's preparation, and its ratio to the list profile of its release."""
    release, prepare = data["meta"]["transformers"], data["decode_parts_ms"]["prepare"]
    same = [d for d in lists if d["meta"]["transformers"] == release]
    if not same:
        return f"{num(prepare, 2)} ms on {release}"
    ratio = prepare / same[0]["decode_parts_ms"]["prepare"]
    return f"{num(prepare, 2)} ms on {release} ({num(ratio, 2)}× the lists')"


def decode_fold_section(runs: list) -> str:
    """The same workload with pure-decode steps calling the varlen kernel causal (the tree
    before) and without the mask over their real rows, in turn: ``(data, tree, turn)``."""
    return _decode_turns(runs, "cb.decode_fold", DECODE_FOLD_FILES, "causal", "no mask",
                         "without the mask")  # fmt: skip


def paged_decode_section(runs: list) -> str:
    """The same workload with pure-decode steps through the gather and the folded kernel (the
    tree before) and reading the cache in place (``paged_decode``), in turn."""
    return _decode_turns(runs, "cb.paged_decode", PAGED_DECODE_FILES, "gather", "in place",
                         "in place")  # fmt: skip


def _decode_turns(runs: list, fragment: str, files: tuple, before: str, after: str,
                  after_words: str) -> str:  # fmt: skip
    """Two trees in turn: the table, and per model the pure-decode step and its forward's
    device span before and after."""
    rows, _ = _in_turn(runs, "decode call")
    first = runs[0][0]
    step, device = {}, {}
    for data, tree, _turn in runs:
        for m in data["models"]:
            v = m["variants"].get("breakgraph", {})
            if "decode_step_ms" in v:
                step.setdefault((m["model"], tree), []).append(v["decode_step_ms"])
                device.setdefault((m["model"], tree), []).append(v["decode_forward_device_ms"])
    lines = [
        f"- {model}: pure-decode step {span(step[(model, before)], 2)} ms {before}, "
        f"{span(step[(model, after)], 2)} ms {after_words}; the forward's device span "
        f"{span(device[(model, before)], 2)} → {span(device[(model, after)], 2)} ms"
        for model in dict.fromkeys(model for model, _ in step)
        if (model, before) in step and (model, after) in step
    ]
    return fill(
        fragment,
        files=", ".join(f"`{name}`" for name, _, _ in files),
        **_run_of(first["meta"]),
        table=rows,
        decode=bullets(lines) or "(not measured)",
    )


def decode_attention_section(data: dict) -> str:
    """``benchmarks/decode_attention.py``: one layer's decode attention, three ways, µs."""
    meta = data["meta"]
    rows, folded, paged, slower = [], [], [], []
    for case, r in data.items():
        if case == "meta":
            continue
        causal_us = r["gather_flash_causal_us"]["median"]
        cells = []
        for variant in ("gather_flash_causal", "gather_flash_folded", "triton_paged"):
            us = r[variant + "_us"]
            cells.append(f"{us['median']:.0f} ({us['min']:.0f}–{us['max']:.0f})")
        fold = causal_us / r["gather_flash_folded_us"]["median"]
        page = r["gather_flash_folded_us"]["median"] / r["triton_paged_us"]["median"]
        folded.append(fold)
        paged.append(page)
        if fold <= 1:
            slower.append(
                f"it is slower at {case} ({cells[1]} against {cells[0]} µs; not profiled)"
            )
        worst = max(r[v + "_max_abs_diff"] for v in ("gather_flash_folded", "triton_paged"))
        rows.append([
            case.split("/")[0], f"{r['hq']}/{r['hkv']} × {r['d']}", str(r["seqs"]),
            num(r["keys"], 0), num(r["kv_mib"], 0), *cells, f"{num(fold, 2)}×",
            f"{num(page, 1)}×", num(worst, 4),
        ])  # fmt: skip
    from .decode_attention import CALLS, KEYS, ROUNDS, SEQUENCES

    return fill(
        "cb.decode_attention",
        file=DECODE_ATTENTION_FILE,
        sequences=", ".join(map(str, SEQUENCES[:-1])) + f" and {SEQUENCES[-1]}",
        min_keys=KEYS[0],
        max_keys=KEYS[1],
        rounds=ROUNDS,
        calls=CALLS,
        gpu=meta["gpu"],
        torch=meta["torch"],
        date=meta["date"],
        table=table(
            ["shape", "heads × size", "sequences", "keys", "KV MiB", "gather + causal µs",
             "gather + no mask µs", "paged, no gather µs", "no mask / causal",
             "paged / no mask", "max abs Δ"],
            rows,
        ),  # fmt: skip
        faster=sum(f > 1 for f in folded),
        cases=len(folded),
        slower="; ".join(slower) or "it is slower in none",
        fold=span([f for f in folded if f > 1] or [float("nan")], 2),
        paged=span(paged, 1),
    )


def _pairs(runs: list, before: str, after: str):
    """``(data, label, model, before's entry, after's entry, per-round tokens/s ratios)`` for
    every model of every ``(data, label)`` run where both variants served (the two took turns
    in one process; the ratios are ``after / before`` round by round)."""
    for data, label in runs:
        for m in data["models"]:
            v = m["variants"]
            old, new = v.get(before, {}), v.get(after, {})
            if "tokens_per_s" not in old or "tokens_per_s" not in new:
                continue
            per_round = [a / b for a, b in zip(new["rounds_tokens_per_s"],
                                               old["rounds_tokens_per_s"])]  # fmt: skip
            yield data, label, m, old, new, per_round


def decode_graphs_section(runs: list, traces: list) -> str:
    """Pure-decode steps as one graph (``breakgraph``) against a break per layer
    (``breakgraph_breaks``), taking turns in one process: ``runs`` holds ``(data, label)``,
    ``traces`` ``cb_trace`` summaries of both variants over pure-decode steps."""
    rows, lines, meta, ratios = [], [], runs[0][0]["meta"], []
    for data, label, m, breaks, graphs, per_round in _pairs(runs, "breakgraph_breaks",
                                                            "breakgraph"):  # fmt: skip
        for name, e in (("breakgraph_breaks", breaks), ("breakgraph", graphs)):
            rows.append([
                label, _release(data), m["model"], f"`{name}`",
                f"{num(e['tokens_per_s'], 0)} ({span(e['rounds_tokens_per_s'], 0)})",
                num(e["decode_step_ms"], 2), num(e["decode_forward_host_ms"], 2),
                num(e["decode_forward_device_ms"], 2), num(e["host_prepare_ms_per_step"], 1),
                pct(e["gpu_forward_fraction"]),
                (f"{e['decode_graph_captures']} in {num(e['decode_graph_capture_s'], 2)} s"
                 if "decode_graph_captures" in e else "-"),
            ])  # fmt: skip
        ratios.append((f"run {label}'s {m['model']}",
                       graphs["tokens_per_s"] / breaks["tokens_per_s"], per_round))
        lines.append(
            f"- {label}, {m['model']} on {_release(data)}: tokens/s "
            f"{num(graphs['tokens_per_s'] / breaks['tokens_per_s'], 2)}× (round by round "
            f"{span(per_round, 2)}); pure-decode step {num(breaks['decode_step_ms'], 2)} → "
            f"{num(graphs['decode_step_ms'], 2)} ms, its forward's host time "
            f"{num(breaks['decode_forward_host_ms'], 2)} → "
            f"{num(graphs['decode_forward_host_ms'], 2)} ms"
        )
    trace_rows, overlap = [], []
    for data in traces:
        variants = data["variants"]
        graphs, breaks = variants.get("breakgraph"), variants.get("breakgraph_breaks")
        if graphs and breaks:
            overlap.append(
                f"{data['meta']['model']}: {pct(breaks['prepare_device_busy_fraction'])} → "
                f"{pct(graphs['prepare_device_busy_fraction'])}, and "
                f"{num(breaks['wall_ms_per_step'], 2)} → {num(graphs['wall_ms_per_step'], 2)} ms "
                f"per step"
            )
        for name, v in data["variants"].items():
            trace_rows.append([
                data["meta"]["model"], f"`{name}`", num(v["wall_ms_per_step"], 2),
                num(v["prepare_ms_per_step"], 2), pct(v["prepare_device_busy_fraction"]),
                num(v["step_ms_per_step"], 2), pct(v["device_busy_fraction"]),
            ])  # fmt: skip
    first = traces[0]["meta"] if traces else {}
    return fill(
        "cb.decode_graphs",
        files=", ".join(f"`{name}` ({label})" for name, label in DECODE_GRAPHS_FILES),
        **_run_of(meta),
        table=table(
            ["run", "transformers", "model", "variant", "tokens/s (rounds)", "decode ms",
             "decode fwd host ms", "decode fwd device ms", "prep ms", "in forward",
             "decode graphs captured"],
            rows,
        ),  # fmt: skip
        ratios=bullets(lines) or "(not measured)",
        trace_files=", ".join(f"`{name}`" for name in DECODE_GRAPHS_TRACE_FILES),
        trace_args=_trace_args(first),
        trace=table(
            ["model", "variant", "ms per step", "prep ms", "GPU busy during prep",
             "step ms", "GPU busy"],
            trace_rows,
        ) if trace_rows else "(not measured)",  # fmt: skip
        overlap="; ".join(overlap) or "not measured",
        faster=sum(r > 1 for _, r, _ in ratios),
        comparisons=len(ratios),
        slower=", ".join(f"{what} {num(r, 2)}× (rounds {span(rounds, 2)})"
                         for what, r, rounds in ratios if r <= 1) or "none",  # fmt: skip
    )


def _trace_args(meta: dict) -> str:
    """The workload of a ``cb_trace`` run, from its summary's ``meta`` ("-" without one)."""
    if not meta:
        return "-"
    a = meta["args"]
    return (f"{a['prompts']} prompts of {a['min_len']}–{a['max_len']} tokens, {a['new_tokens']} "
            f"new tokens, {a['steps']} steps from step {a['skip']}")  # fmt: skip


def compiled_section(runs: list, trace: dict | None) -> str:
    """``enable_continuous_batching(compile=True)`` (``breakgraph_compiled``) against the
    default (``breakgraph``), taking turns in one process: ``runs`` holds ``(data, label)``,
    ``trace`` a ``cb_trace`` summary of both over pure-decode steps (or None)."""
    rows, lines, ratios, cuts, meta = [], [], [], [], runs[0][0]["meta"]
    for data, label, m, plain, compiled, per_round in _pairs(runs, "breakgraph",
                                                             "breakgraph_compiled"):  # fmt: skip
        for name, e in (("breakgraph", plain), ("breakgraph_compiled", compiled)):
            rows.append([
                label, _release(data), m["model"], str(m["prompts"]), f"`{name}`",
                f"{num(e['tokens_per_s'], 0)} ({span(e['rounds_tokens_per_s'], 0)})",
                num(e["decode_step_ms"], 2), num(e["decode_forward_device_ms"], 2),
                f"{num(e['decode_forward_device_ms'] / e['decode_floor_ms'], 1)}×",
                num(e["forward_device_ms_per_step"], 2), num(e["host_prepare_ms_per_step"], 1),
                pct(e["gpu_forward_fraction"]), num(e["rounds_manager_s"][0], 1),
            ])  # fmt: skip
        ratio = compiled["tokens_per_s"] / plain["tokens_per_s"]
        cut = 1 - compiled["decode_forward_device_ms"] / plain["decode_forward_device_ms"]
        ratios.append((f"run {label}'s {m['model']}", ratio, per_round))
        cuts.append(cut)
        lines.append(
            f"- {label}, {m['model']} on {_release(data)}, {m['prompts']} requests: tokens/s "
            f"{num(ratio, 2)}× (round by round {span(per_round, 2)}); the pure-decode "
            f"forward's device time {num(plain['decode_forward_device_ms'], 2)} → "
            f"{num(compiled['decode_forward_device_ms'], 2)} ms ({pct(cut)} less), the "
            f"pure-decode step {num(plain['decode_step_ms'], 2)} → "
            f"{num(compiled['decode_step_ms'], 2)} ms"
        )
    kinds, trace_text = [], "(not measured)"
    if trace is not None:
        variants = trace["variants"]
        names = [n for n in ("breakgraph", "breakgraph_compiled") if n in variants]
        every = dict.fromkeys(k for n in names for k in variants[n]["device_ms_per_step_by_kind"])
        kinds = [[kind] + [num(variants[n]["device_ms_per_step_by_kind"].get(kind, 0.0), 2)
                           for n in names] for kind in every]  # fmt: skip
        kinds.append(["**all kernels**"] + [
            num(sum(variants[n]["device_ms_per_step_by_kind"].values()), 2) for n in names])
        kinds.append(["kernels per step"] + [
            num(variants[n]["device_events"] / variants[n]["steps"], 0) for n in names])
        kinds.append(["GPU busy"] + [pct(variants[n]["device_busy_fraction"]) for n in names])
        kinds.append(["prep ms"] + [num(variants[n]["prepare_ms_per_step"], 2) for n in names])
        kinds.append(["ms per step"] + [num(variants[n]["wall_ms_per_step"], 2) for n in names])
        trace_text = table(["per pure-decode step", *(f"`{n}` ms" for n in names)], kinds)
    first = trace["meta"] if trace else {}
    return fill(
        "cb.compiled",
        files=", ".join(f"`{name}` ({label})" for name, label in COMPILED_FILES),
        **_run_of(meta),
        table=table(
            ["run", "transformers", "model", "requests", "variant", "tokens/s (rounds)",
             "decode ms", "decode fwd device ms", "device x floor", "device ms/step", "prep ms",
             "in forward", "first manager s"],
            rows,
        ),  # fmt: skip
        ratios=bullets(lines) or "(not measured)",
        cut=f"{span([100 * c for c in cuts], 0)}%" if cuts else "-",
        faster=sum(r > 1 for _, r, _ in ratios),
        comparisons=len(ratios),
        slower=", ".join(f"{what} {num(r, 2)}× (rounds {span(rounds, 2)})"
                         for what, r, rounds in ratios if r <= 1) or "none",  # fmt: skip
        trace_file=f"`{COMPILED_TRACE_FILE}`",
        trace_model=first.get("model", "-"),
        trace_release=first.get("transformers", "-"),
        trace_args=_trace_args(first),
        trace=trace_text,
    )


def split_section(sweep: dict | None, runs: list) -> str:
    """``paged_decode``'s flash-decoding split: the kernel per case from the sweep (graph
    replays: the device's time), then ``breakgraph`` against ``breakgraph_unsplit`` in CB;
    ``runs`` holds ``(data, label)``."""
    from breakgraph.integrations.transformers import cb_step
    from breakgraph.integrations.transformers import paged_decode as pd

    from . import decode_attention as da

    kernel_rows, cases_out, meta = [], [], (sweep or {}).get("meta", {})
    speedups, losses = {False: [], True: []}, {False: [], True: []}  # by held_out
    sms = meta.get("multiprocessors", H200_MULTIPROCESSORS)
    for case, r in (sweep or {}).items():
        if case == "meta" or "sweep_graph_us" not in r:
            continue
        times = {k: v["median"] for k, v in r["sweep_graph_us"].items()}
        block = pd.BLOCK_N if r["d"] <= 128 else 64
        default = f"{pd.split_count(r['bucket'] * r['hkv'], sms)}-block{block}"
        best = min(times, key=times.get)
        before, now = times["1-block64"], times[default]
        held_out = bool(r.get("held_out"))
        speedups[held_out].append(before / now)
        losses[held_out].append(now / times[best])
        if held_out:
            cases_out.append((now / times[best], case, default, best, r["d"]))
        kernel_rows.append([
            case.split("/")[0], "held out" if held_out else "yes",
            f"{r['hq']}/{r['hkv']} × {r['d']}",
            case.split("/")[1].replace(f"{r['seqs']}-long", f"{r['seqs']}, long"),
            num(r["keys"], 0), num(r["kv_mib"], 0), num(before, 1),
            f"{num(now, 1)} ({_setting(default)})", f"{num(times[best], 1)} ({_setting(best)})",
            f"{num(before / now, 2)}×", f"{num(now / times[best], 2)}×",
            num(r["kv_mib"] * 2**20 / now / 1e6, 2),
        ])  # fmt: skip

    def summary(held_out: bool) -> str:
        if not losses[held_out]:
            return "(not measured)"
        return (f"{span(speedups[held_out], 2)}× the speed of the kernel before and "
                f"{span(losses[held_out], 2)}× the time of each case's best setting "
                f"({num(statistics.mean(losses[held_out]), 3)}× on average)")  # fmt: skip

    worst = "(not measured)"
    if cases_out:
        loss, case, default, best, _ = max(cases_out)
        large = [c for c in cases_out if c[4] > pd.BLOCK_N]
        same = sum(c[2].split("-")[1] == c[3].split("-")[1] for c in large)
        worst = (f"The worst held-out case is {case.split('/')[0]} at "
                 f"{case.split('/')[1].replace('-long', ' long')} sequences: {num(loss, 2)}× "
                 f"its best setting ({_setting(default)} against {_setting(best)}). On held-out "
                 f"heads larger than {pd.BLOCK_N}, whose default block is 64 keys, the best "
                 f"setting used that block in {same} of {len(large)} cases.")  # fmt: skip
    threshold, facts = _threshold_table(sweep or {}, sms)
    rows, lines, first = [], [], runs[0][0]["meta"] if runs else {}
    for data, label, m, old, new, per_round in _pairs(runs, "breakgraph_unsplit", "breakgraph"):
        for name, e in (("breakgraph_unsplit", old), ("breakgraph", new)):
            rows.append([
                label, _release(data), m["model"],
                f"{m['prompts']} × {num(m['prompt_tokens'] / m['prompts'], 0)}",
                f"`{name}`",
                f"{num(e['tokens_per_s'], 0)} ({span(e['rounds_tokens_per_s'], 0)})",
                num(e["decode_step_ms"], 2), num(e["decode_forward_device_ms"], 2),
                f"{num(e['decode_forward_device_ms'] / e['decode_floor_ms'], 1)}×",
                num(e["host_prepare_ms_per_step"], 1),
            ])  # fmt: skip
        lines.append(
            f"- {label}, {m['model']} on {_release(data)}, {m['prompts']} requests: the "
            f"pure-decode forward's device time {num(old['decode_forward_device_ms'], 2)} → "
            f"{num(new['decode_forward_device_ms'], 2)} ms (before / now "
            f"{num(old['decode_forward_device_ms'] / new['decode_forward_device_ms'], 2)}×); "
            f"tokens/s now / before {num(new['tokens_per_s'] / old['tokens_per_s'], 2)}× "
            f"(round by round {span(per_round, 2)})"
        )
    return fill(
        "cb.split",
        sweep_file=f"`{SPLIT_SWEEP_FILE}`",
        gpu=meta.get("gpu", "-"),
        torch=meta.get("torch", "-"),
        date=meta.get("date", "-"),
        programs=pd.PROGRAMS_PER_SM,
        block=pd.BLOCK_N,
        kernel=table(
            ["shape", "defaults picked on it", "heads × size", "sequences", "keys", "KV MiB",
             "before µs", "default µs (splits × block)", "best µs (splits × block)",
             "before / default", "default / best", "default TB/s"],
            kernel_rows,
        ) if kernel_rows else "(not measured)",  # fmt: skip
        picked=summary(False),
        held_out=summary(True),
        worst=worst,
        threshold=threshold,
        **facts,
        long=f"{da.LONG[0]} sequences of {da.LONG[1][0]}–{da.LONG[1][1]} keys",
        picked_shapes=", ".join(name for name, *_ in da.SHAPES),
        held_shapes=", ".join(name for name, *_ in da.HELD_OUT),
        workloads="; ".join(_workload(data, label) for data, label in runs) or "-",
        split_from=cb_step.SPLIT_FROM_KEYS,
        split_at_least=cb_step.SPLIT_AT_LEAST,
        files=", ".join(f"`{name}` ({label})" for name, label in SPLIT_FILES),
        device=first.get("device", "-"),
        cb_date=first.get("date", "-"),
        table=table(
            ["run", "transformers", "model", "requests × mean prompt", "variant",
             "tokens/s (rounds)", "decode ms", "decode fwd device ms", "device x floor",
             "prep ms"],
            rows,
        ),  # fmt: skip
        ratios=bullets(lines) or "(not measured)",
    )


def _workload(data: dict, label: str) -> str:
    """One CB run's workload from its arguments: ``run A: 100 prompts of 16–1024 tokens, 128
    new tokens each``."""
    a = data["meta"].get("args", {})
    if not a:
        return f"run {label}: -"
    return (f"run {label}: {a['prompts']} prompts of {a['min_len']}–{a['max_len']} tokens, "
            f"{a['new_tokens']} new tokens each")  # fmt: skip


def _threshold_table(sweep: dict, sms: int) -> tuple[str, dict]:
    """The sweep's ``threshold`` rows: per shape and sequence count, the split's launched time
    over the unsplit kernel's at each longest sequence (below 1: the split pays in a break),
    and what the prose says of them (``threshold_seqs``, ``never_paid``, ``beyond``,
    ``below``), computed against ``cb_step``'s rule."""
    from breakgraph.integrations.transformers import cb_step
    from breakgraph.integrations.transformers import paged_decode as pd

    cells: dict[tuple, dict] = {}
    for case, r in sweep.items():
        if case != "meta" and r.get("threshold"):
            key = (case.split("/")[0], f"{r['hq']}/{r['hkv']} × {r['d']}", r["seqs"],
                   pd.split_count(r["bucket"] * r["hkv"], sms))  # fmt: skip
            ratio = r["triton_paged_split_us"]["median"] / r["triton_paged_us"]["median"]
            cells.setdefault(key, {})[r["longest"]] = ratio
    if not cells:
        return "(not measured)", dict.fromkeys(("threshold_seqs", "never_paid", "beyond",
                                                "below"), "-")  # fmt: skip
    longest = sorted({n for row in cells.values() for n in row})
    rows = [[*map(str, key), *(f"{num(row[n], 2)}×" if n in row else "-" for n in longest)]
            for key, row in cells.items()]  # fmt: skip
    header = ["shape", "heads × size", "sequences", "default split"]
    by_split: dict[int, list] = {}
    for key, row in cells.items():
        by_split.setdefault(key[3], []).extend(row.values())
    never = sorted(n for n, ratios in by_split.items() if min(ratios) >= 1)
    eligible = [(n, ratio) for key, row in cells.items() if key[3] >= cb_step.SPLIT_AT_LEAST
                for n, ratio in row.items()]  # fmt: skip

    def tally(values: list) -> str:
        if not values:
            return "no case"
        return (f"{sum(v < 1 for v in values)} of {len(values)} cases "
                f"({span(values, 2)}×)")  # fmt: skip

    seqs = sorted({key[2] for key in cells})
    facts = {
        "threshold_seqs": " and ".join(map(str, seqs)),
        "never_paid": (f"a default split of {' or '.join(map(str, never))} did not pay at any "
                       f"length" if never else "every default split paid at some length"),
        "beyond": tally([v for n, v in eligible if n > cb_step.SPLIT_FROM_KEYS]),
        "below": tally([v for n, v in eligible if n <= cb_step.SPLIT_FROM_KEYS]),
    }  # fmt: skip
    return table(header + [f"≤ {n} keys" for n in longest], rows), facts


def _setting(key: str) -> str:
    """A sweep key ``<splits>-block<n>`` as ``splits × n``."""
    splits, block = key.split("-block")
    return f"{splits} × {block}"


_GATHER = "gather / index (paged cache, embedding)"  # cb_trace's kind of the cache's gather


def trace_decode_section(data: dict, after: dict | None = None) -> str:
    """``cb_trace`` over pure-decode steps: the device's time per step by kind of kernel, and
    the attention kernel's share per layer; ``after``: the same window once decode steps call
    the kernel without the mask (a second column)."""
    meta, args = data["meta"], data["meta"]["args"]
    name, v = next(iter(data["variants"].items()))
    from .families import CB_FAMILIES

    config = CB_FAMILIES[meta["model"]].config()
    layers = config.num_hidden_layers
    busy = statistics.median(step["device_busy_ms"] for step in v["per_step"])
    kinds = v["device_ms_per_step_by_kind"]
    attention = kinds.get("attention", 0.0)
    columns = {"causal call": v}
    after_v = next(iter(after["variants"].values())) if after else None
    if after_v is not None:
        columns["without the mask"] = after_v
    after_kinds = after_v["device_ms_per_step_by_kind"] if after_v else {}
    return fill(
        "cb.trace_decode",
        file=TRACE_DECODE_FILE,
        after_file=TRACE_DECODE_FOLD_FILE if after else "(not measured)",
        gpu=meta["gpu"],
        torch=meta["torch"],
        transformers=meta["transformers"],
        date=meta["date"],
        model=meta["model"],
        variant=name,
        prompts=args["prompts"],
        min_len=args["min_len"],
        max_len=args["max_len"],
        new_tokens=args["new_tokens"],
        skip=args["skip"],
        steps=v["steps"],
        busy=num(busy, 2),
        kinds=_kinds_table(columns, code=False),
        attention=num(attention, 2),
        share=pct(attention / sum(kinds.values())),
        per_layer=num(attention / layers * 1e3, 0),
        layers=layers,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        after_attention=num(after_kinds.get("attention", float("nan")), 2),
        after_per_layer=num(after_kinds.get("attention", float("nan")) / layers * 1e3, 0),
        after_total=num(sum(after_kinds.values()), 2) if after_kinds else "-",
        after_gather=num(after_kinds.get(_GATHER, float("nan")), 2),
        copies_delta=num(after_kinds.get("copies", 0.0) - kinds.get("copies", 0.0), 2),
        after_prepare=num(after_v["prepare_ms_per_step"], 2) if after_v else "-",
        after_step=num(after_v["step_ms_per_step"], 2) if after_v else "-",
        after_wall=num(after_v["wall_ms_per_step"], 2) if after_v else "-",
        after_prep_busy=pct(after_v["prepare_device_busy_fraction"]) if after_v else "-",
    )


def _long_list() -> str:
    """``StepCounter.LONG_LIST`` (imported here: the instruments import transformers)."""
    from .cb_instruments import StepCounter

    return str(StepCounter.LONG_LIST)


def _kinds_table(variants: dict, code: bool = True) -> str:
    """Device milliseconds per step by kind of kernel (rows) and variant (columns), the kinds
    ordered by the first variant's time; "-" for summaries from before the split. ``code``:
    the column names are variant names (set as code), else plain words."""
    kinds: list = []
    for v in variants.values():
        kinds += [k for k in v.get("device_ms_per_step_by_kind", {}) if k not in kinds]
    if not kinds:
        return "(not in this summary: recompute it with `cb_trace.summarize_trace`)"
    split = [v.get("device_ms_per_step_by_kind", {}) for v in variants.values()]
    rows = [[kind] + [_cell(by_kind, kind, ".2f") for by_kind in split] for kind in kinds]
    quote = "`" if code else ""
    return table(["kind of kernel"] + [f"{quote}{name}{quote} ms" for name in variants], rows)


def trace_section(data: dict) -> str:
    """``benchmarks/cb_trace.py``: per variant, how much of the host's batch preparation runs
    while the device is busy (the overlap asynchronous batching is for)."""
    meta, w = data["meta"], data["meta"]["workload"]
    rows = []
    for name, v in data["variants"].items():
        rows.append(
            [
                f"`{name}`",
                v["batching"],
                num(v["wall_ms_per_step"], 2),
                num(v["prepare_ms_per_step"], 2),
                pct(v["prepare_device_busy_fraction"]),
                pct(v["device_busy_fraction"]),
                num(v["host_sync_ms_per_step"], 2),
            ]
        )
    header = ["variant", "batching", "ms per step", "prep ms", "GPU busy during prep",
              "GPU busy", "host waits ms"]  # fmt: skip
    return fill(
        "cb.trace",
        kinds=_kinds_table(data["variants"]),
        steps=next(iter(data["variants"].values()))["steps"],
        file=TRACE_FILE,
        gpu=meta["gpu"],
        torch=meta["torch"],
        transformers=meta["transformers"],
        date=meta["date"],
        model=w["model"],
        prompts=w["prompts"],
        min_len=w["min_len"],
        max_len=w["max_len"],
        new_tokens=w["new_tokens"],
        table=table(header, rows),
    )


def block_table_section(runs: list) -> str:
    """Pure-decode steps through transformers' block table (``breakgraph``) against its
    per-key index lists (``breakgraph_lists``), taking turns in one process: ``runs`` holds
    ``(data, label)``."""
    rows, lines, steps, preps, floors = [], [], [], [], []
    meta = runs[0][0]["meta"]
    for data, label, m, lists, tables, per_round in _pairs(runs, "breakgraph_lists",
                                                           "breakgraph"):  # fmt: skip
        for name, e in (("breakgraph_lists", lists), ("breakgraph", tables)):
            served = e.get("block_table_steps") or {}
            rows.append([
                label, _release(data), m["model"], f"`{name}`",
                f"{num(e['tokens_per_s'], 0)} ({span(e['rounds_tokens_per_s'], 0)})",
                num(e["decode_step_ms"], 2), num(e["decode_over_floor"], 1),
                num(e["host_prepare_ms_per_step"], 2), pct(e["gpu_forward_fraction"]),
                str(served.get("graph", 0)),
            ])  # fmt: skip
        steps.append(tables["decode_step_ms"] / lists["decode_step_ms"])
        preps.append(tables["host_prepare_ms_per_step"] / lists["host_prepare_ms_per_step"])
        floors.append(tables["decode_over_floor"])
        lines.append(
            f"- {label}, {m['model']} on {_release(data)}: tokens/s "
            f"{num(tables['tokens_per_s'] / lists['tokens_per_s'], 2)}× (round by round "
            f"{span(per_round, 2)}); pure-decode step {num(lists['decode_step_ms'], 2)} → "
            f"{num(tables['decode_step_ms'], 2)} ms ({num(lists['decode_over_floor'], 1)} → "
            f"{num(tables['decode_over_floor'], 1)}x its HBM floor); preparation per step "
            f"{num(lists['host_prepare_ms_per_step'], 2)} → "
            f"{num(tables['host_prepare_ms_per_step'], 2)} ms"
        )
    return fill(
        "cb.block_table",
        files=", ".join(f"`{name}` ({label})" for name, label in BLOCK_TABLE_FILES),
        **_run_of(meta),
        table=table(
            ["run", "transformers", "model", "variant", "tokens/s (rounds)", "decode ms",
             "decode x floor", "prep ms", "in forward", "steps from a table"],
            rows,
        ),  # fmt: skip
        ratios=bullets(lines) or "(not measured)",
        step_ratio=span(steps, 2) if steps else "-",
        prep_ratio=span(preps, 2) if preps else "-",
        floor=span(floors, 1) if floors else "-",
    )


def _card(data: dict) -> str:
    """``H200`` or ``H100`` (the card's HBM decides its floor), from the run's GPU name."""
    gpu = data["meta"].get("gpu", data["meta"].get("device", ""))
    return next((card for card in HBM_BYTES_PER_S if card in gpu), gpu)


def _over_floor(data: dict, entry: dict) -> float:
    """A pure-decode step over its HBM floor on the card it ran on (``bench_cb`` divides by an
    H200's bandwidth whatever the card)."""
    assumed = data["meta"].get("hbm_bytes_per_s", HBM_BYTES_PER_S["H200"])
    actual = HBM_BYTES_PER_S.get(_card(data), assumed)
    return entry["decode_over_floor"] * actual / assumed


def table_fill_section(runs: list, traces: list, launch: dict | None,
                       probe: dict | None) -> str:  # fmt: skip
    """The block table written through numpy (``breakgraph``) against transformers' own fill
    (``breakgraph_tx_fill``), with index lists and the compiled decoder beside, taking turns
    in one process: ``runs`` holds ``(data, label)``; ``traces`` the ``cb_trace`` summaries of
    the same runs; ``launch`` and ``probe`` the graph-launch measurements."""
    names = ("breakgraph", "breakgraph_tx_fill", "breakgraph_lists", "breakgraph_compiled")
    rows, fills, compiled, floors, cards = [], [], [], {}, []
    prep_ratios, step_ratios, hosts = [], [], {}
    for data, label in runs:
        cards.append(f"{label}: {data['meta']['gpu']}, transformers {_release(data)}")
        for m in data["models"]:
            v = m["variants"]
            for name in names:
                e = v.get(name, {})
                if "tokens_per_s" not in e:
                    continue
                floors.setdefault(name, []).append(_over_floor(data, e))
                if e.get("decode_forward_host_ms") is not None:
                    hosts.setdefault(name, []).append(e["decode_forward_host_ms"])
                rows.append([
                    label, _release(data), _card(data), m["model"], f"`{name}`",
                    f"{num(e['tokens_per_s'], 0)} ({span(e['rounds_tokens_per_s'], 0)})",
                    num(e["decode_step_ms"], 2), num(_over_floor(data, e), 1),
                    num(e["host_prepare_ms_per_step"], 2),
                    _cell(e, "decode_forward_host_ms", ".2f"),
                    _cell(e, "decode_forward_device_ms", ".2f"),
                ])  # fmt: skip
            own, theirs = v.get("breakgraph", {}), v.get("breakgraph_tx_fill", {})
            if "tokens_per_s" in own and "tokens_per_s" in theirs:
                prep_ratios.append(own["host_prepare_ms_per_step"]
                                   / theirs["host_prepare_ms_per_step"])  # fmt: skip
                step_ratios.append(own["decode_step_ms"] / theirs["decode_step_ms"])
                fills.append(
                    f"- {label}, {m['model']}: preparation "
                    f"{num(theirs['host_prepare_ms_per_step'], 2)} → "
                    f"{num(own['host_prepare_ms_per_step'], 2)} ms per step, pure-decode step "
                    f"{num(theirs['decode_step_ms'], 2)} → {num(own['decode_step_ms'], 2)} ms"
                )
            best = v.get("breakgraph_compiled", {})
            if "tokens_per_s" in own and "tokens_per_s" in best:
                compiled.append(
                    f"- {label}, {m['model']}: {num(own['decode_step_ms'], 2)} → "
                    f"{num(best['decode_step_ms'], 2)} ms ({num(_over_floor(data, own), 1)} → "
                    f"{num(_over_floor(data, best), 1)}× the floor)"
                )
    kinds, launches = [], []
    for summary in traces:
        meta = summary.get("meta", {})
        for name, t in summary.get("variants", {}).items():
            if not t.get("steps"):
                continue
            by_kind = ", ".join(f"{kind} {num(ms, 2)}" for kind, ms in
                                t["device_ms_per_step_by_kind"].items())  # fmt: skip
            kinds.append(f"- `{name}` on {meta.get('gpu', '?')} ({meta.get('transformers', '?')}): "
                         f"device busy {pct(t['device_busy_fraction'])} of "
                         f"{num(t['wall_ms_per_step'], 2)} ms per step; {by_kind}")  # fmt: skip
            if t.get("largest_graph_nodes"):
                launches.append((t["largest_graph_nodes"], t["largest_graph_launch_host_ms"]))
    graphs = launch or {}
    decode = next(iter((probe or {}).get("decode", {}).values()), None)
    return fill(
        "cb.table_fill",
        files=", ".join(f"`{name}` ({label})" for name, label in TABLE_FILL_FILES),
        cards="; ".join(cards),
        traces=", ".join(f"`{name}`" for name in TABLE_FILL_TRACE_FILES),
        trace_model=", ".join(sorted({_argv_value(t.get("meta", {}), "--model") for t in traces})
                              or ["(no trace)"]),  # fmt: skip
        table=table(["run", "transformers", "GPU", "model", "variant", "tokens/s (rounds)",
                     "decode ms", "decode x floor", "prep ms", "decode fwd host ms",
                     "decode fwd device ms"], rows),  # fmt: skip
        fills=bullets(fills) or "(not measured)",
        compiled=bullets(compiled) or "(not measured)",
        fill_prep_ratio=span(prep_ratios or [float("nan")], 2),
        fill_step_ratio=span(step_ratios or [float("nan")], 2),
        host_table=span(hosts.get("breakgraph", [float("nan")]), 2),
        host_lists=span(hosts.get("breakgraph_lists", [float("nan")]), 2),
        floor_default=span(floors.get("breakgraph", [float("nan")]), 1),
        floor_compiled=span(floors.get("breakgraph_compiled", [float("nan")]), 1),
        kinds=bullets(kinds) or "(no trace)",
        trace_nodes=span([n for n, _ in launches] or [float("nan")], 0),
        trace_launch=span([ms * 1e3 for _, ms in launches] or [float("nan")], 0),
        launch_file=GRAPH_LAUNCH_FILE,
        launch_sizes=span(graphs.get("nodes") or [float("nan")], 0),
        launch_fixed=span([graphs[k]["fixed_us"] for k in ("kernels", "copies", "gemm", "triton")
                           if k in graphs] or [float("nan")], 1),  # fmt: skip
        launch_per_node=span([graphs[k]["per_node_us"] for k in ("kernels", "copies", "gemm",
                              "triton") if k in graphs] or [float("nan")], 3),  # fmt: skip
        launch_model=span([r["median_us"] for r in graphs.get("model", {}).get("by_size", {})
                           .values()] or [float("nan")], 0),  # fmt: skip
        probe_file=LAUNCH_PROBE_FILE,
        probe_idle=num(decode["idle"]["median_us"], 1) if decode else "-",
        probe_b2b=num(decode["back_to_back"]["median_us"], 1) if decode else "-",
        probe_profiled=num(probe["profiler_cpu_cuda"]["median_us"], 0) if decode else "-",
        probe_cpu=num(probe["profiler_cpu"]["median_us"], 0) if decode else "-",
        probe_after=num(probe["after_profiler"]["median_us"], 0) if decode else "-",
    )


def _argv_value(meta: dict, flag: str) -> str:
    """The value given to ``flag`` on a run's command line (``meta["argv"]``), or ``?``."""
    argv = meta.get("argv", [])
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else "?"
