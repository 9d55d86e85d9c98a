"""The one exception hierarchy of breakgraph.

Every error the library raises derives from :class:`BreakgraphError`, so callers
can catch the library's failures without catching their own. Subclasses also
derive from the closest built-in (``ValueError``, ``TypeError``, ``RuntimeError``)
so that code written against plain PyTorch keeps working.

Messages follow one rule: name the function, the tensor path and the fix.
"""

from __future__ import annotations

__all__ = [
    "BreakgraphError",
    "BackendError",
    "CaptureError",
    "HostSyncError",
    "StreamError",
    "ReplayError",
    "CopyBackError",
    "InputError",
    "StaleTensorError",
    "RankMismatchError",
    "RankFailedError",
    "BreakgraphWarning",
]


class BreakgraphError(RuntimeError):
    """Base class of every error raised by breakgraph.

    Example::

        >>> import breakgraph
        >>> try:
        ...     breakgraph.BreakableCUDAGraph().replay()  # nothing captured
        ... except breakgraph.BreakgraphError as e:
        ...     print(type(e).__name__, isinstance(e, RuntimeError))
        ReplayError True
    """


class BackendError(BreakgraphError):
    """No usable backend: no GPU and no ``backend="emulated"`` / ``BREAKGRAPH_BACKEND``, or an
    unknown backend name.

    Example::

        >>> import breakgraph
        >>> breakgraph.capture(breakgraph.BreakableCUDAGraph(), backend="tpu").__enter__()
        Traceback (most recent call last):
        breakgraph.errors.BackendError: ...
    """


class CaptureError(BreakgraphError):
    """A capture could not start or could not be completed (nested, already captured, ...).

    Example::

        >>> import breakgraph
        >>> breakgraph.BreakableCUDAGraph().pool()  # no capture yet: no pool
        Traceback (most recent call last):
        breakgraph.errors.CaptureError: ...
    """


class HostSyncError(CaptureError):
    """Code inside a captured segment needed the host to see device values.

    A CUDA graph runs no Python on replay, so ``.item()``, ``nonzero``, ``if tensor:``
    and friends cannot be recorded. Move that code into a function decorated with
    :func:`breakgraph.eager_on_graph`.

    Example::

        >>> import torch, breakgraph
        >>> x = torch.randn(4)
        >>> with breakgraph.capture(breakgraph.BreakableCUDAGraph(), backend="emulated"):
        ...     n = int((x > 0).sum())  # a device value read on the host
        Traceback (most recent call last):
        breakgraph.errors.HostSyncError: ...
    """


class StreamError(CaptureError):
    """A stream dependency that a captured segment cannot express (never dropped silently):
    on CUDA, a stream in the capture waiting on work recorded outside it.

    Example::

        >>> import breakgraph
        >>> issubclass(breakgraph.StreamError, breakgraph.CaptureError)
        True
    """


class ReplayError(BreakgraphError):
    """A graph (or a runner) cannot replay now: it holds no capture, it is replaying already,
    it was closed, its model moved, or ``replay_context()`` has no context set.

    Example::

        >>> import breakgraph
        >>> breakgraph.replay_context()  # outside any replay or context_scope
        Traceback (most recent call last):
        breakgraph.errors.ReplayError: ...
    """


class CopyBackError(BreakgraphError, TypeError):
    """An eager function returned something that cannot be copied into its capture-time output.

    Attributes ``function``, ``path``, ``captured`` and ``got`` describe the mismatch.

    Example::

        >>> import torch, breakgraph
        >>> rows = {"n": 2}
        >>> @breakgraph.eager_on_graph
        ... def head(h):
        ...     return h[: rows["n"]] * 2  # a shape from host state
        >>> g = breakgraph.BreakableCUDAGraph()
        >>> with breakgraph.capture(g, backend="emulated"):
        ...     y = head(torch.randn(4) + 1)
        >>> rows["n"] = 3
        >>> try:
        ...     g.replay()
        ... except breakgraph.CopyBackError as e:
        ...     print(e.function, e.path)
        head output
    """

    def __init__(
        self, function: str, path: str, problem: str, captured: str, got: str, fix: str = ""
    ):
        self.function, self.path, self.captured, self.got = function, path, captured, got
        fix = fix or (
            f"Captured segments keep reading the capture-time object, so on replay {function!r} "
            f"must return the same structure, shapes, dtypes and devices (and equal Python "
            f"values, unless decorated with @eager_on_graph(check_values=False))."
        )
        super().__init__(
            f"eager function {function!r} returned {problem} at {path}: captured {captured}, "
            f"got {got}. {fix}"
        )


class InputError(BreakgraphError, ValueError):
    """An argument or input is invalid: a bad option, or an input that cannot be placed into a
    static buffer (rank, dtype, device or size). Also a ``ValueError``.

    Example::

        >>> import breakgraph
        >>> breakgraph.eager_on_graph(3)
        Traceback (most recent call last):
        breakgraph.errors.InputError: ...
    """


class StaleTensorError(ReplayError):
    """Debug mode: a tensor the graph reads was freed or moved since capture.

    Captured kernels read it at its capture-time address; keep it alive and refill it
    in place (``copy_``) instead of replacing it.

    Example::

        >>> import torch, breakgraph
        >>> x = torch.randn(4)
        >>> g = breakgraph.BreakableCUDAGraph()
        >>> with breakgraph.capture(g, backend="emulated", debug=True):
        ...     y = x * 2
        >>> _ = x.resize_(64)  # new memory: the graph would read the old
        >>> g.replay()
        Traceback (most recent call last):
        breakgraph.errors.StaleTensorError: ...
    """


class RankMismatchError(BreakgraphError):
    """The ranks that replay graphs together were given different inputs or settings.

    With tensor parallelism every rank must make the same call with the same inputs
    (prompts, buckets, options); otherwise the sharded model computes silently wrong
    results or the ranks wait on each other forever. Raised on every rank, before any
    graph runs (see :mod:`breakgraph.distributed`).

    Example::

        >>> import breakgraph
        >>> issubclass(breakgraph.RankMismatchError, breakgraph.BreakgraphError)
        True
    """


class RankFailedError(BreakgraphError):
    """Another rank failed (or stopped answering), so this rank stopped too instead of hanging.

    Raised on the ranks that did *not* fail; the failing rank raises its own error.
    After a failure during capture the model's process group has seen different
    collectives on different ranks and cannot be trusted: end the processes and restart.

    Example::

        >>> import breakgraph
        >>> issubclass(breakgraph.RankFailedError, breakgraph.BreakgraphError)
        True
    """


class BreakgraphWarning(UserWarning):
    """Something breakgraph fixed for you but you may want to know (debug mode: unjoined side
    streams; also an attribute breakgraph patched that other code replaced meanwhile).

    Example::

        >>> import warnings, breakgraph
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warnings.warn("demo", breakgraph.BreakgraphWarning)
        >>> seen[0].category.__name__, issubclass(breakgraph.BreakgraphWarning, UserWarning)
        ('BreakgraphWarning', True)
    """
