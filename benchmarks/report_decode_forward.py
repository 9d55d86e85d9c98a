"""The page's section on breakgraph's forward of a served pure-decode CB step, part by part on
the host (``benchmarks/decode_forward_probe.py``): the tree before the staging cut and this
one, one process each, taking turns.

Why a module of its own: the host of the GPU machine drifts between processes by more than the
change, so the section compares each part with the parts neither tree changed, measured in the
same process, rather than across processes.

Example (the committed runs)::

    python -m benchmarks.report   # the whole page, this section included
"""

from __future__ import annotations

import statistics

from .decode_forward_probe import PARTS
from .template import fill, num, pct, span, table

#: ``decode_forward_probe --passes 2`` of the tree before (``0172197``: two staging copies and
#: a zeroed tail every step) and this one (one copy where ids and positions are rows of one
#: tensor, a tail zeroed only where the step shrank), in turn: (file, tree, release, turn)
FILES = tuple(
    (f"h200-decode-forward-{tree}-{release}-{turn}.json", tree, release, turn)
    for release, turns in (("5.17", (1, 2)), ("5.24", (1,)))
    for turn in turns
    for tree in ("before", "now")
)
#: the order the processes ran in, per release (the JSON says the date only)
RUN_ORDER = {"5.17": ("now", "before", "before", "now"), "5.24": ("before", "now")}
#: the first runs, whose second tree also gathered the key offsets in one operation (reverted:
#: that part did not fall): (file, tree, release, turn)
GATHER_FILES = tuple(
    (f"h200-decode-forward-{'gather-before' if tree == 'before' else 'gather'}-{release}-{turn}"
     ".json", tree, release, turn)
    for release, turns in (("5.17", (1, 2, 3, 4)), ("5.24", (1,)))
    for turn in turns
    for tree in ("before", "gather")
)  # fmt: skip
#: the forward's parts neither tree changed: the yardstick of each process's host speed
UNTOUCHED = ("decode replay", "logits", "decode other", "fp32 copy", "output")


def _parts(data: dict) -> dict:
    """Per model: the medians (µs) the section reads, and the parts over the untouched ones."""
    out = {}
    for model, v in data["models"].items():
        medians = v["median_us"]
        untouched = sum(medians[p] for p in UNTOUCHED)
        out[model] = {
            "staging": medians["staging"], "fill": medians["decode fill"],
            "untouched": untouched, "forward": medians["forward"],
            "staging_rel": medians["staging"] / untouched,
            "fill_rel": medians["decode fill"] / untouched,
            "forward_rel": medians["forward"] / untouched,
            "steps": [s for s in v["decode_step_ms"] if s is not None],
            "forwards": v["decode_graph_forwards"], "requests": v["requests_median"],
        }  # fmt: skip
    return out


def section(runs: list, gather_runs: list = ()) -> str:
    """``runs``: ``(data, tree, release, turn)`` of :data:`FILES`; ``gather_runs`` likewise of
    :data:`GATHER_FILES`."""
    rows, rel = [], {}
    for data, tree, release, turn in runs:
        for model, p in _parts(data).items():
            rows.append([release, model, tree, turn, num(p["staging"], 1), num(p["fill"], 1),
                         num(p["untouched"], 1), num(p["forward"], 1), num(p["staging_rel"]),
                         num(p["forward_rel"]),
                         ", ".join(num(s) for s in p["steps"])])  # fmt: skip
            for key in ("staging_rel", "forward_rel", "fill_rel"):
                rel.setdefault((key, release, tree), []).append(p[key])
            rel.setdefault(("steps", release, model), []).extend(p["steps"])
    header = ["transformers", "model", "tree", "turn", "staging µs", "decode fill µs",
              "untouched µs", "forward µs", "staging / untouched", "forward / untouched",
              "pure-decode step ms (passes)"]  # fmt: skip
    releases = list(dict.fromkeys(release for _, _, release, _ in runs))
    first = runs[0][0]
    compare = lambda key: "; ".join(  # noqa: E731
        f"{span(rel[(key, r, 'before')])} → {span(rel[(key, r, 'now')])} on {r}"
        for r in releases
    )
    steps = "; ".join(
        f"{model} on {release}: {span(values)} ms"
        for (key, release, model), values in rel.items()
        if key == "steps"
    )
    gather = {}
    for data, tree, _, _ in gather_runs:
        for p in _parts(data).values():
            gather.setdefault(("fill_rel", tree), []).append(p["fill_rel"])
            gather.setdefault(("staging_rel", tree), []).append(p["staging_rel"])
    both = {("fill_rel", "before"), ("fill_rel", "gather")} <= gather.keys()
    said = lambda key: (  # noqa: E731
        f"{span(gather[(key, 'before')])} before, {span(gather[(key, 'gather')])} after"
        if both else "-"
    )  # fmt: skip
    one = next(iter(_parts(first).values()))
    output_share = [data["models"][m]["median_us"]["output"] / p["forward"]
                    for data, tree, *_ in runs if tree == "now"
                    for m, p in _parts(data).items()]  # fmt: skip
    saved = lambda key: pct(1 - statistics.median(  # noqa: E731
        v for (k, _, tree), values in rel.items() if k == key and tree == "now" for v in values
    ) / statistics.median(
        v for (k, _, tree), values in rel.items() if k == key and tree == "before" for v in values
    ))  # fmt: skip
    order = "; ".join(f"on {r}: " + ", ".join(RUN_ORDER[r]) for r in releases)
    return fill(
        "cb.forward_parts",
        files=", ".join(f"`{name}`" for name, _, _, _ in FILES),
        gather_files=", ".join(f"`{name}`" for name, _, _, _ in GATHER_FILES),
        device=first["meta"].get("gpu", "?"),
        torch=first["meta"].get("torch", "?"),
        date=first["meta"].get("date", "?"),
        prompts=first["settings"]["prompts"],
        lengths="–".join(str(n) for n in first["settings"]["prompt_lengths"]),
        order=order,
        staging_saved=saved("staging_rel"),
        forward_saved=saved("forward_rel"),
        output_share=f"{pct(min(output_share))}–{pct(max(output_share))}",
        new_tokens=first["settings"]["new_tokens"],
        passes=first["settings"]["passes"],
        min_requests=first["settings"]["min_requests"],
        forwards=one["forwards"],
        requests=num(statistics.median(p["requests"] for d, *_ in runs
                                       for p in _parts(d).values()), 0),  # fmt: skip
        table=table(header, rows),
        staging=compare("staging_rel"),
        forward=compare("forward_rel"),
        fill_now=compare("fill_rel"),
        gathered=said("fill_rel"),
        gathered_staging=said("staging_rel"),
        forward_us=span([p["forward"] for d, tree, *_ in runs if tree == "now"
                         for p in _parts(d).values()], 0),  # fmt: skip
        steps=steps,
    )


# -- session 29: the output part split, the stream order, the key-offset gather ----------------
#: ``decode_forward_probe`` (which also times single operations) in turn, per change:
#: ``order``: 73533b7 (an event waited on and recorded every step) against ``StepOrder``;
#: ``fill``: 73533b7 against ``StepOrder``, the key offsets gathered in one operation and the
#: views made once; ``gather-views``: two copies against the gather, both with the views made
#: once. (file, change, tree, release, turn)
SPLIT_FILES = tuple(
    (f"h200-decode-forward-{change}-{tree}-{release}-{turn}.json", change, tree, release, turn)
    for change, trees, runs in (
        ("order", ("before", "now"), (("5.17", 1), ("5.17", 2), ("5.24", 1))),
        ("fill", ("before", "now"), (("5.17", 1), ("5.17", 2), ("5.24", 1))),
        ("gather-views", ("copies", "gather"), (("5.17", 1), ("5.17", 2))),
    )
    for release, turn in runs
    for tree in trees
)  # fmt: skip
#: the order the processes ran in, per change and release
SPLIT_ORDER = {("order", "5.17"): "now, before, before, now", ("order", "5.24"): "before, now",
               ("fill", "5.17"): "now, before, before, now", ("fill", "5.24"): "before, now",
               ("gather-views", "5.17"): "gather, copies, copies, gather"}  # fmt: skip
#: the forward's parts none of these changes touched: each process's yardstick
STILL = ("refill", "decide", "decode replay", "decode other", "logits", "fp32 copy",
         "output object", "output")  # fmt: skip
#: ``bench_cb --models llama3-8b-4l --prompts 32`` (both decoders, 3 rounds): 73533b7 and this
#: tree in turn (5.24, then 5.17), then this tree twice more on each: (file, tree, release, turn)
FLOOR_AGAIN_FILES = (
    *((f"h200-cb-floor-32-turns-{tree}-{release}.json", tree, release, 1)
      for release in ("5.24", "5.17") for tree in ("before", "now")),
    *((f"h200-cb-floor-32-now-{release}-{turn}.json", "now", release, turn + 1)
      for release in ("5.24", "5.17") for turn in (1, 2)),
)  # fmt: skip


def _still(medians: dict) -> float:
    return sum(medians[p] for p in STILL)


#: single operations the page leaves out: an early probe compared a stream with an event there
#: (a type check, not what ``StepOrder`` does)
OPS_LEFT_OUT = ("stream comparison",)
#: the single operations that are views, and the small ones that reach the device
VIEW_OPS = ("2-d slice (tokens[:, :n])", "1-d slice (cu_k[:n + 1])")
DEVICE_OPS = ("copy int32 [2, n] into int64", "copy int32 [n, 64] table rows",
              "copy int32 [n + 1], same dtype", "expand and copy (padded tail)", "zero a tail")
#: forward parts that are one single operation each: (part, operation)
ONE_OP_PARTS = (("fp32 copy", "fp32 copy of the logits (Tensor.to)"),
                ("output object", "output object (CausalLMOutputWithPast)"))  # fmt: skip


def split_section(runs: list, floors: list) -> str:
    """``runs``: ``(data, change, tree, release, turn)`` of :data:`SPLIT_FILES`; ``floors``:
    ``(data, tree, release, turn)`` of :data:`FLOOR_AGAIN_FILES`."""
    from .report_decode_step import _floor_ms

    rows, rel, ops, share, steps, kept, raw, ratios = [], {}, {}, {}, {}, {}, {}, {}
    for data, change, tree, release, turn in runs:
        timed = data.get("operations_us", {})
        for name, us in timed.items():
            if name not in OPS_LEFT_OUT:
                ops.setdefault(name, []).append(us)
        for model, v in data["models"].items():
            m = v["median_us"]
            still = _still(m)
            rows.append([change, release, model, tree, turn, num(m["stream order"], 1),
                         num(m["staging"], 1), num(m["decode fill"], 1), num(still, 1),
                         num(m["forward"], 1), num(m["forward"] / still)])  # fmt: skip
            for part in ("stream order", "staging", "decode fill", "forward"):
                rel.setdefault((change, tree, part), []).append(m[part] / still)
            raw.setdefault((change, tree), []).append(m["forward"])
            for part, op in ONE_OP_PARTS:
                if op in timed:
                    ratios.setdefault(part, []).append(m[part] / timed[op])
            if change != "gather-views":
                steps.setdefault((model, tree), []).extend(x for x in v["decode_step_ms"] if x)
            if (change, tree) in (("fill", "now"), ("gather-views", "gather")):
                for part in PARTS:
                    share.setdefault(part, []).append(m[part] / m["forward"])
    header = ["change", "transformers", "model", "tree", "turn", "stream order µs", "staging µs",
              "decode fill µs", "still µs", "forward µs", "forward / still"]  # fmt: skip
    median = statistics.median
    op_rows = [[name, num(median(values), 1), span(values, 1), len(values)]
               for name, values in ops.items()]  # fmt: skip
    both = lambda change, a, b, part: (  # noqa: E731
        f"{span(rel[(change, a, part)])} → {span(rel[(change, b, part)])}")
    median_ratio = lambda change, a, b, part: pct(1 - median(  # noqa: E731
        rel[(change, b, part)]) / median(rel[(change, a, part)]))
    order_points = 100 * (median(rel[("order", "before", "stream order")])
                          - median(rel[("order", "now", "stream order")])) / median(
        rel[("order", "before", "forward")])  # fmt: skip
    shares = sorted(((median(v), part) for part, v in share.items()), reverse=True)
    gather = median(ops["gather int32 [bucket + 1] (index_select, out=)"]) / (
        median(ops["copy int32 [n + 1], same dtype"])
        + median(ops["expand and copy (padded tail)"]))  # fmt: skip
    floor_rows, met, prep_met, prep_missed = [], [], [], []
    for data, tree, release, turn in floors:
        m = data["models"][0]
        for variant, label in (("breakgraph", "default"), ("breakgraph_compiled", "compiled")):
            v = m["variants"][variant]
            floor = _floor_ms(data, v)
            over = v["decode_step_ms"] / floor
            floor_rows.append([release, tree, turn, label,
                               f"{num(v['decode_step_ms'])} ({num(over)}×)",
                               num(v["decode_prepare_ms"]), num(v["decode_forward_host_ms"]),
                               num(v["decode_forward_device_ms"])])  # fmt: skip
            for what, key in (("step", "decode_step_ms"), ("device", "decode_forward_device_ms"),
                              ("prep", "decode_prepare_ms")):  # fmt: skip
                kept.setdefault((label, tree, what), []).append(v[key])
                kept.setdefault((label, tree, what, release), []).append(v[key])
            if over <= 2.0:
                met.append(f"{label} on {release} ({tree}, {num(over)}×)")
            if label == "compiled":
                (prep_met if over <= 2.0 else prep_missed).append(v["decode_prepare_ms"])
    releases = sorted({release for _, _, release, _ in floors})
    def slower(label: str, what: str = "step") -> str:
        """How many of this tree's processes took longer (``what``: the step, or ``prep``:
        transformers' scheduling) than the tree before's, on the same release."""
        pairs = [(now, min(kept[(label, "before", what, r)]))
                 for r in releases for now in kept[(label, "now", what, r)]]  # fmt: skip
        return f"{sum(now > before for now, before in pairs)} of {len(pairs)} processes"

    models = sorted({model for model, _ in steps})
    first = runs[0][0]
    return fill(
        "cb.forward_split",
        files=", ".join(f"`{name}`" for name, *_ in SPLIT_FILES),
        floor_files=", ".join(f"`{name}`" for name, *_ in FLOOR_AGAIN_FILES),
        device=first["meta"].get("gpu", "?"), torch=first["meta"].get("torch", "?"),
        date=first["meta"].get("date", "?"),
        order="; ".join(f"{change} on {release}: {turns}"
                        for (change, release), turns in SPLIT_ORDER.items()),
        ops=table(["operation", "µs (median)", "processes' medians", "processes"], op_rows),
        processes=max(len(values) for values in ops.values()),
        view_us=span([median(ops[name]) for name in VIEW_OPS], 1),
        device_us=span([median(ops[name]) for name in DEVICE_OPS], 1),
        fp32_ratio=span(ratios["fp32 copy"], 1),
        output_ratio=span(ratios["output object"], 1),
        table=table(header, rows),
        order_stream=both("order", "before", "now", "stream order"),
        order_saved=median_ratio("order", "before", "now", "stream order"),
        order_forward=both("order", "before", "now", "forward"),
        order_forward_saved=median_ratio("order", "before", "now", "forward"),
        order_points=num(order_points, 1),
        order_forward_us=span(raw[("order", "before")], 0),
        order_forward_now_us=span(raw[("order", "now")], 0),
        fill_staging=both("fill", "before", "now", "staging"),
        fill_fill=both("fill", "before", "now", "decode fill"),
        fill_forward=both("fill", "before", "now", "forward"),
        fill_forward_saved=median_ratio("fill", "before", "now", "forward"),
        gather_fill=both("gather-views", "copies", "gather", "decode fill"),
        gather_saved=median_ratio("gather-views", "copies", "gather", "decode fill"),
        gather_processes=len(rel[("gather-views", "gather", "decode fill")]),
        gather_share=pct(gather),
        shares=", ".join(f"{part} {pct(share)}" for share, part in shares),
        floor_table=table(["transformers", "tree", "process", "decoder", "step ms (× floor)",
                           "scheduling ms", "bg forward host ms", "device ms"],
                          floor_rows),  # fmt: skip
        met="; ".join(met) or "none",
        met_count=len(met),
        floor_runs=len(floor_rows),
        prep_met=span(prep_met) if prep_met else "-",
        prep_missed=span(prep_missed) if prep_missed else "-",
        default_slower=slower("default"),
        compiled_slower=slower("compiled"),
        default_step=both_floor(kept, "default", "step"),
        default_device=both_floor(kept, "default", "device"),
        compiled_step=both_floor(kept, "compiled", "step"),
        compiled_device=both_floor(kept, "compiled", "device"),
        prep_default=slower("default", "prep"),
        prep_compiled=slower("compiled", "prep"),
        probe_requests=num(median(v["requests_median"] for d, *_ in runs
                                  for v in d["models"].values()), 0),  # fmt: skip
        probe_steps="; ".join(
            f"{model} {num(median(steps[(model, 'before')]))} → "
            f"{num(median(steps[(model, 'now')]))} ms" for model in models),
    )


def both_floor(kept: dict, label: str, what: str) -> str:
    """``before → now`` spans of a decoder's step or device span over the floor runs."""
    return f"{span(kept[(label, 'before', what)])} → {span(kept[(label, 'now', what)])} ms"


#: the floor runs of :func:`split_section` again, a later session: 73533b7 (``.device/before``,
#: *before*) and this tree (*now*), one process each, two turns per call and release:
#: (file, call, release, turn, tree), in the order the processes ran. Call *a* ran both turns
#: now-first; call *b* ran the second turn before-first (ABBA), on 5.17, then on 5.24.
FLOOR_RERUN_FILES = (
    *((f"h200-cb-floor-32-rerun-a-{tree}-{turn}-5.17.json", "a", "5.17", turn, tree)
      for turn in (1, 2) for tree in ("now", "before")),
    *((f"h200-cb-floor-32-rerun-b-{tree}-{turn}-{release}.json", "b", release, turn, tree)
      for release in ("5.17", "5.24")
      for turn, order in ((1, ("now", "before")), (2, ("before", "now")))
      for tree in order),
)  # fmt: skip
#: the parts compared pair by pair: (what the page calls it, the bench_cb key)
RERUN_PARTS = (("step", "decode_step_ms"), ("scheduling", "decode_prepare_ms"),
               ("bg forward host", "decode_forward_host_ms"),
               ("device", "decode_forward_device_ms"))  # fmt: skip


def direction(slower: int, pairs: int) -> str:
    """What ``slower`` of ``pairs`` paired processes say about a difference: a direction only
    where every pair agrees.

    Example::

        >>> direction(3, 6)
        'no consistent direction'
        >>> direction(6, 6), direction(0, 6)
        ('this tree slower in every pair', 'this tree faster in every pair')
    """
    if slower == pairs:
        return "this tree slower in every pair"
    if slower == 0:
        return "this tree faster in every pair"
    return "no consistent direction"


#: how far from 1 the median now / before of the default step may be for the re-runs to call
#: the runs above the host's (session 29's processes of this tree: 1.31-1.46x the tree before)
RERUN_TOLERANCE = 0.05


def rerun_verdict(now: list, before: list) -> str:
    """What the re-runs say of the default decoder's step, pair by pair (``now[i]`` against
    ``before[i]``): the tree is not ruled out where every pair is slower; the runs above were
    the host's only where the pairs split and their median ratio is within
    :data:`RERUN_TOLERANCE` of one; otherwise inconclusive.

    Example::

        >>> rerun_verdict([1.0, 2.0], [1.1, 1.9]).startswith("The default decoder's step was")
        True
        >>> rerun_verdict([1.3, 1.3, 1.0], [1.0, 1.0, 1.1]).startswith("Inconclusive")
        True
    """
    slower = sum(a > b for a, b in zip(now, before))
    ratio = statistics.median(a / b for a, b in zip(now, before))
    reading = direction(slower, len(now))
    if slower == len(now):
        return (f"The default decoder's step: {reading}, as in the runs above: the tree is not "
                "ruled out.")  # fmt: skip
    if slower == 0:
        return f"The default decoder's step: {reading}, so no sign that the tree slowed it."
    if abs(ratio - 1) <= RERUN_TOLERANCE:
        return (f"The default decoder's step was longer in this tree in {slower} of "
                f"{len(now)} pairs and shorter in the others, the median ratio "
                f"{num(ratio)}, so the slower default steps of the runs above (every process "
                "of this tree slower than the one of the tree before) were the host's, not the "
                "tree's.")  # fmt: skip
    return (f"Inconclusive: the default decoder's step was longer in this tree in {slower} of "
            f"{len(now)} pairs, but the median ratio is {num(ratio)}.")  # fmt: skip


def floor_rerun_section(runs: list) -> str:
    """``runs``: ``(data, call, release, turn, tree)`` of :data:`FLOOR_RERUN_FILES`, in the
    order they ran. Pairs the two trees' processes of each turn and counts, per decoder and
    part, where this tree took longer."""
    from .report_decode_step import _floor_ms

    rows, met, values, first_slower = [], [], {}, 0
    turns = {}
    for data, call, release, turn, tree in runs:
        turns.setdefault((call, release, turn), []).append((tree, data))
    for (call, release, turn), pair in turns.items():
        assert [tree for tree, _ in pair] in (["now", "before"], ["before", "now"]), pair
        steps = []
        for place, (tree, data) in enumerate(pair):
            m = data["models"][0]
            for variant, label in (("breakgraph", "default"),
                                   ("breakgraph_compiled", "compiled")):  # fmt: skip
                v = m["variants"][variant]
                over = v["decode_step_ms"] / _floor_ms(data, v)
                rows.append([call, release, turn, ("first", "second")[place], tree, label,
                             f"{num(v['decode_step_ms'])} ({num(over)}×)",
                             *(num(v[key]) for _, key in RERUN_PARTS[1:])])  # fmt: skip
                for part, key in RERUN_PARTS:
                    values.setdefault((label, part), {}).setdefault(tree, []).append(v[key])
                if over <= 2.0:
                    met.append(f"{label} on {release} ({tree}, {num(over)}×)")
                steps.append(v["decode_step_ms"])
        # the process that ran first against the second, both decoders' steps
        first_slower += sum(a > b for a, b in zip(steps[:2], steps[2:]))
    median = statistics.median
    lines = []
    for label in ("default", "compiled"):
        for part, _ in RERUN_PARTS:
            now, before = (values[(label, part)][t] for t in ("now", "before"))
            slower = sum(a > b for a, b in zip(now, before))
            ratios = [a / b for a, b in zip(now, before)]
            lines.append([label, part, f"{slower} of {len(now)}", num(median(ratios)),
                          span(ratios), direction(slower, len(now))])  # fmt: skip
    pairs = len(turns)
    first = runs[0][0]
    verdict = rerun_verdict(values[("default", "step")]["now"],
                            values[("default", "step")]["before"])  # fmt: skip
    return fill(
        "cb.floor_rerun",
        files=", ".join(f"`{name}`" for name, *_ in FLOOR_RERUN_FILES),
        device=first["meta"].get("gpu", "?"), torch=first["meta"].get("torch", "?"),
        date=first["meta"].get("date", "?"),
        processes=len(runs), pairs=pairs,
        table=table(["call", "transformers", "turn", "ran", "tree", "decoder",
                     "step ms (× floor)", "scheduling ms", "bg forward host ms", "device ms"],
                    rows),  # fmt: skip
        pairs_table=table(["decoder", "part", "this tree longer", "now / before (median)",
                           "now / before (pairs)", "reading"], lines),  # fmt: skip
        first_slower=f"{first_slower} of {2 * pairs}",
        met_count=len(met), rows=len(rows), met="; ".join(met) or "none", verdict=verdict,
        default_step=span(values[("default", "step")]["now"]
                          + values[("default", "step")]["before"]),
        compiled_step=span(values[("compiled", "step")]["now"]
                           + values[("compiled", "step")]["before"]),
        scheduling=span(values[("default", "scheduling")]["now"]
                        + values[("default", "scheduling")]["before"]
                        + values[("compiled", "scheduling")]["now"]
                        + values[("compiled", "scheduling")]["before"]),
    )
