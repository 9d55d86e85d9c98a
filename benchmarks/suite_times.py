"""A test-suite run's time as JSON for the performance page: where the seconds went, per file.

``scripts/pytest_timing.py`` writes one line per test phase as the run goes (so a run cut by a
time limit still leaves its times); pytest's log ends with the run's counts and wall time.
This turns both into one JSON (schema :data:`SCHEMA`) that ``benchmarks.report_tests`` puts
on the page::

    PYTHONPATH=scripts PYTEST_TIMING_FILE=times.txt \\
        python -m pytest -p pytest_timing -m requires_cuda tests 2>&1 | tee suite.log
    python -m benchmarks.suite_times --times times.txt --log suite.log --label "after" \\
        --selection "-m requires_cuda" --gpu "NVIDIA H200" --torch 2.11.0+cu130 \\
        --transformers 5.17.0 --date 2026-12-02 --out docs/results/h200-cuda-suite-times.json

The versions are options (not read from this process) because the run happened elsewhere.
"""

from __future__ import annotations

import argparse
import json
import re

SCHEMA = "breakgraph-suite-times/1"
SLOWEST = 10  # test ids listed in "slowest"

_SUMMARY = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+) in ([\d.]+)s\b")
_COUNT = re.compile(r"(\d+) ([a-z]+)")
_PLURAL = {"error": "errors", "warning": "warnings"}


def parse_timing_line(line: str) -> dict | None:
    """One line of ``pytest_timing``'s file, or ``None`` for a blank line.

    ``SECONDS PHASE OUTCOME TEST_ID gc=GC_SECONDS/COLLECTIONS``; the test id may hold spaces
    (parametrize ids do), and files written before the gc field have none (``gc_s`` and
    ``collections`` are ``None`` then: not recorded, which is not zero).

    Example::

        >>> parse_timing_line("1.250 call passed tests/t.py::f[tiny kernels-a] gc=0.500/3")
        ... # doctest: +NORMALIZE_WHITESPACE
        {'seconds': 1.25, 'phase': 'call', 'outcome': 'passed',
         'test': 'tests/t.py::f[tiny kernels-a]', 'gc_s': 0.5, 'collections': 3}
        >>> parse_timing_line("0.010 setup skipped tests/t.py::g")["gc_s"] is None
        True
    """
    fields = line.split()
    if not fields:
        return None
    if len(fields) < 4:
        raise ValueError(
            f"parse_timing_line: expected 'SECONDS PHASE OUTCOME TEST_ID', got {line!r}"
        )
    gc_s = collections = None
    if fields[-1].startswith("gc=") and len(fields) > 4:
        seconds, _, count = fields.pop()[len("gc=") :].partition("/")
        gc_s, collections = float(seconds), int(count)
    return {
        "seconds": float(fields[0]),
        "phase": fields[1],
        "outcome": fields[2],
        "test": " ".join(fields[3:]),
        "gc_s": gc_s,
        "collections": collections,
    }


def parse_summary(log: str) -> dict:
    """Counts and wall seconds from the last summary line of a pytest log.

    Example::

        >>> parse_summary("...\\n370 passed, 57 skipped, 540 deselected, 330 warnings "
        ...               "in 203.00s (0:03:23)\\ncuda suite rc=0\\n")
        ... # doctest: +NORMALIZE_WHITESPACE
        {'wall_s': 203.0, 'counts': {'passed': 370, 'skipped': 57, 'failed': 0,
         'deselected': 540, 'warnings': 330}}
        >>> parse_summary("== 1 failed, 2 passed, 1 error in 3.50s ==")["counts"]["errors"]
        1
    """
    found = None
    for line in log.splitlines():
        match = _SUMMARY.match(line.strip())
        if match:
            found = match
    if found is None:
        raise ValueError(
            "parse_summary: no pytest summary line ('N passed, ... in S.SSs') in the log; "
            "was the run cut before it ended?"
        )
    counts = {"passed": 0, "skipped": 0, "failed": 0}
    for number, word in _COUNT.findall(found.group(1)):
        counts[_PLURAL.get(word, word)] = int(number)
    return {"wall_s": float(found.group(2)), "counts": counts}


def _total(values: list) -> float | None:
    """Sum of the recorded values; ``None`` when none was recorded."""
    seen = [v for v in values if v is not None]
    return round(sum(seen), 3) if seen else None


def summarize(lines: list[dict]) -> dict:
    """Totals, per file and the slowest tests of parsed timing lines.

    Example::

        >>> rows = [parse_timing_line(s) for s in (
        ...     "2.0 call passed tests/a.py::x gc=1.000/2", "0.5 setup passed tests/a.py::y",
        ...     "3.0 call passed tests/b.py::z gc=0.100/1")]
        >>> s = summarize(rows)
        >>> s["tests_s"], s["gc_s"], s["collections"], [f["file"] for f in s["per_file"]]
        (5.5, 1.1, 3, ['tests/b.py', 'tests/a.py'])
        >>> s["slowest"][0]
        {'test': 'tests/b.py::z', 'seconds': 3.0, 'gc_s': 0.1}
    """
    by_test: dict[str, list[dict]] = {}
    for line in lines:
        by_test.setdefault(line["test"], []).append(line)
    by_file: dict[str, list[dict]] = {}
    for line in lines:
        by_file.setdefault(line["test"].split("::")[0], []).append(line)

    def totals(group: list[dict]) -> dict:
        return {
            "seconds": round(sum(line["seconds"] for line in group), 3),
            "gc_s": _total([line["gc_s"] for line in group]),
            "collections": _total([line["collections"] for line in group]),
        }

    per_file = [
        {"file": name, **totals(group), "tests": len({line["test"] for line in group})}
        for name, group in by_file.items()
    ]
    per_file.sort(key=lambda f: (-f["seconds"], f["file"]))
    slowest = [
        {"test": name, "seconds": t["seconds"], "gc_s": t["gc_s"]}
        for name, group in by_test.items()
        for t in [totals(group)]
    ]
    slowest.sort(key=lambda t: (-t["seconds"], t["test"]))
    everything = totals(lines)
    if everything["collections"] is not None:
        everything["collections"] = int(everything["collections"])
    for f in per_file:
        if f["collections"] is not None:
            f["collections"] = int(f["collections"])
    return {
        "tests": len(by_test),
        "tests_s": everything["seconds"],
        "gc_s": everything["gc_s"],
        "collections": everything["collections"],
        "per_file": per_file,
        "slowest": slowest[:SLOWEST],
    }


def workers(timeline: str) -> dict:
    """Worker by worker, from ``pytest_timing``'s timeline (``WORKER START STOP PHASE
    TEST_ID`` per line): the span from the first phase's start to the last one's stop, each
    worker's seconds inside tests (*busy*) and outside them from the first test of any worker
    until it stopped (*idle*: a later start, waits between tests), its stop, and the test it
    ran last. Times are seconds from the first start of any worker; what happens before it
    (start-up, collection) is not in the timeline.

    Example::

        >>> t = workers("gw0 100.0 102.0 call tests/a.py::x\\n"
        ...             "gw1 101.0 101.5 call tests/a.py::y\\n"
        ...             "gw1 103.0 110.0 call tests/b.py::z\\n")
        >>> t["span_s"], [(w["worker"], w["busy_s"], w["idle_s"], w["stop_s"])
        ...               for w in t["workers"]]
        (10.0, [('gw0', 2.0, 0.0, 2.0), ('gw1', 7.5, 2.5, 10.0)])
        >>> t["workers"][1]["last_test"]
        'tests/b.py::z'
    """
    rows = []
    for line in timeline.splitlines():
        if line.strip():
            worker, start, stop, _phase, test = line.split(maxsplit=4)
            rows.append((worker, float(start), float(stop), test))
    if not rows:
        raise ValueError("workers: the timeline holds no line")
    origin = min(start for _, start, _, _ in rows)
    out = []
    for worker in sorted({w for w, *_ in rows}):
        mine = sorted((r for r in rows if r[0] == worker), key=lambda r: r[2])
        busy = sum(stop - start for _, start, stop, _ in mine)
        stop = mine[-1][2] - origin
        out.append({"worker": worker, "tests": len({r[3] for r in mine}),
                    "busy_s": round(busy, 3), "idle_s": round(stop - busy, 3),
                    "stop_s": round(stop, 3), "last_test": mine[-1][3]})  # fmt: skip
    return {"span_s": round(max(w["stop_s"] for w in out), 3), "workers": out}


def suite_times(times: str, log: str, label: str, selection: str, meta: dict | None = None) -> dict:
    """The JSON record of one run from the texts of its timing file and pytest log.

    Example::

        >>> run = suite_times("1.5 call passed tests/a.py::x gc=0.750/1\\n",
        ...                   "1 passed in 2.00s", "after", "-m requires_cuda", {"gpu": None})
        >>> run["schema"], run["wall_s"], run["counts"]["passed"], run["gc_s"]
        ('breakgraph-suite-times/1', 2.0, 1, 0.75)
    """
    lines = [row for row in map(parse_timing_line, times.splitlines()) if row is not None]
    if not lines:
        raise ValueError("suite_times: the timing file holds no line")
    summary = parse_summary(log)
    return {
        "schema": SCHEMA,
        "meta": dict(meta or {}),
        "label": label,
        "selection": selection,
        "wall_s": summary["wall_s"],
        "counts": summary["counts"],
        **summarize(lines),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--times", required=True, help="PYTEST_TIMING_FILE of the run")
    parser.add_argument("--log", required=True, help="pytest's output (its last summary line)")
    parser.add_argument("--label", required=True, help="what this run is, for the page")
    parser.add_argument(
        "--selection", default="", help="pytest's selection, e.g. '-m requires_cuda'"
    )
    parser.add_argument(
        "--timeline", default=None, help="pytest_timing's .timeline file: the run worker by worker"
    )
    parser.add_argument("--out", required=True)
    for key in ("gpu", "torch", "transformers", "date"):
        parser.add_argument(f"--{key}", default=None, help=f"the run's {key} (meta)")
    args = parser.parse_args(argv)
    with open(args.times) as f:
        times = f.read()
    with open(args.log) as f:
        log = f.read()
    meta = {k: getattr(args, k) for k in ("gpu", "torch", "transformers", "date")}
    result = suite_times(times, log, args.label, args.selection, meta)
    if args.timeline:
        with open(args.timeline) as f:
            result["timeline"] = workers(f.read())
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
