"""The GPU benchmark suite (pytest-benchmark). Never part of the normal test command.

Run on a GPU machine (writes pytest-benchmark JSON)::

    python -m pytest -o addopts="" -p no:cacheprovider tests/benchmarks --benchmark-only \
        --benchmark-json=bench.json
    python -m benchmarks.report --pytest-benchmark bench.json

Without a GPU every benchmark is skipped (``requires_cuda``); the normal test command
passes ``--benchmark-skip`` as well. The workload builders live in the ``benchmarks``
package (importable from the repository root: pytest's ``pythonpath`` setting).
"""

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def timed(benchmark):
    """``benchmark.pedantic`` with a device synchronisation inside the timed callable."""
    import torch

    def run(fn, rounds=30, warmup_rounds=5):
        def call():
            fn()
            torch.cuda.synchronize()

        return benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=warmup_rounds)

    return run


def pytest_collection_modifyitems(config, items):
    # this hook sees every collected item of the session: mark only the benchmarks
    for item in items:
        if str(item.path).startswith(HERE):
            item.add_marker(pytest.mark.requires_cuda)


@pytest.hookimpl(optionalhook=True)  # the hook exists only where pytest-benchmark is installed
def pytest_benchmark_update_machine_info(config, machine_info):
    """Label the JSON with what the numbers depend on: the GPU and the library versions."""
    import torch

    machine_info["torch"] = torch.__version__
    machine_info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    try:
        import transformers

        machine_info["transformers"] = transformers.__version__
    except ImportError:
        machine_info["transformers"] = None
