"""The tiny random transformers models: the one home of the CPU-fast shapes.

The tests build their models from these pieces, and so do the benchmarks' smoke runs
(``families.SMOKE_FAMILIES``, ``bench_tp --smoke``, ``bench_cb --smoke``), so a change of
shape (or a family added) happens once. Two layers, hidden 64, 4 query and 2 KV heads;
head_dim 16 where the family allows it. Mistral's window (8) is shorter than the longer test
prompts, so the window must be applied. (The examples and the docstring examples spell out
their own small configs: a reader runs them from an installed package, without this folder.)

Example::

    >>> from benchmarks.tiny_models import TINY, tiny_config
    >>> config = tiny_config("LlamaConfig", **TINY)
    >>> config.num_hidden_layers, config.hidden_size, config.vocab_size
    (2, 64, 128)
"""

from __future__ import annotations

TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

#: the smoke runs' model: the shape with a small vocabulary and context
TINY = dict(TINY_SHAPE, vocab_size=128, max_position_embeddings=512)

#: family -> (transformers config class name, extra config kwargs), the dense families
DENSE_FAMILIES = {
    "llama": ("LlamaConfig", dict(head_dim=16)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=8)),
    "gemma": ("GemmaConfig", dict(head_dim=16)),
}

#: the dense families beyond the Llama-style five, each with its own features switched on
#: (partial and interleaved RoPE, clip_qkv, qk-norm, Granite's four multipliers, biases,
#: LayerNorm, parallel attention and MLP, a sliding window, Gemma 3's sliding and global
#: layers, Cohere's logit_scale). The prefill and continuous-batching
#: tests run them; the fuzzer and the benchmarks' smoke runs do not (CI time).
OTHER_DENSE_FAMILIES = {
    "phi3": ("Phi3Config", dict(
        pad_token_id=None,  # its default (32000) is outside the tiny vocabularies, like GLM's
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    )),
    "olmo": ("OlmoConfig", dict(clip_qkv=0.1, attention_bias=True)),
    "olmo2": ("Olmo2Config", dict()),
    "granite": ("GraniteConfig", dict(
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
        logits_scaling=4.0, attention_bias=True, mlp_bias=True,
    )),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=8)),
    "stablelm": ("StableLmConfig", dict(
        qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True,
    )),
    "phi": ("PhiConfig", dict(qk_layernorm=True)),
    "glm": ("GlmConfig", dict(head_dim=16, pad_token_id=None)),  # half-rotary, interleaved
    # a sliding and a global layer, each with its own RoPE (the global one scaled, as Gemma 3's
    # larger checkpoints are), qk-norm, query_pre_attn_scalar, the embedding scale
    "gemma3_text": ("Gemma3TextConfig", dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
        ),
    )),
    # LayerNorm, attention and MLP in parallel, interleaved RoPE, qk-norm, and the logits
    # multiplied by logit_scale after lm_head
    "cohere": ("CohereConfig", dict(
        use_qk_norm=True, logit_scale=0.25,
        eos_token_id=None,  # its default (255001) is outside the tiny vocabularies
    )),
    # NoPE: the second layer without RoPE (SmolLM3 leaves out every fourth)
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0], pad_token_id=None)),
    # a sliding and a full layer, qk-norm
    "olmo3": ("Olmo3Config", dict(
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], pad_token_id=None,
    )),
    "ministral": ("MinistralConfig", dict(
        head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    )),
    # a sliding layer with RoPE and a full one without, qk-norm, norms after the blocks
    "exaone4": ("Exaone4Config", dict(
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], pad_token_id=None,
    )),
    # Cohere's parallel block and logit_scale, a sliding layer with RoPE and a full one without
    "cohere2": ("Cohere2Config", dict(
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], logit_scale=0.25,
        pad_token_id=None, eos_token_id=None,
    )),
    # norms after attention and MLP, half-rotary interleaved RoPE, biases
    "glm4": ("Glm4Config", dict(head_dim=16, attention_bias=True, pad_token_id=None)),
    "helium": ("HeliumConfig", dict(head_dim=16, attention_bias=True, mlp_bias=True)),
    "seed_oss": ("SeedOssConfig", dict(
        head_dim=16, attention_bias=True, attention_out_bias=True, pad_token_id=None,
    )),
    "ernie4_5": ("Ernie4_5Config", dict(head_dim=16, use_bias=True, pad_token_id=None)),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(head_dim=16, pad_token_id=None)),
    # xIELU activation, qk-norm
    "apertus": ("ApertusConfig", dict(pad_token_id=None)),
    # a gateless MLP (ReLU squared)
    "arcee": ("ArceeConfig", dict(head_dim=16, pad_token_id=None)),
    # LayerNorm1P, ReLU squared, half-rotary RoPE
    "nemotron": ("NemotronConfig", dict(head_dim=16, pad_token_id=None, eos_token_id=None)),
    # YaRN with Llama 4's query scale by position, its original length so short that the scale
    # changes at positions 8 and 16 (beta 1.0; checkpoints use 0.1), a window on every layer
    "ministral3": ("Ministral3Config", dict(
        head_dim=16, sliding_window=8,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0,
                             original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=1.0),
    )),
    # LayerNorm with biases, a gateless ReLU-squared MLP, biases on q/k/v/o and the MLP
    "jais2": ("Jais2Config", dict(
        head_dim=16, attention_bias=True, mlp_bias=True, hidden_act="relu2", eos_token_id=None,
    )),
    # Granite's multipliers (the logits multiplied, not divided), norms after attention and MLP,
    # biases
    "hyperclovax": ("HyperCLOVAXConfig", dict(
        head_dim=16, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
        logits_scaling=4.0, use_post_norm=True, attention_bias=True, mlp_bias=True,
    )),
    # from transformers 5.24 (5.23 for the two after it): Llama's code under another type, with
    # EXAONE 3.5's llama3 RoPE and tied embeddings
    "exaone": ("ExaoneConfig", dict(
        head_dim=16, tie_word_embeddings=True, pad_token_id=None, eos_token_id=None,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64),
    )),
    # Llama's code: biases on every projection
    "internlm3": ("InternLM3Config", dict(
        head_dim=16, attention_bias=True, mlp_bias=True, pad_token_id=None, eos_token_id=None,
        rope_parameters=dict(rope_type="default", rope_theta=50000000.0),
    )),
    "iquestcoder": ("IQuestCoderConfig", dict(
        head_dim=16, attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0),
    )),
    # from 5.24: Apertus' decoder (qk-norm, xIELU, llama3 RoPE, biases) and a head over fewer
    # tokens than the embedding
    "apertus1p5_text": ("Apertus1p5TextConfig", dict(
        head_dim=16, attention_bias=True, hidden_act="xielu", output_vocab_size=100,
        rope_parameters=dict(rope_type="llama3", rope_theta=12000000.0, factor=8.0,
                             original_max_position_embeddings=256, low_freq_factor=1.0,
                             high_freq_factor=4.0),
        pad_token_id=None, eos_token_id=None, bos_token_id=None,
    )),
}  # fmt: skip

#: the MoE families' extra kwargs (each test file adds the routing it needs)
QWEN3_MOE = dict(num_experts=4, moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])
MIXTRAL = dict(head_dim=16, num_local_experts=4)
#: Qwen2-MoE's shared expert and its gate beside the routed ones; OLMoE's qk-norm
QWEN2_MOE = dict(num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                 decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
OLMOE = dict(num_experts=4, intermediate_size=64, pad_token_id=None)
#: family -> (transformers config class name, extra config kwargs), the MoE families: the one
#: list the prefill, continuous-batching and fuzzer tests take them from
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", QWEN3_MOE),
    "mixtral": ("MixtralConfig", MIXTRAL),
    "qwen2_moe": ("Qwen2MoeConfig", QWEN2_MOE),
    "olmoe": ("OlmoeConfig", OLMOE),
    # grouped routing (two groups, the best one kept), a score-correction bias, scaled routed
    # weights, a shared expert, qk-norm, half-rotary RoPE
    "glm4_moe": ("Glm4MoeConfig", dict(
        n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=0, norm_topk_prob=True,
        use_qk_norm=True, pad_token_id=None,
    )),
    # shared experts, biases, routing with a minimum norm
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
        moe_layer_start_index=0, use_bias=True, pad_token_id=None,
    )),
    # a gate in fp32, a shared MLP, qk-norm
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(
        num_experts=4, moe_topk=2, head_dim=16, pad_token_id=None,
    )),
    # Granite's four multipliers
    "granitemoe": ("GraniteMoeConfig", dict(
        num_local_experts=4, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.1, logits_scaling=4.0, pad_token_id=None,
    )),
    # the same with a shared MLP
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(
        num_local_experts=4, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.1, logits_scaling=4.0, shared_intermediate_size=48,
        pad_token_id=None,
    )),
    # OLMo-2's norms after each block and qk-norm, with experts
    "flex_olmo": ("FlexOlmoConfig", dict(num_experts=4, pad_token_id=None)),
    # attention sinks, a sliding and a full layer, YaRN RoPE, biases everywhere, experts with
    # biases and a clamped gate (loaded with eager attention: no SDPA, see from_config)
    "gpt_oss": ("GptOssConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, head_dim=16,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128,
                             rope_theta=150000.0, beta_fast=32.0, beta_slow=1.0, truncate=False),
    )),
    # qk-norm over all heads at once, half-rotary RoPE, sigmoid routing with a score-correction
    # bias on the MoE block
    "minimax_m2": ("MiniMaxM2Config", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
        rope_parameters=dict(rope_type="default", rope_theta=5000000.0, partial_rotary_factor=0.5),
        bos_token_id=None, eos_token_id=None,  # its defaults are outside the tiny vocabularies
    )),
    # a sliding layer with RoPE and a full one without, qk-norm, a sigmoid gate on the attention
    # output, biases, muP's embedding scale, norms after the blocks, a dense first layer, sigmoid
    # routing with an expert bias and a route scale, shared experts
    "afmoe": ("AfmoeConfig", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
        num_dense_layers=1, num_shared_experts=2, route_scale=2.5, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], mup_enabled=True,
        attention_bias=True,
    )),
    # a sliding layer with RoPE and a full one without, qk-norm, a dense first layer, grouped
    # sigmoid routing (two groups, one kept) with a score-correction bias, scaled weights, a
    # shared expert
    "exaone_moe": ("ExaoneMoeConfig", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
        first_k_dense_replace=1, num_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )),
    # grouped sigmoid routing with a score-correction bias, scaled weights, a shared expert,
    # q/k/v biases
    "solar_open": ("SolarOpenConfig", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        attention_bias=True, head_dim=16,
    )),
    # Cohere's parallel block from one LayerNorm, interleaved RoPE on the sliding layer and none
    # on the full one, a dense first layer, a shared expert averaged in, logit_scale, biases
    "cohere2_moe": ("Cohere2MoeConfig", dict(
        head_dim=16, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_shared_experts=1, prefix_dense_intermediate_size=48,
        mlp_layer_types=["dense", "sparse"], sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], logit_scale=0.25,
        attention_bias=True, eos_token_id=None,
    )),
    # qk-norm, a dense first layer, fp32 sigmoid routing with a score-correction bias and a
    # routed scaling factor, a shared expert added in fp32, biases
    "hy_v3": ("HYV3Config", dict(
        head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, mlp_layer_types=["dense", "sparse"],
        attention_bias=True, mlp_bias=True,
    )),
    # a sliding and a full layer with their own RoPE theta, qk-norm, a dense first layer,
    # softmax top-k routing renormalised, biases
    "mellum": ("MellumConfig", dict(
        head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, mlp_layer_types=["dense", "sparse"], sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], attention_bias=True,
    )),
    # from transformers 5.20: a sliding layer with RoPE and a full one without, qk-norm, four norms
    # per layer, sigmoid routing with a score-correction bias, a shared expert
    "kolibri1": ("Kolibri1Config", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )),
    # from 5.24: GLM-4.5's code with qk-norm, full rotary, q/k/v biases, grouped sigmoid routing,
    # scaled weights and a dense first layer
    "sarvam_moe": ("SarvamMoEConfig", dict(
        head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        attention_bias=True, use_qk_norm=True, routed_scaling_factor=2.5,
        initializer_range=0.02, pad_token_id=None, eos_token_id=None,
    )),
    # query heads per layer (4, then 8, over 2 key heads), a sliding layer and a full one with
    # their own RoPE (partial on the full one), qk-norm, a softplus gate per head on the
    # attention output, a dense first layer, sigmoid routing with a score-correction bias,
    # scaled weights, a shared expert
    "laguna": ("LagunaConfig", dict(
        head_dim=16, num_attention_heads_per_layer=[4, 8], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
        moe_routed_scaling_factor=2.5,
    )),
}  # fmt: skip

#: families transformers serves without SDPA (gpt-oss: attention sinks); their tiny models load
#: with its eager attention, which breakgraph switches to its own like any other
EAGER_ATTENTION = ("gpt_oss",)


def from_config(config, **options):
    """``AutoModelForCausalLM.from_config(config, **options)`` in eval mode, with SDPA (eager
    attention for :data:`EAGER_ATTENTION`) and attention sinks (gpt-oss) drawn from N(0, 2)
    from the global generator: transformers initialises them near 0 (std 0.02), where a sink
    adds about 1 to each softmax's denominator, while a checkpoint's spread a few units either
    way, and a sink of the wrong sign or scale must show. Routing that transformers initialises
    to zero is drawn too: score-correction and expert biases from N(0, 0.1) (MiniMax-M2,
    AFMoE, EXAONE-MoE, Solar Open, GLM-4-MoE) and an all-zero router weight from N(0, 0.2)
    (AFMoE), or every expert would tie and the routing would go untested.

    >>> from benchmarks.tiny_models import MOE_FAMILIES, TINY, tiny_config
    >>> model = from_config(tiny_config(MOE_FAMILIES["gpt_oss"][0], **TINY,
    ...                                 **MOE_FAMILIES["gpt_oss"][1]))
    >>> model.config._attn_implementation, bool(model.model.layers[0].self_attn.sinks.std() > 0.1)
    ('eager', True)
    """
    import torch
    import transformers

    attention = "eager" if config.model_type in EAGER_ATTENTION else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attention, **options
    )
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 2.0)
            for bias in ("e_score_correction_bias", "expert_bias"):
                if isinstance(getattr(module, bias, None), torch.Tensor):
                    getattr(module, bias).normal_(0.0, 0.1)
            weight = getattr(module, "weight", None)
            if "router" in name and isinstance(weight, torch.Tensor) and not weight.any():
                weight.normal_(0.0, 0.2)
    return model.eval()


def missing_config(family: str) -> str | None:
    """The config class of ``family`` (any of this module's family dicts) where the installed
    transformers lacks it, else None: families that arrived after the oldest supported release
    (5.17) are tested where they exist (the tests' collection skips them elsewhere).

    >>> missing_config("llama") is None, missing_config("not a family") is None
    (True, True)
    """
    # the auto mapping's names: asking transformers' lazy module for a class it lacks imports
    # every model module in search of it
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    families = {**DENSE_FAMILIES, **OTHER_DENSE_FAMILIES, **MOE_FAMILIES}
    class_name = families.get(family, (None,))[0]
    known = class_name in CONFIG_MAPPING_NAMES.values()
    return class_name if class_name and not known else None


def tiny_config(class_name: str, **kwargs):
    """``transformers.<class_name>(**TINY_SHAPE, **kwargs)``; kwargs override the shape."""
    import transformers

    return getattr(transformers, class_name)(**{**TINY_SHAPE, **kwargs})
