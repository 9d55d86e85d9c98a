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

import logging as _logging

from .eager import break_graph, eager_on_graph
from .errors import (
    BackendError,
    BreakgraphError,
    BreakgraphWarning,
    CaptureError,
    CopyBackError,
    HostSyncError,
    InputError,
    RankFailedError,
    RankMismatchError,
    ReplayError,
    StaleTensorError,
    StreamError,
)
from .graph import BreakableCUDAGraph, capture
from .state import context_scope, is_capturing, replay_context

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
    "RankMismatchError",
    "RankFailedError",
    "StaleTensorError",
    "BreakgraphWarning",
]
