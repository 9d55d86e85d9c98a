"""Regression tests for issue 11: no silent wrong answer, no raw or misleading error.

Each test reproduces one report of the new-user trial (item numbers in the test names) and
fails on the code before the fix. Core behaviours run on both backends.
"""

import dataclasses
import functools
import textwrap

import pytest
import torch

import breakgraph
from breakgraph import CaptureError, CopyBackError, HostSyncError, InputError
from breakgraph.runner import BucketedRunner
from breakgraph.testing import assert_replay_matches_eager
from tests.helpers import (
    assert_clean,
    fresh_into,
    fresh_process_check,
    fresh_process_result,
)

# -- 1. copy-back into an argument -----------------------------------------------------------------


def test_01_returned_argument_then_new_tensor_raises(capture, device):
    state = {"clamp": False}

    @breakgraph.eager_on_graph
    def maybe_clamp(h):
        return h.clamp(max=1.5) if state["clamp"] else h

    x = torch.randn(8, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g):
        h = x + 1
        y = maybe_clamp(h)
        out = h + y
    fresh_into(x)
    g.replay()  # still returns its argument: fine
    torch.testing.assert_close(out, (x + 1) * 2)
    state["clamp"] = True
    with pytest.raises(CopyBackError, match="maybe_clamp"):
        g.replay()


def test_01_identity_capture_stub_of_a_function_returning_new_tensors_raises(capture, device):
    """The issue's example: an identity stub stands for an in-place function; a real function
    that returns a new tensor must not be copied into the user's input (101, 10001, ...)."""

    @breakgraph.eager_on_graph(capture_stub=lambda x: x)
    def expensive(x):
        return x * 100 + 1

    static = torch.randn(4, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g):
        y = expensive(static) * 1
    before = static.clone()
    with pytest.raises(CopyBackError, match="expensive.*own argument"):
        g.replay()
    torch.testing.assert_close(static, before)  # the user's input is untouched


def test_01_identity_capture_stub_of_an_inplace_function_keeps_the_aliasing(capture, device):
    """Found by the fuzzer: an in-place function with an identity stub (a stubbed in-place
    all-reduce): its output IS its argument, in the graph as in eager."""

    @breakgraph.eager_on_graph(capture_stub=lambda t: t)
    def all_reduce_(t):
        return t.mul_(2.0)

    x = torch.randn(4, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g):
        h = x * 1.0
        r = all_reduce_(h)
        r.add_(1.0)
        out = h * 1.0
    for _ in range(2):
        x2 = fresh_into(x)
        g.replay()
        torch.testing.assert_close(out, x2 * 2 + 1)


def test_break_raising_inside_inference_mode_leaves_the_process_usable(capture, device):
    """Found by the fuzzer: a break that raises inside torch.inference_mode() entered inside the
    capture block must not leave torch's dispatch state broken."""

    @breakgraph.eager_on_graph
    def refuse(a):
        raise ValueError("not today")

    g = breakgraph.BreakableCUDAGraph()
    with pytest.raises(ValueError, match="not today"):
        with capture(g):
            with torch.inference_mode():
                refuse(torch.randn(2, device=device) * 2)
    assert_clean(g)
    generator = torch.Generator(device=device).manual_seed(0)
    torch.randn(3, generator=generator, device=device)  # crashed inside torch before the fix


def test_01_inplace_function_returning_a_view_of_its_argument(capture, device):
    @breakgraph.eager_on_graph
    def add_one_(x):
        x.add_(1)
        return x.view(2, 2)  # a new view object of the argument on every call

    static = torch.randn(4, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g):
        h = static * 2
        out = add_one_(h) * 3
    x = fresh_into(static)
    g.replay()
    torch.testing.assert_close(out, ((x * 2 + 1) * 3).view(2, 2))


# -- 2. replay inside another capture --------------------------------------------------------------


def test_02_replay_inside_a_capture_raises(capture, device):
    @breakgraph.eager_on_graph
    def double(t):
        return t * 2

    x = torch.randn(3, device=device)
    inner = breakgraph.BreakableCUDAGraph()
    with capture(inner):
        y = double(x) + 1
    outer = breakgraph.BreakableCUDAGraph()
    with pytest.raises(CaptureError, match="replay"):
        with capture(outer):
            z = x * 3
            inner.replay()
    assert_clean(outer)
    inner.replay()  # the inner graph still works


def test_02_runner_call_inside_a_capture_raises(capture, device, backend):
    runner = BucketedRunner(
        lambda t: t * 2, (4,), (torch.randn(1, 2, device=device),), backend=backend
    )
    outer = breakgraph.BreakableCUDAGraph()
    with pytest.raises(CaptureError):
        with capture(outer):
            runner(torch.randn(3, 2, device=device))
    assert_clean(outer)


# -- 3. runner outputs of every structure ----------------------------------------------------------


@dataclasses.dataclass
class Out:
    rows: torch.Tensor
    total: torch.Tensor


class Plain:
    def __init__(self, rows):
        self.rows = rows


@pytest.mark.parametrize("kind", ["dataclass", "object"])
def test_03_runner_slices_and_owns_dataclass_and_object_outputs(backend, device, kind):
    def fn(x):
        rows = x * 2
        return Out(rows, rows.sum(0)) if kind == "dataclass" else Plain(rows)

    runner = BucketedRunner(fn, (8,), (torch.randn(1, 3, device=device),), backend=backend)
    x = torch.randn(5, 3, device=device)
    out = runner(x, owned=True)
    assert out.rows.shape == (5, 3)  # trimmed to the input size
    torch.testing.assert_close(out.rows, x * 2)
    runner(torch.randn(5, 3, device=device))  # the next call must not change an owned result
    torch.testing.assert_close(out.rows, x * 2)


# -- 4. PrefillOutput.cache after a failed prefill: see test_transformers.py -----------------------

# -- 5. emulated backend fidelity ------------------------------------------------------------------


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.unsqueeze_(0),
        lambda t: t.t_(),
        lambda t: t.transpose_(0, 1),
        lambda t: t.squeeze_(),
        lambda t: t.as_strided_((3, 2), (1, 3)),
    ],
    ids=["unsqueeze_", "t_", "transpose_", "squeeze_", "as_strided_"],
)
def test_05_inplace_metadata_ops_are_not_reapplied(capture, device, op):
    x = torch.randn(2, 3, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g):
        h = x * 2
        op(h)
        out = h + 1
    shape = out.shape
    for _ in range(3):
        x2 = fresh_into(x)
        g.replay()
        h2 = x2 * 2
        op(h2)
        assert out.shape == shape
        torch.testing.assert_close(out, h2 + 1)


def test_05_replay_ignores_autocast_at_replay_time(capture, device):
    x, w = torch.randn(4, 4, device=device), torch.randn(4, 4, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g):
        y = x @ w
    fresh_into(x)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        g.replay()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ w)  # full precision, as captured


def test_05_inference_mode_inside_the_capture_block(capture, device):
    x = torch.randn(4, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g):
        with torch.inference_mode():
            y = x.exp() + 1
    fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, x.exp() + 1)


# -- 6. objects with __slots__ ---------------------------------------------------------------------


class Slotted:
    __slots__ = ("value", "tag")

    def __init__(self, value, tag="a"):
        self.value, self.tag = value, tag


@pytest.mark.parametrize("check_values", [True, False])
def test_06_slots_objects_are_copied_back(capture, device, check_values):
    @breakgraph.eager_on_graph(check_values=check_values)
    def make(t):
        return Slotted(t * 2)

    x = torch.randn(3, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g):
        out = make(x).value + 1
    x2 = fresh_into(x)
    g.replay()
    torch.testing.assert_close(out, x2 * 2 + 1)


def test_06_slots_change_is_reported_as_a_tensor_problem(capture, device):
    calls = {"n": 0}

    @breakgraph.eager_on_graph
    def make(t):
        calls["n"] += 1
        return Slotted(t * 2 if calls["n"] == 1 else torch.zeros(5, device=t.device))

    x = torch.randn(3, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g):
        make(x)
    with pytest.raises(CopyBackError, match=r"output\.value.*shape"):
        g.replay()


# -- 7. PrefillRunner heads: see test_transformers.py ----------------------------------------------

# -- 9. an eager function's exception caught inside the capture block ------------------------------


def test_09_caught_exception_in_eager_function_raises_capture_error(capture, device):
    @breakgraph.eager_on_graph
    def fails(t):
        raise ValueError("boom")

    x = torch.randn(3, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with pytest.raises(CaptureError, match="fails"):
        with capture(g):
            y = x * 2
            try:
                fails(y)
            except ValueError:
                pass
            z = y + 1
    assert_clean(g)


def test_09_caught_host_sync_inside_the_capture_block_raises_capture_error(capture, device):
    """A sync refused inside a segment and caught there (a library's broad ``except
    RuntimeError`` fallback) fails the capture: the operation never ran, so the fallback
    branch would be captured and every replay would silently differ from eager."""

    def count_positive(t):
        try:
            return int((t > 0).sum())  # a host sync: refused before it runs
        except RuntimeError:
            return 0

    x = torch.randn(8, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with pytest.raises(CaptureError, match=r"HostSyncError.*count_positive.*caught inside"):
        with capture(g):
            x * (count_positive(x) + 1)
    assert_clean(g)


def test_09_caught_draw_from_an_own_generator_raises_capture_error(capture, device):
    generator = torch.Generator(device=device).manual_seed(0)
    g = breakgraph.BreakableCUDAGraph()
    with pytest.raises(CaptureError, match=r"torch\.Generator of your own.*caught inside"):
        with capture(g):
            try:
                torch.randn(3, device=device, generator=generator)
            except CaptureError:
                pass
    assert_clean(g)


def test_09_a_close_that_raises_leaves_no_capture(monkeypatch):
    """Closing a finished capture can raise (restoring a patch that other code replaced
    warns, an error under ``-W error``): the graph then holds nothing, as after any failure."""
    import warnings

    from breakgraph.errors import BreakgraphWarning

    original = torch.cuda.is_current_stream_capturing
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", original)  # restored after
    x = torch.randn(3)
    g = breakgraph.BreakableCUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BreakgraphWarning)
        with pytest.raises(BreakgraphWarning, match="replaced by other code"):
            with breakgraph.capture(g, backend="emulated"):
                x * 2
                torch.cuda.is_current_stream_capturing = lambda: False  # other code's patch
    torch.cuda.is_current_stream_capturing = original
    assert_clean(g)
    with breakgraph.capture(g, backend="emulated"):  # and the graph captures again
        y = x * 3
    g.replay()
    torch.testing.assert_close(y, x * 3)


# -- 10. expanded (stride-0) outputs ---------------------------------------------------------------


def test_10_expanded_output_is_rejected_at_capture(capture, device):
    @breakgraph.eager_on_graph
    def broadcast(t):
        return t.sum().expand(4)

    x = torch.randn(4, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with pytest.raises(CopyBackError, match="broadcast"):
        with capture(g):
            broadcast(x * 1)
    assert_clean(g)


# -- 11. reference cycles --------------------------------------------------------------------------


def test_11_reference_cycle_in_output_is_a_copy_back_error(capture, device):
    class Node:
        pass

    @breakgraph.eager_on_graph
    def cyclic(t):
        node = Node()
        node.value, node.me = t * 2, node
        return node

    x = torch.randn(2, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with pytest.raises(CopyBackError, match="cycle"):
        with capture(g):
            cyclic(x)
    assert_clean(g)


def test_11_arguments_may_hold_back_references_enums_and_loggers(capture, device):
    """An eager function's arguments are searched for tensors, not rebuilt: a parent pointer,
    a logger (whose manager points back at it) or an Enum member (whose class holds every
    member) used to fail the capture as a 'reference cycle'. An Enum returned is a value."""
    import enum
    import logging

    class Mode(enum.Enum):
        FAST = 1
        SLOW = 2

    class Node:
        def __init__(self, weight, parent=None):
            self.weight, self.parent, self.children = weight, parent, []
            self.log = logging.getLogger("breakgraph-test")
            if parent is not None:
                parent.children.append(self)

    @breakgraph.eager_on_graph
    def act(h, mode, node):
        out = h.relu() if mode is Mode.FAST else h.tanh()
        return out * node.weight + node.parent.weight, Mode.SLOW

    root = Node(torch.randn(4, device=device))
    leaf = Node(torch.randn(4, device=device), parent=root)
    x = torch.randn(4, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g):
        y, mode = act(x * 1, Mode.FAST, leaf)
    assert mode is Mode.SLOW
    for _ in range(2):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, new.relu() * leaf.weight + root.weight)


# -- 12. the user's own RuntimeError ---------------------------------------------------------------


def test_12_user_runtime_error_mentioning_capture_is_not_translated(capture, device):
    x = torch.randn(2, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="while capturing the moment") as info:
        with capture(g):
            x * 2
            raise RuntimeError("failed while capturing the moment during capture")
    assert not isinstance(info.value, HostSyncError)
    assert_clean(g)


# -- 14. inference_mode ----------------------------------------------------------------------------


def test_14_inplace_break_captured_in_inference_mode_replays_outside(capture, device):
    @breakgraph.eager_on_graph
    def bump_(t):
        return t.add_(1)

    with torch.inference_mode():
        x = torch.randn(3, device=device)
        g = breakgraph.BreakableCUDAGraph()
        with capture(g):
            h = x * 2
            out = bump_(h) * 3
    x2 = torch.randn(3, device=device)
    with torch.inference_mode():
        x.copy_(x2)
    g.replay()
    torch.testing.assert_close(out, (x2 * 2 + 1) * 3)


def test_14_runner_built_in_inference_mode_serves_outside(backend, device):
    with torch.inference_mode():
        runner = BucketedRunner(
            lambda t: t * 2, (4,), (torch.randn(1, 2, device=device),), backend=backend
        )
    x = torch.randn(3, 2, device=device)
    torch.testing.assert_close(runner(x), x * 2)


# -- 15. InputError instead of raw errors ----------------------------------------------------------


def test_15_example_inputs_must_be_a_sequence(backend, device):
    with pytest.raises(InputError, match="example_inputs"):
        BucketedRunner(lambda t: t, (4,), torch.randn(1, 2, device=device), backend=backend)


@pytest.mark.parametrize("bad", [[0], [-5], [2.5], ["8"]])
def test_15_add_buckets_validates_sizes(backend, device, bad):
    runner = BucketedRunner(
        lambda t: t * 2, (4,), (torch.randn(1, 2, device=device),), backend=backend
    )
    with runner.capture_window(), pytest.raises(InputError, match="bucket"):
        runner.add_buckets(bad)
    assert runner.buckets == (4,)


@pytest.mark.parametrize("bad", [[0], [2.5], [], ["8"]])
def test_15_constructor_validates_sizes(backend, device, bad):
    with pytest.raises(InputError, match="bucket"):
        BucketedRunner(lambda t: t, bad, (torch.randn(1, 2, device=device),), backend=backend)


@pytest.mark.parametrize(
    "name, value",
    [("fn", None), ("max_padding_fraction", "0.5"), ("max_padding_fraction", True),
     ("agree_size", "max"), ("capture_context", 5), ("dims", True)],  # fmt: skip
)
def test_15_constructor_validates_its_other_arguments(backend, device, name, value):
    """A wrong argument is refused where it is given, naming it, not with a TypeError at the
    first call that uses it."""
    arguments = {"fn": lambda t: t * 2, "buckets": (4,), "backend": backend,
                 "example_inputs": (torch.randn(1, 2, device=device),), name: value}  # fmt: skip
    with pytest.raises(InputError, match=name):
        BucketedRunner(**arguments)


def test_15_route_validates_its_arguments(backend, device):
    runner = BucketedRunner(lambda t: t * 2, (4, 8), (torch.randn(1, 2, device=device),),
                            backend=backend)  # fmt: skip
    for times, margin in (({4: "fast", 8: 1.0}, 0.02), ({4: 1.0, 8: 1.0}, "x"), ([4, 8], 0.02)):
        with pytest.raises(InputError, match="route"):
            runner.ladder.route(times, margin)
    assert runner.ladder.route({4: 2.0, 8: 1.0}, 0.02) == {4: 8}


def test_15_capture_stub_must_be_callable():
    with pytest.raises(InputError, match="capture_stub"):
        breakgraph.eager_on_graph(capture_stub="oops")


def test_15_agree_size_smaller_than_the_size_is_rejected(backend, device):
    runner = BucketedRunner(
        lambda t: t * 2,
        (4, 8),
        (torch.randn(1, 2, device=device),),
        backend=backend,
        agree_size=lambda n: n - 1,
    )
    with pytest.raises(InputError, match="agree_size"):
        runner(torch.randn(3, 2, device=device))


def test_15_fingerprints_read_every_value_of_tensors_inside_containers():
    """Prompts passed as a list: fingerprinted by repr, values were rounded to four decimals
    and long tensors elided (a rank mismatch went unseen), and autograd state counted."""
    from breakgraph.distributed import fingerprint

    a, b = torch.zeros(5000, dtype=torch.long), torch.zeros(5000, dtype=torch.long)
    b[2500] = 1
    assert fingerprint([a]) != fingerprint([b])
    assert fingerprint({"ids": a}) != fingerprint({"ids": b})
    assert fingerprint([torch.tensor([1.00001])]) != fingerprint([torch.tensor([1.00002])])
    t = torch.randn(3, requires_grad=True) * 2
    assert fingerprint([t]) == fingerprint([t.detach()]) == fingerprint([t.detach().clone()])
    assert fingerprint([[1], 2]) != fingerprint([1, [2]])
    assert fingerprint([3, 5]) != fingerprint([5, 3])
    assert fingerprint([a.numpy()]) != fingerprint([b.numpy()])  # numpy elides long arrays too


# inf and nan raised timedelta's OverflowError and ValueError, 1e13 s gloo's "Invalid timeout"
@pytest.mark.parametrize("bad", [None, "30", 0, -1.0, float("inf"), float("nan"), 1e13])
def test_15_rank_group_timeout_must_be_a_positive_number(bad):
    from breakgraph.distributed import RankGroup

    with pytest.raises(InputError, match="RankGroup: timeout must be"):
        RankGroup(timeout=bad)


# -- 16. assert_replay_matches_eager ---------------------------------------------------------------


def test_16_objects_and_nans_compare_by_value(backend):
    class Result:
        def __init__(self, t, note):
            self.t, self.note = t, note

    def fn(x):
        return Result(x * 2, "ok"), x / 0 * 0  # NaN everywhere

    assert_replay_matches_eager(fn, lambda: torch.randn(3), backend="emulated", equal_nan=True)


def test_16_objects_that_differ_still_fail(backend):
    class Result:
        def __init__(self, t):
            self.t = t

    counter = {"n": 0}

    def fn(x):
        counter["n"] += 1
        return Result(x * counter["n"])  # eager and replay disagree

    with pytest.raises(AssertionError, match=r"output\.t"):
        assert_replay_matches_eager(fn, lambda: torch.randn(3), backend="emulated")


# -- docs and names --------------------------------------------------------------------------------


def test_break_names_have_no_addresses(capture, device):
    class Scaler:
        def __call__(self, t):
            return t * 2

    def scale(t, factor):
        return t * factor

    x = torch.randn(2, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g):
        breakgraph.eager_on_graph(Scaler())(x)
        breakgraph.eager_on_graph(functools.partial(scale, factor=3))(x)
    assert g.break_names == ["Scaler", "partial(scale)"]
    assert "0x" not in repr(g)


def test_stale_break_argument_names_the_eager_function(capture, device):
    @breakgraph.eager_on_graph
    def consume(t):
        return t * 2

    x = torch.randn(3, device=device)
    arg = torch.randn(3, device=device)
    g = breakgraph.BreakableCUDAGraph()
    with capture(g, debug=True):
        y = consume(arg) + x
    arg.set_(torch.randn(3, device=device))
    with pytest.raises(breakgraph.StaleTensorError, match="consume"):
        g.replay()


# -- 8. compiled runner after torch.compile(mode="reduce-overhead") (CUDA) -------------------------


fresh_process_check(
    "graphs survive cuBLAS workspace clearing",
    textwrap.dedent(
        """
        import torch, breakgraph
        torch.manual_seed(0)
        w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
        x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)

        @breakgraph.eager_on_graph
        def host(t):
            return t * 1

        graphs = []
        for _ in range(2):
            g = breakgraph.BreakableCUDAGraph()
            with breakgraph.capture(g):
                y = host(x @ w) @ w
            graphs.append((g, y))
        torch._C._cuda_clearCublasWorkspaces()   # what cudagraph trees do around their captures
        junk = [torch.full((1 << 19,), 7.0, device="cuda") for _ in range(512)]  # freed memory
        for _ in range(5):
            x.copy_(torch.randn_like(x))
            for g, y in graphs:
                g.replay()
                torch.testing.assert_close(y, (x @ w) @ w, atol=2e-2, rtol=2e-2)
        torch.cuda.synchronize()
        assert all(bool((j == 7.0).all()) for j in junk), "a graph wrote into freed memory"
        """
    ),
)


@pytest.mark.requires_cuda
@pytest.mark.fresh_process
def test_08_graphs_survive_cublas_workspace_clearing():
    """cudagraph trees (torch.compile reduce-overhead) free cuBLAS workspaces; ours must survive.
    In a process of its own (the clearing is process-wide), shared with the other such checks
    (``helpers.fresh_process_check``)."""
    passed, output = fresh_process_result("graphs survive cuBLAS workspace clearing")
    assert passed, output


# -- found by the fuzzer: composite copies that are annotated as views -----------------------------


def test_copying_composites_under_inference_mode_are_replayed(capture, device):
    """Under inference_mode the emulator sees reshape/contiguous/flatten undecomposed; their
    schema says "view" but they copy when they must, and that copy must run on every replay."""
    with torch.inference_mode():
        x = torch.randn(3, 4, device=device)
        g = breakgraph.BreakableCUDAGraph()
        with capture(g):
            a = x.t().reshape(12) * 1
            b = x.t().contiguous() + 0
            c = x.t().flatten()
        for _ in range(2):
            x.copy_(torch.randn(3, 4, device=device))
            g.replay()
            torch.testing.assert_close(a, x.t().reshape(12))
            torch.testing.assert_close(b, x.t().contiguous())
            torch.testing.assert_close(c, x.t().flatten())


@pytest.mark.parametrize(
    "method, match",
    [
        ("end_segment", "ending the segment"),
        ("begin_segment", r"beginning the segment after '.*step' raised"),
    ],
    ids=["ending", "beginning"],
)
def test_a_segment_that_cannot_end_or_begin_caught_inside_the_block_fails_the_capture(
    capture, device, method, match
):
    """Like item 9, when the segment before a break cannot be ended (a stream error, say), or
    the one after it cannot begin (CUDA's capture_begin out of memory, say). The second was not
    marked, so the block's end tried to end a segment that never began and raised a raw
    AttributeError ('NoneType' ...) instead of naming what failed."""

    @breakgraph.eager_on_graph
    def step(t):
        return t * 2

    g = breakgraph.BreakableCUDAGraph()
    x = torch.randn(3, device=device)
    with pytest.raises(CaptureError, match=match):
        with capture(g):
            session = breakgraph.state.current_capture().session
            original = getattr(session, method)

            def broken(*args):
                setattr(session, method, original)  # fails once
                raise RuntimeError(f"the segment could not {method}")

            setattr(session, method, broken)
            try:
                step(x * 1)
            except RuntimeError:
                pass
    assert_clean(g)
