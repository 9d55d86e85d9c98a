"""The emulated backend (CPU): CUDA-graph semantics without a GPU, bugs included."""

import contextlib
import functools
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import breakgraph
from breakgraph import BreakableCUDAGraph, HostSyncError, eager_on_graph
from breakgraph import syncs as syncs_module
from breakgraph.syncs import SYNC_OPERATIONS
from tests.helpers import HAS_CUDA, assert_clean, fresh_into

capture = functools.partial(breakgraph.capture, backend="emulated")


# ---------------------------------------------------------------------------------------
# torch.cuda.is_current_stream_capturing()
# ---------------------------------------------------------------------------------------


def test_is_current_stream_capturing_follows_segments():
    seen = {}
    probing = [True]

    @eager_on_graph
    def probe(x):
        if probing[0]:  # only during the capture: after it the CPU build's original raises
            seen["eager"] = torch.cuda.is_current_stream_capturing()
        return x * 2

    x = torch.randn(4)
    g = BreakableCUDAGraph()
    with capture(g):
        seen["segment 0"] = torch.cuda.is_current_stream_capturing()
        seen["graphs module"] = torch.cuda.graphs.is_current_stream_capturing()
        y = probe(x + 1)
        seen["segment 1"] = torch.cuda.is_current_stream_capturing()
    probing[0] = False
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, (new + 1) * 2)

    assert seen == {
        "segment 0": True,
        "graphs module": True,
        "eager": False,
        "segment 1": True,
    }
    assert_clean()
    if HAS_CUDA:
        assert torch.cuda.is_current_stream_capturing() is False
    else:  # the CPU build's own function raises, and it is the one installed again
        with pytest.raises(Exception):
            torch.cuda.is_current_stream_capturing()


def test_an_interrupt_while_the_session_patches_torch_leaves_no_patch(monkeypatch):
    """The emulated session replaces ``is_current_stream_capturing`` and the seeding functions
    when a capture opens. An interrupt (Ctrl-C) between two of those replacements left the ones
    made so far installed for good (nobody got the session to close): every later capture
    wrapped them again. The session now undoes them, as the CUDA session its hooks."""
    from breakgraph.backends import emulated

    watched = emulated._watched_seeding
    calls = []

    def interrupted(*args):
        calls.append(args)
        if len(calls) == 3:  # is_current_stream_capturing and two seeding functions patched
            raise KeyboardInterrupt
        return watched(*args)

    monkeypatch.setattr(emulated, "_watched_seeding", interrupted)
    g = BreakableCUDAGraph()
    with pytest.raises(KeyboardInterrupt):
        with capture(g):
            torch.randn(2) * 2
    assert_clean(g)
    monkeypatch.setattr(emulated, "_watched_seeding", watched)
    x = torch.randn(3)
    with capture(g):  # a capture works afterwards
        y = x * 2
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 2)
    assert_clean()


# ---------------------------------------------------------------------------------------
# Seeds: CUDA refuses a new seed on the capturing thread only
# ---------------------------------------------------------------------------------------


def test_another_threads_seed_during_a_segment_is_not_the_captures():
    """A second continuous-batching manager seeds the default generator when it starts
    (transformers' ``set_tp_seed``), maybe while another thread captures. CUDA checks only
    the capturing thread's stream, so the capture stands (it failed on CI: a false
    CaptureError turned pure-decode graphs off)."""
    import threading

    x = torch.randn(4)
    g = BreakableCUDAGraph()
    seeded = threading.Event()
    with capture(g):
        y = x * 2
        threading.Thread(target=lambda: (torch.manual_seed(1234), seeded.set())).start()
        assert seeded.wait(60)
        out = y + 1
    assert torch.initial_seed() == 1234
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(out, new * 2 + 1)
    assert_clean()


def test_another_threads_rng_state_restored_during_a_segment_is_not_the_captures():
    """Another thread samples under ``torch.random.fork_rng()`` (a server's seeded request)
    while a segment is being captured: its ``torch.manual_seed`` is counted, but the state
    ``fork_rng`` puts back on exit (``torch.set_rng_state``) changed the seed uncounted, and
    the capture failed with "seen when the segment ended". Only the capturing thread's seed is
    the capture's (CUDA checks its stream alone)."""
    import threading

    torch.manual_seed(5)
    x = torch.randn(4)
    g = BreakableCUDAGraph()
    forked, restore = threading.Event(), threading.Event()
    restored = threading.Event()

    def sample():
        with torch.random.fork_rng():
            torch.manual_seed(1234)
            forked.set()
            assert restore.wait(60)
        restored.set()

    worker = threading.Thread(target=sample)
    worker.start()
    try:
        assert forked.wait(60)
        with capture(g):  # its segment begins on seed 1234, the worker puts 5 back meanwhile
            y = x * 2
            restore.set()
            assert restored.wait(60)
            out = y + 1
    finally:
        restore.set()
        worker.join(60)
    assert torch.initial_seed() == 5
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(out, new * 2 + 1)
    assert_clean()


def test_a_seed_of_another_thread_under_way_when_a_segment_begins_is_not_the_captures(
    monkeypatch,
):
    """Another thread's ``torch.manual_seed`` was counted before the seed changed: a segment
    that began between the two (the count taken with it, the old seed) saw the new seed at its
    end with no seed counted since, and blamed itself. The seeding thread is held between the
    count and the seed, the segment begins there, then the seed goes on."""
    import threading

    real = torch.manual_seed
    counted, began, seeded = threading.Event(), threading.Event(), threading.Event()

    def manual_seed(seed):  # what the session's watcher calls: paused before seeding
        counted.set()
        assert began.wait(60)
        return real(seed)

    monkeypatch.setattr(torch, "manual_seed", manual_seed)
    torch.random.manual_seed(7)
    x = torch.randn(4)
    g = BreakableCUDAGraph()

    def seed_elsewhere():
        torch.manual_seed(1234)
        seeded.set()

    worker = threading.Thread(target=seed_elsewhere)
    try:
        with capture(g):
            worker.start()
            y = x * 2
            assert counted.wait(60)
            breakgraph.break_graph()  # segment 1 begins with the seed under way
            began.set()
            assert seeded.wait(60)
            out = y + 1
    finally:
        began.set()
        worker.join(60)
    assert torch.initial_seed() == 1234
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(out, new * 2 + 1)
    monkeypatch.undo()
    assert_clean()


@pytest.mark.parametrize(
    "reseed, named",
    [
        (lambda: torch.seed(), "torch.seed"),
        (lambda: torch.random.manual_seed(9), "torch.manual_seed"),
        (lambda: torch.default_generator.manual_seed(9), "seen when the segment ended"),
    ],
    ids=["torch.seed", "torch.random.manual_seed", "generator.manual_seed"],
)
def test_a_new_seed_on_the_capturing_thread_is_refused(reseed, named):
    """Every way to seed the default generator inside a segment fails the capture; through
    torch's functions at the call, before the seed changes; directly on the generator (no
    function to watch) when the segment ends."""
    torch.manual_seed(7)
    x = torch.randn(4)
    g = BreakableCUDAGraph()
    with pytest.raises(breakgraph.CaptureError, match=named):
        with capture(g):
            y = x * 2
            reseed()
            y + 1
    assert_clean(g)
    if named != "seen when the segment ended":
        assert torch.initial_seed() == 7


# ---------------------------------------------------------------------------------------
# Host synchronisations
# ---------------------------------------------------------------------------------------

# name -> (the sync as written in user code, the aten operation the message names,
#          the same computation as a fixed-shape function of x)
SYNC_OPS = {
    "item": (
        lambda x: x.sum().item(),
        "aten._local_scalar_dense",
        lambda x: x * x.sum().item(),
    ),
    "if tensor": (
        lambda x: 1 if x.sum() > 0 else 0,
        "aten._local_scalar_dense",
        lambda x: x * 2 if x.sum() > 0 else x * -3,
    ),
    "nonzero": (
        lambda x: torch.nonzero(x > 0),
        "aten.nonzero",
        lambda x: x + torch.nonzero(x > 0).shape[0],
    ),
    "masked_select": (
        lambda x: torch.masked_select(x, x > 0),
        "aten.masked_select",
        lambda x: x + torch.masked_select(x, x > 0).sum(),
    ),
    "unique": (
        lambda x: torch.unique(torch.round(x)),
        "aten._unique2",
        lambda x: x * torch.unique(torch.round(x)).numel(),
    ),
    "equal": (
        lambda x: torch.equal(x[:2] > 0, x[2:4] > 0),
        "aten.equal",
        lambda x: x * (5.0 if torch.equal(x[:2] > 0, x[2:4] > 0) else 0.5),
    ),
    "mask indexing": (
        lambda x: x[x > 0],
        "aten.index",
        lambda x: x + x[x > 0].sum(),
    ),
    "mask assignment": (
        # a tensor value: torch 2.15 turns `x[mask] = scalar` into masked_fill_ (no sync; the
        # test after the next one)
        lambda x: x.clone().__setitem__(x > 0, x.new_zeros(1)),
        "aten.index_put",
        lambda x: x.masked_fill(x > 0, 0.0) + 1,
    ),
}


@pytest.mark.parametrize("op", list(SYNC_OPS))
def test_host_sync_in_segment_raises(op):
    sync, aten_name, _ = SYNC_OPS[op]
    x = torch.randn(8)
    g = BreakableCUDAGraph()
    with pytest.raises(HostSyncError) as info:
        with capture(g):
            y = x * 2
            sync(y)  # the line the message must point at
    message = str(info.value)
    assert aten_name in message
    assert "@breakgraph.eager_on_graph" in message
    assert "test_emulated.py" in message  # the user line that did it
    assert_clean(g)

    with capture(g):  # a new capture works afterwards
        z = x.exp()
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(z, new.exp())


@pytest.mark.parametrize("op", list(SYNC_OPS))
def test_host_sync_in_eager_function_is_fine(op):
    _, _, compute = SYNC_OPS[op]
    eager = eager_on_graph(compute)
    x = torch.randn(8)
    g = BreakableCUDAGraph()
    with capture(g):
        y = eager(x * 3) + 1
    assert g.num_breaks == 1
    for _ in range(4):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, compute(new * 3) + 1)


# syncs that reach the dispatch mode whole under inference_mode (how the runners capture),
# not as the nonzero or masked_select inside them
WHOLE_UNDER_INFERENCE = {
    "where, one argument": lambda x: torch.where(x > 0)[0],
    "argwhere": lambda x: torch.argwhere(x > 0),
    "combinations": lambda x: torch.combinations(x[:4]),
    "nonzero, as_tuple": lambda x: torch.nonzero(x > 0, as_tuple=True)[0],  # nonzero_numpy
    "narrow, a tensor start": lambda x: torch.narrow(x, 0, (x[0] > 0).long(), 2),
}


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("op", list(SYNC_OPS) + list(WHOLE_UNDER_INFERENCE))
def test_host_syncs_are_caught_under_every_grad_mode(op, grad_mode):
    """Under inference_mode composite ops reach the mode unexpanded: where(cond) captured there
    once replayed its capture-time indices broadcast over the new ones, silently; so did
    narrow with a tensor start (its capture-time start), and nonzero(as_tuple=True) raised a
    raw RuntimeError on the first replay with another count."""
    sync = SYNC_OPS[op][0] if op in SYNC_OPS else WHOLE_UNDER_INFERENCE[op]
    if op == "combinations" and torch.ops.aten.combinations not in SYNC_OPERATIONS:
        pytest.skip("this torch builds combinations without a sync (next test)")
    x = torch.randn(8)
    g = BreakableCUDAGraph()
    with grad_mode(), pytest.raises(HostSyncError, match="test_emulated.py"):
        with capture(g):
            sync(x * 2)
    assert_clean(g)


DEVICE_TO_HOST = {
    ".cpu()": lambda t: t.cpu(),
    ".to('cpu')": lambda t: t.to("cpu"),
    ".to('cpu', dtype)": lambda t: t.to("cpu", torch.float64),
    ".to(cpu_tensor)": lambda t: t.to(torch.ones(1)),
    ".tolist()": lambda t: t.tolist(),
}


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("op", list(DEVICE_TO_HOST))
def test_a_blocking_copy_to_the_host_is_named_under_every_grad_mode(op, grad_mode):
    """The CUDA backend's check (all_devices=False; meta tensors stand for device tensors here):
    under inference_mode `.cpu()`, `.to('cpu')` and `.tolist()` reach the mode whole as aten.to,
    which the check did not know, so CUDA failed the capture later without naming the line."""
    with grad_mode():
        x = torch.ones(3, device="meta")
        with pytest.raises(HostSyncError, match="device-to-host.*test_emulated.py"):
            with syncs_module.SegmentMode(all_devices=False):
                DEVICE_TO_HOST[op](x)
        with syncs_module.SegmentMode(all_devices=False):  # no copy to the host: no sync
            x.to(torch.float64), x.to("meta"), x.to(x), x.to(torch.float64, non_blocking=True)
            torch.ones(2).to("cpu")  # a host tensor stays on the host


def test_the_combinations_probe_answers_the_same_when_breakgraph_is_imported_in_inference_mode():
    """The probe runs at import; under inference_mode composites reach a dispatch mode whole, so
    a probe that did not leave the mode would see no sync and drop combinations silently."""
    script = (
        "import torch\n"
        "with torch.inference_mode():\n"
        "    from breakgraph.syncs import SYNC_OPERATIONS\n"
        "print(torch.ops.aten.combinations in SYNC_OPERATIONS)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.stdout.strip() == str(torch.ops.aten.combinations in SYNC_OPERATIONS), run.stderr


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_mask_assignment_of_a_scalar_is_flagged_or_captured_as_this_torch_runs_it(grad_mode):
    """Up to torch 2.14 `x[mask] = 0.0` runs index_put with a bool index (nonzero inside: a
    sync); 2.15 runs masked_fill_, which needs no sync: flagged on the first, captured and
    replayed with fresh values on the second."""
    ops = syncs_module._dispatched(lambda: torch.ones(3).__setitem__(torch.ones(3) > 0, 0.0))
    packets = [str(f.overloadpacket) for f in ops]
    syncs = "aten.index_put_" in packets
    assert syncs or "aten.masked_fill_" in packets, packets
    x = torch.randn(8)
    g = BreakableCUDAGraph()

    def zero_positives(t):
        t[t > 0] = 0.0
        return t

    with grad_mode(), contextlib.ExitStack() as stack:
        if syncs:
            stack.enter_context(pytest.raises(HostSyncError, match="mask"))
        with capture(g):
            y = zero_positives(x * 2) + 1
    if syncs:
        return
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, (new * 2).clamp(max=0) + 1)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_combinations_is_a_sync_exactly_where_this_torch_makes_it_one(grad_mode):
    """torch up to 2.13 runs masked_select inside combinations (a sync); 2.14 runs
    nonzero_static (its size known). The table follows the installed torch: flagged where it
    syncs, captured and replayed with fresh values where it does not."""
    syncs = syncs_module._decomposes_into_a_sync(lambda: torch.combinations(torch.arange(3.0)))
    assert (torch.ops.aten.combinations in SYNC_OPERATIONS) == syncs
    x = torch.randn(8)
    g = BreakableCUDAGraph()
    with grad_mode(), contextlib.ExitStack() as stack:
        if syncs:
            stack.enter_context(pytest.raises(HostSyncError, match="combinations"))
        with capture(g):
            y = torch.combinations(x[:4] * 2) + 1
    if syncs:
        return
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, torch.combinations(new[:4] * 2) + 1)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_repeat_interleave_syncs_only_with_a_tensor_of_repeats(grad_mode):
    x = torch.randn(2, 3)
    g = BreakableCUDAGraph()
    with grad_mode(), capture(g):  # an int of repeats: the output size is known on the host
        y = x.repeat_interleave(2, dim=1) * 1
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new.repeat_interleave(2, dim=1))
    for sized in (False, True):
        g = BreakableCUDAGraph()
        repeats = torch.tensor([1, 2, 3])
        size = {"output_size": 6} if sized else {}
        with grad_mode(), contextlib.ExitStack() as stack:
            if not sized:
                stack.enter_context(pytest.raises(HostSyncError, match="repeat_interleave"))
            with capture(g):
                x.repeat_interleave(repeats, dim=1, **size)


def test_detect_syncs_false_lets_item_freeze():
    # Without the check the emulator records .item() like any op: the value is frozen.
    x = torch.randn(8)
    g = BreakableCUDAGraph()
    with capture(g, detect_syncs=False):
        y = x * x.sum().item()
    captured_sum = x.sum().item()
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * captured_sum)


def test_detect_syncs_false_freezes_data_dependent_shapes_too():
    """nonzero and mask indexing, let through, keep their capture-time results: they ran again
    and their new results were broadcast into the old buffers (neither eager nor frozen)."""
    x = torch.tensor([1.0, 2.0, -1.0, 3.0])
    g = BreakableCUDAGraph()
    with capture(g, detect_syncs=False):
        where = torch.nonzero(x > 0).flatten() * 10
        picked = x[x > 0] * 1
    captured = where.clone(), picked.clone()
    x.copy_(torch.tensor([-1.0, -1.0, 5.0, -1.0]))  # one positive where there were three
    g.replay()
    assert torch.equal(where, captured[0]) and torch.equal(picked, captured[1])


def test_detect_syncs_false_frozen_results_start_afresh_and_mask_writes_run():
    """A frozen result the segment updates in place starts from its capture-time values on
    every replay (it accumulated); a mask assignment, which writes its argument, runs again."""
    x = torch.tensor([1.0, -2.0, 3.0, -4.0])
    g = BreakableCUDAGraph()
    with capture(g, detect_syncs=False):
        where = torch.nonzero(x > 0).flatten()
        where.add_(1)
        clipped = x.clone()
        clipped[clipped < 0] = 0.0
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        assert where.tolist() == [1, 3]  # [0, 2] at capture, plus one, every time
        torch.testing.assert_close(clipped, new.clamp(min=0))


def test_a_tensor_over_the_callers_memory_is_read_as_it_is_at_replay():
    """torch.from_numpy / as_tensor of an array share the caller's memory: a replay reads it
    as it is then and never writes it (only torch's own copies of Python data are rewritten)."""
    import numpy as np

    host, x = np.array([1.0, 2.0, 3.0], dtype=np.float32), torch.zeros(3)
    g = BreakableCUDAGraph()
    with capture(g):
        out = x + torch.as_tensor(host)
    host[:] = [10.0, 20.0, 30.0]
    new = fresh_into(x)
    g.replay()
    assert host.tolist() == [10.0, 20.0, 30.0]
    torch.testing.assert_close(out, new + torch.tensor([10.0, 20.0, 30.0]))


# ---------------------------------------------------------------------------------------
# In-place, out=, views, random
# ---------------------------------------------------------------------------------------


def inplace_out_views(x, buf):
    y = x * 2
    y.add_(1)  # in-place
    torch.add(y, x, out=buf)  # out=
    flat = buf.view(-1)  # view
    tail = buf[1:]  # view
    tail.mul_(3)  # in-place through a view: buf changes too
    head = x[0] + flat[:4].sum()  # reads a view of the static input
    return flat * 1, head, x.t().contiguous()


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("make", [
    lambda x: torch.tensor([1.0, 2.0]),
    lambda x: torch.as_tensor([1.0, 2.0]),
    lambda x: x.new_tensor([1.0, 2.0]),
], ids=["tensor", "as_tensor", "new_tensor"])  # fmt: skip
def test_a_tensor_of_python_data_starts_from_its_values_every_replay(make, grad_mode):
    """A literal updated in place inside a segment, let through with detect_syncs=False (it is
    a host sync: a copy from pageable host memory on CUDA): each replay writes its values
    again, as a frozen result does (they accumulated over replays, an answer neither eager
    code nor a GPU gives)."""
    x = torch.zeros(2)
    g = BreakableCUDAGraph()
    with grad_mode(), capture(g, detect_syncs=False):
        literal = make(x)
        literal += x
        out = literal * 1
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(out, torch.tensor([1.0, 2.0]) + new)


def test_in_place_out_and_views_replay():
    x = torch.randn(4, 3)
    buf = torch.randn(4, 3)
    g = BreakableCUDAGraph()
    with capture(g):
        flat, head, xt = inplace_out_views(x, buf)
    for _ in range(4):
        new = fresh_into(x)
        g.replay()
        expected = inplace_out_views(new, torch.empty_like(buf))
        torch.testing.assert_close(flat, expected[0])
        torch.testing.assert_close(head, expected[1])
        torch.testing.assert_close(xt, expected[2])
        torch.testing.assert_close(buf.view(-1), expected[0])


@pytest.mark.parametrize("where", ["read", "made"])
def test_a_sparse_tensor_in_a_segment_is_refused_by_name(where):
    """A segment reading or making a sparse tensor failed with torch's raw NotImplementedError
    about as_strided (the recording takes strided aliases). The emulated backend cannot replay
    it at frozen addresses: CaptureError naming the operation, the tensor and the fixes; the
    capture fails even when the block catches it, and nothing is left behind."""
    adjacency, x = torch.eye(3).to_sparse(), torch.randn(3, 2)
    g = BreakableCUDAGraph()
    with pytest.raises(breakgraph.CaptureError) as info:
        with capture(g):
            if where == "read":
                torch.sparse.mm(adjacency, x * 1)
            else:
                (x > 0).float().to_sparse()
    message = str(info.value)
    assert "sparse tensor" in message and "torch.sparse_coo" in message
    assert ("argument 1" if where == "read" else "its output") in message  # _sparse_addmm
    assert ".to_dense()" in message and "@breakgraph.eager_on_graph" in message
    assert "test_emulated.py" in message
    assert_clean(g)
    with pytest.raises(breakgraph.CaptureError, match="sparse tensor"):
        with capture(g):
            with contextlib.suppress(breakgraph.CaptureError):  # caught inside: still fails
                torch.sparse.mm(adjacency, x * 1)
    assert_clean(g)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("where", ["read", "made"])
def test_a_compressed_sparse_tensor_in_a_segment_is_refused_by_name(where):
    """The same for CSR: torch refuses its recording with a RuntimeError (it has no strides),
    not the NotImplementedError of COO, which escaped raw."""
    adjacency, x = torch.eye(3).to_sparse_csr(), torch.randn(3, 2)
    g = BreakableCUDAGraph()
    with pytest.raises(breakgraph.CaptureError, match="sparse tensor.*torch.sparse_csr"):
        with capture(g):
            if where == "read":
                adjacency @ (x * 1)
            else:
                (x > 0).float().to_sparse_csr()
    assert_clean(g)


def test_random_ops_draw_fresh_numbers_each_replay():
    x = torch.randn(1000)
    dropout = nn.Dropout(p=0.5).train()
    g = BreakableCUDAGraph()
    with capture(g):
        r = torch.rand_like(x)
        d = dropout(x) + 0
        f = F.dropout(x, p=0.25, training=True) * 1
    draws = [(r.clone(), d.clone(), f.clone())]
    for _ in range(2):
        g.replay()
        draws.append((r.clone(), d.clone(), f.clone()))
    for (r1, d1, f1), (r2, d2, f2) in zip(draws, draws[1:]):
        assert not torch.equal(r1, r2)
        assert not torch.equal(d1 == 0, d2 == 0)  # another mask
        assert not torch.equal(f1 == 0, f2 == 0)
    for r_, d_, f_ in draws:
        assert ((r_ >= 0) & (r_ < 1)).all()
        assert torch.all((d_ == 0) | torch.isclose(d_, x * 2))  # kept values scaled by 1/(1-p)
        assert torch.all((f_ == 0) | torch.isclose(f_, x / 0.75))
        assert 0.35 < (d_ == 0).float().mean() < 0.65


# ---------------------------------------------------------------------------------------
# The emulator reproduces graph bugs instead of hiding them
# ---------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------
# A tiny HuggingFace model
# ---------------------------------------------------------------------------------------


@pytest.mark.transformers
@torch.no_grad()
def test_tiny_llama_logits_match_eager():
    transformers = pytest.importorskip("transformers")
    from benchmarks.tiny_models import TINY_SHAPE

    config = transformers.LlamaConfig(vocab_size=128, **TINY_SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.eval()
    static_ids = torch.randint(0, 128, (2, 16))
    model(input_ids=static_ids, use_cache=False)  # warm up

    g = BreakableCUDAGraph()
    with capture(g):
        logits = model(input_ids=static_ids, use_cache=False).logits
    assert logits.shape == (2, 16, 128)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16))
        static_ids.copy_(ids)
        g.replay()
        expected = model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
