"""pytest plugin (registered through the ``pytest11`` entry point as ``breakgraph``).

* the marker ``requires_cuda`` skips a test cleanly when no CUDA GPU is available;
* the fixture ``breakgraph_backend`` is ``"cuda"`` with a GPU and ``"emulated"`` without,
  so one test body checks graph safety on a laptop and on the GPU.

Example::

    import pytest

    @pytest.mark.requires_cuda
    def test_on_gpu(breakgraph_backend):
        assert breakgraph_backend == "cuda"
"""

import pytest


def _has_cuda() -> bool:
    import torch  # imported lazily: pytest loads plugins for every project in the environment

    return torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_cuda: needs a CUDA GPU; skipped cleanly without one"
    )


def pytest_collection_modifyitems(config, items):
    # the marker itself: an item's keywords also hold its parametrize ids and parents' names
    marked = [item for item in items if item.get_closest_marker("requires_cuda") is not None]
    if marked and not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture
def breakgraph_backend() -> str:
    """``"cuda"`` when a GPU is available, else ``"emulated"``."""
    return "cuda" if _has_cuda() else "emulated"
