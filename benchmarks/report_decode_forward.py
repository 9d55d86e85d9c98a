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
