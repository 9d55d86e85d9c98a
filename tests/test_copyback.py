"""Copy-back: fresh eager results are written into the capture-time outputs, or refused."""

import collections
import contextlib
import dataclasses
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import breakgraph
from breakgraph import BreakableCUDAGraph, BreakgraphError, CopyBackError, eager_on_graph
from breakgraph.copyback import build_copy_back, call_and_classify
from breakgraph.structure import iter_tensors
from tests.helpers import fresh_into

try:
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError:  # transformers is an optional extra: only the ModelOutput cases need it
    CausalLMOutputWithPast = None

NEEDS_TRANSFORMERS = [
    pytest.mark.transformers,
    pytest.mark.skipif(CausalLMOutputWithPast is None, reason="needs transformers"),
]

Pair = collections.namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Result:
    hidden: torch.Tensor
    extra: dict
    count: int
    note: str | None = None


class Plain:
    def __init__(self, weights, rest):
        self.weights = weights
        self.rest = rest
        self.tag = "plain"


def build(kind: str, x: torch.Tensor) -> Any:
    """A structure of kind ``kind`` whose tensors are fresh functions of ``x`` ([4, 3])."""
    a, b, c = x * 2, x.sum(-1), x[:2] + 1
    if kind == "tensor":
        return a
    if kind == "tuple":
        return (a, b)
    if kind == "list":
        return [a, b, c]
    if kind == "namedtuple":
        return Pair(a, b)
    if kind == "dict":
        return {"k": a, "v": b}
    if kind == "nested dict in tuple":
        return (a, {"k": b, "v": [c, None, 3], "w": {"deep": x - 1}})
    if kind == "dataclass":
        return Result(hidden=a, extra={"b": b, "c": c}, count=5)
    if kind == "object":
        return Plain(a, (b, [c]))
    if kind == "ModelOutput":
        return CausalLMOutputWithPast(logits=a)
    if kind == "ModelOutput with tuple":
        return CausalLMOutputWithPast(logits=a, hidden_states=(b, c))
    raise AssertionError(kind)


KINDS = [
    "tensor",
    "tuple",
    "list",
    "namedtuple",
    "dict",
    "nested dict in tuple",
    "dataclass",
    "object",
    pytest.param("ModelOutput", marks=NEEDS_TRANSFORMERS),
    pytest.param("ModelOutput with tuple", marks=NEEDS_TRANSFORMERS),
]


def leaves(value: Any) -> list:
    """Every leaf (tensors and Python values) of a structure, in a fixed order."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (int, float, str)):
        return [value]
    if isinstance(value, collections.abc.Mapping):
        return [leaf for k in value.keys() for leaf in leaves(value[k])]
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in leaves(item)]
    if dataclasses.is_dataclass(value):
        return [leaf for f in dataclasses.fields(value) for leaf in leaves(getattr(value, f.name))]
    return [leaf for k in vars(value) for leaf in leaves(getattr(value, k))]


def assert_same_values(got: Any, expected: Any) -> None:
    got_leaves, expected_leaves = leaves(got), leaves(expected)
    assert len(got_leaves) == len(expected_leaves)
    for g, e in zip(got_leaves, expected_leaves):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(g, e)
        else:
            assert g == e


def tensor_leaves(value: Any) -> list:
    return [leaf for leaf in leaves(value) if isinstance(leaf, torch.Tensor)]


# ---------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_direct(device, kind):
    captured = build(kind, torch.randn(4, 3, device=device))
    objects = [id(t) for t in tensor_leaves(captured)]
    copy = build_copy_back(captured, "producer")
    for _ in range(3):
        new = build(kind, torch.randn(4, 3, device=device))
        assert copy(new) is None
        assert_same_values(captured, new)
        assert [id(t) for t in tensor_leaves(captured)] == objects  # copied into, not replaced
    assert type(captured) is type(build(kind, torch.randn(4, 3, device=device)))
    if kind.startswith("ModelOutput"):
        assert captured.loss is None and captured.past_key_values is None


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_through_replay(capture, device, kind):
    @eager_on_graph
    def producer(x):
        return build(kind, x.clone())

    x = torch.randn(4, 3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        out = producer(x * 1)
        # A later segment reads every tensor of the capture-time structure.
        total = sum(t.sum() * (i + 1) for i, t in enumerate(tensor_leaves(out)))
    for _ in range(3):
        new = fresh = torch.randn_like(x)
        x.copy_(fresh)
        g.replay()
        expected = build(kind, new)
        assert_same_values(out, expected)
        torch.testing.assert_close(
            total, sum(t.sum() * (i + 1) for i, t in enumerate(tensor_leaves(expected)))
        )


class _PrivateSlots:
    """A private slot (``__hidden``) is stored as ``_PrivateSlots__hidden``."""

    __slots__ = ("__hidden", "count")

    def __init__(self, hidden, count):
        self.__hidden, self.count = hidden, count

    @property
    def hidden(self):
        return self.__hidden


def _assert_replays_follow(capture, device, build, read, expect):
    """Capture ``read(build(x * 2)) + 1`` with ``build`` as an eager break; every replay on
    fresh ``x`` gives ``expect(x * 2) + 1`` (the break's output was copied back)."""

    @eager_on_graph
    def producer(x):
        return build(x * 2)

    x = torch.randn(4, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        out = read(producer(x * 1)) + 1
    for _ in range(3):
        fresh_into(x)
        g.replay()
        torch.testing.assert_close(out, expect(x * 2) + 1)
    return x


def test_a_tensor_in_a_private_slot_is_copied_back(capture, device):
    """The walker looked for a private slot under its written name (``__hidden``), found nothing
    and left its tensor out: replays kept the capture-time values, silently."""
    x = _assert_replays_follow(capture, device, lambda y: _PrivateSlots(y, 1),
                               lambda out: out.hidden, lambda y: y)  # fmt: skip
    assert [path for path, _ in iter_tensors(_PrivateSlots(x, 1))] == [
        "output._PrivateSlots__hidden"
    ]


@dataclasses.dataclass
class _Derived:
    logits: torch.Tensor
    note: str = dataclasses.field(init=False)  # never set

    def __post_init__(self):
        self.probs = self.logits.softmax(-1)  # an attribute that is not a field


def test_a_dataclass_attribute_that_is_not_a_field_is_copied_back(capture, device):
    """The walker took a dataclass's fields alone: a tensor set in ``__post_init__`` was left
    out of copy-back and kept its capture-time values on every replay, silently (and a field
    never set raised a raw AttributeError)."""
    x = _assert_replays_follow(capture, device, _Derived, lambda out: out.probs,
                               lambda y: y.softmax(-1))  # fmt: skip
    paths = [path for path, _ in iter_tensors(_Derived(x))]
    assert paths == ["output.logits", "output.probs"]


# ---------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------


def _t(device, *shape, dtype=torch.float32):
    return torch.randn(*shape, device=device).to(dtype)


# (name, captured, new, path, what was captured, what arrived)
ERROR_CASES = [
    (
        "shape",
        lambda d: (_t(d, 3, 4), {"k": _t(d, 2)}),
        lambda d: (_t(d, 3, 4), {"k": _t(d, 3)}),
        "output[1]['k']",
        "shape=(2,)",
        "shape=(3,)",
    ),
    (
        "no broadcasting",
        lambda d: _t(d, 3, 4),
        lambda d: _t(d, 1, 4),
        "output",
        "shape=(3, 4)",
        "shape=(1, 4)",
    ),
    (
        "dtype",
        lambda d: [_t(d, 2), _t(d, 5)],
        lambda d: [_t(d, 2), _t(d, 5, dtype=torch.float64)],
        "output[1]",
        "dtype=torch.float32",
        "dtype=torch.float64",
    ),
    (
        "device",
        lambda d: {"a": _t(d, 4)},
        lambda d: {"a": torch.empty(4, device="meta")},
        "output['a']",
        "device=",
        "device=meta",
    ),
    (
        "None for a tensor",
        lambda d: Result(hidden=_t(d, 2), extra={}, count=1),
        lambda d: Result(hidden=None, extra={}, count=1),
        "output.hidden",
        "Tensor(shape=(2,)",
        "NoneType None",
    ),
    (
        "tensor for None",
        lambda d: Result(hidden=_t(d, 2), extra={}, count=1),
        lambda d: Result(hidden=_t(d, 2), extra={}, count=1, note=_t(d, 2)),
        "output.note",
        "None",
        "Tensor(shape=(2,)",
    ),
    (
        "other dict keys",
        lambda d: {"a": _t(d, 2), "b": _t(d, 2)},
        lambda d: {"a": _t(d, 2), "c": _t(d, 2)},
        "output",
        "keys ['a', 'b']",
        "keys ['a', 'c']",
    ),
    (
        "other sequence length",
        lambda d: (_t(d, 1), [_t(d, 2), _t(d, 2)]),
        lambda d: (_t(d, 1), [_t(d, 2), _t(d, 2), _t(d, 2)]),
        "output[1]",
        "list of length 2",
        "list of length 3",
    ),
    (
        "tuple vs list",
        lambda d: {"x": (_t(d, 2), _t(d, 2))},
        lambda d: {"x": [_t(d, 2), _t(d, 2)]},
        "output['x']",
        "tuple of length 2",
        "list of length 2",
    ),
    (
        "changed Python value",
        lambda d: (_t(d, 2), 3),
        lambda d: (_t(d, 2), 4),
        "output[1]",
        "int 3",
        "int 4",
    ),
    (
        "namedtuple field",
        lambda d: Pair(_t(d, 2), _t(d, 3)),
        lambda d: Pair(_t(d, 2), _t(d, 4)),
        "output.second",
        "shape=(3,)",
        "shape=(4,)",
    ),
    (
        "object attribute",
        lambda d: Plain(_t(d, 2), (_t(d, 2), [_t(d, 2)])),
        lambda d: Plain(_t(d, 2), (_t(d, 2), [_t(d, 2, dtype=torch.float16)])),
        "output.rest[1][0]",
        "dtype=torch.float32",
        "dtype=torch.float16",
    ),
    (
        "ModelOutput field",
        lambda d: CausalLMOutputWithPast(logits=_t(d, 2, 5)),
        lambda d: CausalLMOutputWithPast(logits=_t(d, 2, 6)),
        "output['logits']",
        "shape=(2, 5)",
        "shape=(2, 6)",
    ),
    (
        "ModelOutput gained a field",
        lambda d: CausalLMOutputWithPast(logits=_t(d, 2, 5)),
        lambda d: CausalLMOutputWithPast(logits=_t(d, 2, 5), loss=_t(d, 1)),
        "output",
        "keys ['logits']",
        "keys ['loss', 'logits']",
    ),
]


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c[0], marks=NEEDS_TRANSFORMERS if "ModelOutput" in c[0] else ())
        for c in ERROR_CASES
    ],
)
def test_mismatch_raises_copy_back_error(device, case):
    _, make_captured, make_new, path, captured_text, got_text = case
    copy = build_copy_back(make_captured(device), "my_eager_fn")
    with pytest.raises(CopyBackError) as info:
        copy(make_new(device))
    error = info.value
    assert isinstance(error, BreakgraphError)
    assert error.function == "my_eager_fn"
    assert error.path == path
    message = str(error)
    assert "'my_eager_fn'" in message
    assert f" at {path}: " in message
    assert f"captured {error.captured}, got {error.got}" in message
    assert captured_text in error.captured, error.captured
    assert got_text in error.got, error.got



def assert_replay_refused_leaving(g, x, held: torch.Tensor, match: str) -> None:
    """A replay on fresh inputs raises ``CopyBackError`` (``match``) and leaves ``held``, memory
    something besides the graph keeps, exactly as it was."""
    before = held.clone()
    fresh_into(x)
    with pytest.raises(CopyBackError, match=match):
        g.replay()
    torch.testing.assert_close(held, before, rtol=0, atol=0)

def test_mismatch_on_replay_names_function_and_path(capture, device):
    @eager_on_graph
    def plan(x):
        rows = breakgraph.replay_context()["rows"]
        return {"meta": (x.sum(), x[:rows] * 2)}

    x = torch.randn(4, 3, device=device)
    g = BreakableCUDAGraph()
    with capture(g, context={"rows": 2}):
        out = plan(x + 1)
        y = out["meta"][1] * 3
    with pytest.raises(CopyBackError) as info:
        g.replay(context={"rows": 3})
    message = str(info.value)
    assert "plan" in info.value.function
    assert info.value.path == "output['meta'][1]"
    assert "shape=(2, 3)" in message and "shape=(3, 3)" in message

    new = torch.randn_like(x)  # the graph still works with a consistent context
    x.copy_(new)
    g.replay(context={"rows": 2})
    torch.testing.assert_close(y, (new + 1)[:2] * 6)


def test_check_values_false_accepts_values_not_tensors(device):
    captured = (_t(device, 3), 3, "note")
    copy = build_copy_back(captured, "informational", check_values=False)
    new = (_t(device, 3), 4, "other note")
    copy(new)
    torch.testing.assert_close(captured[0], new[0])
    with pytest.raises(CopyBackError, match="another shape"):
        copy((_t(device, 4), 4, "note"))
    with pytest.raises(CopyBackError, match="changed structure"):
        copy((_t(device, 3), None, "note"))  # a value turning into None is structure

    strict = build_copy_back(captured, "strict")
    with pytest.raises(CopyBackError, match="changed Python value"):
        strict((_t(device, 3), 4, "note"))


def test_equal_python_values_and_nan_are_accepted(device):
    captured = (_t(device, 2), 3, float("nan"), torch.float32, "s")
    copy = build_copy_back(captured, "values")
    new = (_t(device, 2), 3, float("nan"), torch.float32, "s")
    copy(new)
    torch.testing.assert_close(captured[0], new[0])


# ---------------------------------------------------------------------------------------
# No copy for in-place functions
# ---------------------------------------------------------------------------------------


class CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.copy_:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_same_tensor_is_not_copied(device):
    captured = _t(device, 5)
    copy = build_copy_back(captured, "in_place")
    before = captured.clone()
    with CountCopies() as counter:
        copy(captured)
    assert counter.copies == 0
    torch.testing.assert_close(captured, before)

    fresh = _t(device, 5)
    with CountCopies() as counter:
        copy(fresh)
    assert counter.copies == 1
    torch.testing.assert_close(captured, fresh)


def test_mixed_structure_copies_only_fresh_tensors(device):
    kept, replaced = _t(device, 3), _t(device, 3)
    copy = build_copy_back({"kept": kept, "replaced": replaced}, "mixed")
    fresh = _t(device, 3)
    with CountCopies() as counter:
        copy({"kept": kept, "replaced": fresh})
    assert counter.copies == 1
    torch.testing.assert_close(replaced, fresh)


def test_in_place_eager_function_replays(capture, device):
    @eager_on_graph
    def scale_in_place(x):
        x.mul_(x.abs().max())  # a host-free stand-in for a library's in-place kernel
        return x

    x = torch.randn(6, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        h = x + 1
        out = scale_in_place(h)
        y = out * 2
    assert out is h
    for _ in range(3):
        new = torch.randn_like(x)
        x.copy_(new)
        g.replay()
        expected_h = new + 1
        torch.testing.assert_close(y, expected_h * expected_h.abs().max() * 2)


# what an in-place function (or one returning a long-lived buffer) returns on a bad replay
NOT_THAT_MEMORY = {
    "None": (lambda t: None, "a changed structure"),
    "a tuple": (lambda t: (t,), "a changed structure"),
    "part of it": (lambda t: t[:2], "a tensor of another shape"),
    "another dtype": (lambda t: t.view(torch.int32), "a tensor of another dtype"),
    "a clone": (lambda t: t.clone(), "a new tensor where|a different tensor where"),
}


@pytest.mark.parametrize("returned", NOT_THAT_MEMORY, ids=NOT_THAT_MEMORY.keys())
@pytest.mark.parametrize("memory", ["argument", "held"])
def test_a_changed_structure_where_an_output_was_not_the_graphs_memory_is_named(
    capture, device, returned, memory
):
    """An output in memory the graph does not own (the argument, a global buffer) must be
    that memory on every replay. A replay returning None, a container or another shape there
    was refused as "a new tensor where it returned (memory of) its own argument" (or "a
    different tensor where ... memory it does not own"), and the fix told the user to return
    the argument or a new tensor on every call, while the function had changed its
    structure. Now named like any other output: a changed structure, another shape or
    dtype."""
    bad, problem = NOT_THAT_MEMORY[returned]
    buffer = torch.zeros(4, device=device)
    state = {"bad": False}

    @eager_on_graph
    def update(t):
        target = t if memory == "argument" else buffer
        target.copy_(t * 2)
        return bad(target) if state["bad"] else target

    x = torch.randn(4, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = update(x + 1) + 1
    fresh = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, (fresh + 1) * 2 + 1)
    state["bad"] = True
    fresh_into(x)
    with pytest.raises(CopyBackError, match=rf"'.*update' returned ({problem}).* at output: "):
        g.replay()
    state["bad"] = False
    fresh = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, (fresh + 1) * 2 + 1)


# ---------------------------------------------------------------------------------------
# Memory the graph does not own (issue 22, item 1)
# ---------------------------------------------------------------------------------------

# how an eager function hands back one of several long-lived tensors, chosen per replay
PICKS = {
    "the tensor": lambda w: w,
    "a view": lambda w: w[:, :2],
    "a detached alias": lambda w: w.detach(),
    "inside a dict": lambda w: {"w": w, "note": "adapter"},
}


@pytest.mark.parametrize("pick", PICKS.values(), ids=PICKS.keys())
def test_adapter_chosen_by_the_replay_context_is_never_overwritten(capture, device, pick):
    """The multi-adapter pattern: captured with adapter "a", replayed with "b". Copying b's
    weights into the capture-time output would overwrite adapter a (the user's memory)."""
    adapters = {name: torch.randn(4, 3, device=device) for name in "ab"}
    originals = {name: w.clone() for name, w in adapters.items()}

    @eager_on_graph
    def adapter_weights():
        return pick(adapters[breakgraph.replay_context()])

    def weights_of(result):
        return result["w"] if isinstance(result, dict) else result

    x = torch.randn(2, 4, device=device)
    g = BreakableCUDAGraph()
    with capture(g, context="a"):
        y = (x * 1) @ weights_of(adapter_weights())
    for _ in range(2):
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        g.replay(context="a")
        torch.testing.assert_close(y, fresh @ weights_of(pick(originals["a"])))
    with pytest.raises(CopyBackError, match="adapter_weights.*does not own") as info:
        g.replay(context="b")
    assert info.value.path.startswith("output")
    assert "clone()" in str(info.value)
    for name in "ab":
        torch.testing.assert_close(adapters[name], originals[name], rtol=0, atol=0)
    x.copy_(torch.randn_like(x))
    g.replay(context="a")  # the graph still works with the adapter it was captured with
    torch.testing.assert_close(y, x @ weights_of(pick(originals["a"])))
    with breakgraph.context_scope("a"):  # and plain eager calls see the right weights
        torch.testing.assert_close(weights_of(adapter_weights()), weights_of(pick(originals["a"])))


def test_global_buffer_chosen_by_the_replay_context_is_never_overwritten(capture, device):
    buffers = [torch.zeros(3, device=device), torch.zeros(3, device=device)]

    @eager_on_graph
    def into_buffer(h):
        buf = buffers[breakgraph.replay_context()]
        buf.copy_(h * 2)
        return buf

    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with capture(g, context=0):
        y = into_buffer(x + 1) + 1
    fresh = fresh_into(x)
    g.replay(context=0)
    torch.testing.assert_close(y, (fresh + 1) * 2 + 1)
    before = buffers[0].clone()
    fresh_into(x)
    with pytest.raises(CopyBackError, match=r"into_buffer.*does not own at output: "):
        g.replay(context=1)
    torch.testing.assert_close(buffers[0], before, rtol=0, atol=0)


COMPLEX_VIEWS = {  # views torch replays by a function, which hold their base twice
    "view_as_real": torch.view_as_real,
    "real": lambda z: z.real,
    "imag then slice": lambda z: z.imag[1:],
    "conj": lambda z: z.conj(),
}


@pytest.mark.parametrize("view", list(COMPLEX_VIEWS))
def test_complex_views_of_new_tensors_are_the_graphs_and_of_held_ones_are_not(capture, device,
                                                                              view):  # fmt: skip
    """A view of a complex tensor the function just made is owned by the graph (it was refused
    on the first replay as memory the graph does not own); one of a tensor something else holds
    still is not."""
    make_view, held = COMPLEX_VIEWS[view], {"z": torch.randn(3, dtype=torch.complex64,
                                                             device=device)}  # fmt: skip

    @eager_on_graph
    def rotate(h):
        return make_view(torch.complex(h, 2 * h) * (1 + 1j))

    @eager_on_graph
    def of_held(h):
        held["z"] = held["z"] * 1  # a different tensor every replay, always held
        return make_view(held["z"])

    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with torch.no_grad(), capture(g):
        y = rotate(x * 1) * 1
    for _ in range(2):
        new = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, make_view(torch.complex(new, 2 * new) * (1 + 1j)))
    g = BreakableCUDAGraph()
    with torch.no_grad(), capture(g):
        of_held(x * 1)
    with pytest.raises(CopyBackError, match="does not own"):
        g.replay()


def test_a_view_chain_whose_middle_a_cache_keeps_is_never_written(capture, device):
    """``tmp = z.conj(); cache.append(tmp); return tmp.imag``: the memory is the cache's too.
    A chain of views replayed by functions keeps tensors the census cannot see, so its memory
    counts as held (a chain of a fresh tensor is refused too, loudly, never written over)."""
    cache = []

    @eager_on_graph
    def spectrum(h):
        tmp = torch.complex(h, 2 * h).conj()
        cache.append(tmp)
        return tmp.imag

    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with torch.no_grad(), capture(g):
        spectrum(x * 1)
    assert_replay_refused_leaving(g, x, cache[0], "does not own")


def test_an_equal_array_returned_again_is_the_same_value(capture, device):
    """Python values are compared: numpy arrays element by element (their == is no bool, and
    an equal array was refused on every replay as a changed value); a changed one is named."""
    import numpy as np

    table = {"ids": np.arange(3)}

    @eager_on_graph
    def with_table(h):
        return h * 2, table["ids"].copy()

    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y, ids = with_table(x * 1)
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, new * 2)
    for changed in (np.arange(1, 4), np.arange(4)):  # other values, another shape
        table["ids"] = changed
        with pytest.raises(CopyBackError, match=r"a changed Python value at output\[1\]"):
            g.replay()
    from breakgraph.copyback import _same_value

    assert _same_value(np.float64(1.5), 1.5) and _same_value(1.5, np.float64(1.5))
    assert _same_value(np.array([1.0, np.nan]), np.array([1.0, np.nan]))  # NaN equals NaN
    assert not _same_value(np.array([1.0, np.nan]), np.array([2.0, np.nan]))


def test_cached_structure_chosen_per_replay_is_never_overwritten(capture, device):
    """The tensors are held only by a cached tuple, and the cache holds the tuple."""
    cache = {name: (torch.randn(3, device=device),) for name in "ab"}
    originals = {name: t[0].clone() for name, t in cache.items()}

    @eager_on_graph
    def cached():
        return cache[breakgraph.replay_context()]

    g = BreakableCUDAGraph()
    with capture(g, context="a"):
        y = cached()[0] * 2
    with pytest.raises(CopyBackError, match=r"cached.*at output\[0\]"):
        g.replay(context="b")
    torch.testing.assert_close(cache["a"][0], originals["a"], rtol=0, atol=0)


def test_output_the_function_also_keeps_is_never_overwritten(capture, device):
    """A fresh tensor that the function also keeps (a history list) is the user's memory too:
    copying the next result into it would rewrite the history."""
    history = []

    @eager_on_graph
    def remember(h):
        y = h * 2
        history.append(y)
        return y

    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        out = remember(x + 1) + 0
    assert_replay_refused_leaving(g, x, history[0], "remember.*does not own")


def test_function_returning_its_own_preallocated_buffer_still_replays(capture, device):
    """The integration's attention breaks: a callable object that writes into a buffer it holds
    and returns that buffer (or a fresh view of it) on every call: no copy, no error."""

    class IntoOwnBuffer:
        def __init__(self, n):
            self.out = torch.empty(n, device=device)

        def __call__(self, h):
            torch.mul(h, 3, out=self.out)
            return self.out, self.out[:2]

    x = torch.randn(4, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        full, head = eager_on_graph(IntoOwnBuffer(4))(x + 1)
        y = full * 1 + head.sum()
    for _ in range(3):
        fresh = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, (fresh + 1) * 3 + ((fresh[:2] + 1) * 3).sum())


def test_in_place_function_returning_its_argument_and_a_view_of_it(capture, device):
    @eager_on_graph
    def scale_(h):
        h.mul_(2)
        return h, h[:2]

    x = torch.randn(4, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        h = x + 1
        a, b = scale_(h)
        y = a * 1 + b.sum()
    for _ in range(3):
        fresh = fresh_into(x)
        g.replay()
        torch.testing.assert_close(y, (fresh + 1) * 2 + ((fresh[:2] + 1) * 2).sum())


@pytest.mark.parametrize("cut", ["rows", "columns"])
def test_a_zero_size_view_of_the_argument_may_become_a_new_zero_size_tensor(capture, device, cut):
    """A zero-size output holds no memory for segments to read: a view of the argument at
    capture (``h[:0]``, as a slice of an empty batch gives) and a new empty tensor on replay
    are the same output. It raised CopyBackError ("a new tensor where it returned memory of
    its own argument"), found by the fuzzer's break_returns_zero_size family."""
    state = {"replay": False}

    @eager_on_graph
    def rows_left(h):
        empty = h.new_zeros((0, 3)) if cut == "rows" else h.new_zeros((4, 0))
        return h * 2, (empty if state["replay"] else h[:0] if cut == "rows" else h[:, :0])

    x = torch.randn(4, 3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y, none = rows_left(x + 1)
        out = torch.cat([none, y], 0 if cut == "rows" else 1) * 1
    state["replay"] = True
    for _ in range(2):
        fresh = fresh_into(x)
        g.replay()
        torch.testing.assert_close(out, (fresh + 1) * 2)


def test_persistent_tensor_at_replay_is_copied_from_not_into(capture, device):
    """Fresh at capture, a long-lived tensor on replay: the copy goes from the user's tensor
    into graph memory, which is always safe."""
    weights = {"a": torch.randn(3, device=device)}
    original = weights["a"].clone()
    state = {"persistent": False}

    @eager_on_graph
    def weights_or_fresh(h):
        return weights["a"] if state["persistent"] else h * 1

    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = weights_or_fresh(x + 1) * 2
    state["persistent"] = True
    fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, original * 2)
    torch.testing.assert_close(weights["a"], original, rtol=0, atol=0)


def test_stub_returning_a_long_lived_tensor_stands_for_a_function_returning_it(capture, device):
    """capture_stub semantics are unchanged: the stub's output is the graph's; a persistent
    tensor from the stub must be what the real function returns on every replay."""
    table = torch.randn(3, device=device)
    other = torch.randn(3, device=device)
    original = table.clone()
    state = {"other": False}

    @eager_on_graph(capture_stub=lambda: table)
    def lookup():
        return other if state["other"] else table

    g = BreakableCUDAGraph()
    with capture(g):
        y = lookup() * 2
    g.replay()
    torch.testing.assert_close(y, original * 2)
    state["other"] = True
    with pytest.raises(CopyBackError, match="lookup.*does not own"):
        g.replay()
    torch.testing.assert_close(table, original, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------
# Outputs that share memory (issue 22, item 2)
# ---------------------------------------------------------------------------------------

ALIASED = {
    "(y, y)": lambda y: (y, y),
    "(y, y[:2])": lambda y: (y, y[:2]),
    "{'k': y[1:], 'v': y[:3]}": lambda y: {"k": y[1:], "v": y[:3]},
}
INDEPENDENT = {
    "(y, y)": lambda h: (h * 2, h * 3),
    "(y, y[:2])": lambda h: (h * 2, h[:2] * 3),
    "{'k': y[1:], 'v': y[:3]}": lambda h: {"k": h[1:] * 2, "v": h[:3] * 3},
}
FIRST_AND_OTHER = {
    "(y, y)": ("output[0]", "output[1]"),
    "(y, y[:2])": ("output[0]", "output[1]"),
    "{'k': y[1:], 'v': y[:3]}": ("output['k']", "output['v']"),
}


def _leaves(value):
    return list(value.values()) if isinstance(value, dict) else list(value)


@pytest.mark.parametrize("shape", ALIASED)
def test_outputs_aliased_at_capture_but_not_at_replay_raise(capture, device, shape):
    """(y, y) at capture (k and v of an empty cache), two tensors on replay: copying both into
    one memory would leave the last copy in both slots."""
    state = {"aliased": True}

    @eager_on_graph
    def keys_values(h):
        return ALIASED[shape](h * 2) if state["aliased"] else INDEPENDENT[shape](h)

    x = torch.randn(4, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        outs = [t * 1 for t in _leaves(keys_values(x + 1))]
    fresh = fresh_into(x)
    g.replay()  # aliased the same way: fine
    for out, expected in zip(outs, _leaves(ALIASED[shape]((fresh + 1) * 2))):
        torch.testing.assert_close(out, expected)
    state["aliased"] = False
    fresh_into(x)
    with pytest.raises(CopyBackError, match="keys_values") as info:
        g.replay()
    first, other = FIRST_AND_OTHER[shape]
    assert info.value.path == other
    assert first in str(info.value)


@pytest.mark.parametrize("shape", ALIASED)
def test_outputs_aliased_the_same_way_on_every_replay(capture, device, shape):
    @eager_on_graph
    def keys_values(h):
        return ALIASED[shape](h * 2)

    x = torch.randn(4, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        outs = [t * 1 for t in _leaves(keys_values(x + 1))]
    for _ in range(3):
        fresh = fresh_into(x)
        g.replay()
        for out, expected in zip(outs, _leaves(ALIASED[shape]((fresh + 1) * 2))):
            torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("shape", ALIASED)
def test_outputs_distinct_at_capture_may_alias_at_replay(capture, device, shape):
    state = {"aliased": False}

    @eager_on_graph
    def keys_values(h):
        return ALIASED[shape](h * 2) if state["aliased"] else INDEPENDENT[shape](h)

    x = torch.randn(4, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        outs = [t * 1 for t in _leaves(keys_values(x + 1))]
    state["aliased"] = True
    for _ in range(2):
        fresh = fresh_into(x)
        g.replay()
        for out, expected in zip(outs, _leaves(ALIASED[shape]((fresh + 1) * 2))):
            torch.testing.assert_close(out, expected)


def test_an_overlapping_output_of_another_shape_or_type_on_replay_raises(capture, device):
    """An output that overlaps another is checked with its group before anything of the group
    is copied: another shape or a value that is no tensor names its path, and the shared
    memory keeps the last replay's values."""
    state = {"second": lambda y: y[:2]}

    @eager_on_graph
    def pair(h):
        y = h * 2
        return y, state["second"](y)

    x = torch.randn(4, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        first, second = pair(x + 1)
    fresh = fresh_into(x)
    g.replay()
    torch.testing.assert_close(second, ((fresh + 1) * 2)[:2])
    kept = first.clone()
    for changed, phrase in ((lambda y: y[:3], "another shape"), (lambda y: "oops", "structure")):
        state["second"] = changed
        fresh_into(x)
        with pytest.raises(CopyBackError, match=f"pair' returned a .*{phrase}") as info:
            g.replay()
        assert info.value.path == "output[1]"
        assert torch.equal(first, kept)


def test_chunks_of_one_tensor_may_become_independent_tensors(capture, device):
    """Outputs that share a storage without overlapping (q, k, v chunks, interleaved too)
    need no aliasing on replay: each is copied on its own."""
    state = {"chunks": True}

    @eager_on_graph
    def qkv(h):
        if state["chunks"]:
            return (h * 2).chunk(3, dim=-1)
        return tuple(h[:, i * 2 : i * 2 + 2] * 2 for i in range(3))

    x = torch.randn(5, 6, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        outs = [t * 1 for t in qkv(x + 1)]
    state["chunks"] = False
    fresh = fresh_into(x)
    g.replay()
    for out, expected in zip(outs, ((fresh + 1) * 2).chunk(3, dim=-1)):
        torch.testing.assert_close(out, expected)


def _records(x):
    """One 8-byte record per row: a float32 at bytes 0-3, an int16 pair at bytes 4-7."""
    raw = torch.empty(x.shape[0], 8, dtype=torch.uint8, device=x.device)
    value, code = raw.view(torch.float32)[:, 0], raw.view(torch.int16)[:, 2:4]
    value.copy_(x)
    code.copy_((x * 10).to(torch.int16)[:, None].expand(-1, 2))
    return value, code, raw.view(torch.int32)[:, 0]  # the third shares the floats' bytes


def test_outputs_of_two_dtypes_interleaved_without_sharing_a_byte_may_become_independent(
    capture, device
):
    """Outputs of different dtypes whose byte ranges interleave but share no byte (fields of
    one packed record) were counted as overlapping (the exact check compared elements of one
    size only), so a replay that returned them as separate tensors raised a false
    CopyBackError. Only outputs that share a byte must keep sharing it: here the int32 view
    of the floats' bytes must, and one that does not on replay is still refused."""
    state = {"packed": True}

    @eager_on_graph
    def fields(h):
        value, code, bits = _records(h)
        if state["packed"]:
            return value, code, bits
        return value, code.clone(), bits  # the codes alone; the floats and their bits shared

    x = torch.randn(5, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        value, code, bits = fields(x * 1)
        out = value + code.sum(1), bits * 1
    for packed in (True, False):
        state["packed"] = packed
        fresh = fresh_into(x)
        g.replay()
        torch.testing.assert_close(out[0], fresh + (fresh * 10).to(torch.int16).float() * 2)
        torch.testing.assert_close(out[1], fresh.view(torch.int32))

    @eager_on_graph
    def apart(h):
        value, code, bits = _records(h)
        return value, code, bits if state["packed"] else bits.clone()

    g = BreakableCUDAGraph()
    state["packed"] = True
    with capture(g):
        outs = apart(x * 1)
    state["packed"] = False
    fresh_into(x)
    shared = r"does not share memory with output\[0\] as at capture at output\[2\]"
    with pytest.raises(CopyBackError, match=shared):
        g.replay()


# ---------------------------------------------------------------------------------------
# Who holds an output: call_and_classify (issue 22, item 1)
# ---------------------------------------------------------------------------------------


def _held_paths(output, held):
    return [path for path, t in iter_tensors(output) if t.untyped_storage().data_ptr() in held]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_fresh_outputs_are_owned_in_every_structure(device, kind, mode):
    """No false alarm: new tensors (views of temporaries included) in every structure."""
    x = torch.randn(4, 3, device=device)
    guard = {
        "grad": contextlib.nullcontext(),
        "no_grad": torch.no_grad(),
        "inference_mode": torch.inference_mode(),
    }[mode]
    with guard:
        output, held = call_and_classify(build, (kind, x), {})
        assert held == frozenset()
        output, held = call_and_classify(
            lambda h: ((h * 2)[1:], h.max(0), (h + 1).chunk(2, 1)), (x,), {}
        )
        assert held == frozenset()


WEIGHTS = torch.randn(4, 3)


class Holder:
    def __init__(self):
        self.buffer = torch.zeros(4, 3)
        self.history = []
        self.cached = (torch.zeros(2),)

    def kept(self, h):
        y = h * 2
        self.history.append(y)
        return y


HOLDER = Holder()
HELD_ELSEWHERE = {
    "global tensor": (lambda h: (h * 2, WEIGHTS), ["output[1]"]),
    "view of a global": (lambda h: {"w": WEIGHTS[1:], "h": h + 1}, ["output['w']"]),
    "detached global": (lambda h: WEIGHTS.detach(), ["output"]),
    "module buffer": (lambda h: HOLDER.buffer, ["output"]),
    "kept by the function": (HOLDER.kept, ["output"]),
    "cached container": (lambda h: HOLDER.cached, ["output[0]"]),
    "argument": (lambda h: (h, h * 1), ["output[0]"]),
    "storage object kept": (
        lambda h: torch.empty(0).set_(
            HOLDER.__dict__.setdefault("storage", h.clone().untyped_storage())
        ),
        ["output"],
    ),
    "view of one output kept": (
        lambda h: (lambda y: (HOLDER.history.append(y[:1]), y)[1])(h * 3),
        ["output"],
    ),
}


@pytest.mark.parametrize("case", HELD_ELSEWHERE.values(), ids=HELD_ELSEWHERE.keys())
def test_outputs_held_elsewhere_are_found(case):
    function, paths = case
    x = torch.randn(4, 3)
    with torch.no_grad():
        output, held = call_and_classify(function, (x,), {})
    assert _held_paths(output, held) == paths


def test_output_autograd_saved_for_backward_is_held_elsewhere(capture, device):
    """Autograd counts like any holder (it saved sigmoid's result for backward): the replay
    raises and says to capture under no_grad; under no_grad the same program replays."""
    w = torch.randn(3, device=device, requires_grad=True)

    @eager_on_graph
    def gate(h):
        return torch.sigmoid(h)

    x = torch.randn(3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = gate(x * w) + 1
    fresh_into(x)
    with pytest.raises(CopyBackError, match=r"gate.*requires grad.*no_grad"):
        g.replay()
    g2 = BreakableCUDAGraph()
    with torch.no_grad(), capture(g2):
        y = gate(x * w) + 1
    fresh = fresh_into(x)
    g2.replay()
    torch.testing.assert_close(y, torch.sigmoid(fresh * w.detach()) + 1)


@pytest.mark.parametrize("grad_at", ["capture", "replay only"])
def test_copy_back_under_grad_mode_records_no_autograd_history(capture, device, grad_at):
    """A break captured with grad on whose output requires grad (it used a parameter): every
    replay's copy into the captured output was recorded by autograd, so its history grew by a
    copy node and the new result's own graph per replay, without bound (memory held for ever,
    as the static inputs' copy did before it was detached). Replays write it untracked.
    "replay only", the rarer case: the output did not require grad at capture (its parameter
    did not yet), but a replay's result does (the parameter was set to require grad after the
    capture, grad mode on): the captured output took a copy node per replay."""
    w = torch.randn(3, device=device, requires_grad=grad_at == "capture")

    @eager_on_graph
    def scale(t):
        return t * w

    x = torch.ones(3, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y = scale(x + 1)
        z = y + 1
    history = y.grad_fn
    assert (history is not None) == (grad_at == "capture")
    w.requires_grad_(True)
    for value in (2.0, 3.0):
        x.fill_(value)
        g.replay()
        assert y.grad_fn is history and y.requires_grad == (grad_at == "capture")
        assert torch.allclose(z, (value + 1) * w.detach() + 1)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_argument_is_read_on_every_replay(capture, device, layout):
    """A sparse tensor passed to an eager function failed the capture with torch's raw
    NotImplementedError (no storage) from the arguments' bookkeeping. It has no storage of its
    own: its indices and values count as the argument's memory, so the function gets the
    sparse tensor on every replay (values updated in place are seen) and a view of its values
    returned at capture must be that memory again."""
    dense = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0], [4.0, 0.0, 0.0]], device=device)
    adjacency = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    values = adjacency._values() if layout == "coo" else adjacency.values()

    @eager_on_graph
    def propagate(adj, h):
        vals = adj._values() if layout == "coo" else adj.values()
        return torch.sparse.mm(adj, h), vals  # a dense result, and the argument's memory

    x = torch.randn(3, 2, device=device)
    g = BreakableCUDAGraph()
    with capture(g):
        y, v = propagate(adjacency, x * 1)
        z = y + v.sum()
    for scale in (2.0, 0.5):
        values.mul_(scale)  # the sparse argument, updated in place
        new = fresh_into(x)
        g.replay()
        current = values.sum()
        torch.testing.assert_close(z, torch.sparse.mm(adjacency, new) + current)
    assert v.data_ptr() == values.data_ptr()


def test_a_sparse_output_is_refused_by_name(capture, device):
    """A sparse tensor returned by an eager function failed the capture with torch's raw
    NotImplementedError from the ownership census. Copy-back cannot keep it at frozen
    addresses (copy_ replaces its indices and values), so it is refused by name, with the
    fix, and the graph is left clean."""

    @eager_on_graph
    def sparsify(h):
        return h * 2, (h > 0).float().to_sparse()

    x = torch.randn(3, 2, device=device)
    g = BreakableCUDAGraph()
    refused = r"sparsify' returned a sparse tensor .*output\[1\]"
    with pytest.raises(CopyBackError, match=refused) as e:
        with capture(g):
            sparsify(x + 1)
    assert ".to_dense()" in str(e.value) and "inside the eager function" in str(e.value)
    assert g.num_segments == 0 and not breakgraph.is_capturing()
    with capture(g):  # the graph takes a capture afterwards
        y = (x + 1) * 2
    new = fresh_into(x)
    g.replay()
    torch.testing.assert_close(y, (new + 1) * 2)
