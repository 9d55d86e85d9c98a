"""The examples run (on the CPU through the emulated backend when there is no GPU)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
# the examples import the breakgraph of this checkout, not an installed (e.g. editable) copy
ENV = dict(
    os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
)


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")))
def test_example_runs(name):
    if name in ("quickstart.py", "tensor_parallel.py", "continuous_batching.py"):
        pytest.importorskip("transformers")
        from breakgraph.integrations.transformers import compat

        needs_cb = name in ("continuous_batching.py", "tensor_parallel.py")
        if needs_cb and not compat.supported("continuous_batching"):  # the library's own probe
            pytest.skip(f"transformers lacks: {compat.problems('continuous_batching')}")
    if name == "tensor_parallel.py":
        pytest.importorskip("accelerate")
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name)],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "False" not in result.stdout, result.stdout  # every printed check holds
