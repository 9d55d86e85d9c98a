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
* a tensor made from one Python number (``x[i] = 0.5``) gets its value written again (an
  array of them is a host sync: a pageable copy on CUDA; a tensor over the caller's memory,
  ``from_numpy``, is read as that memory is then);
* random operations draw fresh numbers, as a replayed CUDA graph does (not from a generator
  of the user's own, nor after a new seed inside a segment: CUDA refuses both);
* in-place metadata operations (``unsqueeze_``, ``t_``, ``as_strided_``, ...) run
  nothing: a CUDA graph holds no tensor metadata, only addresses. Every tensor an
  operation read or wrote is recorded as an alias with the shape and strides it had at
  that moment, so a later metadata change cannot alter what replay computes;
* replay runs under ``torch.inference_mode()`` with autocast off, whatever the caller's
  modes are: a CUDA graph replays the kernels it recorded and knows neither.
* collectives (``torch.distributed``'s ``c10d`` and functional ops) run again and are
  waited for before anything reads their result: a CUDA graph orders them on the
  stream, but on the host they complete asynchronously (gloo's worker threads).

In debug mode the steps hold what the graph read but did not make (static inputs, parameters,
caches) weakly and make their aliases again on every replay, so memory that nothing outside
the graph holds is freed as on a GPU and reported (:mod:`.weak_inputs`).

No Python from the user's model runs on replay (only the eager breaks), so frozen
Python decisions, stale input buffers and frozen host ints give the same wrong
answers as on a GPU. During a segment ``torch.cuda.is_current_stream_capturing()``
answers True on the capturing thread, so libraries take their capture-safe paths.

Limits: it cannot see streams, kernels launched outside the aten dispatcher (for
example Triton kernels called directly), or the difference between host and device
tensors (every CPU tensor counts as a device tensor, so ``.item()`` on any tensor
inside a segment raises). Sparse tensors in a segment are refused (``CaptureError``): they
have no strided memory to alias. Replay is slow: it is a testing and debugging tool.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CaptureError
from ..patches import patch_attribute
from ..structure import sparse_parts, storage_address
from ..syncs import (
    SegmentMode,
    exit_segment_mode,
    leave_segment_mode,
    mark_capture_failed,
    sync_reason,
    user_frame,
)
from .base import CaptureOptions, Observer, pool_handle, released_pool_error
from .weak_inputs import ExternalInputs

aten = torch.ops.aten

# Allocations without a kernel: a CUDA graph replays nothing for them.
_NO_KERNEL = {
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten.detach,
    aten.alias,
}

# torch.distributed's operator namespaces: their replays must wait for completion
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


class EmulatedPool:
    """Stands in for a CUDA memory-pool handle: sharing it between graphs is accepted.

    It counts its segments as torch counts a pool's graphs (one per ``capture_begin``, given
    back by ``reset``): once the count falls back to zero the pool is given up, and a capture
    into it fails here as it does on the device."""

    __slots__ = ("live", "released")

    def __init__(self):
        self.live = 0
        self.released = False

    def take(self) -> None:
        if self.released:
            raise released_pool_error(self)
        self.live += 1

    def give_back(self) -> None:
        self.live -= 1
        self.released = self.live == 0

    def __repr__(self) -> str:
        return f"EmulatedPool(id={id(self):#x})"


def _frozen(value: Any) -> Any:
    """An alias of a tensor with its current shape and strides (other values unchanged)."""
    if isinstance(value, torch.Tensor):
        return value.as_strided(value.shape, value.stride(), value.storage_offset())
    if isinstance(value, (list, tuple)):
        return type(value)(_frozen(v) for v in value)
    return value


def _storages(args: tuple, kwargs: dict) -> set:
    values = list(args) + list(kwargs.values())
    found = set()
    for v in values:
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(t, torch.Tensor):
                found.add(storage_address(t))
    return found


def _writes_an_argument(func) -> bool:
    """In-place and ``out=`` operations: their schema marks an argument as written."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _restore(tensors: list) -> Callable[[], None] | None:
    """A replay step writing each tensor's values of now (capture time) into it again."""
    kept = [(_frozen(t), t.clone()) for t in tensors if isinstance(t, torch.Tensor)]
    if not kept:
        return None

    def restore() -> None:
        for target, values in kept:
            target.copy_(values)

    return restore


def _frozen_step(
    func, args: tuple, kwargs: dict, out: Any, hold: Callable | None = None
) -> Callable[[], None] | None:
    """A host sync let through (``detect_syncs=False``): its results keep their capture-time
    values, written again on every replay (the segment may update them in place; a Python
    value, ``.item()``, is frozen into the operations that used it); one that writes its
    argument (``x[mask] = v``) runs again like any in-place operation."""
    if _writes_an_argument(func):
        return _replay_step(func, args, kwargs, out, hold)
    return _restore(list(out) if isinstance(out, (list, tuple)) else [out])


def _replay_step(
    func, args: tuple, kwargs: dict, out: Any, hold: Callable | None = None
) -> Callable[[], None] | None:
    """Compile one recorded operation into a replay closure (None when nothing must run).
    ``hold`` (debug mode, :class:`~.weak_inputs.ExternalInputs`) holds the arguments the
    graph did not make weakly and gives what the step calls instead of ``func``."""
    if func.overloadpacket is aten.lift_fresh:  # a tensor made from host data
        if not out.untyped_storage().resizable():  # over the caller's memory (from_numpy,
            return None  # as_tensor of an array): replays read that memory as it is then
        # torch's own copy of a Python number (x[i] = 0.0, torch.tensor(2.0); an array of them
        # is a host sync, syncs.copies_host_data): nothing else writes it, so every replay
        # writes its value again, and a segment that updates it in place starts from it each
        # time, as eager code does
        return _restore([out])
    if func.overloadpacket in _NO_KERNEL or torch.Tag.inplace_view in func.tags:
        return None
    schema = func._schema
    mutates = _writes_an_argument(func)
    outputs = out if len(schema.returns) > 1 else (out,)
    fresh: list[tuple] = []  # (return index, list index or None, recorded tensor)
    read = None
    for index, (ret, value) in enumerate(zip(schema.returns, outputs)):
        if ret.alias_info is not None:
            # a view or the mutated argument itself, unless it made a copy: composite ops
            # such as reshape/contiguous/flatten (seen undecomposed under inference_mode)
            # are annotated as views but copy when they must
            if read is None:
                read = _storages(args, kwargs)
            if not isinstance(value, torch.Tensor) or storage_address(value) in read:
                continue
        if isinstance(value, torch.Tensor):
            fresh.append((index, None, _frozen(value)))
        elif isinstance(value, (list, tuple)):
            fresh.extend(
                (index, j, _frozen(t)) for j, t in enumerate(value) if isinstance(t, torch.Tensor)
            )
    if not fresh and not mutates:
        return None
    single = len(schema.returns) <= 1
    if hold is None:
        args, call = _frozen(args), func
        kwargs = {k: _frozen(v) for k, v in kwargs.items()}
    else:
        args, kwargs, call = hold(func, args, kwargs)
    collective = func.namespace in _COLLECTIVE_NAMESPACES

    def step() -> None:
        try:
            new = call(*args, **kwargs)
            if collective:
                _wait_collective(new)
        except RuntimeError as exc:  # gloo raises a plain one (a timeout, a peer gone): as
            # torch.distributed's error, which RankGroup.failed_mid_call tells from the rank's own
            if collective and not isinstance(exc, torch.distributed.DistError):
                raise torch.distributed.DistBackendError(f"{func}: {exc}") from exc
            raise
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

    __slots__ = ("steps", "operations", "unjoined", "pool")

    def __init__(self, steps: tuple, operations: int, pool: EmulatedPool | None):
        self.steps = steps
        self.operations = operations
        self.unjoined: list = []  # no streams here
        self.pool = pool  # given back on reset (None: a handle that is not an EmulatedPool)

    def replay(self) -> None:
        # no autograd and no autocast: a CUDA graph replays the kernels it recorded
        with torch.inference_mode(), torch._C._DisableAutocast():
            for step in self.steps:
                step()

    def reset(self) -> None:
        self.steps = ()
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.give_back()

    def __del__(self) -> None:  # a CUDAGraph's destructor resets it: its pool count goes too
        self.reset()


def _refuse_sparse(func, args: tuple, kwargs: dict, out: Any) -> None:
    """Raise ``CaptureError`` naming the first sparse tensor ``func`` read or made, if any.

    A segment is recorded with strided aliases of the tensors it reads, which a sparse tensor
    cannot have (``as_strided`` is refused): its indices and values are no memory of its own
    that a replay could read at a frozen address. Checked only once torch refused the
    recording, so dense operations pay nothing."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)]
    named += [(f"argument {k!r}", v) for k, v in kwargs.items()] + [("its output", out)]
    for where, value in named:
        many = isinstance(value, (list, tuple))
        for j, t in enumerate(value if many else (value,)):
            if isinstance(t, torch.Tensor) and sparse_parts(t):
                path = f"{where}[{j}]" if many else where
                raise mark_capture_failed(CaptureError(
                    f"breakgraph.capture: {func} at {user_frame()} reads or makes a sparse "
                    f"tensor ({path}, {t.layout}) inside a captured segment. The emulated "
                    f"backend replays a segment on the memory its operations used at capture, "
                    f"at frozen addresses, and a sparse tensor has none of its own (its indices "
                    f"and values may be replaced, and their number change). Densify it with "
                    f".to_dense() before the capture, or do the sparse operation inside a "
                    f"function decorated with @breakgraph.eager_on_graph (a sparse argument is "
                    f"passed to it as it is on every replay) and return a dense result."
                ))  # fmt: skip


def _reseeded_error(seen: str) -> CaptureError:
    """torch refuses a new seed for a CUDA generator while a capture is running (the same seed
    is a no-op)."""
    return CaptureError(
        f"breakgraph.capture: the default random generator was given a new seed inside a "
        f"captured segment ({seen}). torch refuses that during a CUDA capture "
        f'("CUDAGeneratorImpl::set_current_seed can be called during stream capture only if new '
        f'seed is the same as the original seed"), and a graph could not seed again on replay '
        f"anyway. Seed before the capture, or inside a function decorated with "
        f"@breakgraph.eager_on_graph, which runs on every replay."
    )


class _OtherThreadSeeds:
    """Counts the seeds of threads with no segment open, given through ``torch.manual_seed``,
    ``torch.seed`` or ``torch.set_rng_state`` (what ``torch.random.fork_rng`` puts back on
    exit) while a session watches them. CUDA checks only the capturing thread (its stream's
    capture status), so another thread's seed (a second continuous-batching manager starting)
    is no capture's business: a segment that ends on a new seed it did not see being given
    blames itself only if no other thread's seed overlapped it.

    Two counts, because the seed changes between them: ``started`` before the call, ``finished``
    after it. A segment takes ``finished`` as it begins, before it reads the seed, and
    ``started`` as it ends, after it reads the seed: a seed that changed between those two
    reads was started before the second and finished after the first, so the two counts
    differ. One count, taken before the call, was equal for a seed under way when the segment
    began (counted, then the seed changed inside the segment): a false ``CaptureError``."""

    def __init__(self) -> None:
        self.started = 0
        self.finished = 0
        self._lock = threading.Lock()

    def seeding(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            self.started += 1
        try:
            return original(*args, **kwargs)
        finally:
            with self._lock:
                self.finished += 1


_other_thread_seeds = _OtherThreadSeeds()


def _watched_seeding(original: Callable, is_new: Callable[..., bool] | None) -> Callable:
    """``original`` (``torch.manual_seed``, ``torch.seed``, ``torch.set_rng_state``) counted on
    every thread with no segment open. On a thread inside a segment, a new seed (``is_new``) is
    refused at the call, before the generator changes (as CUDA's check does); a state set there
    is seen when the segment ends. Nothing is read through the dispatcher: the segment records
    nothing."""

    def seeding(*args: Any, **kwargs: Any) -> Any:
        if not _capturing.active:
            return _other_thread_seeds.seeding(original, args, kwargs)
        if is_new is not None and is_new(*args, **kwargs):
            raise _reseeded_error(f"torch.{original.__name__}")
        return original(*args, **kwargs)

    seeding.__wrapped__ = original
    return seeding


def _always(*args: Any, **kwargs: Any) -> bool:
    """``torch.seed()`` always draws a new seed."""
    return True


def _new_seed(seed: Any) -> bool:
    """Whether ``torch.manual_seed(seed)`` changes the default generator's seed (a negative
    seed is stored as its 64-bit two's complement; one out of range is torch's to refuse)."""
    return int(seed) % 2**64 != torch.default_generator.initial_seed()


# the watched functions: name -> whether a call changes the seed (refused inside a segment)
_SEEDING = {"manual_seed": _new_seed, "seed": _always, "set_rng_state": None}


class _CapturingFlag(threading.local):
    active = False


_capturing = _CapturingFlag()


def _patched_is_capturing(original: Callable[[], bool]) -> Callable[[], bool]:
    """``torch.cuda.is_current_stream_capturing`` that also sees this thread's emulated segment,
    so libraries take their capture-safe paths (as they would under a CUDA capture)."""

    def is_current_stream_capturing() -> bool:
        if _capturing.active:
            return True
        try:
            return original()
        except Exception:  # CPU builds of torch raise here: nothing is being captured
            return False

    return is_current_stream_capturing


class EmulatedSession:
    def __init__(self, options: CaptureOptions, observer: Observer | None = None):
        self.observer = observer
        pool = options.pool
        if pool is None:
            pool = EmulatedPool()
        elif not isinstance(pool, EmulatedPool):  # a CUDA handle or MemPool, as CUDA takes it
            pool = pool_handle(pool)
        self.pool = pool
        self._counted = self.pool if isinstance(self.pool, EmulatedPool) else None
        self._begun = False  # a segment took a count of the pool that no segment holds yet
        self._seed = 0  # the default generator's seed when the segment began
        self._other_seeds = 0  # other threads' seeds finished when it began
        self.detect_syncs = options.detect_syncs
        # debug mode: what the graph reads but did not make is held weakly (.weak_inputs)
        self._external = ExternalInputs(_frozen) if options.debug else None
        self._hold = self._external.hold if self._external is not None else None
        self._mode: SegmentMode | None = None
        self._steps: list = []
        self._stack = contextlib.ExitStack()
        # an interrupt halfway (Ctrl-C) left the patches made so far for good: nobody gets this
        # session to close (as CudaSession's hooks)
        try:
            replacement = _patched_is_capturing(torch.cuda.is_current_stream_capturing)
            patch_attribute(self._stack, torch.cuda, "is_current_stream_capturing", replacement)
            patch_attribute(self._stack, torch.cuda.graphs, "is_current_stream_capturing",
                            replacement)  # fmt: skip
            for owner in (torch, torch.random):  # torch._dynamo wraps torch's own
                for name, is_new in _SEEDING.items():
                    watched = _watched_seeding(getattr(owner, name), is_new)
                    patch_attribute(self._stack, owner, name, watched)
        except BaseException:
            self._stack.close()
            raise

    def _record(self, func, args, kwargs, out) -> None:
        try:
            if not self.detect_syncs and sync_reason(func, args, kwargs, all_devices=True):
                step = _frozen_step(func, args, kwargs, out, self._hold)
            else:
                step = _replay_step(func, args, kwargs, out, self._hold)
        except RuntimeError:  # torch's for a sparse tensor (COO: NotImplementedError, no
            # storage; CSR/CSC: RuntimeError, no strides): refused by name, else re-raised
            _refuse_sparse(func, args, kwargs, out)
            raise
        if step is not None:
            self._steps.append(step)
        if self._external is not None:
            self._external.record(func, args, kwargs, out)
        if self.observer is not None:
            self.observer(func, args, kwargs, out)

    def begin_segment(self) -> None:
        if self._counted is not None:
            self._counted.take()
            self._begun = True
        self._other_seeds = _other_thread_seeds.finished  # first: see _OtherThreadSeeds
        self._seed = torch.default_generator.initial_seed()
        self._steps = []
        self._mode = SegmentMode(
            all_devices=True, on_operation=self._record, check_syncs=self.detect_syncs
        )
        self._mode.__enter__()
        _capturing.active = True

    def end_segment(self, before: str | None = None) -> EmulatedSegment:
        mode = self._mode
        exit_segment_mode(mode, before)  # may refuse: the mode is then abort()'s to exit
        self._mode = None
        _capturing.active = False
        # the CPU generator stands for the device's default one; a seed given past the
        # watched functions (torch.default_generator.manual_seed) is seen only here
        reseeded = torch.default_generator.initial_seed() != self._seed
        if reseeded and _other_thread_seeds.started == self._other_seeds:  # the seed first
            raise _reseeded_error("seen when the segment ended")
        held, self._begun = self._counted if self._begun else None, False
        return EmulatedSegment(tuple(self._steps), mode.operations, held)

    def abort(self) -> None:
        mode, self._mode = self._mode, None
        _capturing.active = False
        if mode is not None:
            leave_segment_mode(mode)
        self._steps = []
        if self._begun:  # as CUDA's abort resets the graph it began
            self._begun = False
            self._counted.give_back()

    def close(self) -> None:
        self._stack.close()


class EmulatedBackend:
    name = "emulated"

    def open(self, options: CaptureOptions, observer: Observer | None = None) -> EmulatedSession:
        return EmulatedSession(options, observer)

    def pool_usable(self, pool: Any) -> bool:
        # as the CUDA backend, which knows a pool torch gave up once a capture was refused
        return not (isinstance(pool, EmulatedPool) and pool.released)

    def pool_bytes(self, pool: Any) -> int | None:
        return None  # emulated segments allocate nothing of their own


EMULATED_BACKEND = EmulatedBackend()
