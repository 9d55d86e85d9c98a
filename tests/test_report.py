"""The performance page is generated from the committed JSON, reproducibly, and no claim on
it can silently contradict the data: numbers and verdicts are computed, prose holds none."""

import importlib.util
import json
import os
import re
import shutil

import pytest

from benchmarks import report, report_breaks, report_earlier, report_prefill
from benchmarks import targets as T
from benchmarks.template import fragments
from tests import report_data
from tests.report_data import baselines

ROOT = os.path.join(os.path.dirname(__file__), "..")
RESULTS = os.path.join(ROOT, "docs", "results")


def results_copy(tmp_path, replace: dict | None = None) -> str:
    """docs/results copied to a temporary folder, files replaced by ``{name: data}`` (None:
    removed)."""
    folder = tmp_path / "results"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(RESULTS, folder)
    for name, data in (replace or {}).items():
        if data is None:
            (folder / name).unlink(missing_ok=True)
        else:
            (folder / name).write_text(json.dumps(data))
    return str(folder)


# -- the committed page ----------------------------------------------------------------------------
def test_committed_page_is_reproduced_exactly():
    with open(os.path.join(ROOT, "docs", "performance.md")) as f:
        assert report.render() == f.read(), "run `python -m benchmarks.report` and commit the page"


def test_prose_template_holds_no_numbers():
    """A number in prose is a claim: it must come from the JSON or a target constant."""
    standalone = re.compile(r"(?<![\w.$-])\d+(?:\.\d+)?(?![\w-])")
    for name, text in fragments().items():
        prose = re.sub(r"`[^`]*`|\$\{\w+\}|\$\$", "", text)
        assert not standalone.findall(prose), f"fragment {name!r}: {standalone.findall(prose)}"


def test_every_placeholder_is_filled_strictly():
    from benchmarks.template import fill

    with pytest.raises(KeyError):
        fill("why.bucket", bucket=64, tokens=32)  # padding missing
    with pytest.raises(KeyError, match="no placeholder"):
        fill("why.bucket", bucket=64, tokens=32, padding="50%", extra=1)


# -- the prefill section: not measured yet, then from data -----------------------------------------
def test_prefill_section_says_not_measured_without_its_json(tmp_path):
    text = report.render(results_copy(tmp_path, {report_prefill.FILE: None}))
    section = text.split("## Prefill against what you would otherwise run")[1].split("\n## ")[0]
    assert "Not measured yet" in section
    assert f"`{report_prefill.FILE}`" in section.replace("docs/results/", "")
    # the targets are stated from the constants even before anything is measured
    assert (
        f"| `TARGET_BG_VS_EXACT_GRAPH_32` | ≤ {T.TARGET_BG_VS_EXACT_GRAPH_32:g} | - | - | - |"
        in section
    )


def prefill_text(tmp_path, data: dict) -> str:
    text = report.render(results_copy(tmp_path, {report_prefill.FILE: data}))
    return text.split("## Prefill against what you would otherwise run")[1].split("\n## Per-break")[
        0
    ]


@pytest.fixture
def issue13_targets(monkeypatch):
    """The synthetic baselines are written around issue 13's limits (1.08 at 32 tokens, 1.05
    above): the verdict mechanics are under test here, not today's target values."""
    monkeypatch.setattr(T, "TARGET_BG_VS_EXACT_GRAPH_32", 1.08)
    monkeypatch.setattr(T, "TARGET_BG_VS_EXACT_GRAPH", 1.05)


@pytest.mark.usefixtures("issue13_targets")
def test_prefill_section_from_results(tmp_path):
    text = prefill_text(tmp_path, baselines())
    assert "Not measured yet" not in text
    # headline: breakgraph / exact graph per family and size, ✗ where a target is missed
    assert "| llama-1b | 1100 | 1.050 | 1.100 ✗ | 1.020 | 0.962 |" in text
    assert "| mistral-7b-4l | 1100 | 1.250 ✗ | 1.030 | 1.010 | 0.962 |" in text
    # the targets table counts the verdicts
    assert "| `TARGET_BG_VS_EXACT_GRAPH_32` | ≤ 1.08 | 1 | 1 | 0 |" in text
    assert "| `TARGET_FIRST_CALL_SPEEDUP` | ≥ 10× over 5 lengths | 0 | 1 | 0 |" in text
    # eager is a ratio, computed
    assert "exact-length graph is\n2.5–6.7× faster than HF eager" in text
    # where it loses, and why: padding/packing (one graph) against the breaks
    assert (
        "- llama-1b, single 200: breakgraph takes 1.100× the exact-length graph's time "
        "(target ≤ 1.05). The one-graph variant, which has no breaks, already takes 1.050× "
        "(bucket 256 for 200 tokens: 22% padding); the breaks add 1.048×." in text
    )
    assert "- mistral-7b-4l: the first calls at 5 lengths take 30.1 s with `compile=True`" in text
    assert "compile reduce-overhead is faster than breakgraph (1.80 ms against 2.50 ms)" in text
    assert "- llama-1b: compile skipped: not in --compile-families." in text


@pytest.mark.usefixtures("issue13_targets")
def test_a_changed_value_changes_the_verdict_and_the_text(tmp_path):
    data = baselines()
    row = data["families"][0]["rows"][1]  # llama-1b, single 200: 1.100, missed
    row["ms"]["breakgraph"] = 4.1  # 1.025: met
    text = prefill_text(tmp_path, data)
    assert "| llama-1b | 1100 | 1.050 | 1.025 | 1.020 | 0.962 |" in text
    assert "llama-1b, single 200: breakgraph takes" not in text
    assert "| `TARGET_BG_VS_EXACT_GRAPH` | ≤ 1.05 | 4 | 0 | 0 |" in text
    row["ms"]["breakgraph"] = 4.5  # 1.125
    text = prefill_text(tmp_path, data)
    assert "| llama-1b | 1100 | 1.050 | 1.125 ✗ | 1.020 | 0.962 |" in text
    assert "llama-1b, single 200: breakgraph takes 1.125×" in text


@pytest.mark.usefixtures("issue13_targets")
def test_a_changed_target_changes_the_text_and_the_verdict(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "TARGET_BG_VS_EXACT_GRAPH", 1.12)
    text = prefill_text(tmp_path, baselines())
    assert "| llama-1b | 1100 | 1.050 | 1.100 | 1.020 | 0.962 |" in text  # 1.100 ≤ 1.12: met
    assert "| `TARGET_BG_VS_EXACT_GRAPH` | ≤ 1.12 | 4 | 0 | 0 |" in text
    assert "≤ 1.12 above" in text


@pytest.mark.parametrize(
    "edit, expected, gone",
    [
        # the host cannot keep up: the loss says so, with the numbers
        (
            lambda d: d["families"][1]["rows"][0]["host"]["breakgraph"].update(return_ms=3.0),
            [
                "the host needs 3.00 ms to issue the call against 2.38 ms of device time",
                "`prefill()` returns after 3.00 ms of host time against 2.38 ms",
            ],
            [],
        ),
        # capture of the extra buckets slows down
        (
            lambda d: d["families"][0]["runner"].update(
                capture_seconds=[[2048, 0.8]] + [[b, 0.2] for b in range(13)]
            ),
            ["- llama-1b: capturing a bucket after the first takes 0.200 s on average"],
            [],
        ),
        # graph memory of the ladder grows
        (
            lambda d: d["families"][0]["largest_bucket_alone"].update(
                graph_memory_bytes={"2048": 300 * 2**20}
            ),
            ["- llama-1b: the ladder's graph memory is 1.51× that of its largest bucket alone"],
            [],
        ),
        # compile=True catches up with torch.compile at 200 tokens
        (
            lambda d: d["families"][1]["rows"][1]["ms"].update(bg_compiled=2.6),
            ["| mistral-7b-4l | single 200 | 2.50 | 2.60 | 3.09 | 3.00 | 1.040 | - |"],
            ["`compile=True` takes 1.100×"],
        ),
        # an error is reported, not dropped
        (
            lambda d: d["families"][0]["errors"].update(hf_graph="RuntimeError: capture failed"),
            ["- llama-1b: hf_graph failed: `RuntimeError: capture failed`."],
            [],
        ),
    ],
)
def test_changed_json_changes_the_page(tmp_path, edit, expected, gone):
    data = baselines()
    edit(data)
    text = prefill_text(tmp_path, data)
    for line in expected:
        assert line.lower() in text.lower(), line
    for line in gone:
        assert line not in text


def test_changed_json_changes_the_overhead_section():
    text = "\n".join(report_breaks.overhead_section(report_data.overhead(1.8, 1.7)))
    assert "| 1.80 | 1.70 | met |" in text
    assert "in *large tensors* the added cost per break misses the target, and so does" in text
    assert "Medians of 15 trials." in text
    text = "\n".join(report_breaks.overhead_section(report_data.overhead(2.5, 1.7)))
    assert "| 2.50 | 1.70 | missed |" in text  # now missed, though the floor is met:
    assert "In *tiny kernels* the added cost per break (2.50 µs) misses the target while" in text
    assert "within 0.80 µs per break in every regime" in text


def test_changed_json_changes_the_anatomy_section():
    text = "\n".join(report_breaks.anatomy_section([report_data.anatomy(-6.0)]))
    assert "At 2048 tokens the eager kernel is *faster* than the captured one (8.00 µs" in text
    text = "\n".join(report_breaks.anatomy_section([report_data.anatomy(3.0)]))
    assert "*faster*" not in text


def test_changed_json_changes_the_earlier_runs():
    runs = [
        ("run 1", report_data.earlier(1.0)),
        ("run 2", report_data.earlier(1.07)),
        ("run 3", report_data.earlier(1.08)),
    ]
    text = "\n".join(report_earlier.section(report_data.earlier(1.05), runs, None))
    assert "tokens): all met." in text
    assert "reads 2.0–3.0 points lower than the second and third runs" in text
    text = "\n".join(report_earlier.section(report_data.earlier(1.2), runs, None))
    assert "single 32: breakgraph / one graph 1.200 > 1.10" in text
    assert "reads 12.0–13.0 points higher than the second and third runs" in text


# -- the pytest-benchmark suite --------------------------------------------------------------------
def suite_data() -> dict:
    bench = []

    def add(median, **info):
        bench.append({"stats": {"median": median}, "extra_info": info})

    for variant, t in [
        ("full_graph", 20e-6),
        ("breakgraph", 40e-6),
        ("separate_graphs", 38e-6),
        ("eager", 90e-6),
        ("peer", 60e-6),
    ]:
        add(
            t * 10,
            workload="overhead",
            regime="tiny kernels",
            variant=variant,
            breaks=9,
            repeats=10,
        )
    add(1e-4, workload="copy-back", kind="fresh", elements=4096, breaks=8, repeats=10)
    add(5e-5, workload="copy-back", kind="in_place", elements=4096, breaks=8, repeats=10)
    for variant, t in [("hf_eager", 0.015), ("breakgraph", 0.0036), ("full_graph", 0.0034)]:
        add(t, workload="prefill", case="32", variant=variant)
    add(1.0, workload="buckets", buckets=2, seconds=1.5, graph_bytes=300 * 2**20)
    return {"benchmarks": bench, "machine_info": {}}


def test_pytest_benchmark_suite_section():
    text = "\n".join(report.suite_section(suite_data()))
    assert "| tiny kernels | 20.0 | 2.22 | 2.00 | 4.44 | 90.0 | 2.00 | 2.25 |" in text
    assert "| 4096 | 1.25 | 0.62 |" in text
    assert "| 32 | 15.00 | 3.60 | 3.40 | - | 1.059 | 4.17 |" in text
    assert "| 2 | 1.50 | 300 |" in text
    # where it loses, stated from the numbers
    assert "- tiny kernels: 2.22 µs per break against 2.00 for separate plain CUDA graphs" in text
    assert "- prefill 32: 5.9% slower than the full graph" in text
    assert "breakable-cuda-graphs" not in text.split("Where breakgraph loses")[1]  # 2.22 < 4.44


def test_suite_json_is_labelled_with_gpu_and_versions():
    spec = importlib.util.spec_from_file_location(
        "bench_conftest", os.path.join(ROOT, "tests", "benchmarks", "conftest.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    info = {}
    module.pytest_benchmark_update_machine_info(None, info)
    import torch

    assert info["torch"] == torch.__version__ and "transformers" in info and "gpu" in info
    data = {
        "benchmarks": [],
        "datetime": "2026-11-30T05:54:19",
        "machine_info": dict(info, gpu="NVIDIA H200"),
    }
    text = "\n".join(report.suite_section(data))
    assert f"gpu NVIDIA H200, torch {torch.__version__}" in text


# -- plots (matplotlib is optional: the `bench` extra) ---------------------------------------------
def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    folder = tmp_path / "results"
    folder.mkdir()
    files = {
        report_prefill.FILE: baselines(),
        "h200-overhead.json": report_data.overhead(1.8, 1.7),
        "h200-prefill.json": report_data.earlier(1.05),
        "suite.json": suite_data(),
    }
    for name, data in files.items():
        (folder / name).write_text(json.dumps(data))
    written = report.write_plots(str(folder), str(folder / "suite.json"), str(tmp_path / "img"))
    assert sorted(os.path.basename(p) for p in written) == [
        "overhead.png",
        "prefill-baselines.png",
        "prefill-llama-1b.png",
        "suite.png",
    ]
    assert all(os.path.getsize(p) > 1000 for p in written)


def test_tp_section_computes_its_verdicts_from_the_data():
    import copy

    from benchmarks import tp_report

    with open(os.path.join(RESULTS, tp_report.FILE)) as f:
        data = json.load(f)
    text = "\n".join(tp_report.tp_section(data))
    assert "missed" not in text  # the committed run met every target
    slower = copy.deepcopy(data)
    row = next(e for e in slower["summary"]["table"] if e["workload"] == "512 tokens")
    row["bg_over_full"], row["tp1_over_tp2_bg"] = 1.2, 0.9
    text = "\n".join(tp_report.tp_section(slower))
    assert "512 tokens: 1.200x the whole graph (target <= 1.05x: missed)" in text
    assert "512 tokens: TP=2 0.90x faster than TP=1 (target > 1: missed)" in text
