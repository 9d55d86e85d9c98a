"""Testing helpers for your own models: check that replays match eager runs.

Example::

    >>> import torch
    >>> from breakgraph.testing import assert_replay_matches_eager
    >>> w = torch.randn(4, 4)
    >>> g = assert_replay_matches_eager(lambda x: (x @ w).relu(), lambda: (torch.randn(2, 4),),
    ...                                 backend="emulated")
    >>> g.num_segments
    1
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .buckets import validate_callable, validate_count, validate_flag, validate_real
from .graph import BreakableCUDAGraph, capture
from .state import context_scope
from .structure import describe, map_tensors, split

__all__ = ["assert_replay_matches_eager"]


def assert_replay_matches_eager(
    fn: Callable,
    make_inputs: Callable[[], Any],
    *,
    replays: int = 3,
    backend: str | None = None,
    context: Any = None,
    warmup: int = 1,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    equal_nan: bool = False,
    debug: bool = False,
) -> BreakableCUDAGraph:
    """Capture ``fn`` once, then replay it on ``replays`` fresh draws and compare with eager.

    ``make_inputs()`` returns a fresh tuple of tensors (or one tensor) on every call, of the
    same structure, shapes and dtypes each time: a copy of the first draw becomes the static
    inputs (inputs that share memory, a buffer and a view of it, share it in the copy too); each
    later draw is copied into them, the graph is replayed, its outputs are copied at once (an
    output in a long-lived buffer would otherwise be overwritten by the eager run before the
    comparison), and ``fn`` is run eagerly on the same draw. Outputs are compared structurally
    (the structures of :mod:`breakgraph.structure`: tensors with ``torch.testing.assert_close``,
    containers and objects field by field, other values with ``==``); ``equal_nan=True`` lets
    NaNs match. The first difference raises ``AssertionError`` naming the replay and its path
    (``output[1]['logits']``). Catches frozen host decisions, stale buffers that ``fn`` reads
    besides its inputs, and unwritten outputs. Returns the graph. ``replays`` below 1 (a check
    that compares nothing), a negative ``warmup``, an ``fn``/``make_inputs`` that is not
    callable, an ``atol``/``rtol`` that is not a real number >= 0 or an ``equal_nan`` other
    than True or False raise ``InputError``, before anything runs.
    """
    validate_callable(fn, "assert_replay_matches_eager: fn", optional=False)
    validate_callable(make_inputs, "assert_replay_matches_eager: make_inputs", optional=False)
    for name, value, least in (("replays", replays, 1), ("warmup", warmup, 0)):
        validate_count(value, least, f"assert_replay_matches_eager: {name}")  # 0 replays: no check
    # here, not as torch's error mid-comparison after the capture (or never: outputs that
    # hold no tensor are compared with ==, and a wrong tolerance went unnoticed)
    for name, value in (("atol", atol), ("rtol", rtol)):
        validate_real(value, f"assert_replay_matches_eager: {name}", least=0.0)
    validate_flag(equal_nan, "assert_replay_matches_eager: equal_nan")
    static = _static_copy(_as_tuple(make_inputs()))
    with context_scope(context):
        for _ in range(warmup):
            fn(*static)
    graph = BreakableCUDAGraph()
    with capture(graph, backend=backend, context=context, debug=debug):
        output = fn(*static)
    for replay in range(replays):
        fresh = _as_tuple(make_inputs())
        _copy_into(static, fresh, "input")
        graph.replay(context=context)
        got = map_tensors(torch.Tensor.clone, output)
        with context_scope(context):
            expected = fn(*fresh)
        _compare(got, expected, "output", f"replay {replay}", (atol, rtol, equal_nan))
    return graph


def _static_copy(draw: tuple) -> tuple:
    """The first draw as the static inputs: each tensor cloned (writable and dense), except
    tensors that share memory with another input (a buffer and a view of it): those become
    views of one copy of that memory, laid out as before, so the graph is captured on inputs
    that alias as the eager runs' do (an in-place write to one shows in the other)."""
    counts: dict[int, int] = {}

    def count(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        counts[key] = counts.get(key, 0) + 1
        return t

    map_tensors(count, draw)
    copies: dict[int, Any] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if counts[key] < 2:
            return t.clone()
        if key not in copies:
            copies[key] = t.untyped_storage().clone()
        view = torch.empty(0, dtype=t.dtype, device=t.device)
        return view.set_(copies[key], t.storage_offset(), t.shape, t.stride())

    return map_tensors(copy, draw)


def _as_tuple(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _copy_into(static: Any, fresh: Any, path: str) -> None:
    if isinstance(static, torch.Tensor):
        if (
            not isinstance(fresh, torch.Tensor)
            or fresh.shape != static.shape
            or fresh.dtype != static.dtype
        ):
            raise AssertionError(
                f"make_inputs() changed {path}: the static inputs need the same shapes "
                f"and dtypes on every draw"
            )
        static.copy_(fresh)
        return
    parts = split(static)
    if parts is not None:
        fresh_parts = split(fresh)
        if fresh_parts is None or type(fresh) is not type(static) or fresh_parts.keys != parts.keys:
            raise AssertionError(
                f"make_inputs() changed {path}: {describe(static)} at first, "
                f"{describe(fresh)} now; the static inputs need the same structure on every draw"
            )
        for key, s, f in zip(parts.keys, parts.values, fresh_parts.values):
            _copy_into(s, f, parts.label(path, key))


def _compare(got: Any, expected: Any, path: str, where: str, tolerance: tuple) -> None:
    atol, rtol, equal_nan = tolerance
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{where}: {path}: replay gave {describe(got)}, eager a tensor")
        try:
            torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, equal_nan=equal_nan)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {path} differs from eager: {exc}") from None
        return
    parts, got_parts = split(expected), split(got)
    if parts is None:
        if got != expected and not (equal_nan and got != got and expected != expected):
            raise AssertionError(f"{where}: {path}: replay gave {got!r}, eager {expected!r}")
        return
    if got_parts is None or type(got) is not type(expected) or got_parts.keys != parts.keys:
        raise AssertionError(
            f"{where}: {path}: replay gave {describe(got)}, eager {describe(expected)}"
        )
    for key, g, e in zip(parts.keys, got_parts.values, parts.values):
        _compare(g, e, parts.label(path, key), where, tolerance)
