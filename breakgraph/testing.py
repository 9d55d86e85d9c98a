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

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .graph import BreakableCUDAGraph, capture, context_scope

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
    debug: bool = False,
) -> BreakableCUDAGraph:
    """Capture ``fn`` once, then replay it on ``replays`` fresh draws and compare with eager.

    ``make_inputs()`` returns a fresh tuple of tensors (or one tensor) on every call:
    the first draw becomes the static inputs; each later draw is copied into them,
    the graph is replayed, and ``fn`` is run eagerly on the same draw. The first
    output that differs raises ``AssertionError`` naming the replay and its path
    (``output[1]['logits']``). Catches frozen host decisions, stale buffers that
    ``fn`` reads besides its inputs, and unwritten outputs. Returns the graph.
    """
    static = _as_tuple(make_inputs())
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
        with context_scope(context):
            expected = fn(*fresh)
        _compare(output, expected, "output", replay, atol, rtol)
    return graph


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
    elif isinstance(static, (tuple, list)):
        for i, (s, f) in enumerate(zip(static, fresh)):
            _copy_into(s, f, f"{path}[{i}]")
    elif isinstance(static, Mapping):
        for k in static:
            _copy_into(static[k], fresh[k], f"{path}[{k!r}]")


def _compare(got: Any, expected: Any, path: str, replay: int, atol: float, rtol: float) -> None:
    where = f"replay {replay}: {path}"
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{where}: replay gave {type(got).__name__}, eager a tensor")
        try:
            torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
        except AssertionError as exc:
            raise AssertionError(f"{where} differs from eager: {exc}") from None
    elif isinstance(expected, (tuple, list)):
        if len(got) != len(expected):
            raise AssertionError(f"{where}: length {len(got)} vs eager {len(expected)}")
        for i, (g, e) in enumerate(zip(got, expected)):
            _compare(g, e, f"{path}[{i}]", replay, atol, rtol)
    elif isinstance(expected, Mapping):
        for k in expected:
            _compare(got[k], expected[k], f"{path}[{k!r}]", replay, atol, rtol)
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            _compare(
                getattr(got, f.name),
                getattr(expected, f.name),
                f"{path}.{f.name}",
                replay,
                atol,
                rtol,
            )
    elif got != expected:
        raise AssertionError(f"{where}: replay gave {got!r}, eager {expected!r}")
