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

Config variants (:func:`draw_config`): the fixed tiny configs above are one point per family;
real checkpoints turn many more knobs. Each seed takes the next family of
``SUPPORTED_MODEL_TYPES`` (those the installed transformers has) with random knobs: RoPE
types (linear, dynamic, yarn, llama3, longrope, proportional), partial rotary, head sizes
unlike ``hidden / heads``, MHA, GQA and MQA, odd head counts,
tied embeddings, biases, qk-norms, Granite's multipliers, Cohere's
logit scale, Gemma 3's layer patterns, windows and scalar, softcapping, sliding windows shorter
and longer than the prompts, MoE routing (``norm_topk_prob``, top-k up to every expert, dense
layers among sparse ones), activations, pad and bos ids and vocabulary sizes. A runner must
refuse exactly the knobs breakgraph cannot serve (:func:`expected_refusal`) with
``UnsupportedModelError``, and serve every other draw exactly (logits and cache); dynamic and
longrope RoPE up to their original length, a longer prompt refused with ``InputError``.
``BREAKGRAPH_FUZZ_CONFIGS`` draws (default 8, from ``BREAKGRAPH_FUZZ_PREFILL_SEED``); the
continuous-batching fuzzer serves the same draws (``tests/test_fuzz_cb.py``).
"""

from __future__ import annotations

import gc
import inspect
import os
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from breakgraph.integrations.transformers import (  # noqa: E402
    SUPPORTED_MODEL_TYPES,
    PrefillRunner,
    UnsupportedModelError,
)
from breakgraph.integrations.transformers.rope import rope_position_limit  # noqa: E402

from benchmarks.tiny_models import (  # noqa: E402
    DENSE_FAMILIES,
    MIXTRAL,
    MOE_FAMILIES,
    QWEN3_MOE,
    from_config,
    missing_config,
    tiny_config,
)
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
CONFIGS = int(os.environ.get("BREAKGRAPH_FUZZ_CONFIGS", "8"))
KINDS = ("random", "random", "exact_bucket", "bucket_minus_one", "one_token", "full", "overflow")


def build_model(arch: str, seed: int, device: str, dtype: torch.dtype):
    cls_name, extra, *experts = ARCHS[arch] if arch in ARCHS else MOE[arch]
    config = tiny_config(cls_name, vocab_size=VOCAB, max_position_embeddings=256, **extra)
    torch.manual_seed(seed)
    options = {"experts_implementation": experts[0]} if experts else {}
    model = from_config(config, dtype=dtype, **options)
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


# -- config variants ------------------------------------------------------------------------------
_PARTIAL_ROTARY = ("phi3", "stablelm", "phi", "glm", "glm4", "nemotron", "glm4_moe",
                   "minimax_m2")  # the factor  # fmt: skip
_KEYED_ROPE = ("gemma3_text", "olmo3", "mellum", "laguna")  # RoPE settings keyed by layer type
#: a window always: sliding layer_types by default, or (Qwen2-MoE) a sliding mask built whatever
#: the layers (transformers' own forward fails without a window)
_SLIDING_LAYERS = ("olmo3", "ministral", "exaone4", "cohere2", "qwen2_moe", "gpt_oss", "afmoe",
                   "exaone_moe", "cohere2_moe", "laguna")  # fmt: skip
_HIDDEN_HEADS = ("helium",)  # o_proj maps hidden_size to hidden_size: head_dim = hidden / heads


def _rope(rng: random.Random, head_dim: int, partial: float, family: str) -> dict:
    """A random RoPE setting that transformers accepts for a head of ``head_dim``."""
    kinds = ["default"] * 3 + ["linear", "dynamic", "yarn", "llama3", "longrope"]
    if partial == 1.0:  # transformers 5.17's proportional RoPE fails with partial rotary
        kinds.append("proportional")
    kind = rng.choice(["default", "longrope"] if family == "phi3" else kinds)
    rope = dict(rope_type=kind, rope_theta=rng.choice([100.0, 10000.0, 500000.0]))
    if kind in ("linear", "dynamic", "yarn", "llama3", "proportional"):
        rope["factor"] = rng.choice([0.5, 2.0, 8.0] if kind == "linear" else [2.0, 4.0, 8.0])
    if kind in ("yarn", "llama3", "longrope"):
        rope["original_max_position_embeddings"] = rng.choice([16, 32, 64])
    if kind == "yarn" and rng.random() < 0.5:
        rope["attention_factor"] = rng.choice([0.5, 1.3])
    if kind == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if kind == "longrope":
        half = int(head_dim * partial) // 2
        rope.update(short_factor=[1 + i / 10 for i in range(half)],
                    long_factor=[2 + i / 10 for i in range(half)])  # fmt: skip
    if family in _PARTIAL_ROTARY:
        rope["partial_rotary_factor"] = partial
    return rope


#: the supported families the installed transformers has (some arrived after 5.17)
DRAWN_FAMILIES = [f for f in SUPPORTED_MODEL_TYPES if missing_config(f) is None]


def draw_config(seed: int) -> tuple[str, dict, str | None]:
    """``(model_type, config kwargs, experts implementation)``: the family ``seed`` picks
    (consecutive seeds go through ``DRAWN_FAMILIES``) with random knobs of real
    checkpoints on a tiny shape (hidden 48-96, 1-4 layers, vocabulary <= 256)."""
    rng = random.Random(seed)
    family = DRAWN_FAMILIES[seed % len(DRAWN_FAMILIES)]
    config_class = type(transformers.AutoConfig.for_model(family))
    knobs = set(inspect.signature(config_class.__init__).parameters)
    hidden = rng.choice([48, 64, 64, 80, 96])
    heads = rng.choice([h for h in (2, 3, 4, 5, 6, 8) if hidden % (2 * h) == 0])
    head_dim = hidden // heads
    kw = dict(hidden_size=hidden, intermediate_size=rng.choice([64, 72, 128]),
              num_hidden_layers=rng.choice([1, 2, 3, 4]), vocab_size=rng.choice([64, 100, 256]),
              max_position_embeddings=rng.choice([128, 256]), num_attention_heads=heads,
              bos_token_id=rng.choice([None, 1]), eos_token_id=None)  # fmt: skip
    if "head_dim" in knobs:  # always set: some families' default is 128 or 256
        # a head unlike hidden / heads, maybe an odd count of heads
        if rng.random() < 0.5 and family not in _HIDDEN_HEADS:
            head_dim = rng.choice([8, 12, 16, 20, 32, 40])
            heads = rng.choice([heads, heads] + [h for h in (3, 5, 6, 7) if hidden % h == 0])
        kw.update(head_dim=head_dim, num_attention_heads=heads)
    kw["num_key_value_heads"] = rng.choice([k for k in (1, 2, 3, 4, heads) if heads % k == 0])
    kw["pad_token_id"] = rng.choice([None, 0, kw["vocab_size"] - 1])
    # rotary sizes transformers takes: even, and above 2 (dynamic RoPE divides by dim - 2)
    rotary = {f: int(head_dim * f) for f in (0.25, 0.4, 0.5, 1.0)}
    even = [f for f, dim in rotary.items() if dim % 2 == 0 and dim > 2]
    partial = rng.choice(even) if family in _PARTIAL_ROTARY else 1.0
    if family in _KEYED_ROPE:  # a setting per layer type
        kw["rope_parameters"] = {kind: _rope(rng, head_dim, 1.0, family)
                                 for kind in ("sliding_attention", "full_attention")}  # fmt: skip
    elif family in _PARTIAL_ROTARY or rng.random() < 0.6:  # their defaults are partial
        kw["rope_parameters"] = _rope(rng, head_dim, partial, family)
    if family == "ministral3":  # Llama 4's query scale by position: the model needs both
        kw.setdefault("rope_parameters", dict(rope_type="default", rope_theta=10000.0))
        kw["rope_parameters"].update(llama_4_scaling_beta=rng.choice([0.1, 1.0]),
                                     original_max_position_embeddings=rng.choice([8, 16, 64]))
    for knob in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_qkv_bias", "use_bias",
                 "qk_layernorm", "use_qk_norm", "use_parallel_residual"):  # fmt: skip
        if knob in knobs and rng.random() < 0.7:
            kw[knob] = rng.random() < 0.5
    if family == "internlm3":  # its config refuses a q/k/v bias unlike the other projections'
        kw["mlp_bias"] = kw["attention_bias"] = kw.get("attention_bias", False)
    if "hidden_act" in knobs and rng.random() < 0.3:
        kw["hidden_act"] = rng.choice(["silu", "gelu", "gelu_pytorch_tanh", "relu"])
    if family == "olmo" and rng.random() < 0.5:
        kw["clip_qkv"] = rng.choice([0.05, 1.0, 8.0])
    if family == "granite":
        for knob in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                     "logits_scaling"):  # fmt: skip
            kw[knob] = rng.choice([0.1, 0.5, 2.0, 12.0])
    if family == "cohere":
        kw["logit_scale"] = rng.choice([0.0625, 0.5, 3.0])
    windows = [None, 1, 2, 5, 8, 16, 300]  # 1: refused by continuous batching
    if "sliding_window" in knobs and family != "gemma3_text" and rng.random() < 0.6:
        kw["sliding_window"] = rng.choice(windows[family in _SLIDING_LAYERS :])
        if "use_sliding_window" in knobs:
            kw["use_sliding_window"] = rng.random() < 0.7
        if "max_window_layers" in knobs:
            kw["max_window_layers"] = rng.choice([0, 1, 2, 28])
    if family == "gemma3_text":
        kw.update(sliding_window=rng.choice([1, 3, 8, 64]),
                  query_pre_attn_scalar=rng.choice([16, 256, head_dim]),
                  layer_types=[rng.choice(["sliding_attention", "full_attention"])
                               for _ in range(kw["num_hidden_layers"])])  # fmt: skip
        for knob, cap in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0)):
            if rng.random() < 0.15:
                kw[knob] = cap
    experts = None
    if family in MOE_FAMILIES:
        count = rng.choice([2, 4, 8])
        kw["num_experts_per_tok"] = rng.randint(1, count)
        experts = rng.choice([None, "eager", "grouped_mm"])
        _routing_knobs(family, kw, rng, count)
    if family in ("qwen3_moe", "qwen2_moe"):
        kw.update(num_experts=count, moe_intermediate_size=rng.choice([32, 64]),
                  norm_topk_prob=rng.random() < 0.5, decoder_sparse_step=rng.choice([1, 2, 3]),
                  mlp_only_layers=rng.choice([[], [0], [1], [0, 1]]))  # fmt: skip
    if family == "qwen2_moe":  # the shared expert beside the routed ones
        kw["shared_expert_intermediate_size"] = rng.choice([32, 96])
    if family == "olmoe":
        kw.update(num_experts=count, norm_topk_prob=rng.random() < 0.5,
                  clip_qkv=rng.choice([None, 0.05, 8.0]))  # fmt: skip
    if family == "mixtral":
        kw.update(num_local_experts=count, router_jitter_noise=rng.choice([0.0, 0.1]))
    return family, kw, experts


def _routing_knobs(family: str, kw: dict, rng: random.Random, count: int) -> None:
    """The routing knobs of the MoE families added in sessions 48-50 (``count`` experts): grouped
    routing, shared experts, dense layers among sparse ones, scaled and normed routing weights,
    Granite's multipliers; and Laguna's query heads per layer (session 53)."""
    k = kw.get("num_experts_per_tok")
    if family in ("glm4_moe", "sarvam_moe"):  # Sarvam: GLM-4.5's code, full rotary
        groups = rng.choice([g for g in (1, 2, 4) if count % g == 0 and count // g >= 2])
        kept = rng.choice([g for g in range(1, groups + 1) if g * count // groups >= k])
        kw.update(n_routed_experts=count, n_group=groups, topk_group=kept,
                  moe_intermediate_size=rng.choice([32, 64]), n_shared_experts=rng.choice([1, 2]),
                  routed_scaling_factor=rng.choice([1.0, 2.5]), norm_topk_prob=rng.random() < 0.5,
                  first_k_dense_replace=rng.choice([0, 0, 1]))  # fmt: skip
    if family == "ernie4_5_moe":
        kw.update(moe_num_experts=count, moe_k=k, moe_intermediate_size=rng.choice([32, 64]),
                  moe_num_shared_experts=rng.choice([0, 1]),
                  moe_layer_start_index=rng.choice([0, 1]), moe_layer_interval=rng.choice([1, 2]),
                  moe_norm_min=rng.choice([1e-12, 0.5]))  # fmt: skip
    if family == "hunyuan_v1_moe":
        kw.update(num_experts=count, moe_topk=k)
    if family in ("granitemoe", "granitemoeshared"):
        kw["num_local_experts"] = count
        for knob in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                     "logits_scaling"):  # fmt: skip
            kw[knob] = rng.choice([0.1, 0.5, 2.0, 12.0])
    if family == "granitemoeshared":
        kw["shared_intermediate_size"] = rng.choice([0, 32, 96])
    if family == "flex_olmo":
        kw.update(num_experts=count, norm_topk_prob=rng.random() < 0.5)
    if family == "gpt_oss":  # sinks: drawn by from_config; the default layers alternate
        kw["num_local_experts"] = count
    if family == "minimax_m2":  # the score-correction bias: drawn by from_config
        kw["num_local_experts"] = count
    if family == "afmoe":
        kw.update(num_experts=count, moe_intermediate_size=rng.choice([32, 64]),
                  num_dense_layers=rng.choice([0, 0, 1]), num_shared_experts=rng.choice([0, 1, 2]),
                  route_scale=rng.choice([1.0, 2.5]), mup_enabled=rng.random() < 0.5)  # fmt: skip
    if family in ("exaone_moe", "solar_open"):  # grouped routing: every group at least 2 experts
        groups = rng.choice([g for g in (1, 2, 4) if count % g == 0 and count // g >= 2])
        kept = rng.choice([g for g in range(1, groups + 1) if g * count // groups >= k])
        kw.update(n_group=groups, topk_group=kept, moe_intermediate_size=rng.choice([32, 64]),
                  routed_scaling_factor=rng.choice([1.0, 2.5]), norm_topk_prob=rng.random() < 0.5)
    if family == "exaone_moe":
        kw.update(num_experts=count, first_k_dense_replace=rng.choice([0, 0, 1]),
                  num_shared_experts=rng.choice([0, 1]))
    if family == "solar_open":
        kw.update(n_routed_experts=count, n_shared_experts=rng.choice([0, 1]))
    if family in ("cohere2_moe", "hy_v3", "mellum"):  # dense and sparse layers in any order
        kw.update(num_experts=count, mlp_layer_types=[
            rng.choice(["dense", "sparse"]) for _ in range(kw["num_hidden_layers"])])
    if family in ("cohere2_moe", "hy_v3"):  # HunYuan 3 takes 0 shared experts as intermediate_size
        kw["num_shared_experts"] = rng.choice([1, 2])
    if family == "cohere2_moe":
        kw["logit_scale"] = rng.choice([0.0625, 0.5, 3.0])
    if family in ("hy_v3", "mellum"):
        kw["moe_intermediate_size"] = rng.choice([32, 64])
    if family == "mellum":
        kw["norm_topk_prob"] = rng.random() < 0.5
    if family == "kolibri1":  # the score-correction bias: drawn by from_config
        kw.update(num_experts=count, moe_intermediate_size=rng.choice([32, 64]),
                  shared_expert_intermediate_size=rng.choice([32, 96]),
                  norm_topk_prob=rng.random() < 0.5)  # fmt: skip
    if family == "laguna":  # the bias likewise; query heads per layer, any mix of layer types
        layers = range(kw["num_hidden_layers"])
        kw.update(num_experts=count, moe_intermediate_size=rng.choice([32, 64]),
                  shared_expert_intermediate_size=rng.choice([32, 96]),
                  moe_routed_scaling_factor=rng.choice([1.0, 2.5]),
                  moe_router_logit_softcapping=rng.choice([0.0, 0.0, 5.0]),
                  gating=rng.choice([True, "per-element"]),
                  mlp_layer_types=[rng.choice(["dense", "sparse"]) for _ in layers],
                  layer_types=[rng.choice(["sliding_attention", "full_attention"]) for _ in layers],
                  num_attention_heads_per_layer=[kw["num_key_value_heads"] * rng.choice([1, 2, 3])
                                                 for _ in layers])  # fmt: skip


def expected_refusal(config, who: str = "PrefillRunner") -> str | None:
    """What breakgraph must refuse in a drawn config (a pattern of its message), or None."""
    from breakgraph.integrations.transformers.models import layer_attention, rope_types

    if {"dynamic", "longrope"} & set(rope_types(config)) and who != "PrefillRunner":
        return "keeps its frequencies only up to|is not static RoPE"  # PrefillRunner: served
    for knob in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, knob, None) is not None:
            return "softcapping is not supported"
    windowed = layer_attention(config) != "full"
    if who != "PrefillRunner" and windowed and getattr(config, "sliding_window", None) == 1:
        return "sliding_window=1"
    return None


def build_variant(seed: int, dtype: torch.dtype = torch.float32):
    """The model of :func:`draw_config`'s draw (random weights from ``seed``)."""
    family, kw, experts = draw_config(seed)
    config = transformers.AutoConfig.for_model(family, **kw)
    torch.manual_seed(seed)
    options = {"experts_implementation": experts} if experts else {}
    return from_config(config, dtype=dtype, **options)


@pytest.mark.parametrize("seed", range(SEED, SEED + CONFIGS))
def test_config_variants_are_served_exactly_or_refused(seed):
    """A random config of one family: ``UnsupportedModelError`` at construction for exactly
    the knobs breakgraph cannot serve; else packed batches, one-prompt batches and the eager
    fallback give the model's own logits, and a prompt's cache the model's own cache."""
    model = build_variant(seed)
    where = f"seed {seed}: {draw_config(seed)}"
    refusal = expected_refusal(model.config)
    make = lambda: PrefillRunner(model, (16, 48), 4, backend="emulated", on_miss="eager",  # noqa: E731
                                 warmup=1, single_prompt_graphs=seed % 2 == 0)  # fmt: skip
    if refusal is not None:
        with pytest.raises(UnsupportedModelError, match=refusal):
            make()
        return
    runner = make()
    limit = rope_position_limit(model)  # dynamic and longrope RoPE: the longest prompt served
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    try:
        for lengths in ([5, 17, 9], [1], [30], [13, 1, 20, 8], [40, 30]):  # the last: eager
            prompts = [torch.randint(vocab, (n,), generator=generator) for n in lengths]
            if limit is not None and max(lengths) > limit:  # dynamic/longrope past its original
                with pytest.raises(InputError, match=f"more than {limit}, the longest"):
                    runner.prefill(prompts)
                continue
            out = runner.prefill(prompts)
            for i, prompt in enumerate(prompts):
                with torch.no_grad():
                    own = model(prompt[None], use_cache=True)
                what = f"{where} lengths {lengths} prompt {i}"
                assert_close_logits(out.logits[i], own.logits[0, -1], "emulated", what)
                if i == len(prompts) - 1 and sum(lengths) <= 48:
                    cache = out.cache(i)
                    assert_close_cache(cache, own.past_key_values, "emulated", what)
    finally:
        runner.close()
