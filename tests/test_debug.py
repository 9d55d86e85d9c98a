"""Debug mode, the coverage report, testing helpers, the pytest plugin and logging."""

import logging
import warnings

import pytest
import torch

import breakgraph
from breakgraph import (
    BreakableCUDAGraph,
    BreakgraphWarning,
    HostSyncError,
    InputError,
    StaleTensorError,
    eager_on_graph,
)
from breakgraph.debug import InputWatch
from breakgraph.runner import BucketedRunner
from breakgraph.testing import assert_replay_matches_eager
from tests.helpers import fresh_into


@eager_on_graph
def host_scale(x):
    return x * float((x > 0).float().mean().item() + 1)


def model(x, w):
    return host_scale(torch.relu(x @ w)) @ w


# -- 1. host syncs: stop at the line, name the function to mark ------------------------------------
def planted_sync(x):
    y = x * 2
    return y * y.sum().item()  # the planted host sync


def test_host_sync_names_line_and_function(capture, device):
    x = torch.randn(8, device=device)
    with pytest.raises(HostSyncError) as info:
        with capture(BreakableCUDAGraph(), debug=True):
            planted_sync(x)
    message = str(info.value)
    assert "test_debug.py" in message and "planted host sync" in message
    assert "Decorate `planted_sync`" in message


# -- 2. tensors the graph reads must stay alive at their captured address --------------------------
def test_replaced_static_input_is_named(capture, device):
    x, w = torch.randn(4, 8, device=device), torch.randn(8, 8, device=device)
    g = BreakableCUDAGraph()
    with capture(g, debug=True):
        y = model(x, w)
    for _ in range(2):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, model(new, w), atol=1e-4, rtol=1e-4)
    x.set_(torch.randn(4, 8, device=device))  # the planted bug: new storage, graph keeps the old
    with pytest.raises(StaleTensorError) as info:
        g.replay()
    message = str(info.value)
    assert "segment 0" in message and "moved to new memory" in message
    assert "shape=(4, 8)" in message and "aten.mm" in message and "test_debug.py" in message


@pytest.mark.parametrize("replace", ["rebind-data", "half"])
def test_replaced_parameter_after_capture_is_named(capture, device, replace):
    lin = torch.nn.Linear(8, 8).to(device)
    x = torch.randn(2, 8, device=device)
    g = BreakableCUDAGraph()
    with torch.no_grad(), capture(g, debug=True):
        y = host_scale(lin(x)) + 1
    g.replay()
    if replace == "rebind-data":
        lin.weight.data = torch.randn(8, 8, device=device)  # e.g. reloading weights by rebinding
    else:
        lin.half()  # a dtype change converts every parameter into new memory
    with pytest.raises(StaleTensorError, match=r"moved to new memory.*shape=\(8, 8\)"):
        g.replay()


def test_resized_break_argument_is_named(capture, device):
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with capture(g, debug=True):
        y = host_scale(x) * 3  # x crosses the break as an argument
    g.replay()
    x.resize_(2)
    with pytest.raises(StaleTensorError, match="host_scale"):
        g.replay()


@eager_on_graph
def sparse_propagate(adjacency, h):
    return torch.sparse.mm(adjacency, h)


def test_a_sparse_break_argument_updated_by_copy_replays_in_debug_mode(capture, device):
    """A sparse tensor has no storage (nor data_ptr): the watch of a break's arguments read
    its data_ptr first and raised torch's raw RuntimeError. The eager function gets the sparse
    tensor itself on every replay, so its parts refilled in place or replaced by ``copy_``
    (new indices and values: the usual update) both replay right, and debug mode, which first
    named the replaced ones, now lets them be."""
    adjacency = torch.eye(3, device=device).to_sparse()
    x = torch.randn(3, 2, device=device)
    g = BreakableCUDAGraph()
    with capture(g, debug=True):
        y = sparse_propagate(adjacency, x * 1) + 1
    adjacency._values().mul_(2)  # in place
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 2 + 1)
    adjacency.copy_(torch.eye(3, device=device).to_sparse() * 3)  # new indices and values
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 3 + 1)


def test_a_segment_reading_a_sparse_tensor_is_watched_by_its_parts():
    """The CUDA path of debug mode (the emulated backend refuses sparse tensors in segments
    before its watch sees them): a segment's sparse input made the watch raise torch's raw
    RuntimeError (data_ptr of a tensor without storage). Its indices and values are watched."""
    watch = InputWatch()
    adjacency, x = torch.eye(3).to_sparse(), torch.randn(3, 2)
    out = torch.sparse.mm(adjacency, x)
    watch.observe(torch.ops.aten._sparse_mm.default, (adjacency, x), {}, out)
    check = watch.checker(0)
    check()
    adjacency.copy_(torch.eye(3).to_sparse() * 2)  # its values replaced: the graph reads the old
    with pytest.raises(StaleTensorError, match="segment 0 reads a tensor that was freed"):
        check()


def capture_over_a_temporary_view(capture, buf, w):
    """Capture ``model`` over a fresh view of ``buf`` that dies right after, the way transformers'
    continuous batching hands its model a new view of its live static buffer on every step."""
    g = BreakableCUDAGraph()
    view = buf[:4]
    with capture(g, debug=True):
        y = model(view, w)
    del view
    return g, y


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_temporary_view_of_a_live_refilled_buffer_replays(capture, device, inference):
    """The view object is gone but the memory the graph reads is alive and refilled: no error.
    Inference tensors' views carry no ``_base``, so only their storage tells that."""
    with torch.inference_mode(inference):
        buf = torch.randn(16, 8, device=device)
        w = torch.randn(8, 8, device=device)
        g, y = capture_over_a_temporary_view(capture, buf, w)
        for _ in range(3):
            new = torch.randn(4, 8, device=device)
            buf[:4].copy_(new)  # refilled through yet another fresh view
            g.replay()
            torch.testing.assert_close(y, model(new, w), atol=1e-4, rtol=1e-4)


def test_replaced_buffer_behind_a_dead_view_is_named(capture, device):
    """The view died, its base lives on: replacing the base's storage is the user's bug."""
    buf, w = torch.randn(16, 8, device=device), torch.randn(8, 8, device=device)
    g, _ = capture_over_a_temporary_view(capture, buf, w)
    g.replay()
    buf.set_(torch.randn(16, 8, device=device))  # the planted bug: refills now miss the graph
    with pytest.raises(StaleTensorError) as info:
        g.replay()
    message = str(info.value)
    assert "segment 0" in message and "moved to new memory" in message
    assert "view of a tensor" in message
    assert "shape=(4, 8)" in message and "aten.mm" in message and "test_debug.py" in message


def test_reallocated_buffer_behind_a_dead_inference_view_is_named(capture, device):
    """No ``_base`` to follow: the storage itself shows that its memory moved."""
    with torch.inference_mode():
        buf, w = torch.randn(16, 8, device=device), torch.randn(8, 8, device=device)
        g, _ = capture_over_a_temporary_view(capture, buf, w)
        g.replay()
        buf.resize_(1024, 8)  # the storage grows: reallocated, the graph reads the old memory
        with pytest.raises(StaleTensorError) as info:
            g.replay()
    message = str(info.value)
    assert "moved to new memory" in message and "shape=(4, 8)" in message


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_freed_buffer_behind_a_dead_view_is_named(capture, device, inference):
    """Nothing but the user holds the memory a graph reads (the emulated backend holds what it
    did not make weakly in debug mode, .backends.weak_inputs): freeing it is seen."""
    with torch.inference_mode(inference):
        buf, w = torch.randn(16, 8, device=device), torch.randn(8, 8, device=device)
        g, _ = capture_over_a_temporary_view(capture, buf, w)
        g.replay()
        del buf
        synchronize(device)
        with pytest.raises(StaleTensorError, match=r"was freed.*shape=\(4, 8\)"):
            g.replay()


def test_freed_input_is_named(capture, device):
    w = torch.randn(8, 8, device=device)
    x = torch.randn(4, 8, device=device)
    g = BreakableCUDAGraph()
    with capture(g, debug=True):
        y = torch.relu(x @ w)
    del x  # the graph does not own its inputs: the memory is free for anyone now
    synchronize(device)
    with pytest.raises(StaleTensorError, match="was freed"):
        g.replay()


def test_a_dropped_static_input_is_named_in_debug_mode_only():
    """Without debug mode the emulated graph keeps reading the input's last values (on CUDA:
    whatever the allocator put there); in debug mode it holds the input weakly, so the drop
    is seen before the segment that reads it."""
    results = {}
    for debug in (False, True):
        x, w = torch.randn(4, 8), torch.randn(8, 8)
        g = BreakableCUDAGraph()
        with breakgraph.capture(g, backend="emulated", debug=debug):
            y = torch.relu(x @ w) + x.sum(0)
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, torch.relu(new @ w) + new.sum(0))
        del w  # the planted bug: only the graph reads the weight now
        try:
            g.replay()
            results[debug] = "replayed"
        except StaleTensorError as exc:
            results[debug] = str(exc)
    assert results[False] == "replayed"
    assert "segment 0 reads a tensor that was freed" in results[True]
    assert "shape=(8, 8)" in results[True] and "test_debug.py" in results[True]


def test_a_break_that_stores_a_new_tensor_the_next_segment_reads_is_named():
    """A break that puts a new tensor in a global on every replay frees the one captured: the
    next segment reads freed memory on CUDA. Debug mode names it on the emulated backend too."""
    store = {}

    @eager_on_graph
    def publish(x):
        store["scaled"] = x * 2  # a new tensor each call: the captured one is freed on replay

    x = torch.randn(4)
    g = BreakableCUDAGraph()
    with breakgraph.capture(g, backend="emulated", debug=True):
        publish(x)
        y = store["scaled"] + 1
    fresh_into(x)
    with pytest.raises(StaleTensorError, match="segment 1 reads a tensor that was freed"):
        g.replay()


def test_a_cast_the_autocast_cache_freed_is_named(monkeypatch):
    """With the capture's own fix undone (autocast's cache left on), the segment reads the
    weight's cast that the cache cached in the warm-up and frees when the region ends (a CUDA
    graph then reads whatever the allocator put there): debug mode names it on the emulated
    backend too."""
    lin = torch.nn.Linear(16, 16)  # a leaf that requires grad: autocast caches its cast
    x = torch.randn(4, 16)
    g = BreakableCUDAGraph()
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x)  # the warm-up caches the cast
            monkeypatch.setattr(torch, "set_autocast_cache_enabled", lambda enabled: None)
            with breakgraph.capture(g, backend="emulated", debug=True):
                lin(x)
            monkeypatch.undo()
        fresh_into(x)
        with pytest.raises(StaleTensorError, match=r"was freed.*bfloat16"):
            g.replay()


def test_debug_mode_writes_into_memory_it_holds_weakly_and_keeps_scalars():
    """A segment writing a cache it did not make writes the same memory on every debug replay;
    a Python number torch made into a tensor only the operation holds is kept."""
    cache, step, dest = torch.zeros(4, 8), torch.tensor(0.5), torch.zeros(8)
    x = torch.randn(4, 8)
    g = BreakableCUDAGraph()
    with breakgraph.capture(g, backend="emulated", debug=True):
        cache[1:3].add_(torch.where(x[1:3] > 0, x[1:3], 0.0) * step)
        torch.mul(cache[2], 3, out=dest)
    for _ in range(2):
        before, new = cache.clone(), fresh_into(x)
        g.replay()
        expected = before.clone()
        expected[1:3] += torch.where(new[1:3] > 0, new[1:3], 0.0) * 0.5
        torch.testing.assert_close(cache, expected)
        torch.testing.assert_close(dest, expected[2] * 3)


def test_a_weak_alias_names_its_operation_once_the_memory_is_freed():
    """What the input check did not see first: the replay step itself refuses freed memory."""
    from breakgraph.backends.weak_inputs import WeakAlias

    x = torch.randn(4, 8)
    alias = WeakAlias(x[1:3], torch.ops.aten.mm.default)
    assert alias.tensor().data_ptr() == x[1:3].data_ptr() and alias.tensor().shape == (2, 8)
    del x
    with pytest.raises(StaleTensorError, match=r"aten.mm.default in a replayed segment.*freed"):
        alias.tensor()


def test_debug_off_pays_nothing(capture, device):
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, 8, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        model(x, w)
    # the replay steps are exactly the segments' replays and the breaks' replays
    c = g._captured
    expected = (c.segments[0].replay, c.breaks[0].replay, c.segments[1].replay)
    assert c.steps == expected
    x.set_(torch.randn(4, 8, device=device))
    g.replay()  # no check: the documented cost of turning debug mode off


def test_environment_variable_turns_debug_on(capture, device, monkeypatch):
    monkeypatch.setenv("BREAKGRAPH_DEBUG", "1")
    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = x.exp()
    x.set_(torch.randn(3, device=device))
    with pytest.raises(StaleTensorError):
        g.replay()


# -- 3. unjoined side streams are named (CUDA) -----------------------------------------------------
@pytest.mark.requires_cuda
def test_unjoined_side_stream_is_named():
    x = torch.randn(1 << 16, device="cuda")
    side = torch.cuda.Stream(priority=-1)  # another pool than the capture stream's
    g = BreakableCUDAGraph()
    with pytest.warns(BreakgraphWarning, match="not joined"):
        with breakgraph.capture(g, backend="cuda", debug=True):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                y = x * 2
            z = host_scale(x)  # the segment ends here with `side` unjoined
            torch.cuda.current_stream().wait_stream(side)
            out = y + z
    assert 0 in g.report().unjoined_streams
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(out, new * 2 + host_scale(new))


# -- 4. the whole region as one eager break, through the same runner -------------------------------
def test_eager_region_runs_everything_in_one_break(backend, device):
    w = torch.randn(8, 8, device=device)
    runner = BucketedRunner(
        lambda x: torch.relu(x @ w) * 2,
        (4, 16),
        (torch.randn(1, 8, device=device),),
        backend=backend,
        eager_region=True,
        warmup=1,
    )
    assert runner.graph(16).num_breaks == 1 and runner.graph(16).report().segment_ops == [0, 0]
    x = torch.randn(11, 8, device=device)
    torch.testing.assert_close(runner(x), torch.relu(x @ w) * 2)


# -- coverage report -------------------------------------------------------------------------------
def test_report_lists_segments_breaks_and_host_time(capture, device):
    x, w = torch.randn(4, 8, device=device), torch.randn(8, 8, device=device)
    g = BreakableCUDAGraph()
    with capture(g, debug=True):
        y = model(x, w)
        breakgraph.break_graph()
        y = y + 1
    for _ in range(3):
        fresh_into(x)
        g.replay()
    report = g.report()
    assert report.break_names == ["host_scale", "break_graph"]
    assert (
        len(report.segment_ops) == 3 and report.segment_ops[0] >= 2 and report.segment_ops[2] == 1
    )
    assert report.break_host_us[0] is not None and report.break_host_us[0] > 0
    assert report.break_host_us[1] is None  # break_graph runs nothing
    text = str(report)
    assert "host_scale" in text and "us/replay" in text and "aten ops" in text
    if device == "cuda":
        assert report.graph_memory_bytes > 0
    else:
        assert report.graph_memory_bytes is None


@pytest.mark.requires_cuda
def test_nvtx_ranges_name_every_segment_and_break(monkeypatch):
    """A profiler timeline shows the structure: one NVTX range per segment and per break."""
    ranges = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda label: ranges.append(("push", label)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: ranges.append(("pop", None)))
    x, w = torch.randn(4, 8, device="cuda"), torch.randn(8, 8, device="cuda")
    g = BreakableCUDAGraph()
    with breakgraph.capture(g, backend="cuda", debug=True):
        y = model(x, w)
    ranges.clear()
    fresh_into(x)
    g.replay()
    labels = [label for kind, label in ranges if kind == "push"]
    assert labels == ["segment 0", "break 0: host_scale", "segment 1"], ranges
    assert [kind for kind, _ in ranges] == ["push", "pop"] * 3
    torch.testing.assert_close(y, model(x, w))


def test_report_without_debug_has_no_timings(capture, device):
    x = torch.randn(4, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        host_scale(x)
    assert g.report().break_host_us == [None]
    assert "not timed: debug mode is off, or the break is empty" in str(g.report())
    with pytest.raises(breakgraph.ReplayError):
        BreakableCUDAGraph().report()
    with capture(g := BreakableCUDAGraph(), debug=True):  # an empty break runs nothing to time
        y = x * 2
        breakgraph.break_graph()
        y = y + 1
    assert "not timed: debug mode is off, or the break is empty" in str(g.report())


# -- testing helpers -------------------------------------------------------------------------------
def test_assert_replay_matches_eager_passes_on_good_code(backend, device):
    w = torch.randn(8, 8, device=device)
    graph = assert_replay_matches_eager(
        lambda x: {"out": model(x, w), "aux": (x.sum(0),)},
        lambda: (torch.randn(4, 8, device=device),),
        backend=backend,
        replays=4,
        atol=1e-4,
        rtol=1e-4,
    )
    assert graph.num_breaks == 1


@pytest.mark.parametrize(
    "bad, phrase",
    [(dict(replays=0), "replays must be an int >= 1"), (dict(replays="3"), "replays must be"),
     (dict(warmup=-1), "warmup must be an int >= 0"), (dict(make_inputs=None), "make_inputs"),
     (dict(fn=3), "fn"), (dict(atol="1e-3"), "atol must be a real number"),
     (dict(rtol=-1e-3), r"rtol must be a real number >= 0"),
     (dict(equal_nan="yes"), "equal_nan must be True or False")],
)  # fmt: skip
def test_assert_replay_matches_eager_refuses_bad_arguments(bad, phrase):
    """replays=0 passed without comparing anything (a check that checks nothing), replays='3'
    and an argument that is not callable raised raw TypeErrors, warmup=-1 was taken as 0."""
    arguments = {"fn": lambda x: x * 2, "make_inputs": lambda: torch.randn(3), **bad}
    with pytest.raises(InputError, match=f"assert_replay_matches_eager: {phrase}"):
        assert_replay_matches_eager(arguments.pop("fn"), arguments.pop("make_inputs"),
                                    backend="emulated", **arguments)  # fmt: skip


def test_assert_replay_matches_eager_catches_a_stale_buffer(backend, device):
    state = {"bias": torch.randn(8, device=device)}

    def fn(x):
        return {"out": x + 1, "biased": (x * 2, x + state["bias"])}

    def make_inputs():
        state["bias"] = torch.randn(8, device=device)  # the bug: rebinding, not copy_
        return (torch.randn(8, device=device),)

    with pytest.raises(
        AssertionError, match=r"replay 0: output\['biased'\]\[1\] differs from eager"
    ):
        assert_replay_matches_eager(fn, make_inputs, backend=backend)


def test_assert_replay_matches_eager_catches_a_frozen_branch(backend, device):
    calls = {"n": 0}

    def fn(x):
        calls["n"] += 1
        return x * 2 if calls["n"] % 2 else x * 3  # a host decision that eager code re-takes

    with pytest.raises(AssertionError, match="replay"):
        assert_replay_matches_eager(fn, lambda: torch.randn(4, device=device), backend=backend)


def test_assert_replay_matches_eager_catches_a_stale_buffer_in_a_long_lived_output(backend, device):
    """An output in a buffer that outlives the call (a static cache): the eager run writes the
    buffer too, so the graph's output is copied before it runs, or the helper compares the
    buffer with itself and passes a wrong graph."""
    buffer, scale = torch.zeros(4, device=device), {"t": torch.ones(4, device=device)}

    def fn(x):
        buffer.copy_(x * scale["t"])
        scale["t"] = scale["t"] + 1  # the bug: the graph keeps reading the first tensor
        return buffer

    with pytest.raises(AssertionError, match="replay 0: output differs from eager"):
        assert_replay_matches_eager(fn, lambda: torch.randn(4, device=device), backend=backend)


@pytest.mark.parametrize("second", [
    (torch.randn(2),),  # a list of two tensors, then a tensor
    ([torch.randn(2)],),  # a shorter list
    ({"b": torch.randn(2)},),  # other keys
], ids=["type", "length", "keys"])  # fmt: skip
def test_assert_replay_matches_eager_names_a_changed_input_structure(second):
    draws = iter([([torch.randn(2), torch.randn(2)],)] * 1 + [second])
    if isinstance(second[0], dict):
        draws = iter([({"a": torch.randn(2)},), second])
    with pytest.raises(AssertionError, match=r"make_inputs\(\) changed input\[0\].*same structure"):
        assert_replay_matches_eager(lambda v: v, lambda: next(draws), backend="emulated")


def test_assert_replay_matches_eager_names_a_changed_shape_and_a_changed_output():
    """A draw of another shape is named as the input that changed; an output whose type or
    Python value the frozen graph cannot follow is named by its path and both values."""
    draws = iter([torch.randn(3), torch.randn(4)])
    with pytest.raises(AssertionError, match=r"make_inputs\(\) changed input\[0\]: .*same shapes"):
        assert_replay_matches_eager(lambda x: x * 2, lambda: next(draws), backend="emulated")
    calls = {"n": 0}

    def counted(x):  # a Python value decided at capture: the replay keeps the capture's
        calls["n"] += 1
        return x * 2, calls["n"]

    with pytest.raises(AssertionError, match=r"replay 0: output\[1\]: replay gave 2, eager 3"):
        assert_replay_matches_eager(counted, lambda: torch.randn(3), backend="emulated")

    def shaped(x):  # the output's container decided at capture
        calls["n"] += 1
        return (x * 2,) if calls["n"] <= 2 else [x * 2]

    calls["n"] = 0
    with pytest.raises(AssertionError, match="output: replay gave tuple of length 1, eager list"):
        assert_replay_matches_eager(shaped, lambda: torch.randn(3), backend="emulated")

    def dropped(x):  # a tensor at capture, None later
        calls["n"] += 1
        return x * 2 if calls["n"] <= 2 else None

    calls["n"] = 0
    with pytest.raises(AssertionError, match="output: replay gave tensor"):
        assert_replay_matches_eager(dropped, lambda: torch.randn(3), backend="emulated")

    def appeared(x):  # None at capture, a tensor later
        calls["n"] += 1
        return None if calls["n"] <= 2 else x * 2

    calls["n"] = 0
    with pytest.raises(AssertionError, match="output: replay gave NoneType None, eager a tensor"):
        assert_replay_matches_eager(appeared, lambda: torch.randn(3), backend="emulated")


def test_assert_replay_matches_eager_takes_expanded_inputs():
    """The first draw is copied into dense static inputs: an expanded draw (stride 0) cannot be
    written into, and the caller's tensors are left as they were."""
    first = torch.randn(1, 3).expand(4, 3)
    draws = iter([(first,)] + [(torch.randn(1, 3).expand(4, 3),) for _ in range(3)])
    kept = first.clone()
    assert_replay_matches_eager(lambda x: x * 2, lambda: next(draws), backend="emulated")
    assert torch.equal(first, kept)


def test_replay_matches_eager_keeps_inputs_that_share_memory_shared(backend, device):
    """A buffer and a view of it: the static inputs share memory as the draws do, so an
    in-place write to one shows in the other in the graph as in eager (each input cloned
    alone, a correct program was reported as differing from eager)."""

    def make_inputs():
        cache = torch.randn(4, device=device)
        return cache, cache[:2]

    def fn(cache, head):
        cache.mul_(2)
        return head + 1

    assert_replay_matches_eager(fn, make_inputs, backend=backend)
    x = torch.randn(3, device=device)  # and the same tensor twice
    assert_replay_matches_eager(lambda a, b: a.add_(1) + b, lambda: (x.clone(),) * 2,
                                backend=backend)  # fmt: skip


# -- plugin and logging ----------------------------------------------------------------------------
@pytest.mark.requires_cuda
def test_requires_cuda_marker_skips_without_a_gpu():
    assert torch.cuda.is_available()  # only ever runs with a GPU


def test_requires_cuda_skips_only_the_marked_tests(tmp_path):
    """The plugin reads the marker itself: a test whose parametrize id or folder is named
    requires_cuda (an item's keywords hold those too) is not skipped."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "requires_cuda").mkdir()
    (tmp_path / "requires_cuda" / "test_in_folder.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "test_ids.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("mode", ["requires_cuda", "cpu"])
        def test_modes(mode):
            pass

        @pytest.mark.requires_cuda
        def test_marked():
            pass
    """))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    expected = "4 passed" if torch.cuda.is_available() else "3 passed, 1 skipped"
    assert expected in result.stdout, result.stdout + result.stderr


def test_backend_fixture(breakgraph_backend):
    assert breakgraph_backend == ("cuda" if torch.cuda.is_available() else "emulated")


def test_nothing_is_printed_by_default(capsys, backend, device):
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("breakgraph").handlers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BucketedRunner(lambda x: x * 2, (4,), (torch.randn(1, device=device),), backend=backend)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_runner_logs_captures_on_the_breakgraph_logger(caplog, backend, device):
    with caplog.at_level(logging.INFO, logger="breakgraph"):
        BucketedRunner(lambda x: x * 2, (4,), (torch.randn(1, device=device),), backend=backend)
    assert any("(size 4)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value, on", [("1", True), ("ON", True), (" yes ", True), ("true", True),
                                       ("", False), ("0", False), ("off", False), ("No", False)])
def test_the_debug_variable_reads_the_usual_words(monkeypatch, value, on):
    """``BREAKGRAPH_DEBUG=off`` turned debug mode on (only "", 0, false and no counted as off)."""
    from breakgraph.debug import debug_enabled

    monkeypatch.setenv("BREAKGRAPH_DEBUG", value)
    assert debug_enabled(None) is on


def test_debug_values_that_are_not_a_yes_or_no_are_refused(monkeypatch):
    """``debug="no"`` turned debug mode on (``bool("no")``), and an unknown word in
    ``BREAKGRAPH_DEBUG`` turned it on as well: both are refused, naming what to write."""
    monkeypatch.setenv("BREAKGRAPH_DEBUG", "of")
    match = "breakgraph.capture: BREAKGRAPH_DEBUG='of'.*1, true, yes or on"
    with pytest.raises(breakgraph.InputError, match=match):
        with breakgraph.capture(breakgraph.BreakableCUDAGraph(), backend="emulated"):
            pass
    monkeypatch.delenv("BREAKGRAPH_DEBUG")
    for flag in ("no", 1, "False"):  # named by the function (it was "debug='no': ...")
        with pytest.raises(breakgraph.InputError,
                           match=rf"breakgraph.capture: debug must be True, False or None .*, "
                                 rf"got {flag!r}"):  # fmt: skip
            with breakgraph.capture(breakgraph.BreakableCUDAGraph(), backend="emulated",
                                    debug=flag):  # fmt: skip
                pass
        with pytest.raises(breakgraph.InputError, match=r"BucketedRunner: debug must be"):
            BucketedRunner(lambda x: x, (4,), (torch.zeros(1),), backend="emulated", debug=flag)
    x = torch.randn(3)
    g = breakgraph.BreakableCUDAGraph()
    with breakgraph.capture(g, backend="emulated", debug=False):  # the capture still works
        y = x * 2
    x.copy_(torch.randn(3))
    g.replay()
    assert torch.equal(y, x * 2)
