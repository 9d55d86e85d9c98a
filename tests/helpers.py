"""Test helpers shared by the behavioural test modules."""

import gc

import pytest
import torch

import breakgraph
from breakgraph import ReplayError

HAS_CUDA = torch.cuda.is_available()
# what breakgraph patches while capturing, as it was before any capture
ORIGINAL_IS_CAPTURING = torch.cuda.is_current_stream_capturing
ORIGINAL_GRAPHS_IS_CAPTURING = torch.cuda.graphs.is_current_stream_capturing
ORIGINAL_EVENT_RECORD = torch.cuda.Event.record
ORIGINAL_EVENT_WAIT = torch.cuda.Event.wait


def fresh_into(static):
    """Draw a fresh random tensor like ``static``, copy it in and return it."""
    new = torch.randn_like(static)
    static.copy_(new)
    return new


def assert_clean(graph=None):
    """Nothing left behind by a capture (finished or failed)."""
    assert not breakgraph.is_capturing()
    assert torch.cuda.is_current_stream_capturing is ORIGINAL_IS_CAPTURING
    assert torch.cuda.graphs.is_current_stream_capturing is ORIGINAL_GRAPHS_IS_CAPTURING
    assert torch.cuda.Event.record is ORIGINAL_EVENT_RECORD
    assert torch.cuda.Event.wait is ORIGINAL_EVENT_WAIT
    assert gc.isenabled()
    if HAS_CUDA:
        assert not torch.cuda.is_current_stream_capturing()
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
    if graph is not None:
        assert graph.num_segments == 0 and graph.num_breaks == 0
        assert repr(graph) == "BreakableCUDAGraph(empty)"
        with pytest.raises(ReplayError):
            graph.replay()
