"""The CUDA backend: every segment is one ``torch.cuda.CUDAGraph``.

All segments of a graph are captured into one private memory pool (and several
graphs can share it with ``pool=other.pool()``), on one capture stream, exactly as
``torch.cuda.graph`` does for a single graph. Each segment is replayed once right
after it is captured, so the eager function that follows sees real inputs and the
capture pass computes real outputs (as the emulated backend does).

cuBLAS workspaces. cuBLAS keeps one scratch workspace per (handle, stream), allocated
by torch's caching allocator on the first matmul of that pair, and a captured matmul
bakes its address into the graph. ``torch.compile(mode="reduce-overhead")`` (CUDA graph
trees) frees *every* workspace around its own captures
(``torch._C._cuda_clearCublasWorkspaces``); a workspace that lived in the ordinary
allocator is then handed to other tensors while our graphs still write scratch data
into it: wrong values or an illegal memory access. So before each capture breakgraph
makes sure the capture stream's workspace lives in a private pool of its own that no
other allocation ever draws from (a one-time empty capture on that stream does it): if
torch frees it, the memory stays in that pool, unused by anyone but cuBLAS scratch.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import BreakgraphError, CaptureError, HostSyncError
from ..streams import StreamTracker
from ..syncs import (
    CompileTransparentSegmentMode,
    SegmentMode,
    exit_segment_mode,
    leave_segment_mode,
)
from .base import CaptureOptions, Observer, pool_handle, released_pool_error

_capture_streams: dict = {}  # device -> breakgraph's capture stream
# pools nothing can be captured into again, and why: "invalidated" (a capture CUDA invalidated
# left it recording, torch 2.11) or "released" (its graphs were all released; torch gave it up)
_spoiled_pools: dict = {}
_workspace_pools: dict = {}  # device -> (pool handle, graph) holding cuBLAS workspaces
# breakgraph's own small captures (cuBLAS preparation, the pool probe, the RNG reset) hold
# nothing of the user's: other threads' syncs and allocations meanwhile must not invalidate
# them, as CUDA's global mode would
_OWN_CAPTURE_MODE = "thread_local"
# workspace pools a failed cuBLAS preparation left recording: never used again, kept alive
# (the workspace cuBLAS was handed there may still live in them)
_retired_workspace_pools: list = []


class CudaSegment:
    """One captured CUDA graph; ``replay`` is the bound ``CUDAGraph.replay`` (hot path)."""

    __slots__ = ("graph", "replay", "operations", "unjoined")

    def __init__(self, graph: torch.cuda.CUDAGraph, operations: int | None, unjoined: list):
        self.graph = graph
        self.replay = graph.replay
        self.operations = operations
        self.unjoined = unjoined  # side streams breakgraph had to join at this segment's end

    def reset(self) -> None:
        self.graph.reset()


class CudaSession:
    """The state of one capture: stream, pool, stream tracker, the segment being captured."""

    def __init__(self, options: CaptureOptions, observer: Observer | None = None):
        pool = None if options.pool is None else pool_handle(options.pool)
        spoiled = None if pool is None else _spoiled_pools.get(pool)
        if spoiled == "released":
            raise released_pool_error(pool)
        if spoiled is not None:
            raise CaptureError(
                f"breakgraph.capture: pool {pool} took part in a capture that "
                f"CUDA invalidated, and torch keeps such a pool recording for the rest of the "
                f"process, so nothing can be captured into it again. Capture into a new pool "
                f"(pool=None, or torch.cuda.graph_pool_handle())."
            )
        stream = options.stream
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise CaptureError(
                f"breakgraph.capture: stream must be a torch.cuda.Stream, got {stream!r}"
            )
        torch.cuda.synchronize()
        # Device memory that dead Python cycles hold goes back to the allocator's cache with a
        # full collection, and the cache goes back to the device for the graph's pool. A full
        # collection walks every object of the process (0.5 s in the test run on an H200
        # host), so, as torch.cuda.graph does, it runs only when asked for: collect_garbage
        # True, or None with torch.compiler.config.force_cudagraph_gc.
        collect = options.collect_garbage
        if collect or (collect is None and torch.compiler.config.force_cudagraph_gc):
            gc.collect()
        if collect is not False:
            torch.cuda.empty_cache()
        device = torch.cuda.current_device()
        if stream is None:
            stream = _capture_streams.get(device)
            if stream is None:
                stream = _capture_streams[device] = torch.cuda.Stream(device)
        self.device = device
        self.pool = pool if pool is not None else tuple(torch.cuda.graph_pool_handle())
        self.stream = stream
        self.options = options
        self.observer = observer
        self.tracker = StreamTracker(stream)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._mode: SegmentMode | None = None
        self._invalidated = False
        self._stack = contextlib.ExitStack()
        try:
            _prepare_cublas(device, stream)
            self._stack.enter_context(torch.cuda.stream(stream))
            self.tracker.install(self._stack)
        except BaseException:
            self._stack.close()
            raise

    def begin_segment(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            graph.capture_begin(pool=self.pool, capture_error_mode=self.options.capture_error_mode)
        except BaseException as error:  # torch may have put its RNG in capture mode first
            self._invalidated = True  # close() resets it
            if isinstance(error, RuntimeError) and "use_count > 0" in str(error):
                _spoiled_pools[self.pool] = "released"  # torch's own assert
                _end_allocate_to_pool(self.device, self.pool)  # if it got that far
                raise released_pool_error(self.pool) from error
            raise
        self._graph = graph
        self.tracker.begin_segment()
        # the dispatch mode sees every aten operation (about 10 us each on the host): only
        # when it has something to do. Without it CUDA itself still refuses a host sync in
        # the capture (capture() reports that as HostSyncError, without the line), and the
        # operations are not counted (``None`` in the report).
        if self.options.detect_syncs or self.observer is not None:
            self._mode = CompileTransparentSegmentMode(
                check_syncs=self.options.detect_syncs, on_operation=self.observer
            )
            self._mode.__enter__()

    def end_segment(self, before: str | None = None) -> CudaSegment:
        graph, mode = self._graph, self._mode
        operations = None
        if mode is not None:
            exit_segment_mode(mode, before)  # may refuse: the mode is then abort()'s to exit
            operations = mode.operations
        self._mode = None
        unjoined = self.tracker.join_all()
        with quiet_empty_graph(not operations):  # a break right after another
            graph.capture_end()
        # kept until here: a capture_end that CUDA refused (a capture invalidated with no error
        # at the operation, a side stream not joined) leaves abort() the graph to end, so the
        # allocator stops recording to the pool and the pool is probed (close)
        self._graph = None
        graph.replay()  # real values for the eager code that follows
        return CudaSegment(graph, operations, unjoined)

    def abort(self) -> None:
        graph, mode = self._graph, self._mode
        self._graph = self._mode = None
        if mode is not None:
            leave_segment_mode(mode)
        if graph is not None:
            self.tracker.active = False
            try:
                with quiet_empty_graph():
                    graph.capture_end()
            except Exception:  # the capture was invalidated: CUDA ended it, tell the allocator
                _end_allocate_to_pool(self.device, self.pool)
                self._invalidated = True
            with contextlib.suppress(Exception):
                graph.reset()

    def close(self) -> None:
        self._stack.close()  # hooks removed, the caller's stream current again
        # the capture pass ran (segment replays, eager breaks) on the capture stream: make the
        # caller's stream wait for it before it reads outputs or refills static inputs
        torch.cuda.current_stream().wait_stream(self.stream)
        if self._invalidated:
            if not _takes_captures(self.pool, self.stream):
                _spoiled_pools.setdefault(self.pool, "invalidated")
            _reset_capture_state(self.stream)


def _prepare_cublas(device: int, stream: torch.cuda.Stream) -> None:
    """Create the cuBLAS handle and give the capture stream a workspace no one else can get.

    The handle: cuBLAS creates it on first use, which CUDA forbids inside a capture
    (``CUBLAS_STATUS_NOT_INITIALIZED``), so create it on the caller's stream first. The
    workspace: see the module docstring. Asking for the handle inside an empty capture on
    the capture stream allocates the (handle, capture stream) workspace, if it does not
    exist yet, in breakgraph's workspace pool; if it exists this does nothing.
    """
    _small_matmuls(device)  # creates the cuBLAS and cuBLASLt handles on the caller's stream
    entry = _workspace_pools.get(device)
    if entry is None:
        entry = _workspace_pools[device] = [torch.cuda.graph_pool_handle(), []]
    pool, keep = entry
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream), quiet_empty_graph():
            graph.capture_begin(pool=pool, capture_error_mode=_OWN_CAPTURE_MODE)
            try:
                _small_matmuls(device)  # allocates the (handle, capture stream) workspaces, here
            finally:
                graph.capture_end()
    except BaseException as exc:
        # CUDA invalidated this small capture (in the global mode, other threads' syncs did in a
        # busy-GPU stress run; it is thread-local now): torch keeps the pool recording and its
        # RNG capturing. Leave neither behind, or every later capture and random draw fails.
        _end_allocate_to_pool(device, pool)
        _retired_workspace_pools.append(_workspace_pools.pop(device))  # kept alive; a new one next
        _reset_capture_state(stream)
        if not is_capture_failure(exc):  # out of memory, an interrupt: as they are
            raise
        first = exc.__context__ or exc  # the call CUDA refused, before capture_end's error
        raise CaptureError(
            f"breakgraph.capture: preparing cuBLAS for the capture (an empty capture on the "
            f"capture stream, before the first segment) failed: {first}. Nothing was "
            f"captured, and torch's capture state was reset: a new capture will work."
        ) from exc
    keep[:] = [graph]  # the pool lives as long as one of its graphs does


def is_capture_failure(exc: BaseException) -> bool:
    """A real CUDA stream-capture failure (not the user's own error that mentions capture,
    nor an out-of-memory error or an interrupt)."""
    if isinstance(exc, BreakgraphError) or not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    if "during CUDA graph capture" in text:  # torch refusing a host copy (unpinned memory)
        return True
    cuda_error = getattr(torch, "AcceleratorError", ())
    from_cuda = isinstance(exc, cuda_error) or "CUDA error" in text or "cudaError" in text
    return from_cuda and ("captur" in text or "StreamCapture" in text)


def capture_failure_error(exc: BaseException) -> HostSyncError:
    """What ``breakgraph.capture`` raises for a CUDA capture failure (:func:`is_capture_failure`)
    inside a segment."""
    return HostSyncError(
        f"the CUDA capture failed inside a segment ({exc}). This is usually a host "
        f"synchronisation (.item(), nonzero, .cpu(), torch.cuda.synchronize()) in code "
        f"breakgraph could not see; move it into a function decorated with "
        f"@breakgraph.eager_on_graph. Or another thread used CUDA meanwhile (a sync, "
        f"an allocation), which the global capture mode forbids everywhere in the "
        f"process: capture_error_mode='thread_local' allows it. The graph was reset; a "
        f"new capture will work."
    )


def _small_matmuls(device: int) -> None:
    dtypes = (torch.float32,) + ((torch.bfloat16,) if torch.cuda.is_bf16_supported() else ())
    for dtype in dtypes:
        a = torch.ones(8, 8, device=device, dtype=dtype)
        torch.addmm(a, a, a)


@contextlib.contextmanager
def quiet_empty_graph(expected: bool = True) -> Iterator[None]:
    """Silence torch's "CUDA Graph is empty" warning where an empty graph is expected
    (a segment between two breaks, an abandoned capture, breakgraph's own set-up)."""
    if not expected:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
        yield


def _reset_capture_state(stream: torch.cuda.Stream) -> None:
    """After CUDA invalidated a capture, torch's RNG still believes it is capturing
    ("Offset increment outside graph capture"); one complete empty capture resets it.

    On breakgraph's capture ``stream``, not on the stream every ``torch.cuda.graph`` shares
    by default: resetting a graph can free the cuBLAS workspaces of the stream it was captured
    on (pytorch/pytorch#193402), and a user's plain graphs on that shared stream may still
    read them; the capture stream's workspaces live in breakgraph's own pool (module
    docstring), so freeing them there harms no graph."""
    try:
        with quiet_empty_graph():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode=_OWN_CAPTURE_MODE):
                torch.cuda.current_stream()
            graph.reset()
    except Exception as exc:  # report, never hide: random numbers may fail until a capture works
        warnings.warn(
            f"breakgraph: could not reset torch's CUDA capture state after an "
            f"invalidated capture ({exc}); CUDA random numbers may fail until the next "
            f"successful capture.",
            RuntimeWarning,
            stacklevel=2,
        )


def _takes_captures(pool: Any, stream: torch.cuda.Stream) -> bool:
    """Probe: can a capture still record into ``pool``? After CUDA invalidated a capture into
    it, torch 2.11 refuses ("beginAllocateToPool: already recording to mempool_id", even after
    ``endAllocateToPool``: ``docs/results/h200-pool-after-failed-capture.log``); a torch that
    recovers passes, and the pool stays in use. One empty capture, discarded; any failure of
    the probe counts as "no" (the caller then uses a new pool, which costs memory, never
    correctness)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream), quiet_empty_graph():
            graph.capture_begin(pool=pool, capture_error_mode=_OWN_CAPTURE_MODE)
            graph.capture_end()
        graph.reset()
    except Exception:
        return False
    return True


def _end_allocate_to_pool(device: int, pool) -> None:
    """Tell the allocator a capture CUDA invalidated is over: ``CUDAGraph.capture_end`` throws
    at ``cudaStreamEndCapture`` before it does. (On torch 2.11 the pool still refuses new
    captures afterwards: see :func:`_takes_captures`.)"""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    try:
        if end is not None:
            end(device, pool)
        else:  # older spelling
            torch._C._cuda_endAllocateCurrentStreamToPool(device, pool)
    except Exception:  # "not currently recording": nothing to end
        pass


class CudaBackend:
    name = "cuda"

    def open(self, options: CaptureOptions, observer: Observer | None = None) -> CudaSession:
        return CudaSession(options, observer)

    def pool_usable(self, pool: Any) -> bool:
        return pool_handle(pool) not in _spoiled_pools

    def pool_bytes(self, pool: Any) -> int | None:
        """Bytes the caching allocator holds in CUDA graph pool ``pool``."""
        handle = pool_handle(pool)
        segments = torch.cuda.memory._snapshot()["segments"]
        return sum(
            s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == handle
        )


CUDA_BACKEND = CudaBackend()
