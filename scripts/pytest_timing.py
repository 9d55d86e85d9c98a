"""A pytest plugin that appends each test's duration to ``$PYTEST_TIMING_FILE`` as it ends,
and each failure's report (the traceback pytest would print at the end, and what the test
printed) to ``$PYTEST_TIMING_FILE.failures``.

``--durations`` and the failure tracebacks print only at the end of a run; a run cut by a time
limit (the device tool's) would report nothing. Use:
``PYTHONPATH=scripts PYTEST_TIMING_FILE=t.txt pytest -p pytest_timing``, then
``sort -k1 -gr t.txt | head`` (seconds, phase, test id). Under pytest-xdist (``-n 2``) each
worker appends its own tests' lines (the controller writes none).

Each line ends with `` gc=S/N``: the seconds the phase spent in N garbage collections
(``gc.callbacks``). Every CUDA capture collects once (as ``torch.cuda.graph`` does), and a
collection walks every object the process holds: this says how much of a test that is.

``$PYTEST_TIMING_FILE.timeline`` gets one line per phase too: ``WORKER START STOP PHASE
TEST_ID``, the phase's wall-clock start and stop (seconds since the epoch) and the
pytest-xdist worker that ran it (``main`` without workers), so that a run's wall time can be
laid out worker by worker (``benchmarks.suite_times --timeline``): where workers sat idle, and
which tests ran last.
"""

from __future__ import annotations

import gc
import os
import time

_file = None
_timeline = None
_gc = {"seconds": 0.0, "count": 0, "start": 0.0}


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc["start"] = time.perf_counter()
    else:
        _gc["seconds"] += time.perf_counter() - _gc["start"]
        _gc["count"] += 1


_skip = {"controller": False}


def pytest_configure(config) -> None:
    # under pytest-xdist the workers run the tests (and their collections) and write the lines;
    # the controller sees every report again and writes nothing
    numprocesses = getattr(config.option, "numprocesses", None)
    _skip["controller"] = bool(numprocesses) and not os.environ.get("PYTEST_XDIST_WORKER")
    if os.environ.get("PYTEST_TIMING_FILE") and not _skip["controller"]:
        gc.callbacks.append(_on_gc)


def pytest_runtest_logreport(report) -> None:
    global _file, _timeline
    path = os.environ.get("PYTEST_TIMING_FILE")
    if not path or _skip["controller"]:
        return
    if _file is None:
        _file = open(path, "a", buffering=1)  # noqa: SIM115 (kept open for the whole run)
        _timeline = open(path + ".timeline", "a", buffering=1)  # noqa: SIM115 (the same)
    gc_part = f"gc={_gc['seconds']:.3f}/{_gc['count']}"
    _gc["seconds"], _gc["count"] = 0.0, 0
    _file.write(f"{report.duration:.3f} {report.when} {report.outcome} {report.nodeid} {gc_part}\n")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    start, stop = f"{report.start:.3f}", f"{report.stop:.3f}"
    _timeline.write(f"{worker} {start} {stop} {report.when} {report.nodeid}\n")
    if report.failed:
        with open(path + ".failures", "a") as failures:
            failures.write(f"==== {report.when} {report.nodeid}\n{report.longreprtext}\n\n")
            # what the test printed (another thread's traceback goes to stderr)
            for title, text in report.sections:
                failures.write(f"---- {title}\n{text[-4000:]}\n")
