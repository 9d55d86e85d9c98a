"""The page's sections on a shape the CB bench never picked (benchmarks/report_held_out.py):
numbers from the JSON reach the text, a changed number changes it, a variant that did not
serve leaves the section out."""

from __future__ import annotations

import copy

from benchmarks import report_held_out as R


def _variant(tokens_per_s, rounds, step, host, breaks, device=None):
    entry = {"tokens_per_s": tokens_per_s, "rounds_tokens_per_s": rounds, "decode_step_ms": step,
             "decode_forward_host_ms": host, "decode_break_host_ms": breaks}  # fmt: skip
    if device is not None:
        entry["decode_forward_device_ms"] = device
    return entry


def _run(now_rounds=(120.0, 90.0, 130.0)):
    meta = {"device": "GPU X", "torch": "2.x", "transformers": "5.17.0", "date": "today",
            "args": {"prompts": 16, "min_len": 1024, "max_len": 3008, "new_tokens": 64,
                     "rounds": 3}}  # fmt: skip
    variants = {
        R.SESSION_36: _variant(sorted(now_rounds)[1], list(now_rounds), 4.0, 2.0, 1.5, 3.5),
        R.BEFORE: _variant(100.0, [100.0, 100.0, 100.0], 5.0, 2.5, 2.0),
    }
    return {"meta": meta, "models": [{"model": "m", "config": {"head_dim": 256},
                                      "variants": variants}]}  # fmt: skip


def test_the_break_split_run_reads_both_rules_round_by_round():
    """Session 36's rule (the run's ``breakgraph_breaks``) over the rule before, round by
    round, the step, the breaks' host time and the device span, before → session 36."""
    text = R.break_split_section(_run())
    assert "| `breakgraph_breaks_keys4096` | 100 (100) | 5.00 | 2.50 | 2.00 | - |" in text
    assert "| `breakgraph_breaks` | 120 (90–130) | 4.00 | 2.00 | 1.50 | 3.50 |" in text
    assert "round by round: 0.90–1.30 (the\nmedian, 1.20×: faster)" in text
    assert ("before → session thirty-six: 5.00 → 4.00 ms; its\nbreaks' host time 2.00 → 1.50 "
            "ms") in text
    assert "its forward's device span - → 3.50 ms" in text
    assert "the runs disagree, and a rerun decides" in text and "again:" not in text
    # heads of 256 split from half the keys of heads up to 128; no sequence past 3008 + 64
    assert "has reached 2048 keys" in text and "grows past 3072 keys" in text
    assert "(heads of 256," in text and "16 prompts of\n1024–3008 tokens" in text
    slower = R.break_split_section(_run((80.0, 90.0, 95.0)))
    assert "round by round: 0.80–0.95 (the\nmedian, 0.90×: slower)" in slower
    assert "So the rule is the one before again: 4096 keys at every head size" in slower


def test_the_break_split_run_is_left_out_where_a_rule_did_not_serve():
    data = _run()
    del data["models"][0]["variants"][R.BEFORE]["tokens_per_s"]
    assert R.break_split_section(data) == ""


def test_the_held_out_shape_prints_its_block_as_the_cb_tables_do():
    entry = {"model": "gemma-2b", "shape": "18 layers, heads of 256", "params_m": 2506.0,
             "prompt_tokens": 52398,
             "floor": {"roofline_s": 0.5, "prefill_s": 0.2, "decode_s": 0.3, "bound_s": 0.4,
                       "weight_bytes_per_decode_step": 5e9},
             "ratios": {}, "ratio_spread": {},
             "variants": {"stock_sdpa": {"skipped": "time budget"}}}  # fmt: skip
    data = {"meta": {"device": "GPU X", "torch": "2.x", "transformers": "5.17.0",
                     "date": "today", "hbm_bytes_per_s": 3.35e12}, "models": [entry]}  # fmt: skip
    text = "\n".join(R.held_out_cb_section(copy.deepcopy(data)))
    assert "### A shape the bench never picked: gemma-2b" in text
    assert "gemma-2b (18 layers, heads of 256) was never served" in text
    assert "### gemma-2b (2506 M parameters, 52398 prompt tokens)" in text
    assert "skipped: time budget" in text and "this card's 3.35 TB/s" in text


def _whole(prompts, variants):
    meta = {"device": "GPU X", "torch": "2.x", "transformers": "5.17.0", "date": "today",
            "hbm_bytes_per_s": 3.35e12, "args": {"prompts": prompts}}  # fmt: skip
    entry = {"model": "llama3-8b", "shape": "32 layers", "params_m": 8030.2,
             "ratios": {}, "ratio_spread": {}, "variants": variants}  # fmt: skip
    return {"meta": meta, "models": [entry]}


def _decoder(tokens_per_s, rounds, step, over, host=0.3, device=4.0):
    return {"tokens_per_s": tokens_per_s, "rounds_tokens_per_s": rounds, "decode_requests": 32,
            "decode_step_ms": step, "decode_over_floor": over, "decode_floor_ms": step / over,
            "decode_forward_host_ms": host, "decode_forward_device_ms": device,
            "decode_context": 500.0, "graphs": 8, "capture_s": 1.0, "breaks_per_graph": 32,
            "eager_steps": 0}  # fmt: skip


def test_the_whole_model_prints_both_runs_and_the_closest_decoder_to_its_floor():
    """Each run's variants are rows (a variant that did not serve says why); the floor column
    and the closest breakgraph decoder come from the JSON, and a changed number changes them."""
    served = _whole(100, {"stock_sdpa": {"failed": "out of memory"},
                          "breakgraph": _decoder(900.0, [880.0, 900.0, 910.0], 9.0, 2.4)})
    few = _whole(32, {"breakgraph": _decoder(500.0, [500.0], 7.0, 2.1),
                      "breakgraph_compiled": _decoder(600.0, [590.0, 610.0], 6.0, 1.8)})
    text = R.whole_model_section([("a.json", served), ("b.json", few)])
    assert "### The whole Llama-3-8B, held out" in text
    assert "llama3-8b (32 layers,\n8030 M parameters)" in text
    assert "| 5.17.0 | 100 | `stock_sdpa` | not measured: out of memory |" in text
    assert "| 5.17.0 | 100 | `breakgraph` | 900 (880–910) | 32 | 9.00 | 2.40× | 3.750 | 0.30 " \
        "| 4.00 |" in text  # fmt: skip
    assert "| 5.17.0 | 32 | `breakgraph_compiled` | 600 (590–610) | 32 | 6.00 | 1.80× |" in text
    assert "- 5.17.0, 32 prompts, `breakgraph_compiled` pure decode at 32 requests" in text
    assert "came to its floor: 1.80× (at 32 prompts, transformers 5.17.0)." in text
    assert "(`a.json`, `b.json`:" in text and "transformers 5.17.0, today" in text
    newer = copy.deepcopy(few)
    newer["meta"]["transformers"] = "5.24.0"
    newer["models"][0]["variants"]["breakgraph"]["decode_over_floor"] = 1.5
    both = R.whole_model_section([("a.json", served), ("b.json", few), ("c.json", newer)])
    assert "transformers 5.17.0 and 5.24.0" in both and "| 5.24.0 | 32 | `breakgraph` |" in both
    assert "came to its floor: 1.50× (at 32 prompts, transformers 5.24.0)." in both
    alone = R.whole_model_section([("a.json", served)])
    assert "\n| 5.17.0 | 32 |" not in alone
    assert "came to its floor: 2.40× (at 100 prompts, transformers 5.17.0)." in alone
    # the same runs on another card: their own section, with the same table and targets
    h200 = R.whole_model_section([("a.json", served), ("b.json", few)], "cb.whole_model_h200")
    assert "### The whole Llama-3-8B on an H200" in h200 and "held out" not in h200
    assert "| 5.17.0 | 32 | `breakgraph_compiled` | 600 (590–610) | 32 | 6.00 | 1.80× |" in h200
    assert "came to its floor: 1.80× (at 32 prompts, transformers 5.17.0)." in h200


def test_the_page_carries_the_whole_model_on_the_h200():
    """The committed H200 runs of the whole Llama-3-8B (issue 23's card) are on the page."""
    from benchmarks import report

    text = report.render()
    assert "### The whole Llama-3-8B on an H200" in text
    assert "`h200-cb-llama3-8b.json`, `h200-cb-llama3-8b-32.json`: NVIDIA H200" in text


def test_the_page_carries_the_whole_moe():
    """The committed runs of the whole Qwen3-30B-A3B (a many-expert MoE no CB shape is) are on
    the page, under their own heading, with their targets."""
    from benchmarks import report

    text = report.render()
    section = text.split("### A whole many-expert MoE, held out")[1].split("\n### ")[0]
    assert "`h100-cb-qwen3-30b-a3b.json`, `h100-cb-qwen3-30b-a3b-32.json`" in section
    assert "| 5.17.0 | 32 | `breakgraph_compiled` |" in section
    assert "100 prompts, `breakgraph` against `stock_sdpa`" in section
    trace = text.split("### A whole MoE's prefill steps on the device")[1].split("\n### ")[0]
    assert "| MoE experts (grouped GEMM) |" in trace
    assert "`masked_fill` takes " in trace
    assert "tokens/s on 5.24.0 that it served on 5.17.0" in trace


def test_the_page_carries_the_whole_qwen25_3b():
    """The committed runs of the whole Qwen2.5-3B (36 layers; the bench cuts it to 12)."""
    from benchmarks import report

    text = report.render()
    section = text.split("### The whole Qwen2.5-3B, held out")[1].split("\n### ")[0]
    assert "`h100-cb-qwen2.5-3b.json`, `h100-cb-qwen2.5-3b-32.json`" in section
    assert "| 5.17.0 | 32 | `breakgraph_compiled` |" in section


def test_the_floor_on_another_card_counts_the_steps_within_twice_their_floor():
    """Each decoder's step on this card beside its ratio on the other (``-`` where the other
    did not serve the shape); the count within twice the floor follows the JSON."""
    here = _whole(32, {"breakgraph": _decoder(500.0, [500.0], 7.0, 2.1),
                       "breakgraph_compiled": _decoder(600.0, [600.0], 6.0, 1.8)})
    there = _whole(32, {"breakgraph": _decoder(500.0, [500.0], 7.0, 3.3)})
    there["meta"]["device"] = "GPU Y"
    text = R.floor_on_card_section(copy.deepcopy(here), there)
    assert "| llama3-8b | `breakgraph` | 32 | 7.00 | 3.333 | 2.10× | 4.00 | 3.30× |" in text
    assert "| llama3-8b | `breakgraph_compiled` | 32 | 6.00 | 3.333 | 1.80× | 4.00 | - |" in text
    assert "× floor, GPU Y |" in text
    assert "this card: 1 of 2 (llama3-8b `breakgraph_compiled` (1.80×))." in text
    here["models"][0]["variants"]["breakgraph"]["decode_over_floor"] = 1.9
    assert "this card: 2 of 2" in R.floor_on_card_section(here, None)
