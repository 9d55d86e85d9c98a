"""GraphLadder: the one owner of graphs per bucket (capture, decision, replay, stats, release).

Behavioural tests run on both backends through the ``backend``/``device`` fixtures; the
decision and bucket-list functions are pure.
"""

import gc

import pytest
import torch

import breakgraph
from breakgraph import InputError, ReplayError, distributed
from breakgraph import ladder as ladder_module
from breakgraph.backends.emulated import EmulatedPool
from breakgraph.ladder import (
    Action,
    Decision,
    GraphLadder,
    choose_bucket,
    default_token_buckets,
    geometric_buckets,
    validate_buckets,
)


@breakgraph.eager_on_graph
def add_context(h):
    """Host-dependent: adds the replay context (an int) to every element."""
    return h + breakgraph.replay_context()


class Owner:
    """What a runner does around a ladder: it owns one static buffer per bucket."""

    def __init__(self, device, sizes):
        self.buffers = {s: torch.zeros(s, 3, device=device) for s in sizes}
        self.recorded, self.warmed = [], []

    def record(self, size):
        self.recorded.append(size)
        return add_context(self.buffers[size] * 2)

    def warm_up(self, size):
        self.warmed.append((size, breakgraph.replay_context()))
        add_context(self.buffers[size] * 2)


def make(backend, device, sizes=(4, 16, 64), **kwargs):
    owner = Owner(device, sizes)
    ladder = GraphLadder(backend=backend, **kwargs)
    ladder.capture(sizes, owner.record, warm_up=owner.warm_up, context=lambda size: size)
    return ladder, owner


# -- the decision ----------------------------------------------------------------------------------


def test_decisions_are_an_enum_that_still_equals_strings():
    decision = choose_bucket((4, 16), 5)
    assert decision == Decision(Action.REPLAY, 16)
    assert decision.action is Action.REPLAY and decision.action == "replay"
    assert choose_bucket((4, 16), 20).action == "eager"
    assert choose_bucket((4, 16), 20, on_miss="raise").action is Action.RAISE
    assert choose_bucket((4, 16), 20, can_capture=True) == Decision("capture", 20)
    assert Decision("eager", None, "why").action is Action.EAGER  # strings still accepted
    assert (str(Action.EAGER), f"{Action.RAISE}", repr(Action.REPLAY)) == (
        "eager",
        "raise",
        "Action.REPLAY",
    )
    assert {"replay": 1}[Action.REPLAY] == 1  # hashes as its string
    with pytest.raises(InputError, match="action must be one of"):
        Decision("maybe")


def test_choose_bucket_refuses_an_on_miss_it_does_not_know():
    """``on_miss="Raise"`` (or any other string) decided ``Action.EAGER`` for a size above
    every bucket, silently, where the caller asked for a refusal."""
    for bad in ("Raise", "raise ", None, True):
        with pytest.raises(InputError, match="choose_bucket: on_miss must be 'eager' or 'raise'"):
            choose_bucket((4, 16), 20, on_miss=bad)


def test_bucket_lists():
    assert validate_buckets((64, 8, 8), "here") == [8, 64]
    assert validate_buckets((), "here", allow_empty=True) == []
    for bad in ((), (0, 4), (2.5,), (True,), "16", (-5,)):
        with pytest.raises(InputError, match="here: bucket sizes must be positive ints"):
            validate_buckets(bad, "here")
    with pytest.raises(InputError, match="here: buckets must be a sequence"):
        validate_buckets(16, "here")
    assert geometric_buckets(32, 4, 2048) == (32, 128, 512, 2048)
    assert geometric_buckets(32, 4, 1000) == (32, 128, 512, 1000)
    assert geometric_buckets(32, 4, 32) == (32,) and geometric_buckets(32, 4, 8) == (8,)
    for args in ((0, 4, 64), (32, 1, 64), (32, 4, 0), (32, 2.0, 64), (True, 4, 64)):
        with pytest.raises(InputError, match="geometric_buckets"):
            geometric_buckets(*args)
    assert len(default_token_buckets(4096)) == 64 and default_token_buckets(100)[-1] == 100


# -- capture ---------------------------------------------------------------------------------------


def test_capture_largest_first_into_one_pool(backend, device):
    ladder, owner = make(backend, device)
    assert owner.recorded == [64, 16, 4] and ladder.buckets == (4, 16, 64)
    assert owner.warmed == [(64, 64)]  # once, before the first bucket, in its context
    assert list(ladder.stats.buckets) == [64, 16, 4]
    pools = {id(ladder.graph(b).pool()) if backend == "emulated" else ladder.graph(b).pool()
             for b in ladder.buckets}  # fmt: skip
    assert len(pools) == 1
    # a second call captures only what is new, into the same pool, and warms up again
    owner.buffers[8] = torch.zeros(8, 3, device=device)
    ladder.capture((4, 8), owner.record, warm_up=owner.warm_up, context=lambda size: size)
    assert owner.recorded == [64, 16, 4, 8] and owner.warmed[-1] == (8, 8)
    assert ladder.buckets == (4, 8, 16, 64)
    assert (ladder.graph(8).pool() is ladder.graph(64).pool()) or backend == "cuda"
    # warm_up_each: before every bucket
    owner.buffers.update({s: torch.zeros(s, 3, device=device) for s in (2, 32)})
    ladder.capture((2, 32), owner.record, warm_up=owner.warm_up, warm_up_each=True,
                   context=lambda size: size)  # fmt: skip
    assert owner.warmed[-2:] == [(32, 32), (2, 2)]


def test_replay_uses_the_live_context_and_counts(backend, device):
    ladder, owner = make(backend, device)
    for n, context in ((3, 5), (10, -2), (16, 7)):
        x = torch.randn(16, 3, device=device)
        owner.buffers[16].copy_(x)
        bucket = ladder.decide(n).bucket
        assert bucket == (4 if n <= 4 else 16)
        if bucket == 16:
            out = ladder.replay(16, context, size=n)
            assert out is ladder.output(16)
            torch.testing.assert_close(out, x * 2 + context)
    assert ladder.stats.buckets[16].replays == 2 and ladder.stats.buckets[16].padded == 6
    with pytest.raises(InputError, match=r"no bucket 5; captured: \(4, 16, 64\)"):
        ladder.replay(5)
    with pytest.raises(InputError, match="no bucket 5"):
        ladder.graph(5)


def test_a_failed_capture_registers_nothing(backend, device):
    owner = Owner(device, (4, 16))
    ladder = GraphLadder(backend=backend)

    def record(size):
        if size == 4:
            raise RuntimeError("boom")
        return owner.record(size)

    with pytest.raises(RuntimeError, match="boom"):
        ladder.capture((4, 16), record, context=lambda size: size)
    assert ladder.buckets == (16,) and list(ladder.stats.buckets) == [16]
    ladder.capture((4,), owner.record, context=lambda size: size)  # a later capture works
    assert ladder.buckets == (4, 16)


def test_a_pool_a_failed_capture_spoiled_is_left_for_a_new_one(monkeypatch):
    """When the backend says a failed capture left the ladder's pool unusable (CUDA, after an
    invalidated capture), the next bucket starts a new pool instead of failing on it."""
    owner = Owner("cpu", (4, 16, 32))
    ladder = GraphLadder(backend="emulated")
    ladder.capture((32,), owner.record, context=lambda size: size)
    spoiled = ladder.graph(32).pool()
    backend = type(ladder._backend)
    monkeypatch.setattr(backend, "pool_usable", lambda self, pool: pool is not spoiled)

    def record(size):
        if size == 16:
            raise RuntimeError("boom")
        return owner.record(size)

    with pytest.raises(RuntimeError, match="boom"):
        ladder.capture((16,), record, context=lambda size: size)
    ladder.capture((4,), owner.record, context=lambda size: size)
    assert ladder.buckets == (4, 32) and ladder.graph(4).pool() is not spoiled


def test_a_given_pool_torch_gave_up_is_left_for_a_new_one(backend, device):
    """A pool given to the ladder whose last graph went before the ladder captured into it:
    the capture is refused by name, and the next one starts a new pool, on both backends (the
    emulated backend said such a pool was still usable, so every later capture failed too)."""
    owner = Owner(device, (4, 16))
    other = breakgraph.BreakableCUDAGraph()
    with breakgraph.capture(other, backend=backend):
        out = owner.buffers[16] * 3  # held: the pool's memory stays in use
    pool = other.pool()
    ladder = GraphLadder(backend=backend, pool=pool)
    other.reset()
    with pytest.raises(breakgraph.CaptureError, match="has no live graph any more"):
        ladder.capture((16,), owner.record, context=lambda size: size)
    ladder.capture((4, 16), owner.record, context=lambda size: size)
    assert ladder.buckets == (4, 16) and ladder.graph(4).pool() == ladder.graph(16).pool()
    assert ladder.graph(16).pool() != pool and out.shape == (16, 3)
    ladder.close()


def count_collections(monkeypatch) -> list:
    collections, real_collect = [], gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or real_collect(*a))
    return collections


def test_one_garbage_collection_per_capture_call(backend, device, monkeypatch):
    flags = []
    real_capture = ladder_module.capture

    def spy(*args, **kwargs):
        flags.append(kwargs["collect_garbage"])
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(ladder_module, "capture", spy)
    collections = count_collections(monkeypatch)
    ladder, owner = make(backend, device)
    assert flags == [None, False, False]  # one flush per capture() call, not one per bucket
    owner.buffers[8] = torch.zeros(8, 3, device=device)
    ladder.capture((8,), owner.record, context=lambda size: size)
    assert flags == [None, False, False, None]
    # None is torch.cuda.graph's rule: a full collection only with force_cudagraph_gc
    assert collections == []
    # torch's own patch: from 2.14 pytest's monkeypatch leaves torch's config without the
    # name after its undo (every later read raised AttributeError)
    with torch.compiler.config.patch(force_cudagraph_gc=True):
        owner.buffers[12] = torch.zeros(12, 3, device=device)
        ladder.capture((12,), owner.record, context=lambda size: size)
    # what a collection protects is device memory held by dead cycles (handed back to the
    # device before the graph's pool grows): only the CUDA backend has any
    assert len(collections) == (1 if backend == "cuda" else 0)


def test_a_capture_collects_only_where_it_frees_device_memory(capture, backend, monkeypatch):
    collections = count_collections(monkeypatch)
    enabled = []

    @breakgraph.eager_on_graph
    def watch(h):
        enabled.append(gc.isenabled())
        return h

    x = torch.randn(4, device="cuda" if backend == "cuda" else "cpu")
    with capture(breakgraph.BreakableCUDAGraph()):  # as torch.cuda.graph: no full collection
        watch(x * 2)
    with capture(breakgraph.BreakableCUDAGraph(), collect_garbage=False):
        watch(x * 2)
    assert collections == []
    with capture(breakgraph.BreakableCUDAGraph(), collect_garbage=True):
        watch(x * 2)
    with torch.compiler.config.patch(force_cudagraph_gc=True):
        with capture(breakgraph.BreakableCUDAGraph()):  # torch's switch, honoured
            watch(x * 2)
    assert len(collections) == (2 if backend == "cuda" else 0)
    assert enabled == [False] * 4 and gc.isenabled()  # off during every capture, then back


def test_capture_of_nothing_new_does_nothing(backend, device):
    ladder, owner = make(backend, device)
    ladder.capture((4, 64), owner.record, warm_up=owner.warm_up)
    assert owner.recorded == [64, 16, 4] and len(owner.warmed) == 1


# -- decisions per call ----------------------------------------------------------------------------


def test_capture_window_and_decision_cache(backend, device):
    ladder, _ = make(backend, device, on_miss="raise")
    assert not ladder.window_open
    assert ladder.decide(100) == Decision(Action.RAISE, None, "larger than every bucket")
    with ladder.capture_window():
        assert ladder.window_open and ladder.decide(100) == Decision(Action.CAPTURE, 100)
    assert not ladder.window_open and ladder.decide(100).action is Action.RAISE
    assert ladder.decide(3) is ladder.decide(3)  # cached outside windows


def test_the_decision_cache_does_not_grow_with_sizes_above_every_bucket(backend, device):
    """A server sees sizes without bound (prompt lengths above the largest bucket, run eagerly):
    the cache held one decision per size ever seen, growing for the life of the process."""
    ladder, _ = make(backend, device)
    for size in range(1, 200):
        ladder.decide(size)
    cached = len(ladder._decisions)  # one per size a bucket holds, one for all the others
    for size in range(200, 2200):
        assert ladder.decide(size) == Decision(Action.EAGER, None, "larger than every bucket")
    assert len(ladder._decisions) == cached == 64 + 1
    assert ladder.decide(5000) is ladder.decide(65)
    with ladder.capture_window():  # sizes above every bucket are captured: each its own
        assert ladder.decide(2300) == Decision(Action.CAPTURE, 2300)
    assert ladder.decide(2300).action is Action.EAGER


def test_agree_size_and_padding(backend, device):
    seen = []
    ladder, _ = make(backend, device, agree_size=lambda size: seen.append(size) or 50,
                     max_padding_fraction=0.5)  # fmt: skip
    assert ladder.decide(3) == Decision(Action.REPLAY, 64) and seen == [3]
    assert ladder.choose(17) == Decision(Action.EAGER, None, "too much padding")
    bad, _ = make(backend, device, agree_size=lambda size: size - 1)
    with pytest.raises(InputError, match="agree_size"):
        bad.decide(3)


@pytest.mark.parametrize("bad", ["3", None, -1, 3.5, True])
def test_sizes_and_buckets_that_are_not_ints_are_refused(bad):
    """decide("3") and decide(None) raised TypeErrors from the bucket search, decide(-1)
    and decide(3.5) replayed bucket 4; replay(4, size=100) counted -96 padding elements and a
    bucket that is not hashable ([4]) raised TypeError: each is an InputError naming the call."""
    ladder, _ = make("emulated", "cpu")
    with pytest.raises(InputError, match="GraphLadder.decide: size must be an int >= 0"):
        ladder.decide(bad)
    with pytest.raises(InputError, match="GraphLadder.choose: size must be an int >= 0"):
        ladder.choose(bad)
    if bad is not None:  # replay's size is optional
        with pytest.raises(InputError, match="GraphLadder.replay: size must be an int >= 0"):
            ladder.replay(4, 0, size=bad)
    with pytest.raises(InputError, match="size=100 is larger than bucket 4"):
        ladder.replay(4, 0, size=100)
    for call in (ladder.replay, ladder.graph, ladder.output):
        with pytest.raises(InputError, match=r"no bucket \[4\]"):
            call([4])
    assert ladder.stats.replays == 0 and ladder.stats.buckets[4].padded == 0
    assert ladder.decide(0).bucket == 4 and ladder.replay(4, 0, size=4) is ladder.output(4)


def test_a_numpy_size_keeps_the_counters_plain_ints():
    """replay(4, size=np.int64(3)) is accepted (decide takes numpy's ints too), but the padding
    counter became a numpy.int64, which json.dumps of the stats refused."""
    import json

    np = pytest.importorskip("numpy")
    ladder, _ = make("emulated", "cpu")
    ladder.replay(4, 0, size=np.int64(3))
    ladder.replay(4, 0, size=np.uint8(2))
    stats = ladder.stats.buckets[4]
    assert stats.padded == 3 and type(stats.padded) is int
    json.dumps({"padded": stats.padded, "total": ladder.stats.padded_elements[4]})
    ladder.close()


def test_stats_totals_views_and_table(backend, device):
    ladder, owner = make(backend, device)
    ladder.replay(16, 0, size=10)
    ladder.replay(16, 0, size=16)
    ladder.replay(4, 0)
    ladder.record_eager("larger than every bucket")
    ladder.record_eager("larger than every bucket")
    stats = ladder.stats
    assert (stats.captures, stats.replays, stats.eager_steps) == (3, 3, 2)
    assert dict(stats.calls) == {64: 0, 16: 2, 4: 1}
    assert dict(stats.padded_elements) == {64: 0, 16: 6, 4: 0}
    assert set(stats.capture_seconds) == {4, 16, 64} and stats.capture_s > 0
    assert stats.capture_s == pytest.approx(sum(stats.capture_seconds.values()))
    assert stats.warmup_seconds > 0 and dict(stats.replay_ms) == {}
    assert {b.breaks for b in stats.buckets.values()} == {1}
    if backend == "emulated":
        assert set(stats.graph_memory_bytes.values()) == {0}
    with pytest.raises(TypeError):
        stats.calls[4] = 9  # views are read-only: the counters live in stats.buckets
    table = str(stats)
    assert table.splitlines()[0].split() == [
        "bucket", "captures", "replays", "padded", "capture", "s", "graph", "MiB", "breaks"
    ]  # fmt: skip
    assert "total" in table and "eager fallbacks: larger than every bucket: 2" in table


def test_route_sends_calls_to_a_faster_larger_bucket(backend, device):
    ladder, _ = make(backend, device)
    assert ladder.decide(3).bucket == 4
    assert ladder.route({4: 1.0, 16: 0.5, 64: 0.49}) == {4: 64}
    assert ladder.decide(3).bucket == 64  # the cached decision was dropped
    assert ladder.stats.routed == {4: 64} and dict(ladder.stats.replay_ms)[16] == 0.5
    with pytest.raises(InputError, match=r"\[5\] are not captured buckets"):
        ladder.route({5: 1.0})


def test_tune_times_nothing_on_the_emulated_backend():
    ladder, _ = make("emulated", "cpu")
    assert ladder.tune() == {} and ladder.stats.routed == {}


@pytest.mark.parametrize(
    "bad", [dict(repeats=0), dict(warmup=-1), dict(repeats=1.5), dict(warmup=True)]
)
def test_tune_refuses_bad_counts(bad):
    ladder, _ = make("emulated", "cpu")
    name = next(iter(bad))
    with pytest.raises(InputError, match=rf"GraphLadder.tune: {name} must be an int"):
        ladder.tune(**bad)


@pytest.mark.parametrize(
    "bad, phrase",
    [
        (dict(margin="2%"), r"GraphLadder.tune: margin must be a real number, got '2%'"),
        (dict(margin=-0.5), r"GraphLadder.tune: margin must be a real number >= 0.0"),
        (dict(margin=float("nan")), r"GraphLadder.tune: margin must be a real number >= 0.0"),
        (dict(context="size"), r"GraphLadder.tune: context must be callable or None"),
    ],
)
def test_tune_refuses_a_bad_margin_or_context_before_timing(bad, phrase):
    """Checked before any timing, so on every backend: on CUDA a string margin was a bare
    TypeError after every bucket was timed, and a negative one routed calls to slower
    buckets."""
    ladder, _ = make("emulated", "cpu")
    with pytest.raises(InputError, match=phrase):
        ladder.tune(**bad)
    with pytest.raises(InputError, match=r"GraphLadder.route: margin must be a real number >="):
        ladder.route({}, -0.5)


@pytest.mark.requires_cuda
def test_tune_times_every_bucket_on_cuda():
    ladder, owner = make("cuda", "cuda")
    made = []

    def context(size):  # a runner's context stages inputs (and may wait for the device)
        made.append(size)
        return size + 1000

    times = ladder.tune(context, repeats=2)
    assert set(times) == {4, 16, 64} and all(t > 0 for t in times.values())
    assert dict(ladder.stats.replay_ms) == times
    # once per timing, not once per replay: every bucket, then those a route rests on again
    routed = {size for route in ladder.stats.routed.items() for size in route}
    assert made[:3] == [4, 16, 64] and set(made[3:]) <= {4, 16, 64}
    assert routed <= set(made[3:])
    seen = []

    @breakgraph.eager_on_graph
    def look(x):
        seen.append(breakgraph.replay_context())
        return x

    other = GraphLadder(backend="cuda")
    buffer = torch.zeros(8, device="cuda")
    other.capture((8,), lambda size: look(buffer[:size] * 2), context=lambda size: size)
    other.tune(context, repeats=3)
    assert seen[-4:] == [1008] * 4 and seen.count(1008) == 4  # a warm-up, three timed replays
    seen.clear()
    other.tune(context, repeats=2, warmup=0)  # one bucket, no route: only the timed replays
    assert seen == [1008] * 2
    other.close()


@pytest.mark.requires_cuda
def test_a_warm_up_that_raises_is_still_joined_to_the_callers_stream():
    """On CUDA a warm-up runs on a side stream, joined to the caller's stream after it. One that
    raised skipped the join: the caller's stream went on (a failed runner frees its buffers, the
    allocator hands the memory out again) while what the warm-up launched still ran."""
    ladder = GraphLadder(backend="cuda")
    x = torch.zeros(16, device="cuda")
    launched = torch.cuda.Event()

    def warm_up(size):
        torch.cuda._sleep(2_000_000_000)  # about a second of device time, on the side stream
        launched.record()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ladder.capture((16,), lambda size: x[:size] * 2, warm_up=warm_up)
    caller = torch.cuda.Event()
    caller.record()
    caller.synchronize()
    assert launched.query()  # the caller's stream waited for the warm-up's work
    assert ladder.buckets == ()
    ladder.close()


# -- release ---------------------------------------------------------------------------------------


def test_close_is_final(backend, device):
    ladder, owner = make(backend, device)
    graphs = [ladder.graph(b) for b in ladder.buckets]
    ladder.replay(4, 0)
    ladder.close()
    assert ladder.closed and ladder.buckets == () and all(g.num_segments == 0 for g in graphs)
    assert ladder.stats.replays == 1  # the counters stay readable
    for call in (
        lambda: ladder.decide(3),
        lambda: ladder.choose(3),
        lambda: ladder.replay(4),
        lambda: ladder.graph(4),
        lambda: ladder.capture((4,), owner.record),
        lambda: ladder.capture_window().__enter__(),
        lambda: ladder.tune(),
        lambda: ladder.route({}),
    ):
        with pytest.raises(ReplayError, match="closed by close"):
            call()
    ladder.close()  # idempotent


def test_discard_releases_every_graph_and_captures_again(backend, device):
    """What an owner whose capture phase failed halfway calls: nothing half-captured stays."""
    ladder, owner = make(backend, device)
    graphs = [ladder.graph(b) for b in ladder.buckets]
    ladder.replay(4, 0)
    ladder.discard()
    assert not ladder.closed and ladder.buckets == () and all(g.num_segments == 0 for g in graphs)
    assert ladder.decide(3).action == "eager" and ladder.stats.replays == 1
    ladder.capture((4, 16), owner.record, context=lambda size: size)
    assert ladder.buckets == (4, 16) and ladder.decide(3).bucket == 4
    ladder.close()
    with pytest.raises(ReplayError, match="closed by close"):
        ladder.discard()


def test_counters_go_on_after_discard_and_a_new_capture(backend, device):
    """discard() keeps the counters readable: a bucket captured again adds to its counts (it
    replaced them, so totals went down), and the routes that went with the graphs leave
    ``stats.routed`` too (it kept a route that decide() no longer took)."""
    ladder, owner = make(backend, device)
    ladder.replay(4, 3, size=3)
    ladder.replay(4, 2, size=2)
    assert ladder.route({4: 1.0, 16: 0.5, 64: 0.6}) == {4: 16} == ladder.stats.routed
    ladder.discard()
    assert ladder.stats.routed == {} and ladder.stats.replays == 2
    ladder.capture((4, 16), owner.record, context=lambda size: size)
    assert ladder.decide(3).bucket == 4 and ladder.stats.routed == {}
    assert ladder.stats.replays == 2 and ladder.stats.padded_elements[4] == 3
    assert ladder.stats.buckets[4].captures == 2 and ladder.stats.buckets[64].captures == 1
    assert ladder.stats.buckets[4].replay_ms is None  # the new graph was not timed
    ladder.close()


@pytest.mark.parametrize(
    "arguments, name",
    [({"record": None}, "record"), ({"warm_up": True}, "warm_up"),
     ({"context": {"lengths": [3]}}, "context")],  # fmt: skip
)
def test_capture_refuses_arguments_that_are_not_callable(backend, device, arguments, name):
    """``context`` takes ``size -> context`` here (``breakgraph.capture`` takes the value):
    refused by name, before anything is captured, not with a TypeError from inside."""
    owner = Owner(device, (4,))
    ladder = GraphLadder(backend=backend)
    call = {"record": owner.record, **arguments}
    with pytest.raises(InputError, match=f"GraphLadder.capture: {name}"):
        ladder.capture((4,), call.pop("record"), **call)
    assert ladder.buckets == ()
    ladder.close()


def test_progress_prints_each_capture_and_repr_says_closed(backend, device, capsys):
    ladder, _ = make(backend, device, sizes=(4, 16), progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" in ")[0] for line in lines] == [
        "breakgraph: captured bucket 1/2 (size 16)", "breakgraph: captured bucket 2/2 (size 4)",
    ]
    assert repr(ladder) == f"GraphLadder(backend={backend!r}, buckets=(4, 16))"
    ladder.close()
    assert repr(ladder) == f"GraphLadder(backend={backend!r}, buckets=(), closed)"


def test_warm_up_each_that_is_not_a_flag_is_refused(backend, device):
    """``warm_up_each="no"`` warmed up every bucket: read for its truth value. Refused by
    name, before anything is captured."""
    owner = Owner(device, (4,))
    ladder = GraphLadder(backend=backend)
    with pytest.raises(InputError, match="GraphLadder.capture: warm_up_each must be True or"):
        ladder.capture((4,), owner.record, warm_up_each=None)
    assert ladder.buckets == ()
    ladder.close()


def test_discard_of_a_ladder_given_a_fresh_pool_captures_again(backend, device):
    """A ladder given a pool of its own (``torch.cuda.graph_pool_handle()``) held that pool's
    only graphs: discarding them gave the pool up, and going back to it failed the next
    capture ("no live graph any more"). After a discard the ladder starts a new pool."""
    fresh = torch.cuda.graph_pool_handle() if backend == "cuda" else EmulatedPool()
    ladder, owner = make(backend, device, pool=fresh)
    assert ladder.graph(4).pool() == fresh
    ladder.discard()
    ladder.capture((4, 16), owner.record, context=lambda size: size)
    owner.buffers[4].copy_(torch.randn(4, 3, device=device))
    out = ladder.replay(4, 5)  # the replay context is added to every element
    torch.testing.assert_close(out, owner.buffers[4] * 2 + 5)
    assert ladder.graph(4).pool() != fresh
    ladder.close()


# -- ranks: every warm-up and capture a checked step, one exchange per decision ------------------


class FakeRanks:
    """Stands in for a RankGroup: records what the ladder asks of it."""

    keeps_memory = False

    def __init__(self, agreed=None):
        self.agreed, self.steps, self.exchanges, self.eager = agreed, [], [], 0

    def agree(self, size, fingerprint=0, what="inputs", fix=None):
        self.exchanges.append((size, fingerprint))
        return size if self.agreed is None else self.agreed

    def capture_step(self, what, step, fingerprint=None, keep=None):
        result = step()
        self.steps.append((what, fingerprint(result) if fingerprint else None, keep))
        return result

    def before_eager(self):
        self.eager += 1


def capture_modes(monkeypatch) -> list:
    """The ``capture_error_mode`` of every capture the ladder starts, in order."""
    modes = []
    real_capture = ladder_module.capture
    monkeypatch.setattr(
        ladder_module,
        "capture",
        lambda *a, **k: modes.append(k["capture_error_mode"]) or real_capture(*a, **k),
    )
    return modes


def test_captures_are_thread_local_unless_told(backend, device, monkeypatch):
    """A ladder captures in CUDA's ``"thread_local"`` mode, with ranks or without: a server's
    other threads (serving, syncing, allocating) must not fail its captures, nor be failed by
    them, as the ``"global"`` mode would do. An explicit mode is passed as given."""
    modes = capture_modes(monkeypatch)
    owner = Owner(device, (4, 16, 32))
    ladder = GraphLadder(backend=backend)
    ladder.capture((4, 16), owner.record, context=lambda size: size)
    assert modes == ["thread_local"] * 2
    ladder.capture((32,), owner.record, context=lambda size: size, capture_error_mode="global")
    assert modes == ["thread_local"] * 2 + ["global"]
    assert ladder.buckets == (4, 16, 32)


def test_rank_agreement(backend, device, monkeypatch):
    modes = capture_modes(monkeypatch)
    ranks = FakeRanks(agreed=50)
    ladder, owner = make(backend, device, sizes=(4, 64), ranks=ranks)
    assert [what for what, _, _ in ranks.steps] == [
        "warm-up of bucket 64",
        "capture of bucket 64",
        "capture of bucket 4",
    ]
    graph = ladder.graph(64)
    assert ranks.steps[1][1] == distributed.fingerprint(repr(graph))  # same segments and breaks
    assert graph in ranks.steps[1][2]  # kept alive if the step fails with NCCL
    assert modes == [distributed.CAPTURE_ERROR_MODE] * 2
    # every decision is an exchange (never cached), on the agreed size
    assert ladder.decide(3, fingerprint=7) == Decision(Action.REPLAY, 64)
    ladder.decide(3, fingerprint=7)
    assert ranks.exchanges == [(3, 7), (3, 7)]
    ladder.record_eager("larger than every bucket")
    assert ranks.eager == 1
    with pytest.raises(InputError, match="timings differ between ranks"):
        ladder.tune()
    with pytest.raises(InputError, match="drop agree_size"):
        GraphLadder(backend=backend, ranks=ranks, agree_size=lambda size: size)


def test_close_keeps_the_graphs_of_a_failed_nccl_step(backend, device):
    ranks = FakeRanks()
    ladder, _ = make(backend, device, ranks=ranks)
    graphs = [ladder.graph(b) for b in ladder.buckets]
    ranks.keeps_memory = True  # what RankGroup reports after a failed NCCL capture step
    kept = len(distributed._KEPT_UNTIL_EXIT)
    ladder.close()
    assert len(distributed._KEPT_UNTIL_EXIT) == kept + 1
    assert all(g.num_segments > 0 for g in graphs)  # not reset
    del distributed._KEPT_UNTIL_EXIT[kept:]


def test_every_bucket_is_watched_for_host_syncs_off_cuda(backend):
    # the emulated backend would record a sync silently: it watches every bucket (CUDA
    # watches only the first of a capture call: tests/test_syncs_cuda.py)
    ladder = GraphLadder(backend=backend)
    watched = [ladder._watch_syncs(i) for i in range(3)]
    assert watched == ([True, False, False] if backend == "cuda" else [True, True, True])


def _refused_by_cuda(ladder, monkeypatch, bucket):
    """Make ``ladder`` behave as on CUDA for the test: only the first bucket watched, and the
    capture of ``bucket`` refused the way ``capture()`` reports CUDA's refusal (a
    ``HostSyncError`` caused by CUDA's ``RuntimeError``, without the line)."""
    monkeypatch.setattr(ladder, "_watch_syncs", lambda i: i == 0)
    step = ladder._step

    def refusing(what, fn, fingerprint=None, keep=None):
        if what == f"capture of bucket {bucket}":
            try:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            except RuntimeError as cuda:
                raise breakgraph.HostSyncError("the CUDA capture failed inside a segment") from cuda
        return step(what, fn, fingerprint, keep)

    monkeypatch.setattr(ladder, "_step", refusing)


def test_a_sync_cuda_refuses_in_an_unwatched_bucket_is_named_by_an_eager_run(monkeypatch):
    x = torch.randn(32)

    def record(size):
        y = x[:size] * 2
        if size < 16:  # a host sync only the small bucket takes
            y = y * y.sum().item()
        return y

    ladder = GraphLadder(backend="emulated")
    _refused_by_cuda(ladder, monkeypatch, bucket=8)
    with pytest.raises(breakgraph.HostSyncError) as info:
        ladder.capture((8, 16, 32), record)
    assert "aten._local_scalar_dense" in str(info.value)  # the eager watched run named it
    assert "test_ladder.py" in str(info.value) and "y.sum().item()" in str(info.value)
    assert ladder.buckets == (16, 32)  # the buckets captured before it stay


def test_cudas_own_error_stands_when_the_eager_run_shows_no_sync(monkeypatch):
    x = torch.randn(32)
    ladder = GraphLadder(backend="emulated")
    _refused_by_cuda(ladder, monkeypatch, bucket=8)
    with pytest.raises(breakgraph.HostSyncError, match="the CUDA capture failed") as info:
        ladder.capture((8, 16, 32), lambda size: x[:size] * 2)
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("value", [None, 0, "no"])
def test_progress_that_is_not_a_bool_is_refused(value):
    """A flag taken for its truth value read ``"no"`` as on (a line per bucket on stderr)."""
    with pytest.raises(InputError, match="GraphLadder: progress must be True or False"):
        GraphLadder(backend="emulated", progress=value)
