"""Per-thread capture state: the capture in progress and the replay context.

Two things are per thread, because CUDA captures and replays are issued from one thread
at a time and a server may run one graph per thread:

* the capture in progress (set by :func:`breakgraph.capture`, read by ``@eager_on_graph``
  wrappers to decide whether to cut a segment);
* the *replay context*: the per-step host state that eager functions read with
  :func:`replay_context`, set by ``replay(context=...)``, ``capture(context=...)`` and
  :func:`context_scope`.

Only one capture runs per process at a time (CUDA allows one global-mode capture, and
breakgraph patches process-wide hooks while capturing): :func:`capture_turn`, which
``graph.capture`` holds, makes a capture started on another thread wait, and refuses to wait
for a capture whose thread has ended (see there).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from .errors import CaptureError, ReplayError

__all__ = ["is_capturing", "replay_context", "context_scope", "current_capture", "capture_turn"]


class _ThreadState(threading.local):
    capture: Any = None  # the graph._Capture recording on this thread
    context: Any = None  # what replay_context() returns


state = _ThreadState()


def current_capture() -> Any:
    """The capture recording on this thread, or None (internal: used by ``eager.py``)."""
    return state.capture


def is_capturing() -> bool:
    """True while the calling code is being recorded into a breakgraph segment.

    False outside any capture and inside eager functions (they run for real).

    Example::

        >>> import breakgraph
        >>> breakgraph.is_capturing()
        False
    """
    capture = state.capture
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
    context = state.context
    if context is None:
        raise ReplayError(
            "breakgraph.replay_context(): no context is set. Pass one with "
            "g.replay(context=...) and capture(g, context=...), or wrap eager calls in "
            "`with breakgraph.context_scope(...)`."
        )
    return context


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
    previous = state.context
    state.context = context
    try:
        yield
    finally:
        state.context = previous


capture_lock = threading.Lock()  # held by the capture in progress, whatever its thread
_holder: list = [None]  # (thread, graph) of the capture holding capture_lock
_POLL_S = 0.25  # how often a waiting capture looks whether the holder's thread still runs


@contextlib.contextmanager
def capture_turn(graph: Any) -> Iterator[None]:
    """Hold the process's one capture turn for ``graph``; wait while another thread holds it.

    A capture is tied to its thread (the capture in progress is per thread), so one whose
    thread has ended can never be finished there: a ``with breakgraph.capture(g):`` inside a
    generator (or coroutine) that yielded and was never resumed or closed. Every later capture
    in the process waited for it for ever; it raises ``CaptureError`` now, naming the graph
    and the fix. (A suspended capture on a thread that still runs cannot be told from a long
    one: waiting for it is waiting for that thread.)

    The waiting loop is inside the ``try``: an interrupt after the lock is taken releases it.
    """
    taken = False
    try:
        while not taken:
            taken = capture_lock.acquire(timeout=_POLL_S)
            holder = _holder[0]
            if not taken and holder is not None and not holder[0].is_alive():
                raise CaptureError(
                    f"breakgraph.capture: a capture of {holder[1]!r}, started on thread "
                    f"{holder[0].name!r}, which has ended, was never finished, so no other "
                    f"capture can start (and its hooks stay installed, the garbage collector "
                    f"off). A `with breakgraph.capture(...)` inside a generator or coroutine "
                    f"that yielded and was never resumed does this: close it (gen.close() runs "
                    f"the block's exit), or do not yield inside a capture."
                )
        _holder[0] = (threading.current_thread(), graph)
        yield
    finally:
        if taken:
            _holder[0] = None
            capture_lock.release()
