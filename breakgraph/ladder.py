"""The graph ladder: one breakable graph per size bucket, and the one decision per call.

Every runner that serves variable sizes from captured graphs does the same job: capture
one :class:`~breakgraph.BreakableCUDAGraph` per bucket, largest first into one memory
pool, choose a bucket per call, agree that choice across ranks, count, and release the
graphs safely. :class:`GraphLadder` does it once, for :class:`~breakgraph.runner.BucketedRunner`,
``PrefillRunner`` (through it) and the continuous-batching step runner.

The ladder holds **no buffers** (as vLLM's ``CudagraphDispatcher`` and ``CUDAGraphWrapper``):
its keys, the captured bucket sizes, are the only source of truth, and per bucket it keeps
only the graph and the output its capture returned. The static input buffers live with
their owner, which hands the ladder ``record(size)`` (run the captured function on the
bucket's buffers) and ``warm_up(size)``.

The decision per call (:func:`~breakgraph.buckets.choose_bucket`), tuned routes
(:func:`~breakgraph.buckets.faster_buckets`) and the bucket lists are pure functions of
:mod:`breakgraph.buckets`; they are re-exported here.

Example::

    >>> import torch
    >>> from breakgraph.ladder import GraphLadder
    >>> x = torch.zeros(16)
    >>> ladder = GraphLadder(backend="emulated")
    >>> ladder.capture((4, 16), lambda size: x[:size] * 2)
    >>> ladder.buckets, ladder.decide(3)
    ((4, 16), Decision(action=Action.REPLAY, bucket=4, reason=''))
    >>> _ = x.copy_(torch.arange(16.0))
    >>> ladder.replay(4, size=3).tolist()
    [0.0, 2.0, 4.0, 6.0]
    >>> ladder.stats.replays, ladder.stats.buckets[4].padded
    (1, 1)
    >>> ladder.close()
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from . import distributed
from .backends import select_backend
from .buckets import (
    Action,
    Decision,
    choose_bucket,
    default_token_buckets,
    faster_buckets,
    geometric_buckets,
    tuned_times,
    validate_buckets,
    validate_callable,
    validate_count,
    validate_flag,
    validate_real,
)
from .debug import debug_enabled
from .errors import HostSyncError, InputError, ReplayError
from .graph import BreakableCUDAGraph, capture
from .ladder_stats import BucketStats, LadderStats
from .state import context_scope
from .syncs import CompileTransparentSegmentMode

__all__ = [
    "GraphLadder",
    "Action",
    "Decision",
    "choose_bucket",
    "faster_buckets",
    "validate_buckets",
    "default_token_buckets",
    "geometric_buckets",
    "BucketStats",
    "LadderStats",
]

logger = logging.getLogger("breakgraph")


# -- the ladder --------------------------------------------------------------------------------


class _Rung:
    """One captured bucket: its graph, the output its capture returned, its counters."""

    __slots__ = ("graph", "output", "stats")

    def __init__(self, graph: BreakableCUDAGraph, output: Any, stats: BucketStats):
        self.graph, self.output, self.stats = graph, output, stats


class GraphLadder:
    """The one owner of graphs per bucket: capture, decision, replay, tuning, release.

    Args:
        backend, pool, debug: as for :func:`breakgraph.capture` (the backend is resolved
            once; every bucket is captured into one pool, ``pool`` or the first graph's).
        ranks: a :class:`~breakgraph.distributed.RankGroup` when segments hold collectives:
            :meth:`decide` agrees the size (and a fingerprint) in one exchange per call, and
            every warm-up and capture is a capture step checked on every rank.
        on_miss: ``"eager"`` or ``"raise"``, for a size above every bucket.
        max_padding_fraction: run eagerly when a bucket's tail would exceed this fraction.
        agree_size: ``size -> size`` before every decision, in one process (not with
            ``ranks``); it must return an int no smaller than the size.
        progress: print one line per captured bucket to stderr (the ``breakgraph`` logger
            gets it at INFO level anyway).
        who: the owner's name, for error messages (``"BucketedRunner"``).

    Captures happen only in :meth:`capture`; decisions see a size above every bucket as
    ``CAPTURE`` only inside :meth:`capture_window`. :meth:`close` is final.
    """

    def __init__(
        self,
        *,
        backend: str | None = None,
        pool: Any = None,
        ranks: distributed.RankGroup | None = None,
        debug: bool | None = None,
        on_miss: str = "eager",
        max_padding_fraction: float | None = None,
        agree_size: Callable[[int], int] | None = None,
        progress: bool = False,
        who: str = "GraphLadder",
    ):
        if on_miss not in ("eager", "raise"):
            raise InputError(f"{who}: on_miss must be 'eager' or 'raise', got {on_miss!r}.")
        if max_padding_fraction is not None and not (
            0.0 <= validate_real(max_padding_fraction, f"{who}: max_padding_fraction") < 1.0
        ):
            raise InputError(f"{who}: max_padding_fraction must be in [0, 1).")
        validate_callable(agree_size, f"{who}: agree_size")
        if ranks is not None and agree_size is not None:
            raise InputError(
                f"{who}: with ranks=, the ranks agree the size themselves; drop agree_size."
            )
        self._backend = select_backend(backend, who)
        self.backend: str = self._backend.name
        self.ranks = ranks
        self.debug = debug_enabled(debug, who)
        self.on_miss = on_miss
        self.max_padding_fraction = max_padding_fraction
        self.agree_size = agree_size
        self.progress = validate_flag(progress, f"{who}: progress")
        self.who = who
        self.stats = LadderStats()
        self.closed = False
        self._pool = pool
        self._rungs: dict[int, _Rung] = {}
        self._sizes: tuple[int, ...] = ()
        self._decisions: dict[int, Decision] = {}  # agreed size (-1: above all) -> decision
        self._faster: dict[int, int] = {}  # bucket -> a larger bucket measured faster (tune)
        self._window_open = False

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return f"GraphLadder(backend={self.backend!r}, buckets={self._sizes}{state})"

    @property
    def buckets(self) -> tuple[int, ...]:
        """The captured bucket sizes, ascending."""
        return self._sizes

    @property
    def window_open(self) -> bool:
        return self._window_open

    # -- capture ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture_window(self) -> Iterator[GraphLadder]:
        """Inside the block a size above every bucket decides ``CAPTURE`` (the owner captures
        it, then decides again). Open it only at a quiet point, e.g. start-up: capturing
        mid-run can grow shared workspaces and move addresses that earlier graphs baked in."""
        self._check_open("capture_window")
        previous, self._window_open = self._window_open, True
        self._decisions.clear()
        try:
            yield self
        finally:
            self._window_open = previous
            self._decisions.clear()

    def capture(
        self,
        sizes: Sequence[int],
        record: Callable[[int], Any],
        *,
        warm_up: Callable[[int], None] | None = None,
        warm_up_each: bool = False,
        context: Callable[[int], Any] | None = None,
        stream: Any = None,
        capture_error_mode: str | None = None,
        collect_garbage: bool | None = None,
    ) -> None:
        """Capture every size of ``sizes`` not captured yet, largest first, into one pool.

        For each bucket: ``warm_up(size)`` (before the first bucket of this call, or before
        every one with ``warm_up_each``) runs eagerly under ``context_scope(context(size))``,
        on a side stream (or ``stream``) with the CUDA backend; then ``record(size)`` runs
        inside ``breakgraph.capture(...)`` with ``context(size)`` as the capture context, and
        what it returns is the bucket's output. Allocate the buffers ``record`` reads before
        the call: whatever it allocates is captured (the emulated backend would replay the
        allocation, refilling the buffer on every replay). The first bucket's capture hands
        cached device memory back (``collect_garbage=None``: as ``torch.cuda.graph``), the
        others skip it (``False``): once per call, not once per bucket. ``collect_garbage=False``
        skips it for every bucket (a bucket captured while serving, between steps).
        ``capture_error_mode`` defaults to ``"thread_local"``
        (:data:`breakgraph.distributed.CAPTURE_ERROR_MODE`: other threads may use CUDA
        meanwhile).

        With ``ranks`` every warm-up and capture is a :meth:`RankGroup.capture_step
        <breakgraph.distributed.RankGroup.capture_step>`: checked on every rank, with the
        graph's topology as fingerprint. After a failed NCCL step the graphs and the owner's
        callables (so whatever they reference) are kept until the process exits: an owner
        must then keep its buffers too (``ranks.keeps_memory``).

        A bucket is registered only when its capture succeeded; on an exception the
        buckets captured before it in this call stay."""
        self._check_open("capture")
        validate_callable(record, f"{self.who}.capture: record", optional=False)
        validate_callable(warm_up, f"{self.who}.capture: warm_up")
        validate_callable(context, f"{self.who}.capture: context (size -> context)")
        validate_flag(warm_up_each, f"{self.who}.capture: warm_up_each")  # "no" warmed up all
        ordered = [
            s
            for s in reversed(validate_buckets(sizes, f"{self.who}.capture", allow_empty=True))
            if s not in self._rungs
        ]
        if capture_error_mode is None:
            capture_error_mode = distributed.CAPTURE_ERROR_MODE  # "thread_local": see there
        for i, size in enumerate(ordered):
            self._capture_one(
                size,
                f"{i + 1}/{len(ordered)}",
                record,
                warm_up if i == 0 or warm_up_each else None,
                context(size) if context is not None else None,
                dict(
                    stream=stream,
                    capture_error_mode=capture_error_mode,
                    collect_garbage=collect_garbage if i == 0 else False,  # once per call
                    detect_syncs=self._watch_syncs(i),
                ),
                keep=(self._rungs, record, warm_up, context),
            )

    def _capture_one(
        self,
        size: int,
        position: str,
        record: Callable[[int], Any],
        warm_up: Callable[[int], None] | None,
        context: Any,
        options: dict,
        keep: tuple,
    ) -> None:
        start = time.perf_counter()
        if warm_up is not None:
            with context_scope(context):
                self._step(
                    f"warm-up of bucket {size}",
                    lambda: self._warm_up(warm_up, size, options["stream"]),
                    keep=keep,
                )
            self.stats.warmup_seconds += time.perf_counter() - start
        graph = BreakableCUDAGraph()
        pool_before = self._pool_bytes()

        def run() -> Any:
            with capture(
                graph,
                pool=self._pool,
                backend=self.backend,
                context=context,
                debug=self.debug,
                **options,
            ):
                return record(size)

        try:
            output = self._step(
                f"capture of bucket {size}",
                run,
                lambda _: distributed.fingerprint(repr(graph)),
                keep=(graph, *keep),
            )
        except BaseException as exc:
            if self._pool is not None and not self._backend.pool_usable(self._pool):
                self._pool = None  # CUDA spoiled it (backends.cuda): later buckets get a new one
            cuda_refused = isinstance(exc, HostSyncError) and isinstance(
                exc.__cause__, RuntimeError
            )
            if cuda_refused and not options["detect_syncs"]:
                # raises the error that names the line (the emulated backend's mode flags CPU
                # tensors too; it only gets here in tests, which fake CUDA's refusal)
                _name_the_sync(record, size, context, all_devices=self.backend != "cuda")
            raise
        self._pool = graph.pool()
        seconds = time.perf_counter() - start
        stats = self.stats.buckets.setdefault(size, BucketStats())  # captured again after
        # discard(): its counters go on (replays, padding, captures and their seconds); what
        # describes the graph (memory, breaks, a tuned time) is the new graph's
        stats.captures += 1
        stats.capture_s += seconds
        stats.graph_memory_bytes = self._pool_bytes() - pool_before
        stats.breaks, stats.replay_ms = graph.num_breaks, None
        self._rungs[size] = _Rung(graph, output, stats)
        self._sizes = tuple(sorted(self._rungs))
        self._decisions.clear()
        message = f"breakgraph: captured bucket {position} (size {size}) in {seconds:.3f} s"
        logger.info("%s: %r", message, graph)
        if self.progress:
            print(message, file=sys.stderr, flush=True)

    def _watch_syncs(self, i: int) -> bool:
        """Whether the ``i``-th capture of a ``capture()`` call watches each operation for host
        syncs. Watching costs about 10 us of host time per aten operation (a third of a deep
        model's capture time per bucket), and every bucket runs the same code: on CUDA only
        the first one is watched. A later bucket whose capture CUDA refuses (a sync on a path
        only that size takes) runs once more, eagerly and watched, so that the error names
        the line (:func:`_name_the_sync`). The emulated backend would record a sync silently,
        and the ranks of a group must take the same steps: both always watch."""
        return i == 0 or self.backend != "cuda" or self.ranks is not None

    def _step(
        self, what: str, step: Callable, fingerprint: Callable | None = None, keep: Any = None
    ) -> Any:
        """A capture-phase step; with ``ranks`` checked on every rank (see capture_step)."""
        if self.ranks is None:
            return step()
        return self.ranks.capture_step(what, step, fingerprint, keep)

    def _warm_up(self, warm_up: Callable[[int], None], size: int, stream: Any) -> None:
        if self.backend != "cuda":
            warm_up(size)
            return
        side = stream if stream is not None else torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                warm_up(size)
        finally:  # also after a raise: the owner may free the buffers the warm-up's work uses
            torch.cuda.current_stream().wait_stream(side)

    def _pool_bytes(self) -> int:
        if self._pool is None:
            return 0
        return self._backend.pool_bytes(self._pool) or 0

    # -- per call ----------------------------------------------------------------------------
    def decide(
        self, size: int, fingerprint: int = 0, what: str = "inputs", fix: str | None = None
    ) -> Decision:
        """What a call of ``size`` does, decided on the agreed size.

        With ``ranks`` this is the call's one exchange: the largest size over the ranks,
        and ``fingerprint`` (:func:`breakgraph.distributed.fingerprint` of the call's
        inputs) must be equal on every rank (``what`` and ``fix`` word the error otherwise,
        see :meth:`RankGroup.agree <breakgraph.distributed.RankGroup.agree>`); else
        ``agree_size(size)`` if given. Cached per agreed size outside capture windows."""
        if self.closed:
            raise self._closed_error("decide")
        if type(size) is not int or size < 0:  # per call: the message is built only here
            size = self._checked_size(size, "decide", tell_ranks=True)
        agreed = size
        if self.ranks is not None:
            agreed = self.ranks.agree(size, fingerprint, what, fix)
        elif self.agree_size is not None:
            agreed = self.agree_size(size)
            if not isinstance(agreed, int) or agreed < size:
                raise InputError(
                    f"{self.who}: agree_size({size}) returned {agreed!r}; it must return an "
                    f"int no smaller than the size (the largest size over all ranks)."
                )
        decision = self._decisions.get(agreed)
        if decision is None:  # sizes above every bucket decide alike: one entry (-1) for all
            above = not self._sizes or agreed > self._sizes[-1]
            decision = self._decisions.get(-1) if above else None
            if decision is None:
                decision = self.choose(agreed)
                if not self._window_open:
                    self._decisions[-1 if above else agreed] = decision
        return decision

    def choose(self, size: int) -> Decision:
        """The decision for ``size`` as given: no exchange, no ``agree_size``, no cache."""
        if self.closed:
            raise self._closed_error("choose")
        if type(size) is not int or size < 0:
            size = self._checked_size(size, "choose")
        return choose_bucket(
            self._sizes, size, max_padding_fraction=self.max_padding_fraction,
            can_capture=self._window_open, on_miss=self.on_miss, faster=self._faster,
        )  # fmt: skip

    def replay(self, bucket: int, context: Any = None, *, size: int | None = None) -> Any:
        """Replay ``bucket``'s graph with ``context`` as the replay context; its capture's output
        (in graph memory). Counts a replay and, with ``size`` (live), ``bucket - size`` padding."""
        rung = self._rung(bucket, "replay")
        if size is not None and (type(size) is not int or not 0 <= size <= bucket):
            size = self._checked_size(size, "replay")  # numpy's int64 made the counter one
            if size > bucket:
                raise InputError(
                    f"{self.who}.replay: size={size} is larger than bucket {bucket}; pass the "
                    f"live size, which the bucket holds (decide(size) chose it)."
                )
        rung.graph.replay(context)
        stats = rung.stats
        stats.replays += 1
        if size is not None:
            stats.padded += bucket - size
        return rung.output

    def record_eager(self, reason: str) -> None:
        """Count an eager fallback for ``reason``; with ``ranks``, make it safe to run an
        eager forward that communicates (:meth:`RankGroup.before_eager
        <breakgraph.distributed.RankGroup.before_eager>`)."""
        fallbacks = self.stats.eager_fallbacks
        fallbacks[reason] = fallbacks.get(reason, 0) + 1
        if self.ranks is not None:
            self.ranks.before_eager()

    def graph(self, bucket: int, *, what: str = "graph") -> BreakableCUDAGraph:
        """The captured graph of ``bucket`` (``what`` names the caller's method in the error
        for a size that is not a bucket)."""
        return self._rung(bucket, what).graph

    def output(self, bucket: int) -> Any:
        """What ``record(bucket)`` returned at capture (graph memory, rewritten by replays)."""
        return self._rung(bucket, "output").output

    # -- tuning ------------------------------------------------------------------------------
    def tune(
        self,
        context: Callable[[int], Any] | None = None,
        repeats: int = 1,
        margin: float = 0.02,
        warmup: int = 1,
    ) -> dict[int, float]:
        """Time every bucket's graph; send each size to the fastest bucket that holds it.

        GEMM libraries pick kernels by shape, and some sizes are slow: on an H200 a
        Llama-1B prefill padded to 208 tokens took longer than one padded to 224 or 256.
        Each bucket replays ``repeats`` times (after ``warmup`` untimed replays; its capture already
        launched every segment once, so the graph is uploaded) with ``context(size)`` (default: its
        capture context), made before each timing, on whatever its buffers hold; then every bucket a
        route would rest on (it, and the bucket it would go to) is timed once more and keeps the
        lower time (:func:`~breakgraph.buckets.tuned_times`: a route should not rest on one sample),
        then :meth:`route`. One host wait per timing: a context that stages inputs (a runner's step
        buffers) would otherwise wait for the device before every replay. The replays are device
        work, the largest part of a runner's construction after the captures
        (``benchmarks/capture_profile.py``). One timed replay is the default: on an H200 (Llama-1B
        widths, 64 buckets) one replay's time varied by 0.25 % (median; 0.8 % at most) between three
        tunings, well inside the 2 % margin; five replays took three times as long (2.5 s against
        0.85 s), and their routes differed between tunings on the same one bucket (at the margin) as
        those of one replay.
        CUDA only (the emulated backend's times mean nothing: nothing is timed or routed);
        not with ``ranks`` (timings differ between ranks, and every rank must take the same
        bucket). Returns the milliseconds per replay of each bucket.
        """
        if self.ranks is not None:
            raise InputError(
                f"{self.who}.tune: timings differ between ranks, so the routes would too; "
                f"every rank must replay the same bucket. Tune in one process, or not at all."
            )
        self._check_open("tune")
        for name, value, least in (("repeats", repeats, 1), ("warmup", warmup, 0)):
            validate_count(value, least, f"{self.who}.tune: {name}")
        validate_callable(context, f"{self.who}.tune: context")  # here, not after the timings
        margin = validate_real(margin, f"{self.who}.tune: margin", least=0.0)
        if self.backend != "cuda" or not self._sizes:
            return {}

        def time_one(size: int) -> float:
            graph = self._rungs[size].graph
            # staged for each timing: the buckets' inputs may share one buffer (a runner's)
            args = () if context is None else (context(size),)
            for _ in range(warmup):
                graph.replay(*args)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                graph.replay(*args)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / repeats

        times = tuned_times(self._sizes, time_one, margin)
        self.route(times, margin)
        return times

    def route(self, times: Mapping[int, float], margin: float = 0.02) -> dict[int, int]:
        """Route each bucket's calls to a larger bucket that ``times`` (ms per replay of every
        bucket: :meth:`tune` measures them, or pass a profile's) say is faster by more than
        ``margin`` (:func:`faster_buckets`). Fills ``stats.routed`` and ``replay_ms``."""
        self._check_open("route")
        margin = validate_real(margin, f"{self.who}.route: margin", least=0.0)  # < 0: slower
        if not isinstance(times, Mapping):
            raise InputError(f"{self.who}.route: times must map buckets to ms, got {times!r}.")
        for size, ms in times.items():
            validate_real(ms, f"{self.who}.route: times[{size!r}]")
        unknown = sorted(set(times) - set(self._rungs))
        if unknown:
            raise InputError(f"{self.who}.route: {unknown} are not captured buckets.")
        faster = faster_buckets(times, margin)
        for size, ms in times.items():
            self._rungs[size].stats.replay_ms = ms
        self._faster = faster
        self._decisions.clear()
        self.stats.routed = dict(faster)
        return dict(faster)

    # -- release -----------------------------------------------------------------------------
    def close(self) -> None:
        """Release every graph; final: later decide, replay and capture raise ``ReplayError``.

        After a failed multi-rank NCCL capture step the graphs are kept until the process
        exits instead (see :meth:`RankGroup.capture_step
        <breakgraph.distributed.RankGroup.capture_step>`). Counters stay readable."""
        if self.closed:
            return
        self.closed = True
        self._window_open = False
        self._release()

    def discard(self) -> None:
        """Release every graph and stay open: the next capture starts from none (an owner whose
        capture phase failed halfway leaves nothing half-captured), in a new pool: torch gives
        a pool up with its last graph, even one the ladder was given. Counters stay
        readable."""
        self._check_open("discard")
        self._release()

    def _release(self) -> None:
        graphs = [rung.graph for rung in self._rungs.values()]
        self._rungs.clear()
        self._sizes = ()
        self._decisions.clear()
        self._faster = {}
        self.stats.routed = {}  # the routes went with the graphs
        if graphs:  # torch gives a pool up with its last graph (backends.base
            # .released_pool_error), and whether these were the last of a pool the ladder was
            # given is not known here: the next capture starts a new pool
            self._pool = None
        distributed.release_graphs(graphs, self.ranks)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise self._closed_error(what)

    def _closed_error(self, what: str) -> ReplayError:
        return ReplayError(
            f"{self.who}.{what}: closed by close(), which released its graphs for good; "
            f"build a new one."
        )

    def _checked_size(self, size: Any, what: str, tell_ranks: bool = False) -> int:
        """``size`` as an int >= 0 (numpy's ints too), else ``InputError`` naming ``what``;
        with ``tell_ranks`` the other ranks raise too instead of waiting for this one. Called
        only where the per-call check (a plain int >= 0) did not pass."""
        try:
            return validate_count(size, 0, f"{self.who}.{what}: size")
        except InputError:
            if tell_ranks and self.ranks is not None:
                self.ranks.report_failure()
            raise

    def _rung(self, bucket: Any, what: str) -> _Rung:
        try:
            return self._rungs[bucket]
        except (KeyError, TypeError):  # TypeError: an unhashable bucket (a list)
            if self.closed:
                raise self._closed_error(what) from None
            raise InputError(
                f"{self.who}.{what}: no bucket {bucket!r}; captured: {self._sizes}."
            ) from None


def _name_the_sync(
    record: Callable[[int], Any], size: int, context: Any, all_devices: bool = False
) -> None:
    """After CUDA refused a host sync in an unwatched capture of bucket ``size``: run
    ``record(size)`` once more, eagerly (like a warm-up) under the sync-watching dispatch mode,
    which raises ``HostSyncError`` naming the operation and the line before it runs. Not a
    second capture: after an invalidated capture the shared pool must not be recorded into
    again. Returns quietly when the eager run shows nothing (the caller re-raises CUDA's)."""
    try:
        watching = CompileTransparentSegmentMode(all_devices=all_devices, check_syncs=True)
        with context_scope(context), watching:
            record(size)
    except HostSyncError:
        raise
    except Exception:  # noqa: S110 (CUDA's own error, re-raised by the caller, says enough)
        pass
