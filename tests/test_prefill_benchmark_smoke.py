"""The prefill benchmark runs end to end on the CPU (``--smoke``: a tiny model, the emulated
backend, CUDA-only variants skipped and listed), so the GPU script cannot rot between runs,
and the report reads what it writes."""

import doctest
import json

import pytest

pytest.importorskip("transformers")

from benchmarks import (  # noqa: E402
    bench_prefill,
    environment,
    report_prefill,
    template,
    timing,
    tiny_models,
)

pytestmark = pytest.mark.transformers


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "prefill.json"
    results = bench_prefill.main(["--smoke", "--out", str(out)])
    with open(out) as f:
        return results, json.load(f)


def test_smoke_run_writes_every_setting_and_skip(smoke):
    _, data = smoke
    assert data["schema"] == bench_prefill.SCHEMA
    meta, settings = data["meta"], data["settings"]
    assert meta["torch"] and meta["transformers"] and meta["gpu"] is None
    assert meta["date"] and meta["host"] and meta["cpu"]  # benchmarks.environment's record
    assert settings["smoke"] and settings["backend"] == "emulated"
    assert settings["runner_kwargs"]["token_buckets"] == [16, 32]
    assert set(data["variants"]) == set(bench_prefill.VARIANTS)
    skipped = {(s["family"], s["what"]) for s in data["skipped"]}
    assert {("tiny-llama", "hf_graph"), ("tiny-llama", "bg_one_graph")} <= skipped


def test_smoke_run_measures_breakgraph_against_eager(smoke):
    _, data = smoke
    (family,) = data["families"]
    assert not family.get("errors"), family.get("errors")
    assert family["runner"]["buckets"] == [16, 32]
    assert [b for b, _ in family["runner"]["capture_seconds"]] == [32, 16]  # largest first
    rows = family["rows"]
    assert [r["workload"] for r in rows[:3]] == ["single 5", "single 12", "single 30"]
    assert rows[-1]["kind"] == "batch" and rows[-1]["prompts"] == 3
    for row in rows:
        assert row["ms"]["breakgraph"] > 0 and row["ms"]["hf_eager"] > 0
        host = row["host"]["breakgraph"]
        # the replay probe saw the call reach its graph, before the call returned
        assert host["first_replay_seen"] == 2
        assert 0 < host["to_first_replay_ms"] <= host["return_ms"]
    assert rows[-1]["apart"] == {"hf_eager": 1} and "hf_eager_padded" in rows[-1]["ms"]
    for workload, variants in family["correctness"].items():
        for name, c in variants.items():
            assert c["max_abs_diff"] < 1e-4 and c["argmax_agree"] == 1.0, (workload, name)


def test_report_reads_the_smoke_json(smoke, capsys):
    results, data = smoke
    text = "\n\n".join(report_prefill.section(data))
    assert "### tiny-llama" in text
    assert "| single 5 | 16 (69%) |" in text
    summary = report_prefill.summary_lines(results)
    assert summary[0].startswith("CPU, torch")
    assert any(line.startswith("targets: ") for line in summary)


def test_defaults_fit_the_gpu_budget():
    settings, out = bench_prefill.parse_args(["--out", "x.json"])
    assert out == "x.json" and not settings.smoke and settings.cuda
    assert settings.families == list(bench_prefill.FAMILIES)
    assert settings.sizes == [32, 200, 1000]
    assert settings.compile_families == ["mistral-7b-4l"]
    assert settings.runner_kwargs == {}  # PrefillRunner(model): default settings
    estimate = sum(bench_prefill.FAMILY_ESTIMATE_S[f] for f in settings.families)
    assert estimate + bench_prefill.COMPILE_ESTIMATE_S <= settings.budget_s
    assert len(settings.first_call_lengths) >= 5
    with pytest.raises(SystemExit):
        bench_prefill.parse_args(["--families", "no-such-model"])


@pytest.mark.parametrize("module", [timing, template, environment, tiny_models])
def test_docstring_examples(module):
    assert doctest.testmod(module).failed == 0


def test_budget_skips_work_and_says_so():
    import dataclasses

    settings = dataclasses.replace(bench_prefill.smoke_settings(), budget_s=-1.0)
    results = bench_prefill.run_all(settings)
    assert results["families"] == []
    assert results["skipped"] == [
        {"family": "tiny-llama", "what": "family", "reason": "time budget (-1 s) would be exceeded"}
    ]


def test_held_out_section_reads_a_run_of_the_benchmark(smoke):
    """The section of a held-out family (gpt-oss on the GPU) renders any run of the benchmark:
    its table, its agreement with HF eager, its targets; none without a run."""
    import copy

    from benchmarks import targets

    _, data = smoke
    # the one target a CPU smoke run measures is a time (capture s per extra bucket), which a
    # loaded CI machine can push past its limit: the verdict is checked on pinned times, both
    # ways, not on how busy the machine was (no timed assertions in unit tests)
    limit = targets.TARGET_CAPTURE_S_PER_EXTRA_BUCKET
    verdicts = []
    for extra_s in (limit / 2, limit * 2):
        pinned = copy.deepcopy(data)
        captured = pinned["families"][0]["runner"]["capture_seconds"]
        captured[1:] = [[bucket, extra_s] for bucket, _ in captured[1:]]
        (text,) = report_prefill.held_out_section([("run.json", pinned)])
        verdicts.append(text)
    text, missed = verdicts
    assert text.startswith("## Prefill on a held-out family with attention sinks: tiny-llama")
    assert "`run.json`: -, torch" in text and "| single 5 | 16 (69%) |" in text
    assert "greedy tokens agree" in text and "1 were met and 0 missed" in text
    assert "0 were met and 1 missed" in missed and "capture s per bucket after the first" in missed
    assert report_prefill.held_out_section([]) == []


def test_held_out_families_are_named_not_default():
    """gpt-oss's shape runs only when named: the default stays the tuned families, and the
    held-out names parse."""
    from benchmarks import families

    assert not set(families.HELD_OUT_FAMILIES) & set(families.FAMILIES)
    settings, _ = bench_prefill.parse_args([])
    assert settings.families == list(families.FAMILIES)
    settings, _ = bench_prefill.parse_args(["--families", "gpt-oss-20b-4l"])
    assert settings.families == ["gpt-oss-20b-4l"]
    assert families.HELD_OUT_FAMILIES["gpt-oss-20b-4l"].config().model_type == "gpt_oss"
