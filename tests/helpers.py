"""Test helpers shared by the behavioural test modules."""

import contextlib
import gc
import re
import subprocess
import threading
import time
import warnings

import pytest
import torch

import breakgraph
from breakgraph import ReplayError

HAS_CUDA = torch.cuda.is_available()
# what breakgraph patches while capturing, as it was before any capture
ORIGINAL_IS_CAPTURING = torch.cuda.is_current_stream_capturing
ORIGINAL_GRAPHS_IS_CAPTURING = torch.cuda.graphs.is_current_stream_capturing
ORIGINAL_EVENT_RECORD = torch.cuda.Event.record
ORIGINAL_EVENT_WAIT = torch.cuda.Event.wait
ORIGINAL_SEEDING = {  # two names of one function, until torch._dynamo wraps torch.manual_seed
    (owner, name): getattr(owner, name)
    for owner in (torch, torch.random)
    for name in ("manual_seed", "seed", "set_rng_state")
}


def fresh_into(static):
    """Draw a fresh random tensor like ``static``, copy it in and return it."""
    new = torch.randn_like(static)
    static.copy_(new)
    return new


def assert_clean(graph=None):
    """Nothing left behind by a capture (finished or failed)."""
    assert not breakgraph.is_capturing()
    assert torch.cuda.is_current_stream_capturing is ORIGINAL_IS_CAPTURING
    assert torch.cuda.graphs.is_current_stream_capturing is ORIGINAL_GRAPHS_IS_CAPTURING
    assert torch.cuda.Event.record is ORIGINAL_EVENT_RECORD
    assert torch.cuda.Event.wait is ORIGINAL_EVENT_WAIT
    for (owner, name), original in ORIGINAL_SEEDING.items():
        assert getattr(owner, name) is original, name
    assert gc.isenabled()
    assert torch.is_autocast_cache_enabled()  # off only inside a capture
    if HAS_CUDA:
        assert not torch.cuda.is_current_stream_capturing()
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
    if graph is not None:
        assert graph.num_segments == 0 and graph.num_breaks == 0
        assert repr(graph) == "BreakableCUDAGraph(empty)"
        with pytest.raises(ReplayError):
            graph.replay()


@contextlib.contextmanager
def collector_off():
    """Python's cyclic garbage collector off for the block (as it was after): an object in a
    reference cycle outlives its last reference there, so a test can check that ``del`` alone
    (reference counting) frees a runner and its graphs, whose pool memory goes back with them.

    One collection first, of the garbage made before the block: the first capture of a process
    may import ``torch._dynamo``, whose import leaves a frame in a cycle with itself
    (``torch.fx.wrap``), and that frame's callers, the runner's constructor among them, stay
    alive until a collection. An object still referenced is not collected, so it cannot hide
    a cycle that only the ``del`` inside the block makes garbage."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def run_threads(*targets, timeout=300):
    """Run each callable on a thread of its own; raise the first exception one of them raised."""
    errors = []

    def guarded(target):
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - raised below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"
    if errors:
        raise errors[0]


# -- checks that need a process of their own -----------------------------------------------------

_FRESH_CHECKS: dict[str, tuple[str, bool]] = {}  # name -> (script, must run first)
_fresh: dict = {}  # "process": the Popen running them; "results": name -> (passed, output)


def fresh_process_check(name: str, script: str, *, first: bool = False) -> None:
    """Register ``script`` to run in ONE new Python process shared by every registered check.

    Some checks need a process of their own: its very first matmul, or process-wide state
    (cuBLAS workspaces cleared) that must not leak into the test run. Starting one costs about
    11 s on the H200's host (CUDA and cuBLAS loading), so the checks share it, and it starts
    as soon as collection ends (``conftest.pytest_collection_finish``, for tests marked
    ``fresh_process``), running beside the other tests. Each check runs in a namespace of its
    own, in registration order, the one registered ``first=True`` before all others (a
    process's first matmul). A check passes when its script raises nothing. Register at import
    time; :func:`fresh_process_result` waits for the outcome.
    """
    if first and any(f for n, (_, f) in _FRESH_CHECKS.items() if n != name):
        raise ValueError(f"fresh_process_check: only one check can run first ({name!r})")
    _FRESH_CHECKS[name] = (script, first)


def start_fresh_process() -> None:
    """Start the process of the registered checks (once; see :func:`fresh_process_check`)."""
    import subprocess
    import sys

    if "process" in _fresh:
        return
    names = sorted(_FRESH_CHECKS, key=lambda n: not _FRESH_CHECKS[n][1])
    driver = "\n".join(
        [
            "import sys, traceback",
            f"checks = {[(n, _FRESH_CHECKS[n][0]) for n in names]!r}",
            "for name, script in checks:",
            "    print(f'@@ {name}', flush=True)",
            "    try:",
            "        exec(compile(script, name, 'exec'), {'__name__': name})",
            "        print('@@ passed', flush=True)",
            "    except BaseException:",
            "        traceback.print_exc(file=sys.stdout)",
            "        print('@@ failed', flush=True)",
        ]
    )
    _fresh["names"] = names
    _fresh["process"] = subprocess.Popen(
        [sys.executable, "-c", driver],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def fresh_process_result(name: str) -> tuple[bool, str]:
    """``(passed, output)`` of the registered check ``name`` (see :func:`fresh_process_check`)."""
    if "results" not in _fresh:
        start_fresh_process()
        process = _fresh["process"]
        stdout, stderr = process.communicate(timeout=600)
        results = {}
        sections = stdout.split("@@ ")[1:]
        for head, verdict in zip(sections[::2], sections[1::2]):
            check, _, output = head.partition("\n")
            results[check] = (verdict.startswith("passed"), output)
        for check in _fresh["names"]:  # the process died inside (or before) these
            died = f"exit {process.returncode}:\n{stdout[-2000:]}{stderr[-3000:]}"
            results.setdefault(check, (False, died))
        _fresh["results"] = results
    return _fresh["results"][name]


# -- transformers' continuous-batching cleanup ---------------------------------------------------


def no_full_collections_in_cb_cleanup(patches, *modules) -> None:
    """Make ``gc.collect()`` a no-op in transformers' continuous batching (and ``modules``).

    transformers runs a full ``gc.collect()`` whenever a CB batch processor is dropped or a
    manager stops (its own cleanup; 0.1-0.3 s each with transformers loaded on CI's CPU), and
    ``benchmarks.bench_cb`` collects between variants to hand GPU memory back: seconds of the
    CB test files, and none of it is what the tests check. ``patches`` is a
    ``pytest.MonkeyPatch`` (the fixture, or ``pytest.MonkeyPatch.context()``).
    """
    import types

    from transformers.generation.continuous_batching import continuous_api

    no_op = types.SimpleNamespace(collect=lambda *args: 0)
    for module in (continuous_api, *modules):
        patches.setattr(module, "gc", no_op)


def cb_loop_wake_event(manager):
    """The event transformers' CB ``manager``'s loop waits on while it has nothing to do
    (private: ``_has_new_requests`` on 5.17, ``_wake_up_loop`` from 5.24), or ``None``."""
    return getattr(manager, "_wake_up_loop", None) or getattr(manager, "_has_new_requests", None)


def joins_wake_the_cb_loop(patches, manager_class) -> None:
    """Make ``manager_class.join`` (transformers' CB manager; ``stop(block=True)`` asks the
    loop to stop, then joins it) wake the generation loop first, instead of waiting out its
    idle poll.

    With nothing to do, transformers' generation loop waits on an event for up to 0.1 s at a
    time and reads a stop request only after the wait. So a stop right after the last result
    (as every ``generate_batch`` ends) took close to 0.1 s, with the test's process idle: 114
    stops, 11.4 s of the CB test files in one process on CI's 2 cores. The join here sets the
    loop's event, then runs transformers' own: the stop asked, its checks and its order are
    transformers'. A loop woken without a stop asked just waits again. Where the event is
    missing (:func:`cb_loop_wake_event`), the join waits as before. ``patches`` is a
    ``pytest.MonkeyPatch``.
    """
    original = manager_class.join

    def join(self, stop_trigger_time, timeout=None):
        wake = cb_loop_wake_event(self)
        if wake is not None:
            wake.set()
        return original(self, stop_trigger_time, timeout)

    patches.setattr(manager_class, "join", join)


class RankDiedWarning(UserWarning):
    """A multi-process launch (the TP tests' ranks, a torchrun example) lost a process to a
    signal and ran once more: CI saw a gloo rank die once with no Python stack. A second death
    fails; ``-W error::tests.helpers.RankDiedWarning`` makes the first one fail."""


#: torchrun's report of a worker that a signal ended (``exitcode  : -11 (pid: ...)``)
TORCHRUN_SIGNAL = re.compile(r"exitcode\s*:\s*-\d+")


def run_torchrun_script(command: list, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, **kwargs)`` for a script that
    starts its ranks under torchrun; run once more (with a :class:`RankDiedWarning`) when it
    failed because a worker died of a signal."""
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0 and TORCHRUN_SIGNAL.search(result.stderr):
        warnings.warn(f"{command[-1]}: a worker died of a signal, ran again; its report: "
                      f"{result.stderr[-3000:]}", RankDiedWarning, stacklevel=2)  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    return result


def compiled_decode_kernels() -> int | None:
    """How many binaries Triton holds in this process for ``paged_decode``'s kernels (None
    where this Triton keeps them elsewhere)."""
    from breakgraph.integrations.transformers import paged_decode as pd

    total = 0
    for kernel in (pd._paged_decode_kernel, pd._paged_decode_split_kernel,
                   pd._paged_decode_combine_kernel):  # fmt: skip
        caches = getattr(kernel, "device_caches", None)
        if caches is not None:  # Triton 3.2 on: device -> (kernels, ...)
            total += sum(len(entry[0]) for entry in caches.values())
        elif isinstance(getattr(kernel, "cache", None), dict):
            total += sum(len(entry) for entry in kernel.cache.values())
        else:
            return None
    return total


@contextlib.contextmanager
def busy_gpu(threads: int = 2):
    """Other work on the GPU meanwhile: ``threads`` threads of this process multiplying
    4096² matrices on streams of their own, so the device runs behind the host and exposes any
    read or reuse of a buffer that the host does not order after the write it needs.

    Safe beside a capture in another thread (CUDA's global capture mode refuses syncs, event
    queries and allocations anywhere in the process while a capture runs, and torch refuses
    random draws): each thread allocates its matrices (filled, not drawn: the tests' seeded
    generator is left alone) and runs its first matmul (cuBLAS's handle and workspace) before
    this yields, then only launches matmuls into its own output, paced by host sleeps at the
    rate the device ran them alone. On exit each thread's stream is drained (no capture runs
    then), and an error in a thread is raised.
    ``BREAKGRAPH_TEST_BUSY_GPU=N`` runs every CUDA test inside it (``tests/conftest.py``)."""
    stop, errors = threading.Event(), []
    ready = threading.Barrier(threads + 1, timeout=120)
    streams = []

    def work():
        try:
            stream = torch.cuda.Stream()
            streams.append(stream)
            with torch.cuda.stream(stream):
                a = torch.full((4096, 4096), 1.0 / 4096, device="cuda")
                out = torch.mm(a, a)
                start = time.perf_counter()
                for _ in range(4):
                    torch.mm(a, a, out=out)
                stream.synchronize()
                pace = time.perf_counter() - start
        except Exception as error:  # noqa: BLE001 - reported on exit
            errors.append(error)
            stop.set()
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            return
        if stop.is_set():  # this thread's or another's set-up failed
            return
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    for _ in range(4):
                        torch.mm(a, a, out=out)
                    time.sleep(pace)
        except Exception as error:  # noqa: BLE001 - reported on exit
            errors.append(error)

    workers = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    try:
        for worker in workers:
            worker.start()
        ready.wait()
        yield
    finally:
        stop.set()
        for worker in workers:
            if worker.ident is not None:  # started
                worker.join(timeout=60)
        for stream in streams:
            stream.synchronize()  # the backlog is this test's, not the next one's
    if errors:
        raise RuntimeError(f"busy_gpu: a thread of the load failed: {errors[0]!r}")


def needs_continuous_batching():
    """A ``skipif`` marker for tests of breakgraph's continuous batching: skipped where the
    installed transformers lacks what the integration reads (the integration's own probe, no
    version string), saying what is missing. Call it after ``pytest.importorskip("transformers")``.
    """
    import transformers
    from breakgraph.integrations.transformers import compat

    return pytest.mark.skipif(
        not compat.supported("continuous_batching"),
        reason=f"transformers {transformers.__version__}: {compat.problems('continuous_batching')}",
    )
