"""Does asynchronous batching overlap the host's preparation with the device? A trace says.

Issue 23 (item 3): on transformers 5.24 breakgraph's asynchronous CB steps lost to its
synchronous ones on a small MoE (``bench_cb``'s host ``prep`` 8.8 ms per step against
5.8 ms). This script serves one short continuous-batching workload per variant under
``torch.profiler`` (CPU and CUDA activity) and measures, over a window of steps, how much
of transformers' host preparation runs while the device is busy. Asynchronous batching only
pays if that share is high: the host prepares step N+1 while the device runs step N. If
the device idles during preparation, the steps are serialised whatever the mode says.

On an H200 (about 60 s; mixtral-1k-8l, 48 prompts of 16-512 tokens, 32 new tokens each,
24 profiled steps per variant; three traces of a few MB and ``summary.json`` land in
``--out``, within the device tool's eight returned files)::

    source scripts/setup_device.sh && python3 -m benchmarks.cb_trace --model mixtral-1k-8l \\
        --out "$OUT/trace"

(for transformers 5.24 carry ``.whl`` as ``scripts/gpu_check.sh`` describes and install it
the same way first), and on any machine in a few seconds (tiny MoE, CPU, fp32, the emulated
backend; no CUDA activity, which the summary says)::

    python -m benchmarks.cb_trace --smoke --out cb-trace-smoke

Each variant (``--variants``, of ``bench_cb.VARIANTS``: by default ``breakgraph``, which is
asynchronous on CUDA, ``breakgraph_sync`` and ``stock_graphs_async``; the CPU skips
``stock_graphs_async``) gets its own manager, serves a warm-up pass (captures, allocator),
then the traced pass: fresh prompts of the same lengths. Models, prompts, the
``ContinuousBatchingConfig`` and the way a variant turns async batching on or off are
``bench_cb``'s (:func:`~benchmarks.bench_cb.build_model`,
:func:`~benchmarks.bench_cb.make_prompts`, :func:`~benchmarks.bench_cb.cb_config`,
``bench_cb.VARIANTS``).

How it marks and windows the steps (:class:`LoopMarks`): ``record_function`` ranges around
the three calls of transformers' generation loop, ``cb.prepare``
(``ContinuousBatchProcessor.prepare_next_batch``: scheduling and the step's input tensors,
the method ``bench_cb`` times as ``prep``), ``cb.step`` (``_generation_step``: inputs to
the device, the forward and sampling launched, outputs requested) and ``cb.update``
(``update_batch``: waits for a step's tokens and hands them out), patched through a
:class:`~breakgraph.patches.PatchSet` for the run and restored. transformers runs that
loop in its own thread, and the profiler records the CPU ops of the thread that starts it,
so the marks start the profiler inside the loop after ``--skip`` steps of the traced pass
and stop it ``--steps`` steps later: the trace holds those steps only.

Reported per variant (:func:`summarize_trace`, on the exported trace; the first
``--settle`` profiled steps are left out, the profiler's start stalls the loop there):
steps, wall ms per step, the host ms per step of each range, the device-busy fraction
(union of CUDA kernels, memcpys and memsets over the window), and the share of each range
during which the device was busy, ``prepare_device_busy_fraction`` the headline: near 1,
preparation hides behind the device; near 0, the device waits for the host. Also the
host's CUDA synchronisation calls (ms per step) and graph launches, the device time per step
by kind of kernel (``device_ms_per_step_by_kind``: :data:`KERNEL_KINDS`), and per step the
same numbers (``per_step``). Open the ``.json.gz`` traces in https://ui.perfetto.dev or
``chrome://tracing``.

Under the profiler every CUDA-graph launch costs the host far more than it does in a plain run
(``graph_launch_host_ms_per_step``, ``largest_graph_nodes``: a 547-node decode graph's launch
takes about 0.6 ms traced against about 17 µs untraced on an H200,
``benchmarks/decode_launch_probe.py``), and the device waits for it: read the host times of
ranges that launch graphs (``cb.step``) as upper bounds, and the device time by kind as is.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import statistics
import sys
import threading
import time

import torch

if __package__ in (None, ""):  # python benchmarks/cb_trace.py: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transformers  # noqa: E402
from breakgraph.integrations.transformers import compat, enable_continuous_batching  # noqa: E402

from benchmarks.bench_cb import (  # noqa: E402
    MODELS,
    VARIANTS,
    build_model,
    cb_config,
    generation_config,
    make_prompts,
    serve,
    synchronize,
)
from benchmarks.cb_instruments import require_internals  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from breakgraph.patches import PatchSet  # noqa: E402

__all__ = ["LoopMarks", "RANGES", "covered", "main", "merge", "summarize_trace"]

#: transformers' CB loop method -> the range that marks it in the trace (loop order).
RANGES = {
    "prepare_next_batch": "cb.prepare",
    "_generation_step": "cb.step",
    "update_batch": "cb.update",
}
PHASES = {"cb.prepare": "prepare", "cb.step": "step", "cb.update": "update"}
#: Chrome-trace categories of work on the device (kernels inside CUDA graphs included).
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CUDA_CATEGORIES = ("cuda_runtime", "cuda_driver")
DEFAULT_VARIANTS = ("breakgraph", "breakgraph_sync", "stock_graphs_async")
SMOKE_VARIANTS = ("breakgraph", "breakgraph_sync")
LARGE_TRACE_MB = 20.0
NO_DEVICE = "none recorded: no CUDA kernel, memcpy or memset in the trace"
#: what a device event is, by its name (first match wins; the order matters: a grouped GEMM is
#: a cutlass kernel too, and a top-k "gathers")
KERNEL_KINDS = (
    ("fused by Inductor (torch.compile's Triton kernels)", ("triton_",)),
    ("MoE experts (grouped GEMM)", ("GroupProblemShape", "grouped_gemm")),
    ("attention", ("flash_fwd", "fmha", "sdpa", "attention", "paged_decode")),
    ("MoE routing (sort, top-k, histogram)", ("Sort", "TopK", "Histogram", "DeviceScan")),
    ("dense GEMM", ("nvjet", "gemm", "Gemm", "cutlass")),
    ("gather / index (paged cache, embedding)", ("gather_kernel", "index_")),
    ("copies", ("Memcpy", "Memset", "copy_kernel", "CatArray")),
    ("elementwise / reduce (norms, rotary, activations)", ("elementwise", "reduce_kernel",
                                                           "softmax")),
)  # fmt: skip
OTHER_KIND = "other"


def kernel_kind(name: str) -> str:
    """The :data:`KERNEL_KINDS` label of a device event's name (:data:`OTHER_KIND` if none).

    >>> kernel_kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>")
    'attention'
    >>> kernel_kind("Memcpy DtoD (Device -> Device)"), kernel_kind("mystery")
    ('copies', 'other')
    >>> kernel_kind("_paged_decode_kernel"), kernel_kind("triton_poi_fused_index_copy_0")
    ('attention', "fused by Inductor (torch.compile's Triton kernels)")
    """
    for kind, marks in KERNEL_KINDS:
        if any(mark in name for mark in marks):
            return kind
    return OTHER_KIND


# -- marks and the step window ----------------------------------------------------------------
def _processor_class():
    from transformers.generation.continuous_batching import continuous_api

    return continuous_api.ContinuousBatchProcessor


class LoopMarks:
    """``record_function`` ranges around transformers' CB loop, and the profiled window.

    :meth:`install` wraps the three loop methods of :data:`RANGES` for as long as the
    PatchSet holds. :meth:`arm` hands it a profiler for the next pass: the loop's thread
    starts it before the first call of ``prepare_next_batch`` that follows ``skip``
    scheduled steps and stops it ``steps`` steps later (or when the pass ends first);
    :meth:`finish` waits for that. Idle polls of the loop (no request scheduled) count no
    step. Between passes, or unarmed, a wrapper costs one ``record_function`` range.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self._reset(None, 0, 0)

    def _reset(self, profiler, skip: int, steps: int) -> None:
        self.profiler, self.skip, self.window = profiler, skip, steps
        self.steps = 0  # scheduled steps of the armed pass
        self.recording, self.recorded, self.error = False, 0, None
        self.async_batching = None  # what transformers' processor decided
        self.closed.clear()

    def install(self, patches: PatchSet) -> None:
        processor = _processor_class()
        missing = [m for m in RANGES if not callable(getattr(processor, m, None))]
        if missing:
            raise SystemExit(
                f"cb_trace: transformers {transformers.__version__} has no "
                f"ContinuousBatchProcessor.{', '.join(missing)} (the CB loop this script marks); "
                f"update benchmarks/cb_trace.py RANGES for this release"
            )
        for method, label in RANGES.items():
            original = getattr(processor, method)
            if method == "prepare_next_batch":
                wrapper = self._prepare_wrapper(original, label)
            else:
                wrapper = _ranged(original, label)
            patches.attribute(processor, method, wrapper)

    def _prepare_wrapper(self, original, label):
        def prepare_next_batch(this):
            self._boundary(this)
            with torch.profiler.record_function(label):
                scheduled = original(this)
            self._counted(scheduled)
            return scheduled

        return prepare_next_batch

    def arm(self, profiler, skip: int, steps: int) -> None:
        """Profile steps ``skip`` .. ``skip + steps - 1`` of the next pass (``skip`` >= 1)."""
        if skip < 1 or steps < 1:
            raise ValueError(f"LoopMarks.arm: skip ({skip}) and steps ({steps}) must be >= 1")
        with self._lock:
            self._reset(profiler, skip, steps)

    def _boundary(self, processor) -> None:  # the loop's thread, before each prepare
        with self._lock:
            if self.profiler is None or self.closed.is_set():
                return
            self.async_batching = getattr(processor, "use_async_batching", None)
            if not self.recording and self.steps == self.skip:
                self._act(self.profiler.start)
                self.recording = not self.closed.is_set()
            elif self.recording and self.steps == self.skip + self.window:
                self._close()

    def _counted(self, scheduled: bool) -> None:  # the loop's thread, after each prepare
        with self._lock:
            if self.profiler is None:  # unarmed (after a window: still counting the pass)
                return
            if scheduled:
                self.steps += 1
                self.recorded += self.recording
            elif self.recording:  # the pass ended inside the window
                self._close()

    def _close(self) -> None:
        self._act(self.profiler.stop)
        self.recording = False
        self.closed.set()

    def _act(self, action) -> None:
        try:
            action()
        except Exception as exc:  # raised in the main thread by finish(), never swallowed
            self.error = exc
            self.recording = False
            self.closed.set()

    def finish(self, timeout: float) -> int:
        """Wait for the window to close after a pass; the steps profiled. Raises what the
        loop's thread hit, or names ``--skip`` if the pass was too short to open it."""
        closed = self.closed.wait(timeout)
        with self._lock:
            profiler, self.profiler = self.profiler, None  # disarmed: the loop stops acting
            if self.error is not None:
                raise RuntimeError(
                    f"cb_trace: the profiler failed in transformers' CB loop thread: "
                    f"{type(self.error).__name__}: {self.error}"
                ) from self.error
            if not closed:
                if self.recording:  # never reached: an idle poll closes it first
                    self._act(profiler.stop)
                raise SystemExit(
                    f"cb_trace: the traced pass had {self.steps} steps, fewer than --skip "
                    f"{self.skip} + 1: lower --skip or serve more (--prompts, --new-tokens)"
                )
            return self.recorded


def _ranged(original, label):
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return original(*args, **kwargs)

    return wrapper


# -- the trace's numbers ----------------------------------------------------------------------
def merge(intervals) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals, sorted and disjoint.

    >>> merge([(5, 20), (0, 3), (2, 4), (25, 30)])
    [(0, 4), (5, 20), (25, 30)]
    """
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(union: list[tuple[float, float]], start: float, end: float) -> float:
    """How much of ``[start, end]`` the merged intervals ``union`` cover.

    >>> covered([(0, 4), (5, 20)], 2, 10)
    7
    """
    starts = getattr(union, "starts", None) or [s for s, _ in union]
    i = max(0, bisect.bisect_right(starts, start) - 1)
    total = 0
    while i < len(union) and union[i][0] < end:
        total += max(0, min(end, union[i][1]) - max(start, union[i][0]))
        i += 1
    return total


class _Union(list):
    """Merged intervals with their starts kept for :func:`covered`'s bisection."""

    def __init__(self, intervals) -> None:
        super().__init__(merge(intervals))
        self.starts = [s for s, _ in self]


def _iterations(ranges: list[dict]) -> list[dict]:
    """The loop's iterations that ran a step: each opens with a ``cb.prepare`` range and
    holds the ranges up to the next one (an idle poll has no ``cb.step``)."""
    iterations: list[dict] = []
    for event in sorted(ranges, key=lambda e: e["ts"]):
        phase = PHASES[event["name"]]
        if phase == "prepare":
            iterations.append({})
        if iterations:
            iterations[-1].setdefault(phase, []).append((event["ts"], event["ts"] + event["dur"]))
    return [it for it in iterations if "step" in it]


def summarize_trace(trace: dict, settle: int = 0) -> dict:
    """The overlap numbers of one exported chrome trace (times in ms, fractions 0..1).

    The window runs from the first ``cb.prepare`` kept (the first ``settle`` steps are left
    out) to the end of the last step's last range; a step's own span runs to the next
    step's ``cb.prepare``. Without CUDA activity in the trace the device numbers are None
    and ``device`` says so.

    >>> X = lambda name, cat, ts, dur: dict(name=name, cat=cat, ph="X", ts=ts, dur=dur)
    >>> trace = {"traceEvents": [
    ...     X("cb.prepare", "user_annotation", 0, 10), X("cb.step", "user_annotation", 10, 2),
    ...     X("cb.update", "user_annotation", 12, 8), X("gemm", "kernel", 5, 20),
    ...     X("cb.prepare", "user_annotation", 20, 10), X("cb.step", "user_annotation", 30, 2),
    ...     X("cb.update", "user_annotation", 32, 8)]}
    >>> s = summarize_trace(trace)
    >>> s["steps"], s["wall_ms_per_step"], s["prepare_ms_per_step"]
    (2, 0.02, 0.01)
    >>> s["prepare_device_busy_fraction"], s["device_busy_fraction"]   # 5+5 of 20; 20 of 40
    (0.5, 0.5)
    >>> s["device_ms_per_step_by_kind"]   # 20 us of "gemm" over 2 steps
    {'dense GEMM': 0.01}
    >>> summarize_trace({"traceEvents": trace["traceEvents"][:3]})["device"]
    'none recorded: no CUDA kernel, memcpy or memset in the trace'
    """
    events, iterations = _window(trace, settle)
    if not iterations:
        note = f"no complete CB step in the trace after {settle} settling steps"
        return {"steps": 0, "device": None, "note": note}
    begin, end = _bounds(iterations)
    window = end - begin
    n = len(iterations)
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    union = _Union((e["ts"], e["ts"] + e["dur"]) for e in device)
    host_cuda = [
        e for e in events if e.get("cat") in HOST_CUDA_CATEGORIES and begin <= e["ts"] < end
    ]
    syncs = [e for e in host_cuda if "Synchronize" in e["name"]]
    ms = 1e-3  # the trace counts microseconds
    out = {
        "steps": n,
        "window_ms": window * ms,
        "wall_ms_per_step": window * ms / n,
        "device": "CUDA" if device else NO_DEVICE,
        "device_events": sum(begin <= e["ts"] < end for e in device),
        "graph_launches": sum("GraphLaunch" in e["name"] for e in host_cuda),
        "host_sync_ms_per_step": sum(e["dur"] for e in syncs) * ms / n,
    }
    by_kind: dict = {}  # device time per step in the window, by kind (overlaps counted twice)
    for e in device:
        if begin <= e["ts"] < end:
            kind = kernel_kind(e["name"])
            by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"] * ms / n
    out["device_ms_per_step_by_kind"] = dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))
    busy = covered(union, begin, end)
    out["device_busy_fraction"] = busy / window if device and window else None
    out["device_idle_ms_per_step"] = (window - busy) * ms / n if device else None
    for phase in PHASES.values():
        spans = [s for it in iterations for s in it.get(phase, ())]
        length = sum(e - s for s, e in spans)
        out[f"{phase}_ms_per_step"] = length * ms / n
        overlap = sum(covered(union, s, e) for s, e in spans)
        out[f"{phase}_device_busy_fraction"] = overlap / length if device and length else None
    rows = []
    for i, it in enumerate(iterations):
        stop = iterations[i + 1]["prepare"][0][0] if i + 1 < n else end
        row = {"wall_ms": (stop - it["prepare"][0][0]) * ms}
        for phase in PHASES.values():
            spans = it.get(phase, ())
            row[f"{phase}_ms"] = sum(e - s for s, e in spans) * ms
        prep = sum(e - s for s, e in it["prepare"])
        row["prepare_device_busy_fraction"] = (
            sum(covered(union, s, e) for s, e in it["prepare"]) / prep if device and prep else None
        )
        row["device_busy_ms"] = covered(union, it["prepare"][0][0], stop) * ms if device else None
        rows.append(row)
    out["per_step"] = rows
    launches = [e for e in host_cuda if "GraphLaunch" in e["name"]]
    out["graph_launch_host_ms_per_step"] = sum(e["dur"] for e in launches) * ms / n
    nodes: dict = {}  # device events per launching call: a graph launch's kernels and copies
    for e in device:
        nodes[_correlation(e)] = nodes.get(_correlation(e), 0) + 1
    sizes = [nodes.get(_correlation(e), 0) for e in launches]
    out["largest_graph_nodes"] = max(sizes, default=0)
    big = [e["dur"] for e, size in zip(launches, sizes) if size == out["largest_graph_nodes"]]
    out["largest_graph_launch_host_ms"] = statistics.median(big) * ms if big else None
    launched = {_correlation(e) for e in device} - {None}
    blind = [e for e in host_cuda if "GraphLaunch" in e["name"]
             and _correlation(e) is not None and _correlation(e) not in launched]  # fmt: skip
    if blind:
        out["note"] = (
            f"{len(blind)} of {out['graph_launches']} graph launches have no device work in the "
            "trace: the profiler did not see the kernels inside CUDA graphs, so the device "
            "numbers undercount"
        )
    return out


def _window(trace: dict, settle: int) -> tuple[list[dict], list[dict]]:
    """The trace's complete events and its CB steps after the first ``settle``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"] in PHASES]
    return events, _iterations(ranges)[settle:]


def _bounds(iterations: list[dict]) -> tuple[float, float]:
    """From the first step's ``cb.prepare`` to the end of the last step's last range."""
    begin = iterations[0]["prepare"][0][0]
    return begin, max(e for it in iterations for spans in it.values() for _, e in spans)


def device_time_by_kernel(trace: dict, settle: int = 0) -> list[dict]:
    """Per kernel (or copy) name, its device ms and launches per step over the window of
    :func:`summarize_trace`, the largest first: which kernels make up each kind's time.

    >>> X = lambda name, cat, ts, dur: dict(name=name, cat=cat, ph="X", ts=ts, dur=dur)
    >>> trace = {"traceEvents": [
    ...     X("cb.prepare", "user_annotation", 0, 10), X("cb.step", "user_annotation", 10, 2),
    ...     X("cb.update", "user_annotation", 12, 8), X("gemm", "kernel", 5, 20),
    ...     X("gemm", "kernel", 25, 10), X("cb.prepare", "user_annotation", 20, 10)]}
    >>> device_time_by_kernel(trace)   # one step: prepare to the end of its update range
    [{'name': 'gemm', 'kind': 'dense GEMM', 'ms_per_step': 0.02, 'launches_per_step': 1.0}]
    """
    events, iterations = _window(trace, settle)
    if not iterations:
        return []
    begin, end = _bounds(iterations)
    totals: dict = {}
    for e in events:
        if e.get("cat") in DEVICE_CATEGORIES and begin <= e["ts"] < end:
            ms, launches = totals.get(e["name"], (0.0, 0))
            totals[e["name"]] = (ms + e["dur"] * 1e-3, launches + 1)
    n = len(iterations)
    rows = [
        {"name": name, "kind": kernel_kind(name), "ms_per_step": ms / n,
         "launches_per_step": launches / n}
        for name, (ms, launches) in totals.items()
    ]  # fmt: skip
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def _correlation(event: dict):
    """The id that links a CUDA runtime call to the device work it launched (Kineto's)."""
    return event.get("args", {}).get("correlation")


# -- one variant ------------------------------------------------------------------------------
def trace_variant(model, name: str, args, ctx) -> dict:
    """A manager of variant ``name``: a warm-up pass, then the traced pass; its trace file
    and :func:`summarize_trace`'s numbers."""
    variant = VARIANTS[name]
    handle = None
    if variant.breakgraph:
        handle = enable_continuous_batching(model, backend=ctx.backend,
                                            decode_graphs=variant.decode_graphs,
                                            compile=variant.compile)  # fmt: skip
    else:
        model.set_attn_implementation("sdpa")
    try:
        manager = model.init_continuous_batching(
            generation_config=ctx.gen, continuous_batching_config=cb_config(args, variant)
        )
        manager.warmup()
        synchronize(ctx.device)
        manager.start()
        try:
            serve(manager, ctx.warm, args.new_tokens)
            profiler = torch.profiler.profile(activities=ctx.activities)
            ctx.marks.arm(profiler, args.skip, args.steps)
            tokens, seconds, _ = serve(manager, ctx.traced, args.new_tokens)
            profiled = ctx.marks.finish(timeout=10.0)
            async_batching = ctx.marks.async_batching
        finally:
            manager.stop(block=True)
            manager.destroy()
    finally:
        if handle is not None:
            handle.disable()
        model.set_attn_implementation("sdpa")
    path = os.path.join(args.out, f"{name}.json.gz")
    profiler.export_chrome_trace(path)
    with gzip.open(path, "rt") as f:
        summary = summarize_trace(json.load(f), args.settle)
    generated = sum(len(t) for t in tokens)
    return {
        "what": variant.what,
        "async_batching": async_batching,
        "profiled_steps": profiled,
        "pass_steps": ctx.marks.steps,
        "pass_tokens_per_s": generated / seconds,  # profiling overhead included
        "trace": path,
        "trace_mb": os.path.getsize(path) / 2**20,
        **summary,
    }


# -- output -----------------------------------------------------------------------------------
def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def print_summary(results: dict) -> None:
    """One line per variant: the wall and host ms per step, each with the device's busy
    share, then what the traces say about async preparation."""
    meta = results["meta"]
    print(f"\n{meta['model']} on {meta['device']} (transformers {meta['transformers']}); "
          f"ms per step, (device busy during it)")  # fmt: skip
    for name, v in results["variants"].items():
        if "skipped" in v:
            print(f"  {name:<19} skipped: {v['skipped']}")
            continue
        mode = {True: "async", False: "sync", None: "?"}[v["async_batching"]]
        if not v["steps"]:
            print(f"  {name:<19} {mode:<5} {v['note']}")
            continue
        print(
            f"  {name:<19} {mode:<5} {v['steps']:>3} steps  wall {v['wall_ms_per_step']:.2f} "
            f"(busy {_pct(v['device_busy_fraction'])})  prep {v['prepare_ms_per_step']:.2f} "
            f"({_pct(v['prepare_device_busy_fraction'])})  step {v['step_ms_per_step']:.2f} "
            f"({_pct(v['step_device_busy_fraction'])})  update {v['update_ms_per_step']:.2f} "
            f"({_pct(v['update_device_busy_fraction'])})  sync {v['host_sync_ms_per_step']:.2f}"
            f"  graph launches {v.get('graph_launch_host_ms_per_step', 0.0):.2f} (largest "
            f"{v.get('largest_graph_nodes', 0)} nodes)  trace {v['trace_mb']:.1f} MB"
        )
        if v.get("note"):
            print(f"  {'':<19} note: {v['note']}")
    ran = {n: v for n, v in results["variants"].items() if v.get("steps")}
    if ran and all(v["device_busy_fraction"] is None for v in ran.values()):
        print("  device: none recorded (no CUDA activity: a CPU run measures host times only)")
    for name, v in ran.items():
        share = v["prepare_device_busy_fraction"]
        if v["async_batching"] and share is not None:
            verdict = "overlaps the device" if share >= 0.5 else "does NOT overlap the device"
            print(f"  {name}: async preparation {verdict} (busy {share:.0%} of prep)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = lambda text: [n for n in text.split(",") if n]  # noqa: E731
    parser.add_argument("--out", default="cb-trace", help="folder for the traces and summary")
    parser.add_argument("--smoke", action="store_true", help="tiny MoE, CPU, emulated backend")
    parser.add_argument("--model", default=None,
                        help=f"one of {', '.join(MODELS)} (default mixtral-1k-8l; --smoke: "
                        "tiny-mixtral)")  # fmt: skip
    parser.add_argument("--variants", type=names, default=None,
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default "
                        f"{','.join(DEFAULT_VARIANTS)})")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=256, help="page size of the cache")
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument(
        "--skip",
        type=int,
        default=6,
        help="steps of the traced pass before the profiler starts (>= 1)",
    )
    parser.add_argument("--steps", type=int, default=24, help="steps profiled")
    parser.add_argument(
        "--settle",
        type=int,
        default=2,
        help="profiled steps left out of the numbers (the profiler's start)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.model = args.model or "tiny-mixtral"
        args.variants = args.variants or list(SMOKE_VARIANTS)
        args.prompts, args.min_len, args.max_len, args.new_tokens = 8, 4, 40, 8
        args.block_size, args.num_blocks, args.max_batch_tokens = 16, 64, 32
        args.skip, args.steps, args.settle = 2, 8, 1
    args.model = args.model or "mixtral-1k-8l"
    args.variants = list(dict.fromkeys(args.variants or DEFAULT_VARIANTS))
    unknown = ({args.model} - set(MODELS)) | (set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown model or variant: {sorted(unknown)}")
    if args.skip < 1 or args.steps < 1 or not 0 <= args.settle < args.steps:
        parser.error("need --skip >= 1, --steps >= 1 and 0 <= --settle < --steps")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    compat.require("continuous_batching", "cb_trace")
    require_internals(any(VARIANTS[v].use_cuda_graph for v in args.variants))
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # tiny model: threads cost more than they save
    os.makedirs(args.out, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # the profiler's first start initialises Kineto (and CUPTI): here, in this thread, not
    # inside transformers' loop thread where the window starts it
    with torch.profiler.profile(activities=activities):
        torch.ones(8, device=device).sum().item()
    started = time.perf_counter()
    meta = environment(cuda)
    meta.update(model=args.model, device=torch.cuda.get_device_name() if cuda else "cpu",
                backend="cuda" if cuda else "emulated", dtype=str(dtype),
                args=vars(args))  # fmt: skip
    results = {"meta": meta, "variants": {}}
    config, model = build_model(args.model, device, dtype)
    ctx = _Context(args, device, cuda, activities, config)
    try:
        with PatchSet() as patches:
            ctx.marks.install(patches)
            for name in args.variants:
                if VARIANTS[name].needs_cuda and not cuda:
                    results["variants"][name] = {"skipped": f"needs CUDA "
                                                 f"({VARIANTS[name].needs_cuda})"}  # fmt: skip
                    continue
                print(f"[{args.model}] {name} ...", flush=True)
                results["variants"][name] = trace_variant(model, name, args, ctx)
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(threads)
    meta["elapsed_s"] = time.perf_counter() - started
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    print_summary(results)
    for name, v in results["variants"].items():
        if v.get("trace_mb", 0) > LARGE_TRACE_MB:
            print(f"  warning: {name}'s trace is {v['trace_mb']:.0f} MB: lower --steps")
    print(f"\ntraces and summary.json in {args.out} ({meta['elapsed_s']:.0f} s)")
    return results


class _Context:
    """What every variant of a run shares: device, workload, profiler settings, the marks."""

    def __init__(self, args, device, cuda: bool, activities, config) -> None:
        self.device, self.activities = device, activities
        self.backend = "cuda" if cuda else "emulated"
        self.gen = generation_config(args.new_tokens)
        vocab = config.vocab_size
        self.warm = make_prompts(args.prompts, args.min_len, args.max_len, vocab, seed=1)
        self.traced = make_prompts(args.prompts, args.min_len, args.max_len, vocab, seed=2)
        self.marks = LoopMarks()


if __name__ == "__main__":
    main()
