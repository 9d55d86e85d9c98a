"""The graph-launch measurements behind the page's *Block tables written through numpy*
section: the launch fit, the scripts' behaviour without CUDA, and the section itself read from
the committed results (changed values change the text; an H100's floor uses its bandwidth)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from benchmarks import decode_gemm_probe, decode_launch_probe, graph_launch, report_cb_decode

RESULTS = os.path.join(os.path.dirname(__file__), "..", "docs", "results")


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def section(runs=None, probe=None) -> str:
    runs = runs or [(load(n), label) for n, label in report_cb_decode.TABLE_FILL_FILES]
    traces = [load(n) for n in report_cb_decode.TABLE_FILL_TRACE_FILES]
    probe = probe or load(report_cb_decode.LAUNCH_PROBE_FILE)
    launch = load(report_cb_decode.GRAPH_LAUNCH_FILE)
    return report_cb_decode.table_fill_section(runs, traces, launch, probe)


def test_the_fit_recovers_fixed_and_per_node_costs():
    fixed, per_node = graph_launch.fit({16: 5.0 + 16 * 0.5, 256: 5.0 + 256 * 0.5,
                                        1024: 5.0 + 1024 * 0.5})  # fmt: skip
    assert fixed == pytest.approx(5.0) and per_node == pytest.approx(0.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scripts measure where CUDA runs")
@pytest.mark.parametrize("script", [graph_launch, decode_launch_probe, decode_gemm_probe])
def test_the_probe_scripts_say_there_is_nothing_to_measure_without_cuda(script, tmp_path,
                                                                        capsys):  # fmt: skip
    out = tmp_path / "x.json"
    assert script.main(["--out", str(out)]) == 0
    assert "no CUDA device" in capsys.readouterr().out and not out.exists()


def test_the_section_reads_the_committed_runs():
    text = section()
    assert "16.6 µs with the device idle before it" in text
    assert "| C | 5.17.0 | H200 | llama3-8b-4l | `breakgraph_compiled` |" in text
    assert "| D | 5.24.0 | H100 |" in text


def test_changed_json_changes_the_section():
    probe = copy.deepcopy(load(report_cb_decode.LAUNCH_PROBE_FILE))
    next(iter(probe["decode"].values()))["idle"]["median_us"] = 999.0
    assert "999.0 µs with the device idle before it" in section(probe=probe)


def test_an_h100_floor_uses_the_h100_bandwidth():
    data = load(report_cb_decode.TABLE_FILL_FILES[1][0])
    entry = {"decode_over_floor": 4.8}
    assert data["meta"]["gpu"].startswith("NVIDIA H100")
    assert report_cb_decode._over_floor(data, entry) == pytest.approx(3.35)
    h200 = copy.deepcopy(data)
    h200["meta"]["gpu"] = "NVIDIA H200"
    assert report_cb_decode._over_floor(h200, entry) == pytest.approx(4.8)
