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

        try:
            g.replay()
        except breakgraph.BreakgraphError as e:
            print("breakgraph refused:", e)
    """


class BackendError(BreakgraphError):
    """No usable backend: no GPU and no ``backend="emulated"`` / ``BREAKGRAPH_BACKEND``."""


class CaptureError(BreakgraphError):
    """A capture could not start or could not be completed (nested, already captured, ...)."""


class HostSyncError(CaptureError):
    """Code inside a captured segment needed the host to see device values.

    A CUDA graph runs no Python on replay, so ``.item()``, ``nonzero``, ``if tensor:``
    and friends cannot be recorded. Move that code into a function decorated with
    :func:`breakgraph.eager_on_graph`.
    """


class StreamError(CaptureError):
    """A stream dependency that a captured segment cannot express (never dropped silently)."""


class ReplayError(BreakgraphError):
    """``replay()`` was called on a graph that holds no capture."""


class CopyBackError(BreakgraphError, TypeError):
    """An eager function returned something that cannot be copied into its capture-time output.

    Attributes ``function``, ``path``, ``captured`` and ``got`` describe the mismatch.
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
    """An input cannot be placed into a static buffer (rank, dtype, device or size)."""


class StaleTensorError(ReplayError):
    """Debug mode: a tensor the graph reads was freed or moved since capture.

    Captured kernels read it at its capture-time address; keep it alive and refill it
    in place (``copy_``) instead of replacing it.
    """


class RankMismatchError(BreakgraphError):
    """The ranks that replay graphs together were given different inputs or settings.

    With tensor parallelism every rank must make the same call with the same inputs
    (prompts, buckets, options); otherwise the sharded model computes silently wrong
    results or the ranks wait on each other forever. Raised on every rank, before any
    graph runs (see :mod:`breakgraph.distributed`).
    """


class RankFailedError(BreakgraphError):
    """Another rank failed (or stopped answering), so this rank stopped too instead of hanging.

    Raised on the ranks that did *not* fail; the failing rank raises its own error.
    After a failure during capture the model's process group has seen different
    collectives on different ranks and cannot be trusted: end the processes and restart.
    """


class BreakgraphWarning(UserWarning):
    """Something breakgraph fixed for you but you may want to know (debug mode)."""
