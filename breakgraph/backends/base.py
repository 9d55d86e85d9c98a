"""The backend contract: what ``graph.py`` needs from a way of capturing segments.

A backend opens a *session* per capture; the session captures segments one after the
other (``begin_segment`` ... ``end_segment``) and every captured *segment* replays on its
own. ``replay()`` of a :class:`~breakgraph.BreakableCUDAGraph` is a loop over
``segment.replay`` and the eager breaks, so every segment has the same small interface
as ``torch.cuda.CUDAGraph`` (``replay()``, ``reset()``), whatever the backend.

Example::

    >>> from breakgraph.backends import select_backend
    >>> from breakgraph.backends.base import CaptureOptions
    >>> session = select_backend("emulated").open(CaptureOptions())
    >>> session.begin_segment()
    >>> segment = session.end_segment()
    >>> session.close()
    >>> segment.operations
    0
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import CaptureError

__all__ = [
    "CaptureOptions",
    "Backend",
    "Session",
    "Segment",
    "Observer",
    "pool_handle",
    "released_pool_error",
]

#: what ``torch.cuda.CUDAGraph.capture_begin`` takes
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
#: ``(func, args, kwargs, out)`` after each aten operation of a segment (debug mode).
Observer = Callable[[Any, tuple, dict, Any], None]


@dataclass(frozen=True)
class CaptureOptions:
    """How one capture runs; built once by :func:`breakgraph.capture` from its arguments."""

    pool: Any = None  # a pool handle (CUDA: torch.cuda.graph_pool_handle(); None: a new one)
    stream: Any = None  # the capture stream (CUDA; None: breakgraph's own per device)
    capture_error_mode: str = "global"
    detect_syncs: bool = True  # raise HostSyncError at the line of a host sync in a segment
    # (False on CUDA: no dispatch mode at all; CUDA's own refusal is still reported)
    debug: bool = False  # input checks, break timers, NVTX (see breakgraph.debug)
    # CUDA, before capturing: True gc.collect() and empty the cache; None (default) as
    # torch.cuda.graph: collect only with torch.compiler.config.force_cudagraph_gc, empty
    # the cache; False neither
    collect_garbage: bool | None = None

    def __post_init__(self) -> None:
        """Refuse a wrong argument of ``capture`` by name before anything starts: a flag given
        as a string or an int (``detect_syncs="no"`` is true, ``collect_garbage=0`` false) was
        taken for its truth value, and a stream that is none made CUDA fail inside."""
        if self.capture_error_mode not in CAPTURE_ERROR_MODES:
            raise CaptureError(
                f"breakgraph.capture: capture_error_mode must be one of {CAPTURE_ERROR_MODES}, "
                f"got {self.capture_error_mode!r}."
            )
        flags = (("detect_syncs", self.detect_syncs, (True, False)),
                 ("collect_garbage", self.collect_garbage, (None, True, False)))  # fmt: skip
        for name, value, allowed in flags:
            if not any(value is choice for choice in allowed):
                choices = ", ".join(map(str, allowed[:-1]))
                raise CaptureError(
                    f"breakgraph.capture: {name} must be {choices} or False, got {value!r}."
                )
        streams = (torch.Stream, torch.cuda.Stream)  # not one class on every build
        if self.stream is not None and not isinstance(self.stream, streams):
            raise CaptureError(
                f"breakgraph.capture: stream must be None (breakgraph's own capture stream) or a "
                f"torch.cuda.Stream, got {self.stream!r}."
            )


class Segment(Protocol):
    """One captured segment: replayed as a whole, like ``torch.cuda.CUDAGraph``."""

    operations: int | None  # aten operations seen (the report; None: not watched, CUDA)
    unjoined: list  # side streams breakgraph had to join at its end (CUDA, debug)

    def replay(self) -> None: ...

    def reset(self) -> None: ...


class Session(Protocol):
    """One capture in progress. ``open`` installs what it needs; ``close`` removes all of it."""

    pool: Any

    def begin_segment(self) -> None: ...

    def end_segment(self, before: str | None = None) -> Segment:
        """Finish the segment and replay it once, so eager code after it sees real values.
        ``before``: the break it ends at (None: the end of the capture block), for errors."""
        ...

    def abort(self) -> None:
        """Abandon the segment being captured, if any (the capture failed)."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str

    def open(self, options: CaptureOptions, observer: Observer | None = None) -> Session: ...

    def pool_bytes(self, pool: Any) -> int | None:
        """Memory held in ``pool`` (None where the backend has no pool memory to report)."""
        ...

    def pool_usable(self, pool: Any) -> bool:
        """Whether a new capture can record into ``pool`` (not after a capture into it was
        invalidated, see :mod:`breakgraph.backends.cuda`, nor once torch gave it up with its
        last graph, :func:`released_pool_error`)."""
        ...


def pool_handle(pool: Any) -> tuple[int, int]:
    """The ``(int, int)`` handle CUDA's capture takes for ``pool``: a handle from
    ``torch.cuda.graph_pool_handle()`` or ``other.pool()`` as a plain tuple, a
    ``torch.cuda.MemPool`` its ``id``. torch 2.14's ``torch.cuda.graph`` takes a MemPool too;
    ``CUDAGraph.capture_begin`` of earlier releases takes the id only, and a pool's key in
    breakgraph's own bookkeeping is the id either way. Anything else raises ``CaptureError``
    here rather than a ``TypeError`` inside torch. Both backends take pools through it (the
    emulated one its own :class:`~breakgraph.backends.emulated.EmulatedPool` too), so a bad
    pool fails on the CPU as on the device.

    Example::

        >>> pool_handle((0, 3))
        (0, 3)
    """
    mem_pool = getattr(torch.cuda, "MemPool", None)
    if mem_pool is not None and isinstance(pool, mem_pool):
        pool = pool.id
    if isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(i, int) for i in pool):
        return tuple(pool)
    raise CaptureError(
        f"breakgraph.capture: pool={pool!r} is not a graph memory pool; pass a handle from "
        f"torch.cuda.graph_pool_handle() or other_graph.pool(), a torch.cuda.MemPool, or None "
        f"for a new pool."
    )


def released_pool_error(pool: Any) -> CaptureError:
    """What both backends raise for a capture into a pool whose graphs were all released.

    torch counts the graphs captured into a pool; when the last one is reset or deleted the
    pool is given up, and its handle can never be captured into again (torch 2.11 fails an
    internal assert, ``use_count > 0``, in ``capture_begin``). The emulated backend keeps the
    same count, so the mistake fails on the CPU as it would on the device."""
    shown = tuple(pool) if isinstance(pool, tuple) else pool
    return CaptureError(
        f"breakgraph.capture: pool {shown} has no live graph any more: torch gives a pool up "
        f"when the last graph captured into it is reset or deleted, and cannot capture into "
        f"its handle again. Capture into a new pool (pool=None, or "
        f"torch.cuda.graph_pool_handle()), or keep one graph of the pool alive until the "
        f"next capture into it has begun."
    )
