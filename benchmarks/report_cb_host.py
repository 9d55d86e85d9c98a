"""The continuous-batching sections of docs/performance.md on the host's side of a step: where
breakgraph's forward spends its host time, transformers' step preparation (its index lists,
their conversion to tensors, its parts on the CPU) and the profiler traces of CB steps.

Used by ``benchmarks/report.py`` with the JSON it finds; the main CB tables are in
:mod:`benchmarks.cb_report`, the decode path's sections in :mod:`benchmarks.report_cb_decode`.
The prose is in ``performance.md.in`` (``cb.*``). Example::

    python -m benchmarks.report   # the whole page, these sections included
"""

from __future__ import annotations

import statistics

from .cb_report import _cell, _cpu_host, _release, _run_of
from .template import bullets, fill, num, pct, span, table

#: one model, breakgraph's variants only, 3 rounds, per release: the CB forward's host time split
HOST_SPLIT_FILES = ("h200-cb-host-split-5.17.json", "h200-cb-host-split-5.24.json")
#: ``bench_cb --prep-lists``: transformers' index lists converted to tensors, per release
PREP_LISTS_FILES = ("h200-cb-prep-lists-5.17.json", "h200-cb-prep-lists-5.24.json")
#: ``benchmarks/cb_prep_profile.py`` on the CPU: a pure-decode step's preparation by part
PREP_PARTS_FILES = ("cpu-cb-prep-profile-5.17.json", "cpu-cb-prep-profile-5.24.json",
                    "cpu-cb-prep-profile-table-5.17.json", "cpu-cb-prep-profile-table-5.24.json",
                    "cpu-cb-prep-profile-fill-5.17.json", "cpu-cb-prep-profile-fill-5.24.json")
#: ``benchmarks/fill_views_probe.py`` on the CPU: the fill's own cost per request, the tree
#: that converted each view (before) and the one that keeps them (after) in turn, two processes
FILL_VIEWS_FILES = ("cpu-fill-views-probe-5.17.json", "cpu-fill-views-probe-5.24.json")
#: the same probe on the H200 server's host (``gpu_check.sh RUN_FILL_VIEWS=1``), one process
FILL_VIEWS_HOST_FILE = "h200-host-fill-views-probe.json"
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


def prep_parts_section(runs: list, views: list = (), host: dict | None = None) -> str:
    """transformers' preparation of a pure-decode step by part (``cb_prep_profile``), one
    column pair per release: ms (mean over the steps) and its share of the preparation; and
    ``views`` (:data:`FILL_VIEWS_FILES`' runs): the numpy fill before and after it kept each
    slot's view, and ``host`` (:data:`FILL_VIEWS_HOST_FILE`) the same on the GPU server's host."""
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
        **{**_run_of(first["meta"], "gpu"),
           "date": " and ".join(sorted({d["meta"]["date"] for d in runs}))},  # fmt: skip
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
        views=_fill_views(views, host),
    )


def _fill_views(probes: list, host: dict | None = None) -> str:
    """``fill_views_probe``'s runs: the fill's µs per request before and after it kept its
    views, or a line saying it was not measured; ``host``: the run on the GPU server's host."""
    if not probes:
        return "(The fill's kept numpy views against a conversion per call: not measured.)"
    host_line = "On the H200 server's host it was not measured."
    if host is not None:
        rows = list(host["layouts"].values())
        host_line = fill(
            "cb.fill_views_host",
            file=FILL_VIEWS_HOST_FILE,
            torch=host["meta"]["torch"],
            date=host["meta"]["date"],
            cores=_cpu_host(host["meta"]),
            transformers=host["meta"]["transformers"],
            before_us=span([row["before_us"] for row in rows], 1),
            after_us=span([row["after_us"] for row in rows], 1),
            ratio=span([row["after_over_before"] for row in rows], 2),
        )
    layouts = [row for data in probes for row in data["layouts"].values()]
    first = probes[0]
    return fill(
        "cb.fill_views",
        files=", ".join(f"`{name}`" for name in FILL_VIEWS_FILES[: len(probes)]),
        **_run_of(first["meta"], "gpu"),
        processes=len(probes),
        before=first["settings"]["before"],
        requests=first["settings"]["requests"],
        rounds=first["settings"]["rounds"],
        repeats=first["settings"]["repeats"],
        layouts=", ".join(first["layouts"]),
        before_us=span([row["before_us"] for row in layouts], 1),
        after_us=span([row["after_us"] for row in layouts], 1),
        ratio=span([row["after_over_before"] for row in layouts], 2),
        ratio_rounds=span([x for row in layouts for x in row["after_over_before_rounds"]], 2),
        saved_us=span([row["before_us"] - row["after_us"] for row in layouts], 1),
        host=host_line.strip(),
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


_GATHER = "gather / index (paged cache, embedding)"  # cb_trace's kind of the cache's gather


def _trace_run(meta: dict, workload: dict) -> dict:
    """A ``cb_trace`` run's provenance and workload placeholders."""
    names = ("prompts", "min_len", "max_len", "new_tokens")
    return {"gpu": meta["gpu"], "torch": meta["torch"], "transformers": meta["transformers"],
            "date": meta["date"], **{name: workload[name] for name in names}}  # fmt: skip


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
        **_trace_run(meta, args),
        model=meta["model"],
        variant=name,
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
        **_trace_run(meta, w),
        model=w["model"],
        table=table(header, rows),
    )
