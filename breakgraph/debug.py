"""Debug mode and the coverage report: make graph bugs loud, show what was captured.

Turn it on per capture with ``capture(g, debug=True)`` or for the process with
``BREAKGRAPH_DEBUG=1``. Debug mode:

1. stops at the Python line of a host synchronisation inside a segment (always on;
   see :mod:`breakgraph.syncs`), naming the function to mark ``@eager_on_graph``;
2. records every tensor the graph reads but did not produce (static inputs,
   parameters, break arguments) and, before each segment of every replay, checks that
   the *memory* it reads is still alive at its captured address: a tensor whose storage
   was replaced (``.set_()``, ``resize_``, ``model.half()`` after capture), or memory
   freed raises :class:`~breakgraph.StaleTensorError` naming its shape, dtype and
   the line that first read it. A temporary view of a live buffer (continuous batching
   hands the model a fresh one every step) may die: its memory is what counts
   (:class:`InputWatch` lists what is and is not seen);
3. names side streams your code left unjoined at a segment end (a
   :class:`~breakgraph.BreakgraphWarning`; breakgraph joins them either way);
4. times every break on the host and marks segments and breaks with NVTX ranges
   (CUDA), so :meth:`BreakableCUDAGraph.report` and a profiler timeline show the
   structure.

To tell capture bugs from runner bugs, run the whole region as one eager break:
``BucketedRunner(..., eager_region=True)`` (or capture ``eager_on_graph(fn)``).

With debug mode off none of this exists: ``replay()`` runs the same prebuilt steps.

Example::

    >>> import torch, breakgraph
    >>> x = torch.randn(3)
    >>> g = breakgraph.BreakableCUDAGraph()
    >>> with breakgraph.capture(g, backend="emulated", debug=True):
    ...     y = x * 2
    >>> x.set_(torch.randn(3))   # the bug: the static input's storage was replaced
    tensor(...)
    >>> g.replay()
    Traceback (most recent call last):
    breakgraph.errors.StaleTensorError: ...
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .errors import BreakgraphWarning, InputError, StaleTensorError
from .structure import describe, iter_tensors, reachable_tensors, sparse_parts, storage_address
from .syncs import user_frame

__all__ = ["debug_enabled", "InputWatch", "GraphReport"]

logger = logging.getLogger("breakgraph")


_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def debug_enabled(flag: bool | None, who: str = "breakgraph") -> bool:
    """``flag`` if given (a bool), else the environment variable ``BREAKGRAPH_DEBUG``: on for
    ``1``/``true``/``yes``/``on``, off when unset or ``0``/``false``/``no``/``off`` (any case).
    Anything else is refused rather than guessed: ``debug="no"`` or ``BREAKGRAPH_DEBUG=of``
    would otherwise turn the checks on (or off) against what was meant. ``who`` (the caller)
    starts the refusal's message.

    >>> debug_enabled(False), debug_enabled(True)
    (False, True)
    """
    if flag is not None:
        if not isinstance(flag, bool):
            raise InputError(
                f"{who}: debug must be True, False or None (None reads the environment "
                f"variable BREAKGRAPH_DEBUG), got {flag!r}."
            )
        return flag
    value = os.environ.get("BREAKGRAPH_DEBUG", "").strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    raise InputError(
        f"{who}: BREAKGRAPH_DEBUG={os.environ['BREAKGRAPH_DEBUG']!r}: set it to 1, true, yes or "
        f"on for debug mode, or 0, false, no, off (or unset it) for none"
    )


@dataclass
class _Watched:
    """One tensor a graph reads without producing it, and the memory behind it.

    The graph reads *memory*, not a Python object, so the checks judge memory. Three weak
    references, none of which keeps anything alive, say who still vouches for that memory:

    * ``tensor``: the object the graph was handed. While it lives, it is the user's handle:
      its storage must still be the captured one (``x.set_(other)`` replaces it even when the
      old storage survives), big enough, with the captured shape and strides;
    * ``base``: the tensor it is a view of, if autograd tracks one (inference tensors' views
      have none). Once a temporary view died, its base is the user's buffer: its storage must
      still be the captured one (``buf.set_(other)`` after the view died);
    * ``storage``: the memory itself. Once no watched object lives, the storage must still be
      alive (someone outside the graph holds it; the emulated backend's debug replays hold it
      weakly, see :mod:`breakgraph.backends.weak_inputs`) at the captured address, with the
      captured size.
    """

    tensor: Any  # weakref to the tensor the graph was handed
    base: Any  # weakref to the tensor it is a view of, or None
    storage: Any  # weakref to its torch.UntypedStorage
    ptr: int
    storage_ptr: int
    nbytes: int
    shape: tuple
    stride: tuple
    description: str
    reader: str  # "segment 3" or "eager function 'name'"

    def problem(self) -> str | None:
        t = self.tensor()
        if t is not None:
            if t.data_ptr() != self.ptr or storage_address(t) != self.storage_ptr:
                return "was moved to new memory (its storage was replaced)"
            if t.untyped_storage().nbytes() < self.nbytes:
                return "was resized smaller"
            if tuple(t.shape) != self.shape or t.stride() != self.stride:
                return f"changed its shape to {tuple(t.shape)} (or its strides)"
            return None
        base = self.base() if self.base is not None else None
        if base is not None:  # a temporary view died: its base is the user's buffer
            problem = self._memory_problem(base.untyped_storage())
            return None if problem is None else f"was a view of a tensor that {problem}"
        storage = self.storage()  # nothing left but the memory itself
        return "was freed" if storage is None else self._memory_problem(storage)

    def _memory_problem(self, storage: torch.UntypedStorage) -> str | None:
        if storage.data_ptr() != self.storage_ptr:
            return "was moved to new memory (its storage was replaced or reallocated)"
        if storage.nbytes() < self.nbytes:
            return "was resized smaller"
        return None


class InputWatch:
    """Records the tensors each segment reads without producing them, and checks them on replay.

    Seen on both backends: the tensor the graph was handed still lives and its storage was
    replaced, reallocated or shrunk, or its shape or strides changed; it died (a temporary
    view) and the tensor it viewed, still alive, had its storage replaced; nothing watched
    lives and the storage itself was reallocated or shrunk, or freed (the emulated backend's
    debug replays hold what they did not make weakly, :mod:`breakgraph.backends.weak_inputs`;
    0-dim tensors and subclasses stay held there, so their freeing is seen on CUDA only).
    Not seen: a name rebound to a new tensor while the old one lives; a live view whose
    base's storage was replaced (refills through the view still reach the graph). A buffer
    whose storage was replaced behind a dead view that has no recorded base (views of
    inference tensors) leaves only the old storage to judge: it is reported as freed unless
    something else (a break's arguments) still holds it.
    """

    def __init__(self) -> None:
        self.segment = 0
        self._produced: set = set()
        self._seen: set = set()
        self.by_segment: dict[int, list[_Watched]] = {}

    def observe(self, func, args, kwargs, out) -> None:
        """The per-operation observer handed to the backend while a segment is captured."""
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._watch(t, f"{func} at {user_frame()}")
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = storage_address(t)
                self._produced.add(storage)
                if storage == 0:  # a sparse tensor made here: its parts are the graph's
                    self._produced.update(storage_address(p) for p in sparse_parts(t))

    def observe_break(self, name: str, args: tuple, kwargs: dict, output: Any) -> None:
        """Watch what crosses a break; checked before the segment that precedes the break."""
        segment, reader = self.segment - 1, f"eager function {name!r}"
        for t in reachable_tensors((args, kwargs)):
            self._watch(t, f"the arguments of {reader}", True, segment, reader)
        for _, t in iter_tensors(output):
            self._produced.add(storage_address(t))
            self._watch(t, f"the output of {reader}", True, segment, reader)

    def _watch(
        self,
        t: torch.Tensor,
        where: str,
        force: bool = False,
        segment: int | None = None,
        reader: str | None = None,
    ) -> None:
        storage = storage_address(t)
        if storage == 0:  # no storage of its own (no data_ptr either): a sparse tensor's memory
            for part in sparse_parts(t):  # is its indices and values, watched as tensors that
                # view nothing; an eager function gets the sparse tensor itself on every
                # replay, so parts replaced by copy_ (its usual update) are stale for it only
                # where a segment writes them
                if not force or storage_address(part) in self._produced:
                    self._watch(part.detach(), where, force, segment, reader)
            return  # a wrapper subclass without one is not watched (its inner tensor is)
        key = (id(t), t.data_ptr())
        if key in self._seen or (storage in self._produced and not force):
            return
        self._seen.add(key)
        description = f"{describe(t)} first read by {where}"
        segment = self.segment if segment is None else segment
        base = t._base
        self.by_segment.setdefault(segment, []).append(
            _Watched(
                weakref.ref(t),
                weakref.ref(base) if base is not None else None,
                weakref.ref(t.untyped_storage()),
                t.data_ptr(),
                storage,
                t.untyped_storage().nbytes(),
                tuple(t.shape),
                t.stride(),
                description,
                reader or f"segment {segment}",
            )
        )

    def checker(self, segment: int) -> Callable[[], None] | None:
        watched = tuple(self.by_segment.get(segment, ()))
        if not watched:
            return None

        def check_inputs() -> None:
            for w in watched:
                problem = w.problem()
                if problem is not None:
                    raise StaleTensorError(
                        f"{w.reader} reads a tensor that {problem} since capture: "
                        f"{w.description}. The graph reads it at its captured address; keep it "
                        f"alive and refill it in place (static.copy_(new)) instead of replacing it."
                    )

        return check_inputs


@dataclass
class GraphReport:
    """What a captured graph holds: see :meth:`BreakableCUDAGraph.report`."""

    backend: str
    segment_ops: list[int | None]  # None: not counted (CUDA, captured with detect_syncs=False)
    break_names: list[str]
    break_host_us: list[float | None]  # mean host time per replay (debug mode only)
    graph_memory_bytes: int | None
    unjoined_streams: dict[int, list[str]] = field(default_factory=dict)

    def __str__(self) -> str:
        rows = [
            f"breakgraph report ({self.backend}): {len(self.segment_ops)} segments, "
            f"{len(self.break_names)} breaks"
        ]
        for i, ops in enumerate(self.segment_ops):
            note = (
                f"  (unjoined side streams: {', '.join(self.unjoined_streams[i])})"
                if i in self.unjoined_streams
                else ""
            )
            counted = f"{ops:>6}" if ops is not None else "     ?"
            rows.append(f"  segment {i:<3} {counted} aten ops{note}")
            if i < len(self.break_names):
                t = self.break_host_us[i]
                timing = (  # an empty break (break_graph()) runs nothing: no timer even then
                    f"{t:8.1f} us/replay"
                    if t is not None
                    else "       - (not timed: debug mode is off, or the break is empty)"
                )
                rows.append(f"    break {i:<3} {self.break_names[i]:<40}{timing}")
        memory = (
            "n/a"
            if self.graph_memory_bytes is None
            else f"{self.graph_memory_bytes / 2**20:.1f} MiB"
        )
        rows.append(f"  graph memory (pool): {memory}")
        return "\n".join(rows)


class BreakTimer:
    """Accumulates host time of one break across replays (debug mode)."""

    __slots__ = ("seconds", "calls")

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def wrap(self, step: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            start = time.perf_counter()
            step()
            self.seconds += time.perf_counter() - start
            self.calls += 1

        return timed

    def mean_us(self) -> float | None:
        return self.seconds / self.calls * 1e6 if self.calls else None


def nvtx(step: Callable[[], None], label: str) -> Callable[[], None]:
    """Wrap a replay step in an NVTX range (CUDA profilers show segments and breaks)."""
    push, pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop

    def ranged() -> None:
        push(label)
        try:
            step()
        finally:
            pop()

    return ranged


def warn_unjoined(segment: int, streams: list) -> None:
    message = (
        f"breakgraph: segment {segment} ended with side streams your code had not joined "
        f"({', '.join(map(repr, streams))}); breakgraph joined them and forks them again "
        f"in the next segment. Join them yourself (current.wait_stream(side)) to make the "
        f"dependency explicit."
    )
    logger.warning(message)
    warnings.warn(message, BreakgraphWarning, stacklevel=4)
