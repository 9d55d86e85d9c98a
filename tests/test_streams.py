"""The stream tracker's bookkeeping, on the CPU: fake streams and events stand for CUDA's.

The CUDA tests (``test_streams_cuda.py``) check the real thing; these check which streams the
tracker counts as forked when a segment ends, which decides what it forks again in the next.
"""

import contextlib

import pytest
import torch

import breakgraph
from breakgraph import StreamError
from breakgraph.streams import StreamTracker


class FakeEvent:
    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass


class FakeStream:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name

    def wait_stream(self, other):  # as torch.cuda.Stream.wait_stream: through an event
        event = torch.cuda.Event()
        event.record(other)
        event.wait(self)


@pytest.fixture
def tracked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    capture_stream, side = FakeStream("capture"), FakeStream("side")
    tracker = StreamTracker(capture_stream)
    with contextlib.ExitStack() as stack:
        tracker.install(stack)
        tracker.begin_segment()
        yield tracker, capture_stream, side


def test_a_stream_forked_again_after_the_user_joined_it_is_forked_again_after_a_break(tracked):
    """Two layers that each fork a side stream and join it, the second with a break in between:
    the second fork was not counted (the stream stayed 'joined by the user'), so the break did not
    fork it again and the join after it raised StreamError on a correct program."""
    tracker, capture_stream, side = tracked
    side.wait_stream(capture_stream)  # layer 1: fork ...
    capture_stream.wait_stream(side)  # ... and join
    side.wait_stream(capture_stream)  # layer 2: fork ...
    assert tracker.join_all() == [side]  # ... a break: still forked, forked again next segment
    tracker.begin_segment()
    capture_stream.wait_stream(side)  # ... and join after the break: no StreamError
    assert tracker.join_all() == []


def test_waiting_on_a_stream_outside_the_capture_raises(tracked):
    _, capture_stream, side = tracked
    with pytest.raises(StreamError, match="waits on an event recorded on side"):
        capture_stream.wait_stream(side)


def test_a_stream_error_caught_inside_the_capture_block_fails_the_capture(tracked):
    """The refused wait never ran, so the segment lacks that dependency: code that catches the
    error (a library's ``except RuntimeError`` fallback) would get a graph that races on replay.
    As after a refused host sync, the capture raises when the block ends and holds nothing."""
    _, capture_stream, side = tracked
    g = breakgraph.BreakableCUDAGraph()
    with pytest.raises(breakgraph.CaptureError, match="StreamError refused"):
        with breakgraph.capture(g, backend="emulated"):
            try:
                capture_stream.wait_stream(side)
            except RuntimeError:
                pass
    assert g.num_segments == 0
    with breakgraph.capture(g, backend="emulated"):  # the next capture is unaffected
        pass
    assert g.num_segments == 1
