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
runs on every model step and is a loop over prebuilt callables.

What a capture produces is one immutable record, :class:`Captured`, stored on the
graph when the capture finishes (never half-built: a failed capture stores nothing),
and dropped by ``reset()``.

Lifetimes: the arguments and outputs of every break are held strongly by the
record until ``reset()``; captured kernels read them at frozen addresses, and a
weak reference would let another graph sharing the pool reuse their memory.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import debug as _debug
from .backends import select_backend
from .backends.base import Backend, CaptureOptions, Segment, Session
from .backends.cuda import capture_failure_error, is_capture_failure
from .copyback import build_copy_back
from .errors import CaptureError, ReplayError
from .modes import any_autocast, autocast_as, break_modes, pin_modes
from .ownership import call_and_classify, refuse_one_shot_iterators, storages_of
from .state import capture_turn, context_scope, is_capturing, replay_context, state

__all__ = ["BreakableCUDAGraph", "capture", "is_capturing", "replay_context", "context_scope"]

# one capture at a time per process: a capture started on another thread waits for its turn
# (state.capture_turn, held around every capture below)
_NO_CONTEXT = object()


@dataclass(frozen=True)
class BreakOptions:
    """How one eager function breaks a graph; built once, when it is decorated."""

    name: str
    capture_stub: Callable | None = None
    check_values: bool = True


@dataclass(frozen=True)
class Break:
    """One eager break: what runs between two segments on replay."""

    name: str
    function: Callable | None  # None for break_graph(): nothing runs on replay
    args: tuple  # held strongly for the graph's lifetime
    kwargs: dict
    output: Any  # the capture-time output, into which replays copy
    replay: Callable[[], None] | None


@dataclass(frozen=True)
class Captured:
    """Everything one capture produced; ``replay()`` only runs ``steps``."""

    backend: Backend
    pool: Any
    context: Any
    segments: tuple[Segment, ...]
    breaks: tuple[Break, ...]
    steps: tuple[Callable[[], None], ...]  # segment.replay, break.replay, ... (prebuilt)
    timers: tuple | None = None  # debug mode: host time of each break
    unjoined: dict | None = None  # debug mode: segment -> side streams breakgraph joined
    without_grad: bool = False  # every break was captured under no_grad: replays run under it
    autocast: Any = False  # every break's autocast (None: off), replays run so; False: mixed


class BreakableCUDAGraph:
    """A sequence of captured CUDA-graph segments separated by eager functions.

    Capture it with :func:`breakgraph.capture`, then call :meth:`replay` on every
    step after refreshing the static inputs in place.

    Thread safety: a graph replays on the calling thread's current stream and reads
    and writes fixed memory, so one graph must not be replayed from two threads at
    once (a replay that begins while another thread replays it raises ``ReplayError``);
    different graphs may, on different streams, if they share no pool.

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
    """  # noqa: E501

    def __init__(self) -> None:
        self._captured: Captured | None = None
        self._capturing = False
        # a replay of it runs, on some thread: a second one (another thread's, or one of its
        # eager functions') would overwrite the memory the first one reads, a reset free it
        self._replaying = False

    @property
    def num_segments(self) -> int:
        """Number of captured segments (``num_breaks + 1`` after a capture, 0 before)."""
        return len(self._captured.segments) if self._captured else 0

    @property
    def num_breaks(self) -> int:
        """Number of eager breaks between the segments."""
        return len(self._captured.breaks) if self._captured else 0

    @property
    def backend(self) -> str | None:
        """``"cuda"`` or ``"emulated"`` once captured, else None."""
        return self._captured.backend.name if self._captured else None

    @property
    def break_names(self) -> list:
        """Names of the eager functions, in replay order."""
        return [b.name for b in self._captured.breaks] if self._captured else []

    def pool(self) -> Any:
        """The memory-pool handle this graph was captured into.

        Pass it as ``capture(other, pool=g.pool())`` to let ``other`` share the
        memory (safe when the graphs never replay concurrently).
        """
        if self._captured is None:
            raise CaptureError("BreakableCUDAGraph.pool(): the graph holds no capture yet.")
        return self._captured.pool

    def replay(self, context: Any = _NO_CONTEXT) -> None:
        """Replay every segment and eager break in order, on the current stream.

        ``context`` is what :func:`breakgraph.replay_context` returns inside the
        eager functions during this replay (default: the ``context`` given to
        ``capture``). It is how per-step host state reaches eager functions, which
        are re-called with their capture-time arguments.
        """
        captured = self._captured
        if captured is None:
            raise ReplayError(
                "BreakableCUDAGraph.replay(): nothing was captured. Capture first with "
                "`with breakgraph.capture(g): ...`."
            )
        if self._replaying:
            raise self._refused("replay()")
        outer = state.capture
        if outer is not None and outer.in_segment:
            raise CaptureError(
                "BreakableCUDAGraph.replay() inside another graph's capture: the outer capture "
                "would record this graph's kernels with its eager breaks' capture-time host "
                "values frozen. Replay it before or after the capture, or call the model "
                "function itself inside the capture."
            )
        previous = state.context
        grad_off = captured.without_grad and torch.is_grad_enabled()
        cast = captured.autocast is not False and (captured.autocast or any_autocast())
        restore = None
        # the thread's state is set inside the try: an interrupt (Ctrl-C) can leave none of it
        try:
            self._replaying = True
            state.context = captured.context if context is _NO_CONTEXT else context
            if grad_off:  # breaks captured under no_grad replay under it, whatever the mode
                torch.set_grad_enabled(False)
            if cast:  # breaks replay under their capture's autocast, here one for all (.modes)
                restore = autocast_as(captured.autocast)
            for step in captured.steps:
                step()
        finally:
            self._replaying = False
            state.context = previous
            if grad_off:
                torch.set_grad_enabled(True)
            if restore is not None:
                restore.close()

    def reset(self) -> None:
        """Drop every segment and break and release what they held; the graph can be captured
        again. Refused inside its own capture, and while it replays (called by one of its eager
        functions, or on another thread)."""
        if self._capturing:
            raise CaptureError("BreakableCUDAGraph.reset() inside its own capture.")
        if self._replaying:
            raise self._refused("reset()")
        captured, self._captured = self._captured, None
        if captured is not None:
            for segment in captured.segments:
                segment.reset()

    def _refused(self, what: str) -> ReplayError:
        """``what`` (``replay()``, ``reset()``) while this graph replays: inside that replay (an
        eager function of it: the replay's frame on this thread's stack, looked up only here)
        or on another thread. A flag, not a lock: two replays that begin at once may both pass."""
        frame = sys._getframe(2)  # the caller of replay() or reset()
        while frame is not None and (frame.f_code is not _REPLAY_CODE
                                     or frame.f_locals.get("self") is not self):  # fmt: skip
            frame = frame.f_back
        if frame is None:
            return ReplayError(
                f"BreakableCUDAGraph.{what} while another thread replays this graph: it reads "
                f"and writes fixed memory (static inputs, outputs), so two replays at once give "
                f"each thread the other's results, silently (on CUDA too), and a reset frees what "
                f"the replay runs. Use a graph from one thread at a time (a lock around filling "
                f"its inputs, replay() and reading its outputs), or one graph per thread."
            )
        return ReplayError(
            f"BreakableCUDAGraph.{what} inside its own replay (an eager function of this graph "
            f"called it): the rest of the replay would read outputs that a replay overwrote, or "
            f"run segments that were reset (CUDA raises there; the emulated backend would skip "
            f"them, silently). Call it after replay() returns, from the code that called replay()."
        )

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
        captured = self._captured
        if captured is None:
            raise ReplayError("BreakableCUDAGraph.report(): nothing was captured.")
        timers = captured.timers or (None,) * len(captured.breaks)
        return _debug.GraphReport(
            backend=captured.backend.name,
            segment_ops=[s.operations for s in captured.segments],
            break_names=self.break_names,
            break_host_us=[t.mean_us() if t is not None else None for t in timers],
            graph_memory_bytes=captured.backend.pool_bytes(captured.pool),
            unjoined_streams=dict(captured.unjoined or {}),
        )

    def __repr__(self) -> str:
        name = type(self).__name__
        if self._captured is None:
            return f"{name}(empty)"
        parts = ["[segment 0]"]
        for i, brk in enumerate(self._captured.breaks):
            parts += [brk.name, f"[segment {i + 1}]"]
        return (
            f"{name}(backend={self.backend!r}, segments={self.num_segments}, "
            f"breaks={self.num_breaks}: {' -> '.join(parts)})"
        )


_REPLAY_CODE = BreakableCUDAGraph.replay.__code__


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
    collect_garbage: bool | None = None,
) -> Iterator[BreakableCUDAGraph]:
    """Capture the work in the ``with`` block into ``graph``, breaking at eager functions.

    Mirrors ``torch.cuda.graph``: ``pool`` is a handle from
    ``torch.cuda.graph_pool_handle()`` or ``other.pool()``, or a ``torch.cuda.MemPool`` (all
    segments of the graph share it), ``stream`` the capture stream (a private one by default) and
    ``capture_error_mode`` is passed to ``CUDAGraph.capture_begin``. ``backend`` is
    ``"cuda"`` or ``"emulated"`` (default: ``$BREAKGRAPH_BACKEND``, else CUDA).
    ``context`` is what :func:`replay_context` returns during this capture and, by
    default, during replays. ``detect_syncs=False`` turns off the check that names
    host synchronisations inside segments (on CUDA nothing watches the operations then, which
    makes a capture faster; CUDA still refuses a sync, reported as ``HostSyncError`` without
    the line, and ``report()`` counts no operations). ``debug=True`` (default:
    ``$BREAKGRAPH_DEBUG``) adds the checks of :mod:`breakgraph.debug` to every replay.
    ``collect_garbage`` decides, on CUDA, what runs before the capture to hand device memory
    back for the graph's pool: ``None`` does what ``torch.cuda.graph`` does (a full
    ``gc.collect()`` only when ``torch.compiler.config.force_cudagraph_gc`` is set, then
    ``torch.cuda.empty_cache()``), ``True`` both always, ``False`` neither (a runner
    capturing many graphs in a row flushes the cache once). A full collection frees the
    device memory that dead reference cycles hold, and walks every object of the process to
    do it (0.5 s in a big one). The emulated backend has no device memory and does neither.
    The collector is disabled during the capture either way.

    Unlike ``torch.cuda.graph``, the capture pass computes real values: each
    segment is replayed once as soon as it is captured, so eager functions see real
    inputs. Warm up first anyway (libraries pick algorithms on their first call).

    On any exception nothing is left behind: the graph holds no capture, hooks are
    removed, the current stream is restored and a new capture works.

    Captures run one at a time per process: a capture started while another thread is
    capturing waits for it (runners and managers serving from several threads take turns);
    a capture started inside a capture on the same thread raises ``CaptureError``.

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
    _refuse_held(graph)
    options = CaptureOptions(  # checks the arguments (see there)
        pool,
        stream,
        capture_error_mode,
        detect_syncs,
        _debug.debug_enabled(debug, "breakgraph.capture"),
        collect_garbage,
    )
    chosen = select_backend(backend)
    if state.capture is not None:  # this thread is capturing: waiting would never end
        raise CaptureError(
            "breakgraph.capture: a capture is already in progress on this thread (nested "
            "captures are not supported, and CUDA allows one capture at a time). Finish it "
            "first, or call the function itself inside the outer capture (one left open in "
            "a generator that yielded stays open until the generator is closed: gen.close())."
        )
    # a capture on another thread: wait for it to finish (or refuse one whose thread ended).
    # `with`, not acquire() before a try: an interrupt between the two left the lock held
    with capture_turn(graph):
        recording = None
        try:
            _refuse_held(graph)  # again: another thread may have captured into it meanwhile
            recording = _Capture(graph, chosen, options, context)
            yield graph
            recording.finish()
        except BaseException as exc:
            if recording is not None:
                recording.abort()
            if chosen.name == "cuda" and is_capture_failure(exc):  # not the user's own error
                raise capture_failure_error(exc) from exc
            raise


def _refuse_held(graph: BreakableCUDAGraph) -> None:
    if graph._captured is not None or graph._capturing:
        raise CaptureError(
            "breakgraph.capture: this graph already holds a capture; call g.reset() first "
            "or capture into a new BreakableCUDAGraph."
        )


class _Capture:
    """One running capture: opens the backend session, cuts segments at breaks."""

    def __init__(
        self, graph: BreakableCUDAGraph, backend: Backend, options: CaptureOptions, context: Any
    ):
        self.graph, self.backend, self.options, self.context = graph, backend, options, context
        self.in_segment = False
        self.failure: str | None = None  # why the capture cannot be completed
        self.segments: list[Segment] = []
        self.breaks: list[Break] = []
        self.modes: list[tuple] = []  # per break: its grad mode and autocast (.modes)
        self.unjoined: dict = {}
        self._closed = False
        self.watch = _debug.InputWatch() if options.debug else None
        self._gc_was_enabled = gc.isenabled()
        self._autocast_cached = torch.is_autocast_cache_enabled()
        self._previous_context = state.context
        # no collection inside the capture: finalizers would run their tensor operations (and
        # CUDA frees or syncs) inside a segment. A collection before it, which hands device
        # memory held by dead cycles back (collect_garbage), is the CUDA backend's.
        # no autocast cache inside the capture: a weight's cast cached before it (a warm-up in
        # the same autocast region) is memory the cache frees when the region ends, which the
        # graph would go on reading; each cast is captured as a kernel instead (pytorch#71631)
        try:  # an interrupt anywhere from here on leaves none of it (gc off, the session's hooks)
            gc.disable()
            torch.set_autocast_cache_enabled(False)
            observer = self.watch.observe if self.watch is not None else None
            self.session: Session = backend.open(options, observer)
        except BaseException:
            self._restore()
            raise
        try:
            graph._capturing = True
            state.capture, state.context = self, context
            self._begin_segment()
        except BaseException:  # capture() holds no recording to abort yet: clean up here
            self.abort()
            raise

    def _begin_segment(self) -> None:
        self.session.begin_segment()
        self.in_segment = True

    def _end_segment(self, before: str | None = None) -> None:
        self.in_segment = False
        segment = self.session.end_segment(before)
        self.segments.append(segment)
        if self.watch is not None:
            index = self.watch.segment
            if segment.unjoined:
                self.unjoined[index] = [repr(s) for s in segment.unjoined]
                _debug.warn_unjoined(index, segment.unjoined)
            self.watch.segment += 1

    def fail(self, why: str) -> None:
        """Mark the capture as one that cannot complete (the first reason is kept): an
        exception the user's code caught inside the block left the segments without what
        raised, so :meth:`finish` refuses instead of storing a graph that differs from eager."""
        if self.failure is None:
            self.failure = why

    def run_break(
        self, function: Callable | None, options: BreakOptions, args: tuple, kwargs: dict
    ) -> Any:
        """End the segment, run ``function`` eagerly, register its replay, begin a new segment.
        Called only inside a segment (``eager_on_graph``'s wrapper and ``break_graph`` check
        ``in_segment``: an eager function called from inside another one runs plainly)."""
        try:
            self._end_segment(options.name)
        except BaseException as exc:  # the segment is gone: nothing after this is captured
            self.fail(f"ending the segment before {options.name!r} raised {exc!r}")
            raise
        try:
            if function is None:  # break_graph(): an empty break, nothing runs on replay
                output, replay = None, None
            else:
                output, replay = self._run_eagerly(function, options, args, kwargs)
        except BaseException as exc:
            self.fail(f"eager function {options.name!r} raised {type(exc).__name__}: {exc}")
            # open a segment again before the exception unwinds the user's code: guards it
            # entered inside the segment (torch.inference_mode()) restore dispatch state that
            # includes the segment's dispatch mode, which must then still be there
            with contextlib.suppress(Exception):
                self._begin_segment()
            raise
        self.breaks.append(Break(options.name, function, args, kwargs, output, replay))
        self.modes.append(break_modes(function))  # what it replays under (.modes)
        try:
            if self.watch is not None:
                self.watch.observe_break(options.name, args, kwargs, output)
            self._begin_segment()
        except BaseException as exc:  # no segment: what follows would run uncaptured
            self.fail(f"beginning the segment after {options.name!r} raised {exc!r}")
            raise
        return output

    @staticmethod
    def _run_eagerly(
        function: Callable, options: BreakOptions, args: tuple, kwargs: dict
    ) -> tuple[Any, Callable[[], None]]:
        refuse_one_shot_iterators(options.name, args, kwargs)  # drained by the capture pass
        arguments = storages_of(args, kwargs)
        # a stub that returns its argument stands for an in-place function: like any output in
        # memory that something else holds (an argument, a long-lived tensor), the real
        # function must then return that memory on every replay. Who holds the output is
        # counted right after the call, before any other code can take a view of it.
        output, held = call_and_classify(options.capture_stub or function, args, kwargs)
        copy_back = build_copy_back(output, options.name, options.check_values, arguments, held)
        if torch.is_inference_mode_enabled():  # its tensors are only writable in that mode

            def replay() -> None:
                with torch.inference_mode():
                    copy_back(function(*args, **kwargs))

        else:  # with grad or under no_grad: finish() makes the no_grad ones replay under it

            def replay() -> None:
                copy_back(function(*args, **kwargs))

        return output, replay

    def finish(self) -> None:
        if self.failure is not None:
            raise CaptureError(
                f"breakgraph.capture: {self.failure}, and the exception was caught inside the "
                f"capture block. The graph would not match the code (what raised is missing "
                f"from it), so the capture was abandoned. Let the exception leave the "
                f"`with breakgraph.capture(...)` block, or catch it inside the eager function."
            )
        self._end_segment()
        # breaks replay under their capture's grad mode and autocast: the whole replay turns
        # grad off / the caller's autocast off (one check each), or each break alone (.modes)
        self.breaks, without_grad, autocast = pin_modes(self.breaks, self.modes)
        timers = None
        if self.watch is None:
            steps = [self.segments[0].replay]
            for brk, segment in zip(self.breaks, self.segments[1:]):
                if brk.replay is not None:
                    steps.append(brk.replay)
                steps.append(segment.replay)
        else:
            timers = tuple(_debug.BreakTimer() for _ in self.breaks)
            steps = self._debug_steps(timers)
        captured = Captured(
            self.backend,
            self.session.pool,
            self.context,
            tuple(self.segments),
            tuple(self.breaks),
            tuple(steps),
            timers,
            self.unjoined,
            without_grad,
            autocast,
        )
        self._close()  # first: where closing raises (a restore that warns, under -W error),
        # the graph holds nothing and abort() drops the segments
        self.graph._captured = captured
        self.graph._capturing = False

    def _debug_steps(self, timers: tuple) -> list:
        """Replay steps with input checks, break timers and NVTX ranges (debug mode only)."""
        cuda = self.backend.name == "cuda"
        steps = []
        for i, segment in enumerate(self.segments):
            check = self.watch.checker(i)
            if check is not None:
                steps.append(check)
            steps.append(_debug.nvtx(segment.replay, f"segment {i}") if cuda else segment.replay)
            if i < len(self.breaks) and self.breaks[i].replay is not None:
                brk = self.breaks[i]
                step = timers[i].wrap(brk.replay)
                steps.append(_debug.nvtx(step, f"break {i}: {brk.name}") if cuda else step)
        return steps

    def abort(self) -> None:
        """Leave nothing behind: no half-built graph, no hook, the previous stream current.

        Every step runs even where one before it raised (a segment's reset, the session's
        abort): a failure must not leave the graph marked as capturing, the other segments
        holding their pool or the hooks installed. The first error is raised at the end."""
        self.in_segment = False
        segments, self.segments, self.breaks = self.segments, [], []
        self.graph._capturing = False
        # _restore again: _close may have been interrupted after marking itself closed
        steps = [segment.reset for segment in segments] + [self._close, self._restore]
        if not self._closed:  # closed: finish() raised while closing, after the session
            steps.insert(0, self.session.abort)
        first = None
        for step in steps:
            try:
                step()
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.session.close()
            finally:
                self._restore()

    def _restore(self) -> None:
        state.capture, state.context = None, self._previous_context
        torch.set_autocast_cache_enabled(self._autocast_cached)
        if self._gc_was_enabled:
            gc.enable()
