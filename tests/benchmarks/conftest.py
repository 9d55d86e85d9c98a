"""The GPU benchmark suite (pytest-benchmark). Never part of the normal test command.

Run on a GPU machine (writes pytest-benchmark JSON)::

    python -m pytest -o addopts="" -p no:cacheprovider tests/benchmarks --benchmark-only \
        --benchmark-json=bench.json
    python benchmarks/report.py --pytest-benchmark bench.json

Without a GPU every benchmark is skipped (``requires_cuda``); the normal test command
passes ``--benchmark-skip`` as well. The workload builders live in ``benchmarks/``.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


HERE = os.path.dirname(os.path.abspath(__file__))


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
