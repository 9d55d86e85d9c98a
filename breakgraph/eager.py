"""``@eager_on_graph`` and ``break_graph()``: where a captured graph breaks.

A decorated function behaves exactly like the function it wraps, except inside
a segment being captured by :func:`breakgraph.capture`: there it ends the
segment, runs once eagerly, is registered to run again on every replay (with the
same arguments; its fresh results are copied into the capture-time outputs) and a
new segment begins. Built on ``wrapt`` so that signatures, ``__wrapped__``,
methods, classmethods, staticmethods and ``nn.Module.forward`` behave as usual.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import wrapt

from .buckets import validate_callable
from .errors import InputError
from .graph import BreakOptions
from .state import state

__all__ = ["eager_on_graph", "break_graph"]

_EMPTY_BREAK = BreakOptions("break_graph")


def _name_of(function: Any) -> str:
    """A readable break name: the function's qualified name, ``partial(f)``, or the class
    of a callable object (never a repr with a memory address)."""
    if isinstance(function, functools.partial):
        inner = function.func
        return f"partial({getattr(inner, '__name__', None) or _name_of(inner)})"
    if isinstance(function, (classmethod, staticmethod)):
        return _name_of(function.__func__)
    name = getattr(function, "__qualname__", None)
    if isinstance(name, str):
        return name
    return type(function).__name__


def eager_on_graph(
    function: Callable | None = None,
    *,
    enable: bool = True,
    capture_stub: Callable | None = None,
    check_values: bool = True,
):
    """Run ``function`` eagerly between captured segments, on capture and on every replay.

    Use it on host-dependent code: ``.item()``-driven control flow, attention
    metadata built from the live batch, loops over active experts, kernels that
    need exact host ints. Usable bare (``@eager_on_graph``) or with options:

    * ``enable=False`` returns ``function`` itself, unchanged (a switch for A/B runs);
    * ``capture_stub`` runs *instead of* ``function`` during the capture pass only
      (for rank-coupled or expensive work); it must return the same structure,
      shapes and dtypes. Replays run the real function. A stub that returns its
      argument (``lambda x: x``) stands for an in-place function: the real function
      must then return that argument on every replay;
    * ``check_values=False`` accepts Python values in the output (ints, strings)
      that differ from the capture-time ones, for values that are informational
      only; tensors are always checked.

    On replay the function is called with its capture-time arguments: read
    per-step state from static tensors or from :func:`breakgraph.replay_context`.
    It may return new tensors (copied into the capture-time ones, checked for
    shape, dtype and device) or the very tensors it was given (no copy). Not both:
    an output in memory that something else held at capture (an argument, a long-lived
    tensor such as one of several adapters) must be that memory on every replay, or
    :class:`~breakgraph.CopyBackError` is raised (copying into it would overwrite it for
    its other holders). If it raises during capture, the capture fails with
    :class:`~breakgraph.CaptureError` even when the exception is caught inside the
    capture block. A break replays under ``torch.inference_mode()`` if it was captured
    under it.

    Example::

        >>> import torch, breakgraph
        >>> @breakgraph.eager_on_graph
        ... def keep_positive(x):
        ...     return x[x > 0].sum().reshape(1)    # data-dependent: cannot be captured
        >>> x = torch.tensor([1.0, -2.0, 3.0])
        >>> g = breakgraph.BreakableCUDAGraph()
        >>> with breakgraph.capture(g, backend="emulated"):
        ...     total = keep_positive(x * 1) + 1
        >>> _ = x.copy_(torch.tensor([5.0, 5.0, -1.0])); g.replay(); total.tolist()
        [11.0]
    """

    validate_callable(capture_stub, "eager_on_graph: capture_stub")
    for name, flag in (("enable", enable), ("check_values", check_values)):
        if flag is not True and flag is not False:  # enable=None was off, enable="no" on
            raise InputError(f"eager_on_graph: {name} must be True or False, got {flag!r}.")

    def decorate(wrapped: Callable):
        if not enable:
            return wrapped
        _refuse_lazy(wrapped)
        options = BreakOptions(_name_of(wrapped), capture_stub, check_values)

        @wrapt.decorator
        def wrapper(inner, instance, args, kwargs):
            capture = state.capture
            if capture is None or not capture.in_segment or torch.compiler.is_compiling():
                return inner(*args, **kwargs)
            return capture.run_break(inner, options, args, kwargs)

        return wrapper(wrapped)

    if function is not None:
        # classmethod objects are not callable, but wrapt wraps them correctly (both orders).
        if not (callable(function) or isinstance(function, (classmethod, staticmethod))):
            raise InputError(f"eager_on_graph: expected a callable, got {function!r}.")
        return decorate(function)
    return decorate


def _refuse_lazy(function: Any) -> None:
    """A generator or ``async`` function returns before its body runs: the body would run
    where its result is consumed, after the break, inside the captured segment (so never
    eagerly on replay), and replays would hand back a new generator each time (refused then
    as a changed value, or, with ``check_values=False``, replaced by the capture-time one)."""
    target = getattr(function, "__func__", function)  # a classmethod or staticmethod object
    for kind, test in (
        ("a generator function", inspect.isgeneratorfunction),
        ("an async function", inspect.iscoroutinefunction),
        ("an async generator function", inspect.isasyncgenfunction),
    ):
        if test(target):
            raise InputError(
                f"eager_on_graph: {_name_of(function)!r} is {kind}; its body would run only "
                f"when its result is consumed, inside the captured segment, not eagerly. "
                f"Return the values themselves (a list or tuple of tensors)."
            )


def break_graph() -> None:
    """End the current segment and begin a new one, with nothing run between them.

    Outside a capture it does nothing. Useful to bound segment sizes, to measure
    per-break overhead, or to place a point where side streams are joined.

    Example::

        >>> import breakgraph
        >>> breakgraph.break_graph()   # no capture: a no-op
    """
    capture = state.capture
    if capture is not None and capture.in_segment and not torch.compiler.is_compiling():
        capture.run_break(None, _EMPTY_BREAK, (), {})
