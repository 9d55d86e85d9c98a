"""The error of the transformers integration, below every module that raises it.

:class:`UnsupportedModelError` is raised by the support policy (:mod:`.models`: the model,
its configuration) and by the support gate (:mod:`.compat`: the installed transformers),
so it lives under both; ``models`` and the package re-export it. Like every error of
breakgraph it derives from :class:`breakgraph.BreakgraphError`, and from ``ValueError``.

Example::

    >>> from breakgraph.integrations.transformers import UnsupportedModelError
    >>> import breakgraph
    >>> issubclass(UnsupportedModelError, (breakgraph.BreakgraphError, ValueError))
    True
"""

from __future__ import annotations

from breakgraph.errors import BreakgraphError

__all__ = ["UnsupportedModelError"]


class UnsupportedModelError(BreakgraphError, ValueError):
    """The model, its configuration or the installed transformers cannot be served correctly."""
