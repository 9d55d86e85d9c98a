"""transformers' CB index lists converted through numpy (``index_lists``): equal tensors to
``torch.tensor``'s for what transformers passes, ``torch.tensor`` itself for anything else,
installed only where the probe finds transformers converting that way, used by real CB steps,
and gone when the last model is disabled."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from breakgraph.integrations.transformers import compat, index_lists  # noqa: E402
from breakgraph.integrations.transformers.index_lists import NumpyLists  # noqa: E402
from breakgraph.integrations.transformers.index_rows import RowChunks  # noqa: E402

from breakgraph.patches import PatchSet  # noqa: E402
from tests.helpers import needs_continuous_batching  # noqa: E402

pytestmark = pytest.mark.transformers
needs_cb = needs_continuous_batching()


def test_docstring_examples():
    result = doctest.testmod(index_lists)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_lists_of_ints_convert_to_equal_tensors(dtype, device):
    fast = NumpyLists()
    values = torch.randint(-(2**30), 2**30, (5000,)).tolist()
    got = fast.tensor(values, dtype=dtype, device=device)
    want = torch.tensor(values, dtype=dtype, device=device)
    assert got.dtype == want.dtype and got.device == want.device and torch.equal(got, want)
    assert fast.tensor([], dtype=dtype).shape == (0,)


@pytest.mark.parametrize(
    "data,kwargs",
    [
        ([1, 2, 3], {"dtype": torch.int64}),  # short: torch's own
        (list(range(100)), {}),  # no dtype: torch infers it
        (list(range(100)), {"dtype": torch.float32}),
        ([True] * 100, {"dtype": torch.int64}),  # not ints
        ([float(i) for i in range(100)], {"dtype": torch.int64}),
        (list(range(100)), {"dtype": torch.int64, "requires_grad": False}),
        (tuple(range(100)), {"dtype": torch.int64}),  # not a list
        (np.arange(100), {"dtype": torch.int64}),
    ],
    ids=["short", "no-dtype", "float", "bools", "floats", "kwargs", "tuple", "array"],
)
def test_everything_else_is_torch_tensor(monkeypatch, data, kwargs):
    calls = []
    original = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: calls.append(1) or original(*a, **k))
    got = NumpyLists().tensor(data, **kwargs)
    assert calls == [1]
    want = original(data, **kwargs)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_an_int32_overflow_raises_as_torch_would():
    big = [2**40] * 100
    with pytest.raises((RuntimeError, OverflowError)):
        torch.tensor(big, dtype=torch.int32)
    with pytest.raises((RuntimeError, OverflowError)):
        NumpyLists().tensor(big, dtype=torch.int32)


def test_every_other_attribute_is_torch_s_at_each_use(monkeypatch):
    fast = NumpyLists()
    assert fast.int64 is torch.int64 and fast.empty is torch.empty and fast.Tensor is torch.Tensor
    monkeypatch.setattr(torch, "finfo", "replaced")  # a later replacement is seen
    assert fast.finfo == "replaced"
    with pytest.raises(AttributeError):
        fast.no_such_name  # noqa: B018


def test_without_a_device_the_default_device_holds():
    values = list(range(100))
    with torch.device("meta"):
        got, want = NumpyLists().tensor(values, dtype=torch.int64), torch.tensor(values)
    assert got.device == want.device == torch.device("meta")


@needs_cb
def test_installed_only_where_the_probe_finds_list_conversions(monkeypatch):
    module = compat.index_lists_module()
    assert module is not None and module.torch is torch
    with PatchSet() as patches:
        assert index_lists.install(patches)
        assert isinstance(module.torch, NumpyLists)
        with PatchSet() as again:  # installed already: the probe says so, nothing is wrapped
            assert compat.index_lists_module() is None and not index_lists.install(again)
    assert module.torch is torch
    monkeypatch.setattr(compat.inspect, "getsource", lambda obj: "def f(): pass")
    assert compat.index_lists_module() is None
    with PatchSet() as patches:
        assert not index_lists.install(patches)
        assert module.torch is torch


@needs_cb
def test_cb_steps_convert_their_index_lists_through_numpy(monkeypatch):
    """A real CB run (emulated backend): transformers' long lists go through the numpy path, the
    tokens equal ``generate()``'s, and disabling restores transformers' module."""
    from breakgraph.integrations.transformers import enable_continuous_batching

    from tests.test_continuous_batching import (
        BUCKETS,
        build_model,
        generate_batch,
        generate_each,
        random_prompts,
    )

    fast_calls = []
    convert = NumpyLists.tensor

    def spy(self, data, *args, **kwargs):
        if type(data) in (list, RowChunks) and kwargs.get("dtype") in (torch.int32, torch.int64):
            fast_calls.append(len(data))
        return convert(self, data, *args, **kwargs)

    monkeypatch.setattr(NumpyLists, "tensor", spy)
    model = build_model("llama")
    prompts = random_prompts()
    expected = generate_each(model, prompts)
    with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS):
        tokens = generate_batch(model, prompts)
    assert tokens == expected
    assert fast_calls and max(fast_calls) >= 100  # the read indices of the decode steps
    assert compat.index_lists_module().torch is torch
