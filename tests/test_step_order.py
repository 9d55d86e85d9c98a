"""``cb_step.StepOrder``: continuous-batching steps of managers on different CUDA streams run in
the order they were issued; steps on one stream add no wait; every step starts with it.

The bookkeeping runs on the CPU with stand-in streams; the ordering itself on a GPU (two real
streams, the first one's step still running when the second starts)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from breakgraph.integrations.transformers.cb_step import StepOrder  # noqa: E402

from tests.helpers import needs_continuous_batching  # noqa: E402


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


@needs_continuous_batching()
def test_every_step_runs_after_the_order_and_before_anything_else(monkeypatch):
    """``StepRunner.forward`` calls ``follow()`` first on every step (CUDA only: here a stand-in
    order on the emulated backend), before the step touches transformers' tensors."""
    from breakgraph.integrations.transformers import cb_step, enable_continuous_batching

    from tests.test_continuous_batching import BUCKETS, build_model, generate_batch, random_prompts

    events, forward, refill = [], cb_step.StepRunner.forward, cb_step.CBStep.refill

    class Order:
        def follow(self):
            events.append("follow")

    def counted_forward(runner, **kwargs):
        events.append("forward")
        return forward(runner, **kwargs)

    def counted_refill(step, *args):
        events.append("refill")
        return refill(step, *args)

    monkeypatch.setattr(cb_step.StepRunner, "forward", counted_forward)
    monkeypatch.setattr(cb_step.CBStep, "refill", counted_refill)
    model = build_model("llama")
    with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS) as handle:
        handle.runner._order = Order()
        generate_batch(model, random_prompts(seed=16))
    steps = events.count("forward")
    assert steps > 2 and events == ["forward", "follow", "refill"] * steps, events[:9]
