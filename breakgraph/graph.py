"""The capture/replay path: ``BreakableCUDAGraph``, ``capture()`` and the break protocol.

A CUDA graph freezes addresses, launch parameters and host decisions and runs no
Python on replay. A ``BreakableCUDAGraph`` is an ordered list of captured segments
interleaved with eager breaks::

    replay():  segment 0, break 0, segment 1, break 1, ..., last segment

Inside ``with capture(g):`` a call to a function decorated with
:func:`~breakgraph.eager_on_graph` ends the segment being captured, runs the
function eagerly once, registers a *replay function* (call it again with the same
arguments, copy its fresh results into the capture-time outputs) and begins a new
segment. Everything in this file runs once at capture except ``replay()``, which
runs on every model step and is kept to a loop over prebuilt callables.

Lifetimes: the arguments and outputs of every break are held strongly by the
graph until ``reset()``; captured kernels read them at frozen addresses, and a
weak reference would let another graph sharing the pool reuse their memory.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import debug as _debug
from .backends import select_backend
from .copyback import build_copy_back
from .errors import CaptureError, HostSyncError, ReplayError

__all__ = ["BreakableCUDAGraph", "capture", "is_capturing", "replay_context", "context_scope"]


class _ThreadState(threading.local):
    capture: _Capture | None = None  # the capture running on this thread
    context: Any = None  # what replay_context() returns


_state = _ThreadState()
_capture_lock = threading.Lock()  # one capture at a time per process (CUDA requires it too)
_NO_CONTEXT = object()


@dataclass
class _Break:
    """One eager break: what runs between two segments on replay."""

    name: str
    function: Callable | None  # None for break_graph(): nothing runs on replay
    args: tuple  # held strongly for the graph's lifetime
    kwargs: dict
    output: Any  # the capture-time output, into which replays copy
    replay: Callable[[], None] | None


class BreakableCUDAGraph:
    """A sequence of captured CUDA-graph segments separated by eager functions.

    Capture it with :func:`breakgraph.capture`, then call :meth:`replay` on every
    step after refreshing the static inputs in place.

    Example::

        >>> import torch, breakgraph
        >>> @breakgraph.eager_on_graph
        ... def host_scale(x):
        ...     return x * 2              # could use .item(), Python loops, ...
        >>> static_x = torch.randn(4)
        >>> g = breakgraph.BreakableCUDAGraph()
        >>> with breakgraph.capture(g, backend="emulated"):
        ...     out = host_scale(static_x + 1) - 1
        >>> g
        BreakableCUDAGraph(backend='emulated', segments=2, breaks=1: [segment 0] -> host_scale -> [segment 1])
        >>> _ = static_x.copy_(torch.arange(4.0)); g.replay()
        >>> out.tolist()
        [1.0, 3.0, 5.0, 7.0]
    """

    def __init__(self) -> None:
        self._segments: list = []
        self._breaks: list = []
        self._steps: tuple = ()  # prebuilt replay sequence: segment.replay, break.replay, ...
        self._pool: Any = None
        self._backend: str | None = None
        self._context: Any = None
        self._capturing = False
        self._timers: list | None = None  # debug mode: host time of each break
        self._unjoined: dict = {}  # debug mode: segment -> side streams breakgraph had to join

    @property
    def num_segments(self) -> int:
        """Number of captured segments (``num_breaks + 1`` after a capture, 0 before)."""
        return len(self._segments)

    @property
    def num_breaks(self) -> int:
        """Number of eager breaks between the segments."""
        return len(self._breaks)

    @property
    def backend(self) -> str | None:
        """``"cuda"`` or ``"emulated"`` once captured, else None."""
        return self._backend

    @property
    def break_names(self) -> list:
        """Names of the eager functions, in replay order."""
        return [b.name for b in self._breaks]

    def pool(self) -> Any:
        """The memory-pool handle this graph was captured into.

        Pass it as ``capture(other, pool=g.pool())`` to let ``other`` share the
        memory (safe when the graphs never replay concurrently).
        """
        if self._pool is None:
            raise CaptureError("BreakableCUDAGraph.pool(): the graph holds no capture yet.")
        return self._pool

    def replay(self, context: Any = _NO_CONTEXT) -> None:
        """Replay every segment and eager break in order, on the current stream.

        ``context`` is what :func:`breakgraph.replay_context` returns inside the
        eager functions during this replay (default: the ``context`` given to
        ``capture``). It is how per-step host state reaches eager functions, which
        are re-called with their capture-time arguments.
        """
        steps = self._steps
        if not steps:
            raise ReplayError(
                "BreakableCUDAGraph.replay(): nothing was captured. Capture first with "
                "`with breakgraph.capture(g): ...`."
            )
        state = _state
        previous = state.context
        state.context = self._context if context is _NO_CONTEXT else context
        try:
            for step in steps:
                step()
        finally:
            state.context = previous

    def reset(self) -> None:
        """Drop every segment and break and release what they held; the graph can be captured again."""
        if self._capturing:
            raise CaptureError("BreakableCUDAGraph.reset() inside its own capture.")
        for segment in self._segments:
            segment.reset()
        self._segments, self._breaks, self._steps = [], [], ()
        self._pool = self._backend = self._context = self._timers = None
        self._unjoined = {}

    def report(self) -> _debug.GraphReport:
        """The coverage report: segments (aten ops each), breaks (names, host time per
        replay when captured in debug mode), graph-pool memory (CUDA).

        Example::

            >>> import torch, breakgraph
            >>> x = torch.randn(2)
            >>> g = breakgraph.BreakableCUDAGraph()
            >>> with breakgraph.capture(g, backend="emulated"):
            ...     y = x.exp()
            ...     breakgraph.break_graph()
            >>> g.report().segment_ops
            [1, 0]
        """
        if not self._segments:
            raise ReplayError("BreakableCUDAGraph.report(): nothing was captured.")
        timers = self._timers or [None] * len(self._breaks)
        return _debug.GraphReport(
            backend=self._backend,
            segment_ops=[s.operations for s in self._segments],
            break_names=self.break_names,
            break_host_us=[t.mean_us() if t is not None else None for t in timers],
            graph_memory_bytes=_debug.pool_bytes(self._pool) if self._backend == "cuda" else None,
            unjoined_streams=dict(self._unjoined),
        )

    def __repr__(self) -> str:
        name = type(self).__name__
        if not self._segments:
            return f"{name}(empty)"
        parts = ["[segment 0]"]
        for i, brk in enumerate(self._breaks):
            parts += [brk.name, f"[segment {i + 1}]"]
        return (
            f"{name}(backend={self._backend!r}, segments={self.num_segments}, "
            f"breaks={self.num_breaks}: {' -> '.join(parts)})"
        )


def is_capturing() -> bool:
    """True while the calling code is being recorded into a breakgraph segment.

    False outside any capture and inside eager functions (they run for real).

    Example::

        >>> import breakgraph
        >>> breakgraph.is_capturing()
        False
    """
    capture = _state.capture
    return capture is not None and capture.in_segment


def replay_context() -> Any:
    """The per-replay host state of the graph being replayed (or captured).

    Eager functions are re-called on replay with their *capture-time* arguments,
    so anything that changes per step (the live batch's lengths, say) must be read
    at replay time. Pass it as ``g.replay(context=obj)`` (or ``capture(g,
    context=obj)`` for the capture pass) and read it here.

    Example::

        >>> import torch, breakgraph
        >>> @breakgraph.eager_on_graph
        ... def scale(x):
        ...     return x * breakgraph.replay_context()["factor"]
        >>> x = torch.ones(2)
        >>> g = breakgraph.BreakableCUDAGraph()
        >>> with breakgraph.capture(g, backend="emulated", context={"factor": 1.0}):
        ...     y = scale(x)
        >>> g.replay(context={"factor": 3.0}); y.tolist()
        [3.0, 3.0]
    """
    context = _state.context
    if context is None:
        raise ReplayError(
            "breakgraph.replay_context(): no context is set. Pass one with "
            "g.replay(context=...) and capture(g, context=...), or wrap eager calls in "
            "`with breakgraph.context_scope(...)`."
        )
    return context


@contextlib.contextmanager
def capture(
    graph: BreakableCUDAGraph,
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "global",
    *,
    backend: str | None = None,
    context: Any = None,
    detect_syncs: bool = True,
    debug: bool | None = None,
) -> Iterator[BreakableCUDAGraph]:
    """Capture the work in the ``with`` block into ``graph``, breaking at eager functions.

    Mirrors ``torch.cuda.graph``: ``pool`` is a handle from
    ``torch.cuda.graph_pool_handle()`` or ``other.pool()`` (all segments of the
    graph share it), ``stream`` the capture stream (a private one by default) and
    ``capture_error_mode`` is passed to ``CUDAGraph.capture_begin``. ``backend`` is
    ``"cuda"`` or ``"emulated"`` (default: ``$BREAKGRAPH_BACKEND``, else CUDA).
    ``context`` is what :func:`replay_context` returns during this capture and, by
    default, during replays. ``detect_syncs=False`` turns off the check that names
    host synchronisations inside segments. ``debug=True`` (default:
    ``$BREAKGRAPH_DEBUG``) adds the checks of :mod:`breakgraph.debug` to every replay.

    Unlike ``torch.cuda.graph``, the capture pass computes real values: each
    segment is replayed once as soon as it is captured, so eager functions see real
    inputs. Warm up first anyway (libraries pick algorithms on their first call).

    On any exception nothing is left behind: the graph is reset, hooks are
    removed, the current stream is restored and a new capture works.

    Example::

        >>> import torch, breakgraph
        >>> x = torch.randn(3)
        >>> g = breakgraph.BreakableCUDAGraph()
        >>> with breakgraph.capture(g, backend="emulated"):
        ...     y = x.sin()
        ...     breakgraph.break_graph()
        ...     z = y * 2
        >>> (g.num_segments, g.num_breaks)
        (2, 1)
    """
    if not isinstance(graph, BreakableCUDAGraph):
        raise CaptureError(
            f"breakgraph.capture: expected a BreakableCUDAGraph, got {type(graph).__name__}."
        )
    if graph._segments or graph._capturing:
        raise CaptureError(
            "breakgraph.capture: this graph already holds a capture; call g.reset() first "
            "or capture into a new BreakableCUDAGraph."
        )
    chosen = select_backend(backend)
    if not _capture_lock.acquire(blocking=False):
        raise CaptureError(
            "breakgraph.capture: another capture is in progress (nested captures are not "
            "supported, and CUDA allows one capture at a time). Finish it first."
        )
    session = None
    try:
        session = _Capture(
            graph,
            chosen,
            pool,
            stream,
            capture_error_mode,
            context,
            detect_syncs,
            _debug.debug_enabled(debug),
        )
        yield graph
        session.finish()
    except BaseException as exc:
        if session is not None:
            session.abort()
        if _is_cuda_capture_failure(exc):
            raise HostSyncError(
                f"the CUDA capture failed inside a segment ({exc}). This is usually a host "
                f"synchronisation (.item(), nonzero, .cpu(), torch.cuda.synchronize()) in code "
                f"breakgraph could not see; move it into a function decorated with "
                f"@breakgraph.eager_on_graph. The graph was reset; a new capture will work."
            ) from exc
        raise
    finally:
        _capture_lock.release()


def _is_cuda_capture_failure(exc: BaseException) -> bool:
    if isinstance(exc, HostSyncError) or not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return "capturing" in text or "StreamCapture" in text or "during capture" in text


class _Capture:
    """One running capture: opens the backend session, cuts segments at breaks."""

    def __init__(
        self,
        graph,
        backend,
        pool,
        stream,
        capture_error_mode,
        context,
        detect_syncs,
        debug: bool = False,
    ):
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise CaptureError(
                f"breakgraph.capture: capture_error_mode must be 'global', 'thread_local' or "
                f"'relaxed', got {capture_error_mode!r}."
            )
        self.graph = graph
        self.in_segment = False
        self._closed = False
        self.watch = _debug.InputWatch() if debug else None
        self._gc_was_enabled = gc.isenabled()
        self._previous_context = _state.context
        gc.collect()  # once, not once per segment: it dominated capture time in peers
        gc.disable()
        try:
            self.session = backend.open(
                pool,
                stream,
                capture_error_mode,
                detect_syncs,
                self.watch.observe if debug else None,
            )
        except BaseException:
            self._restore()
            raise
        graph._capturing = True
        graph._backend, graph._pool, graph._context = backend.name, self.session.pool, context
        _state.capture, _state.context = self, context
        try:
            self._begin_segment()
        except BaseException:  # capture() holds no session to abort yet: clean up here
            self.abort()
            raise

    def _begin_segment(self) -> None:
        self.session.begin_segment()
        self.in_segment = True

    def _end_segment(self) -> None:
        self.in_segment = False
        segment = self.session.end_segment()
        self.graph._segments.append(segment)
        if self.watch is not None:
            index = self.watch.segment
            if segment.unjoined:
                self.graph._unjoined[index] = [repr(s) for s in segment.unjoined]
                _debug.warn_unjoined(index, segment.unjoined)
            self.watch.segment += 1

    def run_break(
        self,
        function: Callable,
        name: str,
        args: tuple,
        kwargs: dict,
        capture_stub: Callable | None,
        check_values: bool,
    ) -> Any:
        """End the segment, run ``function`` eagerly, register its replay, begin a new segment."""
        if not self.in_segment:  # an eager function called from inside another one
            return function(*args, **kwargs)
        self._end_segment()
        if function is None:  # break_graph(): an empty break, nothing runs on replay
            output, replay = None, None
        else:
            output = (capture_stub or function)(*args, **kwargs)
            copy_back = build_copy_back(output, name, check_values)

            def replay() -> None:
                copy_back(function(*args, **kwargs))

        self.graph._breaks.append(_Break(name, function, args, kwargs, output, replay))
        if self.watch is not None:
            self.watch.observe_break(name, args, kwargs, output)
        self._begin_segment()
        return output

    def finish(self) -> None:
        self._end_segment()
        graph = self.graph
        if self.watch is None:
            steps = [graph._segments[0].replay]
            for brk, segment in zip(graph._breaks, graph._segments[1:]):
                if brk.replay is not None:
                    steps.append(brk.replay)
                steps.append(segment.replay)
        else:
            steps = self._debug_steps()
        graph._steps = tuple(steps)
        graph._capturing = False
        self._close()

    def _debug_steps(self) -> list:
        """Replay steps with input checks, break timers and NVTX ranges (debug mode only)."""
        graph = self.graph
        cuda = graph._backend == "cuda"
        graph._timers = [_debug.BreakTimer() for _ in graph._breaks]
        steps = []
        for i, segment in enumerate(graph._segments):
            check = self.watch.checker(i)
            if check is not None:
                steps.append(check)
            steps.append(_debug.nvtx(segment.replay, f"segment {i}") if cuda else segment.replay)
            if i < len(graph._breaks) and graph._breaks[i].replay is not None:
                brk = graph._breaks[i]
                step = graph._timers[i].wrap(brk.replay)
                steps.append(_debug.nvtx(step, f"break {i}: {brk.name}") if cuda else step)
        return steps

    def abort(self) -> None:
        """Leave nothing behind: no half-built graph, no hook, the previous stream current."""
        if self._closed:
            return
        self.in_segment = False
        try:
            self.session.abort()
        finally:
            self.graph._capturing = False
            self.graph.reset()
            self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self.session.close()
            self._restore()

    def _restore(self) -> None:
        _state.capture, _state.context = None, self._previous_context
        if self._gc_was_enabled:
            gc.enable()


@contextlib.contextmanager
def context_scope(context: Any) -> Iterator[None]:
    """Make ``replay_context()`` return ``context`` while eager code runs outside any graph.

    Runners use it for eager fallbacks, so eager functions find the same state
    whether they run from a replay or from a plain call.

    Example::

        >>> import breakgraph
        >>> with breakgraph.context_scope({"n": 3}):
        ...     breakgraph.replay_context()["n"]
        3
    """
    previous = _state.context
    _state.context = context
    try:
        yield
    finally:
        _state.context = previous
