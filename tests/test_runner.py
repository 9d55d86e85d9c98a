"""BucketedRunner: buckets, padding hygiene, validation, capture-phase discipline, counters.

Every test runs on both backends through the ``backend``/``device`` fixtures.
"""

import weakref

import pytest
import torch

import breakgraph
from breakgraph import CaptureError, InputError, ReplayError
from breakgraph.runner import BucketedRunner
from tests.helpers import assert_clean

BUCKETS = (4, 16, 64)


@breakgraph.eager_on_graph
def scale_real_rows(h):
    """Host-dependent: only the live rows (the call's context) are normalised."""
    n = breakgraph.replay_context()
    out = h.clone()
    out[:n] = h[:n] / (h[:n].abs().amax() + 1)
    return out


def make(device, backend, **kwargs):
    torch.manual_seed(0)
    w = torch.randn(8, 8, device=device)

    def model(x):
        return scale_real_rows(torch.relu(x @ w)) @ w.t()

    kwargs.setdefault("capture_context", lambda size: size)
    runner = BucketedRunner(
        model, BUCKETS, (torch.randn(1, 8, device=device),), backend=backend, warmup=1, **kwargs
    )
    return runner, model


def eager(model, x):
    with breakgraph.context_scope(x.shape[0]):
        return model(x)


def test_random_sizes_match_eager(backend, device):
    runner, model = make(device, backend)
    assert runner.buckets == BUCKETS
    sizes = torch.randint(1, 65, (25,), generator=torch.Generator().manual_seed(3)).tolist()
    for n in sizes + [4, 16, 64, 1]:
        x = torch.randn(n, 8, device=device)
        out = runner(x, context=n)
        assert out.shape == (n, 8)
        torch.testing.assert_close(out, eager(model, x), atol=1e-5, rtol=1e-5)
    assert sum(runner.stats.calls.values()) == len(sizes) + 4
    assert all(runner.stats.calls[b] > 0 for b in BUCKETS)
    assert runner.stats.eager_fallbacks == {}


def test_poisoned_tail_never_reaches_outputs(backend, device):
    runner, model = make(device, backend)
    (buffer,) = runner.static_inputs(16)
    for n in (5, 9, 15):  # all served by bucket 16
        buffer.fill_(float("nan"))  # stale garbage in the whole static buffer
        x = torch.randn(n, 8, device=device)
        out = runner(x, context=n)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, eager(model, x), atol=1e-5, rtol=1e-5)
        assert (buffer[n:] == 0).all()  # the tail was written with the pad value


def test_pad_values_are_written(backend, device):
    runner, _ = make(device, backend, pad_values=-3.0)
    runner(torch.randn(5, 8, device=device), context=5)
    assert (runner.static_inputs(16)[0][5:] == -3.0).all()


def test_outputs_live_in_graph_memory_unless_owned(backend, device):
    runner, model = make(device, backend)
    x1, x2 = torch.randn(10, 8, device=device), torch.randn(10, 8, device=device)
    shared = runner(x1, context=10)
    owned = runner(x1, context=10, owned=True)
    runner(x2, context=10)
    torch.testing.assert_close(shared, eager(model, x2), atol=1e-5, rtol=1e-5)  # overwritten
    torch.testing.assert_close(owned, eager(model, x1), atol=1e-5, rtol=1e-5)  # kept


class Tagged(list):
    """A list subclass with an attribute of its own (set after construction)."""


class Batch(list):
    """A list subclass whose constructor takes more than its items."""

    def __init__(self, items, meta):
        super().__init__(items)
        self.meta = meta


def test_list_subclass_outputs_keep_their_attributes_or_are_refused_by_name(backend, device):
    """Trimming and ``owned=True`` rebuild every container: a list subclass came back without
    the attributes it held (``out.lengths`` raised AttributeError on the new one), and one whose
    constructor takes more than its items raised the constructor's raw TypeError."""

    def tagged(x):
        out = Tagged([x * 2])
        out.lengths = "per-row"
        return out

    runner = BucketedRunner(tagged, (8,), (torch.randn(1, 3, device=device),), backend=backend)
    x = torch.randn(5, 3, device=device)
    for out in (runner(x), runner(x, owned=True)):
        assert type(out) is Tagged and out.lengths == "per-row"
        torch.testing.assert_close(out[0], x * 2)  # trimmed to the 5 rows
    runner = BucketedRunner(lambda x: Batch([x * 2], "m"), (8,),
                            (torch.randn(1, 3, device=device),), backend=backend)  # fmt: skip
    with pytest.raises(breakgraph.structure.StructureError, match=r"a Batch cannot be rebuilt.*"
                       r"slice_outputs=False and owned=False.* at output$"):  # fmt: skip
        runner(x)


@pytest.mark.parametrize(
    "bad, phrase",
    [
        (lambda d: torch.randn(3, 8, 1, device=d), "dimensions"),
        (lambda d: torch.randn(3, 8, device=d).double(), "dtype"),
        (lambda d: torch.randn(3, 7, device=d), "shape"),
        (lambda d: torch.randn(0, 8, device=d), "empty"),
        (lambda d: [[1.0] * 8], "must be a tensor"),
        (lambda d: torch.randn(3, 8, device="meta"), "device"),
    ],
)
def test_bad_inputs_raise_before_copying(backend, device, bad, phrase):
    runner, _ = make(device, backend)
    buffer = runner.static_inputs(4)[0]
    before = buffer.clone()
    with pytest.raises(InputError, match=phrase):
        runner(bad(device), context=3)
    assert torch.equal(buffer, before) or torch.isnan(before).any()


def test_oversize_raises_or_runs_eagerly(backend, device):
    runner, model = make(device, backend, on_miss="raise")
    with pytest.raises(InputError, match="exceeds the largest bucket 64"):
        runner(torch.randn(65, 8, device=device), context=65)
    runner, model = make(device, backend, on_miss="eager")
    x = torch.randn(100, 8, device=device)
    torch.testing.assert_close(runner(x, context=100), eager(model, x), atol=1e-5, rtol=1e-5)
    assert runner.stats.eager_fallbacks == {"larger than every bucket": 1}
    assert runner.buckets == BUCKETS  # nothing was captured on the fly


def test_capture_only_inside_a_window(backend, device):
    runner, model = make(device, backend)
    with pytest.raises(CaptureError, match="capture_window"):
        runner.add_buckets([128])
    with runner.capture_window():
        runner.add_buckets([128])
        x = torch.randn(200, 8, device=device)  # a miss inside the window captures its size
        torch.testing.assert_close(runner(x, context=200), eager(model, x), atol=1e-5, rtol=1e-5)
    assert runner.buckets == BUCKETS + (128, 200)
    x = torch.randn(100, 8, device=device)
    torch.testing.assert_close(runner(x, context=100), eager(model, x), atol=1e-5, rtol=1e-5)
    assert runner.stats.calls[128] == 1


def test_padding_fraction_falls_back_to_eager(backend, device):
    runner, model = make(device, backend, max_padding_fraction=0.5)
    x = torch.randn(17, 8, device=device)  # bucket 64 would be 73% padding
    torch.testing.assert_close(runner(x, context=17), eager(model, x), atol=1e-5, rtol=1e-5)
    assert runner.stats.eager_fallbacks == {"too much padding": 1}
    runner(torch.randn(40, 8, device=device), context=40)
    assert runner.stats.calls[64] == 1


def test_agree_size_picks_the_same_bucket_for_every_rank(backend, device):
    seen = []

    def agree(size):  # stands in for an all-reduce MAX across ranks
        seen.append(size)
        return 50

    runner, model = make(device, backend, agree_size=agree, max_padding_fraction=0.5)
    x = torch.randn(3, 8, device=device)  # alone it would take bucket 4 (or go eager)
    torch.testing.assert_close(runner(x, context=3), eager(model, x), atol=1e-5, rtol=1e-5)
    assert seen == [3] and runner.stats.calls[64] == 1 and runner.stats.eager_fallbacks == {}


def test_stats_table_and_close(backend, device):
    runner, _ = make(device, backend)
    runner(torch.randn(3, 8, device=device), context=3)
    table = str(runner.stats)
    assert "bucket" in table and "eager fallbacks: none" in table
    assert runner.stats.padded_elements[4] == 1
    assert set(runner.stats.capture_seconds) == set(BUCKETS)
    runner.close()
    with pytest.raises(ReplayError, match="closed"):
        runner(torch.randn(3, 8, device=device), context=3)


def test_all_buckets_share_one_pool(backend, device):
    runner, _ = make(device, backend)
    pools = {
        id(runner.graph(b).pool()) if backend == "emulated" else runner.graph(b).pool()
        for b in BUCKETS
    }
    assert len(pools) == 1


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        (dict(buckets=()), "positive"),
        (dict(buckets=(0, 4)), "positive"),
        (dict(on_miss="maybe"), "on_miss"),
        (dict(max_padding_fraction=1.5), "max_padding_fraction"),
        (dict(example_inputs=()), "example_inputs"),
        (dict(dims=5), "out of range"),
        (dict(warmup=-1), "warmup must be an int >= 0"),
        (dict(warmup=1.5), "warmup must be an int >= 0"),
        (dict(pad_values=(0, 1)), "pad_values"),
        (dict(ranks=object(), warmup=0), r"with ranks=, collectives must run eagerly"),
        # not a bare AttributeError ('str' object has no attribute 'agree_settings')
        (dict(ranks="nccl"), r"BucketedRunner: ranks must be a breakgraph\.distributed\.RankGroup"),
        (dict(static_inputs=[torch.zeros(1, 8)]), r"BucketedRunner: static_inputs must be a .*Sta"),
    ],
)
def test_bad_configuration(backend, device, kwargs, phrase):
    args = dict(
        fn=lambda x: x * 2,
        buckets=(4,),
        example_inputs=(torch.randn(1, 8, device=device),),
        backend=backend,
    )
    args.update(kwargs)
    with pytest.raises(InputError, match=phrase):
        BucketedRunner(**args)


def test_sizes_that_are_not_sizes_are_refused(backend, device):
    runner, _ = make(device, backend)
    for bad in (-1, 2.5, True, None):
        with pytest.raises(InputError, match="BucketedRunner.decide: size must be an int >= 0"):
            runner.decide(bad)
        with pytest.raises(InputError, match="BucketedRunner.bucket_for: size must be an int"):
            runner.bucket_for(bad)
    assert runner.decide(0).bucket == runner.bucket_for(3) == 4
    with pytest.raises(InputError, match=r"BucketedRunner.static_inputs: no bucket 5"):
        runner.static_inputs(5)


def test_negative_dims_trim_outputs_where_the_first_input_has_its_bucketed_dimension(
    backend, device
):
    """``dims=-1`` on token ids ``[batch, tokens]``: the hidden states ``[batch, tokens,
    hidden]`` are trimmed along dimension 1, the ids' bucketed one counted from the start (not
    their own last dimension, which would leave the pad rows in)."""
    embed = torch.nn.Embedding(16, 4).to(device)
    runner = BucketedRunner(
        lambda ids: (embed(ids), ids * 2),
        buckets=(8,), example_inputs=(torch.zeros(1, 1, dtype=torch.long, device=device),),
        dims=-1, backend=backend, warmup=1,
    )  # fmt: skip
    for n in (5, 2, 8):
        ids = torch.randint(16, (1, n), device=device)
        with torch.no_grad():
            hidden, doubled = runner(ids)
            torch.testing.assert_close(hidden, embed(ids))  # [1, n, 4], no padding rows
        torch.testing.assert_close(doubled, ids * 2)


# -- tuned routes: a larger bucket that is faster takes the call --------------------------------


def test_a_route_rests_on_two_timings_of_each_bucket():
    """tuned_times: one timing per bucket, then a second of every bucket a route would rest
    on, keeping the lower: a slow sample of one bucket no longer routes its calls away; a
    bucket that is really faster still takes them."""
    from breakgraph.buckets import faster_buckets, tuned_times

    calls = []

    def timer(samples):
        def time_one(size):
            calls.append(size)
            return samples[size].pop(0)

        return time_one

    noisy = {960: [8.0], 1024: [9.2, 8.5], 1152: [8.8, 9.0]}  # 1024's first sample was slow
    times = tuned_times([960, 1024, 1152], timer(noisy))
    assert times == {960: 8.0, 1024: 8.5, 1152: 8.8} and faster_buckets(times) == {}
    assert calls == [960, 1024, 1152, 1024, 1152]  # only the route's two buckets again
    calls.clear()
    real = {200: [3.9], 208: [4.4, 4.3], 224: [4.0, 4.05], 256: [4.3]}
    times = tuned_times([200, 208, 224, 256], timer(real))
    assert faster_buckets(times) == {208: 224}
    assert calls == [200, 208, 224, 256, 208, 224]
    calls.clear()
    assert tuned_times([8, 16], timer({8: [1.0], 16: [1.5]})) == {8: 1.0, 16: 1.5}
    assert calls == [8, 16]  # no route: nothing timed twice
    calls.clear()
    # 16's slow first sample routed it to 64; its second makes it beat 4: that new route's
    # bucket 4 is timed twice too, and keeps its route only if it stays slower
    cascade = {4: [1.0, 0.99], 16: [1.05, 0.95], 64: [1.0, 1.0]}
    times = tuned_times([4, 16, 64], timer(cascade))
    assert calls == [4, 16, 64, 16, 64, 4] and faster_buckets(times) == {4: 16}
    routed = {size for route in faster_buckets(times).items() for size in route}
    assert all(calls.count(size) == 2 for size in routed)


def test_faster_buckets_and_routed_decisions():
    from breakgraph.runner import choose_bucket, faster_buckets

    times = {192: 3.74, 200: 3.80, 208: 4.02, 224: 3.92, 256: 3.90}  # measured on an H200
    routes = faster_buckets(times)
    assert routes == {208: 224}  # 224 and 256 are within the margin of each other: no route
    assert faster_buckets({16: 1.0, 32: 0.5, 64: 0.4}) == {16: 64, 32: 64}
    assert faster_buckets({16: 1.0, 32: 0.995}) == {}  # within the 2 % margin
    buckets = tuple(sorted(times))
    assert choose_bucket(buckets, 201, faster=routes).bucket == 224
    assert choose_bucket(buckets, 200, faster=routes).bucket == 200


@pytest.mark.requires_cuda
def test_tune_times_every_bucket_and_results_stay_right():
    runner, model = make("cuda", "cuda")
    times = runner.tune(repeats=2)
    assert set(times) == set(BUCKETS) and all(t > 0 for t in times.values())
    assert runner.stats.replay_ms == times
    for n in (3, 10, 40):
        x = torch.randn(n, 8, device="cuda")
        torch.testing.assert_close(runner(x, context=n), eager(model, x), atol=1e-5, rtol=1e-5)


def test_tune_is_a_no_op_on_the_emulated_backend():
    runner, _ = make("cpu", "emulated")
    assert runner.tune() == {} and runner.stats.routed == {}


# -- close is final; StaticInputs rejects what the runner rejects -------------------------------


def test_close_is_final(backend, device):
    runner, _ = make(device, backend)
    runner.close()
    with pytest.raises(ReplayError, match="closed"):
        runner.decide(3)
    with pytest.raises(ReplayError, match="closed"):
        runner.bucket_for(3)
    with pytest.raises(ReplayError, match="closed"):  # a capture window does not revive it
        with runner.capture_window():
            runner.add_buckets([8])
    with pytest.raises(ReplayError, match="closed"):
        runner(torch.randn(3, 8, device=device), context=3)
    assert runner.buckets == ()


def test_a_constructor_that_fails_halfway_releases_what_it_captured(backend, device, monkeypatch):
    """A bucket whose capture fails fails the constructor: nobody gets the runner, so nobody can
    close it, and the larger buckets captured before it (largest first) kept their graphs and
    their pool's memory for as long as the exception's traceback lived (a REPL keeps the last
    one). The constructor closes the runner itself."""
    graphs, made = [], []

    class Recorded(breakgraph.BreakableCUDAGraph):
        def __init__(self):
            super().__init__()
            graphs.append(self)

    class Kept(BucketedRunner):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(breakgraph.ladder, "BreakableCUDAGraph", Recorded)
    w = torch.randn(8, 8, device=device)

    def model(x):
        if breakgraph.is_capturing() and x.shape[0] == 4:
            raise RuntimeError("boom")
        return scale_real_rows(torch.relu(x @ w))

    with pytest.raises(RuntimeError, match="boom"):
        Kept(model, BUCKETS, (torch.randn(1, 8, device=device),), backend=backend, warmup=1,
             capture_context=lambda size: size)  # fmt: skip
    (runner,) = made
    assert len(graphs) == len(BUCKETS)  # 64 and 16 captured, 4 failed
    assert all(g.num_segments == 0 for g in graphs), [g.num_segments for g in graphs]
    assert runner.ladder.closed and runner.buckets == ()
    assert_clean()


@pytest.mark.parametrize(
    "bad, phrase",
    [
        (lambda d: torch.ones(1, 2, device=d), "size=3, but the inputs hold 1"),  # 1 row into 3
        (lambda d: torch.ones(3, 1, device=d), "shape"),  # would broadcast along dim 1
        (lambda d: torch.ones(3, 2, device=d, dtype=torch.float64), "dtype"),  # would be cast
        (lambda d: torch.ones(3, 2, 1, device=d), "dimensions"),
    ],
)
def test_static_inputs_fill_never_broadcasts_or_casts(device, bad, phrase):
    from breakgraph.runner import StaticInputs

    spec = StaticInputs((torch.zeros(1, 2, device=device),), dims=0, pad_values=-1.0)
    buffers = spec.allocate(4)
    before = buffers[0].clone()
    with pytest.raises(InputError, match=phrase):
        spec.fill(buffers, (bad(device),), 3)
    assert torch.equal(buffers[0], before)  # nothing was copied
    x = torch.randn(3, 2, device=device)
    with pytest.raises(InputError, match="not a bucket buffer"):
        spec.fill(spec.allocate(2), (x,), 3)  # a bucket smaller than the size
    with pytest.raises(InputError, match="not a bucket buffer"):
        spec.fill((torch.zeros(4, 2, device=device, dtype=torch.float16),), (x,), 3)
    spec.fill(buffers, (x,), 3)
    assert torch.equal(buffers[0][:3], x) and (buffers[0][3:] == -1).all()


def test_static_inputs_errors_name_who_holds_the_spec():
    """A spec built by hand named ``BucketedRunner`` in its errors, which the user never
    built; it names itself now, and a runner's spec still names the runner."""
    from breakgraph.runner import BucketedRunner, StaticInputs

    with pytest.raises(InputError, match=r"^StaticInputs: example_inputs must be a tuple"):
        StaticInputs(torch.zeros(2))
    with pytest.raises(InputError, match=r"^StaticInputs: dims has 2 entries for 1 inputs"):
        StaticInputs((torch.zeros(2),), dims=(0, 0))
    spec = StaticInputs((torch.zeros(1, 2),))
    with pytest.raises(InputError, match=r"^StaticInputs: input 0 has dtype torch.float64"):
        spec.size_of((torch.zeros(3, 2, dtype=torch.float64),))
    with pytest.raises(InputError, match=r"^BucketedRunner: input 0 has dtype torch.float64"):
        BucketedRunner(torch.neg, (4,), (torch.zeros(1, 2),), backend="emulated")(
            torch.zeros(3, 2, dtype=torch.float64)
        )


def test_inputs_of_several_tensors_are_checked_together(backend, device):
    """A count that differs from the spec's, and bucketed sizes that differ between inputs,
    are refused by number before anything is copied (the runner's call and StaticInputs.fill)."""
    runner = BucketedRunner(
        lambda h, w: h * w[:, None], (4, 8),
        (torch.zeros(1, 2, device=device), torch.zeros(1, device=device)),
        backend=backend, warmup=1,
    )  # fmt: skip
    h, w = torch.randn(3, 2, device=device), torch.randn(3, device=device)
    with pytest.raises(InputError, match="expected 2 inputs, got 1"):
        runner(h)
    with pytest.raises(InputError, match="input 1 has bucketed size 2, but input 0 has 3"):
        runner(h, w[:2])
    spec = runner.inputs
    assert spec.device.type == torch.device(device).type  # "cuda:0" against "cuda"
    with pytest.raises(InputError, match="StaticInputs.fill: 1 buffers for 2 inputs"):
        spec.fill(spec.allocate(4)[:1], (h, w), 3)
    assert sum(runner.stats.calls.values()) == 0
    torch.testing.assert_close(runner(h, w), h * w[:, None])


def test_a_slice_outputs_callable_trims_padded_calls(backend, device):
    """``slice_outputs=callable`` trims a padded call its own way (here the second output, a
    ``[1, N]`` row that the default would leave whole); a call at the bucket size goes
    through it too, so that the output's structure never depends on the size."""
    trimmed = []

    def trim(output, size):
        trimmed.append(size)
        return output[0][:size], output[1][:, :size]

    runner = BucketedRunner(
        lambda x: (x * 2, x.sum(1)[None]), (4, 8), (torch.zeros(1, 3, device=device),),
        backend=backend, warmup=1, slice_outputs=trim,
    )  # fmt: skip
    for n in (3, 8, 5):
        x = torch.randn(n, 3, device=device)
        doubled, row = runner(x)
        torch.testing.assert_close(doubled, x * 2)
        torch.testing.assert_close(row, x.sum(1)[None])
    assert trimmed == [3, 8, 5]
    assert (runner.on_miss, runner.max_padding_fraction, runner.agree_size) == ("eager", None, None)


@pytest.mark.parametrize(
    "dtype, pad",
    [
        (torch.int64, 0.5),  # would pad with 0
        (torch.uint8, 300),
        (torch.uint8, -1),
        (torch.bool, 2),
        (torch.int32, float("nan")),
        (torch.float16, 1e6),  # overflows to inf
        (torch.float32, 1e-50),  # underflows to 0
        (torch.float32, "0"),
    ],
)
def test_pad_values_the_dtype_cannot_hold_are_refused(dtype, pad):
    from breakgraph.runner import StaticInputs

    with pytest.raises(InputError, match="pad"):
        StaticInputs((torch.zeros(1, 2, dtype=dtype),), pad_values=pad)
    with pytest.raises(InputError, match="pad"):
        BucketedRunner(lambda x: x, (4,), (torch.zeros(1, 2, dtype=dtype),), pad_values=pad,
                       backend="emulated")  # fmt: skip


@pytest.mark.parametrize(
    "dtype, pad",
    [(torch.int64, 3.0), (torch.int64, -7), (torch.bool, True), (torch.float32, 0.1),
     (torch.bfloat16, -1.5), (torch.float32, float("nan")), (torch.float16, float("-inf"))],
)  # fmt: skip
def test_pad_values_the_dtype_holds_are_written(dtype, pad):
    from breakgraph.runner import StaticInputs

    (buffer,) = StaticInputs((torch.zeros(1, 2, dtype=dtype),), pad_values=pad).allocate(3)
    expected = torch.full((3, 2), pad, dtype=dtype)
    assert torch.equal(buffer, expected) or (buffer.isnan().all() and expected.isnan().all())


def test_inputs_that_require_grad_leave_no_history_in_the_static_buffers(backend, device):
    """The copy into a bucket's buffer was recorded by autograd: the buffer came to require
    grad, and its history (one CopySlices per copy and tail fill) grew by every call and kept
    every earlier call's input alive."""
    import weakref

    runner, model = make(device, backend)
    inputs = []
    for n in (3, 2, 4):
        x = torch.randn(n, 8, device=device, requires_grad=True)
        out = runner(x, context=n)
        torch.testing.assert_close(out, eager(model, x.detach()), atol=1e-5, rtol=1e-5)
        inputs.append(weakref.ref(x))
        del x
    (buffer,) = runner.static_inputs(4)
    assert not buffer.requires_grad and buffer.grad_fn is None
    assert all(ref() is None for ref in inputs)  # nothing keeps the inputs alive


def test_a_runner_built_in_grad_mode_captures_without_autograd(backend, device):
    """Built in the default grad mode over a module with trainable weights: the capture ran
    with grad, so the eager break's ``sigmoid`` output was saved by autograd (memory the graph
    did not own) and the first call raised CopyBackError; outputs carried a stale capture-time
    ``grad_fn``. The runner captures under ``no_grad``, as the docs say the runners do."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).to(device)  # requires_grad weights

    @breakgraph.eager_on_graph
    def gate(h):
        return torch.sigmoid(h)

    def model(x):
        return lin(gate(lin(x)))

    assert torch.is_grad_enabled()
    runner = BucketedRunner(model, (4, 16), (torch.randn(1, 8, device=device),),
                            backend=backend, warmup=1)  # fmt: skip
    for n in (3, 9, 4):
        x = torch.randn(n, 8, device=device)
        out = runner(x)
        assert not out.requires_grad and out.grad_fn is None
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    runner.close()


def test_a_dropped_runner_and_its_graphs_are_freed_at_del(backend, device):
    """``del`` alone (reference counting, the collector off) frees a runner and its graphs,
    eager breaks and capture contexts included, so their pool's memory goes back at once; so
    does an object that keeps a runner over its own methods, handed over with ``weak_method``
    (bound, they would make a reference cycle: object, runner, method, object)."""
    import weakref

    from breakgraph.memory import weak_method
    from tests.helpers import collector_off

    runner, _ = make(device, backend)
    runner(torch.randn(5, 8, device=device), context=5)

    class Owner:
        def __init__(self):
            self.w = torch.randn(8, 8, device=device)
            self.runner = BucketedRunner(
                weak_method(self.forward),
                BUCKETS,
                (torch.randn(1, 8, device=device),),
                backend=backend,
                warmup=1,
                capture_context=weak_method(self.context_of),
            )

        def forward(self, x):
            return scale_real_rows(x @ self.w)

        def context_of(self, size):
            return size

    owner = Owner()
    x = torch.randn(5, 8, device=device)
    with breakgraph.context_scope(5):
        expected = scale_real_rows(x @ owner.w)
    torch.testing.assert_close(owner.runner(x, context=5), expected)
    forward = owner.runner.fn
    with collector_off():
        refs = [weakref.ref(o) for o in (runner, owner, owner.runner)]
        refs += [weakref.ref(r.graph(b)) for r in (runner, owner.runner) for b in BUCKETS]
        del runner, owner
        assert [ref() is None for ref in refs] == [True] * len(refs)
    with pytest.raises(ReplayError, match="Owner.forward: its object was deleted"):
        forward(x)


def test_borrowed_refuses_what_has_no_dense_memory_to_borrow():
    """``borrowed`` of a non-tensor was a bare ``AttributeError``, of a sparse tensor torch's
    ``NotImplementedError``, of a meta tensor "Trying to resize storage"."""
    from breakgraph.memory import borrowed

    bads = [[1.0], torch.randn(3).to_sparse(), torch.empty(3, device="meta")]
    for bad, what in zip(bads, ("got list", "got a torch.sparse_coo tensor", "got a meta tensor")):
        with pytest.raises(InputError, match=f"borrowed: expected a dense tensor .*{what}"):
            borrowed(bad)
    owner = torch.randn(4, 3)[1:]
    alias = borrowed(owner)
    owner.add_(torch.randn(3, 3))
    assert torch.equal(alias, owner) and alias.stride() == owner.stride()


def test_weak_method_takes_bound_methods_only_and_keeps_their_names():
    """``weak_method`` of a plain function or a builtin raised a bare ``AttributeError``; the
    callable it returns carries the method's name and module (break names, pickling errors)."""
    from breakgraph.memory import weak_method

    for bad in (scale_real_rows, len, lambda x: x):
        with pytest.raises(InputError, match="weak_method: expected a bound method"):
            weak_method(bad)

    class Owner:
        def forward(self, x):
            return x

    owner = Owner()
    call = weak_method(owner.forward)
    assert (call.__name__, call.__module__) == ("forward", __name__)
    assert call.__qualname__.endswith("Owner.forward") and call(3) == 3

    class Slotted:  # no __weakref__: refused with the fix, not torch's or weakref's TypeError
        __slots__ = ()

        def forward(self, x):
            return x

    with pytest.raises(InputError, match=r"weak_method: .*Slotted.forward.*__weakref__"):
        weak_method(Slotted().forward)


def test_add_buckets_whose_buffers_fail_to_allocate_keeps_none_of_them(backend, device):
    """add_buckets allocates every new bucket's buffers before capturing; one that failed (out
    of memory) left the buffers allocated before it in the runner, with no graph to read them:
    held until the next capture phase, and memory is what just ran out."""
    made = []

    class Failing(breakgraph.runner.StaticInputs):
        def allocate(self, size):
            if size == 64:
                raise torch.OutOfMemoryError("no memory for bucket 64")
            buffers = super().allocate(size)
            made.append((size, weakref.ref(buffers[0])))
            return buffers

    inputs = Failing((torch.zeros(1, 8, device=device),))
    runner = BucketedRunner(lambda x: x * 2, (4,), backend=backend, static_inputs=inputs)
    with pytest.raises(torch.OutOfMemoryError), runner.capture_window():
        runner.add_buckets((16, 64))
    assert runner.buckets == (4,)
    assert [size for size, ref in made if ref() is not None] == [4]  # bucket 16's went
    with runner.capture_window():  # the runner captures and serves as before
        runner.add_buckets((16,))
    x = torch.randn(9, 8, device=device)
    assert torch.equal(runner(x), x * 2)


@pytest.mark.parametrize(
    "argument, value",
    [("slice_outputs", 0), ("slice_outputs", None), ("slice_outputs", "no"),
     ("warmup_each", "no"), ("eager_region", 1), ("progress", None)],
)  # fmt: skip
def test_flags_that_are_not_bools_are_refused(argument, value):
    """docs/api.md: invalid constructor arguments raise InputError. Taken for its truth value,
    ``slice_outputs=0`` or ``None`` trimmed the outputs as True does (and ``eager_region="no"``
    ran the whole function eagerly), without a word."""
    with pytest.raises(InputError, match=f"BucketedRunner: {argument}"):
        BucketedRunner(lambda x: x * 2, (4,), (torch.zeros(1, 2),), backend="emulated",
                       **{argument: value})  # fmt: skip


def test_slice_outputs_takes_a_callable_and_false():
    whole = BucketedRunner(lambda x: x * 2, (4,), (torch.zeros(1, 2),), backend="emulated",
                           slice_outputs=False)  # fmt: skip
    first_row = BucketedRunner(lambda x: x * 2, (4,), (torch.zeros(1, 2),), backend="emulated",
                               slice_outputs=lambda out, size: out[:1])  # fmt: skip
    x = torch.randn(3, 2)
    assert whole(x).shape == (4, 2)
    assert torch.equal(first_row(x), x[:1] * 2)


@pytest.mark.parametrize(
    "inputs",
    [(torch.zeros(2, 2),), (torch.zeros(2, 2), 3), (torch.zeros(2, 2), torch.zeros(2, 2, 1)),
     (torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.float64)),
     (torch.zeros(2, 2), torch.zeros(2, 3)), (torch.zeros(2, 2), torch.zeros(3, 2)),
     (torch.zeros(0, 2), torch.zeros(0, 2))],
    ids=["count", "not a tensor", "dims", "dtype", "shape", "sizes disagree", "empty"],
)  # fmt: skip
def test_every_refused_input_says_nothing_was_copied(inputs):
    """docs/runner.md: each validation failure raises InputError and says "Nothing was
    copied."; a wrong count, a non-tensor and an empty input did not say it."""
    runner = BucketedRunner(lambda x, y: x * 2 + y, (4,), (torch.zeros(1, 2), torch.zeros(1, 2)),
                            backend="emulated")  # fmt: skip
    with pytest.raises(InputError, match="Nothing was copied"):
        runner(*inputs)


def test_owned_that_is_not_a_bool_is_refused():
    """``owned="no"`` copied the output, as True does (taken for its truth value)."""
    runner = BucketedRunner(lambda x: x * 2, (4,), (torch.zeros(1, 2),), backend="emulated")
    with pytest.raises(InputError, match="BucketedRunner: owned must be True or False"):
        runner(torch.randn(3, 2), owned="no")
    assert runner.stats.replays == 0


def test_run_eagerly_refuses_a_bare_tensor():
    """``run_eagerly(x, ...)`` unpacked the tensor's rows as separate inputs (a raw
    TypeError from ``fn``); it takes a tuple of the inputs."""
    runner = BucketedRunner(lambda x: x * 2, (4,), (torch.zeros(1, 2),), backend="emulated")
    x = torch.randn(3, 2)
    with pytest.raises(InputError, match=r"run_eagerly: inputs must be a tuple.*\(x,\)"):
        runner.run_eagerly(x, None, "test")
    assert torch.equal(runner.run_eagerly((x,), None, "test"), x * 2)


def test_eager_fallback_runs_under_the_graphs_autocast_not_the_callers():
    """Under the caller's ``torch.autocast``, a size that fits a bucket came back in fp32 (the
    graph, captured without autocast) and a size above every bucket in bf16 (the fallback ran
    in the caller's modes): the dtype depended on the size. The fallback now runs under the
    autocast the runner was built under."""
    w = torch.randn(4, 4)
    runner = BucketedRunner(lambda x: (x * 1) @ w + 1, (4, 8), (torch.randn(1, 4),),
                            backend="emulated")  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):
        small, large = torch.randn(3, 4), torch.randn(30, 4)
        assert runner(small).dtype == torch.float32
        out = runner(large)
        assert out.dtype == torch.float32  # was bfloat16
        assert torch.is_autocast_enabled("cpu")  # the caller's autocast is back
    torch.testing.assert_close(out, large @ w + 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        built = BucketedRunner(lambda x: (x * 1) @ w + 1, (4,), (torch.randn(1, 4),),
                               backend="emulated")  # fmt: skip
    assert built(torch.randn(9, 4)).dtype == torch.bfloat16  # built under it: kept


@pytest.mark.parametrize("built", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_bucket_added_under_another_autocast_is_captured_under_the_runners(built):
    """``add_buckets`` (or a call above every bucket inside ``capture_window()``) captured the
    new bucket under the caller's autocast: sizes it served came back in another dtype than
    the other buckets' and the eager fallback's. Every bucket is captured (and warmed up)
    under the autocast the runner was built under; the caller's is back afterwards."""
    w = torch.randn(4, 4)

    def fn(x):
        return (x * 1) @ w + 1

    def autocast(dtype):
        return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)

    with autocast(built):
        runner = BucketedRunner(fn, (4,), (torch.randn(1, 4),), backend="emulated")
    expected = torch.bfloat16 if built else torch.float32
    other = None if built else torch.float16
    with runner.capture_window(), autocast(other):
        runner.add_buckets([8])
        runner(torch.randn(12, 4))  # above every bucket, inside the window: captured
        assert torch.is_autocast_enabled("cpu") == (other is not None)
    assert runner.buckets == (4, 8, 12)
    for rows, caller in [(3, None), (6, other), (10, torch.bfloat16), (30, other)]:
        x = torch.randn(rows, 4)
        with autocast(caller):
            out = runner(x)
        assert out.dtype == expected, (rows, caller)
        with autocast(built):
            torch.testing.assert_close(out, fn(x))


def test_a_slice_outputs_callable_runs_at_an_exact_bucket_size_too():
    """The callable was skipped when the size equalled the bucket: one that reshapes the
    output returned a tensor for 3 rows and the whole tuple for 4."""
    runner = BucketedRunner(lambda a: (a * 2, a.sum()), (4, 8), (torch.zeros(1, 2),),
                            backend="emulated", slice_outputs=lambda o, n: o[0][:n])  # fmt: skip
    for rows in (3, 4, 8):
        x = torch.randn(rows, 2)
        out = runner(x)
        assert isinstance(out, torch.Tensor)
        assert torch.equal(out, x * 2)
