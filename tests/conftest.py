"""Shared fixtures: every behavioural test runs on both backends.

``backend`` is ``"emulated"`` (CPU, always) and ``"cuda"`` (marked ``cuda``,
skipped cleanly without a GPU); ``device`` is the matching tensor device.
"""

import functools

import pytest
import torch

import breakgraph

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


BACKENDS = [
    pytest.param("emulated", id="emulated"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def device(backend):
    return "cuda" if backend == "cuda" else "cpu"


@pytest.fixture
def capture(backend):
    """``breakgraph.capture`` bound to the backend under test."""
    return functools.partial(breakgraph.capture, backend=backend)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
