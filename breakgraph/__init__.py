"""breakgraph: run almost all of a model under CUDA graphs, with declared eager breaks.

::

    import breakgraph

    @breakgraph.eager_on_graph            # runs eagerly on every replay
    def plan_attention(meta): ...

    g = breakgraph.BreakableCUDAGraph()
    with breakgraph.capture(g):           # warm up first, as with torch.cuda.graph
        out = model(static_input)         # segments are captured around each eager call
    static_input.copy_(new_input)
    g.replay()                            # segment, eager fn, segment, ..., segment

See ``docs/concepts.md`` for the semantics and ``examples/`` for runnable scripts.
"""

from .eager import break_graph, eager_on_graph
from .errors import (
    BackendError,
    BreakgraphError,
    CaptureError,
    CopyBackError,
    HostSyncError,
    InputError,
    ReplayError,
    StaleTensorError,
    StreamError,
    BreakgraphWarning,
)
from .graph import BreakableCUDAGraph, capture, context_scope, is_capturing, replay_context

import logging as _logging

_logging.getLogger("breakgraph").addHandler(_logging.NullHandler())  # nothing printed by default

__version__ = "0.1.0"

__all__ = [
    "BreakableCUDAGraph",
    "capture",
    "eager_on_graph",
    "break_graph",
    "is_capturing",
    "replay_context",
    "context_scope",
    "BreakgraphError",
    "BackendError",
    "CaptureError",
    "HostSyncError",
    "StreamError",
    "ReplayError",
    "CopyBackError",
    "InputError",
    "StaleTensorError",
    "BreakgraphWarning",
]


def _mount_checkout_integrations() -> None:
    """Make ``breakgraph.integrations`` importable from a source checkout.

    Installed wheels place the top-level ``integrations/`` folder inside the
    package. In a checkout whose ``breakgraph/`` shadows the installed package (tests
    run from the repository root), older setuptools' editable finders do not map it,
    so load it here from ``../integrations``. Its ``__init__`` imports nothing heavy.
    """
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    source = os.path.join(os.path.dirname(here), "integrations", "__init__.py")
    name = __name__ + ".integrations"
    if name in sys.modules or os.path.isdir(os.path.join(here, "integrations")):
        return
    if not os.path.isfile(source) or importlib.util.find_spec(name) is not None:
        return
    spec = importlib.util.spec_from_file_location(
        name, source, submodule_search_locations=[os.path.dirname(source)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_mount_checkout_integrations()
