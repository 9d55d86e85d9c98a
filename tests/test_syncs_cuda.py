"""Host synchronisations inside a CUDA capture: named early, or translated when CUDA fails.

CUDA only; skipped without a GPU.
"""

import functools

import pytest
import torch

import breakgraph
from breakgraph import (
    BreakableCUDAGraph,
    BreakgraphError,
    CaptureError,
    HostSyncError,
    eager_on_graph,
)
from tests.helpers import assert_clean, fresh_into

pytestmark = pytest.mark.requires_cuda


capture = functools.partial(breakgraph.capture, backend="cuda")


@eager_on_graph
def host_weight(x):
    return x * x.abs().max().item()


def assert_new_capture_works(graph, x):
    with capture(graph):
        y = host_weight(x.sin()) - x
    assert (graph.num_segments, graph.num_breaks) == (2, 1)
    for _ in range(3):
        new = fresh_into(x)
        graph.replay()
        expected = host_weight(new.sin()) - new
        torch.testing.assert_close(y, expected)
    assert_clean()


SYNCS = {
    ".item()": (lambda t: t.sum().item(), "aten._local_scalar_dense"),
    ".cpu()": (lambda t: t.cpu(), "device-to-host"),
    ".to('cpu')": (lambda t: t.to("cpu"), "device-to-host"),
    ".tolist()": (lambda t: t.tolist(), None),
    "if tensor": (lambda t: 1 if t.sum() > 0 else 0, "aten._local_scalar_dense"),
    "nonzero": (lambda t: t.nonzero(), "aten.nonzero"),
    "x[mask]": (lambda t: t[t > 0], "boolean-mask"),
}


@pytest.mark.parametrize("op", list(SYNCS))
@torch.no_grad()
def test_host_sync_on_cuda_tensor_raises(op):
    sync, fragment = SYNCS[op]
    x = torch.randn(64, device="cuda")
    g = BreakableCUDAGraph()
    with pytest.raises(HostSyncError) as info:
        with capture(g):
            y = x * 2
            sync(y)
    message = str(info.value)
    assert "@breakgraph.eager_on_graph" in message
    if fragment is not None:
        assert fragment in message
    assert "test_syncs_cuda.py" in message  # the user's line
    assert_clean(g)
    assert_new_capture_works(g, x)


@torch.no_grad()
def test_item_on_cpu_tensor_is_allowed():
    host = torch.randn(3)  # a CPU tensor: no device sync, its value is frozen like any host value
    x = torch.randn(64, device="cuda")
    g = BreakableCUDAGraph()
    with capture(g):
        value = host.sum().item()
        y = x * value
    assert_clean()
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, new * value)


@torch.no_grad()
def test_item_without_detection_still_raises_breakgraph_error():
    x = torch.randn(64, device="cuda")
    g = BreakableCUDAGraph()
    with pytest.raises(HostSyncError) as info:
        with capture(g, detect_syncs=False):
            y = x * 2
            y.sum().item()  # CUDA itself fails here
    assert isinstance(info.value, BreakgraphError)
    assert "@breakgraph.eager_on_graph" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert_clean(g)
    assert_new_capture_works(g, x)


@torch.no_grad()
def test_random_numbers_work_right_after_an_invalidated_capture():
    # CUDA invalidates the capture (no detection); torch's RNG must not be left "capturing"
    x = torch.randn(64, device="cuda")
    g = BreakableCUDAGraph()
    with pytest.raises(HostSyncError):
        with capture(g, detect_syncs=False):
            (x * 2).sum().item()
    r = torch.randn(16, device="cuda")  # raised "Offset increment outside graph capture" before
    assert torch.isfinite(r).all()
    assert_new_capture_works(g, x)


@torch.no_grad()
def test_outputs_are_ready_for_the_callers_stream_right_after_capture():
    # the capture pass runs on the capture stream; the caller's stream must wait for it
    x = torch.randn(1 << 20, device="cuda")
    g = BreakableCUDAGraph()
    with capture(g):
        y = x
        for _ in range(20):
            y = torch.sin(y) * 1.0001
    early = y.clone()  # on the caller's stream, no explicit synchronisation
    torch.cuda.synchronize()
    torch.testing.assert_close(early, y)


@torch.no_grad()
def test_a_ladder_watches_only_the_first_bucket_of_a_capture_call():
    # watching every aten operation costs host time per bucket; the buckets run the same code
    from breakgraph.ladder import GraphLadder

    buffer = torch.randn(64, device="cuda")
    ladder = GraphLadder(backend="cuda")
    ladder.capture((8, 16, 32), lambda size: buffer[:size].sin() * 2)
    ops = {size: ladder.graph(size).report().segment_ops for size in (8, 16, 32)}
    assert ops[32][0] > 0  # the first captured (largest): watched, its operations counted
    assert ops[16] == ops[8] == [None]
    fresh_into(buffer)
    torch.testing.assert_close(ladder.replay(16, None), buffer[:16].sin() * 2)
    ladder.close()


def _sync_below(limit: int):
    def record(size: int) -> torch.Tensor:
        y = torch.ones(size, device="cuda")
        if size < limit:
            y = y * y.sum().item()  # a host sync only small buckets take
        return y

    return record


@torch.no_grad()
def test_a_sync_only_a_later_bucket_takes_is_still_named():
    from breakgraph.ladder import GraphLadder

    ladder = GraphLadder(backend="cuda")
    with pytest.raises(HostSyncError) as info:
        ladder.capture((8, 16, 32), _sync_below(16))
    assert "aten._local_scalar_dense" in str(info.value)  # the watched retry named it
    assert "test_syncs_cuda.py" in str(info.value) and ".item()" in str(info.value)
    assert ladder.buckets == (16, 32)  # the buckets before it stay captured
    assert_clean()
    ladder.close()


@torch.no_grad()
@pytest.mark.parametrize("detect_syncs", [False, True], ids=["cuda_refuses", "watched"])
def test_a_shared_pool_after_a_failed_capture_takes_captures_or_says_why_not(detect_syncs):
    # after CUDA invalidated a capture into a pool, torch 2.11 keeps that pool "recording"
    # ("beginAllocateToPool: already recording to mempool_id", even after endAllocateToPool):
    # a later capture into it must either work or say so by name, and leave nothing behind
    x = torch.randn(64, device="cuda")
    first = BreakableCUDAGraph()
    with capture(first):
        doubled = x * 2
    with pytest.raises(HostSyncError):
        with capture(BreakableCUDAGraph(), pool=first.pool(), detect_syncs=detect_syncs):
            (x * 3).sum().item()
    again = BreakableCUDAGraph()
    try:
        with capture(again, pool=first.pool()):
            shifted = x + 1
    except CaptureError as exc:
        assert not detect_syncs  # the watched sync never reached CUDA: the pool is fine
        assert "Capture into a new pool" in str(exc) and "invalidated" in str(exc)
        assert_clean(again)
        torch.randn(4, device="cuda")  # the RNG is out of capture mode
        with capture(again):  # a new pool works
            shifted = x + 1
    for _ in range(2):
        new = fresh_into(x)
        first.replay()
        again.replay()
        torch.testing.assert_close(doubled, new * 2)
        torch.testing.assert_close(shifted, new + 1)
    assert_clean()


@torch.no_grad()
def test_a_ladder_captures_more_buckets_after_a_named_sync():
    from breakgraph.ladder import GraphLadder

    ladder = GraphLadder(backend="cuda")
    with pytest.raises(HostSyncError):
        ladder.capture((8, 16, 32), _sync_below(16))
    buffer = torch.randn(64, device="cuda")
    # the same pool, or a new one where CUDA spoiled it (the ladder switches by itself)
    ladder.capture((48, 64), lambda size: buffer[:size].cos())
    fresh_into(buffer)
    torch.testing.assert_close(ladder.replay(48, None), buffer[:48].cos())
    torch.testing.assert_close(ladder.replay(16, None), torch.ones(16, device="cuda"))
    ladder.close()


@torch.no_grad()
def test_a_failed_cublas_preparation_leaves_nothing_behind(monkeypatch):
    # before the first segment, an empty capture on the capture stream puts the cuBLAS
    # workspace in a pool of its own (backends/cuda._prepare_cublas). When CUDA invalidates
    # it (here a sync inside it; in the busy-GPU stress run, another thread's CUDA calls),
    # torch keeps that pool recording and its RNG capturing: every later capture failed on
    # "beginAllocateToPool: already recording" until the process ended. It must raise by name
    # and leave the RNG, the pool and the next capture working.
    from breakgraph.backends import cuda

    x = torch.randn(64, device="cuda")
    real = cuda._small_matmuls
    calls = []

    def invalidating(device):
        calls.append(device)
        real(device)
        if len(calls) == 2:  # inside the empty capture
            torch.zeros(1, device="cuda").item()

    monkeypatch.setattr(cuda, "_small_matmuls", invalidating)
    g = BreakableCUDAGraph()
    with pytest.raises(CaptureError, match="preparing cuBLAS.*captur"):
        with capture(g):
            x * 2
    monkeypatch.setattr(cuda, "_small_matmuls", real)
    assert_clean(g)
    device = torch.cuda.current_device()
    failed_pool = cuda._retired_workspace_pools[-1][0]
    assert device not in cuda._workspace_pools  # the next capture makes a new one
    with pytest.raises(RuntimeError, match="not currently recording"):  # it was ended
        torch._C._cuda_endAllocateToPool(device, failed_pool)
    r = torch.randn(16, device="cuda")  # the RNG is out of capture mode
    assert torch.isfinite(r).all()
    for _ in range(2):  # the next captures prepare cuBLAS in a new pool, and work
        assert_new_capture_works(BreakableCUDAGraph(), x)
