"""Every synchronous ``torch.distributed.all_reduce`` inside a capture as an eager break.

SGLang's choice for its piecewise graphs, one of :class:`~breakgraph.integrations.transformers.
PrefillRunner`'s (``tp_collectives="eager"``): the captured segments hold no communication,
and the collectives run between them on every replay. Re-exported by
:mod:`breakgraph.distributed`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .eager import eager_on_graph
from .patches import PatchSet, SharedPatches

__all__ = ["all_reduce_as_breaks"]


@contextlib.contextmanager
def all_reduce_as_breaks() -> Iterator[None]:
    """Inside a capture, run every synchronous ``torch.distributed.all_reduce`` as an eager break.

    This is SGLang's choice for its piecewise graphs: the collective runs outside the
    graph on every replay, and the captured segments hold no communication. transformers'
    row-parallel layers call ``torch.distributed.all_reduce`` (the module attribute) in
    place, so swapping that attribute while the capture runs is the narrowest hook. It is
    restored when the last block open in the process exits (one wrapper for every thread: it
    makes breaks only on a thread inside a block and capturing, and blocks entered and left on
    several threads in any order, two runners serving from two threads, restore the original),
    and elsewhere the wrapper only calls the original function. Asynchronous calls
    (``async_op=True``) and functional collectives (the ``lm_head`` all-gather of DTensor) are
    left as they are.

    Example::

        >>> import torch.distributed as dist
        >>> original = dist.all_reduce
        >>> with all_reduce_as_breaks():
        ...     dist.all_reduce is original
        False
        >>> dist.all_reduce is original
        True
    """
    _all_reduce_breaks.acquire()
    _blocks.depth += 1
    try:
        yield
    finally:
        _blocks.depth -= 1
        _all_reduce_breaks.release()


def _install_all_reduce_breaks(patches: PatchSet) -> None:
    import torch.distributed as dist

    original = dist.all_reduce
    as_break = eager_on_graph(original)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op or not _blocks.depth:  # a thread outside every block: as torch's
            return original(tensor, op=op, group=group, async_op=async_op)
        return as_break(tensor, op=op, group=group)

    patches.attribute(dist, "all_reduce", all_reduce)


# installed with the first all_reduce_as_breaks() block open and removed with the last: a
# wrapper per block, restored as each block exits, left another thread's block without its
# wrapper, or a wrapper installed for good when the blocks did not exit in reverse order
_all_reduce_breaks = SharedPatches(_install_all_reduce_breaks)


class _BlockDepth(threading.local):
    """How many all_reduce_as_breaks() blocks this thread is inside: the one wrapper makes
    breaks only for them (another thread's capture, outside every block, keeps its all-reduces
    in its graph, as its ranks' fingerprints expect)."""

    depth = 0


_blocks = _BlockDepth()
