"""Continuous batching on shapes the CB bench never picked: gemma-2b (18 layers, heads of
256, one key head), against stock, and the break split rule of session 36 served on it; the
whole Llama-3-8B (32 layers) that the bench's ``llama3-8b-4l`` cuts to four, against stock and
against its pure-decode floor (:func:`whole_model_section`).

The break path's split rule was set on one kernel timed alone (``decode_attention
--threshold-only``); session 36 split heads wider than 128 from fewer keys (2048 at 256), a
case picked on held-out shapes of that sweep only. :func:`break_split_section` reads
``bench_cb`` with decode graphs off (every pure-decode step a break per layer, as
sliding-window models run them), that rule against the rule before it, taking turns in one
process; it lost, and :func:`breakgraph.integrations.transformers.paged_decode.break_split` is
the rule before again.
"""

from __future__ import annotations

import statistics

from . import targets as T
from .cb_report import _cell, _model_block, _release
from .template import bullets, fill, num, pct, span, table

#: ``bench_cb --models gemma-2b`` on the default workload, stock and breakgraph
CB_FILE = "h100-cb-gemma-2b.json"
#: ``bench_cb --models gemma-2b --prompts 16 --min-len 1024 --max-len 3008``, decode graphs off,
#: in turn: the run's ``breakgraph_breaks`` was session 36's rule (:data:`SESSION_36`),
#: ``breakgraph_breaks_keys4096`` the rule before it, which is the rule again since (the
#: variant that reruns session 36's rule is now ``breakgraph_breaks_keys2048``)
BREAK_SPLIT_FILE = "h100-cb-break-split-gemma-2b.json"
SESSION_36, BEFORE = "breakgraph_breaks", "breakgraph_breaks_keys4096"
KEY_DEVICE = "decode_forward_device_ms"  # a pure-decode forward's device span ("-": the CPU)
#: ``gpu_check.sh RUN_HELD_OUT``: ``bench_cb --models llama3-8b`` on the default workload
#: (stock and breakgraph), then with 32 prompts (both decoders and stock's forced graphs), on
#: transformers 5.17.0; then breakgraph's variants alone on 5.24.0 (the same runs, the wheel
#: carried)
WHOLE_FILES = ("h100-cb-llama3-8b.json", "h100-cb-llama3-8b-32.json",
               "h100-cb-llama3-8b-5.24.json", "h100-cb-llama3-8b-32-5.24.json")  # fmt: skip
#: the same two runs on transformers 5.17.0 on an H200, the card issue 23's targets name
WHOLE_H200_FILES = ("h200-cb-llama3-8b.json", "h200-cb-llama3-8b-32.json")
#: ``gpu_check.sh RUN_HELD_OUT_MOE``: ``bench_cb --models qwen3-30b-a3b``, the same two runs
#: (a whole many-expert MoE, which no CB shape is)
WHOLE_MOE_FILES = ("h100-cb-qwen3-30b-a3b.json", "h100-cb-qwen3-30b-a3b-32.json",
                   "h100-cb-qwen3-30b-a3b-5.24.json", "h100-cb-qwen3-30b-a3b-32-5.24.json")
#: ``bench_cb --models qwen2.5-3b``, the same two runs: the whole model ``qwen2.5-3b-12l`` cuts
WHOLE_3B_FILES = ("h100-cb-qwen2.5-3b.json", "h100-cb-qwen2.5-3b-32.json")
#: ``cb_trace --model qwen3-30b-a3b --skip 3 --steps 12``: the default workload's first steps
#: (prefill chunks of 2048 tokens beside the decoding requests), on transformers 5.17.0
MOE_TRACE = "h100-cb-trace-qwen3-30b-a3b-5.17"
MOE_TRACE_SUMMARY = f"{MOE_TRACE}/summary.json"
#: session 51: ``bench_cb --models gemma3-1b`` (then ``gpt-oss-20b-4l``), one process each, its
#: ``breakgraph`` (pure-decode graphs reading sliding-window rings in place) and
#: ``breakgraph_breaks`` (a break per layer, as every sliding-window model ran before) taking
#: turns, beside stock; the card's prefix is the run's (either card, whichever came)
SLIDING_FILES = tuple(f"{card}-cb-sliding-{model}-{release}.json"
                      for model in ("gemma3-1b", "gpt-oss-20b-4l") for release in ("5.17", "5.24")
                      for card in ("h200", "h100"))  # fmt: skip
#: the kernel transformers 5.17's ``grouped_mm`` zeroes expert parallelism's sentinel rows with
MASKED_FILL = "masked_fill"


def held_out_cb_section(data: dict) -> list[str]:
    """gemma-2b served on the CB bench's default workload: the intro, then the model's block
    as the CB tables print theirs (:func:`benchmarks.cb_report._model_block`)."""
    meta, m = data["meta"], data["models"][0]
    return [
        fill("cb.held_out", model=m["model"], shape=m["shape"], file=CB_FILE,
             device=meta["device"], torch=meta["torch"], transformers=meta["transformers"],
             date=meta["date"], hbm=f"{meta['hbm_bytes_per_s'] / 1e12:g}"),  # fmt: skip
        "",
        *_model_block(m["model"], [data]),
    ]


def break_split_section(data: dict) -> str:
    """Session 36's rule against the rule before it, in turn: per variant its tokens/s (median
    and rounds), the pure-decode step, its forward's host time, its breaks' host time and its
    device span; then the per-round ratios. Empty when either variant did not serve."""
    from breakgraph.integrations.transformers import paged_decode as pd

    from .report_cb_decode import RULE_BEFORE_KEYS, WIDE_FROM_HEAD

    m = data["models"][0]
    v = m["variants"]
    wide, before = v.get(SESSION_36, {}), v.get(BEFORE, {})
    if "tokens_per_s" not in wide or "tokens_per_s" not in before:
        return ""
    rows = []
    for name, e in ((BEFORE, before), (SESSION_36, wide)):
        rows.append([
            f"`{name}`", f"{num(e['tokens_per_s'], 0)} ({span(e['rounds_tokens_per_s'], 0)})",
            num(e["decode_step_ms"], 2), num(e["decode_forward_host_ms"], 2),
            num(e["decode_break_host_ms"], 2), _cell(e, KEY_DEVICE, ".2f"),
        ])  # fmt: skip
    per_round = [a / b for a, b in zip(wide["rounds_tokens_per_s"], before["rounds_tokens_per_s"])]
    meta, args = data["meta"], data["meta"]["args"]
    head = m["config"].get("head_dim", 0)
    ratio = statistics.median(per_round)
    return fill(
        "cb.break_split_run",
        model=m["model"], head=head, file=BREAK_SPLIT_FILE, device=meta["device"],
        torch=meta["torch"], transformers=meta["transformers"], date=meta["date"],
        prompts=args["prompts"], min_len=args["min_len"], max_len=args["max_len"],
        new_tokens=args["new_tokens"], rounds=args["rounds"], before_keys=RULE_BEFORE_KEYS,
        wide_keys=RULE_BEFORE_KEYS * WIDE_FROM_HEAD // max(head, WIDE_FROM_HEAD),
        longest=args["max_len"] + args["new_tokens"],
        table=table(["variant", "tokens/s (rounds)", "decode ms", "decode fwd host ms",
                     "decode breaks host ms", "decode fwd device ms"], rows),  # fmt: skip
        per_round=span(per_round, 2), ratio=num(ratio, 2),
        verdict="faster" if ratio > 1 else "slower",
        step=f"{num(before['decode_step_ms'], 2)} → {num(wide['decode_step_ms'], 2)}",
        breaks=f"{num(before['decode_break_host_ms'], 2)} → {num(wide['decode_break_host_ms'], 2)}",
        device_span=f"{_cell(before, KEY_DEVICE, '.2f')} → {_cell(wide, KEY_DEVICE, '.2f')}",
        conclusion=fill("cb.break_split_run." + ("won" if ratio > 1 else "lost"),
                        now_keys=pd.BREAK_SPLIT_FROM_KEYS),  # fmt: skip
    )  # fmt: skip



def whole_model_section(runs: list[tuple[str, dict]], fragment: str = "cb.whole_model") -> str:
    """A whole model (Llama-3-8B, Qwen2.5-3B, Qwen3-30B-A3B: ``fragment`` says which), ``runs`` of
    ``(file, data)`` (the first: the default workload
    with stock): one row per run and variant (tokens/s and its rounds, the pure-decode step
    against its floor, the step's forward on the host and on the device), then issue 23's
    targets as the CB tables state them (:func:`benchmarks.cb_report.target_lines`)."""
    from .cb_report import target_lines

    rows, targets, best = [], [], []  # best: (a breakgraph step over its floor, where)
    for _, data in runs:
        m, prompts = data["models"][0], data["meta"]["args"]["prompts"]
        release = data["meta"]["transformers"]
        for name, v in m["variants"].items():
            if "tokens_per_s" not in v:
                why = v.get("skipped") or v.get("failed", "did not serve")
                rows.append([release, prompts, f"`{name}`", f"not measured: {why}"] + [""] * 6)
                continue
            rounds = v.get("rounds_tokens_per_s", [v["tokens_per_s"]])
            rows.append([
                release, prompts, f"`{name}`",
                f"{num(v['tokens_per_s'], 0)} ({span(rounds, 0)})",
                v.get("decode_requests", "-"), _cell(v, "decode_step_ms", ".2f"),
                _times(v, "decode_over_floor"), _cell(v, "decode_floor_ms", ".3f"),
                _cell(v, "decode_forward_host_ms", ".2f"), _cell(v, KEY_DEVICE, ".2f"),
            ])  # fmt: skip
            if name.startswith("breakgraph") and "decode_over_floor" in v:
                best.append((v["decode_over_floor"], f"{prompts} prompts, transformers {release}"))
        targets += [f"- {release}, {prompts} prompts, {line[2:]}" for line in target_lines(m)]
    meta, m = runs[0][1]["meta"], runs[0][1]["models"][0]
    closest = min(best, default=None)
    bg = m["variants"].get("breakgraph", {})
    return fill(
        fragment, model=m["model"], shape=m["shape"], params=f"{m['params_m']:.0f}",
        files=", ".join(f"`{name}`" for name, _ in runs), device=meta["device"],
        torch=meta["torch"], releases=" and ".join(dict.fromkeys(
            d["meta"]["transformers"] for _, d in runs)), date=meta["date"],
        hbm=f"{meta['hbm_bytes_per_s'] / 1e12:g}",
        table=table(["transformers", "prompts", "variant", "tokens/s (rounds)", "decode requests",
                     "decode ms", "× floor", "floor ms", "decode fwd host ms",
                     "decode fwd device ms"], rows),  # fmt: skip
        targets="\n".join(targets),
        closest="-" if closest is None else f"{num(closest[0], 2)}× (at {closest[1]})",
        host=_cell(bg, "decode_forward_host_ms", ".2f"),
        device_span=_cell(bg, KEY_DEVICE, ".2f"),
        busy=f"{100 * bg['gpu_forward_fraction']:.1f}%" if "gpu_forward_fraction" in bg else "-",
    )



#: ``bench_cb --prompts 32`` on the CB shapes and gemma-2b, both decoders, on an H100, beside
#: the same workload's H200 run of the CB shapes (``report_decode_step.FLOOR_FILES``' 5.17 run)
FLOOR_CARD_FILES = ("h100-cb-floor-32-5.17.json", "h200-cb-floor-32-again-5.17.json")


def floor_on_card_section(data: dict, other: dict | None) -> str:
    """Pure-decode steps at 32 requests against their floor on ``data``'s card, per shape and
    decoder, beside ``other``'s ratio on its card (``-`` for a shape it did not serve), and how
    many of the steps are within twice their floor."""
    limit = T.TARGET_CB_DECODE_OVER_FLOOR
    theirs = {(m["model"], name): v.get("decode_over_floor")
              for m in (other or {}).get("models", []) for name, v in m["variants"].items()}
    rows, within, measured = [], [], 0
    for m in data["models"]:
        for name, v in m["variants"].items():
            if "decode_over_floor" not in v:
                continue
            measured += 1
            if v["decode_over_floor"] <= limit:
                within.append(f"{m['model']} `{name}` ({num(v['decode_over_floor'], 2)}×)")
            there = theirs.get((m["model"], name))
            rows.append([
                m["model"], f"`{name}`", v["decode_requests"], _cell(v, "decode_step_ms", ".2f"),
                _cell(v, "decode_floor_ms", ".3f"), _times(v, "decode_over_floor"),
                _cell(v, KEY_DEVICE, ".2f"),
                "-" if there is None else num(there, 2) + "×",
            ])  # fmt: skip
    meta, ometa = data["meta"], (other or {}).get("meta", {})
    return fill(
        "cb.floor_on_card", file=FLOOR_CARD_FILES[0], device=meta["device"],
        torch=meta["torch"], transformers=meta["transformers"], date=meta["date"],
        hbm=f"{meta['hbm_bytes_per_s'] / 1e12:g}", other_file=FLOOR_CARD_FILES[1],
        other_device=ometa.get("device", "-"), other_date=ometa.get("date", "-"),
        table=table(["model", "decoder", "requests", "decode ms", "floor ms", "× floor",
                     "decode fwd device ms", f"× floor, {ometa.get('device', '-')}"], rows),
        limit=f"{limit:g}", met=len(within), measured=measured,
        within="; ".join(within) or "none",
    )  # fmt: skip


def _times(entry: dict, key: str) -> str:
    """A ratio of ``entry`` printed with its "×", or "-" where the run has none."""
    cell = _cell(entry, key, ".2f")
    return cell if cell == "-" else cell + "×"


def moe_trace_section(summary: dict, kernels: list[dict], tokens_per_s: dict, layers: int) -> str:
    """Where a prefill-heavy step of the whole MoE goes on the device: device ms per step by
    kind of kernel, the largest kernels, the share of ``masked_fill`` (transformers 5.17's
    sentinel masks in ``grouped_mm``), and the default workload's tokens/s per release
    (``tokens_per_s``: release -> breakgraph's median; ``layers``: the model's)."""
    from .report_decode_kernels import _short

    v = summary["variants"]["breakgraph"]
    kinds = sorted(v["device_ms_per_step_by_kind"].items(), key=lambda kv: -kv[1])
    device = sum(ms for _, ms in kinds)
    masked = sum(k["ms_per_step"] for k in kernels if MASKED_FILL in k["name"])
    masked_launches = sum(k["launches_per_step"] for k in kernels if MASKED_FILL in k["name"])
    releases = sorted(tokens_per_s)
    meta = summary["meta"]
    return fill(
        "cb.whole_moe_trace", file=MOE_TRACE, model=meta["model"], device=meta["device"],
        torch=meta["torch"],
        transformers=meta["transformers"], date=meta["date"], steps=v["steps"],
        step_ms=num(v["step_ms_per_step"], 1), busy=f"{100 * v['step_device_busy_fraction']:.0f}%",
        kinds=table(["device ms per step", "ms", "share"],
                    [[kind, num(ms, 1), f"{100 * ms / device:.0f}%"] for kind, ms in kinds]),
        top=table(["ms per step", "launches per step", "kind", "kernel"],
                  [[num(k["ms_per_step"], 2), num(k["launches_per_step"], 1), k["kind"],
                    f"`{_short(k['name'])}`"] for k in kernels[:8]]),
        masked=num(masked, 1), masked_share=f"{100 * masked / device:.0f}%",
        masked_per_layer=num(masked_launches / layers, 0),
        old=releases[0], new=releases[-1],
        gain=num(tokens_per_s[releases[-1]] / tokens_per_s[releases[0]], 3),
    )  # fmt: skip


def moe_trace_block(summary: dict, results: str, load) -> str:
    """:func:`moe_trace_section` from the committed trace (its kernels read from the chrome
    trace beside ``summary``) and the whole MoE's default-workload runs (``load``: the page's
    loader of a results file); empty when a run is missing."""
    import os

    from .report_decode_kernels import _trace_kernels

    runs = [d for name in WHOLE_MOE_FILES if (d := load(name)) is not None]
    served = {d["meta"]["transformers"]: d["models"][0]["variants"]["breakgraph"]["tokens_per_s"]
              for d in runs if d["meta"]["args"]["prompts"] == 100}  # fmt: skip
    if not served:
        return ""
    trace = os.path.basename(summary["variants"]["breakgraph"]["trace"])  # the device's path
    path = os.path.realpath(os.path.join(results, MOE_TRACE, trace))
    stat = os.stat(path)
    kernels = _trace_kernels(path, summary["meta"]["args"]["settle"], stat.st_mtime_ns,
                             stat.st_size)  # fmt: skip
    layers = runs[0]["models"][0]["config"]["num_hidden_layers"]
    return moe_trace_section(summary, [dict(k) for k in kernels], served, layers)



def _sliding_ratio(graphs: dict, variants: dict, other: str, ratio: float, per_round) -> str:
    """One ratio line's text: ``breakgraph`` against ``other`` (with its rounds), then what
    changed between them, then breakgraph against stock where stock ran."""
    before = variants[other]
    step = (f"the pure-decode step {_cell(before, 'decode_step_ms', '.2f')} → "
            f"{_cell(graphs, 'decode_step_ms', '.2f')} ms" if "decode_step_ms" in graphs
            else "no step in which every request decodes")  # fmt: skip
    if other == "breakgraph_breaks":
        what = (f"tokens/s {num(ratio, 2)}× the breaks' (round by round {span(per_round, 2)}); "
                f"{step}, the pure-decode forward's host time "
                f"{_cell(before, 'decode_forward_host_ms', '.2f')} → "
                f"{_cell(graphs, 'decode_forward_host_ms', '.2f')} ms")  # fmt: skip
    else:
        busy = [pct(e["gpu_forward_fraction"]) if "gpu_forward_fraction" in e else "-"
                for e in (before, graphs)]  # fmt: skip
        what = (f"tokens/s {num(ratio, 2)}× those with transformers' own index lists (round by "
                f"round {span(per_round, 2)}); the host's preparation "
                f"{_cell(before, 'host_prepare_ms_per_step', '.1f')} → "
                f"{_cell(graphs, 'host_prepare_ms_per_step', '.1f')} ms per step, the device "
                f"busy in the forward {busy[0]} → {busy[1]} of the time, {step}")  # fmt: skip
    stock = [f"{num(graphs['tokens_per_s'] / variants[k]['tokens_per_s'], 2)}× `{k}`"
             for k in ("stock_sdpa", "stock_graphs") if "tokens_per_s" in variants.get(k, {})]
    return what + (f"; breakgraph {', '.join(stock)}" if stock and other == "breakgraph_breaks"
                   else "")  # fmt: skip


def sliding_section(runs: list) -> str:
    """Models with sliding-window layers: ``breakgraph`` against the breaks pure-decode steps
    took before (``breakgraph_breaks``) and against transformers' own index lists
    (``breakgraph_tx_rows``), in turn, with stock beside them: ``runs`` holds ``(file,
    data)``. A table per variant, then the ratios, each with its rounds."""
    rows, lines, losses = [], [], []
    for _, data in runs:
        m = data["models"][0]
        for variant, v in m["variants"].items():
            if "tokens_per_s" not in v:
                why = v.get("failed") or v.get("skipped") or "not run"
                rows.append([_release(data), m["model"], f"`{variant}`", f"failed: {why}"[:160],
                             *["-"] * 8])  # fmt: skip
                continue
            rounds = v.get("rounds_tokens_per_s") or [v["tokens_per_s"]]
            rows.append([
                _release(data), m["model"], f"`{variant}`",
                f"{num(v['tokens_per_s'], 0)} ({span(rounds, 0)})",
                _cell(v, "decode_step_ms", ".2f"), _cell(v, "decode_over_floor", ".1f"),
                _cell(v, "decode_forward_host_ms", ".2f"),
                _cell(v, "decode_forward_device_ms", ".2f"),
                _cell(v, "host_prepare_ms_per_step", ".1f"),
                pct(v["gpu_forward_fraction"]) if "gpu_forward_fraction" in v else "-",
                _cell(v, "decode_graph_captures", "d"), _cell(v, "tokens_agree_with_stock", ".2f"),
            ])  # fmt: skip
        v = m["variants"]
        graphs = v.get("breakgraph", {})
        for other in ("breakgraph_breaks", "breakgraph_tx_rows"):
            if "tokens_per_s" not in graphs or "tokens_per_s" not in v.get(other, {}):
                continue
            per_round = [a / b for a, b in zip(graphs["rounds_tokens_per_s"],
                                               v[other]["rounds_tokens_per_s"])]  # fmt: skip
            ratio = statistics.median(per_round)
            lines.append(f"- {m['model']} on {_release(data)}: "
                         + _sliding_ratio(graphs, v, other, ratio, per_round))  # fmt: skip
            if ratio <= 1:
                losses.append(f"{m['model']} on {_release(data)} against `{other}` "
                              f"({num(ratio, 2)}×)")  # fmt: skip
    meta = runs[0][1]["meta"]
    return fill(
        "cb.sliding",
        files=", ".join(f"`{name}`" for name, _ in runs),
        device=meta["device"], torch=meta["torch"], date=meta["date"],
        hbm=f"{meta['hbm_bytes_per_s'] / 1e12:g}",
        shapes="; ".join(f"{d['models'][0]['model']}: {d['models'][0]['shape']}"
                         for _, d in runs if d["meta"]["transformers"] == _release(runs[0][1])),
        table=table(["transformers", "model", "variant", "tokens/s (rounds)", "decode ms",
                     "decode x floor", "decode fwd host ms", "decode fwd device ms", "prep ms",
                     "in forward", "decode graphs captured", "agree"], rows),  # fmt: skip
        ratios=bullets(lines) or "(not measured)",
        losses=", ".join(losses) or "none",
    )
