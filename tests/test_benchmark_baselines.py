"""The benchmark-only baselines, built outside the library without any hook of it:
``benchmarks/one_graph.py`` (a ``PrefillRunner`` with attention recorded inside the graph at
upper-bound lengths, no breaks) and ``benchmarks/compile_interplay.py``'s old cuBLAS workspace
preparation (the CUDA backend's, replaced through ``breakgraph.patches`` for its own run)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from breakgraph.integrations.transformers import ATTENTION_KEY, UnsupportedModelError  # noqa: E402

from benchmarks.one_graph import ONE_GRAPH_KEY, OneGraphPrefillRunner  # noqa: E402
from breakgraph.errors import InputError  # noqa: E402
from tests.test_transformers import (  # noqa: E402
    BUCKETS,
    MAX_PROMPTS,
    assert_logits_close,
    eager_last_logits,
    model_for,
    prompts_of,
)

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("one_cpu_thread")]


def test_compile_interplay_restores_the_old_cublas_preparation_for_its_run_only():
    from benchmarks import compile_interplay
    from breakgraph.backends import cuda

    library = cuda._prepare_cublas
    with compile_interplay.cublas_workspaces(isolated=True):
        assert cuda._prepare_cublas is library
    with compile_interplay.cublas_workspaces(isolated=False):
        assert cuda._prepare_cublas is compile_interplay._prepare_cublas_in_the_ordinary_allocator
    assert cuda._prepare_cublas is library


def test_needs_cuda_flash_attention():
    """fp32 on the CPU (and the emulated backend anywhere) has no FlashAttention to capture:
    refused before anything is captured, the model untouched."""
    model = model_for("llama", "emulated")
    with pytest.raises(UnsupportedModelError, match="needs the CUDA backend"):
        OneGraphPrefillRunner(model, BUCKETS, MAX_PROMPTS, backend="emulated", warmup=1)
    with pytest.raises(InputError, match="attention must be 'flash'"):
        OneGraphPrefillRunner(model, BUCKETS, attention="reference", backend="emulated")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.requires_cuda
@pytest.mark.parametrize("cut", [False, True])
def test_one_graph_matches_eager_with_no_breaks(cut):
    """bf16 on CUDA: every bucket one graph (with ``cut_after_attention``, one empty break per
    layer), logits as the eager model's, the model's attention restored after each forward."""
    model = model_for("llama", "cuda")
    runner = OneGraphPrefillRunner(
        model, BUCKETS, MAX_PROMPTS, warmup=1, tune_buckets=False, cut_after_attention=cut
    )
    try:
        breaks = model.config.num_hidden_layers if cut else 0
        assert all(runner.graph(b).num_breaks == breaks for b in runner.buckets)
        assert runner.attention == "flash"
        for lengths in ([5, 9], [20, 20, 1, 7], [16]):
            prompts = prompts_of(lengths, "cuda")
            out = runner.prefill(prompts)
            for i, p in enumerate(prompts):
                assert_logits_close(
                    out.logits[i], eager_last_logits(model, p), "cuda", f"{lengths} {i}"
                )
        assert model.config._attn_implementation == "sdpa"
        with runner.installed():  # PrefillRunner's switch, then this variant's key
            assert model.config._attn_implementation == ONE_GRAPH_KEY
        assert model.config._attn_implementation not in (ONE_GRAPH_KEY, ATTENTION_KEY)
    finally:
        runner.close()
