"""The page's sections on ``compile=True`` inside CUDA captures, before and after session 53.

Why: breakgraph turns autocast's cast cache off inside every capture (``breakgraph.graph``,
pytorch#71631) and Dynamo guards on that flag, so every frame the warm-ups compiled compiled
again inside the first CUDA capture. On Gemma-3-1B's shape the new kernels' first launch
autotuned there, a synchronisation, and the capture failed; elsewhere the second compile
cost construction time. ``CompiledForward`` now calls with the cache off
(:mod:`breakgraph.integrations.transformers.compiled`).

The runs (an H100, the device tool's; one process each):

* :data:`PREFILL_FILES`: ``bench_prefill --families mistral-7b-4l --compile-families
  mistral-7b-4l --sizes 32``, session 52's tree and this one taking turns, Inductor's and AOT
  autograd's caches off (``TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0``);
* :data:`CB_FILES`: ``bench_cb --variants breakgraph,breakgraph_compiled`` (gpt-oss with
  ``breakgraph_breaks`` too) on the held-out sliding-window shapes, the variants in turn, and
  :data:`CB_BEFORE_FILE`, the same on the tree before, where ``breakgraph_compiled`` failed;
* :data:`TRACE_SUMMARY`: ``cb_trace --model gemma3-1b --prompts 32`` with both decoders;
* :data:`REGION_FILES` (session 54): the same prefill run on llama-1b and mistral-7b-4l, the
  whole-model compile (session 53's tree) and the compile by region taking turns, each process
  with empty Triton and Inductor cache folders (a cold start), and :data:`DEEP_FILES`, the
  whole-model compile on two deep families (a first run on a fresh machine each);
* :data:`CB_REGION_FILES` (session 55): ``bench_cb --models llama3-8b-4l --variants
  breakgraph_compiled --prompts 32``, the whole-model compile (``9b928ae``) and the compile by
  region taking turns, one process each with empty Triton and Inductor caches (one round each:
  the first manager holds the compile);
* :data:`AUTOTUNE_FILES` (session 56): the same workload, ``compile=True`` against
  ``compile={"mode": "max-autotune-no-cudagraphs"}`` (``breakgraph_autotuned``) taking turns,
  three rounds a process, with :data:`AUTOTUNE_GEMM_FILE`, the decode GEMMs alone through
  cuBLAS and through Inductor's autotuned kernels (``decode_gemm_probe --autotune --rows 32``).

Example (the committed runs)::

    python -m benchmarks.report   # the whole page, these sections included
"""

from __future__ import annotations

import statistics

from . import targets as T
from .cb_report import _cell, _release
from .template import fill, num, pct, span, table

#: (file, tree) in the order the processes ran
PREFILL_FILES = (("h100-prefill-compile-head53-1.json", "after"),
                 ("h100-prefill-compile-head52-1.json", "before"),
                 ("h100-prefill-compile-head53-2.json", "after"))  # fmt: skip
#: a whole ``bench_prefill --compile-families mistral-7b-4l`` run on this tree, the same card
PREFILL_STEADY_FILE = "h100-prefill-compile-mistral-5.17.json"
CB_FILES = ("h100-cb-compiled-gemma3-1b-5.17.json", "h100-cb-compiled-gemma3-1b-5.24.json",
            "h100-cb-compiled-gpt-oss-20b-4l-5.17.json")  # fmt: skip
CB_BEFORE_FILE = "h100-cb-compiled-gemma3-1b-5.24-before.json"
TRACE_SUMMARY = "h100-cb-trace-gemma3-32-5.24/summary.json"
COMPILED = "breakgraph_compiled"
#: (file, what compile=True compiled) in the order the processes ran
REGION_FILES = (("h100-prefill-compile-cold-head54-llama-1b.json", "whole model"),
                ("h100-prefill-compile-cold-head54b-llama-1b.json", "by region"),
                ("h100-prefill-compile-cold-head54b-mistral-7b-4l.json", "by region"),
                ("h100-prefill-compile-cold-head54-mistral-7b-4l.json", "whole model"))  # fmt: skip
#: (file, what compile=True compiled) in the order the processes ran: continuous batching
CB_REGION_FILES = (("h100-cb-compile-regions-now-1.json", "by region"),
                   ("h100-cb-compile-regions-before-1.json", "whole model"),
                   ("h100-cb-compile-regions-before-2.json", "whole model"),
                   ("h100-cb-compile-regions-now-2.json", "by region"))  # fmt: skip
#: (file, mode) in the order the processes ran: compile=True against Inductor's max-autotune
AUTOTUNE_FILES = (("h100-cb-autotuned-1.json", "max-autotune"),
                  ("h100-cb-compiled-1.json", "default"),
                  ("h100-cb-compiled-2.json", "default"),
                  ("h100-cb-autotuned-2.json", "max-autotune"),
                  ("h100-cb-autotuned-3.json", "max-autotune"),
                  ("h100-cb-compiled-3.json", "default"))  # fmt: skip
AUTOTUNE_VARIANTS = {"default": COMPILED, "max-autotune": "breakgraph_autotuned"}
AUTOTUNE_GEMM_FILE = "h100-decode-gemm-autotune.json"
DEEP_FILES = ("h100-prefill-compile-deep-llama-1b.json",
              "h100-prefill-compile-deep-qwen2-1.5b.json")  # fmt: skip


def prefill_section(runs: list, steady: dict | None) -> str:
    """``runs``: ``(data, tree)`` in the order they ran: construction of the compiled runner
    split as the benchmark splits it, and the frames and graphs Dynamo compiled; ``steady``:
    :data:`PREFILL_STEADY_FILE`, whose steady-state ratios close the section (None: left out)."""
    rows, after, before = [], [], []
    for data, tree in runs:
        bg = data["families"][0]["compile"]["bg_compiled"]
        split, dynamo = bg["breakdown"], bg["dynamo"]
        ro = data["families"][0]["compile"]["compile_ro"]["lengths"]
        ro_total = sum(length["ready_s"] for length in ro)
        (after if tree == "after" else before).append((bg["construction_s"], ro_total))
        rows.append([tree, num(bg["construction_s"]), num(split["compile_s"]),
                     num(split["capture_s"]), str(dynamo["frames"]), str(dynamo["graphs"]),
                     num(ro_total), num(ro_total / bg["construction_s"])])  # fmt: skip
    meta = runs[0][0]["meta"]
    return fill(
        "prefill.compile_capture",
        files="`, `".join(name for name, _ in PREFILL_FILES),
        device=meta["gpu"], torch=meta["torch"], transformers=meta["transformers"],
        date=meta["date"], family=runs[0][0]["families"][0]["family"],
        table=table(["tree", "construction s", "compiling s", "capturing s", "frames compiled",
                     "graphs compiled", "torch.compile: first calls at 5 lengths s",
                     "first calls / construction"], rows),
        before=span([c for c, _ in before]), after=span([c for c, _ in after]),
        ratio=span([r / c for c, r in after]), target=f"{T.TARGET_FIRST_CALL_SPEEDUP:g}",
        steady=_steady(steady) if steady is not None else "",
    )  # fmt: skip


def _steady(data: dict) -> str:
    """The compiled runner's median time over reduce-overhead's, per single-prompt length."""
    rows = [r for r in data["families"][0]["rows"] if r["kind"] == "single"
            and {"bg_compiled", "compile_ro"} <= set(r["ms"])]  # fmt: skip
    cells = ", ".join(f"{num(r['ms']['bg_compiled'] / r['ms']['compile_ro'], 2)} at "
                      f"{r['tokens']} tokens" for r in rows)  # fmt: skip
    return fill("prefill.compile_capture.steady", file=PREFILL_STEADY_FILE, ratios=cells)


def cb_section(runs: list, before: dict | None, trace: dict | None) -> str:
    """``runs``: ``(file, data)`` of :data:`CB_FILES`; ``before``: the failed run on the tree
    before; ``trace``: the 32-request trace's summary, or None."""
    rows, lines = [], []
    for _, data in runs:
        m = data["models"][0]
        v = m["variants"]
        for variant, e in v.items():
            rounds = e.get("rounds_tokens_per_s") or [e["tokens_per_s"]]
            manager = e.get("rounds_manager_s") or [e.get("manager_s", 0.0)]
            rows.append([_release(data), m["model"], f"`{variant}`",
                         f"{num(e['tokens_per_s'], 0)} ({span(rounds, 0)})",
                         _cell(e, "decode_step_ms", ".2f"), _cell(e, "decode_over_floor", ".1f"),
                         _cell(e, "host_prepare_ms_per_step", ".1f"),
                         num(manager[0], 1)])  # fmt: skip
        if COMPILED in v and "breakgraph" in v:
            per_round = [a / b for a, b in zip(v[COMPILED]["rounds_tokens_per_s"],
                                               v["breakgraph"]["rounds_tokens_per_s"])]  # fmt: skip
            step = (f"; the pure-decode step {_cell(v['breakgraph'], 'decode_step_ms', '.2f')} → "
                    f"{_cell(v[COMPILED], 'decode_step_ms', '.2f')} ms "
                    f"({_cell(v['breakgraph'], 'decode_over_floor', '.1f')} → "
                    f"{_cell(v[COMPILED], 'decode_over_floor', '.1f')}× its floor)"
                    if "decode_step_ms" in v[COMPILED] else
                    "; no step in which every request decodes")  # fmt: skip
            lines.append(f"- {m['model']} on {_release(data)}: `{COMPILED}` "
                         f"{num(statistics.median(per_round), 2)}× `breakgraph`'s tokens/s "
                         f"(round by round {span(per_round, 2)}){step}")  # fmt: skip
    failed = (before or {}).get("models", [{}])[0].get("variants", {}).get(COMPILED, {})
    why = failed.get("failed", "not run").split("(")[0].strip()
    meta = runs[0][1]["meta"]
    return fill(
        "cb.compile_capture",
        files=", ".join(f"`{name}`" for name, _ in runs), before_file=CB_BEFORE_FILE,
        device=meta["device"], torch=meta["torch"], date=meta["date"],
        hbm=f"{meta['hbm_bytes_per_s'] / 1e12:g}", why=why,
        table=table(["transformers", "model", "variant", "tokens/s (rounds)", "decode ms",
                     "× floor", "prep ms", "first manager s"], rows),
        ratios="\n".join(lines),
        trace=_trace_block(trace) if trace is not None else "",
    )  # fmt: skip


def _trace_block(summary: dict) -> str:
    """Device ms per pure-decode step by kind of kernel, both decoders, from the trace."""
    variants = summary["variants"]
    kinds = sorted({k for e in variants.values() for k in e["device_ms_per_step_by_kind"]},
                   key=lambda k: -variants["breakgraph"]["device_ms_per_step_by_kind"].get(k, 0))
    rows = [[k] + [num(e["device_ms_per_step_by_kind"].get(k, 0.0)) for e in variants.values()]
            for k in kinds]  # fmt: skip
    rows.append(["**all kernels**"] + [num(sum(e["device_ms_per_step_by_kind"].values()))
                                       for e in variants.values()])  # fmt: skip
    rows.append(["wall ms per step (profiled)"] + [num(e["wall_ms_per_step"])
                                                   for e in variants.values()])  # fmt: skip
    args = summary["meta"]["args"]
    return fill(
        "cb.compile_capture.trace", file=TRACE_SUMMARY, requests=args["prompts"],
        transformers=summary["meta"]["transformers"],
        steps=next(iter(variants.values()))["steps"],
        table=table(["device ms per step", *(f"`{v}`" for v in variants)], rows),
    )  # fmt: skip


def regions_section(runs: list, deep: list) -> str:
    """``runs``: ``(data, compiled)`` of :data:`REGION_FILES`; ``deep``: the data of
    :data:`DEEP_FILES` (an empty list leaves their sentence out)."""
    rows, by, bound = [], {}, []
    for data, what in runs:
        fam = data["families"][0]
        bg, ro = fam["compile"]["bg_compiled"], fam["compile"]["compile_ro"]["lengths"]
        phases = bg["dynamo"]["compile_s"]
        ro_total = sum(length["ready_s"] for length in ro)
        row = next(r for r in fam["rows"] if r["kind"] == "single")
        single, tokens = row["ms"], row["tokens"]
        by.setdefault(fam["family"], {})[what] = (bg["construction_s"], phases["dynamo_s"])
        if what == "by region":
            bound.append(f"{fam['family']} {num(ro_total / T.TARGET_FIRST_CALL_SPEEDUP, 1)} s "
                         f"against {num(phases['compile_s'], 1)} s of compiling alone")
        rows.append([fam["family"], str(fam["config"]["num_hidden_layers"]), what,
                     num(bg["construction_s"], 1), num(phases["compile_s"], 1),
                     num(phases["dynamo_s"], 1), str(bg["dynamo"]["frames"]),
                     str(bg["dynamo"]["graphs"]), num(ro_total, 1),
                     num(ro_total / bg["construction_s"], 1), num(single["bg_compiled"]),
                     num(single["bg_compiled"] / single["compile_ro"])])  # fmt: skip
    changes = "; ".join(
        f"{family}: construction {num(v['whole model'][0], 1)} → {num(v['by region'][0], 1)} s, "
        f"Dynamo {num(v['whole model'][1], 1)} → {num(v['by region'][1], 1)} s"
        for family, v in by.items() if {"whole model", "by region"} <= set(v))  # fmt: skip
    meta = runs[0][0]["meta"]
    return fill(
        "prefill.compile_regions",
        files="`, `".join(name for name, _ in REGION_FILES), device=meta["gpu"],
        torch=meta["torch"], transformers=meta["transformers"], date=meta["date"],
        table=table(["family", "layers", "compile=True compiles", "construction s",
                     "compiling s", "Dynamo s", "frames", "graphs",
                     "torch.compile: first calls at 5 lengths s", "first calls / construction",
                     f"compiled ms, {tokens} tokens",
                     f"compiled / reduce-overhead, {tokens} tokens"], rows), tokens=tokens,
        changes=changes, target=f"{T.TARGET_FIRST_CALL_SPEEDUP:g}", bound="; ".join(bound),
        deep=_deep(deep) if deep else "",
    )  # fmt: skip


def _deep(runs: list) -> str:
    """The whole-model compile's first calls against reduce-overhead's on the deep families."""
    cells = []
    for data in runs:
        fam = data["families"][0]
        bg, ro = fam["compile"]["bg_compiled"], fam["compile"]["compile_ro"]["lengths"]
        ro_total = sum(length["ready_s"] for length in ro)
        cells.append(f"{fam['family']} ({fam['config']['num_hidden_layers']} layers) "
                     f"{num(bg['construction_s'], 1)} s against {num(ro_total, 1)} s "
                     f"({num(ro_total / bg['construction_s'], 1)}×)")  # fmt: skip
    return fill("prefill.compile_regions.deep", files="`, `".join(DEEP_FILES),
                cells="; ".join(cells))  # fmt: skip


def _turns(runs: list, variant_of) -> tuple[list, dict, dict]:
    """``runs``: ``(data, label)`` in the order the processes ran, ``variant_of(label)`` the
    ``bench_cb`` variant each served: ``[(turn, label, entry, first manager s)]``, then per
    label the lists of first manager, pure-decode device time, step and tokens/s, and their
    medians."""
    turns, by = [], {}
    for turn, (data, label) in enumerate(runs, 1):
        e = data["models"][0]["variants"][variant_of(label)]
        manager = (e.get("rounds_manager_s") or [e["manager_s"]])[0]
        side = by.setdefault(label, {"manager": [], "device": [], "step": [], "tokens": []})
        for key, value in (("manager", manager), ("device", e["decode_forward_device_ms"]),
                           ("step", e["decode_step_ms"]), ("tokens", e["tokens_per_s"])):
            side[key].append(value)
        turns.append((turn, label, e, manager))
    med = {w: {k: statistics.median(v) for k, v in side.items()} for w, side in by.items()}
    return turns, by, med


def cb_regions_section(runs: list) -> str:
    """``runs``: ``(data, compiled)`` of :data:`CB_REGION_FILES` in the order they ran: each
    process's first manager (the compile and the captures), its round's tokens/s and its
    pure-decode step, then the medians of each side."""
    turns, by, med = _turns(runs, lambda _: COMPILED)
    rows = [[str(turn), what, num(manager, 1), num(e["capture_s"], 1), num(e["tokens_per_s"], 0),
             num(e["decode_step_ms"], 2), num(e["decode_forward_device_ms"], 2),
             num(e["host_prepare_ms_per_step"], 2)]
            for turn, what, e, manager in turns]  # fmt: skip
    whole, region = med["whole model"], med["by region"]
    data, model = runs[0][0], runs[0][0]["models"][0]
    meta = data["meta"]
    return fill(
        "cb.compile_regions",
        files="`, `".join(name for name, _ in CB_REGION_FILES), device=meta["gpu"],
        torch=meta["torch"], transformers=meta["transformers"], date=meta["date"],
        model=model["model"], prompts=model["prompts"], new_tokens=model["new_tokens"],
        table=table(["turn", "compile=True compiles", "first manager s", "captures s",
                     "tokens/s", "pure-decode step ms", "its forward on the device ms",
                     "prep ms per step"], rows),
        manager=f"{num(whole['manager'], 1)} → {num(region['manager'], 1)} s",
        on_device=f"{num(whole['device'], 2)} → {num(region['device'], 2)} ms",
        step=f"{num(whole['step'], 2)} → {num(region['step'], 2)} ms",
        tokens=f"{num(whole['tokens'], 0)} → {num(region['tokens'], 0)}",
        steps=span(by["by region"]["step"] + by["whole model"]["step"], 2),
    )  # fmt: skip


def _gemm_rows(probe: dict) -> list:
    """The probe's rows: per shape and row count, cuBLAS against Inductor's autotuned kernel
    (a layer's separate GEMMs, then the LM head), with each one's share of HBM bandwidth."""
    rows = []
    for shape in probe["shapes"]:
        for count, r in shape["rows"].items():
            for part, key, unit in (("a layer's GEMMs", "separate", "ms_per_layer"),
                                    ("LM head", "head", "ms")):  # fmt: skip
                plain, tuned = r[key], r[f"{key}_autotuned"]
                rows.append([shape["shape"], count, part,
                             f"{num(plain[unit], 3)} ({pct(plain['bandwidth_share'])})",
                             f"{num(tuned[unit], 3)} ({pct(tuned['bandwidth_share'])})",
                             num(tuned[unit] / plain[unit], 2)])  # fmt: skip
    return rows


def autotune_section(runs: list, probe: dict) -> str:
    """``runs``: ``(data, mode)`` of :data:`AUTOTUNE_FILES` in the order they ran: each
    process's first manager, its median round's tokens/s, its pure-decode step against the
    floor and the step's forward on the device, then the medians of each side; ``probe``: the
    decode GEMMs alone, cuBLAS against autotuned."""
    turns, by, med = _turns(runs, lambda mode: AUTOTUNE_VARIANTS[mode])
    rows = [[str(turn), mode, num(manager, 1), num(e["tokens_per_s"], 0),
             num(e["decode_step_ms"], 2), num(e["decode_over_floor"], 2),
             num(e["decode_forward_device_ms"], 2), num(e["host_prepare_ms_per_step"], 2)]
            for turn, mode, e, manager in turns]  # fmt: skip
    plain, tuned = med["default"], med["max-autotune"]
    data, model = runs[0][0], runs[0][0]["models"][0]
    meta, e = data["meta"], turns[0][2]
    rows_of = [r for shape in probe["shapes"] for r in shape["rows"].values()]
    layer_ratios = [r["separate_autotuned"]["ms_per_layer"] / r["separate"]["ms_per_layer"]
                    for r in rows_of]  # fmt: skip
    head_ratios = [r["head_autotuned"]["ms"] / r["head"]["ms"] for r in rows_of]
    # a side's processes spread by more than a few percent: a change only where they part
    autotuned, default = by["max-autotune"]["device"], by["default"]["device"]
    faster = max(autotuned) < min(default)
    if faster:
        change = "shortens the step's device time (each of its processes beat each default one)"
    elif min(autotuned) > max(default):
        change = "lengthens the step's device time (each of its processes lost to each default one)"
    else:
        change = "does not shorten the step's device time (the two sides' processes overlap)"
    longer = tuned["manager"] > plain["manager"]
    verdict = f"Max-autotune {change}, and its compile is {'longer' if longer else 'no longer'}."
    if not faster:
        verdict += " For these shapes the lever is closed."
    return fill(
        "cb.autotune",
        files="`, `".join(name for name, _ in AUTOTUNE_FILES), probe_file=AUTOTUNE_GEMM_FILE,
        probe_device=probe["meta"]["gpu"], probe_torch=probe["meta"]["torch"],
        probe_date=probe["meta"]["date"], hbm=num(probe["meta"]["hbm_bytes_per_s"] / 1e12, 2),
        device=meta["gpu"], torch=meta["torch"], transformers=meta["transformers"],
        date=meta["date"], model=model["model"], prompts=model["prompts"],
        new_tokens=model["new_tokens"],
        floor=num(e["decode_floor_ms"], 3), requests=e["decode_requests"],
        gemm_table=table(["shape", "rows", "part", "cuBLAS ms (share of HBM)",
                          "autotuned ms (share of HBM)", "autotuned / cuBLAS"],
                         _gemm_rows(probe)),  # fmt: skip
        layer_span=span(layer_ratios, 2), head_span=span(head_ratios, 2),
        table=table(["turn", "compile mode", "first manager s", "tokens/s (median round)",
                     "pure-decode step ms", "× floor", "its forward on the device ms",
                     "prep ms per step"], rows),  # fmt: skip
        manager=f"{num(plain['manager'], 1)} → {num(tuned['manager'], 1)} s",
        on_device=f"{num(plain['device'], 2)} → {num(tuned['device'], 2)} ms",
        step=f"{num(plain['step'], 2)} → {num(tuned['step'], 2)} ms",
        tokens=f"{num(plain['tokens'], 0)} → {num(tuned['tokens'], 0)}",
        over_floor=num(plain["step"] / e["decode_floor_ms"], 2),
        verdict=verdict, rounds=meta["args"]["rounds"],
        prep_span=span([e["host_prepare_ms_per_step"] for _, _, e, _ in turns], 2),
    )  # fmt: skip
