"""The examples run (on the CPU through the emulated backend when there is no GPU).

Each example runs as ``__main__`` in this process (``runpy``), so the suite pays for
importing torch and transformers once, not once per example; the autouse seed fixture
reseeds the global generator the examples seed. ``tensor_parallel.py`` is the exception:
started with plain ``python`` it relaunches itself under torchrun, and that is what it
checks, so it runs as a user starts it.
"""

import os
import runpy
import subprocess
import sys
import warnings

import pytest

from tests.helpers import RankDiedWarning, run_torchrun_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
# the relaunched example imports the breakgraph of this checkout, not an installed (e.g.
# editable) copy; in this process the checkout is first on sys.path (pyproject's pythonpath)
ENV = dict(
    os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
)


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")))
def test_example_runs(name, one_cpu_thread, capsys, tmp_path):
    if name in ("quickstart.py", "tensor_parallel.py", "continuous_batching.py"):
        pytest.importorskip("transformers")
        from breakgraph.integrations.transformers import compat

        needs_cb = name in ("continuous_batching.py", "tensor_parallel.py")
        if needs_cb and not compat.supported("continuous_batching"):  # the library's own probe
            pytest.skip(f"transformers lacks: {compat.problems('continuous_batching')}")
    if name == "tensor_parallel.py":
        pytest.importorskip("accelerate")
        result = run_torchrun_script([sys.executable, os.path.join(EXAMPLES, name)],
                                     timeout=600, env=dict(ENV, TMPDIR=str(tmp_path)))  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        saved = [n for n in os.listdir(tmp_path) if n.startswith("breakgraph-tp-")]
        assert saved == []  # the model it saved for its ranks is gone (torchrun's files stay)
        stdout = result.stdout
    else:
        runpy.run_path(os.path.join(EXAMPLES, name), run_name="__main__")  # raises if it fails
        stdout = capsys.readouterr().out
    assert "False" not in stdout, stdout  # every printed check holds


def test_a_torchrun_script_whose_worker_dies_of_a_signal_runs_once_more(monkeypatch):
    """torchrun's report of a signal death reruns the script once, with a warning; any other
    failure, or a second death, is the result."""
    died = subprocess.CompletedProcess([], 1, "", "[0]:\n  exitcode  : -11 (pid: 7) SIGSEGV")
    failed = subprocess.CompletedProcess([], 1, "", "ValueError: a bug")
    passed = subprocess.CompletedProcess([], 0, "ok", "")
    for answers, warned, result in (
        ([died, passed], True, passed),
        ([died, died, passed], True, died),
        ([failed, passed], False, failed),
    ):
        calls = iter(answers)
        monkeypatch.setattr(subprocess, "run", lambda *a, **k: next(calls))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert run_torchrun_script(["python", "example.py"]) is result
        assert any(issubclass(w.category, RankDiedWarning) for w in caught) == warned
