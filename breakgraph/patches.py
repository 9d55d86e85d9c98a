"""Scoped patches: set an attribute for the length of a capture, restore it exactly.

breakgraph patches a few process-wide attributes while a capture runs (``streams.py``
hooks ``torch.cuda.Event.record``/``wait``; the emulated backend answers
``torch.cuda.is_current_stream_capturing``). Each patch is registered on the capture
session's ``contextlib.ExitStack`` so every exit path undoes it, and an attribute is
restored only if it still holds breakgraph's value: if other code replaced it meanwhile,
theirs stays and a :class:`~breakgraph.BreakgraphWarning` says so.

Example::

    >>> import contextlib, types
    >>> from breakgraph.patches import patch_attribute
    >>> box = types.SimpleNamespace(f=len)
    >>> with contextlib.ExitStack() as stack:
    ...     patch_attribute(stack, box, "f", abs)
    ...     box.f(-2)
    2
    >>> box.f is len
    True
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from .errors import BreakgraphWarning

__all__ = ["patch_attribute"]


def patch_attribute(stack: contextlib.ExitStack, owner: Any, name: str, value: Any) -> None:
    """``owner.name = value`` until ``stack`` closes; then the original, if still ours."""
    original = getattr(owner, name)
    setattr(owner, name, value)

    def restore() -> None:
        if getattr(owner, name) is value:
            setattr(owner, name, original)
            return
        where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
        warnings.warn(
            f"breakgraph: {where}.{name} was replaced by other code while breakgraph had patched "
            f"it for a capture; leaving the new value in place (breakgraph's patch is gone).",
            BreakgraphWarning,
            stacklevel=2,
        )

    stack.callback(restore)
