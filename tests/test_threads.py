"""Thread safety of the core on the emulated backend, used the way a server uses it.

Several threads capture and replay graphs of their own at once (captures take turns on the
process-wide lock), read the stats of a ladder another thread is capturing into, and open
blocks that patch process-wide functions in any order. Where an interleaving is needed, a
thread is paused at the exact point by a hook, so that the test fails the same way every time
without the fix; the integration's own thread tests are in ``test_continuous_batching.py``.
"""

import contextlib
import threading
import warnings

import pytest
import torch

import breakgraph
from breakgraph import distributed
from breakgraph.errors import BreakgraphWarning
from breakgraph.ladder import GraphLadder
from breakgraph.ladder_stats import BucketStats, combined
from breakgraph.runner import BucketedRunner
from tests.helpers import assert_clean, run_threads


def capturing_now() -> bool:
    """``torch.cuda.is_current_stream_capturing()`` as a library asks it (torch's CPU build
    raises outside breakgraph's capture)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


@breakgraph.eager_on_graph
def scale_by_context(h):
    return h * breakgraph.replay_context()["scale"]


def test_threads_capture_and_replay_their_own_graphs_at_once():
    """Four threads, each capturing a graph (plain, or in debug mode) and replaying it with its
    own contexts while the others capture (their segments record on their threads only) and
    replay: every replay equals the eager function, a thread sees itself capturing only inside
    its own segments (breakgraph.is_capturing and the patched torch function), and nothing is
    left installed afterwards."""
    seen = set()
    start = threading.Barrier(4, timeout=60)

    def serve(seed):
        numbers = torch.Generator().manual_seed(seed)  # its own: see the docstring
        w = torch.randn(8, 8, generator=numbers)

        def model(x):
            h = torch.tanh(x @ w)
            seen.add((breakgraph.is_capturing(), capturing_now()))
            return (scale_by_context(h) @ w).relu()

        for _ in range(6):
            x = torch.randn(4, 8, generator=numbers)
            g = breakgraph.BreakableCUDAGraph()
            start.wait()  # every thread captures at once: they take turns on the lock
            with breakgraph.capture(g, backend="emulated", context={"scale": 1.0},
                                    debug=seed % 2 == 1):  # fmt: skip
                out = model(x)
            for step in range(4):
                fresh, scale = torch.randn(4, 8, generator=numbers), float(seed + step)
                x.copy_(fresh)
                g.replay(context={"scale": scale})
                with breakgraph.context_scope({"scale": scale}):
                    expected = model(fresh)
                torch.testing.assert_close(out, expected)
            g.reset()

    run_threads(*(lambda seed=seed: serve(seed) for seed in range(4)))
    assert seen == {(True, True), (False, False)}
    assert_clean()


def test_runners_serve_from_several_threads_at_once():
    """One BucketedRunner per thread, called with sizes that pick every bucket and the eager
    fallback, its eager break reading the call's context: every call equals the function."""

    def serve(seed):
        numbers = torch.Generator().manual_seed(seed)
        w = torch.randn(8, 8, generator=numbers)

        def fn(x):
            return scale_by_context(x @ w).sin()

        runner = BucketedRunner(fn, (4, 8), (torch.zeros(1, 8),), backend="emulated",
                                context={"scale": 1.0}, debug=seed == 0)  # fmt: skip
        try:
            for call in range(40):
                x = torch.randn(1 + (call + seed) % 10, 8, generator=numbers)
                context = {"scale": call / 7}
                got = runner(x, context=context, owned=True)
                with breakgraph.context_scope(context):
                    torch.testing.assert_close(got, fn(x))
        finally:
            runner.close()

    run_threads(*(lambda seed=seed: serve(seed) for seed in range(3)))
    assert_clean()


READS = {
    "replays": lambda stats: stats.replays,
    "captures": lambda stats: stats.captures,
    "capture_s": lambda stats: stats.capture_s,
    "calls": lambda stats: dict(stats.calls),
    "combined": lambda stats: combined(stats),
}


@pytest.mark.parametrize("read", READS.values(), ids=READS.keys())
def test_stats_read_while_another_thread_captures_a_bucket(read):
    """A server's monitoring thread reads a ladder's stats while the serving thread captures a
    new bucket (the continuous-batching decode graphs capture while serving): the totals, the
    per-bucket views and ``combined`` looped over the live dict of buckets, and
    raised "dictionary changed size during iteration" in the reader. The reader is paused at
    the first bucket it reads, the capture runs, then the reader goes on: it reads the buckets
    as they were when it started."""
    x = torch.zeros(16)
    ladder = GraphLadder(backend="emulated")
    ladder.capture((4,), lambda size: x[:size] * 2)
    reading, captured = threading.Event(), threading.Event()
    reader, results = [], []

    class PausingStats(BucketStats):  # the reader stops at its first look at this bucket
        def __getattribute__(self, name):
            if threading.get_ident() in reader and not reading.is_set():
                reading.set()
                captured.wait(timeout=10)
            return super().__getattribute__(name)

    ladder.stats.buckets[4] = PausingStats(**vars(ladder.stats.buckets[4]))

    def read_stats():
        reader.append(threading.get_ident())
        results.append(read(ladder.stats))

    def capture_meanwhile():
        assert reading.wait(timeout=10), "the reader never read bucket 4"
        with ladder.capture_window():
            ladder.capture((8,), lambda size: x[:size] * 2)
        captured.set()

    try:
        run_threads(read_stats, capture_meanwhile)
    finally:
        ladder.close()
    assert len(results) == 1 and ladder.stats.captures == 2


def test_all_reduce_as_breaks_blocks_exit_in_any_order():
    """Two runners with eager collectives (``PrefillRunner(tp_collectives="eager")``) serve from
    two threads: their ``all_reduce_as_breaks()`` blocks overlap and the first one in need not
    be the last one out. Each block installed a wrapper of its own and put back, on exit, what
    it had found: the first one out found the second's wrapper (a warning, and it left it),
    and the second one out then put the first's wrapper back, for good. One wrapper now serves
    every open block and the last one out restores torch's function."""
    import torch.distributed as dist

    original = dist.all_reduce
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    inside = {}

    def first():
        with distributed.all_reduce_as_breaks():
            first_in.set()
            assert second_in.wait(timeout=10)
        first_out.set()

    def second():
        assert first_in.wait(timeout=10)
        with distributed.all_reduce_as_breaks():
            second_in.set()
            assert first_out.wait(timeout=10)
            inside["after the first left"] = dist.all_reduce

    with warnings.catch_warnings(record=True) as caught:  # the process's: both threads' too
        warnings.simplefilter("always", BreakgraphWarning)
        run_threads(first, second)
    assert not [str(w.message) for w in caught if issubclass(w.category, BreakgraphWarning)]
    assert inside["after the first left"] is not original  # the second block still has it
    assert dist.all_reduce is original


def test_all_reduce_as_breaks_makes_breaks_only_inside_a_block(monkeypatch):
    """The one wrapper of every open block turned all-reduces into breaks on any thread that
    was capturing: a runner that captures its collectives (no block of its own) on one thread
    got breaks while another thread's runner held a block open, and its ranks' graphs could
    then differ. Only a thread inside a block gets breaks."""
    import torch.distributed as dist

    def doubles(tensor, op=None, group=None, async_op=False):  # stands in for a collective
        return tensor.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", doubles)
    held, done = threading.Event(), threading.Event()
    breaks = {}

    def hold_a_block():
        with distributed.all_reduce_as_breaks():
            held.set()
            assert done.wait(timeout=30)

    def capture(name, block):
        assert held.wait(timeout=30)
        x = torch.randn(4)
        g = breakgraph.BreakableCUDAGraph()
        with contextlib.ExitStack() as stack:
            if block:
                stack.enter_context(distributed.all_reduce_as_breaks())
            with breakgraph.capture(g, backend="emulated"):
                y = x * 1
                dist.all_reduce(y)
                out = y + 1
        g.replay()
        torch.testing.assert_close(out, x * 2 + 1)
        breaks[name] = g.num_breaks

    def both():
        try:
            capture("outside", block=False)
            capture("inside", block=True)
        finally:
            done.set()

    run_threads(hold_a_block, both)
    assert breaks == {"outside": 0, "inside": 1}


def test_an_interrupt_right_after_the_capture_lock_is_taken_releases_it():
    """``capture`` took its process-wide lock with ``acquire()`` before its ``try``: a
    KeyboardInterrupt between the two (Ctrl-C while waiting for another thread's capture) left
    the lock held, and every later capture in the process waited for it for ever. The lock is
    a ``with`` block now; an interrupt at its first statement releases it."""
    import sys

    from breakgraph import graph as graph_module
    from breakgraph.state import capture_lock

    lock, raised = capture_lock, []

    def trace(frame, event, arg):
        if frame.f_code is not graph_module.capture.__wrapped__.__code__:
            return None
        if event == "line" and lock.locked() and not raised:
            raised.append(frame.f_lineno)
            raise KeyboardInterrupt
        return trace

    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt), breakgraph.capture(
            breakgraph.BreakableCUDAGraph(), backend="emulated"
        ):
            pass
    finally:
        sys.settrace(None)
    assert raised and not lock.locked()
    assert breakgraph.state.current_capture() is None
    g, x = breakgraph.BreakableCUDAGraph(), torch.ones(2)
    with breakgraph.capture(g, backend="emulated", context={"scale": 1.0}):  # no wait
        y = scale_by_context(x)
    g.replay(context={"scale": 3.0})
    assert y.tolist() == [3.0, 3.0]


def test_a_capture_left_open_by_a_thread_that_ended_is_refused_not_waited_for():
    """A ``with breakgraph.capture(g):`` inside a generator that yielded on a thread that then
    ended, the generator never resumed: the capture holds the process's capture turn for
    ever, and every later capture waited for it (a hang). The capture is tied to its ended
    thread and can never be finished there, so a later capture raises ``CaptureError`` naming
    it and the fix; once the generator is closed, captures work again."""
    import gc

    x = torch.randn(3)
    abandoned = breakgraph.BreakableCUDAGraph()

    def steps():
        with breakgraph.capture(abandoned, backend="emulated"):
            yield x * 2

    suspended = steps()
    worker = threading.Thread(target=lambda: next(suspended), name="suspended-capture")
    worker.start()
    worker.join()
    outcome = []

    def capture_again():
        try:
            with breakgraph.capture(breakgraph.BreakableCUDAGraph(), backend="emulated"):
                x.sin()
            outcome.append("captured")
        except breakgraph.CaptureError as exc:
            outcome.append(str(exc))

    try:
        later = threading.Thread(target=capture_again, daemon=True)  # waited for ever
        later.start()
        later.join(timeout=60)
        assert outcome, "the capture waited for the ended thread's capture"
        assert "started on thread 'suspended-capture', which has ended" in outcome[0]
        assert "gen.close()" in outcome[0]
    finally:
        suspended.close()  # the block's exit: the turn, the hooks and the collector come back
    assert gc.isenabled() and not capturing_now()
    g = breakgraph.BreakableCUDAGraph()
    with breakgraph.capture(g, backend="emulated", context={"scale": 1.0}):
        y = scale_by_context(x)
    g.replay(context={"scale": 3.0})
    assert torch.equal(y, x * 3)


def test_a_graph_replayed_from_two_threads_at_once_is_refused():
    """One graph replayed by two threads at once: both write its static inputs and read its
    outputs, its segments and breaks interleave (on CUDA too), and each thread's result could
    be the other's, silently. The second replay raises ``ReplayError`` naming the cause; the
    first one, held inside its eager break meanwhile, is right, and the graph serves again."""
    inside, tried = threading.Event(), threading.Event()
    holder = []

    @breakgraph.eager_on_graph
    def hold(h):
        if threading.get_ident() in holder:
            inside.set()
            assert tried.wait(timeout=30)
        return h * 2

    x = torch.randn(4)
    g = breakgraph.BreakableCUDAGraph()
    with breakgraph.capture(g, backend="emulated"):
        out = hold(x + 1) - 1
    results = {}

    def first():
        holder.append(threading.get_ident())
        new = torch.randn(4)
        x.copy_(new)
        g.replay()
        results["first"] = (out.clone(), (new + 1) * 2 - 1)

    def second():
        assert inside.wait(timeout=30), "the first replay never reached its break"
        try:
            with pytest.raises(breakgraph.ReplayError, match="another thread"):
                g.replay()
        finally:
            tried.set()

    run_threads(first, second, timeout=60)
    torch.testing.assert_close(*results["first"])
    holder.clear()
    new = torch.randn(4)
    x.copy_(new)
    g.replay()
    torch.testing.assert_close(out, (new + 1) * 2 - 1)


def test_a_graph_replayed_or_reset_inside_its_own_replay_is_refused():
    """An eager function of a graph that replays that graph again overwrote the outputs the
    outer replay's later segments read (a recursion, on CUDA too); one that resets it from
    another thread freed what the replay still runs. Both raise ``ReplayError``."""
    calls = []

    @breakgraph.eager_on_graph
    def again(h):
        if not calls:
            calls.append(1)
            g.replay()
        return h * 2

    x = torch.randn(4)
    g = breakgraph.BreakableCUDAGraph()
    with breakgraph.capture(g, backend="emulated"):
        calls.append(0)  # the capture's own call of `again` does not replay
        out = again(x + 1)
    calls.clear()
    with pytest.raises(breakgraph.ReplayError, match="inside its own replay"):
        g.replay()

    reset_from = {}

    @breakgraph.eager_on_graph
    def reset_elsewhere(h):
        if reset_from.get("armed"):
            def reset():
                with pytest.raises(breakgraph.ReplayError, match="another thread"):
                    g2.reset()
                reset_from["refused"] = True
            run_threads(reset, timeout=60)
        return h * 2

    g2 = breakgraph.BreakableCUDAGraph()
    with breakgraph.capture(g2, backend="emulated"):
        out = reset_elsewhere(x + 1)
    reset_from["armed"] = True
    new = torch.randn(4)
    x.copy_(new)
    g2.replay()
    assert reset_from["refused"]
    torch.testing.assert_close(out, (new + 1) * 2)


def test_a_runner_closed_while_another_thread_replays_releases_every_other_graph():
    """close() while another thread replays one of the runner's graphs: that graph's reset is
    refused (ReplayError), and the refusal stopped the release halfway, the graphs after it
    never reset. Every other graph is released now; the replaying one goes when collected."""
    inside, closed = threading.Event(), threading.Event()
    holder = []

    @breakgraph.eager_on_graph
    def hold(h):
        if threading.get_ident() in holder:
            inside.set()
            assert closed.wait(timeout=30)
        return h * 2

    runner = BucketedRunner(lambda x: hold(x + 1) - 1, (2, 4, 8), (torch.zeros(1, 3),),
                            backend="emulated")  # fmt: skip
    graphs = {size: runner.ladder.graph(size) for size in (2, 4, 8)}
    got = {}

    def serve():
        holder.append(threading.get_ident())
        x = torch.randn(3, 3)
        got["out"], got["expected"] = runner(x, owned=True), (x + 1) * 2 - 1

    def close():
        assert inside.wait(timeout=30), "the replay never reached its break"
        try:
            with pytest.raises(breakgraph.ReplayError, match="another thread"):
                runner.close()
        finally:
            closed.set()

    run_threads(serve, close, timeout=60)
    torch.testing.assert_close(got["out"], got["expected"])
    assert [graphs[size].num_segments for size in (2, 4, 8)] == [0, 2, 0]
