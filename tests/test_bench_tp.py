"""``benchmarks/bench_tp.py --smoke``: the TP benchmark's whole path on the CPU (two processes
under torchrun, gloo, the emulated backend, a tiny model), so the GPU run does not fail late."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_run_writes_every_variant(tmp_path):
    out = tmp_path / "tp.json"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    )
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "bench_tp.py"),
            "--smoke",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["smoke"] and data["meta"]["world_size"] == 2
    rows = data["tp"]["rows"]
    assert [row["workload"].split()[0] for row in rows] == ["8", "16", "32", "64", "batch"]
    for row in rows:
        for variant in ("tp_eager", "tp_breakgraph", "tp_bg_eager_ar"):
            assert row[variant]["median_ms"] > 0
    assert data["tp"]["skipped"] == {
        "tp_full_graph": "captured attention needs CUDA (FlashAttention)"
    }
    for by_variant in data["tp"]["correctness_vs_tp_eager"].values():
        for variant in ("tp_breakgraph", "tp_bg_eager_ar"):
            assert by_variant[variant]["max_abs_diff"] < 1e-4
    assert len(data["tp1"]["rows"]) == len(rows)
    assert len(data["summary"]["table"]) == len(rows) and data["summary"]["targets"] == {}
    assert "max |logits - TP eager|" in result.stdout
