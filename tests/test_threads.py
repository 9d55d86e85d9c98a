"""Thread safety of the core on the emulated backend, used the way a server uses it.

Several threads capture and replay graphs of their own at once (captures take turns on the
process-wide lock), read the stats of a ladder another thread is capturing into, and open
blocks that patch process-wide functions in any order. Where an interleaving is needed, a
thread is paused at the exact point by a hook, so that the test fails the same way every time
without the fix; the integration's own thread tests are in ``test_continuous_batching.py``.
"""

import threading
import warnings

from breakgraph import distributed
from breakgraph.errors import BreakgraphWarning
from tests.helpers import run_threads


def test_all_reduce_as_breaks_blocks_exit_in_any_order():
    """Two runners with eager collectives (``PrefillRunner(tp_collectives="eager")``) serve from
    two threads: their ``all_reduce_as_breaks()`` blocks overlap and the first one in need not
    be the last one out. Each block installed a wrapper of its own and put back, on exit, what
    it had found: the first one out found the second's wrapper (a warning, and it left it),
    and the second one out then put the first's wrapper back, for good. One wrapper now serves
    every open block and the last one out restores torch's function."""
    import torch.distributed as dist

    original = dist.all_reduce
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    inside = {}

    def first():
        with distributed.all_reduce_as_breaks():
            first_in.set()
            assert second_in.wait(timeout=10)
        first_out.set()

    def second():
        assert first_in.wait(timeout=10)
        with distributed.all_reduce_as_breaks():
            second_in.set()
            assert first_out.wait(timeout=10)
            inside["after the first left"] = dist.all_reduce

    with warnings.catch_warnings(record=True) as caught:  # the process's: both threads' too
        warnings.simplefilter("always", BreakgraphWarning)
        run_threads(first, second)
    assert not [str(w.message) for w in caught if issubclass(w.category, BreakgraphWarning)]
    assert inside["after the first left"] is not original  # the second block still has it
    assert dist.all_reduce is original
