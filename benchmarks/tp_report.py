"""The tensor-parallel section of docs/performance.md (from ``benchmarks/bench_tp.py``).

Used by ``benchmarks/report.py`` when ``docs/results/h200x2-tp.json`` exists (and, beside
it, the run with ``NCCL_GRAPH_MIXING_SUPPORT=0``)::

    bash scripts/tp_check.sh              # on 2 GPUs: tp.json and tp-no-mixing.json
    python -m benchmarks.report           # the page and img/tp.png
"""

from __future__ import annotations

import os

from . import targets as T

FILE = "h200x2-tp.json"
NO_MIXING_FILE = "h200x2-tp-no-mixing.json"
_COLUMNS = [
    ("tp_eager", "TP=2 eager"),
    ("tp_full_graph", "TP=2 whole graph"),
    ("tp_breakgraph", "TP=2 breakgraph"),
    ("tp_bg_eager_ar", "TP=2 breakgraph, break at all-reduce"),
    ("tp1_breakgraph", "TP=1 breakgraph"),
]


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def tp_section(data: dict, no_mixing: dict | None = None) -> list:
    """Latency table, ratios with their per-round spread, targets and where TP loses."""
    meta, settings, tp = data["meta"], data["settings"], data["tp"]
    c = settings["config"]
    lines = [
        "## Tensor parallelism (2 GPUs, prefill)",
        "",
        f"`benchmarks/bench_tp.py` under `torchrun --nproc-per-node 2` ({meta['device']} x"
        f"{meta['world_size']}, torch {meta['torch']}, transformers {meta['transformers']}, NCCL "
        f"{meta['nccl']}, NCCL_GRAPH_MIXING_SUPPORT {meta['nccl_graph_mixing_support']}, "
        f"{meta['date']}): an 8B-Llama shape ({c['num_hidden_layers']} layers, hidden "
        f"{c['hidden_size']}, {c['num_attention_heads']}/{c['num_key_value_heads']} heads, "
        f"vocab {c['vocab_size']}), {settings['dtype']}, random weights, sharded by transformers "
        f"(`DistributedConfig(tp_size=2)`). Buckets {settings['buckets']}; medians over "
        f"{settings['rounds']} rounds of {settings['iters_per_round']} turns, the TP=2 variants "
        "taking turns call by call; *per round* is the lowest and highest ratio of round "
        "medians. TP=1 runs afterwards on rank 0 alone (another random model of the same "
        "shape; latencies compare, logits do not). The batch is 16 prompts of "
        f"{settings['batch_lengths_range'][0]}-{settings['batch_lengths_range'][1]} tokens "
        "(TP eager runs it one prompt at a time).",
        "",
        "| workload | " + " | ".join(label for _, label in _COLUMNS) + " | breakgraph / whole "
        "graph (per round) | eager / breakgraph | TP=1 / TP=2 |",
        "|---|" + "---|" * (len(_COLUMNS) + 3),
    ]
    for e in data["summary"]["table"]:
        ms = e["ms"]
        cells = [f"{ms[key]:.2f} ms" if key in ms else "-" for key, _ in _COLUMNS]
        spread = e.get("bg_over_full_rounds")
        ratio = (
            f"{e['bg_over_full']:.3f} ({spread[0]:.2f}-{spread[1]:.2f})"
            if "bg_over_full" in e
            else "-"
        )
        lines.append(
            f"| {e['workload']} | " + " | ".join(cells) + f" | {ratio} | "
            f"{e['eager_over_bg']:.1f}x | {e['tp1_over_tp2_bg']:.2f}x |"
        )
    lines += ["", "Targets (TP=2 breakgraph with the collectives captured):", ""]
    for e in data["summary"]["table"]:
        tokens, single = e["tokens"], e["workload"].endswith(" tokens")
        if "bg_over_full" in e and tokens >= T.TP_FROM_TOKENS:
            ok = e["bg_over_full"] <= T.TARGET_TP_BG_VS_WHOLE_GRAPH
            lines.append(
                f"- {e['workload']}: {e['bg_over_full']:.3f}x the whole graph (target <= "
                f"{T.TARGET_TP_BG_VS_WHOLE_GRAPH:g}x: {_verdict(ok)})"
            )
        if single and tokens <= T.TP_EAGER_MAX_TOKENS:
            ok = e["eager_over_bg"] >= T.TARGET_TP_EAGER_OVER_BG
            lines.append(
                f"- {e['workload']}: {e['eager_over_bg']:.1f}x faster than TP eager (target >= "
                f"{T.TARGET_TP_EAGER_OVER_BG:g}x: {_verdict(ok)})"
            )
        if tokens >= 512:
            ok = e["tp1_over_tp2_bg"] > 1
            lines.append(
                f"- {e['workload']}: TP=2 {e['tp1_over_tp2_bg']:.2f}x faster than TP=1 "
                f"(target > 1: {_verdict(ok)})"
            )
    worst = {}
    for per_variant in tp["correctness_vs_tp_eager"].values():
        for variant, numbers in per_variant.items():
            diff, agree = worst.get(variant, (0.0, 1.0))
            worst[variant] = (
                max(diff, numbers["max_abs_diff"]),
                min(agree, numbers["argmax_agree"]),
            )
    capture = ", ".join(f"{k} {v:.1f} s" for k, v in tp["capture_s"].items())
    lines += [
        "",
        f"Capture of all buckets: {capture}; TP=1 {data['tp1']['capture_s']:.1f} s. The "
        f"per-call agreement (one gloo all-reduce of {2 + meta['world_size'] + 1} int64) "
        f"took {tp['agreement_us']['median']:.0f} µs (p90 {tp['agreement_us']['p90']:.0f})"
        + (
            f"; the same values through NCCL with a host read would take "
            f"{tp['agreement_nccl_us']['median']:.0f} µs but synchronise the device"
            if "agreement_nccl_us" in tp
            else ""
        )
        + ". Logits against TP eager (HF's sdpa attention), worst over the workloads: "
        + "; ".join(
            f"{variant} max |diff| {diff:.3g}, same argmax {100 * agree:.0f}%"
            for variant, (diff, agree) in worst.items()
        )
        + ". "
        + (
            "The graph variants give identical logits; the gap to eager is"
            if len(set(worst.values())) == 1
            else "The gap to eager comes from"
        )
        + " bf16 attention kernels (FlashAttention varlen against sdpa) over "
        f"{c['num_hidden_layers']} layers of a random model, whose top logits are nearly tied.",
    ]
    if no_mixing is not None:
        lines += ["", _mixing_line(data, no_mixing)]
    lines += ["", *_losses(data)]
    return lines


def _mixing_line(data: dict, other: dict) -> str:
    """The same benchmark with NCCL_GRAPH_MIXING_SUPPORT=0 (another run)."""
    mine = {e["workload"]: e["ms"]["tp_breakgraph"] for e in data["summary"]["table"]}
    theirs = {e["workload"]: e["ms"]["tp_breakgraph"] for e in other["summary"]["table"]}
    ratios = [theirs[w] / mine[w] for w in mine if w in theirs]
    low, high = min(ratios), max(ratios)
    verdict = (
        "within 3%, so no measurable difference at these sizes"
        if 0.97 <= low and high <= 1.03
        else "a difference beyond run-to-run noise"
    )
    return (
        f"With `NCCL_GRAPH_MIXING_SUPPORT=0` (`{NO_MIXING_FILE}`, a separate run, so across "
        f"runs): TP=2 breakgraph took {low:.3f}-{high:.3f}x its time with mixing on, "
        f"{verdict}. The variant that breaks at each all-reduce is refused there (it mixes "
        "eager and captured collectives)."
    )


def _losses(data: dict) -> list:
    """Where TP=2 breakgraph loses, computed from the table."""
    table = data["summary"]["table"]
    out = ["Where it loses:", ""]
    small = [e for e in table if e["tokens"] < 512 and e["workload"].endswith(" tokens")]
    if small:
        gains = ", ".join(f"{e['tp1_over_tp2_bg']:.2f}x at {e['tokens']}" for e in small)
        out.append(
            f"- Short prompts gain little from the second GPU ({gains} over TP=1): the "
            "forward is bound by weight reads and launches, and each of the "
            f"{2 * data['settings']['config']['num_hidden_layers']} all-reduces adds latency."
        )
    with_ar = sorted((e for e in table if "eager_ar_over_bg" in e), key=lambda e: e["tokens"])
    if with_ar:
        first, rest = with_ar[0], [e["eager_ar_over_bg"] for e in with_ar[1:]]
        out.append(
            "- Breaking at each all-reduce (SGLang's piecewise choice; three breaks per layer "
            f"instead of one) takes {first['eager_ar_over_bg']:.2f}x the time of the captured "
            f"collectives at {first['tokens']} tokens"
            + (f" and {min(rest):.2f}-{max(rest):.2f}x on the larger workloads" if rest else "")
            + ". It is the choice only where a collective cannot be captured."
        )
    over = [e for e in table if e.get("bg_over_full", 0) > 1]
    if over:
        worst = max(over, key=lambda e: e["bg_over_full"])
        out.append(
            f"- Against one whole graph the per-layer attention breaks cost up to "
            f"{100 * (worst['bg_over_full'] - 1):.1f}% ({worst['workload']}); the whole graph "
            "needs FlashAttention with upper-bound lengths and one graph per batch shape."
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
