"""The model shapes the benchmarks run: real families' widths, random weights, no download.

Deep, narrow models (many attention breaks per token of work) and wide, shallow ones
(the 4-layer Mistral/Mixtral cuts: a 7B layer's compute with few breaks), dense and MoE.
``SMOKE_FAMILIES`` are tiny versions for the CPU smoke run (``tiny_models``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .tiny_models import EAGER_ATTENTION, MIXTRAL, MOE_FAMILIES, TINY, tiny_config


@dataclass(frozen=True)
class Family:
    """A named model shape. ``config`` builds the transformers config (imported lazily)."""

    name: str
    config: Callable[[], object]
    shape: str  # what it mimics, for the page


def _tf():
    import transformers

    return transformers


#: Mistral-7B-v0.1's widths (Mixtral-8x7B's experts have the same), cut to 4 layers
_7B_4L = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=32768,
)


def _mistral_7b_4l(sliding_window: int):
    """Mistral-7B-v0.1's widths cut to 4 layers, with the given sliding window."""
    return _tf().MistralConfig(**_7B_4L, sliding_window=sliding_window)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama-1b",
            lambda: _tf().LlamaConfig(
                vocab_size=32000,
                hidden_size=2048,
                intermediate_size=5632,
                num_hidden_layers=22,
                num_attention_heads=32,
                num_key_value_heads=4,
                max_position_embeddings=4096,
            ),
            "TinyLlama-1.1B: 22 layers, hidden 2048, GQA 32/4",
        ),
        Family(
            "qwen2-1.5b",
            lambda: _tf().Qwen2Config(
                vocab_size=151936,
                hidden_size=1536,
                intermediate_size=8960,
                num_hidden_layers=28,
                num_attention_heads=12,
                num_key_value_heads=2,
                max_position_embeddings=32768,
                rope_theta=1e6,
                tie_word_embeddings=True,
            ),
            "Qwen2-1.5B: 28 layers, hidden 1536, GQA 12/2",
        ),
        Family(
            "qwen3-0.6b",
            lambda: _tf().Qwen3Config(
                vocab_size=151936,
                hidden_size=1024,
                intermediate_size=3072,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                max_position_embeddings=40960,
                tie_word_embeddings=True,
            ),
            "Qwen3-0.6B: 28 layers, hidden 1024, GQA 16/8, head_dim 128",
        ),
        Family(
            "gemma-2b",
            lambda: _tf().GemmaConfig(
                vocab_size=256000,
                hidden_size=2048,
                intermediate_size=16384,
                num_hidden_layers=18,
                num_attention_heads=8,
                num_key_value_heads=1,
                head_dim=256,
                max_position_embeddings=8192,
            ),
            "Gemma-2B: 18 layers, hidden 2048, MQA 8/1, head_dim 256, vocab 256000",
        ),
        Family(
            "mistral-7b-4l",
            lambda: _mistral_7b_4l(sliding_window=4096),
            "Mistral-7B-v0.1 cut to 4 layers: hidden 4096, GQA 32/8, sliding window 4096",
        ),
        Family(
            "mixtral-4l",
            lambda: _tf().MixtralConfig(**_7B_4L, num_local_experts=8, num_experts_per_tok=2),
            "Mixtral-8x7B cut to 4 layers: 8 experts, top-2, hidden 4096",
        ),
        Family(
            "qwen3-moe-8l",
            lambda: _tf().Qwen3MoeConfig(
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_hidden_layers=8,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=128,
                num_experts_per_tok=8,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                max_position_embeddings=40960,
            ),
            "Qwen3-30B-A3B cut to 8 layers: 128 experts, top-8, hidden 2048",
        ),
        # the two small shapes of issue 23 (4 layers each): a fixed per-call cost shows there
        Family(
            "mistral-sw256-4l",
            lambda: _mistral_7b_4l(sliding_window=256),
            "Mistral-7B widths cut to 4 layers, sliding window 256",
        ),
        Family(
            "mixtral-1k-4l",
            lambda: _tf().MixtralConfig(
                vocab_size=32000,
                hidden_size=1024,
                intermediate_size=3584,
                num_hidden_layers=4,
                num_attention_heads=16,
                num_key_value_heads=4,
                num_local_experts=8,
                num_experts_per_tok=2,
                max_position_embeddings=4096,
            ),
            "Mixtral at hidden 1024: 4 layers, 8 experts top-2, GQA 16/4",
        ),
    )
}

#: Llama-3-8B's config, all 32 layers (the CB shapes cut it; ``bench_tp`` runs it whole): the
#: widths and heads of Mistral-7B, a larger vocabulary and RoPE base
LLAMA3_8B = dict(_7B_4L, vocab_size=128256, num_hidden_layers=32,
                 max_position_embeddings=8192, rope_theta=500000.0)  # fmt: skip

#: Qwen2.5-3B's config, all 36 layers (the CB shape ``qwen2.5-3b-12l`` cuts it to twelve)
QWEN25_3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                 num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                 max_position_embeddings=32768, rope_theta=1e6,
                 tie_word_embeddings=True)  # fmt: skip
#: Qwen3-30B-A3B's config, all 48 layers (``qwen3-moe-8l`` in ``FAMILIES`` cuts it to eight)
#: Gemma-3-1B's text model (google/gemma-3-1b-pt): five sliding-window layers to one global
GEMMA3_1B = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                 query_pre_attn_scalar=256, max_position_embeddings=32768,
                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                  "full_attention": {"rope_type": "default",
                                                     "rope_theta": 1e6}})  # fmt: skip
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
                     rope_theta=1e6)  # fmt: skip

#: The continuous-batching benchmark's own shapes (``benchmarks/bench_cb.py``), kept apart from
#: ``FAMILIES`` so that the prefill benchmark's default (every family) does not grow. The first
#: three are the shapes issue 23 asks for, none of them tuned on; ``qwen3-moe`` is the small MoE
#: the CB page has measured since issue 14.
CB_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen2.5-3b-12l",
            lambda: _tf().Qwen2Config(
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=11008,
                num_hidden_layers=12,
                num_attention_heads=16,
                num_key_value_heads=2,
                max_position_embeddings=32768,
                rope_theta=1e6,
                tie_word_embeddings=True,
            ),
            "Qwen2.5-3B cut to 12 layers: hidden 2048, GQA 16/2, vocab 151936, tied embeddings",
        ),
        Family(
            "llama3-8b-4l",
            lambda: _tf().LlamaConfig(**dict(LLAMA3_8B, num_hidden_layers=4)),
            "Llama-3-8B cut to 4 layers: hidden 4096, GQA 32/8, vocab 128256",
        ),
        Family(  # held out: the whole model the 4-layer cut stands for (16 GB in bf16)
            "llama3-8b",
            lambda: _tf().LlamaConfig(**LLAMA3_8B),
            "Llama-3-8B, all 32 layers: hidden 4096, GQA 32/8, vocab 128256",
        ),
        Family(  # held out: the whole model qwen2.5-3b-12l cuts to twelve layers (6 GB in bf16)
            "qwen2.5-3b",
            lambda: _tf().Qwen2Config(**QWEN25_3B),
            "Qwen2.5-3B, all 36 layers: hidden 2048, GQA 16/2, vocab 151936, tied embeddings",
        ),
        Family(  # held out: a whole many-expert MoE (61 GB in bf16; qwen3-moe-8l cuts it to 8)
            "qwen3-30b-a3b",
            lambda: _tf().Qwen3MoeConfig(**QWEN3_30B_A3B),
            "Qwen3-30B-A3B, all 48 layers: 128 experts top-8, hidden 2048, GQA 32/4",
        ),
        Family(  # held out: a whole model whose layers slide (5 of every 6, window 512)
            "gemma3-1b",
            lambda: _tf().Gemma3TextConfig(**GEMMA3_1B),
            "Gemma-3-1B, all 26 layers: sliding window 512 on 5 of 6, MQA 4/1 of 256, vocab 262144",
        ),
        Family(
            "mixtral-1k-8l",
            lambda: _tf().MixtralConfig(
                vocab_size=32000,
                hidden_size=1024,
                intermediate_size=3584,
                num_hidden_layers=8,
                num_attention_heads=16,
                num_key_value_heads=4,
                num_local_experts=8,
                num_experts_per_tok=2,
                max_position_embeddings=4096,
            ),
            "Mixtral at hidden 1024: 8 layers, 8 experts top-2, GQA 16/4",
        ),
        Family(
            "qwen3-moe",
            lambda: _tf().Qwen3MoeConfig(  # ~0.4B parameters
                vocab_size=32000,
                hidden_size=1024,
                intermediate_size=2816,
                moe_intermediate_size=512,
                num_hidden_layers=12,
                num_attention_heads=16,
                num_key_value_heads=4,
                head_dim=64,
                num_experts=16,
                num_experts_per_tok=4,
                max_position_embeddings=4096,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
            "Qwen3-MoE at hidden 1024: 12 layers, 16 experts top-4 (0.4B parameters)",
        ),
    )
}

#: Shapes the prefill benchmark runs only when named (``--families``), held out of its default:
#: gpt-oss-20b's widths cut to 4 layers (attention sinks, sliding layers of 128 beside full ones,
#: 32 experts top-4 with biases, YaRN RoPE), a family no default was tuned on
HELD_OUT_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "gpt-oss-20b-4l",
            lambda: _tf().GptOssConfig(
                vocab_size=201088,
                hidden_size=2880,
                intermediate_size=2880,
                num_hidden_layers=4,
                num_attention_heads=64,
                num_key_value_heads=8,
                head_dim=64,
                num_local_experts=32,
                num_experts_per_tok=4,
                sliding_window=128,
                max_position_embeddings=131072,
                rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                     beta_slow=1.0, truncate=False, rope_theta=150000.0,
                                     original_max_position_embeddings=4096),
            ),
            "gpt-oss-20b cut to 4 layers: sinks, sliding 128 / full, 32 experts top-4, GQA 64/8",
        ),
    )
}

SMOKE_FAMILIES: dict[str, Family] = {  # the tiny models (tiny_models.TINY)
    f.name: f
    for f in (
        Family("tiny-llama", lambda: tiny_config("LlamaConfig", **TINY), "2 layers, hidden 64"),
        Family(
            "tiny-mixtral",
            lambda: tiny_config("MixtralConfig", **TINY, **MIXTRAL, num_experts_per_tok=2),
            "2 layers, hidden 64, 4 experts, top-2",
        ),
        Family(
            "tiny-gpt-oss",
            lambda: tiny_config(MOE_FAMILIES["gpt_oss"][0], **TINY, **MOE_FAMILIES["gpt_oss"][1]),
            "2 layers, hidden 64, attention sinks, a sliding and a full layer, 4 experts",
        ),
    )
}


def stock_attention(config) -> str:
    """The attention a user of transformers gets for a model of ``config``: its SDPA, or its
    eager attention for the families transformers serves without SDPA (gpt-oss)."""
    return "eager" if config.model_type in EAGER_ATTENTION else "sdpa"


def make_model(config, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random-weight causal LM with HF's own SDPA attention (its eager attention for the
    families transformers serves without SDPA: gpt-oss), in eval mode (seed 0)."""
    transformers = _tf()
    torch.manual_seed(0)
    attention = stock_attention(config)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attention
        )
    return model.eval()


def config_summary(config) -> dict:
    """The config fields that set the cost of a prefill (for the JSON)."""
    keys = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "sliding_window",
        "max_position_embeddings",
        "tie_word_embeddings",
    )
    out = {k: getattr(config, k) for k in keys if getattr(config, k, None) is not None}
    for k in ("_experts_implementation", "_attn_implementation"):
        if getattr(config, k, None) is not None:
            out[k.lstrip("_")] = getattr(config, k)
    return out
