"""The tensor-parallel section of docs/performance.md (from ``benchmarks/bench_tp.py``).

Used by ``benchmarks/report.py`` when ``docs/results/h200x2-tp.json`` exists (and, beside
it, the run with ``NCCL_GRAPH_MIXING_SUPPORT=0``)::

    bash scripts/tp_check.sh              # on 2 GPUs: tp.json and tp-no-mixing.json
    python -m benchmarks.report           # the page and img/tp.png

Tables and numbers come from here, the prose from ``performance.md.in`` (``tp.*``).
"""

from __future__ import annotations

import os

from . import targets as T
from .template import bullets, fill, num, pct, table

FILE = "h200x2-tp.json"
NO_MIXING_FILE = "h200x2-tp-no-mixing.json"
_COLUMNS = [
    ("tp_eager", "TP=2 eager"),
    ("tp_full_graph", "TP=2 whole graph"),
    ("tp_breakgraph", "TP=2 breakgraph"),
    ("tp_bg_eager_ar", "TP=2 breakgraph, break at all-reduce"),
    ("tp1_breakgraph", "TP=1 breakgraph"),
]


SINGLE = 1  # TP=1: the comparison on one GPU ...
SINGLE_RANK = 0  # ... run by this rank alone, after the TP runs
MIXING_NOISE = 0.03  # with graph mixing off, a ratio within this of 1 is run-to-run noise


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def tp_section(data: dict, no_mixing: dict | None = None) -> list:
    """Latency table, ratios with their per-round spread, targets and where TP loses; the
    prose is in ``performance.md.in`` (``tp.*``)."""
    meta, settings = data["meta"], data["settings"]
    c = settings["config"]
    world = meta["world_size"]
    lines = [
        fill(
            "tp.intro",
            world=world,
            device=meta["device"],
            torch=meta["torch"],
            transformers=meta["transformers"],
            nccl=meta["nccl"],
            mixing=meta["nccl_graph_mixing_support"],
            date=meta["date"],
            layers=c["num_hidden_layers"],
            hidden=c["hidden_size"],
            heads=c["num_attention_heads"],
            kv_heads=c["num_key_value_heads"],
            vocab=c["vocab_size"],
            dtype=settings["dtype"],
            buckets=settings["buckets"],
            rounds=settings["rounds"],
            turns=settings["iters_per_round"],
            single=SINGLE,
            rank=SINGLE_RANK,
            prompts=settings["max_prompts"],  # the batch fills max_prompts
            shortest=settings["batch_lengths_range"][0],
            longest=settings["batch_lengths_range"][1],
            table=_table(data["summary"]["table"]),
            targets=bullets(_targets(data["summary"]["table"], world)),
        ),
        "",
        _capture(data),
    ]
    if no_mixing is not None:
        lines += ["", _mixing_line(data, no_mixing)]
    lines += ["", fill("tp.losses", items=bullets(_losses(data)))]
    return lines


def _table(rows: list) -> str:
    header = (
        ["workload"]
        + [label for _, label in _COLUMNS]
        + ["breakgraph / whole graph (per round)", "eager / breakgraph", "TP=1 / TP=2"]
    )
    cells = []
    for e in rows:
        ms = e["ms"]
        spread = e.get("bg_over_full_rounds")
        ratio = (
            f"{e['bg_over_full']:.3f} ({spread[0]:.2f}-{spread[1]:.2f})"
            if "bg_over_full" in e
            else "-"
        )
        cells.append(
            [e["workload"]]
            + [f"{ms[key]:.2f} ms" if key in ms else "-" for key, _ in _COLUMNS]
            + [ratio, f"{e['eager_over_bg']:.1f}x", f"{e['tp1_over_tp2_bg']:.2f}x"]
        )
    return table(header, cells)


def _targets(rows: list, world: int) -> list:
    """TP=2 breakgraph with captured collectives against each target, workload by workload."""
    out = []
    for e in rows:
        tokens, single = e["tokens"], e["workload"].endswith(" tokens")
        if "bg_over_full" in e and tokens >= T.TP_FROM_TOKENS:
            limit = T.TARGET_TP_BG_VS_WHOLE_GRAPH
            ratio = e["bg_over_full"]
            out.append(_target("whole_graph", e, num(ratio, 3), limit, ratio <= limit))
        if single and tokens <= T.TP_EAGER_MAX_TOKENS:
            limit = T.TARGET_TP_EAGER_OVER_BG
            ratio = e["eager_over_bg"]
            out.append(_target("eager", e, num(ratio, 1), limit, ratio >= limit))
        if tokens >= T.TP_SCALING_FROM_TOKENS:
            limit = T.TARGET_TP2_OVER_TP1
            ratio = e["tp1_over_tp2_bg"]
            out.append(
                _target("tp1", e, num(ratio), limit, ratio > limit, world=world, single=SINGLE)
            )
    return out


def _target(kind: str, e: dict, ratio: str, limit: float, met: bool, **more) -> str:
    """One target's line (fragment ``tp.target.<kind>``) for workload ``e``."""
    return fill(
        f"tp.target.{kind}",
        workload=e["workload"],
        ratio=ratio,
        limit=f"{limit:g}",
        verdict=_verdict(met),
        **more,
    )


def _capture(data: dict) -> str:
    """Capture times, the per-call agreement and the logits against TP eager."""
    meta, tp = data["meta"], data["tp"]
    worst = {}
    for per_variant in tp["correctness_vs_tp_eager"].values():
        for variant, numbers in per_variant.items():
            diff, agree = worst.get(variant, (0.0, 1.0))
            worst[variant] = (
                max(diff, numbers["max_abs_diff"]),
                min(agree, numbers["argmax_agree"]),
            )
    nccl = tp.get("agreement_nccl_us")
    return fill(
        "tp.capture",
        capture=", ".join(f"{k} {v:.1f} s" for k, v in tp["capture_s"].items()),
        single=SINGLE,
        tp1=num(data["tp1"]["capture_s"], 1),
        words=2 + meta["world_size"] + 1,
        median=num(tp["agreement_us"]["median"], 0),
        p90=num(tp["agreement_us"]["p90"], 0),
        nccl="" if nccl is None else fill("tp.capture.nccl", median=num(nccl["median"], 0)),
        worst="; ".join(
            fill("tp.logits", variant=variant, diff=f"{diff:.3g}", agree=pct(agree))
            for variant, (diff, agree) in worst.items()
        ),
        gap=fill("tp.gap.identical" if len(set(worst.values())) == 1 else "tp.gap.differs"),
        layers=data["settings"]["config"]["num_hidden_layers"],
    )


def _mixing_line(data: dict, other: dict) -> str:
    """The same benchmark with NCCL_GRAPH_MIXING_SUPPORT=0 (another run)."""
    mine = {e["workload"]: e["ms"]["tp_breakgraph"] for e in data["summary"]["table"]}
    theirs = {e["workload"]: e["ms"]["tp_breakgraph"] for e in other["summary"]["table"]}
    ratios = [theirs[w] / mine[w] for w in mine if w in theirs]
    low, high = min(ratios), max(ratios)
    same = 1 - MIXING_NOISE <= low and high <= 1 + MIXING_NOISE
    return fill(
        "tp.mixing",
        file=NO_MIXING_FILE,
        world=data["meta"]["world_size"],
        low=num(low, 3),
        high=num(high, 3),
        verdict=(
            fill("tp.mixing.same", noise=pct(MIXING_NOISE))
            if same
            else fill("tp.mixing.differs")
        ),
    )


def _losses(data: dict) -> list:
    """Where TP=2 breakgraph loses, computed from the table."""
    rows = data["summary"]["table"]
    out = []
    small = [  # single prompts below the size where a second GPU pays
        e
        for e in rows
        if e["tokens"] < T.TP_SCALING_FROM_TOKENS and e["workload"].endswith(" tokens")
    ]
    if small:
        out.append(
            fill(
                "tp.loss.short",
                gains=", ".join(
                    fill("tp.loss.short.gain", ratio=num(e["tp1_over_tp2_bg"]), tokens=e["tokens"])
                    for e in small
                ),
                single=SINGLE,
                all_reduces=2 * data["settings"]["config"]["num_hidden_layers"],
            )
        )
    with_ar = sorted((e for e in rows if "eager_ar_over_bg" in e), key=lambda e: e["tokens"])
    if with_ar:
        first, rest = with_ar[0], [e["eager_ar_over_bg"] for e in with_ar[1:]]
        out.append(
            fill(
                "tp.loss.all_reduce",
                ratio=num(first["eager_ar_over_bg"]),
                tokens=first["tokens"],
                larger=(
                    fill("tp.loss.all_reduce.larger", low=num(min(rest)), high=num(max(rest)))
                    if rest
                    else ""
                ),
            )
        )
    over = [e for e in rows if e.get("bg_over_full", 0) > 1]
    if over:
        worst = max(over, key=lambda e: e["bg_over_full"])
        out.append(
            fill(
                "tp.loss.whole_graph",
                percent=num(100 * (worst["bg_over_full"] - 1), 1),
                workload=worst["workload"],
            )
        )
    return out


def write_tp_plot(data: dict, plt, save: dict, img: str) -> str:
    """Latency per workload and variant (log scale)."""
    table = data["summary"]["table"]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    width = 0.16
    for k, (key, label) in enumerate(_COLUMNS):
        values = [e["ms"].get(key, 0) for e in table]
        if any(values):
            ax.bar([i + (k - 2) * width for i in range(len(table))], values, width, label=label)
    ax.set_yscale("log")
    ax.set_ylabel("ms per prefill (log)")
    ax.set_xticks(
        list(range(len(table))), [e["workload"].replace(" (", "\n(") for e in table], fontsize=7
    )
    ax.set_title(f"tensor parallelism, 8B-Llama shape, {data['meta']['device']} x2", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    path = os.path.join(img, "tp.png")
    fig.savefig(path, **save)
    plt.close(fig)
    return path
