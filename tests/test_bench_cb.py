"""The continuous-batching benchmark's own parts (``benchmarks/bench_cb.py``, ``roofline``,
``cb_report``), on the CPU: the floor arithmetic, the pure-decode window, the transformers
internals it reads (probed, and failing with a clear message), the graph counter, the
ratios, and the performance page's section with one table per transformers release; and the
whole ``--smoke`` run (every variant), once, in this process."""

from __future__ import annotations

import copy
import dataclasses
import doctest
import json
import logging
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from breakgraph.integrations.transformers import compat  # noqa: E402

from benchmarks import (  # noqa: E402
    bench_cb,
    cb_instruments,
    cb_report,
    report_cb_decode,
    report_cb_host,
    roofline,
)
from tests.helpers import (  # noqa: E402
    needs_continuous_batching,
    no_full_collections_in_cb_cleanup,
)

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("one_cpu_thread")]
needs_cb = needs_continuous_batching()

SHAPE = roofline.Shape(layers=2, heads=4, kv_heads=2, head_dim=16, dense_params=1000,
                       expert_params=800, experts=8, top_k=2, head_params=500,
                       bytes_per_param=2)  # fmt: skip


# -- the floor --------------------------------------------------------------------------------
@pytest.mark.parametrize("module", [roofline, cb_instruments], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_a_floor_takes_the_cards_bandwidth_unless_told_and_warns_for_an_unknown_card(capsys):
    """Session 55 ran bench_cb on an H100 without --hbm-tbs and its floors took an H200's
    bandwidth: the card now decides, the flags still win, and a card not in CARDS says so."""
    h100 = roofline.floor_peaks(None, None, "NVIDIA H100 80GB HBM3")
    assert h100 == (3.35e12, 990e12)
    assert roofline.floor_peaks(None, None, "NVIDIA H200") == (4.8e12, 990e12)
    assert roofline.floor_peaks(2.0, 500.0, "NVIDIA H100 80GB HBM3") == (2.0e12, 500e12)
    assert capsys.readouterr().err == ""
    assert roofline.floor_peaks(None, None, None) == (4.8e12, 990e12)  # the CPU: nominal
    assert capsys.readouterr().err == ""
    assert roofline.floor_peaks(None, None, "NVIDIA A10G") == (4.8e12, 990e12)
    assert "no HBM bandwidth known for 'NVIDIA A10G'" in capsys.readouterr().err
    roofline.floor_peaks(0.6, None, "NVIDIA A10G")  # told: no warning
    assert capsys.readouterr().err == ""


def test_decode_step_floor_counts_weights_routed_experts_and_kv_rows():
    one = roofline.decode_step_floor(SHAPE, requests=1, context=10, hbm_bytes_per_s=1e3)
    # one token reads 2 of 8 experts: 800 * 2/8 = 200 expert parameters
    assert one["bytes"] == (1000 + 500 + 200) * 2 + 10 * SHAPE.kv_bytes_per_token
    many = roofline.decode_step_floor(SHAPE, requests=1000, context=10, hbm_bytes_per_s=1e3)
    weights = many["bytes"] - 1000 * 10 * SHAPE.kv_bytes_per_token
    assert weights == pytest.approx((1000 + 500 + 800) * 2)  # every expert routed to
    assert one["memory_bound"] and one["floor_ms"] == pytest.approx(one["bytes"])  # 1 kB/s


def test_workload_floor_adds_the_phases_and_bounds_them():
    floor = roofline.workload_floor(SHAPE, [100, 300], new_tokens=5, max_batch_tokens=256)
    assert floor["prefill_steps"] == 2 and floor["decode_steps"] == 4
    assert floor["roofline_s"] == pytest.approx(floor["prefill_s"] + floor["decode_s"])
    assert 0 < floor["bound_s"] <= floor["roofline_s"]
    longer = roofline.workload_floor(SHAPE, [100, 300], new_tokens=50, max_batch_tokens=256)
    assert longer["decode_s"] > 10 * floor["decode_s"]


def test_sliding_window_layers_read_at_most_their_window():
    """A sliding-window layer's decode query reads at most its window of keys (the floor of
    a Gemma-3-like model is not its full-attention twin's), and its prefill queries attend to
    at most that many; ``shape_of`` counts the layers from ``layer_types`` (or every layer
    where the config has a window and no types)."""
    from benchmarks.families import SMOKE_FAMILIES, TINY

    windowed = dataclasses.replace(SHAPE, sliding_layers=1, window=4)
    per_layer = SHAPE.kv_bytes_per_token // SHAPE.layers
    short = roofline.decode_step_floor(windowed, requests=1, context=3, hbm_bytes_per_s=1e3)
    assert short["bytes"] == roofline.decode_step_floor(SHAPE, 1, 3, hbm_bytes_per_s=1e3)["bytes"]
    step = roofline.decode_step_floor(windowed, requests=1, context=10, hbm_bytes_per_s=1e3)
    whole = roofline.decode_step_floor(SHAPE, requests=1, context=10, hbm_bytes_per_s=1e3)
    assert whole["bytes"] - step["bytes"] == (10 - 4) * per_layer
    assert windowed.attended_pairs(3) == SHAPE.attended_pairs(3) == 6
    assert windowed.attended_pairs(10) == (55 + (10 + 6 * 4)) / 2  # full + windowed layer
    gpt_oss = transformers.AutoModelForCausalLM.from_config(SMOKE_FAMILIES["tiny-gpt-oss"].config())
    shape = roofline.shape_of(gpt_oss)  # a sliding and a full layer
    assert (shape.sliding_layers, shape.window) == (1, gpt_oss.config.sliding_window)
    mistral = transformers.MistralConfig(**TINY, sliding_window=8)
    shape = roofline.shape_of(transformers.AutoModelForCausalLM.from_config(mistral))
    assert (shape.sliding_layers, shape.window) == (mistral.num_hidden_layers, 8)
    llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY))
    assert roofline.shape_of(llama).sliding_layers == 0


def test_shape_of_counts_experts_apart_and_a_tied_head_once():
    from benchmarks.families import SMOKE_FAMILIES, TINY

    moe = transformers.AutoModelForCausalLM.from_config(SMOKE_FAMILIES["tiny-mixtral"].config())
    shape = roofline.shape_of(moe)
    total = sum(p.numel() for p in moe.parameters())
    embedding = moe.get_input_embeddings().weight.numel()
    assert shape.experts == 4 and shape.top_k == 2 and shape.expert_params > 0
    assert shape.dense_params + shape.expert_params + embedding + shape.head_params == total
    tied = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**TINY, tie_word_embeddings=True)
    )
    shape = roofline.shape_of(tied)
    assert shape.experts == 0 and shape.bytes_per_param == 4
    assert shape.head_params == tied.get_input_embeddings().weight.numel()
    assert shape.dense_params + shape.head_params == sum(p.numel() for p in tied.parameters())


# -- the pure-decode window -------------------------------------------------------------------
def _output(stamps):
    return types.SimpleNamespace(timestamps=stamps, created_time=0.0)


def test_decode_window_takes_the_steps_where_every_request_decodes():
    # request a: first token at 1, then every 1 s; b is prefilled later (first token at 3)
    a = _output([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    b = _output([3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5])
    window = cb_instruments.decode_window([a, b], [10, 20])
    # window [3, 6]: a's intervals 3-4, 4-5, 5-6 (1 s), b's six of 0.5 s between 3 and 6
    assert window["decode_intervals"] == 9 and window["decode_requests"] == 2
    assert window["decode_step_ms"] == pytest.approx(500.0)
    keys = [10 + i for i in (3, 4, 5)] + [20 + i for i in range(1, 7)]
    assert window["decode_context"] == pytest.approx(sum(keys) / len(keys))
    assert cb_instruments.decode_window([_output([1.0, 2.0]), _output([3.0, 4.0])], [5, 5]) == {}


# -- the transformers internals the benchmark reads --------------------------------------------
@needs_cb
def test_the_internals_read_are_there_on_this_release():
    assert cb_instruments.internals_problems(stock_graphs=True) == []


@needs_cb
def test_a_missing_internal_fails_with_a_clear_message(monkeypatch):
    processor = cb_instruments._processor_class()
    monkeypatch.delattr(processor, "prepare_next_batch")
    found = cb_instruments.internals_problems(stock_graphs=False)
    assert any("prepare_next_batch" in problem for problem in found)
    with pytest.raises(SystemExit) as error:
        cb_instruments.require_internals(stock_graphs=False)
    message = str(error.value)
    assert f"transformers {transformers.__version__}" in message and "INTERNALS" in message


@needs_cb
def test_a_vanished_graph_message_is_named(monkeypatch):
    log = cb_instruments.GraphLog
    monkeypatch.setattr(log, "MESSAGES", ("Creating graph for", "No such message"))
    assert cb_instruments.internals_problems(stock_graphs=False) == []  # not read then
    found = cb_instruments.internals_problems(stock_graphs=True)
    assert found == ["transformers no longer logs 'No such message' (stock graph count)"]


def test_graph_log_counts_captures_quietly_and_restores_the_logger(capfd):
    import contextlib

    logger = logging.getLogger(cb_instruments.GraphLog.LOGGER)
    console = logging.StreamHandler()
    logger.addHandler(console)  # as transformers' own console handler
    level = logger.level
    try:
        log = cb_instruments.GraphLog()
        with contextlib.ExitStack() as stack:
            log.install(stack)
            logger.info("Creating graph for key = (64, 16384)")
            logger.info("Setting graph for key = (64, 16384)")
            logger.info("Setting graph for key = (128, 16384)")  # no 'Creating' seen: no time
            assert log.captures == 2 and log.capture_s >= 0
            logger.warning("a warning still shows")
        assert log not in logger.handlers and logger.level == level
        assert console.level == logging.NOTSET
    finally:
        logger.removeHandler(console)
    err = capfd.readouterr().err
    assert "a warning still shows" in err and "Setting graph" not in err


def test_step_counter_times_long_list_conversions_inside_preparation_only(monkeypatch):
    """``--prep-lists``: inside ``prepare_next_batch`` only, and only for lists longer than
    ``LONG_LIST``; an idle poll (no step) counts nothing; ``torch.tensor`` is restored."""
    from breakgraph.integrations.transformers.index_lists import NumpyLists

    from breakgraph.patches import PatchSet

    long_list = list(range(cb_instruments.StepCounter.LONG_LIST + 1))

    class Processor:
        step = True

        def prepare_next_batch(self):
            torch.tensor(long_list)
            torch.tensor([1, 2, 3])  # short: not counted
            # breakgraph's numpy path (what transformers calls while CB is enabled): counted
            # once, though it may call torch.tensor itself
            NumpyLists().tensor(long_list, dtype=torch.int64)
            return self.step

    idle = Processor()
    idle.step = False

    monkeypatch.setattr(cb_instruments, "_processor_class", lambda: Processor)
    original, numpy_path = torch.tensor, NumpyLists.tensor
    counter = cb_instruments.StepCounter(lists=True)
    with PatchSet() as patches:
        counter.install(patches)
        torch.tensor(long_list)  # outside the preparation: not counted
        Processor().prepare_next_batch()
        idle.prepare_next_batch()  # an idle poll
        Processor().prepare_next_batch()
    assert torch.tensor is original
    summary = counter.summary()
    assert summary["host_prepare_list_entries_per_step"] == 2 * len(long_list)
    assert counter.steps == 2 and NumpyLists.tensor is numpy_path
    assert len(counter.each) == 2 and sum(counter.each) == pytest.approx(1e3 * counter.prepare_s)
    assert 0 < summary["host_prepare_lists_ms_per_step"] <= summary["host_prepare_ms_per_step"]
    plain = cb_instruments.StepCounter()
    assert set(plain.summary()) == {"host_prepare_ms_per_step"}


def test_the_page_splits_transformers_preparation_where_measured():
    """``bench_cb --prep-lists`` results give the page a table per release, model and variant
    with the conversion's share of the preparation and of the step; runs without it none."""
    variant = {"tokens_per_s": 1000.0, "wall_ms_per_step": 10.0, "host_prepare_ms_per_step": 6.0,
               "host_prepare_lists_ms_per_step": 3.0, "host_prepare_ns_per_list_entry": 60.0,
               "host_prepare_list_entries_per_step": 50000.0}  # fmt: skip
    run = {"meta": {"device": "GPU", "torch": "2.x", "date": "today", "transformers": "5.17.0"},
           "models": [{"model": "m", "variants": {"breakgraph": variant}}]}  # fmt: skip
    text = report_cb_host.prep_lists_section([run])
    assert "| 5.17.0 | m | `breakgraph` | 1000 | 10.0 | 6.0 | 3.0 | 50% | 30% |" in text
    assert "3.0–3.0 ms per step" in text
    plain = copy.deepcopy(run)
    del plain["models"][0]["variants"]["breakgraph"]["host_prepare_lists_ms_per_step"]
    assert report_cb_host.prep_lists_section([plain]) == ""


def test_the_page_sets_numpy_lists_against_torch_tensor_in_turn():
    """Each tree's rows, and breakgraph over stock graphs where the run had them."""
    meta = {"device": "GPU", "torch": "2.x", "date": "today", "transformers": "5.24.0"}
    bg = {"tokens_per_s": 300.0, "wall_ms_per_step": 5.0, "host_prepare_ms_per_step": 3.0,
          "rounds_tokens_per_s": [300.0, 400.0]}  # fmt: skip
    run = {"meta": meta, "models": [{"model": "m", "variants": {
        "stock_graphs": {"tokens_per_s": 100.0}, "breakgraph": bg}}]}  # fmt: skip
    text = report_cb_host.numpy_lists_section([(run, "numpy", 1)])
    assert "| 5.24.0 | m | numpy | 1 | `breakgraph` | 300 | 5.0 | 3.0 | - | - | - | 3.00× |" in text
    assert "- lists by numpy: breakgraph / stock graphs 3.00× (rounds 3.00–4.00)" in text


def test_the_decode_trace_section_splits_attention_per_layer():
    meta = {"gpu": "GPU", "torch": "2.x", "transformers": "5.17.0", "date": "today",
            "model": "mixtral-1k-8l", "args": {"prompts": 100, "min_len": 16, "max_len": 1024,
                                               "new_tokens": 128, "skip": 70}}  # fmt: skip
    variant = {"steps": 14, "per_step": [{"device_busy_ms": 4.0}, {"device_busy_ms": 5.0}],
               "device_ms_per_step_by_kind": {"attention": 1.6, "copies": 2.4}}  # fmt: skip
    text = report_cb_host.trace_decode_section({"meta": meta, "variants": {"breakgraph": variant}})
    assert "busy\n4.50 ms per step" in text
    assert "1.60 ms per step, 40% of the\ndevice's time, about 200 µs for each of the 8" in text
    # the window after the change: a second column, and the per-layer attention it leaves
    after = {**variant, "device_ms_per_step_by_kind": {"attention": 0.4, "copies": 2.5},
             "prepare_ms_per_step": 3.5, "step_ms_per_step": 4.25, "wall_ms_per_step": 8.0,
             "prepare_device_busy_fraction": 0.06}  # fmt: skip
    text = report_cb_host.trace_decode_section(
        {"meta": meta, "variants": {"breakgraph": variant}},
        {"meta": meta, "variants": {"breakgraph": after}},
    )
    assert "| attention | 1.60 | 0.40 |" in text
    assert "fell to 0.40 ms per\nstep (about 50 µs per layer)" in text
    assert "Copies\ngrew by 0.10 ms per step" in text


def test_the_decode_fold_section_sets_the_two_calls_side_by_side():
    meta = {"device": "GPU", "torch": "2.x", "date": "today", "transformers": "5.17.0"}

    def run(decode_ms):
        bg = {"tokens_per_s": 300.0, "wall_ms_per_step": 5.0, "host_prepare_ms_per_step": 3.0,
              "decode_step_ms": decode_ms, "decode_forward_device_ms": decode_ms - 1}  # fmt: skip
        return {"meta": meta, "models": [{"model": "m", "variants": {"breakgraph": bg}}]}

    text = report_cb_decode.decode_fold_section([
        (run(14.0), "causal", 1), (run(7.0), "no mask", 1),
        (run(16.0), "causal", 2), (run(11.5), "no mask", 2),
    ])  # fmt: skip
    row = "| 5.17.0 | m | no mask | 2 | `breakgraph` | 300 | 5.0 | 3.0 | - | 11.50 | 10.50 | - |"
    assert row in text
    assert "- m: pure-decode step 14.00–16.00 ms causal, 7.00–11.50 ms without the mask; the " \
        "forward's device span 13.00–15.00 → 6.00–10.50 ms" in text
    text = report_cb_decode.paged_decode_section([(run(9.0), "gather", 1),
                                                  (run(7.0), "in place", 1)])  # fmt: skip
    assert "- m: pure-decode step 9.00 ms gather, 7.00 ms in place; the forward's device span " \
        "8.00 → 6.00 ms" in text


def test_the_decode_attention_section_names_the_case_the_fold_loses():
    def case(causal, folded, paged):
        row = {"hq": 16, "hkv": 4, "d": 64, "seqs": 32, "keys": 1000, "kv_mib": 1.0}
        for name, us in (("gather_flash_causal", causal), ("gather_flash_folded", folded),
                         ("triton_paged", paged)):  # fmt: skip
            row[name + "_us"] = {"median": us, "min": us - 1, "max": us + 1}
            row[name + "_max_abs_diff"] = 0.002
        return row

    data = {"meta": {"gpu": "GPU", "torch": "2.x", "date": "today"},
            "a/32": case(100.0, 150.0, 50.0), "b/100": case(300.0, 100.0, 25.0)}  # fmt: skip
    text = report_cb_decode.decode_attention_section(data)
    assert "faster in 1 of 2 cases (3.00× against" in text
    assert "it is slower at a/32 (150 (149–151) against 100 (99–101) µs; not profiled)" in text
    assert "another 3.0–4.0× on top" in text


def test_the_threshold_section_says_where_each_case_pays_and_what_the_rule_gives_up():
    """The tallies (session 36's rule: a 64-wide head splits from 4096 keys, a 256-wide one
    from 2048), where each case pays, and the rules before and now (``paged_decode``: 4096
    keys at every head), tried, and session 36's follow the rows."""
    from breakgraph.integrations.transformers import paged_decode as pd

    assert pd.BREAK_SPLIT_FROM_KEYS == 4096 and report_cb_decode.WIDE_FROM_HEAD == 128

    def case(longest, ratio, d=64, held_out=False, unsplit=100.0):
        return {"hq": 16, "hkv": 4, "d": d, "seqs": 8, "bucket": 8, "threshold": True,
                "longest": longest, "max_keys": longest, "held_out": held_out,
                "triton_paged_us": {"median": unsplit},
                "triton_paged_split_us": {"median": unsplit * ratio},
                "triton_paged_split_graph_us": {"median": 1.0}}  # fmt: skip

    data = {"meta": {"gpu": "GPU", "torch": "2.x", "date": "today", "multiprocessors": 132},
            "a/8-upto1": case(3584, 0.9), "a/8-upto2": case(4096, 1.1),
            "a/8-upto3": case(4608, 0.8), "h/8-upto1": case(1536, 1.2, 256, True),
            "h/8-upto2": case(2048, 0.95, 256, True), "h/8-upto3": case(2560, 1.05, 256, True)}
    earlier = {"meta": {"multiprocessors": 132}, "a/8-upto3": case(4608, 0.5, unsplit=40.0)}
    text = report_cb_decode.threshold_section(data, earlier)
    assert "paid in 1 of 2 (0.80–1.10×) on the picked shapes and\n1 of 2 (0.95–1.05×)" in text
    assert "would have paid in\n1 of 1 (0.90×) and 0 of 1 (1.20×)" in text
    assert "- a, 8 sequences, default split 16: the split pays from ≤ 4608 keys" in text
    assert "- h (held out), 8 sequences, default split 16: the split pays at no length" in text
    assert ("- this sweep (6 rows): before and now 1 losses taken (10 µs), 2 gains left (15 µs), "
            "25 µs in all; tried 1 losses taken (5 µs), 2 gains left (30 µs), 35 µs in all; "
            "session 36 2 losses taken (15 µs), 1 gains left (10 µs), 25 µs in all") in text
    assert ("- the split sweep above (1 rows): before and now 0 losses taken (0 µs), 0 gains left "
            "(0 µs), 0 µs in all; tried 0 losses taken (0 µs), 1 gains left (20 µs), 20 µs in "
            "all; session 36 0 losses taken (0 µs), 0 gains left (0 µs), 0 µs in all") in text
    assert "the launched split took\n4.00× its time on the split sweep's host" in text
    alone = report_cb_decode.threshold_section(data)  # no earlier sweep: no hosts paragraph
    assert "The two hosts differ" not in alone and "- the split sweep above" not in alone
    assert report_cb_decode.threshold_section({"meta": {}}) == ""


def test_replayed_longest_sequences_check_every_rows_total():
    """``decode_attention.replay_max_keys`` gives an earlier run's rows their longest sequence
    by replaying the seeded draws, and refuses a file whose totals the replay does not match."""
    from benchmarks import decode_attention as da

    lens = torch.randint(2048, 4097, (8,), generator=torch.Generator().manual_seed(0))
    row = {"threshold": True, "longest": 4096, "seqs": 8, "keys": int(lens.sum())}
    data = da.replay_max_keys({"meta": {}, "x/8-upto4096": dict(row)})
    assert data["x/8-upto4096"]["max_keys"] == int(lens.max())
    with pytest.raises(ValueError, match="not this run's draws"):
        da.replay_max_keys({"meta": {}, "x/8-upto4096": dict(row, keys=row["keys"] + 1)})


def test_the_losses_paragraph_names_where_synchronous_steps_won():
    def run(release, sync):
        bg = {"tokens_per_s": 100.0, "decode_over_floor": 10.0 if sync < 100 else 20.0}
        return {"meta": {"transformers": release}, "models": [{"model": "m", "variants": {
            "breakgraph": bg, "breakgraph_sync": {"tokens_per_s": sync}}}]}  # fmt: skip

    losses = cb_report._losses([run("5.17.0", 90.0), run("5.24.0", 110.0)])
    assert losses == {"over_low": "10", "over_high": "20", "sync_wins": "m on 5.24.0"}


# -- ratios ------------------------------------------------------------------------------------
def test_ratios_pair_rounds_or_divide_by_a_baseline_that_ran_once():
    def rounds(*values):
        return [{"tokens_per_s": v} for v in values]

    ratios, spread = bench_cb._ratios({
        "stock_sdpa": rounds(100.0),
        "stock_graphs": rounds(200.0, 400.0, 100.0),
        "breakgraph": rounds(500.0, 800.0, 600.0),
    })  # fmt: skip
    assert ratios["breakgraph_over_stock_sdpa"] == 6.0  # 5, 8, 6: the lower median
    assert spread["breakgraph_over_stock_sdpa"] == [5.0, 8.0]
    assert ratios["breakgraph_over_stock_graphs"] == 2.5  # round by round: 2.5, 2, 6
    assert "stock_graphs_over_stock_sdpa" not in ratios


def test_every_model_and_variant_is_known_and_estimated():
    args = bench_cb.parse_args([])
    assert args.models == list(bench_cb.DEFAULT_MODELS) and args.prompts >= 100
    total = sum(bench_cb.estimate_s(name, args) for name in args.models)
    assert 120 < total < 450  # the H200 run must fit its ~6 minutes (printed at the start)
    for name in bench_cb.MODELS:
        assert set(bench_cb.model_variants(name, args)) <= set(bench_cb.VARIANTS)
    with pytest.raises(SystemExit):
        bench_cb.parse_args(["--variants", "whole_graph"])  # dropped (see the module docstring)


# -- the performance page's section -------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_json(tmp_path_factory):
    """``python -m benchmarks.bench_cb --smoke --out cb.json``, every variant, run in this
    process (``main`` is the whole script); ``data`` is what it wrote."""
    if not compat.supported("continuous_batching"):
        pytest.skip("continuous batching is not supported on this transformers")
    if torch.cuda.is_available():
        pytest.skip(
            "--smoke is the CPU run: on a GPU machine transformers makes CUDA choices (graphs, "
            "async batching) for the CPU model, on torch.cuda.is_available() alone"
        )
    out = tmp_path_factory.mktemp("bench-cb") / "cb.json"
    threads = torch.get_num_threads()
    original = vars(cb_instruments._processor_class())["prepare_next_batch"]
    try:
        with pytest.MonkeyPatch.context() as patches:  # seconds of collections (helpers)
            no_full_collections_in_cb_cleanup(patches, bench_cb)
            returned = bench_cb.main(["--smoke", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    return types.SimpleNamespace(data=data, returned=returned, original=original)


def test_smoke_run_measures_every_variant(smoke_json):
    """The smoke run on this transformers (5.17 and 5.24 in CI): every variant's fp32 tokens
    equal stock CB's exactly (the script itself fails otherwise), each pass is measured
    (steps, host scheduling, forward times, pure-decode steps, the floor), the run records its
    versions, and the performance page's section renders from the JSON."""
    data = smoke_json.data
    assert data == json.loads(json.dumps(smoke_json.returned, default=str))  # what it returned
    meta = data["meta"]
    assert meta["transformers"] == transformers.__version__ and meta["torch"] == torch.__version__
    assert meta["schema"] == 2 and meta["backend"] == "emulated"
    for model in data["models"]:
        variants = model["variants"]
        assert "needs CUDA" in variants["stock_graphs_async"]["skipped"]  # CPU
        for name in ("stock_sdpa", "stock_graphs", "breakgraph", "breakgraph_sync"):
            v = variants[name]
            assert v["tokens_agree_with_stock"] == 1.0, name
            assert v["tokens_per_s"] > 0 and v["steps"] > 0 and v["host_prepare_ms_per_step"] > 0
            assert v["decode_requests"] == model["prompts"] and v["decode_step_ms"] > 0
            assert v["over_roofline"] > 1 and v["decode_over_floor"] > 1
        for name in ("breakgraph", "breakgraph_sync", "breakgraph_breaks"):
            v = variants[name]
            assert v["tokens_agree_with_stock"] == 1.0, name
            assert v["graphs"] >= 2 and v["replays"] == v["steps"] == v["forward_calls"]
            assert v["forward_host_ms_per_step"] > 0 and v["decode_forward_steps"] > 0
            assert v["decode_prepare_ms"] > 0  # each pure-decode forward's scheduling
            # its attention breaks inside the forward, the cache updates inside the breaks
            fwd, brk = v["forward_host_ms_per_step"], v["break_host_ms_per_step"]
            assert fwd > brk > v["cache_update_host_ms_per_step"] > 0
            if name == "breakgraph_breaks":  # pure-decode steps through the breaks too
                assert v["decode_break_host_ms"] > 0 and "decode_graph_replays" not in v
            else:  # pure-decode steps replay graphs without breaks
                assert v["decode_break_host_ms"] == 0 and v["decode_graph_replays"] > 0
                assert v["decode_graph_layouts"] == 1 and v["decode_graph_off"] is None
        assert variants["breakgraph"]["rounds"] == 2 and variants["stock_sdpa"]["rounds"] == 1
        ratios = set(model["ratios"])
        assert {"breakgraph_over_stock_sdpa", "breakgraph_over_stock_graphs"} <= ratios
        assert model["floor"]["roofline_s"] >= model["floor"]["bound_s"] > 0
    # the performance page's section renders from it (benchmarks/report.py uses cb_report.py)
    page = "\n".join(cb_report.cb_section(data))
    assert "| `breakgraph` |" in page and "capture, all graphs" in page
    assert "breaks ms" in page and "cache upd ms" in page
    from breakgraph.integrations.transformers import cb_step, compat

    # the timing wrappers are gone after the run (PatchSet restores them)
    assert not hasattr(cb_step.PagedAttention.__call__, "__wrapped__")
    assert not hasattr(compat.cache_read_write, "__wrapped__")


def test_a_cpu_run_on_a_gpu_machine_skips_transformers_graphs(monkeypatch):
    """transformers turns its CUDA graphs on when CUDA is available, whatever the model's
    device: a CPU run there must not ask it for graphs of a CPU model."""
    graphs, plain = bench_cb.VARIANTS["stock_graphs"], bench_cb.VARIANTS["stock_sdpa"]
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench_cb.cpu_run_with_a_gpu(graphs, cpu)
    assert not bench_cb.cpu_run_with_a_gpu(graphs, gpu) and not bench_cb.cpu_run_with_a_gpu(
        plain, cpu
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not bench_cb.cpu_run_with_a_gpu(graphs, cpu)


def test_a_variants_compile_mode_reaches_enable_continuous_batching_as_an_accepted_dict():
    from breakgraph.integrations.transformers.compiled import check_compile_option

    autotuned = bench_cb.compile_argument(bench_cb.VARIANTS["breakgraph_autotuned"])
    assert autotuned == {"mode": "max-autotune-no-cudagraphs"}
    check_compile_option(autotuned, "bench_cb")  # not one of the modes refused in CB
    assert bench_cb.compile_argument(bench_cb.VARIANTS["breakgraph_compiled"]) is True
    assert bench_cb.compile_argument(bench_cb.VARIANTS["breakgraph"]) is False


def test_in_process_run_restores_transformers(smoke_json):
    assert vars(cb_instruments._processor_class())["prepare_next_batch"] is smoke_json.original
    logger = logging.getLogger(cb_instruments.GraphLog.LOGGER)
    assert not any(isinstance(h, cb_instruments.GraphLog) for h in logger.handlers)
    variants = smoke_json.data["models"][0]["variants"]
    assert variants["breakgraph"]["tokens_agree_with_stock"] == 1.0


def test_section_has_a_table_per_transformers_release(smoke_json):
    older = copy.deepcopy(smoke_json.data)
    newer = copy.deepcopy(older)
    older["meta"]["transformers"], newer["meta"]["transformers"] = "5.17.0", "5.24.0"
    newer["models"][0]["variants"]["breakgraph"]["tokens_per_s"] = 12345.0
    page = "\n".join(cb_report.cb_section(older, newer))
    assert page.count("## Continuous batching") == 1
    assert "transformers 5.17.0 (torch" in page and "transformers 5.24.0 (torch" in page
    assert "| tiny-llama | `breakgraph` |" in page and "| 12345 |" in page  # the summary
    assert page.count("\n| `breakgraph` |") == 2 and "capture, all graphs" in page
    assert "target ≥ 5x" in page  # issue 23's targets, judged from the numbers


def test_a_model_skipped_or_failed_is_said_so(smoke_json):
    data = copy.deepcopy(smoke_json.data)
    data["models"].append({"model": "llama3-8b-4l", "skipped": "time budget: ..."})
    data["models"].append({"model": "mixtral-1k-8l", "failed": "OutOfMemoryError: ..."})
    newer = copy.deepcopy(data)
    newer["meta"]["transformers"] = "5.99.0"
    newer["models"] = newer["models"][1:]  # this release did not get to tiny-llama
    page = "\n".join(cb_report.cb_section(data, newer))
    assert "### llama3-8b-4l" in page and "time budget" in page
    assert "failed: OutOfMemoryError" in page
    assert "transformers 5.99.0: not measured (not in this run)." in page


def test_the_committed_earlier_layout_still_renders():
    import os

    from benchmarks.report import RESULTS

    with open(os.path.join(RESULTS, cb_report.FILE)) as f:
        data = json.load(f)
    if cb_report.schema(data) >= 2:
        pytest.skip("the committed CB JSON is already the current layout")
    page = "\n".join(cb_report.cb_section(data))
    assert "| breakgraph_async |" in page and "whole_graph" in page


def test_step_timer_keeps_the_forward_signature_transformers_reads():
    """transformers passes ``logits_to_keep`` only to a forward whose signature has it: a
    timer that hid it would make stock CB compute logits for every token (a slower baseline)."""
    from benchmarks.families import TINY
    from breakgraph.patches import PatchSet

    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY))
    assert model._supports_logits_to_keep()
    timer = cb_instruments.StepTimer(cuda=False)
    with PatchSet() as patches:
        timer.install(patches, model)
        assert model._supports_logits_to_keep()
        ids = torch.randint(0, 100, (1, 5))
        logits = model(input_ids=ids, logits_to_keep=torch.tensor([1, 4])).logits
        assert logits.shape[:2] == (1, 2)
        assert [r[3:] for r in timer.records] == [(5, 2)] and timer.records[0][0] > 0
    assert "forward" not in vars(model)


def test_step_timer_pairs_pure_decode_forwards_with_their_scheduling():
    """The k-th scheduled step is the k-th forward: a pure-decode forward's scheduling time is
    taken from the same position of ``StepCounter.each``; counts that do not pair give none."""
    timer = cb_instruments.StepTimer(cuda=False)
    # (host s, events, tokens, rows): a prefill step, then two pure-decode steps of 40 rows
    timer.records = [(0.004, None, None, 300, 10), (0.001, None, None, 40, 40),
                     (0.003, None, None, 40, 40)]  # fmt: skip
    timer.split = [(0.0, 0.0)] * 3
    summary = timer.summary(1.0, 32, [9.0, 2.0, 4.0])
    assert summary["decode_forward_steps"] == 2 and summary["decode_forward_host_ms"] == 2.0
    assert summary["decode_prepare_ms"] == 3.0  # the median of 2 and 4, not the prefill's 9
    assert "decode_prepare_ms" not in timer.summary(1.0, 32, [9.0, 2.0])


@needs_cb
def test_a_failing_variant_is_recorded_and_the_others_still_run(monkeypatch, capsys):
    no_full_collections_in_cb_cleanup(monkeypatch, bench_cb)
    real = bench_cb.run_round

    def run_round(model, variant, run):
        if variant.name == "breakgraph":
            raise RuntimeError("boom")
        return real(model, variant, run)

    monkeypatch.setattr(bench_cb, "run_round", run_round)
    argv = ["--smoke", "--variants", "stock_sdpa,breakgraph,breakgraph_sync", "--rounds", "2"]
    with pytest.raises(RuntimeError, match="boom"):  # --smoke stops at the first failure
        bench_cb.main(argv)
    data = bench_cb.main([*argv, "--keep-going"])  # as every GPU run does
    variants = data["models"][0]["variants"]
    assert variants["breakgraph"] == {"failed": "round 1: RuntimeError: boom"}
    assert variants["breakgraph_sync"]["tokens_agree_with_stock"] == 1.0
    assert set(data["models"][0]["ratios"]) == {"breakgraph_sync_over_stock_sdpa"}
    page = "\n".join(cb_report.cb_section(json.loads(json.dumps(data, default=str))))
    assert "| `breakgraph` | failed: round 1: RuntimeError: boom |" in page
    assert "breakgraph failed (round 1: RuntimeError: boom)" in capsys.readouterr().out


def test_the_again_section_sets_the_later_run_beside_the_earlier_with_the_targets():
    meta = {"device": "GPU", "torch": "2.x", "date": "today", "transformers": "5.24.0",
            "args": {"rounds": 3}}  # fmt: skip

    def model(name, bg, stock, graphs=None, async_graphs=None):
        v = {"stock_sdpa": {"tokens_per_s": stock},
             "breakgraph": {"tokens_per_s": bg, "rounds_tokens_per_s": [bg / 4, bg, bg * 1.1]}}
        ratios = {"breakgraph_over_stock_sdpa": bg / stock}
        spread = {"breakgraph_over_stock_sdpa": [bg / 4 / stock, bg * 1.1 / stock]}
        for rival, tokens in (("stock_graphs", graphs), ("stock_graphs_async", async_graphs)):
            if tokens:
                v[rival] = {"tokens_per_s": tokens}
                ratios[f"breakgraph_over_{rival}"] = bg / tokens
                spread[f"breakgraph_over_{rival}"] = [bg / 4 / tokens, bg * 1.1 / tokens]
        return {"model": name, "variants": v, "ratios": ratios, "ratio_spread": spread}

    now = {"meta": meta, "models": [model("a", 1000.0, 100.0, graphs=400.0, async_graphs=200.0),
                                    model("b", 400.0, 100.0),
                                    {"model": "d", "variants": {"breakgraph": {"failed": "x"}}}]}
    before = {"meta": {**meta, "date": "yesterday"},
              "models": [model("a", 800.0, 200.0, graphs=100.0, async_graphs=500.0),
                         model("b", 400.0, 100.0), model("c", 1.0, 1.0)]}  # fmt: skip
    text = cb_report.again_section(now, before, "again.json", "the tree of today")
    assert "for this release are from yesterday" in text
    assert "with\na later tree, the tree of today: `again.json`" in text
    assert "missing here: d (x); c (not run again)" in text
    # the earlier ratio against the earlier run's own faster graphs variant (async: 800 / 500)
    assert ("| a | 100 | 400 (`stock_graphs`) | 1000 (250–1100) | 10.00× (2.50–11.00) | 4.00× "
            "| 2.50× (0.62–2.75) | 1.60× |") in text  # fmt: skip
    assert "| b | 100 | - | 400 (100–440) | 4.00× (1.00–4.40) | 4.00× | - | - |" in text
    assert "4.0–10.0× (target ≥ 5×: met on 1 of\n2 shapes)" in text
    assert "2.5× (target ≥ 2×: met on 1 of 1 shapes)" in text.replace("\n", " ")
    assert "tokens/s were 1.00–1.25× the earlier run's, stock\n`sdpa`'s 0.50–1.00×" in text
    assert "missing here: d (x)." in cb_report.again_section(now, now, "again.json", "t")


def test_the_tried_section_sets_a_release_outside_the_range_with_its_tests_and_targets():
    meta = {"device": "GPU", "torch": "2.x", "date": "today", "transformers": "5.25.0",
            "args": {"rounds": 3}}  # fmt: skip
    v = {"stock_sdpa": {"tokens_per_s": 100.0}, "stock_graphs": {"tokens_per_s": 400.0},
         "breakgraph": {"tokens_per_s": 1000.0, "rounds_tokens_per_s": [250.0, 1000.0, 1100.0]}}
    ratios = {"breakgraph_over_stock_sdpa": 10.0, "breakgraph_over_stock_graphs": 2.5}
    spread = {"breakgraph_over_stock_sdpa": [2.5, 11.0],
              "breakgraph_over_stock_graphs": [0.6, 2.75]}
    run = {"meta": meta, "models": [{"model": "a", "variants": v, "ratios": ratios,
                                     "ratio_spread": spread}]}  # fmt: skip
    suite = {"counts": {"passed": 9, "skipped": 2, "failed": 0}, "wall_s": 90.87}
    text = cb_report.tried_section(run, suite)
    assert text.startswith("### transformers 5.25.0, tried (outside the declared range)")
    assert "the CUDA tests: 9 passed, 0 failed, 2 skipped" in text
    assert "90.9 s with four workers); the bench on a\n(`h200-cb-5.25.json`" in text
    assert ("| a | 100 | 400 (`stock_graphs`) | 1000 (250–1100) | 10.00× (2.50–11.00) "
            "| 2.50× (0.60–2.75) |") in text  # fmt: skip
    assert "met on 1 of\n1 shapes" in text and "2.5×\n(target ≥ 2×: met on 1 of 1" in text
    assert "the CUDA tests: not run; the bench" in cb_report.tried_section(run, None)
    assert "preparation of a step on this release: not measured." in text

    def prep(release, table, timed):
        parts = {"prepare": 2.0 + table, "block table": table, "scheduler": 0.5,
                 "other batch tensors": 0.9, "update": 0.6}  # fmt: skip
        return {"meta": {"gpu": "none (2 CPU cores)", "torch": "2.x", "date": "today",
                         "transformers": release},
                "settings": {"rounds": 5, "requests": 100}, "decode_steps": 110,
                "decode_requests_median": 69.5, "decode_parts_ms": parts,
                "pass_s": {"timed": timed}}  # fmt: skip

    text = cb_report.tried_section(run, suite, [prep("5.24.0", 0.5, [50.0, 60.0]),
                                                prep("5.25.0", 1.0, [55.0, 66.0])])  # fmt: skip
    assert "| **all of the preparation** | 2.50 | 3.00 |" in text
    assert "| block table | 0.50 | 1.00 |" in text
    assert "5.25.0 / 5.24.0: 1.20; the part that moved most: block table 0.50 → 1.00 ms." in text
    assert "took 50–66 s each" in text
    assert "The serve launcher on the GPU: not run." in text

    def serve(release, passed, failed, seconds):
        slowest = [{"test": "t.py::test_serve_launcher_answers_a_completion[cuda]",
                    "seconds": seconds}, {"test": "t.py::other", "seconds": 99.0}]
        return ({"meta": {"gpu": "GPU", "transformers": release}, "slowest": slowest,
                 "counts": {"passed": passed, "failed": failed}}, f"serve-{release}.json")

    text = cb_report.tried_section(run, suite, (), [serve("5.24.0", 8, 0, 15.04),
                                                    serve("5.25.0", 7, 1, 21.16)])  # fmt: skip
    assert ("8 passed, 0 failed on 5.24.0 (`serve-5.24.0.json`); 7 passed, 1 failed on 5.25.0 "
            "(`serve-5.25.0.json`)") in text.replace("\n", " ")  # fmt: skip
    assert "15.0–21.2 s each" in text
