"""The emulated backend: CUDA-graph semantics on any device, for tests and debugging.

During capture every segment runs for real under a ``TorchDispatchMode`` that
records each aten operation with the very tensor objects it read and wrote. On
replay the segment re-executes the recorded operations, in order, against those
same objects:

* an operation that returns fresh tensors runs again and its results are copied
  into the tensors recorded at capture ("frozen addresses"), so later operations,
  which hold the recorded tensors, see the new values;
* in-place and ``out=`` operations run again and mutate their targets;
* views run nothing: they share storage with their base, which was updated;
* ``empty``-like allocations run nothing (a CUDA graph launches no kernel for them);
* random operations draw fresh numbers, as a replayed CUDA graph does;
* collectives (``torch.distributed``'s ``c10d`` and functional ops) run again and are
  waited for before anything reads their result: a CUDA graph orders them on the
  stream, but on the host they complete asynchronously (gloo's worker threads).

No Python from the user's model runs on replay (only the eager breaks), so frozen
Python decisions, stale input buffers and frozen host ints give the same wrong
answers as on a GPU. During a segment ``torch.cuda.is_current_stream_capturing()``
answers True on the capturing thread, so libraries take their capture-safe paths.

Limits: it cannot see streams, kernels launched outside the aten dispatcher (for
example Triton kernels called directly), or the difference between host and device
tensors (every CPU tensor counts as a device tensor, so ``.item()`` on any tensor
inside a segment raises). Replay is slow: it is a testing and debugging tool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ..syncs import SegmentMode

aten = torch.ops.aten

# Allocations without a kernel: a CUDA graph replays nothing for them.
_NO_KERNEL = {
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten.lift_fresh,
    aten.detach,
    aten.alias,
}

# torch.distributed's operator namespaces: their replays must wait for completion
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


class EmulatedPool:
    """Stands in for a CUDA memory-pool handle: sharing it between graphs is accepted."""

    def __repr__(self) -> str:
        return f"EmulatedPool(id={id(self):#x})"


def _replay_step(func, args: tuple, kwargs: dict, out: Any) -> Callable[[], None] | None:
    """Compile one recorded operation into a replay closure (None when nothing must run)."""
    if func.overloadpacket in _NO_KERNEL:
        return None
    schema = func._schema
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    outputs = out if len(schema.returns) > 1 else (out,)
    fresh: list[tuple] = []  # (return index, list index or None, recorded tensor)
    for index, (ret, value) in enumerate(zip(schema.returns, outputs)):
        if ret.alias_info is not None:
            continue  # a view or the mutated argument itself
        if isinstance(value, torch.Tensor):
            fresh.append((index, None, value))
        elif isinstance(value, (list, tuple)):
            fresh.extend((index, j, t) for j, t in enumerate(value) if isinstance(t, torch.Tensor))
    if not fresh and not mutates:
        return None
    single = len(schema.returns) <= 1
    collective = func.namespace in _COLLECTIVE_NAMESPACES

    def step() -> None:
        new = func(*args, **kwargs)
        if collective:
            _wait_collective(new)
        news = (new,) if single else new
        for index, j, recorded in fresh:
            value = news[index] if j is None else news[index][j]
            recorded.copy_(value)

    return step


def _wait_collective(result: Any) -> None:
    """Wait for a replayed collective: a ``Work`` handle (``c10d`` ops) or an async tensor
    (functional collectives). Waiting twice is harmless, so ``wait_tensor`` replays as is."""
    for value in result if isinstance(result, (tuple, list)) else (result,):
        if isinstance(value, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(value)
        elif hasattr(value, "wait"):
            value.wait()


class EmulatedSegment:
    """A recorded segment; ``replay`` re-executes its operations in order."""

    __slots__ = ("steps", "operations", "inference", "unjoined")

    def __init__(self, steps: tuple, operations: int, inference: bool):
        self.steps = steps
        self.operations = operations
        self.inference = inference  # captured under inference_mode: its tensors need it
        self.unjoined: list = []  # no streams here

    def replay(self) -> None:
        with torch.inference_mode() if self.inference else torch.no_grad():
            for step in self.steps:
                step()

    def reset(self) -> None:
        self.steps = ()


class _CapturingFlag(threading.local):
    active = False


_capturing = _CapturingFlag()
_patch_lock = threading.Lock()
_patch_depth = 0
_original_is_capturing = torch.cuda.is_current_stream_capturing


def _emulated_is_capturing() -> bool:
    if _capturing.active:
        return True
    try:
        return _original_is_capturing()
    except Exception:  # CPU builds of torch raise here: nothing is being captured
        return False


def _patch_is_capturing(install: bool) -> None:
    """Make ``torch.cuda.is_current_stream_capturing`` see emulated captures (refcounted)."""
    global _patch_depth
    with _patch_lock:
        _patch_depth += 1 if install else -1
        function = _emulated_is_capturing if _patch_depth > 0 else _original_is_capturing
        torch.cuda.is_current_stream_capturing = function
        torch.cuda.graphs.is_current_stream_capturing = function


class EmulatedSession:
    def __init__(self, pool, stream, capture_error_mode: str, detect_syncs: bool, observer=None):
        self.observer = observer
        self.pool = pool if pool is not None else EmulatedPool()
        self.detect_syncs = detect_syncs
        self._mode: SegmentMode | None = None
        self._steps: list = []
        _patch_is_capturing(True)

    def _record(self, func, args, kwargs, out) -> None:
        step = _replay_step(func, args, kwargs, out)
        if step is not None:
            self._steps.append(step)
        if self.observer is not None:
            self.observer(func, args, kwargs, out)

    def begin_segment(self) -> None:
        self._steps = []
        self._inference = torch.is_inference_mode_enabled()
        self._mode = SegmentMode(
            all_devices=True, on_operation=self._record, check_syncs=self.detect_syncs
        )
        self._mode.__enter__()
        _capturing.active = True

    def end_segment(self) -> EmulatedSegment:
        mode, self._mode = self._mode, None
        _capturing.active = False
        mode.__exit__(None, None, None)
        return EmulatedSegment(tuple(self._steps), mode.operations, self._inference)

    def abort(self) -> None:
        mode, self._mode = self._mode, None
        _capturing.active = False
        if mode is not None:
            mode.__exit__(None, None, None)
        self._steps = []

    def close(self) -> None:
        _patch_is_capturing(False)


class EmulatedBackend:
    name = "emulated"

    def new_pool(self) -> EmulatedPool:
        return EmulatedPool()

    def open(
        self, pool, stream, capture_error_mode: str, detect_syncs: bool, observer=None
    ) -> EmulatedSession:
        return EmulatedSession(pool, stream, capture_error_mode, detect_syncs, observer)


EMULATED_BACKEND = EmulatedBackend()
