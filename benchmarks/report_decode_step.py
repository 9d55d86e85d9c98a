"""The page's sections on one pure-decode step: its write rows derived inside the decode graph
(the tree before and this one, in turn) and the step's budget against twice its HBM floor.

Why a module of its own: these two sections read ``bench_cb`` runs and the GEMM probe
(``benchmarks/decode_gemm_probe.py``) together, per shape, to say which part of the step (
transformers' host work, breakgraph's forward, the device) stands between it and issue
twenty-three's target; :mod:`benchmarks.report_cb_decode` holds the decode path's sections
before them.

Example (the committed runs)::

    python -m benchmarks.report   # the whole page, these sections included
"""

from __future__ import annotations

import statistics

from . import targets as T
from .cb_report import _release, _run_of
from .report_cb_decode import card_floor_scale
from .split_kernel_ab import WARM_UP_BATCHES
from .template import bullets, fill, num, span, table

#: ``bench_cb --variants breakgraph`` of the tree before (``host``: write rows derived on the
#: host's stream before the replay) and this one (``graph``: derived inside the graph), one
#: process each, in turn: (file, tree, turn)
WRITE_ROWS_FILES = tuple(
    (f"h200-cb-write-rows-{tree}-{turn}-{release}.json", tree, turn)
    for release in ("5.17", "5.24")
    for turn in (1, 2)
    for tree in ("host", "graph")
)
#: ``bench_cb --variants breakgraph,breakgraph_compiled`` of this tree, per release, with 100
#: prompts (the CB tables' workload) and with 32 (``--prompts 32``, the target's fewest
#: requests): the step's parts against its floor
FLOOR_FILES = ("h200-cb-floor-again-5.17.json", "h200-cb-floor-again-5.24.json",
               "h200-cb-floor-32-again-5.17.json", "h200-cb-floor-32-again-5.24.json")
#: the same runs of an earlier tree (before the block-table fill kept its numpy views), in the
#: order of :data:`FLOOR_FILES`
FLOOR_BEFORE_FILES = ("h200-cb-floor-5.17.json", "h200-cb-write-rows-graph-1-5.24.json",
                      "h200-cb-floor-32-5.17.json", "h200-cb-floor-32-5.24.json")
#: ``benchmarks/triton_first_call.py``: every ``paged_decode`` variant's first call in a process
#: with an empty Triton cache, then in one that finds them on disk
FIRST_CALL_FILES = ("h200-triton-first-call-cold.json", "h200-triton-first-call-disk.json")
#: ``bench_cb --variants breakgraph`` and ``--variants breakgraph_cold_kernels``, each in a
#: process of its own with an empty Triton cache: the decode kernels compiled when the manager
#: is created, and as before (in the first step that needs one)
WARM_KERNELS_FILES = ("h200-cb-warm-kernels.json", "h200-cb-cold-kernels.json")
#: ``benchmarks/split_kernel_ab.py``: the kernels with a compile-time split count (before) and
#: with one pair for every count (now), in turn; then the probe and the CB runs with and without
#: the warm-up again, with this tree
SPLIT_AB_FILE = "h200-split-kernel-ab.json"
FIRST_CALL_PAIR_FILES = ("h200-triton-first-call-cold-pair.json",
                         "h200-triton-first-call-disk-pair.json")
WARM_KERNELS_PAIR_FILES = ("h200-cb-warm-kernels-pair.json", "h200-cb-cold-kernels-pair.json")
#: ``benchmarks/decode_gemm_probe.py``: a decode step's GEMMs alone, as the model runs them
#: and fused
DECODE_GEMM_FILE = "h200-decode-gemm.json"


def _after_over_before(trees: dict, metric: str) -> float:
    """``metric``'s median in this tree over the tree before's (``trees``: ``{"host": [variant
    entries], "graph": [...]}``)."""
    median = lambda tree: statistics.median(v[metric] for v in trees[tree])  # noqa: E731
    return median("graph") / median("host")


def write_rows_section(runs: list) -> str:
    """The two trees in turn (``runs``: ``(data, tree, turn)``): per release and model, the
    pure-decode forward's host time (what the change moves), its device span, the step."""
    rows, seen, others, other_variants = [], {}, [], set()
    for data, tree, turn in runs:
        extra = {name for m in data["models"] for name, v in m["variants"].items()
                 if name != "breakgraph" and "tokens_per_s" in v}  # fmt: skip
        if extra:
            others.append(f"{tree} {turn} on {_release(data)}")
            other_variants |= extra
        for m in data["models"]:
            v = m["variants"].get("breakgraph", {})
            if "decode_forward_host_ms" not in v:
                continue
            seen.setdefault((_release(data), m["model"]), {}).setdefault(tree, []).append(v)
            rows.append([
                _release(data), m["model"], tree, str(turn),
                f"{num(v['tokens_per_s'], 0)} ({span(v['rounds_tokens_per_s'], 0)})",
                num(v["decode_step_ms"], 2), num(v["decode_prepare_ms"], 2),
                num(v["decode_forward_host_ms"], 2), num(v["decode_forward_device_ms"], 2),
            ])  # fmt: skip
    lines, ratios, device_ratios, tokens_ratios, drift = [], [], [], [], []
    for (release, model), trees in seen.items():
        drift += [max(v["tokens_per_s"] for v in runs_) / min(v["tokens_per_s"] for v in runs_)
                  for runs_ in trees.values()]  # fmt: skip
        if "host" not in trees or "graph" not in trees:
            continue
        ratio = _after_over_before(trees, "decode_forward_host_ms")
        ratios.append(ratio)
        device_ratios.append(_after_over_before(trees, "decode_forward_device_ms"))
        tokens_ratios.append(_after_over_before(trees, "tokens_per_s"))
        host = {tree: [v["decode_forward_host_ms"] for v in trees[tree]] for tree in trees}
        lines.append(f"- {model} on {release}: {span(host['host'], 2)} → "
                     f"{span(host['graph'], 2)} ms ({num(ratio, 2)}×)")  # fmt: skip
    first, nan = runs[0][0], [float("nan")]
    return fill(
        "cb.write_rows",
        files=", ".join(f"`{name}`" for name, _, _ in WRITE_ROWS_FILES),
        **_run_of(first["meta"], "gpu"),
        table=table(["transformers", "model", "write rows", "turn", "tokens/s (rounds)",
                     "decode ms", "decode prep ms", "decode fwd host ms",
                     "decode fwd device ms"], rows),  # fmt: skip
        host=bullets(lines) or "(not measured)",
        ratio=span(ratios or nan, 2),
        device_ratio=span(device_ratios or nan, 2),
        tokens_ratio=span(tokens_ratios or nan, 2),
        same_tree=num(max(drift, default=float("nan")), 2),
        variants_note=fill("cb.write_rows.others", others=", ".join(others),
                           other_variants=", ".join(f"`{n}`" for n in sorted(other_variants)))
        if others else fill("cb.write_rows.alone"),  # fmt: skip
    )


def _floor_ms(data: dict, entry: dict) -> float:
    """A pure-decode step's HBM floor on the card the run had (``bench_cb`` divided by its
    ``--hbm-tbs``, an H200's by default whatever the card until session 56)."""
    return entry["decode_floor_ms"] / card_floor_scale(data)


def _gemm_ms(probe: dict | None, model: str, requests: int, layers: int) -> tuple:
    """``(separate, fused, share)``: ms of one step's GEMMs (every layer's, and the head) at
    the probe's row count nearest ``requests``, and the share of HBM bandwidth the layers'
    separate GEMMs reach; ``(None, None, None)`` where the probe has no such shape."""
    shape = next((s for s in (probe or {}).get("shapes", []) if s["shape"] == model), None)
    if shape is None:
        return None, None, None
    rows = shape["rows"][min(shape["rows"], key=lambda r: abs(int(r) - requests))]
    head = rows["head"]["ms"]
    separate, fused = (layers * rows[way]["ms_per_layer"] + head for way in ("separate", "fused"))
    return separate, fused, rows["separate"]["bandwidth_share"]


def _over(ms: float | None, floor: float) -> str:
    """A table cell: ``"ms (× the floor)"``, or ``-`` where not measured."""
    return "-" if ms is None else f"{num(ms, 2)} ({num(ms / floor, 1)}×)"


def _by_requests(values: dict, digits: int = 1, unit: str = "×") -> str:
    """``"a–b× with 100 requests, c–d× with 32 requests"``: ``values`` is ``{requests:
    [ratios]}``."""
    return ", ".join(f"{span(v, digits)}{unit} with {requests} requests"
                     for requests, v in sorted(values.items(), reverse=True))  # fmt: skip


def _counts(values: dict) -> str:
    """``"6 of 6 runs with 100 requests, 1 of 6 with 32"``: ``values`` is ``{requests:
    [bool]}``."""
    return ", ".join(f"{sum(v)} of {len(v)} runs with {requests} requests"
                     for requests, v in sorted(values.items(), reverse=True))  # fmt: skip


def _decode_parts(runs: list) -> dict:
    """``{(release, model, requests): (step, scheduling, device)}`` ms of the default decoder's
    pure-decode steps in ``runs``."""
    parts = {}
    for data in runs:
        for m in data["models"]:
            v = m["variants"].get("breakgraph", {})
            if "decode_prepare_ms" in v:
                key = (_release(data), m["model"], v["decode_requests"])
                parts[key] = tuple(v[k] for k in ("decode_step_ms", "decode_prepare_ms",
                                                  "decode_forward_device_ms"))  # fmt: skip
    return parts


def floor_before(before: list, runs: list) -> str:
    """The earlier tree's runs (:data:`FLOOR_BEFORE_FILES`) beside this one's: each shape's
    step, scheduling and device forward, before → now (default decoder), and the range of
    the scheduling's ratio; empty without earlier runs."""
    old, new = _decode_parts(before), _decode_parts(runs)
    keys = [k for k in new if k in old]
    if not keys:
        return ""
    arrow = lambda a, b: f"{num(a, 2)} → {num(b, 2)}"  # noqa: E731
    rows = [[*map(str, k), *(arrow(a, b) for a, b in zip(old[k], new[k]))] for k in keys]
    ratios = [new[k][1] / old[k][1] for k in keys]
    return fill(
        "cb.floor_before",
        files=", ".join(f"`{name}`" for name in FLOOR_BEFORE_FILES),
        date=before[0]["meta"]["date"],
        table=table(["transformers", "model", "requests", "step ms", "scheduling ms",
                     "device ms"], rows),  # fmt: skip
        scheduling=span(ratios, 2),
        device=span([new[k][2] / old[k][2] for k in keys], 2),
    ).strip()


def floor_section(runs: list, probe: dict | None, before: list = ()) -> str:
    """Each shape's pure-decode step split into what bounds it, each part over the step's
    HBM floor: the step with the default and the compiled decoder, transformers' scheduling
    of the step (``decode_prepare_ms``), breakgraph's forward on the host, the device's
    forward (both decoders) and, from the probe, the step's GEMMs alone (``runs``: the
    ``FLOOR_FILES`` loaded, one request count each)."""
    rows, met = [], []
    prep, over, device, compiled, gemms, fused, shares = {}, {}, {}, {}, {}, {}, {}
    for data in runs:
        for m in data["models"]:
            v = m["variants"].get("breakgraph", {})
            c = m["variants"].get("breakgraph_compiled", {})
            if "decode_prepare_ms" not in v:
                continue
            floor = _floor_ms(data, v)
            requests = v["decode_requests"]
            separate, joined, share = _gemm_ms(probe, m["model"], requests,
                                               m["floor"]["shape"]["layers"])  # fmt: skip
            prep.setdefault(requests, []).append(v["decode_prepare_ms"] / floor)
            over.setdefault(requests, []).append(
                v["decode_prepare_ms"] > T.TARGET_CB_DECODE_OVER_FLOOR * floor)
            device.setdefault(requests, []).append(v["decode_forward_device_ms"] / floor)
            if c.get("decode_forward_device_ms") is not None:
                compiled.setdefault(requests, []).append(c["decode_forward_device_ms"] / floor)
            if separate is not None:
                gemms.setdefault(requests, []).append(separate / floor)
                fused.setdefault(requests, []).append(joined / floor)
                shares.setdefault(requests, []).append(100 * share)
            best, how = min((v["decode_step_ms"], "default"),
                            (c.get("decode_step_ms", float("inf")), "compiled"))  # fmt: skip
            if best <= T.TARGET_CB_DECODE_OVER_FLOOR * floor and (
                requests >= T.TARGET_CB_DECODE_MIN_REQUESTS):  # fmt: skip
                met.append(f"{m['model']} on {_release(data)} with {requests} requests, "
                           f"{num(best / floor, 1)}× ({how})")  # fmt: skip
            rows.append([
                _release(data), m["model"], str(requests), num(floor, 3),
                _over(v["decode_step_ms"], floor), _over(c.get("decode_step_ms"), floor),
                _over(v["decode_prepare_ms"], floor), _over(v["decode_forward_host_ms"], floor),
                _over(v["decode_forward_device_ms"], floor),
                _over(c.get("decode_forward_device_ms"), floor), _over(separate, floor),
                _over(joined, floor),
            ])  # fmt: skip
    first = runs[0]["meta"]
    return fill(
        "cb.floor",
        files=", ".join(f"`{name}`" for name in FLOOR_FILES),
        probe=f"`{DECODE_GEMM_FILE}`",
        **_run_of(first, "gpu"),
        target=f"{T.TARGET_CB_DECODE_OVER_FLOOR:g}",
        min_requests=T.TARGET_CB_DECODE_MIN_REQUESTS,
        table=table(["transformers", "model", "requests", "floor ms", "step", "step compiled",
                     "scheduling", "bg forward host", "device", "device compiled",
                     "GEMMs alone", "GEMMs fused"], rows),  # fmt: skip
        met=len(met),
        runs=len(rows),
        met_runs="; ".join(met) or "none",
        prep=_by_requests(prep) or "-",
        prep_over=_counts(over) or "-",
        device_over=_by_requests(device) or "-",
        compiled_over=_by_requests(compiled) or "-",
        gemms=_by_requests(gemms) or "-",
        fused=_by_requests(fused) or "-",
        share=_by_requests(shares, 0, "%") or "-",
        reps=(probe or {}).get("meta", {}).get("reps", "-"),
        before=floor_before(list(before), runs),
    )


def _longer(deltas: dict) -> str:
    """``"a–b s longer"`` / ``"a–b s shorter"`` of ``{name: seconds}``; where the signs
    differ, each by name: ``"0.30 s longer (x) and 0.34 s shorter (y)"``."""
    values = list(deltas.values())
    if all(d > 0 for d in values) or all(d < 0 for d in values):
        word = "longer" if values[0] > 0 else "shorter"
        return f"{span([abs(d) for d in values], 2)} s {word}"
    return " and ".join(f"{num(abs(d), 2)} s {'longer' if d > 0 else 'shorter'} ({name})"
                        for name, d in deltas.items())  # fmt: skip


def _median_of(values, digits: int = 2) -> str:
    """``"m (low–high)"``: the median of ``values`` and their range."""
    values = list(values)
    return f"{num(statistics.median(values), digits)} ({span(values, digits)})"


def _warm_cold(runs: list) -> dict:
    """``bench_cb`` runs with the decode-kernel warm-up (``breakgraph``) and without it
    (``breakgraph_cold_kernels``), each model's first round against its later ones: the table
    rows and, per variant, the first round over the median of the later ones, the first
    manager's creation and the decode captures while serving it, and per model the first
    round with its manager in seconds."""
    rows, first_over_rest, manager, capture, total = [], {}, {}, {}, {}
    for data in runs:
        for m in data["models"]:
            for name, v in m["variants"].items():
                rounds = v["rounds_tokens_per_s"]
                later = statistics.median(rounds[1:])
                first_over_rest.setdefault(name, []).append(rounds[0] / later)
                manager.setdefault(name, []).append(v["rounds_manager_s"][0])
                capture.setdefault(name, []).append(v["rounds_decode_capture_s"][0])
                # every round serves the same tokens: the first one's serving time from its rate
                first_s = v["rounds_manager_s"][0] + v["tokens"] / rounds[0]
                total.setdefault(m["model"], {})[name] = first_s
                rows.append([m["model"], f"`{name}`", num(rounds[0], 0),
                             " / ".join(num(r, 0) for r in rounds[1:]),
                             num(v["rounds_manager_s"][0], 2),
                             num(v["rounds_decode_capture_s"][0], 2), num(first_s, 2)])  # fmt: skip
    warm, plain = "breakgraph", "breakgraph_cold_kernels"
    return {
        "table": table(["model", "variant", "round 1 tokens/s", "later rounds tokens/s",
                        "round 1 manager s", "round 1 decode captures s",
                        "round 1 with its manager s"], rows),  # fmt: skip
        "warm_first": span(first_over_rest[warm], 2),
        "cold_first": span(first_over_rest[plain], 2),
        "manager_warm": span(manager[warm], 2),
        "manager_cold": span(manager[plain], 2),
        "capture_warm": span(capture[warm], 2),
        "capture_cold": span(capture[plain], 2),
        "total": _longer({model: t[warm] - t[plain] for model, t in total.items()}),
    }


def _workload(meta: dict) -> str:
    args = meta["args"]
    return (f"{args['prompts']} prompts of {args['min_len']}–{args['max_len']} tokens, "
            f"{args['new_tokens']} new tokens, {args['rounds']} rounds")  # fmt: skip


def warm_kernels_section(first_calls: list, runs: list) -> str:
    """The decode kernels' compile, and what compiling them before serving changed: the probe
    (``first_calls``: :data:`FIRST_CALL_FILES` loaded, empty cache then disk), then the CB runs
    with and without the warm-up (``runs``: :data:`WARM_KERNELS_FILES` loaded, in that order):
    each model's first round against the median of its later ones, the first round's manager
    creation and its decode-graph captures while serving."""
    cold, disk = first_calls
    warm = "breakgraph"
    meta = runs[0]["meta"]
    return fill(
        "cb.warm_kernels",
        probe_files=", ".join(f"`{name}`" for name in FIRST_CALL_FILES),
        files=", ".join(f"`{name}`" for name in WARM_KERNELS_FILES),
        **_run_of(meta, "gpu"),
        variants=len(cold["rows"]),
        shapes=len({r["shape"] for r in cold["rows"]}),
        cold=_median_of(r["first_ms"] / 1e3 for r in cold["rows"]),
        cold_total=num(sum(r["first_ms"] for r in cold["rows"]) / 1e3, 1),
        disk=_median_of((r["first_ms"] for r in disk["rows"]), 1),
        second=span([r["second_ms"] for r in cold["rows"] + disk["rows"]], 2),
        rebuilt=" (rebuilt from the runs' printed lines: their JSON write failed)"
        if cold.get("rebuilt_from_log") else "",
        workload=_workload(meta),
        warmed="; ".join(f"{m['model']} {', '.join(map(str, v['kernels_warmed']))}"
                         for data in runs for m in data["models"]
                         for v in [m["variants"].get(warm)] if v),  # fmt: skip
        **_warm_cold(runs),
    )


def split_pair_section(ab: dict, first_calls: list, first_calls_before: list, runs: list) -> str:
    """One split-kernel pair for every split count: the A/B of the kernels before and now
    (``ab``: :data:`SPLIT_AB_FILE`; their times per split count and the warm-up's compile),
    the first-call probe again (``first_calls``: :data:`FIRST_CALL_PAIR_FILES`, against
    ``first_calls_before``: :data:`FIRST_CALL_FILES`) and the CB runs with and without the
    warm-up again (``runs``: :data:`WARM_KERNELS_PAIR_FILES`)."""
    rows, cases = [], ab["rows"]
    for count in sorted({r["splits"] for r in cases}):
        mine = [r for r in cases if r["splits"] == count]
        cells = []
        for kind in ("graph", "launched"):
            ratios = [r[f"now_over_before_{kind}"] for r in mine]
            cells.append(f"{num(statistics.median(ratios), 3)} ({span(ratios, 3)})")
        before = [r["before_graph_us"]["median"] for r in mine]
        rows.append([count, len(mine), span(before, 1), *cells])
    split_graph = [r["now_over_before_graph"] for r in cases if r["splits"] > 1]
    warm = {tree: [w for w in ab["warm_up"] if w["tree"] == tree] for tree in ("before", "now")}
    pairs = {}
    for w in ab["warm_up"]:
        pairs.setdefault((w["shape"], w["page"]), []).append(w)
    first_extra = [pair[0]["s"] - pair[1]["s"] for pair in pairs.values()
                   if pair[0]["binaries"] == pair[1]["binaries"]]  # fmt: skip
    more = [w for w in warm["before"] if len([c for c in w["splits"] if c > 1]) > 1]
    more_shapes = {w["shape"] for w in more}  # several split counts: a pair each before
    cold, disk = first_calls
    counts = sorted({r["splits"] for r in cold["rows"] if r["splits"] > 1})
    later = [r for r in cold["rows"] if r["splits"] > counts[0]]  # after the first that split
    meta = ab["meta"]
    return fill(
        "cb.split_pair",
        ab_file=f"`{SPLIT_AB_FILE}`",
        **_run_of(meta, "gpu"),
        cases=len({(r["shape"], r["seqs"]) for r in cases}),
        shapes=len({r["shape"] for r in cases}),
        held_out=len({r["shape"] for r in cases if r["held_out"]}),
        seqs=", ".join(str(s) for s in sorted({r["seqs"] for r in cases})),
        keys=f"{ab['keys'][0]}–{ab['keys'][1]}",
        rounds=ab["rounds"],
        calls=ab["calls"],
        table=table(["splits", "cases", "before µs (graph)", "now / before, in a graph",
                     "now / before, launched"], rows),  # fmt: skip
        split_graph=f"{num(statistics.median(split_graph), 3)} ({span(split_graph, 3)})",
        diff=f"{max(r['max_abs_diff'] for r in cases):.1e}",
        batches=", ".join(map(str, WARM_UP_BATCHES)),
        warm_shapes=len({w["shape"] for w in ab["warm_up"]}),
        warm_before=num(sum(w["s"] for w in warm["before"]), 1),
        warm_now=num(sum(w["s"] for w in warm["now"]), 1),
        binaries_before=sum(w["binaries"] for w in warm["before"]),
        binaries_now=sum(w["binaries"] for w in warm["now"]),
        more=", ".join(sorted({f"{w['shape']} ({', '.join(map(str, w['splits']))})"
                               for w in more})),  # fmt: skip
        more_before=sum(w["binaries"] for w in warm["before"] if w["shape"] in more_shapes),
        more_now=sum(w["binaries"] for w in warm["now"] if w["shape"] in more_shapes),
        first_extra=span(first_extra, 2),
        probe_files=", ".join(f"`{name}`" for name in FIRST_CALL_PAIR_FILES),
        probe_date=first_calls[0]["meta"]["date"],
        variants=len(cold["rows"]),
        cold_total=num(sum(r["first_ms"] for r in cold["rows"]) / 1e3, 1),
        cold_total_before=num(sum(r["first_ms"] for r in first_calls_before[0]["rows"]) / 1e3, 1),
        later_first=span([r["first_ms"] for r in later], 1),
        later_counts=", ".join(map(str, counts[1:-1])) + f" or {counts[-1]}",
        first_count=counts[0],
        page=max(w["page"] for w in ab["warm_up"]),
        disk_total=num(sum(r["first_ms"] for r in disk["rows"]) / 1e3, 2),
        files=", ".join(f"`{name}`" for name in WARM_KERNELS_PAIR_FILES),
        workload=_workload(runs[0]["meta"]),
        **{f"cb_{k}": v for k, v in _warm_cold(runs).items()},
        cb_first_model=runs[0]["models"][0]["model"],
    )


#: ``bench_cb``'s ``breakgraph_breaks`` (every pure-decode layer an attention break) with the
#: tree before (a9bb246: the break's output allocated by the kernel, padded to the bucket and
#: copied back) and now (written into the tensor the graph captured), one process each, in
#: turn: ``(file, tree, turn)``; the ``shapes-`` runs on mixtral-1k-8l and gemma-2b
BREAK_OUTPUT_FILES = tuple(
    (f"h100-cb-break-out-{shapes}{tree}-{turn}-{release}.json", tree, turn)
    for shapes, release, turns in (("", "5.17", (1, 2)), ("", "5.24", (1,)),
                                   ("shapes-", "5.17", (1, 2)))  # fmt: skip
    for turn in turns
    for tree in ("before", "now")
)


def break_output_section(runs: list) -> str:
    """Attention breaks that write into their captured output on every torch: the break path's
    host time per pure-decode step, the step and tokens/s, before and now (``runs``:
    ``(data, tree, turn)`` of :data:`BREAK_OUTPUT_FILES` loaded)."""
    rows, host, break_host, step, rate, device = [], {}, {}, {}, {}, {}
    layers = {}
    for data, tree, turn in runs:
        release = _release(data)
        for m in data["models"]:
            v = m["variants"]["breakgraph_breaks"]
            key = (release, m["model"])
            layers[m["model"]] = m["config"]["num_hidden_layers"]
            for store, value in ((break_host, v["decode_break_host_ms"]),
                                 (host, v["decode_forward_host_ms"]),
                                 (step, v["decode_step_ms"]), (rate, v["tokens_per_s"]),
                                 (device, v["decode_forward_device_ms"])):  # fmt: skip
                store.setdefault(key, {}).setdefault(tree, []).append(value)
            rows.append([release, m["model"], tree, turn, num(v["decode_break_host_ms"], 3),
                         num(v["decode_forward_host_ms"], 3),
                         num(v["decode_forward_device_ms"], 3), num(v["decode_step_ms"], 3),
                         " / ".join(num(r, 0) for r in v["rounds_tokens_per_s"])])  # fmt: skip

    def over(store: dict, key: tuple) -> float:
        return statistics.median(store[key]["now"]) / statistics.median(store[key]["before"])

    ratio_rows, ratios = [], {"break": [], "device": [], "step": [], "rate": [], "us": []}
    for key in break_host:
        release, model = key
        saved = (statistics.median(break_host[key]["before"])
                 - statistics.median(break_host[key]["now"])) / layers[model] * 1e3  # fmt: skip
        values = {"break": over(break_host, key), "us": saved, "device": over(device, key),
                  "step": over(step, key), "rate": over(rate, key)}  # fmt: skip
        for name, value in values.items():
            ratios[name].append(value)
        ratio_rows.append([release, model, layers[model], num(values["break"], 2),
                           num(saved, 1), num(values["device"], 2), num(values["step"], 2),
                           num(values["rate"], 2)])  # fmt: skip
    meta = runs[0][0]["meta"]
    return fill(
        "cb.break_output",
        files=", ".join(f"`{name}`" for name, _, _ in BREAK_OUTPUT_FILES),
        **_run_of(meta, "gpu"),
        releases=" and ".join(sorted({_release(d) for d, _, _ in runs})),
        workload=_workload(meta),
        table=table(["transformers", "model", "tree", "turn", "decode breaks host ms",
                     "decode forward host ms", "decode forward device ms",
                     "pure-decode step ms", "tokens/s (rounds)"], rows),  # fmt: skip
        ratio_table=table(["transformers", "model", "layers", "breaks host, now / before",
                           "µs less per break", "device forward, now / before",
                           "pure-decode step, now / before", "tokens/s, now / before"],
                          ratio_rows),  # fmt: skip
        break_ratio=span(ratios["break"], 2),
        per_layer=span(ratios["us"], 0),
        step_ratio=span(ratios["step"], 2),
        device_ratio=span(ratios["device"], 2),
        rate_ratio=span(ratios["rate"], 2),
    )
