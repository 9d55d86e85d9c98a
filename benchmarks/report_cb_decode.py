"""The continuous-batching sections of docs/performance.md on the decode path, each a change
measured against the code before it: decode attention without the causal mask, reading the
paged cache in place, pure-decode steps as one graph, the compiled decoder, transformers' block
table (and its fill), and decode attention split across programs.

Used by ``benchmarks/report.py`` with the JSON it finds; the main CB tables are in
:mod:`benchmarks.cb_report`, the host's side in :mod:`benchmarks.report_cb_host`, a decode
step against its floor in :mod:`benchmarks.report_decode_step`. The prose is in
``performance.md.in`` (``cb.*``). Example::

    python -m benchmarks.report   # the whole page, these sections included
"""

from __future__ import annotations

import statistics

from . import roofline
from .cb_report import _cell, _release, _run_of
from .report_cb_host import _in_turn
from .template import bullets, fill, num, pct, span, table

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
#: ``decode_attention --threshold-only``: the break path's split threshold on a finer grid
THRESHOLD_FILE = "h200-decode-attention-threshold.json"
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
#: the cards' short names in the tables; the bandwidth a floor is corrected to is the card's
#: (``roofline.CARDS``): until session 56 bench_cb divided by an H200's whatever the card
CARD_LABELS = ("H200", "H100")
#: multiprocessors of the GPU the sweep ran on, where its JSON does not say (an H200's)
H200_MULTIPROCESSORS = 132


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
        from_keys=pd.BREAK_SPLIT_FROM_KEYS,
        split_at_least=pd.BREAK_SPLIT_AT_LEAST,
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
    ``below``), computed against ``paged_decode.break_split``."""
    from breakgraph.integrations.transformers import paged_decode as pd

    cells: dict[tuple, dict] = {}
    eligible = []  # (whether the break rule splits the row, ratio), default split large enough
    for case, r in sweep.items():
        if case != "meta" and r.get("threshold"):
            key = (case.split("/")[0], f"{r['hq']}/{r['hkv']} × {r['d']}", r["seqs"],
                   pd.split_count(r["bucket"] * r["hkv"], sms))  # fmt: skip
            ratio = r["triton_paged_split_us"]["median"] / r["triton_paged_us"]["median"]
            cells.setdefault(key, {})[r["longest"]] = ratio
            if key[3] >= pd.BREAK_SPLIT_AT_LEAST:
                eligible.append((_break_rule(key[3], _longest(r)), ratio))
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
        "beyond": tally([v for split, v in eligible if split]),
        "below": tally([v for split, v in eligible if not split]),
    }  # fmt: skip
    return table(header + [f"≤ {n} keys" for n in longest], rows), facts


def _longest(row: dict) -> int:
    """A threshold row's longest sequence: ``max_keys`` (recorded, or replayed from the seed for
    earlier runs: ``decode_attention.replay_max_keys``), else the column's bound."""
    return row.get("max_keys", row["longest"])


def _break_rule(default: int, longest: int, head_dim: int = 0) -> bool:
    """Whether an attention break splits: ``paged_decode``'s rule (the head size plays no
    part; the rules below read it)."""
    from breakgraph.integrations.transformers import paged_decode as pd

    return pd.break_split(default, longest) > 1


def _wide_rule(default: int, longest: int, head_dim: int) -> bool:
    """Session 36's rule: ``RULE_BEFORE_KEYS`` keys up to a head size of ``WIDE_FROM_HEAD``,
    proportionally fewer at wider heads (2048 keys at 256)."""
    from breakgraph.integrations.transformers import paged_decode as pd

    wide = longest * max(head_dim, WIDE_FROM_HEAD) >= RULE_BEFORE_KEYS * WIDE_FROM_HEAD
    return default >= pd.BREAK_SPLIT_AT_LEAST and wide


def _product_rule(default: int, longest: int, head_dim: int) -> bool:
    """Tried in session 36: keys times head size at every head size (``RULE_BEFORE_KEYS`` keys
    at a head of 128, twice as many at 64)."""
    from breakgraph.integrations.transformers import paged_decode as pd

    return default >= pd.BREAK_SPLIT_AT_LEAST and longest * head_dim >= RULE_BEFORE_KEYS * 128


#: The break path's rule before session 36, and again since session 38: a split from this many
#: keys, whatever the head size
RULE_BEFORE_KEYS = 4096
#: session 36's rule scaled the keys down for heads wider than this
WIDE_FROM_HEAD = 128


def threshold_section(data: dict, earlier: dict | None = None, cb_run: str = "") -> str:
    """``decode_attention --threshold-only``: the launched split over the unsplit kernel on a
    finer grid of longest keys, on the picked and the held-out shapes, against the break
    path's rule (:func:`breakgraph.integrations.transformers.paged_decode.break_split`):
    where it pays, where the rule takes a loss or leaves a gain; then the rules before, tried
    and now on this sweep and ``earlier`` (the split sweep's threshold rows, another host);
    ``cb_run``, the rule served in continuous batching
    (:func:`benchmarks.report_held_out.break_split_section`), closes it. Empty where the file
    holds no threshold rows."""
    from breakgraph.integrations.transformers import paged_decode as pd

    from . import decode_attention as da

    meta = data.get("meta", {})
    sms = meta.get("multiprocessors", H200_MULTIPROCESSORS)
    rows = {c: r for c, r in data.items() if c != "meta" and r.get("threshold")}
    if not rows:
        return ""
    table_text, _ = _threshold_table(rows, sms)
    tallies = {(h, side): [] for h in (False, True) for side in ("beyond", "below")}
    crossings = []
    cases: dict[tuple, dict] = {}
    for case, r in rows.items():
        split = pd.split_count(r["bucket"] * r["hkv"], sms)
        ratio = r["triton_paged_split_us"]["median"] / r["triton_paged_us"]["median"]
        cases.setdefault((case.split("/")[0], r["seqs"], split, bool(r.get("held_out"))),
                         {})[r["longest"]] = ratio  # fmt: skip
        if split >= pd.BREAK_SPLIT_AT_LEAST:
            side = "beyond" if _wide_rule(split, _longest(r), r["d"]) else "below"
            tallies[bool(r.get("held_out")), side].append(ratio)
    for (shape, seqs, split, held_out), by_length in cases.items():
        lengths = sorted(by_length)
        paying = [n for i, n in enumerate(lengths) if all(by_length[m] < 1 for m in lengths[i:])]
        where = f"from ≤ {paying[0]} keys" if paying else "at no length of the grid"
        never = split < pd.BREAK_SPLIT_AT_LEAST
        crossings.append(f"- {shape}{' (held out)' if held_out else ''}, {seqs} sequences, "
                         f"default split {split}: the split pays {where}"
                         + (" (below the minimum split: a break never splits it)" if never
                            else ""))  # fmt: skip

    def tally(values: list) -> str:
        if not values:
            return "no case"
        return f"{sum(v < 1 for v in values)} of {len(values)} ({span(values, 2)}×)"

    compared = []
    for label, sweep in (("this sweep", data), ("the split sweep above", earlier or {})):
        host = sweep.get("meta", {}).get("multiprocessors", H200_MULTIPROCESSORS)
        found = [r for c, r in sweep.items() if c != "meta" and r.get("threshold")]
        if found:
            costs = [f"{name} {_rule_cost(found, host, rule)}" for name, rule in (
                ("before and now", _break_rule), ("tried", _product_rule),
                ("session 36", _wide_rule))]  # fmt: skip
            compared.append(f"- {label} ({len(found)} rows): " + "; ".join(costs))
    timed = ("triton_paged_split_us", "triton_paged_split_graph_us")
    common = [c for c, r in rows.items() if all(k in r and k in (earlier or {}).get(c, {})
                                                 for k in timed)]  # fmt: skip
    hosts = ""
    if common:
        slower = [rows[c][timed[0]]["median"] / earlier[c][timed[0]]["median"] for c in common]
        moved = [rows[c][timed[1]]["median"] / earlier[c][timed[1]]["median"] for c in common]
        hosts = fill("cb.split_threshold.hosts", common=len(common), slower=f"{span(slower, 2)}×",
                     slower_median=f"{num(statistics.median(slower), 2)}×",
                     graph_moved=f"{span(moved, 2)}×")  # fmt: skip
    lengths = sorted({r["longest"] for r in rows.values()})
    return fill(
        "cb.split_threshold",
        file=f"`{THRESHOLD_FILE}`", gpu=meta.get("gpu", "-"), torch=meta.get("torch", "-"),
        date=meta.get("date", "-"), low=lengths[0], high=lengths[-1], steps=len(lengths),
        held_shapes=", ".join(name for name, *_ in da.HELD_OUT), table=table_text,
        head=WIDE_FROM_HEAD, before_keys=RULE_BEFORE_KEYS,
        wide_keys=RULE_BEFORE_KEYS // 2,  # at a head twice WIDE_FROM_HEAD
        beyond_picked=tally(tallies[False, "beyond"]), beyond_held=tally(tallies[True, "beyond"]),
        below_picked=tally(tallies[False, "below"]), below_held=tally(tallies[True, "below"]),
        crossings=bullets(crossings), compared=bullets(compared) or "(not measured)",
        hosts=hosts, cb_run=cb_run or fill("cb.split_threshold.no_cb_run"),
    )  # fmt: skip


def _rule_cost(rows: list, sms: int, rule) -> str:
    """What ``rule`` (``(default split, longest keys, head size) -> splits``) gives away on
    threshold rows against splitting exactly where the split pays: the losses it takes (it
    splits, the split is slower) and the gains it leaves (it does not, the split is faster),
    as cases and µs per launched call summed. Rows whose default split is below the minimum
    split under no rule and count for none."""
    from breakgraph.integrations.transformers import paged_decode as pd

    taken, left = [], []
    for r in rows:
        unsplit, split = r["triton_paged_us"]["median"], r["triton_paged_split_us"]["median"]
        default = pd.split_count(r["bucket"] * r["hkv"], sms)
        if default < pd.BREAK_SPLIT_AT_LEAST:
            continue
        if rule(default, _longest(r), r["d"]):
            taken += [split - unsplit] if split >= unsplit else []
        elif split < unsplit:
            left.append(unsplit - split)
    return (f"{len(taken)} losses taken ({num(sum(taken), 0)} µs), {len(left)} gains left "
            f"({num(sum(left), 0)} µs), {num(sum(taken) + sum(left), 0)} µs in all")


def _setting(key: str) -> str:
    """A sweep key ``<splits>-block<n>`` as ``splits × n``."""
    splits, block = key.split("-block")
    return f"{splits} × {block}"


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


def _gpu(data: dict) -> str:
    return data["meta"].get("gpu", data["meta"].get("device", "")) or ""


def _card(data: dict) -> str:
    """``H200`` or ``H100``, from the run's GPU name (the name itself for another card)."""
    return next((card for card in CARD_LABELS if card in _gpu(data)), _gpu(data))


def card_floor_scale(data: dict) -> float:
    """The card's HBM bandwidth over the one the run's floors divided by (``bench_cb`` took an
    H200's whatever the card until session 56; 1.0 for a run that took its card's, or for a
    card not in ``roofline.CARDS``)."""
    assumed = data["meta"].get("hbm_bytes_per_s", roofline.H200_HBM_BYTES_PER_S)
    return (roofline.card_peaks(_gpu(data)) or (assumed,))[0] / assumed


def _over_floor(data: dict, entry: dict) -> float:
    """A pure-decode step over its HBM floor on the card it ran on."""
    return entry["decode_over_floor"] * card_floor_scale(data)


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
