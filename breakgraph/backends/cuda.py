"""The CUDA backend: every segment is one ``torch.cuda.CUDAGraph``.

All segments of a graph are captured into one private memory pool (and several
graphs can share it with ``pool=other.pool()``), on one capture stream, exactly as
``torch.cuda.graph`` does for a single graph. Each segment is replayed once right
after it is captured, so the eager function that follows sees real inputs and the
capture pass computes real outputs (as the emulated backend does).
"""

from __future__ import annotations

import warnings

import torch

from ..errors import CaptureError
from ..streams import StreamTracker
from ..syncs import CompileTransparentSegmentMode, SegmentMode

_default_capture_streams: dict = {}


class CudaSegment:
    """One captured CUDA graph; ``replay`` is the bound ``CUDAGraph.replay`` (hot path)."""

    __slots__ = ("graph", "replay", "operations", "unjoined")

    def __init__(self, graph: torch.cuda.CUDAGraph, operations: int, unjoined: list):
        self.graph = graph
        self.replay = graph.replay
        self.operations = operations
        self.unjoined = unjoined  # side streams breakgraph had to join at this segment's end

    def reset(self) -> None:
        self.graph.reset()


class CudaSession:
    """The state of one capture: stream, pool, stream tracker, the segment being captured."""

    def __init__(
        self,
        pool,
        stream: torch.cuda.Stream | None,
        capture_error_mode: str,
        detect_syncs: bool,
        observer=None,
    ):
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise CaptureError(
                f"breakgraph.capture: stream must be a torch.cuda.Stream, got {stream!r}"
            )
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        device = torch.cuda.current_device()
        if stream is None:
            stream = _default_capture_streams.get(device)
            if stream is None:
                stream = _default_capture_streams[device] = torch.cuda.Stream(device)
        self.device = device
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = stream
        self.capture_error_mode = capture_error_mode
        self.detect_syncs = detect_syncs
        self.observer = observer
        self.tracker = StreamTracker(stream)
        self._stream_context = torch.cuda.stream(stream)
        self._stream_context.__enter__()
        # cuBLAS creates its handle on first use, which CUDA forbids inside a capture
        # (CUBLAS_STATUS_NOT_INITIALIZED): create it now, so a capture may hold the
        # process's first matmul without a warm-up
        torch.cuda.current_blas_handle()
        self.tracker.install()
        self._graph: torch.cuda.CUDAGraph | None = None
        self._invalidated = False
        self._mode: SegmentMode | None = None

    def begin_segment(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode=self.capture_error_mode)
        self._graph = graph
        self.tracker.begin_segment()
        self._mode = CompileTransparentSegmentMode(
            check_syncs=self.detect_syncs, on_operation=self.observer
        )
        self._mode.__enter__()

    def end_segment(self) -> CudaSegment:
        graph, mode = self._graph, self._mode
        self._graph = self._mode = None
        mode.__exit__(None, None, None)
        unjoined = self.tracker.join_all()
        with warnings.catch_warnings():
            if mode.operations == 0:  # a break right after another: an empty segment is expected
                warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            graph.capture_end()
        graph.replay()  # real values for the eager code that follows
        return CudaSegment(graph, mode.operations, unjoined)

    def abort(self) -> None:
        """Abandon the segment being captured (if any), leaving the allocator and stream clean."""
        graph, mode = self._graph, self._mode
        self._graph = self._mode = None
        if mode is not None:
            mode.__exit__(None, None, None)
        if graph is not None:
            self.tracker.active = False
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
                    graph.capture_end()
            except Exception:  # the capture was invalidated: CUDA ended it, tell the allocator
                _end_allocate_to_pool(self.device, self.pool)
                self._invalidated = True
            try:
                graph.reset()
            except Exception:
                pass

    def close(self) -> None:
        self.tracker.uninstall()
        self._stream_context.__exit__(None, None, None)
        # the capture pass ran (segment replays, eager breaks) on the capture stream: make the
        # caller's stream wait for it before it reads outputs or refills static inputs
        torch.cuda.current_stream().wait_stream(self.stream)
        if self._invalidated:
            _reset_capture_state()


def _reset_capture_state() -> None:
    """After CUDA invalidated a capture, torch's RNG still believes it is capturing
    ("Offset increment outside graph capture"); one complete empty capture resets it."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                torch.cuda.current_stream()
            graph.reset()
    except Exception as exc:  # report, never hide: random numbers may fail until a capture succeeds
        warnings.warn(
            f"breakgraph: could not reset torch's CUDA capture state after an "
            f"invalidated capture ({exc}); CUDA random numbers may fail until the next "
            f"successful capture.",
            RuntimeWarning,
            stacklevel=2,
        )


def _end_allocate_to_pool(device: int, pool) -> None:
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    try:
        if end is not None:
            end(device, pool)
        else:  # older spelling
            torch._C._cuda_endAllocateCurrentStreamToPool(device, pool)
    except Exception:
        pass


class CudaBackend:
    name = "cuda"

    def new_pool(self):
        return torch.cuda.graph_pool_handle()

    def open(
        self, pool, stream, capture_error_mode: str, detect_syncs: bool, observer=None
    ) -> CudaSession:
        return CudaSession(pool, stream, capture_error_mode, detect_syncs, observer)


CUDA_BACKEND = CudaBackend()
