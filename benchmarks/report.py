"""Turn the committed benchmark JSON into docs/performance.md and its plots.

Deterministic: the same JSON gives the same page (a test checks the committed page).
Tables come from code (``report_*`` modules), prose from ``performance.md.in``, targets
from ``targets.py``; a section whose JSON is missing says it was not measured.

    python -m benchmarks.report                      # docs/results/*.json -> docs/performance.md
    python -m benchmarks.report --pytest-benchmark bench.json   # another suite JSON
"""

from __future__ import annotations

import argparse
import json
import os
import re
import unicodedata

from . import (
    cb_report,
    report_breaks,
    report_cb_decode,
    report_cb_host,
    report_compile_capture,
    report_compile_fallback,
    report_cudnn_ragged,
    report_decode_forward,
    report_decode_kernels,
    report_decode_step,
    report_earlier,
    report_held_out,
    report_prefill,
    report_suite,
    report_tests,
    tp_report,
)
from . import targets as T
from .template import fill, table

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(HERE, "..", "docs")
RESULTS = os.path.join(DOCS, "results")
SUITE_JSON = os.path.join(RESULTS, report_suite.FILE)

# re-exported for the tests and for scripts that used them from here
suite_section = report_suite.suite_section
suite_losses = report_suite.suite_losses


def _load(name: str, results: str = RESULTS) -> dict | None:
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def sources_table(loaded: dict[str, dict]) -> str:
    """Where each JSON file was measured."""
    rows = []
    for name, data in loaded.items():
        meta = data.get("meta") or data.get("machine_info") or {}
        date = meta.get("date") or str(data.get("datetime", "-"))[:10]
        rows.append(
            [
                f"`{name}`",
                meta.get("gpu") or meta.get("device") or "-",
                meta.get("torch") or "-",
                meta.get("transformers") or "-",
                date,
            ]
        )
    return table(["JSON", "GPU", "torch", "transformers", "date"], rows)


def anchor(heading: str, taken: dict[str, int]) -> str:
    """The anchor GitHub gives ``heading`` (its text, lowercased, punctuation dropped, spaces
    to hyphens; a repeat gets ``-1``, ``-2``, ...); ``taken`` counts the anchors so far.

    Example::

        >>> taken = {}
        >>> anchor("Continuous batching (transformers `generate_batch` / manager)", taken)
        'continuous-batching-transformers-generate_batch--manager'
        >>> anchor("torch.compile", taken), anchor("torch.compile", taken)
        ('torchcompile', 'torchcompile-1')
    """
    keep = lambda c: c.isalnum() or c in " -_" or unicodedata.category(c).startswith("M")  # noqa: E731
    slug = "".join(c for c in heading.strip().lower() if keep(c)).replace(" ", "-")
    repeat = taken.get(slug, 0)
    taken[slug] = repeat + 1
    return f"{slug}-{repeat}" if repeat else slug


def contents(markdown: str) -> str:
    """A list linking every section (``##``) and subsection (``###``) of ``markdown``, in
    page order, but the subsections named after a model family (one per family, under the
    sections that list them); lines inside code fences are not headings.

    Example::

        >>> print(contents("# Page\\n## Prefill\\n### llama-1b (1100 M parameters)\\n### Targets"))
        - [Prefill](#prefill)
          - [Targets](#targets)
    """
    taken: dict[str, int] = {}
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        level = 0 if fenced else len(line) - len(line.lstrip("#"))
        if level not in (1, 2, 3) or not line[level:].startswith(" "):
            continue
        title = line[level:].strip()
        slug = anchor(title, taken)
        if level == 1 or (level == 3 and _FAMILY_HEADING.search(title)):
            continue
        indent = "  " * (level - 2)
        lines.append(f"{indent}- [{title}](#{slug})")
    return "\n".join(lines)


#: a subsection per model family: "llama-1b (1100 M parameters)", "... (596 M parameters, ...)"
_FAMILY_HEADING = re.compile(r"\(\d+ M parameters")


def render(results: str = RESULTS, suite: str | None = SUITE_JSON) -> str:
    """The page, from the JSON files in ``results`` (and the suite JSON ``suite``)."""
    load = lambda name: _load(name, results)  # noqa: E731
    names = (
        [report_prefill.FILE, report_prefill.NEWEST_FILE, report_prefill.FIXED_FILE]
        + [report_prefill.TRIED_FILE]
        + [report_breaks.OVERHEAD_FILE]
        + [report_breaks.BEFORE_DEBUG_FILE]
        + list(report_breaks.ANATOMY_FILES)
        + [report_earlier.FILE, *report_earlier.RUN_FILES, report_earlier.MOE_FILE]
        + [tp_report.FILE, tp_report.NO_MIXING_FILE]
        + [*report_prefill.CAPTURE_FILES, *(n for n, _ in report_prefill.CAPTURE_LATER_FILES)]
        + [report_cb_host.TRACE_FILE, report_cb_host.TRACE_DECODE_FILE]
        + [report_cb_host.TRACE_DECODE_FOLD_FILE, report_cb_decode.DECODE_ATTENTION_FILE]
        + [name for name, _, _ in report_cb_decode.DECODE_FOLD_FILES]
        + [name for name, _, _ in report_cb_decode.PAGED_DECODE_FILES]
        + [name for name, _ in report_cb_decode.DECODE_GRAPHS_FILES]
        + list(report_held_out.SLIDING_FILES)
        + [name for name, _ in report_cb_decode.COMPILED_FILES]
        + [name for name, _ in report_cb_decode.BLOCK_TABLE_FILES]
        + [name for name, _ in report_cb_decode.TABLE_FILL_FILES]
        + [*report_cb_decode.TABLE_FILL_TRACE_FILES, report_cb_decode.GRAPH_LAUNCH_FILE]
        + [report_cb_decode.LAUNCH_PROBE_FILE]
        + [*report_cb_decode.DECODE_GRAPHS_TRACE_FILES, report_cb_decode.COMPILED_TRACE_FILE]
        + [report_cb_decode.SPLIT_SWEEP_FILE, *(name for name, _ in report_cb_decode.SPLIT_FILES)]
        + [report_cb_decode.THRESHOLD_FILE]
        + [report_tests.PROFILE_FILE, report_tests.SUITE_BEFORE_FILE, report_tests.SUITE_FILE]
        + [report_tests.SUITE_WHOLE_FILE, report_tests.CPU_SUITE_FILE]
        + [report_tests.CPU_SUITE_SERIAL_FILE, report_tests.SUITE_SERIAL_FILE]
        + [report_tests.SUITE_NEWEST_FILE, *report_cb_host.PREP_PARTS_FILES]
        + [report_tests.SUITE_AGAIN_FILE, report_tests.SUITE_EARLIER_FILE]
        + [*report_tests.SUITE_SIX_FILES, report_tests.SUITE_LAYOUT_FIRST_FILE]
        + [report_tests.SUITE_COST_FILE, report_tests.SUITE_DEALT_FILE]
        + [report_tests.SUITE_SESSION32_FILE, report_tests.SUITE_NEWEST_EARLIER_FILE]
        + list(report_tests.SUITE_OTHER_CARD_FILES)
        + [name for name, *_ in report_tests.CPU_LAYOUT_FILES]
        + [name for name, *_ in report_tests.CPU_CUTS_FILES]
        + [name for name, *_ in report_tests.CPU_WAITS_FILES]
        + [*report_cb_host.FILL_VIEWS_FILES, report_cb_host.FILL_VIEWS_HOST_FILE]
        + [name for name, _, _ in report_decode_step.WRITE_ROWS_FILES]
        + [*report_decode_step.FLOOR_FILES, *report_decode_step.FLOOR_BEFORE_FILES]
        + [report_decode_step.DECODE_GEMM_FILE, *report_decode_step.FIRST_CALL_FILES]
        + [name for name, *_ in report_decode_forward.FILES]
        + [name for name, *_ in report_decode_forward.GATHER_FILES]
        + [name for name, *_ in report_decode_forward.SPLIT_FILES]
        + [name for name, *_ in report_decode_forward.FLOOR_AGAIN_FILES]
        + [name for name, *_ in report_decode_forward.FLOOR_RERUN_FILES]
        + [*report_decode_kernels.SUMMARY_FILES, report_cudnn_ragged.CAPTURE_FILE]
        + [name for name, *_ in report_cudnn_ragged.PREFILL_FILES]
        + [name for name, _ in report_compile_capture.PREFILL_FILES]
        + [report_compile_capture.PREFILL_STEADY_FILE]
        + [*report_compile_capture.CB_FILES, report_compile_capture.CB_BEFORE_FILE]
        + [report_compile_capture.TRACE_SUMMARY]
        + [name for name, _ in report_compile_capture.REGION_FILES]
        + list(report_compile_capture.DEEP_FILES)
        + [name for name, _ in report_compile_capture.CB_REGION_FILES]
        + [name for name, _ in report_compile_capture.AUTOTUNE_FILES]
        + [report_compile_capture.AUTOTUNE_GEMM_FILE]
        + [name for name, *_ in (*report_compile_fallback.CPU_FILES,
                                 *report_compile_fallback.GPU_FILES)]  # fmt: skip
        + [*report_decode_step.WARM_KERNELS_FILES]
        + [name for name, _ in cb_report.AGAIN_FILES] + [*cb_report.TRIED_FILES]
        + [*cb_report.TRIED_PREP_FILES, *cb_report.SERVE_FILES]
        + [report_held_out.CB_FILE, report_held_out.BREAK_SPLIT_FILE]
        + [*report_held_out.WHOLE_FILES, report_held_out.FLOOR_CARD_FILES[0]]
        + [*report_held_out.WHOLE_H200_FILES, *report_held_out.WHOLE_MOE_FILES]
        + [*report_held_out.WHOLE_3B_FILES]
        + [report_held_out.MOE_TRACE_SUMMARY]
        + [report_prefill.OTHER_CARD_FILE, report_prefill.LM_HEAD_FILE]
        + list(report_prefill.HELD_OUT_FILES)
    )
    loaded = {n: d for n in names if (d := load(n)) is not None}
    suite_data = None
    if suite and os.path.exists(suite):
        with open(suite) as f:
            suite_data = json.load(f)
        loaded[os.path.basename(suite)] = suite_data
    blocks = []
    blocks += report_prefill.section(
        loaded.get(report_prefill.FILE),
        load(report_prefill.NEIGHBOURS_FILE),
        load(report_prefill.PACKED_ONLY_FILE),
        [(tag, d) for n, tag in report_prefill.UPLOAD_FILES if (d := load(n)) is not None],
        load(report_prefill.BACK_TO_BACK_FILE),
        load(report_prefill.BACK_TO_BACK_EVENT_FILE),
        load(report_prefill.MOE_PADDING_FILE),
        load(report_prefill.HOST_LINES_FILE),
        [(tag, d) for n, tag in report_prefill.VIEW_FILES if (d := load(n)) is not None],
        load(report_prefill.COPY_ISSUE_FILE),
    )
    blocks += report_prefill.capture_split_section(
        [loaded[n] for n in report_prefill.CAPTURE_FILES if n in loaded],
        [(n, tag, loaded[n]) for n, tag in report_prefill.CAPTURE_LATER_FILES if n in loaded],
        loaded.get(report_prefill.FILE),
    )
    ragged_runs = [(d, *rest) for name, *rest in report_cudnn_ragged.PREFILL_FILES
                   if (d := loaded.get(name)) is not None]  # fmt: skip
    ragged_capture = loaded.get(report_cudnn_ragged.CAPTURE_FILE)
    if ragged_capture is not None and len(ragged_runs) == len(report_cudnn_ragged.PREFILL_FILES):
        blocks.append(report_cudnn_ragged.section(ragged_capture, ragged_runs))
    blocks += report_tests.capture_profile_section(loaded.get(report_tests.PROFILE_FILE))
    compile_run = load(report_prefill.COMPILE_FILE)
    if compile_run is not None:
        blocks += report_prefill.compile_run_section(compile_run)
    for files, on_gpu in ((report_compile_fallback.GPU_FILES, True),
                          (report_compile_fallback.CPU_FILES, False)):  # fmt: skip
        fallback = [(loaded[name], *rest) for name, *rest in files if name in loaded]
        if len(fallback) == len(files):  # the GPU's runs once they exist, else the CPU's
            blocks.append(report_compile_fallback.section(fallback, on_gpu))
            break
    capture = [(loaded[name], tree) for name, tree in report_compile_capture.PREFILL_FILES
               if name in loaded]  # fmt: skip
    if len(capture) == len(report_compile_capture.PREFILL_FILES):
        blocks.append(report_compile_capture.prefill_section(
            capture, loaded.get(report_compile_capture.PREFILL_STEADY_FILE)))  # fmt: skip
    regions = [(loaded[name], what) for name, what in report_compile_capture.REGION_FILES
               if name in loaded]  # fmt: skip
    if len(regions) == len(report_compile_capture.REGION_FILES):
        blocks.append(report_compile_capture.regions_section(
            regions, [loaded[n] for n in report_compile_capture.DEEP_FILES if n in loaded]))
    cb_regions = [(loaded[name], what) for name, what in report_compile_capture.CB_REGION_FILES
                  if name in loaded]  # fmt: skip
    if len(cb_regions) == len(report_compile_capture.CB_REGION_FILES):
        blocks.append(report_compile_capture.cb_regions_section(cb_regions))
    autotuned = [(loaded[name], mode) for name, mode in report_compile_capture.AUTOTUNE_FILES
                 if name in loaded]  # fmt: skip
    gemm_probe = loaded.get(report_compile_capture.AUTOTUNE_GEMM_FILE)
    if len(autotuned) == len(report_compile_capture.AUTOTUNE_FILES) and gemm_probe:
        blocks.append(report_compile_capture.autotune_section(autotuned, gemm_probe))
    blocks += report_prefill.newest_release_section(
        loaded.get(report_prefill.NEWEST_FILE), loaded.get(report_prefill.FILE),
        loaded.get(report_prefill.FIXED_FILE),
    )
    blocks += report_prefill.tried_release_section(
        loaded.get(report_prefill.TRIED_FILE), loaded.get(report_prefill.FILE),
        loaded.get(report_prefill.NEWEST_FILE),
    )
    blocks += report_prefill.other_card_section(
        loaded.get(report_prefill.OTHER_CARD_FILE), loaded.get(report_prefill.FILE)
    )
    blocks += report_prefill.lm_head_section(
        loaded.get(report_prefill.LM_HEAD_FILE), loaded.get(report_prefill.OTHER_CARD_FILE)
    )
    blocks += report_prefill.held_out_section(
        [(name, loaded[name]) for name in report_prefill.HELD_OUT_FILES if name in loaded]
    )
    if report_breaks.OVERHEAD_FILE in loaded:
        blocks += report_breaks.overhead_section(
            loaded[report_breaks.OVERHEAD_FILE], loaded.get(report_breaks.BEFORE_DEBUG_FILE)
        )
    anatomy = [loaded[n] for n in report_breaks.ANATOMY_FILES if n in loaded]
    if anatomy:
        blocks += report_breaks.anatomy_section(anatomy)
    runs = [
        (f"run {i}", loaded[n]) for i, n in enumerate(report_earlier.RUN_FILES, 1) if n in loaded
    ]
    blocks += report_earlier.section(
        loaded.get(report_earlier.FILE), runs, loaded.get(report_earlier.MOE_FILE)
    )
    cb = [data for name in cb_report.FILES if (data := load(name)) is not None]
    if cb:  # one JSON per transformers release
        blocks.append("\n".join(cb_report.cb_section(*cb)))
    for name, tree in cb_report.AGAIN_FILES:
        if (again := load(name)) is not None:
            release = again["meta"]["transformers"]
            before = next((d for d in cb if d["meta"]["transformers"] == release), None)
            blocks.append(cb_report.again_section(again, before, name, tree))
    if (tried := load(cb_report.TRIED_FILES[0])) is not None:
        prep = [d for name in cb_report.TRIED_PREP_FILES if (d := load(name)) is not None]
        serve = [(d, name) for name in cb_report.SERVE_FILES if (d := load(name)) is not None]
        blocks.append(cb_report.tried_section(tried, load(cb_report.TRIED_FILES[1]), prep, serve))
    if (held_out := load(report_held_out.CB_FILE)) is not None:
        blocks.append("\n".join(report_held_out.held_out_cb_section(held_out)))
    sliding = [(n, d) for n in report_held_out.SLIDING_FILES if (d := load(n)) is not None]
    if sliding:
        blocks.append(report_held_out.sliding_section(sliding))
    compiled = [(n, d) for n in report_compile_capture.CB_FILES if (d := load(n)) is not None]
    if compiled:
        blocks.append(report_compile_capture.cb_section(
            compiled, load(report_compile_capture.CB_BEFORE_FILE),
            load(report_compile_capture.TRACE_SUMMARY)))  # fmt: skip
    whole = [(n, d) for n in report_held_out.WHOLE_FILES if (d := load(n)) is not None]
    if whole and whole[0][0] == report_held_out.WHOLE_FILES[0]:
        blocks.append(report_held_out.whole_model_section(whole))
    for files, fragment in ((report_held_out.WHOLE_H200_FILES, "cb.whole_model_h200"),
                            (report_held_out.WHOLE_3B_FILES, "cb.whole_3b"),
                            (report_held_out.WHOLE_MOE_FILES, "cb.whole_moe")):  # fmt: skip
        whole = [(n, d) for n in files if (d := load(n)) is not None]
        if whole and whole[0][0] == files[0]:
            blocks.append(report_held_out.whole_model_section(whole, fragment))
    if (moe_trace := load(report_held_out.MOE_TRACE_SUMMARY)) is not None:
        blocks.append(report_held_out.moe_trace_block(moe_trace, results, load))
    if (card := load(report_held_out.FLOOR_CARD_FILES[0])) is not None:
        other = load(report_held_out.FLOOR_CARD_FILES[1])
        blocks.append(report_held_out.floor_on_card_section(card, other))
    split = [data for name in report_cb_host.HOST_SPLIT_FILES if (data := load(name)) is not None]
    if split:
        blocks.append(report_cb_host.host_split_section(split))
    lists = [data for name in report_cb_host.PREP_LISTS_FILES if (data := load(name)) is not None]
    if lists:
        blocks.append(report_cb_host.prep_lists_section(lists))
    turns = [(d, tree, turn) for name, tree, turn in report_cb_host.NUMPY_LISTS_FILES
             if (d := load(name)) is not None]  # fmt: skip
    if turns:
        blocks.append(report_cb_host.numpy_lists_section(turns))
    parts = [data for name in report_cb_host.PREP_PARTS_FILES if (data := load(name)) is not None]
    views = [d for name in report_cb_host.FILL_VIEWS_FILES if (d := load(name)) is not None]
    if parts:
        host = load(report_cb_host.FILL_VIEWS_HOST_FILE)
        blocks.append(report_cb_host.prep_parts_section(parts, views, host))
    if report_cb_host.TRACE_FILE in loaded:
        blocks.append(report_cb_host.trace_section(loaded[report_cb_host.TRACE_FILE]))
    if (decode := load(report_cb_host.TRACE_DECODE_FILE)) is not None:
        after = load(report_cb_host.TRACE_DECODE_FOLD_FILE)
        blocks.append(report_cb_host.trace_decode_section(decode, after))
    folds = [(d, tree, turn) for name, tree, turn in report_cb_decode.DECODE_FOLD_FILES
             if (d := load(name)) is not None]  # fmt: skip
    if folds:
        blocks.append(report_cb_decode.decode_fold_section(folds))
    if (attention := load(report_cb_decode.DECODE_ATTENTION_FILE)) is not None:
        blocks.append(report_cb_decode.decode_attention_section(attention))
    paged = [(d, tree, turn) for name, tree, turn in report_cb_decode.PAGED_DECODE_FILES
             if (d := load(name)) is not None]  # fmt: skip
    if paged:
        blocks.append(report_cb_decode.paged_decode_section(paged))
    graphs = [(d, label) for name, label in report_cb_decode.DECODE_GRAPHS_FILES
              if (d := load(name)) is not None]  # fmt: skip
    if graphs:
        traces = [d for name in report_cb_decode.DECODE_GRAPHS_TRACE_FILES if (d := load(name))]
        blocks.append(report_cb_decode.decode_graphs_section(graphs, traces))
    compiled = [(d, label) for name, label in report_cb_decode.COMPILED_FILES
                if (d := load(name)) is not None]  # fmt: skip
    if compiled:
        trace = load(report_cb_decode.COMPILED_TRACE_FILE)
        blocks.append(report_cb_decode.compiled_section(compiled, trace))
    tables = [(d, label) for name, label in report_cb_decode.BLOCK_TABLE_FILES
              if (d := load(name)) is not None]  # fmt: skip
    if tables:
        blocks.append(report_cb_decode.block_table_section(tables))
    fills = [(d, label) for name, label in report_cb_decode.TABLE_FILL_FILES
             if (d := load(name)) is not None]  # fmt: skip
    if fills:
        traces = [d for name in report_cb_decode.TABLE_FILL_TRACE_FILES if (d := load(name))]
        launch = load(report_cb_decode.GRAPH_LAUNCH_FILE)
        probe = load(report_cb_decode.LAUNCH_PROBE_FILE)
        blocks.append(report_cb_decode.table_fill_section(fills, traces, launch, probe))
    rows = [(d, tree, turn) for name, tree, turn in report_decode_step.WRITE_ROWS_FILES
            if (d := load(name)) is not None]  # fmt: skip
    if rows:
        blocks.append(report_decode_step.write_rows_section(rows))
    floors = [d for name in report_decode_step.FLOOR_FILES if (d := load(name)) is not None]
    if floors:
        probe = load(report_decode_step.DECODE_GEMM_FILE)
        before = [d for name in report_decode_step.FLOOR_BEFORE_FILES if (d := load(name))]
        blocks.append(report_decode_step.floor_section(floors, probe, before))
    forward_runs = [(d, *rest) for name, *rest in report_decode_forward.FILES
                    if (d := load(name)) is not None]  # fmt: skip
    if forward_runs:
        gather_runs = [(d, *rest) for name, *rest in report_decode_forward.GATHER_FILES
                       if (d := load(name)) is not None]  # fmt: skip
        blocks.append(report_decode_forward.section(forward_runs, gather_runs))
    split_runs = [(d, *rest) for name, *rest in report_decode_forward.SPLIT_FILES
                  if (d := load(name)) is not None]  # fmt: skip
    floor_again = [(d, *rest) for name, *rest in report_decode_forward.FLOOR_AGAIN_FILES
                   if (d := load(name)) is not None]  # fmt: skip
    if split_runs and floor_again:
        blocks.append(report_decode_forward.split_section(split_runs, floor_again))
    floor_rerun = [(d, *rest) for name, *rest in report_decode_forward.FLOOR_RERUN_FILES
                   if (d := load(name)) is not None]  # fmt: skip
    if len(floor_rerun) == len(report_decode_forward.FLOOR_RERUN_FILES):
        blocks.append(report_decode_forward.floor_rerun_section(floor_rerun))
    kernel_runs = [
        (release, summary, report_decode_kernels.load_kernels(results, folder, summary), floor)
        for release, folder, floor_file in report_decode_kernels.RUNS
        if (summary := load(f"{folder}/summary.json")) and (floor := load(floor_file))
    ]
    if len(kernel_runs) == len(report_decode_kernels.RUNS):
        blocks.append(report_decode_kernels.section(kernel_runs))
    first_calls = [d for name in report_decode_step.FIRST_CALL_FILES if (d := load(name))]
    warm_runs = [d for name in report_decode_step.WARM_KERNELS_FILES if (d := load(name))]
    if len(first_calls) == 2 and len(warm_runs) == 2:
        blocks.append(report_decode_step.warm_kernels_section(first_calls, warm_runs))
    ab = load(report_decode_step.SPLIT_AB_FILE)
    pair_calls = [d for name in report_decode_step.FIRST_CALL_PAIR_FILES if (d := load(name))]
    pair_runs = [d for name in report_decode_step.WARM_KERNELS_PAIR_FILES if (d := load(name))]
    if ab is not None and len(pair_calls) == 2 and len(pair_runs) == 2 and len(first_calls) == 2:
        blocks.append(report_decode_step.split_pair_section(ab, pair_calls, first_calls, pair_runs))
    split = [(d, label) for name, label in report_cb_decode.SPLIT_FILES
             if (d := load(name)) is not None]  # fmt: skip
    sweep = load(report_cb_decode.SPLIT_SWEEP_FILE)
    if split or sweep is not None:
        blocks.append(report_cb_decode.split_section(sweep, split))
    if (threshold := load(report_cb_decode.THRESHOLD_FILE)) is not None:
        served = load(report_held_out.BREAK_SPLIT_FILE)
        cb_run = report_held_out.break_split_section(served) if served is not None else ""
        if text := report_cb_decode.threshold_section(threshold, sweep, cb_run):
            blocks.append(text)
    break_output = [(d, tree, turn) for name, tree, turn in report_decode_step.BREAK_OUTPUT_FILES
                    if (d := load(name)) is not None]  # fmt: skip
    if len(break_output) == len(report_decode_step.BREAK_OUTPUT_FILES):
        blocks.append(report_decode_step.break_output_section(break_output))
    tp = loaded.get(tp_report.FILE)
    if tp is not None:
        blocks.append("\n".join(tp_report.tp_section(tp, loaded.get(tp_report.NO_MIXING_FILE))))
    if suite_data is not None:
        blocks += report_suite.suite_section(suite_data)
    blocks += report_tests.suite_time_section(
        loaded.get(report_tests.SUITE_FILE),
        loaded.get(report_tests.SUITE_BEFORE_FILE),
        loaded.get(report_tests.SUITE_WHOLE_FILE),
        loaded.get(report_tests.CPU_SUITE_FILE),
        loaded.get(report_tests.CPU_SUITE_SERIAL_FILE),
        loaded.get(report_tests.SUITE_SERIAL_FILE),
        loaded.get(report_tests.SUITE_NEWEST_FILE),
        loaded.get(report_tests.SUITE_EARLIER_FILE),
        loaded.get(report_tests.SUITE_AGAIN_FILE),
        tuple(loaded.get(name) for name in report_tests.SUITE_SIX_FILES),
        [(d, *rest) for name, *rest in report_tests.CPU_LAYOUT_FILES
         if (d := loaded.get(name)) is not None],  # fmt: skip
        loaded.get(report_tests.SUITE_LAYOUT_FIRST_FILE),
        loaded.get(report_tests.SUITE_COST_FILE),
        loaded.get(report_tests.SUITE_DEALT_FILE),
        [(d, *rest) for name, *rest in report_tests.CPU_CUTS_FILES
         if (d := loaded.get(name)) is not None],  # fmt: skip
        [(d, *rest) for name, *rest in report_tests.CPU_WAITS_FILES
         if (d := loaded.get(name)) is not None],  # fmt: skip
        loaded.get(report_tests.SUITE_SESSION32_FILE),
        loaded.get(report_tests.SUITE_NEWEST_EARLIER_FILE),
        [loaded.get(name) for name in report_tests.SUITE_OTHER_CARD_FILES],
    )
    blocks.append(fill("sources", sources=sources_table(loaded)))
    body = "\n\n".join(b.strip("\n") for b in blocks if b)
    return fill("page", contents=contents(body)).strip("\n") + "\n\n" + body + "\n"


def write_plots(
    results: str = RESULTS, suite: str | None = SUITE_JSON, img: str | None = None
) -> list:
    """PNG plots next to the page (needs matplotlib, the `bench` extra); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img = img or os.path.join(DOCS, "img")
    os.makedirs(img, exist_ok=True)
    save = dict(dpi=110, metadata={"Software": None})
    written = []
    baselines = _load(report_prefill.FILE, results)
    if baselines:
        path = os.path.join(img, "prefill-baselines.png")
        report_prefill.plot(baselines, plt, path, save)
        written.append(path)
    overhead = _load(report_breaks.OVERHEAD_FILE, results)
    if overhead:
        written.append(_overhead_plot(overhead, plt, img, save))
    earlier = _load(report_earlier.FILE, results)
    for m in (earlier or {}).get("models", []):
        written.append(_earlier_plot(m, earlier["meta"], plt, img, save))
    cb = _load(cb_report.FILE, results)
    if cb:
        written.append(cb_report.write_cb_plot(cb, plt, save, img))
    tp = _load(tp_report.FILE, results)
    if tp:
        written.append(tp_report.write_tp_plot(tp, plt, save, img))
    if suite and os.path.exists(suite):
        with open(suite) as f:
            path = os.path.join(img, "suite.png")
            report_suite.write_suite_plot(json.load(f), plt, path, save)
            written.append(path)
    return written


def _overhead_plot(data: dict, plt, img: str, save: dict) -> str:
    rows = data["overhead"]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["added_per_break_us"] for r in rows], 0.4, label="breakgraph")
    ax.bar(
        [i + 0.2 for i in x],
        [r["floor_per_break_us"] for r in rows],
        0.4,
        label="separate CUDA graphs (floor)",
    )
    target = T.TARGET_ADDED_US_PER_BREAK
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"{target:g} µs target")
    ax.set_xticks(list(x), [r["regime"] for r in rows])
    ax.set_ylabel("µs added per break")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(img, "overhead.png")
    fig.savefig(path, **save)
    plt.close(fig)
    return path


def _earlier_plot(m: dict, meta: dict, plt, img: str, save: dict) -> str:
    rows = m["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    x = range(len(rows))
    series = [
        ("hf_eager", "HF eager"),
        ("breakgraph", "breakgraph"),
        ("full_graph", "one CUDA graph"),
        ("bg_compiled", "breakgraph + compile"),
        ("compile_ro", "compile reduce-overhead"),
    ]
    width = 0.16
    for k, (key, label) in enumerate(series):
        values = [r.get(key, 0) for r in rows]
        if any(values):
            ax.bar([i + (k - 2) * width for i in x], values, width, label=label)
    ax.set_yscale("log")
    ax.set_ylabel("ms (log)")
    ax.set_xticks(list(x), [r["workload"].replace(" (", "\n(") for r in rows], fontsize=7)
    ax.set_title(f"{m['model']} prefill, {meta['gpu']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(img, f"prefill-{m['model']}.png")
    fig.savefig(path, **save)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(DOCS, "performance.md"))
    parser.add_argument("--results", default=RESULTS, help="folder of the benchmark JSON")
    parser.add_argument(
        "--pytest-benchmark", default=SUITE_JSON, help="pytest-benchmark JSON of tests/benchmarks"
    )
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    with open(args.out, "w") as f:
        f.write(render(args.results, args.pytest_benchmark))
    if not args.no_plots:
        try:
            write_plots(args.results, args.pytest_benchmark)
        except ImportError:
            print("report: matplotlib is not installed; the page is written, the plots are not")


if __name__ == "__main__":
    main()
