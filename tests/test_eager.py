"""@eager_on_graph: transparent outside a capture, a break inside one, on every kind of callable."""

import inspect

import pytest
import torch
from torch import nn

import breakgraph
from breakgraph import BreakableCUDAGraph, CopyBackError, InputError, eager_on_graph


def fresh_into(static):
    new = torch.randn_like(static)
    static.copy_(new)
    return new


# ---------------------------------------------------------------------------------------
# Outside a capture: exactly the function
# ---------------------------------------------------------------------------------------


def scaled_sum(x: torch.Tensor, scale: float = 2.0, *, offset: int = 0) -> torch.Tensor:
    """Multiply, sum, shift."""
    if scale == 0:
        raise ValueError("scale must not be zero")
    return (x * scale).sum() + offset


decorated_scaled_sum = eager_on_graph(scaled_sum)


def test_outside_capture_behaves_like_the_function(device):
    x = torch.randn(5, device=device)
    for args, kwargs in [((x,), {}), ((x, 3.5), {"offset": 4}), ((), {"x": x, "scale": -1.0})]:
        torch.testing.assert_close(
            decorated_scaled_sum(*args, **kwargs), scaled_sum(*args, **kwargs)
        )
    with pytest.raises(ValueError, match="scale must not be zero"):
        decorated_scaled_sum(x, 0)
    with pytest.raises(TypeError):
        decorated_scaled_sum(x, bogus=1)


def test_outside_capture_returns_the_very_object():
    x = torch.randn(3)
    same = eager_on_graph(lambda t: t)
    assert same(x) is x


def test_metadata_is_preserved():
    assert decorated_scaled_sum.__wrapped__ is scaled_sum
    assert decorated_scaled_sum.__name__ == "scaled_sum"
    assert decorated_scaled_sum.__qualname__ == "scaled_sum"
    assert decorated_scaled_sum.__doc__ == "Multiply, sum, shift."
    assert decorated_scaled_sum.__module__ == __name__
    assert inspect.signature(decorated_scaled_sum) == inspect.signature(scaled_sum)


def test_enable_false_returns_the_same_function():
    assert eager_on_graph(enable=False)(scaled_sum) is scaled_sum
    assert eager_on_graph(scaled_sum, enable=False) is scaled_sum


@pytest.mark.parametrize("option", ["enable", "check_values"])
@pytest.mark.parametrize("bad", [None, 0, "no", 1])
def test_flags_must_be_bools(option, bad):
    """enable=None returned the function undecorated (no break at all), enable="no" decorated
    it: a flag was taken for its truth value. Refused by name, decorated or bare."""
    with pytest.raises(InputError, match=f"eager_on_graph: {option} must be True or False"):
        eager_on_graph(**{option: bad})(scaled_sum)
    with pytest.raises(InputError, match=f"eager_on_graph: {option} must be True or False"):
        eager_on_graph(scaled_sum, **{option: bad})


def test_non_callable_is_rejected():
    with pytest.raises(InputError, match="expected a callable"):
        eager_on_graph(42)


def doubled_lazily(t):
    yield t * 2


async def doubled_later(t):
    return t * 2


async def doubled_lazily_later(t):
    yield t * 2


@pytest.mark.parametrize(
    "function, kind",
    [(doubled_lazily, "a generator function"), (doubled_later, "an async function"),
     (doubled_lazily_later, "an async generator function"),
     (staticmethod(doubled_lazily), "a generator function")],
)  # fmt: skip
def test_generator_and_async_functions_are_refused_at_decoration(function, kind):
    """Their body runs only where the result is consumed: after the break, inside the
    captured segment, never eagerly. Decorated, such a function was accepted and failed at
    the first replay as a "changed Python value" (a new generator each call), or with
    ``check_values=False`` its body was captured as graph code without a word."""
    for check_values in (True, False):
        with pytest.raises(InputError, match=rf"eager_on_graph: 'doubled_\w+' is {kind};"):
            eager_on_graph(function, check_values=check_values)
    assert eager_on_graph(function, enable=False) is function  # off: left as it is


# ---------------------------------------------------------------------------------------
# Inside a capture: a break, on every kind of callable
# ---------------------------------------------------------------------------------------


class Holder:
    factor = 3.0

    def __init__(self, factor):
        self.factor = factor

    @eager_on_graph
    def method(self, x):
        return x * self.factor  # self is read at replay time

    @eager_on_graph
    @classmethod
    def class_method_outer(cls, x):
        return x * cls.factor

    @classmethod
    @eager_on_graph
    def class_method_inner(cls, x):
        return x * cls.factor

    @eager_on_graph
    @staticmethod
    def static_method_outer(x):
        return x * 5.0

    @staticmethod
    @eager_on_graph
    def static_method_inner(x):
        return x * 5.0


@pytest.mark.parametrize(
    "name, expected_factor",
    [
        ("method", 2.0),
        ("class_method_outer", 3.0),
        ("class_method_inner", 3.0),
        ("static_method_outer", 5.0),
        ("static_method_inner", 5.0),
    ],
)
@pytest.mark.parametrize("through", ["instance", "class"])
def test_methods_classmethods_staticmethods(capture, device, name, expected_factor, through):
    if name == "method" and through == "class":
        pytest.skip("an instance method needs an instance")
    holder = Holder(2.0)
    owner = holder if through == "instance" else Holder
    x = torch.randn(6, device=device)

    function = getattr(owner, name)
    torch.testing.assert_close(function(x), x * expected_factor)  # outside capture
    assert function.__name__ == name

    g = BreakableCUDAGraph()
    with capture(g):
        y = getattr(owner, name)(x + 1) - 1
    assert g.num_breaks == 1
    assert g.break_names == [f"Holder.{name}"]
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, (new + 1) * expected_factor - 1)


def test_method_reads_instance_state_at_replay(capture, device):
    holder = Holder(2.0)
    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = holder.method(x) + 0
    holder.factor = -4.0  # the bound instance is kept, so its state is read per replay
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * -4.0)


class HostModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    @eager_on_graph
    def forward(self, x):
        keep = x[x.sum(-1) > 0]  # data-dependent rows
        return self.linear(x) + keep.sum()


@torch.no_grad()
def test_module_forward(capture, device):
    module = HostModule().to(device)
    x = torch.randn(4, 8, device=device)
    torch.testing.assert_close(module(x), HostModule.forward.__wrapped__(module, x))
    assert inspect.signature(HostModule.forward) == inspect.signature(
        HostModule.forward.__wrapped__
    )

    g = BreakableCUDAGraph()
    with capture(g):
        y = module(x * 2) + 1
    assert g.num_breaks == 1
    assert g.break_names == ["HostModule.forward"]
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, module(new * 2) + 1)


# ---------------------------------------------------------------------------------------
# Parametrised forms and options
# ---------------------------------------------------------------------------------------


@eager_on_graph()
def called_with_parentheses(x):
    return x.abs() * 2


@eager_on_graph(check_values=False)
def with_informational_count(x):
    return x.abs(), int((x > 0).sum())  # the count changes per replay


def test_parametrised_forms(capture, device):
    assert called_with_parentheses.__wrapped__.__name__ == "called_with_parentheses"
    x = torch.randn(16, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        a = called_with_parentheses(x) + 1
        b, count = with_informational_count(x * 3)
        c = b - 1
    assert g.num_breaks == 2
    assert isinstance(count, int)
    for _ in range(3):
        new = fresh_into(x)
        g.replay()  # a changed count is accepted with check_values=False
        torch.testing.assert_close(a, new.abs() * 2 + 1)
        torch.testing.assert_close(c, (new * 3).abs() - 1)


def test_changed_python_value_is_rejected_by_default(capture, device):
    @eager_on_graph
    def with_count(x):
        return x.abs(), int((x > 0).sum())

    x = torch.randn(64, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        with_count(x)
    captured_count = int((x > 0).sum())
    x.copy_(torch.where(x > 0, -x, x))  # now nothing is positive: the count changes
    with pytest.raises(CopyBackError, match="changed Python value"):
        g.replay()
    assert captured_count != 0


@pytest.mark.parametrize(
    "make", [lambda hs: (h for h in hs), iter, lambda hs: map(torch.neg, hs)],
    ids=["generator", "iter", "map"],
)
def test_one_shot_iterator_argument_is_refused_at_capture(capture, device, make):
    """Replays call the function with the capture-time objects: a generator consumed by the
    capture pass is empty on every replay. ``total`` then replayed a sum of nothing (zeros):
    a silently wrong answer, with no error."""

    @eager_on_graph
    def total(hs):
        out = torch.zeros(3, device=device)
        for h in hs:
            out += h
        return out

    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with pytest.raises(breakgraph.CaptureError, match=r"'.*total'.*argument 0 is a one-shot"):
        with capture(g):
            h = x * 1
            total(make([h, h * 2]))
    assert g.num_segments == 0 and not breakgraph.is_capturing()
    with capture(g):  # a list is read again on every replay: the fix the message names
        y = total([x * 1, x * 2]) + 1
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 3 + 1)


def test_capture_stub_runs_at_capture_real_function_on_replay(capture, device):
    calls = {"real": 0, "stub": 0}

    def stub(x):
        calls["stub"] += 1
        return torch.full_like(x, 7.0)

    @eager_on_graph(capture_stub=stub)
    def expensive(x):
        calls["real"] += 1
        return x * 3

    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = expensive(x + 1) + 1
    assert calls == {"real": 0, "stub": 1}
    torch.testing.assert_close(y, torch.full_like(x, 8.0))  # capture pass used the stub

    for i in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, (new + 1) * 3 + 1)
        assert calls == {"real": i + 1, "stub": 1}

    # Outside a capture the stub plays no part.
    torch.testing.assert_close(expensive(x), x * 3)
    assert calls == {"real": 4, "stub": 1}


def test_capture_stub_of_another_shape_is_reported_on_replay(capture, device):
    @eager_on_graph(capture_stub=lambda x: x[:1] * 1)
    def real(x):
        return x * 2

    x = torch.randn(3, 4, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        real(x)
    with pytest.raises(CopyBackError, match="another shape"):
        g.replay()


# ---------------------------------------------------------------------------------------
# torch.compile, nested eager functions
# ---------------------------------------------------------------------------------------


@eager_on_graph
def host_weighted(x):
    return x * x[x > 0].sum()  # data-dependent: a graph break for dynamo


def compiled_caller(x):
    return host_weighted(x.sin()) + x.cos()


def test_under_torch_compile(device):
    torch._dynamo.reset()
    compiled = torch.compile(compiled_caller, backend="eager", fullgraph=False)
    try:
        for _ in range(3):
            x = torch.randn(7, device=device)
            torch.testing.assert_close(compiled(x), compiled_caller(x))
    finally:
        torch._dynamo.reset()


def test_eager_inside_eager_is_one_break(capture, device):
    calls = []

    @eager_on_graph
    def inner(x):
        calls.append("inner")
        assert not breakgraph.is_capturing()
        return x * 2

    @eager_on_graph
    def outer(x):
        calls.append("outer")
        return inner(x) + 1

    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = outer(x * 3) - x
    assert g.num_breaks == 1
    assert g.num_segments == 2
    assert [name.rsplit(".", 1)[-1] for name in g.break_names] == ["outer"]
    assert calls == ["outer", "inner"]
    for _ in range(3):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, new * 6 + 1 - new)
    assert calls == ["outer", "inner"] * 4
