"""The torch names breakgraph reads beyond torch's documented API, checked on the installed torch.

The CUDA backend's calls run only on a GPU, so a torch release that renamed one would pass the
CPU suite and fail on the first capture. The names exist in every build with CUDA compiled in,
GPU or not (CI's legs on the PyPI builds of torch run this file without a GPU: docs/testing.md);
the CPU build has none of ``torch._C._cuda_*``, so those are skipped there. Where the library
already falls back (``_use_count``, ``_view_func``, the two spellings of ``endAllocateToPool``),
the test asks for what the fallback needs.
"""

from __future__ import annotations

import inspect

import pytest
import torch

CUDA_BUILT = torch.backends.cuda.is_built()

#: dotted name -> (where breakgraph reads it, needs a build with CUDA); a tuple of names: any
#: one of them (the library tries them in order)
NAMES = {
    "torch._C._storage_Use_Count": ("ownership._holders", False),
    "torch._C._construct_storage_from_data_pointer": ("memory.borrowed", False),
    "torch._C._DisableAutocast": ("backends.emulated", False),
    "torch._C._is_any_autocast_enabled": ("modes.any_autocast", False),
    "torch._debug_has_internal_overlap": ("copyback", False),
    "torch.utils._python_dispatch._get_current_dispatch_mode": ("syncs.exit_segment_mode", False),
    "torch._dynamo.mark_dynamic": ("integrations.transformers.compiled", False),
    "torch._dynamo.eval_frame.OptimizedModule": ("integrations.transformers.models", False),
    "torch.compiler.config.force_cudagraph_gc": ("backends.cuda.CudaSession", False),
    "torch.cuda.graph_pool_handle": ("backends.cuda", True),
    "torch.cuda.memory._snapshot": ("backends.cuda.CudaBackend.pool_bytes", True),
    (
        "torch._C._cuda_endAllocateToPool",
        "torch._C._cuda_endAllocateCurrentStreamToPool",
    ): ("backends.cuda._end_allocate_to_pool", True),
}


def _resolve(dotted: str):
    import importlib

    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:  # a submodule not imported yet
            obj = importlib.import_module(".".join(parts[: index + 1]))
    return obj


@pytest.mark.parametrize("names", list(NAMES), ids=lambda n: n if isinstance(n, str) else n[0])
def test_every_private_torch_name_breakgraph_reads_exists(names):
    where, needs_cuda = NAMES[names]
    if needs_cuda and not CUDA_BUILT:
        pytest.skip("this torch is built without CUDA")
    names = (names,) if isinstance(names, str) else names
    missing = []
    for name in names:
        try:
            _resolve(name)
            return
        except (AttributeError, ImportError) as error:
            missing.append(f"{name}: {error}")
    pytest.fail(f"{where} reads {' or '.join(names)}; torch {torch.__version__} lacks: {missing}")


@pytest.mark.skipif(not CUDA_BUILT, reason="this torch is built without CUDA")
def test_the_capture_calls_take_the_arguments_the_cuda_backend_passes():
    begin = inspect.signature(torch.cuda.CUDAGraph.capture_begin).parameters
    assert {"pool", "capture_error_mode"} <= set(begin)
    graph = inspect.signature(torch.cuda.graph.__init__).parameters
    assert {"cuda_graph", "pool", "stream", "capture_error_mode"} <= set(graph)
    for method in ("capture_end", "replay", "reset", "pool"):
        assert callable(getattr(torch.cuda.CUDAGraph, method))


def test_tensor_internals_used_by_the_ownership_census_behave_as_counted():
    """``_use_count`` and ``_view_func`` are optional (the census falls back), but where they
    exist they must count what it assumes: a view holds its base from C++."""
    base = torch.ones(4)
    use_count = getattr(base, "_use_count", None)
    if use_count is None:
        pytest.skip("no Tensor._use_count on this torch (the census uses the storage count)")
    before = use_count()
    view = base[:2]
    assert use_count() > before
    del view
    assert use_count() == before
    if hasattr(base[:2], "_view_func"):
        probe = torch.empty_like(base, device="meta")
        replica = base[:2]._view_func(probe)
        assert replica.shape == (2,) and replica.device.type == "meta"
