"""The page's sections on one pure-decode step (``benchmarks/report_decode_step.py``): the write
rows derived inside the graph, the tree before and this one in turn, and the step's parts
against twice its HBM floor. Synthetic runs, so a changed number must change the text."""

import json
import os

from benchmarks import report_decode_step as R

RESULTS = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "results")
META = {"device": "GPU", "gpu": "GPU", "torch": "2.x", "date": "today", "transformers": "5.17.0"}


def _variant(host_ms=0.5, device_ms=2.0, prep_ms=2.0, step_ms=3.0, floor_ms=0.5):
    return {"tokens_per_s": 1000.0, "rounds_tokens_per_s": [900.0, 1000.0, 1100.0],
            "decode_step_ms": step_ms, "decode_prepare_ms": prep_ms,
            "decode_forward_host_ms": host_ms, "decode_forward_device_ms": device_ms,
            "decode_floor_ms": floor_ms, "decode_requests": 100}  # fmt: skip


def _run(model="m", layers=4, **variants):
    shape = {"layers": layers}
    return {"meta": META, "models": [{"model": model, "floor": {"shape": shape},
                                      "variants": variants}]}  # fmt: skip


def test_the_write_rows_section_compares_the_forward_host_time_tree_by_tree():
    runs = [
        (_run(breakgraph=_variant(host_ms=0.6, device_ms=2.0)), "host", 1),
        (_run(breakgraph=_variant(host_ms=0.3, device_ms=1.9)), "graph", 1),
        (_run(breakgraph=_variant(host_ms=0.8, device_ms=2.2)), "host", 2),
        (_run(breakgraph=_variant(host_ms=0.4, device_ms=2.1)), "graph", 2),
    ]
    text = R.write_rows_section(runs)
    assert "| 5.17.0 | m | graph | 2 | 1000 (900–1100) | 3.00 | 2.00 | 0.40 | 2.10 |" in text
    assert "- m on 5.17.0: 0.60–0.80 → 0.30–0.40 ms (0.50×)" in text
    assert "After / before: 0.50; the forward's device span, after / before: 0.95" in text
    assert "Every run ran `breakgraph` alone:" in text
    runs[0][0]["models"][0]["variants"]["breakgraph_compiled"] = {"tokens_per_s": 1.0}
    text = R.write_rows_section(runs)
    assert "Runs host 1 on 5.17.0 also ran `breakgraph_compiled` in turn with" in text


def test_the_write_rows_section_says_not_measured_without_both_trees():
    text = R.write_rows_section([(_run(breakgraph=_variant()), "host", 1)])
    assert "before → after (each process's median round):\n\n(not measured)" in text


def _probe(per_layer_separate=0.1, per_layer_fused=0.08, head=0.2):
    def rows(scale):
        return {"separate": {"ms_per_layer": per_layer_separate * scale, "bandwidth_share": 0.5},
                "fused": {"ms_per_layer": per_layer_fused * scale, "bandwidth_share": 0.6},
                "head": {"ms": head}}  # fmt: skip

    return {"meta": {"reps": 30},
            "shapes": [{"shape": "m", "rows": {"32": rows(0.5), "128": rows(1.0)}}]}


def test_the_floor_section_puts_every_part_of_the_step_over_its_floor():
    data = _run(layers=4, breakgraph=_variant(prep_ms=1.5, device_ms=2.0, floor_ms=0.5),
                breakgraph_compiled=_variant(device_ms=1.0, floor_ms=0.5))  # fmt: skip
    text = R.floor_section([data], _probe())
    # 100 requests: the probe's 128 rows (nearest); 4 layers x 0.1 + the head's 0.2
    assert ("| 5.17.0 | m | 100 | 0.500 | 3.00 (6.0×) | 3.00 (6.0×) | 1.50 (3.0×) | 0.50 (1.0×) "
            "| 2.00 (4.0×) | 1.00 (2.0×) | 0.60 (1.2×) | 0.52 (1.0×) |") in text  # fmt: skip
    assert "alone, over the floor: 3.0× with 100 requests; it is\n  above twice the floor in 1 " \
        "of 1 runs with 100 requests." in text
    assert "within twice its floor in 0 of 1 runs:\nnone." in text
    assert "their weights: 50% with 100 requests." in text and ", 30 replays," in text
    assert "over the floor: 1.2× with 100 requests (fused: 1.0× with 100 requests)" in text


def test_the_floor_section_names_the_runs_within_twice_the_floor_by_request_count():
    many = _run(breakgraph=_variant(prep_ms=1.5, floor_ms=0.5))
    few = _run(breakgraph=_variant(prep_ms=0.4, step_ms=1.2, floor_ms=0.4),
               breakgraph_compiled=_variant(step_ms=0.72, floor_ms=0.4))  # fmt: skip
    few["models"][0]["variants"]["breakgraph"]["decode_requests"] = 32
    few["models"][0]["variants"]["breakgraph_compiled"]["decode_requests"] = 32
    text = R.floor_section([many, few], _probe())
    assert "within twice its floor in 1 of 2 runs:\nm on 5.17.0 with 32 requests, 1.8× " \
        "(compiled)." in text
    assert "3.0× with 100 requests, 1.0× with 32 requests" in text
    assert "1 of 1 runs with 100 requests, 0 of 1 runs with 32 requests" in text
    assert "| 5.17.0 | m | 32 | 0.400 | 1.20 (3.0×) | 0.72 (1.8×) |" in text  # probe: 32 rows


def test_the_floor_section_marks_what_was_not_measured():
    fits = _run(model="other", breakgraph=_variant(prep_ms=0.9, floor_ms=0.5))
    text = R.floor_section([fits], _probe())
    assert "| 5.17.0 | other | 100 | 0.500 | 3.00 (6.0×) | - |" in text
    assert text.count("| - | - | - |") == 1 and "0 of 1 runs with 100 requests" in text


def test_the_floor_section_reads_the_committed_runs():
    def load(name):
        with open(os.path.join(RESULTS, name)) as f:
            return json.load(f)

    runs = [load(name) for name in R.FLOOR_FILES]
    text = R.floor_section(runs, load(R.DECODE_GEMM_FILE))
    assert {r["meta"]["transformers"] for r in runs} == {"5.17.0", "5.24.0"}
    assert "| 5.17.0 | qwen2.5-3b-12l | 100 | 0.666 |" in text
    assert "| 5.24.0 | llama3-8b-4l | 32 | 0.637 |" in text
    assert "3 of 6 runs with 100 requests" in text  # scheduling above twice the floor
    before = [load(name) for name in R.FLOOR_BEFORE_FILES]
    text = R.floor_section(runs, load(R.DECODE_GEMM_FILE), before)
    assert "| 5.17.0 | llama3-8b-4l | 100 | 3.65 → 1.93 | 2.11 → 1.07 | 1.98 → 1.84 |" in text


def test_the_floor_section_sets_an_earlier_tree_beside_this_one():
    """Each shape's step, scheduling and device forward before → now, matched by release,
    model and request count; a shape only one tree ran is left out, and no earlier run
    leaves the paragraph out."""
    before = _run(breakgraph=_variant(step_ms=4.0, prep_ms=2.0, device_ms=2.0))
    now = _run(breakgraph=_variant(step_ms=3.0, prep_ms=1.0, device_ms=2.2))
    other = _run(model="other", breakgraph=_variant())
    text = R.floor_section([now, other], _probe(), [before])
    assert "| 5.17.0 | m | 100 | 4.00 → 3.00 | 2.00 → 1.00 | 2.00 → 2.20 |" in text
    assert "| 5.17.0 | other | 100 | 3.00 →" not in text
    assert "now / before: 0.50; the device's forward now / before: 1.10" in text
    assert "before → now" not in R.floor_section([now], _probe())


def test_the_floor_is_the_cards_own():
    """bench_cb divides by an H200's bandwidth whatever the card: an H100 run's floor is
    longer by the bandwidths' ratio, and so is every part's share of it."""
    data = _run(breakgraph=_variant(prep_ms=3.35, floor_ms=0.48))
    data["meta"] = {**META, "gpu": "NVIDIA H100 80GB HBM3", "hbm_bytes_per_s": 4.8e12}
    text = R.floor_section([data], None)
    assert "| 5.17.0 | m | 100 | 0.688 |" in text and "| 3.35 (4.9×) |" in text



def test_the_warm_kernels_section_sets_the_first_round_beside_the_later_ones():
    """The probe's compile and disk times (median and range), then per model and variant the
    first round against the later ones, the first manager, the decode captures while serving
    and the first round with its manager; a changed number changes the text."""
    def probe(firsts, rebuilt=False):
        rows = [{"shape": "s", "first_ms": ms, "second_ms": 0.1} for ms in firsts]
        return {"meta": META, "rows": rows, **({"rebuilt_from_log": True} if rebuilt else {})}

    def run(variant, rounds, manager, capture, warmed=()):
        v = {"rounds_tokens_per_s": rounds, "rounds_manager_s": [manager, 0.1, 0.1],
             "rounds_decode_capture_s": [capture, 0.05, 0.05], "tokens": 1000,
             "kernels_warmed": list(warmed)}  # fmt: skip
        args = {"prompts": 100, "min_len": 16, "max_len": 1024, "new_tokens": 128, "rounds": 3}
        return {"meta": {**META, "args": args},
                "models": [{"model": "m", "variants": {variant: v}}]}  # fmt: skip

    text = R.warm_kernels_section(
        [probe([500.0, 700.0, 1500.0], rebuilt=True), probe([500.0, 2.0, 1.5])],
        [run("breakgraph", [900.0, 1000.0, 1000.0], 3.0, 0.1, (1, 2)),
         run("breakgraph_cold_kernels", [250.0, 1000.0, 1000.0], 0.5, 2.5)],
    )  # fmt: skip
    flat = text.replace("\n", " ")
    assert "a first call took 0.70 (0.50–1.50) s" in flat and "2.7 s for all of them" in flat
    assert "2.0 (1.5–500.0) ms from disk" in flat and "rebuilt from the runs' printed" in flat
    assert "| m | `breakgraph` | 900 | 1000 / 1000 | 3.00 | 0.10 | 4.11 |" in text
    assert "| m | `breakgraph_cold_kernels` | 250 | 1000 / 1000 | 0.50 | 2.50 | 4.50 |" in text
    assert "0.90 with the warm-up, 0.25 without it" in flat
    assert "took 0.39 s shorter with the warm-up" in flat and "(m 1, 2)" in flat
