"""Two sections of the performance page about time spent before any model is served: the
CUDA test suite's wall time (``benchmarks.suite_times``' JSON) and where a runner's
construction goes (``benchmarks.capture_profile``'s JSON). Tables and generated lines from
code, prose from ``performance.md.in``, targets from ``targets.py``."""

from __future__ import annotations

import statistics

from . import targets as T
from .template import bullets, fill, num, pct, table

SUITE_FILE = "h200-cuda-suite-times.json"  # the latest CUDA run (replaced by newer runs)
#: the latest run before the slow tests were dealt over the workers' first chunks (session 28)
SUITE_EARLIER_FILE = "h200-cuda-suite-times-session28.json"
SUITE_BEFORE_FILE = "h200-cuda-suite-times-before.json"  # before captures stopped collecting
SUITE_WHOLE_FILE = "h200-suite-times-whole.json"  # the whole suite (emulated and CUDA tests)
#: the same tests in one process, where the latest run used pytest-xdist workers
SUITE_SERIAL_FILE = "h200-cuda-suite-times-serial.json"
#: the CUDA tests on the newest transformers supported: the latest run, and session 24's
SUITE_NEWEST_FILE = "h200-cuda-suite-times-5.24-session35.json"
SUITE_NEWEST_EARLIER_FILE = "h200-cuda-suite-times-5.24.json"
#: the earlier run's command again, later, on another lease of the machine (with a timeline)
SUITE_AGAIN_FILE = "h200-cuda-suite-times-again.json"
#: six workers, before and with the layout over the workers' first chunks (with timelines)
SUITE_SIX_FILES = ("h200-cuda-suite-times-six-chunked.json", "h200-cuda-suite-times-six.json")
#: four workers with the layout's first version, which dealt the slow tests in turn (session 30)
SUITE_LAYOUT_FIRST_FILE = "h200-cuda-suite-times-layout-first.json"
#: four workers with the layout dealing by cost and capacity, before the GPU's random packed
#: batches were dealt too (session 31; the latest run, SUITE_FILE, has them)
SUITE_COST_FILE = "h200-cuda-suite-times-cost.json"
#: the same, with the GPU's random packed batches dealt too (session 31's last run)
SUITE_DEALT_FILE = "h200-cuda-suite-times-dealt.json"
#: session 32's run, on its own tests (the latest, SUITE_FILE, is session 35's)
SUITE_SESSION32_FILE = "h200-cuda-suite-times-session32.json"
#: sessions 55's and 56's runs on an H100 (no H200 came), transformers 5.17.0 then 5.24.0 each:
#: the suite as it is now, on another card than the target names (the table's rows, a line each)
SUITE_OTHER_CARD_FILES = ("h100-cuda-suite-times-session55.json",
                          "h100-cuda-suite-times-5.24-session55.json",
                          "h100-cuda-suite-times-session56.json",
                          "h100-cuda-suite-times-5.24-session56.json")  # fmt: skip
AGAIN_MIN_S = 1.0  # tests compared between a run and a later one: at least this long in the first
PROFILE_FILE = "h200-capture-profile.json"
#: the whole suite on a CPU machine like CI's: the README's command (pytest-xdist, two workers)
#: and the same tests in one process
CPU_SUITE_FILE = "cpu-suite-times.json"
CPU_SUITE_SERIAL_FILE = "cpu-suite-times-serial.json"
#: the README's command with ``tests/conftest.layout`` on and off, in turn on one VM, in the
#: order they ran: (file, layout on, turn)
CPU_LAYOUT_FILES = (("cpu-suite-times-layout-on-1.json", True, 1),
                    ("cpu-suite-times-layout-off-1.json", False, 1),
                    ("cpu-suite-times-layout-off-2.json", False, 2),
                    ("cpu-suite-times-layout-on-2.json", True, 2))  # fmt: skip
#: the README's command on the tree before session 32's cuts of the suite's slowest work
#: (074b68f) and after them, in turn on one VM: (file, after the cuts, turn)
CPU_CUTS_FILES = (("cpu-suite-times-cuts-before-1.json", False, 1),
                  ("cpu-suite-times-cuts-after-1.json", True, 1),
                  ("cpu-suite-times-cuts-after-2.json", True, 2),
                  ("cpu-suite-times-cuts-before-2.json", False, 2))  # fmt: skip
#: the README's command before and after session 33's removal of idle seconds, in turn
CPU_WAITS_FILES = (("cpu-suite-times-waits-before-1.json", False, 1),
                   ("cpu-suite-times-waits-after-1.json", True, 1),
                   ("cpu-suite-times-waits-after-2.json", True, 2),
                   ("cpu-suite-times-waits-before-2.json", False, 2))  # fmt: skip
CUT_TESTS = 6  # tests named in the cuts' line, the largest changes first
TOP_FILES = 10  # files in the per-file table
SLOWEST_FILES = 3  # files named where the target is missed
LARGEST_PARTS = 3  # parts named per runner


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else num(value, digits)


def gc_share(run: dict) -> float | None:
    """The share of a run's test seconds spent in garbage collections (``None``: not recorded).

    Example::

        >>> round(gc_share({"tests_s": 345.4, "gc_s": 172.9}), 3)
        0.501
        >>> gc_share({"tests_s": 10.0, "gc_s": None}) is None
        True
    """
    if run.get("gc_s") is None or not run.get("tests_s"):
        return None
    return run["gc_s"] / run["tests_s"]


def suite_verdict(run: dict) -> str:
    """``"met"`` or ``"missed"``: the run's wall time against ``TARGET_CUDA_SUITE_S``.

    Example::

        >>> suite_verdict({"wall_s": 150.0}), suite_verdict({"wall_s": 203.0})
        ('met', 'missed')
    """
    return "met" if run["wall_s"] <= T.TARGET_CUDA_SUITE_S else "missed"


def suite_runs_table(runs: list[dict]) -> str:
    rows = []
    for run in runs:
        share = gc_share(run)
        counts = run["counts"]
        rows.append(
            [
                run["label"],
                _cell(run["wall_s"]),
                _cell(run["tests_s"]),
                _cell(run["gc_s"]),
                "-" if share is None else pct(share),
                "-" if run["collections"] is None else run["collections"],
                counts.get("passed", 0),
                counts.get("skipped", 0),
                counts.get("failed", 0) + counts.get("errors", 0),
                suite_verdict(run),
            ]
        )
    header = [
        "run",
        "wall s",
        "test s",
        "of which gc s",
        "gc share",
        "collections",
        "passed",
        "skipped",
        "failed",
        f"target ≤ {T.TARGET_CUDA_SUITE_S:g} s",
    ]
    return table(header, rows)


def per_file_table(run: dict, before: dict | None) -> str:
    """The run's slowest files; ``before``'s seconds beside them where it has the file."""
    old = {f["file"]: f for f in (before or {}).get("per_file", [])}
    rows = []
    for f in run["per_file"][:TOP_FILES]:
        prev = old.get(f["file"])
        rows.append(
            [
                f"`{f['file']}`",
                f["tests"],
                _cell(f["seconds"]),
                _cell(f["gc_s"]),
                "-" if prev is None else f"{_cell(prev['seconds'])} ({_cell(prev['gc_s'])})",
            ]
        )
    return table(["file", "tests", "seconds", "gc s", "before: seconds (gc s)"], rows)


def suite_verdict_line(run: dict) -> str:
    """The latest run against the target; where missed, by how much and its slowest files."""
    target = T.TARGET_CUDA_SUITE_S
    if suite_verdict(run) == "met":
        return fill(
            "tests.suite.met", label=run["label"], wall=_cell(run["wall_s"]), target=f"{target:g}"
        )
    slowest = ", ".join(
        f"`{f['file']}` {_cell(f['seconds'])} s" for f in run["per_file"][:SLOWEST_FILES]
    )
    over = run["wall_s"] - target
    return fill(
        "tests.suite.missed",
        label=run["label"],
        wall=_cell(run["wall_s"]),
        target=f"{target:g}",
        over=_cell(over),
        over_pct=pct(over / target),
        slowest=slowest,
    )


def other_card_line(runs: list) -> str:
    """The runs on another card than the target names: each against the target, and what
    failed in them (empty without runs)."""
    if not runs:
        return ""
    lines = " ".join(suite_verdict_line(r).strip("\n") for r in runs)
    failed = [f"*{r['label']}*: {r['counts'].get('failed', 0)}" for r in runs
              if r["counts"].get("failed", 0)]  # fmt: skip
    return fill("tests.suite.other_card", gpu=(runs[0].get("meta") or {}).get("gpu") or "-",
                lines=lines, failed="; ".join(failed) or "none").strip("\n")  # fmt: skip


def gc_paragraph(before: dict | None, run: dict) -> str:
    """What the collections cost before (computed from ``before``), and what is left."""
    share, share_now = (gc_share(before) if before else None), gc_share(run)
    if share is None or share_now is None:
        return ""
    return fill(
        "tests.suite.gc",
        before_gc=_cell(before["gc_s"], 0),
        before_tests=_cell(before["tests_s"], 0),
        before_share=pct(share),
        before_collections=before["collections"],
        before_wall=_cell(before["wall_s"], 0),
        wall=_cell(run["wall_s"], 0),
        gc=_cell(run["gc_s"]),
        share=pct(share_now),
        collections=run["collections"],
    )


def whole_suite_line(whole: dict | None) -> str:
    """One line on the whole suite (emulated and CUDA tests) on the GPU machine, if measured."""
    if whole is None:
        return ""
    counts = whole["counts"]
    return fill(
        "tests.suite.whole",
        file=SUITE_WHOLE_FILE,
        wall=_cell(whole["wall_s"]),
        passed=counts.get("passed", 0),
        skipped=counts.get("skipped", 0),
        failed=counts.get("failed", 0),
    ).strip("\n")


def cpu_suite_line(run: dict | None, serial: dict | None) -> str:
    """The whole suite on a CPU machine like CI's against its target (``run``, the README's
    command), beside the same tests in one process (``serial``), if measured."""
    if run is None:
        return ""
    meta, counts, target = run.get("meta") or {}, run["counts"], T.TARGET_CPU_SUITE_S
    slowest = ", ".join(
        f"`{t['test'].split('::')[-1]}` {_cell(t['seconds'])} s" for t in run["slowest"][:3]
    )
    return fill(
        "tests.suite.cpu",
        files="`, `".join([CPU_SUITE_FILE] + ([CPU_SUITE_SERIAL_FILE] if serial else [])),
        torch=meta.get("torch") or "-",
        transformers=meta.get("transformers") or "-",
        date=meta.get("date") or "-",
        cores=T.CPU_SUITE_CORES,
        label=run["label"],
        wall=_cell(run["wall_s"]),
        passed=counts.get("passed", 0),
        skipped=counts.get("skipped", 0),
        failed=counts.get("failed", 0),
        serial=_cell(serial["wall_s"]) if serial else "-",
        tests_s=_cell(run["tests_s"]),
        serial_tests_s=_cell(serial["tests_s"]) if serial else "-",
        target=f"{target:g}",
        verdict="meets" if run["wall_s"] <= target else "misses",
        slowest=slowest,
    ).strip("\n")


def slowdown(reference: dict, later: list[dict]) -> list[float]:
    """Sorted time ratios, later over ``reference``, of the tests both list among their
    slowest, those under :data:`AGAIN_MIN_S` in ``reference`` left out.

    Example::

        >>> ref = {"slowest": [{"test": "a", "seconds": 2.0}, {"test": "b", "seconds": 0.5}]}
        >>> slowdown(ref, [{"slowest": [{"test": "a", "seconds": 3.0},
        ...                             {"test": "b", "seconds": 5.0}]}])
        [1.5]
    """
    before = {t["test"]: t["seconds"] for t in reference["slowest"]}
    return sorted(t["seconds"] / before[t["test"]] for run in later for t in run["slowest"]
                  if before.get(t["test"], 0) >= AGAIN_MIN_S)  # fmt: skip


def again_line(run: dict, again: dict | None) -> str | None:
    """The latest run's command again (``again``): its wall against the target, and how much
    longer the tests that both runs timed took (the median over tests of at least
    :data:`AGAIN_MIN_S` in ``run``), from its list of slowest tests."""
    if again is None:
        return None
    ratios = slowdown(run, [again])
    return fill(
        "tests.suite.again",
        label=again["label"], date=(again.get("meta") or {}).get("date") or "-",
        wall=_cell(again["wall_s"]), target=f"{T.TARGET_CUDA_SUITE_S:g}",
        verdict=suite_verdict(again), tests_s=_cell(again["tests_s"]),
        run_tests_s=_cell(run["tests_s"]), run_wall=_cell(run["wall_s"]),
        common=len(ratios), ratios=f"{num(ratios[0])}–{num(ratios[-1])}" if ratios else "-",
        median=num(statistics.median(ratios)) if ratios else "-",
        outcome=_outcome(again["counts"]),
    )


def _outcome(counts: dict) -> str:
    """``"Every test it ran passed"`` or how many failed (errors counted as failures)."""
    failed = counts.get("failed", 0) + counts.get("errors", 0)
    return "Every test it ran passed" if not failed else f"{failed} of its tests failed"


def cpu_layout_line(cpu: dict | None, runs: list) -> str | None:
    """The README's command with the layout on and off in turn (``runs``: ``(data, on, turn)``
    of :data:`CPU_LAYOUT_FILES`), beside the committed CPU run ``cpu``: their walls, how
    evenly the two workers finished, and how much slower the VM's tests ran than in ``cpu``."""
    if cpu is None or len(runs) != len(CPU_LAYOUT_FILES):
        return None
    on = [d for d, state, _ in runs if state]
    off = [d for d, state, _ in runs if not state]
    ratios = slowdown(cpu, on)
    gaps = []
    for d, _, _ in runs:
        stops = [w["stop_s"] for w in d["timeline"]["workers"]]
        gaps.append(max(stops) - min(stops))
    walls = lambda ds: ", ".join(_cell(d["wall_s"]) for d in ds)  # noqa: E731
    worst = max(d["wall_s"] for d in on)
    failed = {d["counts"].get("failed", 0) for d in off}
    return fill(
        "tests.suite.cpu_layout",
        date=(on[0].get("meta") or {}).get("date") or "-",
        files="`, `".join(name for name, *_ in CPU_LAYOUT_FILES),
        order=", ".join("on" if state else "off" for _, state, _ in runs),
        on=walls(on), off=walls(off), failed="/".join(map(str, sorted(failed))),
        gap=_cell(max(gaps)), tests_s=" and ".join(_cell(d["tests_s"]) for d in on),
        cpu_tests_s=_cell(cpu["tests_s"]), cpu_wall=_cell(cpu["wall_s"]),
        median=num(statistics.median(ratios)) if ratios else "-", common=len(ratios),
        verdict="meets" if worst <= T.TARGET_CPU_SUITE_S else "misses",
        target=f"{T.TARGET_CPU_SUITE_S:g}",
    )


def cpu_cuts_line(
    runs: list, files: tuple = CPU_CUTS_FILES, fragment: str = "tests.suite.cpu_cuts", **extra
) -> str | None:
    """The README's command before and after a round of cuts, in turn (``runs``: ``(data,
    after, turn)`` of ``files``, :data:`CPU_CUTS_FILES` for session 32's, or
    :data:`CPU_WAITS_FILES` for session 33's, with its ``fragment``): the walls, the tests' own
    seconds, and the tests whose time changed most (each side's median over its runs; a test
    missing from a run's list of slowest counts as 0 s there: it was under the list's last
    entry). Where the slower run after misses the target, ``fragment``'s ``.rest`` says why.
    ``extra``: more of ``fragment``'s placeholders."""
    if len(runs) != len(files):
        return None
    before = [d for d, after, _ in runs if not after]
    after = [d for d, cut, _ in runs if cut]

    def median_times(ds: list) -> tuple[dict, float]:
        """Each listed test's median over ``ds`` (a run that does not list it: the run's last
        entry, an upper bound), and the largest last entry (below it: not listed)."""
        floor = max(d["slowest"][-1]["seconds"] for d in ds)
        names = {t["test"] for d in ds for t in d["slowest"]}
        times = {n: statistics.median(next((t["seconds"] for t in d["slowest"] if t["test"] == n),
                                           d["slowest"][-1]["seconds"]) for d in ds)
                 for n in names}  # fmt: skip
        return times, floor

    (old, old_floor), (new, new_floor) = median_times(before), median_times(after)
    shown = lambda times, floor, n: (  # noqa: E731
        f"{_cell(times[n])}" if n in times else f"under {_cell(floor)}")
    changes = sorted(set(old) | set(new),
                     key=lambda n: new.get(n, new_floor) - old.get(n, old_floor))  # fmt: skip
    named = ", ".join(f"`{n.rpartition('::')[2]}` {shown(old, old_floor, n)} → "
                      f"{shown(new, new_floor, n)} s" for n in changes[:CUT_TESTS])  # fmt: skip
    walls = lambda ds: ", ".join(_cell(d["wall_s"]) for d in ds)  # noqa: E731
    worst = max(d["wall_s"] for d in after)
    return fill(
        fragment,
        date=(after[0].get("meta") or {}).get("date") or "-",
        files="`, `".join(name for name, *_ in files),
        order=", ".join("after" if cut else "before" for _, cut, _ in runs),
        before=walls(before), after=walls(after),
        before_tests=" and ".join(_cell(d["tests_s"]) for d in before),
        after_tests=" and ".join(_cell(d["tests_s"]) for d in after),
        ratio=num(statistics.median(d["wall_s"] for d in after)
                  / statistics.median(d["wall_s"] for d in before)),  # fmt: skip
        named=named,
        outcome="every run passed" if not any(d["counts"].get("failed", 0) for d, *_ in runs)
        else "some runs had failures",
        passed_before="/".join(sorted({str(d["counts"].get("passed", 0)) for d in before})),
        passed_after="/".join(sorted({str(d["counts"].get("passed", 0)) for d in after})),
        verdict="meets" if worst <= T.TARGET_CPU_SUITE_S else "misses",
        target=f"{T.TARGET_CPU_SUITE_S:g}",
        rest="" if worst <= T.TARGET_CPU_SUITE_S
        else fill(f"{fragment}.rest").strip("\n"),
        **extra,
    )


def _timeline_row(r: dict) -> list:
    """A run's row of the worker-by-worker table, the last worker to stop first."""
    t = r["timeline"]
    busy = sorted(t["workers"], key=lambda w: -w["stop_s"])
    return [r["label"], len(t["workers"]), _cell(r["wall_s"]), _cell(t["span_s"]),
            ", ".join(f"{_cell(w['busy_s'])} ({_cell(w['stop_s'])})" for w in busy),
            f"`{busy[0]['last_test'].rpartition('::')[2]}`"]  # fmt: skip


def workers_paragraph(pairs: list[tuple[dict, dict]], later: list = ()) -> str | None:
    """Runs laid out worker by worker (``suite_times --timeline``): ``pairs`` of a run before
    ``tests/conftest.layout`` and one with it, on the same number of workers; ``later``, runs
    of later versions of the layout, a row and a line each."""
    pairs = [(a, b) for a, b in pairs if a and b and "timeline" in a and "timeline" in b]
    later = [r for r in later if r and "timeline" in r]
    if not pairs:
        return None
    rows, lines = [], []
    for pair in pairs:
        rows += [_timeline_row(r) for r in pair]
        (a, b), n = pair, len(pair[0]["timeline"]["workers"])
        stops = [sorted(w["stop_s"] for w in r["timeline"]["workers"]) for r in pair]
        lines.append(
            f"- {n} workers: the last worker stopped at {_cell(stops[0][-1])} s while the others "
            f"stopped at {_cell(stops[0][0])}–{_cell(stops[0][-2])} s before the layout, every "
            f"worker between {_cell(stops[1][0])} and {_cell(stops[1][-1])} s with it; the "
            f"tests' own seconds {_cell(a['tests_s'])} → {_cell(b['tests_s'])}, pytest's wall "
            f"{_cell(a['wall_s'])} → {_cell(b['wall_s'])} s."
        )
    for r in later:
        stops = sorted(w["stop_s"] for w in r["timeline"]["workers"])
        rows.append(_timeline_row(r))
        lines.append(
            f"- *{r['label']}*: every worker stopped between {_cell(stops[0])} and "
            f"{_cell(stops[-1])} s ({_cell(stops[-1] - stops[0])} s apart); the tests' own "
            f"seconds {_cell(r['tests_s'])}, pytest's wall {_cell(r['wall_s'])} s."
        )
    return fill(
        "tests.suite.workers",
        table=table(["run", "workers", "wall s", "first test to last s",
                     "each worker: busy s (stopped at s)", "the last worker's last test"],
                    rows),  # fmt: skip
        lines=bullets(lines),
    )


def vm_speed_line(cuts: list, waits: list) -> str:
    """How fast the VM ran for session 33's runs against session 32's (``cuts`` and ``waits``:
    ``(data, after, turn)``): the tree before session 33 against session 32's tree after its
    cuts, nearly the same tests; empty where either side is missing."""
    then = [d["wall_s"] for d, after, _ in cuts if after]
    now = [d["wall_s"] for d, after, _ in waits if not after]
    if not then or not now:
        return ""
    walls = lambda values: ", ".join(_cell(v) for v in values)  # noqa: E731
    speed = "faster" if statistics.median(now) < statistics.median(then) else "slower"
    return fill("tests.suite.cpu_waits.vm", speed=speed, now=walls(now), then=walls(then)).strip(
        "\n"
    )


def suite_time_section(
    run: dict | None, before: dict | None = None, whole: dict | None = None,
    cpu: dict | None = None, cpu_serial: dict | None = None, serial: dict | None = None,
    newest: dict | None = None, earlier: dict | None = None, again: dict | None = None,
    six: tuple = (None, None), cpu_layout: list = (), layout_first: dict | None = None,
    cost: dict | None = None, dealt: dict | None = None, cpu_cuts: list = (),
    cpu_waits: list = (), session32: dict | None = None, newest_earlier: dict | None = None,
    other_card: list = (),
) -> list[str]:  # fmt: skip
    """The "Test-suite time" section: ``run`` the latest CUDA run, ``before`` the run before
    captures stopped collecting garbage, ``whole`` a run of the whole suite on the same kind of
    machine, ``cpu`` and ``cpu_serial`` the whole suite on a CPU machine like CI's, ``serial``
    the CUDA tests in one process where ``run`` used workers, ``newest`` the CUDA tests on the
    newest transformers supported, ``earlier`` the latest run before ``tests/conftest.layout``,
    ``again`` its command later on another lease of the machine, ``six`` six workers before and
    with the layout, ``cpu_layout`` the README's command with the layout on and off,
    ``layout_first`` the run of the layout's first version, ``cost`` of its version by cost and
    ``dealt`` of its last version before ``run``, ``cpu_cuts`` the README's command before and
    after session 32's cuts, ``cpu_waits`` before and after session 33's, ``session32`` the
    latest run before ``run``, ``newest_earlier`` the run before ``newest`` and
    ``other_card`` the data of :data:`SUITE_OTHER_CARD_FILES`, file by file (any may be
    missing, None: not measured)."""
    targets = dict(
        cuda_target=f"{T.TARGET_CUDA_SUITE_S:g}",
        cpu_target=f"{T.TARGET_CPU_SUITE_S:g}",
        cpu_cores=T.CPU_SUITE_CORES,
    )
    if run is None:
        return [fill("tests.suite.missing", file=SUITE_FILE, **targets)]
    meta = run.get("meta") or {}
    named = ((SUITE_BEFORE_FILE, before), (SUITE_SERIAL_FILE, serial),
             (SUITE_EARLIER_FILE, earlier), (SUITE_NEWEST_EARLIER_FILE, newest_earlier),
             (SUITE_AGAIN_FILE, again), (SUITE_SIX_FILES[0], six[0]),
             (SUITE_LAYOUT_FIRST_FILE, layout_first), (SUITE_SIX_FILES[1], six[1]),
             (SUITE_COST_FILE, cost), (SUITE_DEALT_FILE, dealt),
             (SUITE_SESSION32_FILE, session32), (SUITE_NEWEST_FILE, newest),
             (SUITE_FILE, run), *zip(SUITE_OTHER_CARD_FILES, other_card))  # fmt: skip
    runs = [r for _, r in named if r]
    names = [n for n, r in named if r]
    dates = sorted({(r.get("meta") or {}).get("date") or "-" for r in runs})
    releases = dict.fromkeys((r.get("meta") or {}).get("transformers") or "-" for r in runs)
    return [
        fill(
            "tests.suite",
            selection=run["selection"] or "(everything)",
            files="`, `".join(names),
            gpu=", ".join(dict.fromkeys((r.get("meta") or {}).get("gpu") or "-" for r in runs)),
            torch=meta.get("torch") or "-",
            transformers=", ".join(releases),
            date=", ".join(dates),
            **targets,
            table=suite_runs_table(runs),
            verdict="\n\n".join(
                filter(
                    None,
                    [suite_verdict_line(run), newest and suite_verdict_line(newest),
                     other_card_line([r for r in other_card if r]),
                     earlier and again_line(earlier, again),
                     workers_paragraph([(again, layout_first), six],
                                       [cost, dealt, session32, newest, run, *other_card]),
                     whole_suite_line(whole),
                     cpu_suite_line(cpu, cpu_serial), cpu_layout_line(cpu, list(cpu_layout)),
                     cpu_cuts_line(list(cpu_cuts)),
                     cpu_cuts_line(list(cpu_waits), CPU_WAITS_FILES, "tests.suite.cpu_waits",
                                   vm=vm_speed_line(list(cpu_cuts), list(cpu_waits))),
                     gc_paragraph(before, run)],  # fmt: skip
                )
            ),
            top=min(TOP_FILES, len(run["per_file"])),
            files_count=len(run["per_file"]),
            per_file=per_file_table(run, before),
        )
    ]


# -- construction under cProfile ----------------------------------------------------------------
def _share(seconds: float, run: dict) -> str:
    return pct(seconds / run["profiled_total_s"]) if run["profiled_total_s"] else "-"


def gpu_waits(run: dict) -> float:
    """Seconds of every ``gpu wait: ...`` part of a profiled run (leaf functions: they do not
    overlap each other).

    Example::

        >>> gpu_waits({"parts_s": {"gpu wait: tuning": 1.0, "gpu wait: staging": 0.5, "sdpa": 3}})
        1.5
    """
    return sum(s for name, s in run["parts_s"].items() if name.startswith("gpu wait"))


def largest_parts(run: dict, count: int = LARGEST_PARTS) -> list[tuple[str, float]]:
    """The ``count`` largest parts of a run, largest first (ties by name).

    Example::

        >>> largest_parts({"parts_s": {"a": 1.0, "b": 3.0, "c": 2.0}}, 2)
        [('b', 3.0), ('c', 2.0)]
    """
    return sorted(run["parts_s"].items(), key=lambda p: (-p[1], p[0]))[:count]


def profile_lines(runs: list[dict]) -> list[str]:
    """Generated lines: each runner's largest parts and GPU waits, and what the first runner
    pays beyond the second."""
    lines = []
    for run in runs:
        parts = ", ".join(
            f"`{name}` {num(s)} s ({_share(s, run)})" for name, s in largest_parts(run)
        )
        waits = gpu_waits(run)
        lines.append(
            fill(
                "capture_profile.largest",
                which=run["which"],
                seconds=num(run["construction_s"]),
                parts=parts,
                waits=num(waits),
                waits_share=_share(waits, run),
            )
        )
    by_which = {run["which"]: run for run in runs}
    first, second = by_which.get("first"), by_which.get("second")
    if first and second:
        differences = {
            name: s - second["parts_s"].get(name, 0.0) for name, s in first["parts_s"].items()
        }
        name, extra = max(differences.items(), key=lambda p: (p[1], p[0]))
        lines.append(
            fill(
                "capture_profile.first",
                extra=num(first["construction_s"] - second["construction_s"]),
                part=name,
                part_extra=num(extra),
                part_first=num(first["parts_s"][name]),
                part_second=num(second["parts_s"].get(name, 0.0)),
            )
        )
    return lines


def capture_profile_section(data: dict | None) -> list[str]:
    """The "Construction time, profiled" section from ``capture_profile``'s JSON."""
    targets = dict(
        extra_target=f"{T.TARGET_CAPTURE_S_PER_EXTRA_BUCKET:g}",
        ladder_target=f"{T.TARGET_LADDER_CAPTURE_S:g}",
    )
    if data is None:
        return [fill("capture_profile.missing", file=PROFILE_FILE, **targets)]
    runs, meta = data["runs"], data.get("meta") or {}
    runs_table = table(
        ["runner", "construction s (under cProfile)", "profiled s", "buckets", "graphs"],
        [
            [
                r["which"],
                num(r["construction_s"]),
                num(r["profiled_total_s"]),
                r["buckets"],
                r["graphs"],
            ]
            for r in runs
        ],
    )
    names = sorted(runs[0]["parts_s"], key=lambda n: (-runs[0]["parts_s"][n], n))
    names += [n for r in runs[1:] for n in r["parts_s"] if n not in names]
    header = ["part"]
    for r in runs:
        header += [f"{r['which']} runner s", "share"]
    rows = []
    for name in names:
        row = [f"`{name}`"]
        for r in runs:
            s = r["parts_s"].get(name)
            row += ["-", "-"] if s is None else [num(s), _share(s, r)]
        rows.append(row)
    return [
        fill(
            "capture_profile",
            file=PROFILE_FILE,
            gpu=meta.get("gpu") or "-",
            torch=meta.get("torch") or "-",
            transformers=meta.get("transformers") or "-",
            date=meta.get("date") or "-",
            family=data["family"],
            **targets,
            runs=runs_table,
            parts=table(header, rows),
            largest=bullets(profile_lines(runs)),
        )
    ]
