"""A pytest plugin that appends each test's duration to ``$PYTEST_TIMING_FILE`` as it ends,
and each failure's report (the traceback pytest would print at the end) to
``$PYTEST_TIMING_FILE.failures``.

``--durations`` and the failure tracebacks print only at the end of a run; a run cut by a time
limit (the device tool's) would report nothing. Use:
``PYTHONPATH=scripts PYTEST_TIMING_FILE=t.txt pytest -p pytest_timing``, then
``sort -k1 -gr t.txt | head`` (seconds, phase, test id).
"""

from __future__ import annotations

import os

_file = None


def pytest_runtest_logreport(report) -> None:
    global _file
    path = os.environ.get("PYTEST_TIMING_FILE")
    if not path:
        return
    if _file is None:
        _file = open(path, "a", buffering=1)  # noqa: SIM115 (kept open for the whole run)
    _file.write(f"{report.duration:.3f} {report.when} {report.outcome} {report.nodeid}\n")
    if report.failed:
        with open(path + ".failures", "a") as failures:
            failures.write(f"==== {report.when} {report.nodeid}\n{report.longreprtext}\n\n")
