"""``benchmarks/decode_forward_probe.py`` on the CPU: its timers over a short served run (every
part recorded on the pure-decode forwards, the parts adding up to the forward, every wrapped
function restored afterwards), and its main without CUDA."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


from benchmarks import cb_prep_profile, decode_forward_probe  # noqa: E402
from tests.helpers import needs_continuous_batching  # noqa: E402

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("one_cpu_thread")]
needs_cb = needs_continuous_batching()


@needs_cb
def test_the_timers_split_every_pure_decode_forward_and_restore_what_they_wrapped():
    from breakgraph.integrations.transformers import (
        cb_step,
        decode_graph,
        enable_continuous_batching,
    )

    from breakgraph.ladder import GraphLadder
    from breakgraph.patches import PatchSet

    model, prompts, cb_config = cb_prep_profile.build(34, block_table=True)
    prompts = [p[:12] for p in prompts]  # short: the emulated decode kernel reads every row
    wrapped = lambda: [cb_step.StepRunner.forward, cb_step.CBStep.refill, GraphLadder.decide,  # noqa: E731
                       GraphLadder.replay, cb_step.StepRunner._replay,
                       decode_graph.DecodeGraphs.replay, decode_graph.DecodeBuffers.fill,
                       torch.Tensor.to, cb_step.StepOrder.follow]  # fmt: skip
    before = wrapped()
    timers = decode_forward_probe.ForwardTimers()
    with enable_continuous_batching(model, backend="emulated"), torch.no_grad():
        with PatchSet() as patches:
            timers.install(patches)
            cb_prep_profile.serve(model, prompts, cb_config, 4, None)
    assert wrapped() == before and "to" not in vars(torch.Tensor)
    summary = timers.summary()
    assert summary["decode_graph_forwards"] >= 2 and summary["requests_median"] >= 32
    medians = summary["median_us"]
    assert set(medians) == {*decode_forward_probe.PARTS, "forward"}
    assert all(value >= 0 for value in medians.values()), medians
    recorded = {"refill", "decide", "_replay", "decode graphs", "decode fill", "decode replay",
                "ladder replay", "fp32 copy", "output object", "forward"}  # fmt: skip
    for forward in timers.forwards:  # every wrapper timed; the parts add up to the forward
        assert recorded <= forward.keys(), recorded - forward.keys()
        parts = timers.parts(forward)
        total = sum(parts[p] for p in decode_forward_probe.PARTS)
        assert total == pytest.approx(parts["forward"], rel=1e-6)


def test_without_cuda_it_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert decode_forward_probe.main(["--out", str(tmp_path / "out.json")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "out.json").exists()


def test_single_operations_are_timed_on_the_device_given():
    timed = decode_forward_probe.time_operations(torch.device("cpu"), repeats=100)
    assert {"output object (CausalLMOutputWithPast)", "copy int32 [2, n] into int64"} <= set(timed)
    assert all(value > 0 for value in timed.values()), timed
    assert not any("stream" in name for name in timed)  # CUDA's own calls: on a GPU only
