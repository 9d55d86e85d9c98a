"""``cb_step.StepOrder``: continuous-batching steps of managers on different CUDA streams run in
the order they were issued; steps on one stream add no wait.

The bookkeeping runs on the CPU with stand-in streams; the ordering itself on a GPU (two real
streams, the first one's step still running when the second starts)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from breakgraph.integrations.transformers.cb_step import StepOrder  # noqa: E402


class FakeStream:
    """What ``StepOrder`` uses of a stream: equality and ``wait_stream``."""

    def __init__(self, name: str, waits: list) -> None:
        self.name, self.waits = name, waits

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStream) and other.name == self.name

    def wait_stream(self, other) -> None:
        self.waits.append((self.name, other.name))


def test_a_step_waits_only_where_the_stream_changed(monkeypatch):
    waits: list = []
    # a fresh object per lookup, as torch.cuda.current_stream() returns
    current = {"name": "a"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: FakeStream(current["name"], waits))
    order = StepOrder()
    for name in ("a", "a", "b", "b", "a", "c", "c"):
        current["name"] = name
        order.follow()
    assert waits == [("b", "a"), ("a", "b"), ("c", "a")]


@pytest.mark.requires_cuda
def test_a_step_on_another_stream_sees_the_step_before_it():
    """Stream ``first`` writes after a long sleep; the next step, on ``second``, reads: without
    the wait it would read before the write lands (the value at the start)."""
    order = StepOrder()
    first, second = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)
    for trial in range(3):
        value = torch.randn(1 << 16, device="cuda")
        expected = value + 1
        torch.cuda.synchronize()
        with torch.cuda.stream(first):
            order.follow()
            torch.cuda._sleep(50_000_000)  # tens of milliseconds of device time
            value.add_(1)
        with torch.cuda.stream(second):
            order.follow()
            seen = value.clone()
        torch.cuda.synchronize()
        torch.testing.assert_close(seen, expected, msg=f"trial {trial}")
        assert order.last == second
        order.last = None  # the next trial starts on `first` again, with no step before it
