"""BreakableCUDAGraph and capture(): topology, replay, lifetimes, errors, per-replay state.

Every test runs on both backends through the ``capture``/``device`` fixtures
(the CUDA one is skipped without a GPU). Replays always use fresh random inputs
copied into the static input and are compared with eager results on the same
inputs.
"""

import gc
import textwrap
import time

import pytest
import torch
from torch import nn

import breakgraph
from breakgraph import (
    BackendError,
    BreakableCUDAGraph,
    CaptureError,
    HostSyncError,
    ReplayError,
    break_graph,
    eager_on_graph,
)
from breakgraph.backends.base import pool_handle
from tests.helpers import (
    HAS_CUDA,
    assert_clean,
    fresh_into,
    fresh_process_check,
    fresh_process_result,
)

# Taken before any test runs a capture: what every capture must leave in place.


# ---------------------------------------------------------------------------------------
# Host-dependent eager functions and a small multi-break model
# ---------------------------------------------------------------------------------------


@eager_on_graph
def data_dependent_loop(x):
    """A Python loop whose trip count depends on the data (needs .item())."""
    out = x.clone()
    steps = int((x > 0).sum().item()) % 4 + 1
    for _ in range(steps):
        out = out * 0.75 + 0.1
    return out


@eager_on_graph
def square_negatives(x):
    """Boolean indexing: the selected set has a data-dependent size."""
    out = x.clone()
    mask = x < 0
    out[mask] = x[mask] ** 2
    return out


@eager_on_graph
def row_stats(x):
    """Returns two tensors computed with host-side decisions per row."""
    rows = []
    for row in x:
        positives = row[row > 0]
        rows.append(positives.sum() if positives.numel() else row.min())
    stacked = torch.stack(rows)
    return stacked, x - stacked[:, None]


class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        h = torch.tanh(self.linear(x)) + x  # captured
        h = data_dependent_loop(h)  # break
        h = h * 1.5 - 0.25  # captured
        return square_negatives(h)  # break


class Stack(nn.Module):
    def __init__(self, layers, width):
        super().__init__()
        self.layers = nn.ModuleList(Layer(width) for _ in range(layers))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        stats, centred = row_stats(x)  # break returning a tuple
        return self.head(centred) + stats[:, None]


# ---------------------------------------------------------------------------------------
# Multi-break model, shared pools
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def test_multi_break_model_replays_match_eager(capture, device):
    model = Stack(layers=3, width=16).to(device)
    static_x = torch.randn(6, 16, device=device)
    model(static_x)  # warm up

    g = BreakableCUDAGraph()
    with capture(g):
        out = model(static_x)
    assert g.num_breaks == 3 * 2 + 1
    assert g.num_segments == g.num_breaks + 1
    torch.testing.assert_close(out, model(static_x.clone()))  # the capture pass is real

    for _ in range(12):
        new = fresh_into(static_x)
        g.replay()
        torch.testing.assert_close(out, model(new))


@torch.no_grad()
def test_two_graphs_sharing_a_pool_replay_interleaved(capture, device):
    model_a = Stack(layers=2, width=16).to(device)
    model_b = Stack(layers=3, width=16).to(device)
    static_a = torch.randn(5, 16, device=device)
    static_b = torch.randn(7, 16, device=device)
    model_a(static_a), model_b(static_b)  # warm up

    ga = BreakableCUDAGraph()
    with capture(ga):
        out_a = model_a(static_a)
    gb = BreakableCUDAGraph()
    with capture(gb, pool=ga.pool()):
        out_b = model_b(static_b)
    assert gb.pool() == ga.pool()
    assert ga.num_breaks == 5 and gb.num_breaks == 7
    gc.collect()  # nothing the graphs need may depend on a Python reference we dropped

    for _ in range(6):
        new_a = fresh_into(static_a)
        ga.replay()
        torch.testing.assert_close(out_a, model_a(new_a))
        new_b = fresh_into(static_b)
        gb.replay()
        torch.testing.assert_close(out_b, model_b(new_b))
        torch.testing.assert_close(out_a, model_a(new_a))  # B's replay left A's output alone


def test_a_mem_pool_is_taken_by_its_id_and_anything_else_is_refused(monkeypatch):
    """torch 2.14's ``torch.cuda.graph`` takes a ``torch.cuda.MemPool`` as its pool;
    breakgraph takes one on every release, by its id (earlier ``capture_begin``s take the id
    only), and refuses what is no pool by name instead of a TypeError inside torch."""

    class FakeMemPool:  # the CPU build's MemPool cannot be made
        def __init__(self, id):
            self.id = id

    monkeypatch.setattr(torch.cuda, "MemPool", FakeMemPool)
    assert pool_handle(FakeMemPool((0, 7))) == (0, 7)
    assert pool_handle((3, 0)) == (3, 0)
    for bad in ("not a pool handle", (1, 2, 3), [0, 1], (0, 1.0), 5):
        with pytest.raises(CaptureError, match=r"is not a graph memory pool.*MemPool"):
            pool_handle(bad)
    # the emulated backend takes it as CUDA does: the graph's pool is the id
    x = torch.randn(4)
    g = BreakableCUDAGraph()
    with breakgraph.capture(g, pool=FakeMemPool((0, 7)), backend="emulated"):
        y = double_on_host(x) + 1
    assert g.pool() == (0, 7)
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 2 + 1)


@pytest.mark.requires_cuda
@torch.no_grad()
def test_two_graphs_share_a_mem_pool():
    """A ``torch.cuda.MemPool`` as the pool of two graphs, as ``torch.cuda.graph`` takes it
    from torch 2.14: both record into it and replay interleaved."""
    model_a = Stack(layers=2, width=16).to("cuda")
    model_b = Stack(layers=3, width=16).to("cuda")
    static_a = torch.randn(5, 16, device="cuda")
    static_b = torch.randn(7, 16, device="cuda")
    model_a(static_a), model_b(static_b)  # warm up
    mem_pool = torch.cuda.MemPool()
    ga, gb = BreakableCUDAGraph(), BreakableCUDAGraph()
    with breakgraph.capture(ga, pool=mem_pool, backend="cuda"):
        out_a = model_a(static_a)
    with breakgraph.capture(gb, pool=mem_pool, backend="cuda"):
        out_b = model_b(static_b)
    assert ga.pool() == gb.pool() == tuple(mem_pool.id)
    assert ga.report().graph_memory_bytes > 0
    for _ in range(4):
        new_a, new_b = fresh_into(static_a), fresh_into(static_b)
        ga.replay()
        gb.replay()
        torch.testing.assert_close(out_a, model_a(new_a))
        torch.testing.assert_close(out_b, model_b(new_b))


def _new_pool(backend):
    if backend == "cuda":
        return torch.cuda.graph_pool_handle()
    return breakgraph.backends.emulated.EmulatedPool()


@torch.no_grad()
def test_a_pool_is_given_up_with_its_last_graph_and_refused_by_name(capture, backend, device):
    """torch counts a pool's graphs and gives the pool up with the last one: a later capture
    into its handle failed torch 2.11's internal assert (``use_count > 0``) on the H200, where
    ``GraphLadder.discard`` then ``capture`` hit it. Both backends refuse it by name, also where
    the pool's only capture failed, and a pool with one live graph stays shared."""
    model = Stack(layers=2, width=16).to(device)
    static = torch.randn(5, 16, device=device)
    model(static)
    first, second, third = BreakableCUDAGraph(), BreakableCUDAGraph(), BreakableCUDAGraph()
    with capture(first):
        model(static)
    pool = first.pool()
    with capture(second, pool=pool):
        model(static)
    first.reset()  # second keeps the pool
    with capture(third, pool=pool):
        out = model(static)
    new = fresh_into(static)
    third.replay()
    torch.testing.assert_close(out, model(new))
    second.reset(), third.reset()
    for _ in range(2):  # the second time from breakgraph's record, before torch is asked
        with pytest.raises(CaptureError, match=r"has no live graph any more.*new pool"):
            with capture(BreakableCUDAGraph(), pool=pool):
                model(static)
        assert_clean()

    failed = _new_pool(backend)  # its only capture failed: torch gave it up on the reset
    with pytest.raises(HostSyncError):
        with capture(BreakableCUDAGraph(), pool=failed):
            static.sum().item()
    with pytest.raises(CaptureError, match="has no live graph any more"):
        with capture(BreakableCUDAGraph(), pool=failed):
            model(static)
    fresh = BreakableCUDAGraph()
    with capture(fresh):  # a new pool works as ever
        out = model(static)
    new = fresh_into(static)
    fresh.replay()
    torch.testing.assert_close(out, model(new))


# ---------------------------------------------------------------------------------------
# Topology
# ---------------------------------------------------------------------------------------


@eager_on_graph
def double_on_host(x):
    return x * 2


@eager_on_graph
def add_one_on_host(x):
    return x + 1


def test_topology_and_repr(capture, device):
    x = torch.randn(8, device=device)
    g = BreakableCUDAGraph()
    assert (g.num_segments, g.num_breaks, g.backend) == (0, 0, None)
    assert repr(g) == "BreakableCUDAGraph(empty)"

    with capture(g):
        a = x.sin()
        b = double_on_host(a)
        break_graph()
        c = add_one_on_host(b.cos())
        d = c * 3

    assert g.num_segments == 4
    assert g.num_breaks == 3
    assert g.backend == ("cuda" if device == "cuda" else "emulated")
    assert g.break_names == ["double_on_host", "break_graph", "add_one_on_host"]
    backend = g.backend
    assert repr(g) == (
        f"BreakableCUDAGraph(backend={backend!r}, segments=4, breaks=3: [segment 0] -> "
        "double_on_host -> [segment 1] -> break_graph -> [segment 2] -> add_one_on_host "
        "-> [segment 3])"
    )

    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(d, ((new.sin() * 2).cos() + 1) * 3)


def test_empty_break_runs_nothing_on_replay(capture, device):
    x = torch.randn(8, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = x * 2
        break_graph()
        break_graph()
        z = y + x
    assert (g.num_segments, g.num_breaks) == (3, 2)
    assert g.break_names == ["break_graph", "break_graph"]
    # An empty break registers no replay function: replay is segment, segment, segment.
    assert all(brk.function is None and brk.replay is None for brk in g._captured.breaks)
    assert len(g._captured.steps) == g.num_segments
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(z, new * 3)


def test_break_graph_outside_capture_is_a_no_op():
    assert break_graph() is None
    assert_clean()


# ---------------------------------------------------------------------------------------
# Errors on misuse; reset
# ---------------------------------------------------------------------------------------


def test_replay_before_capture_raises():
    with pytest.raises(ReplayError, match="nothing was captured"):
        BreakableCUDAGraph().replay()


def test_pool_before_capture_raises():
    with pytest.raises(CaptureError):
        BreakableCUDAGraph().pool()


def test_capture_into_captured_graph_raises_and_keeps_it(capture, device):
    x = torch.randn(5, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = double_on_host(x + 1)
    with pytest.raises(CaptureError, match="already holds a capture"):
        with capture(g):
            pytest.fail("the body must not run")  # pragma: no cover
    assert_clean()
    assert (g.num_segments, g.num_breaks) == (2, 1)  # the failed attempt did not touch it
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, (new + 1) * 2)


def test_reset_inside_its_own_replay_raises_and_keeps_the_graph(capture, device):
    """An eager function that reset the graph replaying it: the rest of that replay ran
    nothing on the emulated backend (its segments were emptied), silently, where CUDA raises
    at the next segment. reset() now refuses by name; the graph keeps its capture."""
    holder = {"reset": False}

    @eager_on_graph
    def resets_its_graph(t):
        if holder["reset"]:
            holder["graph"].reset()
        return t * 2

    x = torch.randn(5, device=device)
    g = BreakableCUDAGraph()
    holder["graph"] = g
    with capture(g):
        y = resets_its_graph(x + 1) + 1
    holder["reset"] = True
    with pytest.raises(ReplayError, match=r"reset\(\) inside its own replay"):
        g.replay()
    assert (g.num_segments, g.num_breaks) == (2, 1)
    holder["reset"] = False
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, (new + 1) * 2 + 1)
    g.reset()  # outside the replay: fine
    assert_clean(g)


def test_reset_then_capture_again(capture, device):
    x = torch.randn(5, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = double_on_host(x + 1)
    g.reset()
    assert_clean(g)
    with pytest.raises(CaptureError):
        g.pool()

    with capture(g):
        z = add_one_on_host(x * 3) - x
    assert g.break_names == ["add_one_on_host"]
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(z, new * 3 + 1 - new)


def test_reset_inside_its_own_capture_or_a_capture_of_no_graph_raises(capture, device):
    """reset() of the graph being captured, and capture() of what is not a
    BreakableCUDAGraph, raise CaptureError by name; the graph is captured again afterwards."""
    x = torch.randn(5, device=device)
    g = BreakableCUDAGraph()
    with pytest.raises(CaptureError, match=r"reset\(\) inside its own capture"):
        with capture(g):
            y = x * 2
            g.reset()
    assert_clean(g)
    for wrong in (None, torch.zeros(1), "g"):
        with pytest.raises(CaptureError, match="expected a BreakableCUDAGraph, got"):
            with capture(wrong):
                pass
    with capture(g):
        y = double_on_host(x + 1)
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, (new + 1) * 2)


@pytest.mark.parametrize("target", ["other graph", "same graph"])
def test_nested_capture_raises_and_outer_capture_completes(capture, device, target):
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    other = g if target == "same graph" else BreakableCUDAGraph()
    with capture(g):
        y = x * 2
        with pytest.raises(CaptureError):
            with capture(other):
                pytest.fail("the nested body must not run")  # pragma: no cover
        z = double_on_host(y) + 1
    assert_clean()
    if other is not g:
        assert other.num_segments == 0
    assert (g.num_segments, g.num_breaks) == (2, 1)
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(z, new * 4 + 1)


def test_nested_capture_error_aborts_outer_cleanly(capture, device):
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with pytest.raises(CaptureError):
        with capture(g):
            y = double_on_host(x * 2)
            with capture(BreakableCUDAGraph()):
                pass  # pragma: no cover
    assert_clean(g)
    with capture(g):  # the lock was released and the graph reset: capture again
        y = double_on_host(x * 2) + 1
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 4 + 1)


# ---------------------------------------------------------------------------------------
# Per-replay host state
# ---------------------------------------------------------------------------------------


@eager_on_graph
def scale_by_context(x):
    return x * breakgraph.replay_context()["factor"]


def test_replay_context_per_replay(capture, device):
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with capture(g, context={"factor": 2.0}):
        y = scale_by_context(x + 1) - 1
    torch.testing.assert_close(y, (x + 1) * 2 - 1)  # capture pass saw the capture context

    for factor in (3.0, -0.5, 7.25):
        new = fresh_into(x)
        g.replay(context={"factor": factor})
        torch.testing.assert_close(y, (new + 1) * factor - 1)

    new = fresh_into(x)
    g.replay()  # no context: the capture's context is the default
    torch.testing.assert_close(y, (new + 1) * 2 - 1)

    with pytest.raises(ReplayError):  # restored after each replay
        breakgraph.replay_context()


def test_replay_context_is_a_live_host_object(capture, device):
    state = {"factor": 1.0}
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with capture(g, context=state):
        y = scale_by_context(x) + x
    for factor in (4.0, -2.0):
        state["factor"] = factor  # the caller updates the host object before replay()
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, new * factor + new)


def test_replay_context_outside_replay_raises():
    with pytest.raises(ReplayError, match="no context is set"):
        breakgraph.replay_context()


@eager_on_graph
def add_host_int(x, n):
    return x + n


def test_python_int_argument_is_frozen_at_capture(capture, device):
    step = {"n": 3}
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = add_host_int(x * 1, step["n"])
    step["n"] = 10  # too late: replay calls add_host_int with its capture-time arguments
    for _ in range(2):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, new + 3)
        assert not torch.allclose(y, new + 10)


# ---------------------------------------------------------------------------------------
# A failed capture leaves nothing behind
# ---------------------------------------------------------------------------------------


class UserFailure(Exception):
    pass


@eager_on_graph
def failing_eager(x):
    raise UserFailure("raised by an eager function")


@pytest.mark.parametrize("where", ["first segment", "later segment", "eager function"])
def test_failure_inside_capture_leaves_nothing_behind(capture, device, where):
    assert gc.isenabled()
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with pytest.raises(UserFailure):
        with capture(g):
            y = x * 2
            if where == "first segment":
                raise UserFailure("raised in a segment")
            y = double_on_host(y)  # a complete segment and a break exist already
            if where == "later segment":
                raise UserFailure("raised in a segment")
            failing_eager(y)
    assert_clean(g)

    with capture(g):  # a new capture into the same graph works
        z = double_on_host(x + 1) * x
    assert (g.num_segments, g.num_breaks) == (2, 1)
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(z, (new + 1) * 2 * new)
    assert_clean()


class InjectedFailure(Exception):
    pass


def _session_class(backend):
    if backend == "cuda":
        from breakgraph.backends.cuda import CudaSession

        return CudaSession
    from breakgraph.backends.emulated import EmulatedSession

    return EmulatedSession


@pytest.mark.parametrize("which", ["first segment", "segment after a break"])
def test_failure_beginning_a_segment_leaves_nothing_behind(
    capture, backend, device, monkeypatch, which
):
    # Stands in for a backend failing to begin a segment (e.g. CUDAGraph.capture_begin raising).
    session_class = _session_class(backend)
    original_begin = session_class.begin_segment
    calls = []

    def failing_begin(self):
        calls.append(None)
        if which == "first segment" or len(calls) == 2:
            raise InjectedFailure("capture_begin failed")
        return original_begin(self)

    monkeypatch.setattr(session_class, "begin_segment", failing_begin)
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with pytest.raises(InjectedFailure):
        with capture(g):
            double_on_host(x * 2)
    monkeypatch.undo()
    assert_clean_and_capturable(capture, g, x)


def assert_clean_and_capturable(capture, g, x) -> None:
    """Nothing of a failed capture is left, and a new capture into ``g`` works."""
    assert_clean(g)
    assert not g._capturing
    with capture(g):
        y = double_on_host(x * 2) + 1
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 4 + 1)


def _segment_class(backend):
    if backend == "cuda":
        from breakgraph.backends.cuda import CudaSegment

        return CudaSegment
    from breakgraph.backends.emulated import EmulatedSegment

    return EmulatedSegment


def test_a_segment_reset_failing_during_abort_still_cleans_up(
    capture, backend, device, monkeypatch
):
    """The abort of a failed capture resets its segments in a loop: a reset that raised
    skipped the other segments' resets and the session's close, so the graph stayed marked
    as capturing (no new capture into it), the capture stayed current on the thread and the
    hooks stayed installed. Every step now runs, then the first error is raised."""
    segment_class = _segment_class(backend)
    original_reset = segment_class.reset
    resets = []

    def failing_reset(self):
        resets.append(self)
        if len(resets) == 1:
            raise InjectedFailure("segment reset failed")
        original_reset(self)

    monkeypatch.setattr(segment_class, "reset", failing_reset)
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with pytest.raises(InjectedFailure) as info:
        with capture(g):
            y = double_on_host(x * 2)
            y = double_on_host(y + 1)  # two segments ended: two resets
            raise UserFailure("raised in a segment")
    monkeypatch.undo()
    assert isinstance(info.value.__context__, UserFailure)
    assert len(resets) == 2  # the one after the failing reset ran too
    assert_clean_and_capturable(capture, g, x)


@pytest.mark.parametrize("bad", ["not a pool handle", (1, 2, 3), 5])
def test_invalid_pool_leaves_nothing_behind(capture, device, bad):
    """A pool that is none is refused by name on both backends, before the body runs, and
    the graph takes a capture afterwards."""
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with pytest.raises(CaptureError, match=r"is not a graph memory pool.*MemPool"):
        with capture(g, pool=bad):
            pytest.fail("the body must not run")  # pragma: no cover
    assert_clean(g)
    assert not g._capturing
    with capture(g):
        y = double_on_host(x * 2) + 1
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 4 + 1)


@pytest.mark.parametrize(
    "option, bad, match",
    [
        ("detect_syncs", "no", r"detect_syncs must be True or False, got 'no'"),
        ("detect_syncs", None, r"detect_syncs must be True or False, got None"),
        ("collect_garbage", 0, r"collect_garbage must be None, True or False, got 0"),
        ("stream", "side", r"stream must be None .* or a torch.cuda.Stream, got 'side'"),
        ("capture_error_mode", 1, r"capture_error_mode must be one of"),
    ],
)
def test_bad_capture_options_are_refused_by_name(capture, device, option, bad, match):
    """capture() took its flags for their truth value (detect_syncs="no" watched for syncs,
    collect_garbage=0 skipped the collection) and a stream that is none failed inside CUDA's
    stream switch (the emulated backend ignored it). Refused by name before the body runs."""
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with pytest.raises(CaptureError, match=f"breakgraph.capture: {match}"):
        with capture(g, **{option: bad}):
            pytest.fail("the body must not run")  # pragma: no cover
    assert_clean(g)
    with capture(g):
        y = double_on_host(x * 2) + 1
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 4 + 1)


def test_gc_disabled_during_capture_only(capture, device):
    assert gc.isenabled()
    seen = []
    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        seen.append(gc.isenabled())
        double_on_host(x)
        seen.append(gc.isenabled())
    assert seen == [False, False]
    assert gc.isenabled()


# ---------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is available: the default backend is 'cuda'")
def test_no_gpu_no_backend_raises_backend_error(monkeypatch):
    monkeypatch.delenv("BREAKGRAPH_BACKEND", raising=False)
    g = BreakableCUDAGraph()
    with pytest.raises(BackendError) as info:
        with breakgraph.capture(g):
            pytest.fail("the body must not run")  # pragma: no cover
    message = str(info.value)
    assert "backend='emulated'" in message
    assert "BREAKGRAPH_BACKEND" in message
    assert_clean(g)


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is available")
def test_cuda_backend_without_gpu_raises_backend_error():
    with pytest.raises(BackendError, match="emulated"):
        with breakgraph.capture(BreakableCUDAGraph(), backend="cuda"):
            pass  # pragma: no cover
    assert_clean()


def test_backend_from_environment(monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_BACKEND", "emulated")
    x = torch.randn(4)
    g = BreakableCUDAGraph()
    with breakgraph.capture(g):
        y = double_on_host(x.exp())
    assert g.backend == "emulated"
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new.exp() * 2)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_unknown_backend_raises_backend_error(monkeypatch, how):
    g = BreakableCUDAGraph()
    kwargs = {}
    if how == "argument":
        kwargs["backend"] = "tpu"
    else:
        monkeypatch.setenv("BREAKGRAPH_BACKEND", "tpu")
    with pytest.raises(BackendError, match="unknown backend 'tpu'"):
        with breakgraph.capture(g, **kwargs):
            pass  # pragma: no cover
    assert_clean(g)
    assert issubclass(BackendError, breakgraph.BreakgraphError)


# ---------------------------------------------------------------------------------------
# is_capturing()
# ---------------------------------------------------------------------------------------


def test_is_capturing(capture, device):
    seen = {}

    @eager_on_graph
    def probe(x):
        seen.setdefault("eager", []).append(breakgraph.is_capturing())
        return x + 1

    x = torch.randn(4, device=device)
    seen["before"] = breakgraph.is_capturing()
    g = BreakableCUDAGraph()
    with capture(g):
        seen["segment 0"] = breakgraph.is_capturing()
        y = probe(x * 2)
        seen["segment 1"] = breakgraph.is_capturing()
    seen["after"] = breakgraph.is_capturing()
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 2 + 1)

    assert seen == {
        "before": False,
        "segment 0": True,
        "eager": [False, False],  # at capture and at replay
        "segment 1": True,
        "after": False,
    }


# ---------------------------------------------------------------------------------------
# inference_mode
# ---------------------------------------------------------------------------------------


def test_capture_under_inference_mode_replays_outside_it(capture, device):
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with torch.inference_mode():
        with capture(g):
            y = double_on_host(x + 1) + 1
    new = fresh_into(x)
    g.replay()  # torch.cuda.graph allows this: replay does not involve autograd
    torch.testing.assert_close(y, (new + 1) * 2 + 1)


def test_capture_under_no_grad_replays_breaks_without_autograd(capture, device):
    """Replayed with grad enabled, a break captured under no_grad runs under no_grad again: its
    parameters' autograd would otherwise make its outputs need grad (copy-back into views made
    under no_grad then raised torch's error)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4, device=device)

    @eager_on_graph
    def project(h):
        return linear(h).chunk(2, dim=-1)  # views of a new tensor

    x = torch.randn(2, 4, device=device)
    g = BreakableCUDAGraph()
    with torch.no_grad(), capture(g):
        first, second = project(x * 1)
        out = first + second
    for _ in range(2):
        new = fresh_into(x)
        assert torch.is_grad_enabled()
        g.replay()
        with torch.no_grad():
            torch.testing.assert_close(out, sum(linear(new).chunk(2, dim=-1)))
        assert not (first.requires_grad or out.requires_grad)


@pytest.mark.parametrize("at", ["is_grad_enabled", "set_grad_enabled"])
def test_an_interrupt_as_replay_sets_up_restores_the_threads_state(
    capture, device, monkeypatch, at
):
    """replay() set the replay context, read the grad mode and turned grad off (breaks captured
    under no_grad) before its try: a KeyboardInterrupt delivered as one of those calls returned
    (Ctrl-C: Python raises it at the end of a call) left the replay's context for the thread
    (replay_context() outside any replay returned it instead of raising) and grad mode off for
    the rest of the program. Both are restored now; the next replay is right."""

    @eager_on_graph
    def scale(h):
        return h * breakgraph.replay_context()

    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with torch.no_grad(), capture(g, context=2.0):
        out = scale(x + 1) + 1
    original = getattr(torch, at)

    def interrupted(*args):
        result = original(*args)
        monkeypatch.setattr(torch, at, original)  # once
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, at, interrupted)
    with pytest.raises(KeyboardInterrupt):
        g.replay(context=3.0)
    assert torch.is_grad_enabled()
    with pytest.raises(breakgraph.ReplayError, match="no context is set"):
        breakgraph.replay_context()
    new = fresh_into(x)
    g.replay(context=3.0)
    torch.testing.assert_close(out, (new + 1) * 3 + 1)


@pytest.mark.parametrize("at", ["gc.disable", "_Capture._restore"])
def test_an_interrupt_as_a_capture_opens_or_closes_leaves_nothing_behind(
    capture, device, monkeypatch, at
):
    """Found by injecting an exception at random lines of a PrefillRunner's life: a
    KeyboardInterrupt as ``gc.disable()`` returned (before the capture's try) left the collector
    off for good; one at the start of the restore of the thread's state, after the session had
    closed (``_close`` marks itself closed first, so ``abort`` skipped it), left the capture as
    this thread's for good: every later capture on it raised "a capture is already in progress
    on this thread", and the collector stayed off. Both are undone now."""
    from breakgraph import graph as graph_module

    owner, name = (gc, "disable") if at == "gc.disable" else (graph_module._Capture, "_restore")
    original = getattr(owner, name)

    def interrupted(*args):
        monkeypatch.setattr(owner, name, original)  # once
        if owner is gc:
            original(*args)  # Ctrl-C: raised as the call returns
        raise KeyboardInterrupt

    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        with capture(g):
            y = x * 2
    assert_clean(g)
    with capture(g):  # a capture works afterwards, on this thread
        y = x * 2
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 2)
    assert_clean()


def test_breaks_captured_in_different_grad_modes_each_replay_in_their_own(capture, device):
    """One break captured under no_grad, one with grad that uses autograd: turning grad off for
    the whole replay broke the second (its autograd.grad found nothing requiring grad)."""
    weight = torch.ones(3, device=device, requires_grad=True)

    @eager_on_graph
    def scale(h):
        return h * 2

    @eager_on_graph
    def gradient(h):
        (grad,) = torch.autograd.grad((weight * h).sum(), weight)
        return grad.detach() * 1

    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        with torch.no_grad():
            doubled = scale(x * 1)
        out = gradient(doubled)
    for _ in range(2):
        new = fresh_into(x)
        g.replay()  # with grad: the first break turns it off for itself only
        torch.testing.assert_close(out, new * 2)  # d(sum(weight * h))/d(weight) = h = 2x
        assert not doubled.requires_grad


def test_breaks_replay_under_their_capture_autocast_not_the_callers(capture, device):
    """A graph captured in fp32 and replayed inside ``torch.autocast`` (an inference server's
    usual wrapper) ran its breaks in bf16: the replay raised CopyBackError for a dtype the
    function never chose, and a break that cast back (``.float()``) silently computed in bf16.
    Each break replays under the autocast it was captured under (segments never see any)."""
    kind = torch.device(device).type
    w = torch.randn(8, 8, device=device)

    @eager_on_graph
    def project(h):
        return h @ w  # fp32 at capture; bf16 under the caller's autocast

    @eager_on_graph
    def project_back(h):
        return (h @ w).float()  # fp32 either way: the precision would change silently

    @eager_on_graph
    def own_autocast(h):  # an autocast the break enters itself still applies
        with torch.autocast(kind, dtype=torch.bfloat16):
            return h @ w

    x = torch.randn(4, 8, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        a = project(x * 1)
        b = project_back(x * 1)
        c = own_autocast(x * 1)
    for _ in range(2):
        new = fresh_into(x)
        with torch.autocast(kind, dtype=torch.bfloat16):
            g.replay()
            assert torch.is_autocast_enabled(kind)  # the caller's mode is back
        torch.testing.assert_close(a, new @ w)
        assert torch.equal(b, new @ w)  # bit for bit: computed in fp32 as at capture
        assert c.dtype == torch.bfloat16

    cast = BreakableCUDAGraph()  # captured under autocast: replayed under it, also outside
    with torch.autocast(kind, dtype=torch.bfloat16), capture(cast):
        d = project_back(x * 1)
        e = project(x * 2)
    with torch.autocast(kind, dtype=torch.bfloat16):
        plain = project(x * 1)
        with capture(mixed := BreakableCUDAGraph()):
            f = project(x * 1)
            with torch.autocast(kind, enabled=False):
                h = project(x * 1)
    for _ in range(2):
        new = fresh_into(x)
        cast.replay()
        mixed.replay()
        with torch.autocast(kind, dtype=torch.bfloat16):
            expected = (new @ w).float(), new * 2 @ w, new @ w
        assert torch.equal(d, expected[0]) and torch.equal(e, expected[1])
        assert torch.equal(f, expected[2]) and f.dtype == plain.dtype == torch.bfloat16
        torch.testing.assert_close(h, new @ w)  # its break captured with autocast off
        assert h.dtype == torch.float32


def test_a_capture_reads_no_cast_the_autocast_cache_frees_later(capture, device):
    """A weight's cast that autocast cached before the capture (a warm-up in the same autocast
    region, as the docs advise) is memory the cache frees when the region ends: the graph went
    on reading it, and on CUDA its replays computed with whatever the allocator put there next
    (pytorch#71631). Captures now run with autocast's cache off, so each cast is a kernel of
    its segment. (The emulated backend holds every tensor it read: there the cache's state is
    what fails.)"""
    kind = torch.device(device).type
    lin = nn.Linear(64, 64, device=device)  # a leaf that requires grad: autocast caches its cast
    cached = []

    @eager_on_graph
    def shift(h):
        cached.append(torch.is_autocast_cache_enabled())
        return h + 1

    def f(x):
        return lin(shift(lin(x)))

    x = torch.randn(16, 64, device=device)
    g = BreakableCUDAGraph()
    with torch.no_grad():
        with torch.autocast(kind, dtype=torch.bfloat16):
            f(x)  # the warm-up caches the weight's bf16 cast
            with capture(g):
                out = f(x)
            assert torch.is_autocast_cache_enabled()  # the caller's, back
        assert cached == [True, False]
        # the region's end freed the cached cast: fill the memory it held
        junk = [torch.full((64, 64), float("nan"), dtype=torch.bfloat16, device=device)
                for _ in range(16)]  # fmt: skip
        for _ in range(2):
            new = fresh_into(x)
            g.replay()
            with torch.autocast(kind, dtype=torch.bfloat16):
                expected = f(new)
            assert not out.isnan().any()
            torch.testing.assert_close(out, expected)
    del junk
    with pytest.raises(ValueError), capture(BreakableCUDAGraph()):  # restored after a failure
        assert not torch.is_autocast_cache_enabled()
        raise ValueError("boom")
    assert_clean()


def test_a_break_entering_autocast_without_a_dtype_gets_its_captures_dtype(capture, device):
    """The caller's autocast was turned off for a break with ``enabled=False`` only, which kept
    the caller's dtype: a break entering ``torch.autocast(device)`` without a dtype computed in
    the caller's fp16 on replay, not the default bf16 (CUDA: fp16, the caller's bf16) it
    captured in, silently where it cast back (found by the modes fuzzer)."""
    kind = torch.device(device).type
    other = torch.float16 if kind == "cpu" else torch.bfloat16
    w = torch.randn(8, 8, device=device)

    @eager_on_graph
    def project(h):
        with torch.autocast(kind):  # the dtype is whatever autocast's dtype is now
            return (h @ w).float()

    x = torch.randn(4, 8, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        out = project(x * 1)
    for _ in range(2):
        new = fresh_into(x)
        with torch.autocast(kind, dtype=other):
            g.replay()
            assert torch.get_autocast_dtype(kind) == other  # the caller's, back
        assert torch.equal(out, project(new * 1))


def test_a_break_captured_with_autocast_off_keeps_the_dtype_autocast_had(capture, device):
    """A break captured inside ``torch.autocast(enabled=False)`` within an autocast of another
    dtype than the default (a model turning autocast off for one part) was recorded as "no
    autocast" and replayed with the default dtype: one re-entering ``torch.autocast(device)``
    without a dtype computed in bf16 on replay where it computed in fp16 at capture (CUDA: the
    reverse), silently where it cast back. Each break records its dtypes also where autocast
    is off (found by the modes fuzzer)."""
    kind = torch.device(device).type
    other = torch.float16 if kind == "cpu" else torch.bfloat16
    w = torch.randn(8, 8, device=device)

    @eager_on_graph
    def project(h):
        with torch.autocast(kind):  # re-enabled, in the dtype autocast has now
            return (h @ w).float()

    x = torch.randn(4, 8, device=device)
    g = BreakableCUDAGraph()
    with torch.autocast(kind, dtype=other), capture(g):
        with torch.autocast(kind, enabled=False):
            out = project(x * 1)
    for caller in (None, torch.bfloat16, torch.float16):
        new = fresh_into(x)
        with torch.autocast(kind, dtype=caller or other, enabled=caller is not None):
            g.replay()
        with torch.autocast(kind, dtype=other):
            assert torch.equal(out, project(new * 1)), caller


def test_a_break_pinned_to_another_autocast_shares_no_weight_casts_with_the_caller(capture, device):
    """Autocast caches a weight's cast (a Parameter, under no_grad too) by tensor, not dtype,
    until the outermost autocast exits: a break captured under bf16 autocast and replayed
    inside the caller's fp16 autocast left its bf16 weight to the caller's next fp16 matmul,
    or took the caller's fp16 one, and one of them raised ``expected m1 and m2 to have the same
    dtype``; also a break entering an fp16 autocast of its own under the caller's bf16. A
    pinned autocast inside the caller's caches nothing (found by the modes fuzzer). On the
    device under test: CPU operations in a CUDA capture are not replayed."""
    kind = torch.device(device).type
    w = torch.nn.Parameter(torch.randn(8, 8, device=device))

    @eager_on_graph
    def project(h):
        return (h @ w).float()

    @eager_on_graph
    def own(h):
        with torch.autocast(kind, dtype=torch.float16):
            return (h @ w).float()

    x = torch.randn(4, 8, device=device)
    g = BreakableCUDAGraph()
    with torch.no_grad(), torch.autocast(kind, dtype=torch.bfloat16), capture(g):
        out = project(x * 1)
    plain = BreakableCUDAGraph()
    with torch.no_grad(), capture(plain):
        mine = own(x * 1)
    for caller, graph, result, captured in (
        (torch.float16, g, out, torch.bfloat16),
        (torch.bfloat16, plain, mine, None),
    ):
        new = fresh_into(x)
        with torch.no_grad(), torch.autocast(kind, dtype=caller):
            before = new @ w  # the caller's cast of w, cached
            graph.replay()
            after = new @ w
        assert before.dtype == after.dtype == caller
        with torch.no_grad(), torch.autocast(kind, dtype=captured, enabled=bool(captured)):
            assert torch.equal(result, (project if captured else own)(new * 1))


# ---------------------------------------------------------------------------------------
# Graph bugs stay visible (both backends give the same wrong answer)
# ---------------------------------------------------------------------------------------

CONFIG = {"scale_positive": True}


def branchy(x):
    n = x.shape[0]  # a host int from the static input's shape
    if n > 2 and CONFIG["scale_positive"]:  # a Python branch on host values
        return x * 2
    return x * -1


def test_python_branch_is_frozen_on_replay(capture, device, monkeypatch):
    """The emulator must not hide graph bugs by re-running Python: same wrong answer as CUDA."""
    monkeypatch.setitem(CONFIG, "scale_positive", True)
    x = torch.randn(4, 3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = branchy(x)
    CONFIG["scale_positive"] = False  # eager code would now take the other branch
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 2)  # the frozen branch, as a CUDA graph gives
    assert not torch.allclose(y, branchy(new))


def test_stale_input_buffer_is_read_on_replay(capture, device):
    weight = torch.randn(3, 3, device=device)
    static = torch.randn(4, 3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        out = (static @ weight).relu() + static
    at_capture = out.clone()

    new = torch.randn(4, 3, device=device)
    # the old buffer stays alive (a second name): freed, its memory would be anyone's on CUDA,
    # and debug mode (BREAKGRAPH_DEBUG=1) would rightly report it as freed on both backends
    old = static  # noqa: F841
    static = new  # the bug: rebinding the name instead of static.copy_(new)
    g.replay()
    torch.testing.assert_close(out, at_capture)  # still computed from the old buffer
    assert not torch.allclose(out, (new @ weight).relu() + new)


fresh_process_check(
    "first matmul of the process",
    textwrap.dedent("""
        import torch, breakgraph
        x = torch.randn(16, 16, device="cuda")
        g = breakgraph.BreakableCUDAGraph()
        with breakgraph.capture(g):
            y = (x @ x).relu()
        for _ in range(3):
            x.copy_(torch.randn(16, 16, device="cuda"))
            g.replay()
            torch.testing.assert_close(y, (x @ x).relu())
    """),
    first=True,
)


@pytest.mark.requires_cuda
@pytest.mark.fresh_process
def test_first_matmul_of_the_process_inside_a_capture():
    """cuBLAS cannot create its handle inside a capture; breakgraph creates it beforehand, so a
    fresh process may capture its very first matmul (this failed with
    CUBLAS_STATUS_NOT_INITIALIZED). The process is shared with other such checks
    (``helpers.fresh_process_check``); this one runs first in it."""
    passed, output = fresh_process_result("first matmul of the process")
    assert passed, output


def test_captures_on_two_threads_take_turns(capture, device):
    """A capture started while another thread captures waits for it, then succeeds (nested
    captures on one thread still raise): two runners or managers built from two threads.

    In ``"thread_local"`` mode, as the runners capture: the first thread replays and checks
    (a sync) while the second may already capture, which the global mode forbids anywhere in
    the process: the likely cause of this test's one failure under a busy GPU
    (``BREAKGRAPH_TEST_BUSY_GPU``, docs/testing.md), where the first thread's check ran late."""
    import threading

    inside, release, order = threading.Event(), threading.Event(), []
    x = torch.randn(4, device=device)

    def first():
        g = breakgraph.BreakableCUDAGraph()
        with capture(g, capture_error_mode="thread_local"):
            y = x * 2
            order.append("first in")
            inside.set()
            release.wait(timeout=30)
            order.append("first done")  # still inside the capture (its lock held)
        g.replay()
        results["first"] = torch.equal(y, x * 2)

    def second():
        inside.wait(timeout=30)
        g = breakgraph.BreakableCUDAGraph()
        with capture(g, capture_error_mode="thread_local"):
            order.append("second in")
            z = x + 1
        g.replay()
        results["second"] = torch.equal(z, x + 1)

    results = {}
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    inside.wait(timeout=30)
    time.sleep(0.2)  # the second thread is now waiting for the lock
    assert order == ["first in"]
    release.set()
    for thread in threads:
        thread.join(timeout=30)
    assert order == ["first in", "first done", "second in"]
    assert results == {"first": True, "second": True}


def test_two_threads_capturing_into_one_graph_do_not_overwrite_each_other(capture, device):
    """Both threads pass the "already holds a capture" check while a third holds the capture
    lock; the one that gets the lock second must still be refused, not replace the first's
    capture (whose outputs would then never update on replay)."""
    import threading

    hold, inside = threading.Event(), threading.Event()
    x = torch.randn(4, device=device)
    g = breakgraph.BreakableCUDAGraph()
    outputs, errors = {}, {}

    def blocker():
        with capture(breakgraph.BreakableCUDAGraph(), capture_error_mode="thread_local"):
            inside.set()
            hold.wait(timeout=30)

    def capturer(k):
        try:
            with capture(g, capture_error_mode="thread_local"):
                outputs[k] = x * k
        except CaptureError as exc:
            errors[k] = exc

    first = threading.Thread(target=blocker)
    first.start()
    inside.wait(timeout=30)
    threads = [threading.Thread(target=capturer, args=(k,)) for k in (2, 3)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # both wait for the lock, past the first check
    hold.set()
    for thread in [first, *threads]:
        thread.join(timeout=30)
    assert len(outputs) == 1 and len(errors) == 1
    assert "already holds a capture" in str(next(iter(errors.values())))
    (k, out), = outputs.items()
    x.copy_(torch.randn(4, device=device))
    g.replay()
    torch.testing.assert_close(out, x * k)


def test_torch_refusing_a_host_copy_during_capture_is_named_a_host_sync():
    """torch's own refusal of an unpinned host copy inside a CUDA capture (e.g. fp32
    ``grouped_mm``'s fallback) becomes HostSyncError with the fix, like CUDA's capture errors."""
    from breakgraph.backends.cuda import capture_failure_error, is_capture_failure

    refusal = RuntimeError(
        "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
        "tensor is pinned. Please use tensor.pin_memory() or allocate the tensor with "
        "pin_memory=True."
    )
    assert is_capture_failure(refusal)  # on the CUDA backend only (capture() checks it)
    assert not is_capture_failure(RuntimeError("my own error about capture"))
    assert isinstance(capture_failure_error(refusal), breakgraph.HostSyncError)


def test_the_capture_state_reset_runs_on_breakgraphs_own_stream(monkeypatch):
    """After an invalidated capture, closing the capture session resets torch's RNG state with
    an empty capture on the session's own capture stream: a graph reset may free the cuBLAS
    workspaces of the stream it was captured on, and the stream every ``torch.cuda.graph``
    shares by default may hold a user's plain graphs (pytorch/pytorch#193402). Drives
    ``CudaSession.close`` with stand-ins for CUDA, on any machine."""
    import contextlib
    import types

    from breakgraph.backends import cuda

    streams, resets, waited = [], [], []

    class FakeGraph:
        def reset(self):
            resets.append(self)

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None, capture_error_mode="global"):
        streams.append(stream)
        yield

    caller = types.SimpleNamespace(wait_stream=waited.append)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: caller)
    monkeypatch.setattr(cuda, "_takes_captures", lambda pool, stream: True)
    own = object()
    session = types.SimpleNamespace(_stack=contextlib.ExitStack(), stream=own,
                                    _invalidated=True, pool=(0, 1))  # fmt: skip
    cuda.CudaSession.close(session)
    assert waited == [own] and streams == [own] and len(resets) == 1
    session._invalidated, streams[:] = False, []
    cuda.CudaSession.close(session)  # a capture CUDA did not invalidate: no reset
    assert streams == []


def test_a_break_inside_a_dispatch_mode_entered_in_the_capture_block_is_refused(capture, device):
    """A break exits the segment's dispatch mode, and torch pops the top of the mode stack: with
    a mode of the user's (FlopCounterMode, say) entered inside the block above it, the break
    popped the user's mode instead, the eager function ran under the old segment's mode (its
    host reads refused as syncs, its output taken for memory held elsewhere) and the user's mode
    stopped seeing anything. Refused naming the mode and the break (the eager function), or the
    block's end; entered around the capture block it works."""
    from torch.utils._python_dispatch import (
        TorchDispatchMode,
        _get_current_dispatch_mode,
        _get_current_dispatch_mode_stack,
    )

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    @breakgraph.eager_on_graph
    def double(t):
        return t * 2

    x = torch.ones(3, device=device)
    g = breakgraph.BreakableCUDAGraph()
    named = r"at the break '.*double' .* inside Counting, a TorchDispatchMode.*around the"
    with pytest.raises(breakgraph.CaptureError, match=named):
        with capture(g):
            with Counting():
                double(x + 1)
    assert _get_current_dispatch_mode() is None
    assert_clean(g)
    mode = Counting()
    with pytest.raises(breakgraph.CaptureError, match="at the end of the capture block inside"):
        with capture(g):
            mode.__enter__()  # never left: the last segment ends under it
            y = x + 1
    # the user's mode stays on the stack, alone (the abort popped it in place of breakgraph's,
    # whose mode then stayed for good: on torch 2.10 the user's __exit__ crashed the process)
    assert _get_current_dispatch_mode_stack() == [mode]
    mode.__exit__(None, None, None)
    assert _get_current_dispatch_mode() is None
    assert_clean(g)
    with Counting(), capture(g):  # around the block: the segments' modes stay above it
        y = double(x + 1) + 1
    x.fill_(2.0)
    g.replay()
    assert y.tolist() == [7.0] * 3
