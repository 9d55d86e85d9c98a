"""How the benchmarks time things: turn-taking medians, host issue time, pure device time.

Every timer takes a ``sync`` callable (``torch.cuda.synchronize`` on a GPU, a no-op on
the CPU) so the same code runs in the CPU smoke mode.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch


def no_sync() -> None:
    """The ``sync`` of CPU runs: nothing is asynchronous there."""


def interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int,
    iters: int,
    warmup: int,
    sync: Callable[[], None] = no_sync,
    spread: Sequence[tuple[str, str]] = (),
) -> dict:
    """Median wall time (ms) of each function, synchronised around each call.

    The functions take turns call by call, each turn in the next of all their orders
    (a b c, a c b, b a c, ...): drift (clocks, temperature, a busy host) hits every
    variant alike, and each variant follows each other one equally often (a fast graph
    right after a 20 ms eager call does not run in the same GPU state as after another
    graph). For each pair ``(a, b)`` in ``spread`` the result also holds the lowest and
    highest ratio median(a) / median(b) over rounds of ``iters`` turns: the noise of
    that ratio.

    Returns ``{"ms": {name: median}, "spread": {"a/b": [low, high]}, "calls": n}``.

    Example::

        >>> out = interleaved({"a": lambda: None, "b": lambda: None}, rounds=2, iters=3,
        ...                   warmup=1, spread=[("a", "b")])
        >>> sorted(out["ms"]), out["calls"], sorted(out["spread"])
        (['a', 'b'], 6, ['a/b'])
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    ratios: dict[tuple[str, str], list[float]] = {pair: [] for pair in spread}
    orders = list(itertools.permutations(fns))
    turn = 0
    for _ in range(rounds):
        block: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(iters):
            for name in orders[turn % len(orders)]:
                fn = fns[name]
                start = time.perf_counter()
                fn()
                sync()
                block[name].append((time.perf_counter() - start) * 1e3)
            turn += 1
        for name, times in block.items():
            samples[name] += times
        for a, b in spread:
            ratios[(a, b)].append(statistics.median(block[a]) / statistics.median(block[b]))
    return {
        "ms": {name: statistics.median(v) for name, v in samples.items()},
        "spread": {f"{a}/{b}": [min(r), max(r)] for (a, b), r in ratios.items()},
        "calls": rounds * iters,
    }


def median_ms(fn: Callable[[], object], *, calls: int, sync: Callable[[], None] = no_sync) -> float:
    """Median wall time (ms) of ``calls`` synchronised calls, after one warm-up call.

    For variants too slow to take turns with the others (HF eager over a whole batch,
    one prompt at a time).
    """
    fn()
    sync()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


class ReplayProbe:
    """Records when a call first enters ``replay()`` of one of the given graphs.

    Installed on the graph *objects* (an instance attribute wrapping the bound method),
    so the library is measured as it is; :func:`probe_replays` removes it again. ``hit``
    is ``None`` until a replay starts after :meth:`arm`, and stays ``None`` when the
    caller reaches the graph some other way (a bound method saved before the probe).
    """

    def __init__(self) -> None:
        self.hit: float | None = None

    def arm(self) -> None:
        self.hit = None

    def wrap(self, replay: Callable) -> Callable:
        def probed(*args, **kwargs):
            if self.hit is None:
                self.hit = time.perf_counter()
            return replay(*args, **kwargs)

        return probed


@contextlib.contextmanager
def probe_replays(graphs: Sequence[object]) -> Iterator[ReplayProbe]:
    """Wrap ``graph.replay`` of every graph for the duration of the block.

    Example::

        >>> class Graph:
        ...     def replay(self):
        ...         return "replayed"
        >>> g = Graph()
        >>> with probe_replays([g]) as probe:
        ...     probe.arm(); result = g.replay()
        >>> result, probe.hit is not None, "replay" in vars(g)
        ('replayed', True, False)
    """
    probe = ReplayProbe()
    wrapped = []
    for graph in graphs:
        probed = probe.wrap(graph.replay)
        try:
            graph.replay = probed
        except AttributeError:  # no instance attributes (__slots__): left unprobed
            continue
        wrapped.append((graph, probed))
    try:
        yield probe
    finally:
        for graph, probed in wrapped:
            if vars(graph).get("replay") is probed:
                del graph.replay


def host_times(
    call: Callable[[], object],
    *,
    iters: int,
    sync: Callable[[], None] = no_sync,
    probe: ReplayProbe | None = None,
) -> dict:
    """Host time of one call with an idle device at the start (no sync inside).

    ``return_ms``: until the call returns; ``to_first_replay_ms``: until it enters its
    first graph replay (needs a ``probe`` over the call's graphs; ``None`` when no probed
    graph was replayed, e.g. when the runner binds ``replay`` before the probe is set).
    """
    returns, firsts = [], []
    for _ in range(iters):
        sync()
        if probe is not None:
            probe.arm()
        start = time.perf_counter()
        call()
        end = time.perf_counter()
        returns.append((end - start) * 1e3)
        if probe is not None and probe.hit is not None:
            firsts.append((probe.hit - start) * 1e3)
    sync()
    return {
        "return_ms": statistics.median(returns),
        "to_first_replay_ms": statistics.median(firsts) if firsts else None,
        "first_replay_seen": len(firsts),
    }


class DeviceClock:
    """Pure device time of a call: a sleep kernel holds the stream while the host issues
    the call, so CUDA events around the call time the GPU work alone, without the gaps a
    slow host would leave. ``hidden`` says whether the host finished issuing before the
    hold ended (if not, the time includes host gaps, or the call synchronised).
    """

    def __init__(self, hold_ms: float):
        self.hold_ms = hold_ms
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        torch.cuda._sleep(cycles)  # first call loads the kernel
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.cycles_per_ms = cycles / start.elapsed_time(end)

    def measure(self, call: Callable[[], object], *, iters: int) -> dict:
        device, hidden = [], 0
        for _ in range(iters):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            issue = time.perf_counter()
            torch.cuda._sleep(int(self.hold_ms * self.cycles_per_ms))
            start.record()
            call()
            end.record()
            hidden += (time.perf_counter() - issue) * 1e3 < self.hold_ms
            end.synchronize()
            device.append(start.elapsed_time(end))
        return {"device_ms": statistics.median(device), "hidden": hidden / iters}
