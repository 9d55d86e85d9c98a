"""Prefill fuzzer: random packed batches through ``PrefillRunner`` vs each prompt alone in HF.

For each architecture (llama, qwen2, qwen3, mistral with a sliding window shorter than
the prompts, gemma; and two MoE: Mixtral with transformers' ``grouped_mm`` experts and the
padding mask on every bucket, Qwen3-MoE with the eager experts loop) a tiny random-weight
causal LM (hidden 64, 2 layers, vocab 128) gets two runners with random token buckets, a
random ``max_prompts`` and ``on_miss="eager"`` (the MoE: half the batches). Then
random batches go through it: random prompt counts and lengths, totals that hit a bucket
exactly, totals one short of a bucket (a one-token padding tail), one-token prompts, full
batches of ``max_prompts`` prompts and batches longer than the largest bucket (the eager
fallback). Every prompt's last-token logits must match the unmodified model run on that
prompt alone (``model(ids[None]).logits[0, -1]``), and one prompt's KV cache per graph
batch must match the model's own ``past_key_values``.

Scale: ``BREAKGRAPH_FUZZ_PREFILL_BATCHES`` batches per architecture on the emulated
backend (default 100: 500 batches, ~10 s on 2 cores) and
``BREAKGRAPH_FUZZ_CUDA_PREFILL_BATCHES`` on CUDA in bf16 (default 400: 2,000 batches).
``BREAKGRAPH_FUZZ_PREFILL_SEED`` (default 0) shifts every model's and runner's seed: other
weights, runner buckets and batches for a long campaign.
A failure names the architecture, the runner's buckets, the batch index and its prompt
lengths; :func:`batch` rebuilds any batch from those.
"""

from __future__ import annotations

import gc
import os
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from breakgraph.integrations.transformers import PrefillRunner  # noqa: E402

from benchmarks.tiny_models import DENSE_FAMILIES, MIXTRAL, QWEN3_MOE, tiny_config  # noqa: E402
from breakgraph.errors import InputError  # noqa: E402

pytestmark = pytest.mark.transformers

VOCAB = 128
ARCHS = DENSE_FAMILIES
# MoE: transformers' grouped_mm experts with the padding mask on every bucket (the cost model
# would never use it on these tiny widths), and the eager loop on the live rows (a break)
MOE = {
    "mixtral_grouped": ("MixtralConfig", dict(MIXTRAL, num_experts_per_tok=2), "grouped_mm"),
    "qwen3_moe_eager": ("Qwen3MoeConfig", dict(QWEN3_MOE, num_experts_per_tok=2), "eager"),
}
BATCHES = int(os.environ.get("BREAKGRAPH_FUZZ_PREFILL_BATCHES", "100"))
CUDA_BATCHES = int(os.environ.get("BREAKGRAPH_FUZZ_CUDA_PREFILL_BATCHES", "400"))
SEED = int(os.environ.get("BREAKGRAPH_FUZZ_PREFILL_SEED", "0"))
KINDS = ("random", "random", "exact_bucket", "bucket_minus_one", "one_token", "full", "overflow")


def build_model(arch: str, seed: int, device: str, dtype: torch.dtype):
    cls_name, extra, *experts = ARCHS[arch] if arch in ARCHS else MOE[arch]
    config = tiny_config(cls_name, vocab_size=VOCAB, max_position_embeddings=256, **extra)
    torch.manual_seed(seed)
    options = {"experts_implementation": experts[0]} if experts else {}
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=dtype, attn_implementation="sdpa", **options
    )
    return model.to(device).eval()


def runner_config(seed: int) -> tuple[tuple[int, ...], int]:
    """Random token buckets (2-3 sizes in 4..48) and a random max_prompts (2..6)."""
    rng = random.Random(seed)
    buckets = tuple(sorted(rng.sample(range(4, 49), rng.randint(2, 3))))
    return buckets, rng.randint(2, 6)


def split(total: int, parts: int, rng: random.Random) -> list[int]:
    """``total`` tokens as ``parts`` positive prompt lengths."""
    parts = max(1, min(parts, total))
    cuts = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def batch(seed: int, index: int, buckets: tuple, max_prompts: int) -> tuple[str, list[int]]:
    """Batch ``index`` of a fuzz run: its kind and prompt lengths (deterministic)."""
    rng = random.Random(seed * 100_003 + index)
    kind = KINDS[index % len(KINDS)] if index < len(KINDS) else rng.choice(KINDS)
    n = rng.randint(1, max_prompts)
    if kind == "exact_bucket":
        return kind, split(rng.choice(buckets), n, rng)
    if kind == "bucket_minus_one":
        size = rng.choice([b for b in buckets if b > 1])
        return kind, split(size - 1, n, rng)
    if kind == "one_token":
        return kind, [1] * n
    if kind == "full":
        return kind, split(rng.randint(max_prompts, max(buckets)), max_prompts, rng)
    if kind == "overflow":
        return kind, split(rng.randint(max(buckets) + 1, max(buckets) + 24), n, rng)
    return kind, split(rng.randint(n, max(buckets)), n, rng)


def assert_close_logits(got, ref, backend: str, what: str) -> None:
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite logits"
    if backend == "emulated":
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"{what}: {m}")
        return
    # bf16 (FlashAttention in the runner, SDPA in the reference): 5% of the largest |logit|,
    # floor 0.01 (as tests/test_transformers.py); argmax where the top-2 margin is clear
    tolerance = max(0.01, 0.05 * ref.abs().max().item())
    error = (got - ref).abs().max().item()
    assert error <= tolerance, f"{what}: max|diff| {error:.4f} > {tolerance:.4f} (bf16)"
    top2 = ref.topk(2).values
    if (top2[0] - top2[1]).item() > 0.05:
        assert got.argmax() == ref.argmax(), f"{what}: argmax differs with a clear top-2 margin"


def assert_close_cache(mine, theirs, backend: str, what: str) -> None:
    assert mine.get_seq_length() == theirs.get_seq_length(), f"{what}: cache length"
    for layer, (a, b) in enumerate(zip(mine.layers, theirs.layers)):
        for name in ("keys", "values"):
            got, ref = getattr(a, name).float(), getattr(b, name).float()
            if backend == "emulated":
                torch.testing.assert_close(
                    got,
                    ref,
                    atol=1e-4,
                    rtol=1e-4,
                    msg=lambda m: f"{what} layer {layer} {name}: {m}",
                )
            else:  # wrong or stale rows differ by O(max|ref|); bf16 rounding by far less
                error, scale = (got - ref).abs().max().item(), ref.abs().max().item()
                assert error <= 0.1 * scale + 0.02, f"{what} layer {layer} {name}: {error:.4f}"


@pytest.fixture(scope="module", autouse=True)
def _fast():
    """One CPU thread (tiny models), and a frozen heap for the collector's automatic full
    collections (see test_fuzz.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    torch.set_num_threads(threads)


def fuzz_prefill(arch: str, backend: str, batches: int, runners: int = 2) -> None:
    """``batches`` random batches through each of ``runners`` runners of one model."""
    device, dtype = ("cuda", torch.bfloat16) if backend == "cuda" else ("cpu", torch.float32)
    base = SEED + [*ARCHS, *MOE].index(arch) + (100 if backend == "cuda" else 0)
    model = build_model(arch, base, device, dtype)
    for seed in range(base, base + 10 * runners, 10):
        buckets, max_prompts = runner_config(seed)
        runner = PrefillRunner(
            model, buckets, max_prompts, backend=backend, on_miss="eager", warmup=1
        )
        try:
            run_batches(model, runner, arch, backend, seed, batches // runners, device)
        finally:
            runner.close()


def run_batches(model, runner, arch: str, backend: str, seed: int, batches: int, device) -> None:
    buckets, max_prompts = runner.buckets, runner.max_prompts
    for index in range(batches):
        kind, lengths = batch(seed, index, buckets, max_prompts)
        where = (
            f"{arch} ({backend}) runner buckets={buckets} max_prompts={max_prompts}: "
            f"batch {index} ({kind}) lengths={lengths} [batch(seed={seed}, index={index})]"
        )
        generator = torch.Generator().manual_seed(seed * 7919 + index)
        prompts = [torch.randint(VOCAB, (n,), generator=generator).to(device) for n in lengths]
        out = runner.prefill(prompts)
        assert out.logits.shape == (len(prompts), VOCAB), where
        checked = random.Random(index).randrange(len(prompts))
        for i, p in enumerate(prompts):
            with torch.no_grad():
                own = model(p[None], use_cache=i == checked)
            assert_close_logits(out.logits[i], own.logits[0, -1], backend, f"{where} prompt {i}")
            if i != checked:
                continue
            if sum(lengths) > max(buckets):
                with pytest.raises(InputError):  # the eager fallback keeps no cache
                    out.cache(i)
            else:
                cache = out.cache(i)
                assert_close_cache(cache, own.past_key_values, backend, f"{where} cache {i}")
    fallbacks = sum(runner.stats.eager_fallbacks.values())
    overflowing = sum(
        sum(batch(seed, i, buckets, max_prompts)[1]) > max(buckets) for i in range(batches)
    )
    assert fallbacks == overflowing, f"{arch}: {fallbacks} eager fallbacks, {overflowing} expected"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_random_packed_batches_match_each_prompt_alone(arch):
    fuzz_prefill(arch, "emulated", BATCHES)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("arch", list(ARCHS))
def test_random_packed_batches_match_each_prompt_alone_cuda(arch):
    fuzz_prefill(arch, "cuda", CUDA_BATCHES)


def _mask_always(monkeypatch) -> None:
    from breakgraph.integrations.transformers import experts

    monkeypatch.setattr(experts, "MASK_COST_FLOP", 0)
    monkeypatch.setattr(experts, "COMPUTE_BOUND_ROWS", 0)


@pytest.mark.parametrize("arch", list(MOE))
def test_random_packed_moe_batches_skip_padding_and_match(arch, monkeypatch):
    """MoE experts doing no work on padding rows (grouped_mm: masked in the graph; the eager
    loop: live rows only) leave every prompt's logits and cache as the model's own."""
    _mask_always(monkeypatch)
    fuzz_prefill(arch, "emulated", BATCHES // 2)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("arch", list(MOE))
def test_random_packed_moe_batches_skip_padding_and_match_cuda(arch, monkeypatch):
    _mask_always(monkeypatch)
    fuzz_prefill(arch, "cuda", CUDA_BATCHES // 4)


def test_batches_cover_every_kind():
    buckets, max_prompts = runner_config(0)
    made = [batch(0, i, buckets, max_prompts) for i in range(BATCHES)]
    assert {kind for kind, _ in made} == set(KINDS)
    for kind, lengths in made:
        assert lengths and min(lengths) >= 1 and len(lengths) <= max_prompts
        if kind == "exact_bucket":
            assert sum(lengths) in buckets
        if kind == "overflow":
            assert sum(lengths) > max(buckets)
        if kind == "full":
            assert len(lengths) == max_prompts
