"""Side streams inside a CUDA capture: forks are tracked and joined at every segment end.

CUDA only (the emulated backend cannot see streams); skipped without a GPU.
"""

import functools

import pytest
import torch

import breakgraph
from breakgraph import BreakableCUDAGraph, StreamError, eager_on_graph
from tests.helpers import assert_clean, fresh_into

pytestmark = pytest.mark.requires_cuda


capture = functools.partial(breakgraph.capture, backend="cuda")

N = 1 << 16  # big enough that a missing dependency between streams shows up as a race

# The side streams here are high-priority ones: torch hands streams out round-robin from a pool
# of 32 per priority, and breakgraph's capture stream comes from the default-priority pool, so a
# default `torch.cuda.Stream()` is the capture stream itself once in 32 (depending on how many
# streams earlier tests made). A test would then fork nothing, or wait legally where it expects
# a StreamError (seen on the H200, session 13).


@eager_on_graph
def host_scale(x):
    """Host-dependent: scales by the number of positive entries (needs .item())."""
    return x * (int((x > 0).sum().item()) / x.numel())


def capture_and_check(body, replays=5):
    """Warm ``body`` up, capture it (one break: two segments), check that no hook or stream
    is left behind, then replay on fresh inputs and compare each replay with eager."""
    x = torch.randn(N, device="cuda")
    body(x)
    torch.cuda.synchronize()
    g = BreakableCUDAGraph()
    with capture(g):
        out = body(x)
    assert (g.num_segments, g.num_breaks) == (2, 1)
    assert_clean()
    for _ in range(replays):
        new = fresh_into(x)
        g.replay()
        expected = body(new.clone())
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected)


@torch.no_grad()
def test_side_stream_joined_by_user_then_break():
    side = torch.cuda.Stream(priority=-1)  # never breakgraph's capture stream (see the top)

    def body(x):
        current = torch.cuda.current_stream()
        side.wait_stream(current)  # fork
        with torch.cuda.stream(side):
            a = (x.sin() * 2).exp()
        b = x.cos()
        current.wait_stream(side)  # join
        c = host_scale(a + b)  # break
        return c * 3 - b

    capture_and_check(body)


@torch.no_grad()
def test_side_stream_not_joined_before_break():
    side = torch.cuda.Stream(priority=-1)  # never breakgraph's capture stream (see the top)

    def body(x):
        current = torch.cuda.current_stream()
        side.wait_stream(current)  # fork ...
        with torch.cuda.stream(side):
            a = (x * 1.5).tanh()
        c = host_scale(x.cos())  # ... break while `side` is still forked
        with torch.cuda.stream(side):
            a2 = a * a + 1  # more side work after the break
        d = c * 2
        current.wait_stream(side)  # the user joins only now
        return d + a2

    capture_and_check(body)


@torch.no_grad()
def test_fork_and_join_through_events():
    side = torch.cuda.Stream(priority=-1)  # never breakgraph's capture stream (see the top)

    def body(x):
        current = torch.cuda.current_stream()
        forked = torch.cuda.Event()
        forked.record()  # on the capture stream
        side.wait_event(forked)  # fork
        with torch.cuda.stream(side):
            a = x.sigmoid() * 4
        y = host_scale(x + 1)  # break while forked
        with torch.cuda.stream(side):
            a = a - 1
        joined = side.record_event()
        current.wait_event(joined)  # join
        return a * y

    capture_and_check(body)


@pytest.mark.parametrize("how", ["wait_stream", "event recorded before capture"])
@torch.no_grad()
def test_waiting_on_work_outside_the_capture_raises(how):
    other = torch.cuda.Stream(priority=-1)
    x = torch.randn(N, device="cuda")
    with torch.cuda.stream(other):
        queued = x * 2  # work queued before the capture
    event = other.record_event()

    g = BreakableCUDAGraph()
    with pytest.raises(StreamError) as info:
        with capture(g):
            y = x + 1
            if how == "wait_stream":
                torch.cuda.current_stream().wait_stream(other)
            else:
                torch.cuda.current_stream().wait_event(event)
            y = y + queued  # pragma: no cover
    assert "cannot be recorded in a CUDA graph" in str(info.value)
    assert isinstance(info.value, breakgraph.CaptureError)
    assert_clean(g)

    with capture(g):  # a new capture works
        z = host_scale(x.exp()) + 1
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(z, host_scale(new.exp()) + 1)
    assert_clean()


def test_hooks_are_removed_after_captures():
    x = torch.randn(8, device="cuda")
    g = BreakableCUDAGraph()
    with capture(g):
        host_scale(x)
    assert_clean()
    event = torch.cuda.Event()
    event.record()  # the originals work as before
    torch.cuda.current_stream().wait_event(event)
    event.synchronize()


def test_a_segment_end_cuda_refuses_leaves_the_pool_to_a_new_capture():
    """A fork breakgraph cannot see (an event recorded and waited on below torch's Python
    ``Event``) leaves work unjoined, and CUDA refuses to end the segment. The session had already
    let go of the segment's graph, so nothing told the allocator the capture was over: the
    pool stayed recording, and the next capture into it failed with torch's internal
    ``beginAllocateToPool: already recording to mempool_id`` (a GraphLadder would not know to
    leave it). Now that pool is refused by name, and a new pool captures as ever (checked on an
    H200: torch's error before, this one after)."""
    x = torch.ones(4, device="cuda")
    first = BreakableCUDAGraph()
    with capture(first):
        held = x * 2
    pool = first.pool()

    def untracked_fork():
        x * 3
        side, event = torch.cuda.Stream(priority=-1), torch.cuda.Event()
        torch._C._CudaEventBase.record(event, torch.cuda.current_stream())
        torch._C._CudaEventBase.wait(event, side)
        with torch.cuda.stream(side):
            x + 1

    with pytest.raises(breakgraph.HostSyncError, match="unjoined"):
        with capture(BreakableCUDAGraph(), pool=pool):
            untracked_fork()
    assert_clean()
    with pytest.raises(breakgraph.CaptureError, match="CUDA invalidated"):
        with capture(BreakableCUDAGraph(), pool=pool):
            x * 4
    g = BreakableCUDAGraph()
    with capture(g):  # a new pool
        out = x * 5 + torch.rand_like(x)
    g.replay()
    torch.cuda.synchronize()
    assert out.shape == (4,) and held.shape == (4,)
