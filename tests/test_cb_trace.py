"""The continuous-batching trace (``benchmarks/cb_trace.py``) on the CPU: the overlap
arithmetic on a hand-made chrome trace, the step window of the loop marks, and the whole
script in smoke mode (tiny MoE, emulated backend: traces written, no CUDA activity and the
summary saying so, transformers' methods restored)."""

from __future__ import annotations

import doctest
import gzip
import json

import pytest

transformers = pytest.importorskip("transformers")


from benchmarks import cb_trace  # noqa: E402
from tests.helpers import (  # noqa: E402
    needs_continuous_batching,
    no_full_collections_in_cb_cleanup,
)

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("one_cpu_thread")]
needs_cb = needs_continuous_batching()


def _x(name, cat, ts, dur):
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur}


def _step(t0, prep, step, update):
    """One loop iteration's ranges from ``t0`` (microseconds)."""
    return [
        _x("cb.prepare", "user_annotation", t0, prep),
        _x("cb.step", "user_annotation", t0 + prep, step),
        _x("cb.update", "user_annotation", t0 + prep + step, update),
    ]


def test_docstring_examples():
    result = doctest.testmod(cb_trace)
    assert result.attempted > 0 and result.failed == 0


def test_summary_counts_device_time_inside_each_host_range():
    events = [
        *_step(0, 100, 10, 90),  # settling step: left out
        *_step(200, 100, 10, 90),
        _x("cb.prepare", "user_annotation", 400, 5),  # an idle poll: no step
        *_step(405, 100, 10, 95),
        # device: busy over 250..350 (two overlapping kernels, counted once) and 500..600
        _x("gemm", "kernel", 250, 80),
        dict(_x("attn", "kernel", 300, 50), args={"correlation": 7}),  # the graph's
        _x("copy", "gpu_memcpy", 500, 100),
        _x("cb.prepare", "gpu_user_annotation", 0, 600),  # not device work
        _x("cudaStreamSynchronize", "cuda_runtime", 320, 40),
        dict(_x("cudaGraphLaunch", "cuda_runtime", 312, 2), args={"correlation": 7}),
        _x("aten::mm", "cpu_op", 210, 50),
    ]
    s = cb_trace.summarize_trace({"traceEvents": events}, settle=1)
    assert s["steps"] == 2 and s["window_ms"] == pytest.approx(0.41)  # 200 .. 610
    assert s["wall_ms_per_step"] == pytest.approx(0.205)
    assert s["prepare_ms_per_step"] == pytest.approx(0.1)  # the poll is no step's
    # prep 200..300 sees 50 busy, prep 405..505 sees 5
    assert s["prepare_device_busy_fraction"] == pytest.approx(55 / 200)
    assert s["device_busy_fraction"] == pytest.approx(200 / 410)
    assert s["device_idle_ms_per_step"] == pytest.approx(0.105)
    assert s["update_device_busy_fraction"] == pytest.approx((40 + 85) / 185)
    assert s["host_sync_ms_per_step"] == pytest.approx(0.02) and s["graph_launches"] == 1
    assert s["device"] == "CUDA" and s["device_events"] == 3
    first, second = s["per_step"]
    assert first["wall_ms"] == pytest.approx(0.205)
    assert first["device_busy_ms"] == pytest.approx(0.1)
    assert second["prepare_device_busy_fraction"] == pytest.approx(5 / 100)
    assert "note" not in s


def test_summary_flags_graph_launches_whose_kernels_are_missing():
    launch = dict(_x("cudaGraphLaunch", "cuda_runtime", 12, 2), args={"correlation": 9})
    kernel = dict(_x("attn", "kernel", 14, 5), args={"correlation": 8})  # an eager one
    s = cb_trace.summarize_trace({"traceEvents": [*_step(0, 10, 5, 5), launch, kernel]})
    assert s["graph_launches"] == 1 and "1 of 1 graph launches have no device work" in s["note"]


def test_summary_without_device_work_says_so():
    s = cb_trace.summarize_trace({"traceEvents": _step(0, 10, 5, 5) + _step(20, 10, 5, 5)})
    assert s["steps"] == 2 and s["device"].startswith("none recorded")
    assert s["device_busy_fraction"] is None and s["prepare_device_busy_fraction"] is None
    assert s["prepare_ms_per_step"] == pytest.approx(0.01)
    empty = cb_trace.summarize_trace({"traceEvents": _step(0, 10, 5, 5)}, settle=1)
    assert empty["steps"] == 0 and "settling" in empty["note"]


def test_printed_summary_says_whether_async_preparation_overlaps(capsys):
    row = dict(what="w", steps=4, wall_ms_per_step=9.0, device_busy_fraction=0.6,
               prepare_ms_per_step=8.8, step_ms_per_step=1.0, update_ms_per_step=0.3,
               step_device_busy_fraction=0.9, update_device_busy_fraction=0.8,
               host_sync_ms_per_step=0.2, trace_mb=1.0)  # fmt: skip
    variants = {
        "breakgraph": dict(row, async_batching=True, prepare_device_busy_fraction=0.12),
        "stock_graphs_async": dict(row, async_batching=True, prepare_device_busy_fraction=0.9),
        "breakgraph_sync": dict(row, async_batching=False, prepare_device_busy_fraction=0.0),
    }
    meta = {"model": "m", "device": "gpu", "transformers": "5.24.0"}
    cb_trace.print_summary({"meta": meta, "variants": variants})
    out = capsys.readouterr().out
    assert "breakgraph: async preparation does NOT overlap the device (busy 12% of prep)" in out
    assert "stock_graphs_async: async preparation overlaps the device (busy 90%" in out
    assert "breakgraph_sync: async" not in out and "prep 8.80 (12%)" in out


class _Profiler:
    def __init__(self):
        self.calls = []

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")


def _loop(marks, scheduled):
    """What the wrapped ``prepare_next_batch`` does around each call of the loop."""
    for s in scheduled:
        marks._boundary(object())
        marks._counted(s)


def test_window_opens_after_skip_steps_and_closes_after_steps():
    marks, profiler = cb_trace.LoopMarks(), _Profiler()
    _loop(marks, [True] * 3)  # unarmed: nothing happens
    marks.arm(profiler, skip=2, steps=3)
    _loop(marks, [False, True, True])  # an idle poll first, then two steps
    assert profiler.calls == []
    _loop(marks, [True, True, True])
    assert profiler.calls == ["start"] and marks.recording
    _loop(marks, [True, True, False])
    assert profiler.calls == ["start", "stop"] and marks.finish(timeout=0) == 3


def test_window_closes_when_the_pass_ends_inside_it():
    marks, profiler = cb_trace.LoopMarks(), _Profiler()
    marks.arm(profiler, skip=1, steps=10)
    _loop(marks, [True, True, True, False, False])
    assert profiler.calls == ["start", "stop"] and marks.finish(timeout=0) == 2


def test_a_pass_shorter_than_skip_names_the_flag():
    marks, profiler = cb_trace.LoopMarks(), _Profiler()
    marks.arm(profiler, skip=5, steps=2)
    _loop(marks, [True, True, False])
    with pytest.raises(SystemExit, match="--skip 5"):
        marks.finish(timeout=0)
    _loop(marks, [True] * 8)  # disarmed
    assert profiler.calls == []


def test_a_profiler_failure_in_the_loop_thread_is_raised():
    class Broken(_Profiler):
        def start(self):
            raise RuntimeError("CUPTI unavailable")

    marks = cb_trace.LoopMarks()
    marks.arm(Broken(), skip=1, steps=2)
    _loop(marks, [True, True])
    with pytest.raises(RuntimeError, match="CB loop thread: RuntimeError: CUPTI unavailable"):
        marks.finish(timeout=0)


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        cb_trace.parse_args(["--steps", "4", "--settle", "4"])
    with pytest.raises(SystemExit):
        cb_trace.parse_args(["--model", "no-such-model"])
    args = cb_trace.parse_args(["--smoke"])
    assert args.model == "tiny-mixtral" and args.variants == list(cb_trace.SMOKE_VARIANTS)


@needs_cb
def test_smoke_run_writes_traces_and_summary(tmp_path, monkeypatch):
    """``python -m benchmarks.cb_trace --smoke`` in-process: one gzip'd chrome trace per
    variant holding the marked steps, the summary on disk, the CUDA-only variant skipped,
    no device numbers on the CPU, and transformers' loop methods restored."""
    no_full_collections_in_cb_cleanup(monkeypatch)
    processor = cb_trace._processor_class()
    before = {m: processor.__dict__[m] for m in cb_trace.RANGES}
    variants = "breakgraph,breakgraph_sync,stock_graphs_async"
    results = cb_trace.main(["--smoke", "--variants", variants, "--out", str(tmp_path)])
    assert {m: processor.__dict__[m] for m in cb_trace.RANGES} == before
    with open(tmp_path / "summary.json") as f:
        assert json.load(f)["variants"].keys() == results["variants"].keys()
    assert "needs CUDA" in results["variants"]["stock_graphs_async"]["skipped"]
    for name in ("breakgraph", "breakgraph_sync"):
        v = results["variants"][name]
        assert v["async_batching"] is False  # the CPU: transformers never runs async there
        assert v["profiled_steps"] == 8 and v["steps"] == 7 and len(v["per_step"]) == 7
        assert v["pass_steps"] > v["profiled_steps"] + 2  # the window closed inside the pass
        assert v["wall_ms_per_step"] > v["prepare_ms_per_step"] > 0 and v["step_ms_per_step"] > 0
        assert v["device"].startswith("none recorded") and v["device_busy_fraction"] is None
        assert v["trace"] == str(tmp_path / f"{name}.json.gz") and v["trace_mb"] < 5
        with gzip.open(v["trace"], "rt") as f:
            events = json.load(f)["traceEvents"]
        marked = [e["name"] for e in events if e.get("cat") == "user_annotation"]
        assert marked.count("cb.step") == 8 and {"cb.prepare", "cb.update"} <= set(marked)
