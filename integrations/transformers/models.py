"""Which models breakgraph serves, and how: the support policy of the transformers integration.

One place for what both entry points (``PrefillRunner`` and ``enable_continuous_batching``)
decide the same way: the supported model families and configurations
(:func:`check_model`), the error they raise (:class:`UnsupportedModelError`, from
:mod:`.errors`), the attention kernel behind ``attention="auto"`` (:func:`resolve_attention`)
and the default bucket ladders (:func:`default_token_buckets` for prefill,
:func:`default_query_buckets` for the continuous-batching steps). Whether the *installed
transformers* has what the code reads is decided by probes in :mod:`.compat`.

Example::

    >>> import torch
    >>> from breakgraph.integrations.transformers.models import resolve_attention
    >>> resolve_attention("auto", torch.float32, torch.device("cpu"), "PrefillRunner")
    'reference'
"""

from __future__ import annotations

from typing import Any

import torch

from breakgraph.buckets import default_token_buckets, geometric_buckets, validate_buckets
from breakgraph.errors import InputError, ReplayError

from .compat import SWITCHED_ROPE_TYPES, causal_lm_class_name
from .errors import UnsupportedModelError
from .logits_head import logits_after_head

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "check_model",
    "resolve_attention",
    "default_token_buckets",
    "default_query_buckets",
    "DEFAULT_MAX_BATCH_TOKENS",
    "attention_heads",
    "query_heads",
    "layer_attention",
    "check_paged_window",
    "check_paged_heads",
    "check_head_norms",
    "check_tp_heads",
    "token_vocabulary",
    "check_sampled_tokens",
    "check_step_compile",
    "check_async_batching",
    "eager_steps",
    "rope_types",
    "check_rope",
    "logits_after_head",
    "weights_anchor",
    "moved_error",
]

SUPPORTED_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma", "qwen3_moe", "mixtral", "qwen2_moe", "olmoe",
    "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe", "granitemoe", "granitemoeshared", "flex_olmo",
    "gpt_oss", "minimax_m2", "afmoe", "exaone_moe", "solar_open", "cohere2_moe", "hy_v3", "mellum",
    "kolibri1", "sarvam_moe", "laguna",
    "phi3", "olmo", "olmo2", "granite", "starcoder2", "stablelm", "phi", "glm", "gemma3_text",
    "cohere", "smollm3", "olmo3", "ministral", "exaone4", "cohere2", "glm4", "helium", "seed_oss",
    "ernie4_5", "hunyuan_v1_dense", "apertus", "arcee", "nemotron", "ministral3", "jais2",
    "hyperclovax", "exaone", "internlm3", "iquestcoder", "apertus1p5_text",
)  # fmt: skip
# computed once; transformers' dynamic_rope_update switches "dynamic" and "longrope" per call
# (served by PrefillRunner up to their original length: check_rope)
_STATIC_ROPE_TYPES = (None, "default", "linear", "llama3", "yarn", "proportional")

#: Continuous batching: the query buckets grow by this factor from the first: 32, 128, 512,
#: 2048. Coarse on purpose. The attention breaks run at the exact lengths, so padding costs
#: only in the dense layers, and a CB step is either decode (a few tokens per request: the
#: GEMMs read their weights whatever the row count) or a large prefill chunk (in the largest
#: bucket).
DEFAULT_BUCKET_FACTOR, DEFAULT_FIRST_BUCKET = 4, 32
#: ``max_batch_tokens`` of a CB manager whose config leaves it unset (the largest bucket).
DEFAULT_MAX_BATCH_TOKENS = 2048


def default_query_buckets(query_buckets: Any, max_batch_tokens: int, who: str) -> tuple[int, ...]:
    """The query-token buckets of continuous-batching steps: the given sizes (default: 32, 128,
    512, ..., a factor of 4 apart) below ``max_batch_tokens``, which is always the last.

    Sizes are validated like every bucket list (positive ints; no strings, floats or bools).

    Example::

        >>> default_query_buckets(None, 2048, "f"), default_query_buckets((8, 64), 256, "f")
        ((32, 128, 512, 2048), (8, 64, 256))
    """
    if query_buckets is None:
        sizes = geometric_buckets(DEFAULT_FIRST_BUCKET, DEFAULT_BUCKET_FACTOR, max_batch_tokens)
    else:
        sizes = validate_buckets(query_buckets, f"{who}: query_buckets")
    return tuple(s for s in sizes if s < max_batch_tokens) + (max_batch_tokens,)


def query_heads(config: Any) -> tuple[int, ...] | None:
    """Each layer's query heads, from the config: ``num_attention_heads_per_layer`` where the
    family sets a count per layer (Laguna), else ``num_attention_heads`` for every layer (None
    where the config names neither, or no layer count).

    Example::

        >>> from transformers import LlamaConfig
        >>> query_heads(LlamaConfig(num_hidden_layers=3, num_attention_heads=8))
        (8, 8, 8)
    """
    layers = getattr(config, "num_hidden_layers", None)
    per_layer = getattr(config, "num_attention_heads_per_layer", None)
    if per_layer is not None and layers is not None and len(per_layer) == layers:
        return tuple(int(count) for count in per_layer)
    heads = getattr(config, "num_attention_heads", None)
    return None if heads is None or layers is None else (heads,) * layers


def attention_heads(config: Any) -> tuple[tuple[int, int, int], ...] | None:
    """The distinct ``(query heads, key heads, head size)`` of a model's attention layers, from
    its config, in layer order (one triple unless the layers' query heads differ: Laguna); None
    where it names no query heads. The decode kernels compile once per triple.

    Example::

        >>> from transformers import LlamaConfig
        >>> config = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
        >>> attention_heads(config)
        ((8, 2, 32),)
    """
    q_heads = getattr(config, "num_attention_heads", None)
    if q_heads is None:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
    counts = query_heads(config) or (q_heads,)
    return tuple((count, kv_heads, head_dim) for count in dict.fromkeys(counts))


def layer_attention(config: Any) -> str:
    """Whether a model's layers attend to all their keys: ``"full"`` (every layer),
    ``"sliding"`` (every layer through a sliding window) or ``"mixed"``, from the config's
    ``layer_types`` where it has them, else from ``sliding_window``.

    Example::

        >>> from transformers import MistralConfig
        >>> windows = MistralConfig(sliding_window=256), MistralConfig(sliding_window=None)
        >>> [layer_attention(config) for config in windows]
        ['sliding', 'full']
    """
    types = getattr(config, "layer_types", None)
    if types:
        kinds = {"full" if t == "full_attention" else "sliding" for t in types}
        return kinds.pop() if len(kinds) == 1 else "mixed"
    return "full" if getattr(config, "sliding_window", None) is None else "sliding"


def resolve_attention(attention: str, dtype: torch.dtype, device: torch.device, who: str,
                      backend: str | None = None) -> str:  # fmt: skip
    """The attention kernel of an entry point: ``"flash"`` or ``"reference"``.

    ``"auto"`` is FlashAttention varlen (inside ATen; for one prefill prompt, HF's own causal
    SDPA call) on CUDA in bf16/fp16, else the exact per-sequence reference. With ``backend``
    (prefill passes its own) FlashAttention also needs it to be ``"cuda"``: the emulated
    backend reproduces CUDA graph semantics, not the kernels.
    """
    from .attention import flash_available

    allowed = ("auto", "flash", "reference")
    if attention not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise InputError(f"{who}: attention must be one of {choices}, got {attention!r}.")
    can_flash = flash_available(dtype, device) and backend in (None, "cuda")
    if attention == "flash" and not can_flash:
        raise UnsupportedModelError(
            f"{who}: attention={attention!r} needs the CUDA backend, bf16/fp16 weights and "
            f"torch's FlashAttention varlen kernel; use attention='reference'."
        )
    if attention == "auto":
        return "flash" if can_flash else "reference"
    return attention


def rope_types(config: Any) -> list:
    """Every RoPE type a config sets, once each: in ``rope_parameters`` and ``rope_scaling`` (one
    setting, or a dict of settings keyed by layer type, as Gemma 3's global and sliding layers
    have), ``None`` for a setting that names none.

    Example::

        >>> from transformers import LlamaConfig
        >>> rope_types(LlamaConfig(rope_parameters=dict(rope_type="dynamic", factor=2.0)))
        ['dynamic']
    """

    def walk(setting: Any):
        if not isinstance(setting, dict):
            return
        nested = [value for value in setting.values() if isinstance(value, dict)]
        if not nested or "rope_type" in setting or "type" in setting:
            yield setting.get("rope_type", setting.get("type"))
        for value in nested:  # per layer type
            yield from walk(value)

    names = ("rope_parameters", "rope_scaling")  # one dict under two names in transformers 5
    found = (t for name in names for t in walk(getattr(config, name, None)))
    return list(dict.fromkeys(found)) or [None]


def check_rope(model: Any, who: str) -> None:
    """Refuse RoPE the graphs cannot hold: static RoPE passes; ``dynamic`` and ``longrope``
    (which transformers switches per call from the longest sequence, on the host) pass for
    PrefillRunner, whose prompts each start at position 0, so that up to their original length
    (:func:`.rope.rope_position_limit`, longer prompts refused per call) they are static, where
    contract item 18 finds their modules (:func:`.rope.switched_rope_modules`); continuous
    batching refuses them, as any other type.

    Example::

        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64,
        ...     rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))
        >>> model = transformers.AutoModelForCausalLM.from_config(cfg)
        >>> check_rope(model, "PrefillRunner")  # served for prompts up to 64 tokens
        >>> check_rope(model, "f")
        Traceback (most recent call last):
        breakgraph.integrations.transformers.errors.UnsupportedModelError: f: rope_type ...
    """
    from .rope import rope_position_limit, switched_rope_modules

    kinds = [t for t in rope_types(model.config) if t not in _STATIC_ROPE_TYPES]
    if not kinds:
        return
    switched = all(t in SWITCHED_ROPE_TYPES for t in kinds)
    if switched and who == "PrefillRunner":
        found = switched_rope_modules(model)  # None: a module not laid out as the contract says
        held = any(isinstance(getattr(m, "rope_type", None), (str, dict)) for m in model.modules())
        if found or (found == [] and held):  # []: rotary modules that switch nothing (Gemma 3
            return  # without full-attention layers holds no RoPE of their type)
    if switched and who != "PrefillRunner" and rope_position_limit(model) is not None:
        raise UnsupportedModelError(
            f"{who}: rope_type {kinds[0]!r} keeps its frequencies only up to "
            f"{rope_position_limit(model)} positions, and a request's positions grow past that "
            f"as it decodes, where transformers switches them on the host per call; only static "
            f"RoPE ({', '.join(map(str, _STATIC_ROPE_TYPES[1:]))}) can be captured for it. "
            f"PrefillRunner serves this model for prompts up to that length."
        )
    unknown = next((t for t in kinds if t not in SWITCHED_ROPE_TYPES), kinds[0])
    raise UnsupportedModelError(
        f"{who}: rope_type {unknown!r} is not static RoPE (dynamic and longrope recompute their "
        f"frequencies from the live sequence length on the host; PrefillRunner serves them "
        f"up to their original length where it finds transformers' rotary modules as it knows "
        f"them); only static RoPE ({', '.join(map(str, _STATIC_ROPE_TYPES[1:]))}) can be captured."
    )


def check_model(model: Any, who: str = "PrefillRunner") -> None:
    """Reject models the graphs cannot serve correctly; ``who`` names the caller in messages.

    Example::

        >>> check_model(torch.nn.Linear(2, 2), "f")
        Traceback (most recent call last):
        breakgraph.integrations.transformers.errors.UnsupportedModelError: f: model type None ...
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{who}: model type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    if (
        isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
        or hasattr(getattr(model, "forward", None), "_torchdynamo_orig_callable")
        or getattr(model, "_compiled_call_impl", None) is not None  # nn.Module.compile(), in place
    ):
        raise UnsupportedModelError(
            f"{who}: the model is compiled with torch.compile; pass the uncompiled model "
            "(breakgraph captures it itself)."
        )
    causal_lm = causal_lm_class_name(model_type)
    if type(model).__name__ != causal_lm:
        raise UnsupportedModelError(
            f"{who}: {type(model).__name__} is not a causal LM (for {model_type!r} "
            f"that is {causal_lm}); breakgraph returns next-token logits from the LM head. "
            f"Load the model with AutoModelForCausalLM."
        )
    training = [name or "the model" for name, m in model.named_modules() if m.training]
    if training:  # a submodule too: its dropout would be left out of the graph
        raise UnsupportedModelError(
            f"{who}: the model is in training mode ({', '.join(training[:3])}"
            f"{', ...' if len(training) > 3 else ''}); call model.eval() first."
        )
    # HF's attention reads `is_causal` off each attention module (Gemma's
    # use_bidirectional_attention clears it); breakgraph's attention is always causal
    bidirectional = [n for n, m in model.named_modules() if getattr(m, "is_causal", 1) is False]
    if bidirectional:
        raise UnsupportedModelError(
            f"{who}: the model's attention is bidirectional (is_causal=False on "
            f"{bidirectional[0]}, as config.use_bidirectional_attention=True makes it), and "
            f"breakgraph's attention is causal; load the model without bidirectional attention."
        )
    check_rope(model, who)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise UnsupportedModelError(f"{who}: {name} is not supported.")
    check_head_norms(model, who)
    check_tp_heads(model, who)
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise UnsupportedModelError(f"{who}: all parameters must be on one device.")
    if devices == {torch.device("meta")}:
        raise UnsupportedModelError(
            f"{who}: the parameters are on the meta device and hold no data (a model built "
            f"under torch.device('meta') or offloaded); load its weights onto a device first."
        )


def check_head_norms(model: Any, who: str) -> None:
    """Refuse a tensor-parallel model whose qk-norm holds a weight row per head (Cohere's
    ``use_qk_norm``: ``(heads, head_dim)``) that the TP plan leaves whole while it shards the
    projections: each rank's share of the heads meets every head's weights, and the sharded
    model's own forward fails (stock transformers too)."""
    from breakgraph.distributed import tensor_parallel_group

    if tensor_parallel_group(model, who) is None:
        return
    from torch.distributed.tensor import DTensor

    for name, module in model.named_modules():
        weight = getattr(module, "weight", None) if name.endswith((".q_norm", ".k_norm")) else None
        if weight is not None and weight.ndim > 1 and not isinstance(weight, DTensor):
            raise UnsupportedModelError(
                f"{who}: under tensor parallelism each rank computes a share of the attention "
                f"heads, but {name} normalizes with a weight row for every head "
                f"({tuple(weight.shape)}, not sharded by the model's TP plan), so the sharded "
                f"model's own forward fails (stock transformers too). Serve it unsharded."
            )


def check_tp_heads(model: Any, who: str) -> None:
    """Refuse a tensor-parallel model whose TP plan splits the query, key or value projection
    by rows (``"colwise"``, not gathered) while its heads do not divide by the TP size: each
    rank then holds part of a head, and the sharded model's own forward fails (stock
    transformers too). Under breakgraph that was a raw view error ("shape '[1, 32, -1, 16]' is
    invalid") in the first warm-up, after which the model's process group was unusable; every
    rank refuses alike here, before anything runs."""
    heads = attention_heads(model.config)
    if heads is None or not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor

    size = next((p.device_mesh.size() for p in model.parameters() if isinstance(p, DTensor)), 1)
    plan = getattr(model, "tp_plan", None) or {}
    kv_heads = heads[0][1]  # every layer's (the query heads may differ per layer: Laguna)
    counts = [("q_proj", q) for q, _, _ in heads] + [("k_proj", kv_heads), ("v_proj", kv_heads)]
    for name, count in counts:
        split = [k for k, style in plan.items() if k.endswith(f"self_attn.{name}")
                 and style == "colwise"]  # fmt: skip
        if split and count % size:
            raise UnsupportedModelError(
                f"{who}: under tensor parallelism over {size} ranks the TP plan splits "
                f"{split[0]} by rows, but the model's layers have {count} "
                f"{'query' if name == 'q_proj' else 'key/value'} heads, which do not divide by "
                f"{size}: each rank would hold part of a head (the sharded model's own forward "
                f"fails). Use a TP size that divides the heads."
            )


def _rows(module: Any) -> int | None:
    """An embedding's ids or a head's logits: ``num_embeddings`` or ``out_features`` where
    the module has them (the logical size, also of a quantized or tensor-parallel weight,
    whose stored shape may be packed or a shard), else the rows of its 2-D weight; None
    where it has neither."""
    for name in ("num_embeddings", "out_features"):
        size = getattr(module, name, None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    weight = getattr(module, "weight", None)
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.ndim == 2 else None


def token_vocabulary(model: Any) -> int:
    """The token ids a prefill of ``model`` can embed, ``0 .. n-1``: ``config.vocab_size``, or
    the input embedding's rows where it has fewer (a model whose embedding was swapped or
    resized without its config). Capture draws ids from this range and a prompt is checked
    against it, so such a model prefills its embeddable ids and refuses the others by name,
    instead of failing at construction with torch's raw ``IndexError``.

    Example::

        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=4)
        >>> model = transformers.AutoModelForCausalLM.from_config(cfg)
        >>> model.model.embed_tokens = torch.nn.Embedding(100, 64)
        >>> token_vocabulary(model)
        100
    """
    vocab = model.config.get_text_config().vocab_size
    rows = _rows(model.get_input_embeddings())
    return vocab if rows is None else min(vocab, rows)


def check_sampled_tokens(model: Any, who: str) -> None:
    """Refuse generation from a model whose LM head scores more tokens than its input
    embedding holds: a sampled id past the embedding's rows is fed back as the next step's
    input and fails the lookup (torch's ``IndexError`` in the middle of serving; stock
    transformers too)."""
    rows, logits = _rows(model.get_input_embeddings()), _rows(model.get_output_embeddings())
    if rows is not None and logits is not None and logits > rows:
        raise UnsupportedModelError(
            f"{who}: the LM head scores {logits} tokens but the input embedding holds "
            f"{rows} rows (config.vocab_size={model.config.get_text_config().vocab_size}), so "
            f"a generated id from {rows} up cannot be fed back. Make them agree, e.g. "
            f"model.resize_token_embeddings({logits})."
        )


def check_step_compile(model: Any, config: Any, who: str) -> None:
    """Refuse a continuous-batching config that would make transformers ``torch.compile`` its
    step around breakgraph's graph replays: every request would fail in Inductor. transformers
    compiles with the CB config's ``varlen_compile_config`` or ``decode_compile_config``, else
    with the model config's ``compile_config`` (its fallback), or at a
    ``default_compile_level``."""
    fallback = getattr(model.config.get_text_config(), "compile_config", None)
    compiled = config.varlen_compile_config or config.decode_compile_config or fallback
    if compiled is not None or getattr(config, "default_compile_level", 0):
        raise UnsupportedModelError(
            f"{who}: torch.compile of the CB step (the ContinuousBatchingConfig's compile "
            f"configs, or the model config's compile_config, which transformers falls back "
            f"to) cannot be combined with breakgraph's graphs; pass enable_continuous_"
            f"batching(model, compile=True) for compiled graphs, or ContinuousBatchingConfig("
            f"use_cuda_graph=False) to compile eager steps."
        )


def check_async_batching(asked: Any, device: torch.device, forks: bool, who: str) -> None:
    """Refuse ``use_async_batching=True`` where breakgraph cannot serve it: on a CPU model
    (transformers overlaps host and device work with CUDA streams), and for a manager that
    forks its requests (``num_return_sequences`` above 1). Asynchronous batching schedules step
    N+1 before step N's update forks a request, so a request with children and one prompt token
    left can be alone in a step with no query token: transformers' own graphs pad such a step,
    breakgraph's steps are not padded, and transformers' sampling then indexes a token of an
    empty step (on a GPU, 19 of 121 forking scenarios of the CB fuzzer failed every request in
    flight). Left unset, such a manager's steps are synchronous.

    >>> check_async_batching(None, torch.device("cpu"), True, "f")  # unset: decided later
    """
    if asked and forks:
        raise UnsupportedModelError(
            f"{who}: asynchronous batching (use_async_batching=True) with "
            f"num_return_sequences above 1: transformers schedules the next step before it "
            f"forks a request, so a request with children can be alone in a step with no query "
            f"token, which transformers' own graphs pad and breakgraph's steps do not. Leave "
            f"use_async_batching unset (such a manager's steps are then synchronous) or pass "
            f"False."
        )
    if asked and device.type != "cuda":
        raise UnsupportedModelError(
            f"{who}: asynchronous batching (use_async_batching=True) needs a CUDA model "
            f"(transformers overlaps host and device work with CUDA streams); leave it "
            f"unset or False here."
        )


def eager_steps(config: Any, who: str) -> str | None:
    """Which steps of a CB manager run eagerly, from its ``ContinuousBatchingConfig``'s
    ``use_cuda_graph`` (transformers' ``(varlen, decode)`` pair: graphs for its varlen path,
    graphs for its decode fast path; a bool is both): None (graphs for every step: None, True),
    ``"all"`` (False), ``"mixed"`` (``(False, True)``: graphs for pure-decode steps only, every
    step with a longer query eager) or ``"decode"`` (``(True, False)``: pure-decode steps
    eager). Read before as its first flag alone, ``(False, True)`` gave no graphs at all.

    Example::

        >>> from types import SimpleNamespace as config
        >>> [eager_steps(config(use_cuda_graph=c), "f") for c in (None, False, (False, True))]
        [None, 'all', 'mixed']
    """
    choice = None if config is None else config.use_cuda_graph
    if isinstance(choice, (tuple, list)) and len(choice) == 2 and all(
        c is True or c is False for c in choice
    ):
        return {(True, True): None, (False, False): "all", (False, True): "mixed",
                (True, False): "decode"}[tuple(choice)]  # fmt: skip
    if choice is None or choice is True or choice is False:
        return "all" if choice is False else None
    raise InputError(
        f"{who}: ContinuousBatchingConfig.use_cuda_graph must be None, a bool or a "
        f"(varlen, decode) pair of bools, got {choice!r}."
    )


def check_paged_window(config: Any, who: str) -> None:
    """Refuse a one-token sliding window for continuous batching: transformers' paged cache
    takes a window of 1 for its mark of a full-attention layer (it reads every key of such a
    layer, while the step's lengths give it one key per query), so the keys would not match."""
    if layer_attention(config) != "full" and getattr(config, "sliding_window", None) == 1:
        raise UnsupportedModelError(
            f"{who}: sliding_window=1 is transformers' paged cache's mark of a full-attention "
            f"layer, so its continuous batching reads other keys than a one-token window "
            f"(stock transformers too); PrefillRunner serves the model."
        )


def check_paged_heads(model: Any, who: str) -> None:
    """Refuse continuous batching of a tensor-parallel model whose key/value projections
    gather their output: transformers' paged cache holds ``1/tp`` of the key heads per rank
    whenever ``k_proj`` and ``v_proj`` are in the TP plan, while such a projection (OLMo-2's
    ``colwise_gather_output``, for its qk-norm over all heads) gives every rank every head,
    so no key fits the cache (stock continuous batching fails every request too)."""
    from breakgraph.distributed import tensor_parallel_group

    plan = getattr(model, "tp_plan", None) or {}
    gathered = [key for key, style in plan.items() if key.endswith(("self_attn.k_proj",
                "self_attn.v_proj")) and "gather_output" in str(style)]  # fmt: skip
    if gathered and tensor_parallel_group(model, who) is not None:
        raise UnsupportedModelError(
            f"{who}: under tensor parallelism transformers' paged cache holds a share of the "
            f"key heads on each rank, but this model's TP plan gathers every head on every rank "
            f"({gathered[0]}: {plan[gathered[0]]!r}), so its keys do not fit the cache (stock "
            f"continuous batching fails too). PrefillRunner serves it under TP; continuous "
            f"batching serves it unsharded."
        )


def key_changed(model: Any, key: str, who: str) -> InputError:
    """The refusal of a capture or eager CB step whose model no longer holds ``key``, the
    attention key continuous batching installed (set to another while enabled): that key's
    attention would run without the paged cache, giving other tokens, silently."""
    return InputError(
        f"{who}: the model's attention implementation is {model.config._attn_implementation!r}, "
        f"set while continuous batching was enabled; its steps need {key!r} (another key "
        f"runs without the paged cache). Call model.set_attn_implementation({key!r}) to serve "
        f"again, or handle.disable() first and set it then."
    )


def weights_anchor(model: Any) -> tuple:
    """``(parameters, name, address)``: the parameter dict of the module that holds the model's
    first plain (not DTensor) parameter, its name there and its memory's address, for a runner
    to compare on every call (``parameters[name].data_ptr() != address``: one dict read, one
    C call). A graph reads the memory its weights had at capture, so a model moved since
    (``to()``, ``half()``, ``cuda()``) or whose parameter was replaced ran the old weights,
    silently (on CUDA, memory already given back). Looked up in the dict on every call, a
    replaced ``Parameter`` object is seen too. Weights copied in place keep their memory."""
    for name, parameter in model.named_parameters():
        if type(parameter.data) is torch.Tensor:
            owner, _, leaf = name.rpartition(".")
            return model.get_submodule(owner)._parameters, leaf, parameter.data_ptr()
    none = torch.empty(0)  # every parameter a shard (tensor parallelism): nothing to compare
    return {"": none}, "", none.data_ptr()


def moved_error(model: Any, dtype: torch.dtype, device: torch.device, who: str,
                rebuild: str = "Build a new runner for the model as it is now (close this one)",
                ) -> ReplayError:  # fmt: skip
    """The refusal of a call after :func:`weights_anchor` saw other memory; ``rebuild`` says
    how to get graphs of the model as it is now."""
    now = next(model.parameters())
    return ReplayError(
        f"{who}: the model's weights are no longer where its graphs read them: the model was "
        f"moved since the graphs were captured (captured {dtype} on {device}, now {now.dtype} "
        f"on {now.device}) or a parameter was replaced. {rebuild}; to change weights under "
        f"the graphs, copy them in place (param.copy_(new), model.load_state_dict(...))."
    )


def kept_weights(anchor: tuple | None, model: Any, who: str, rebuild: str) -> tuple:
    """``(addresses, dtype, device)``: every plain parameter's memory by name, as the graphs
    read it. None (nothing captured yet) takes it; else ``anchor`` is checked against ``model``
    (:func:`moved_error`, naming the first parameter moved or replaced). One read per
    parameter: for rare points (a CB manager's creation), not per step."""
    now = {name: parameter.data_ptr() for name, parameter in model.named_parameters()
           if type(parameter.data) is torch.Tensor}  # fmt: skip
    if anchor is None:
        first = next(model.parameters())
        return now, first.dtype, first.device
    addresses, dtype, device = anchor
    moved = next((name for name, address in addresses.items() if now.get(name) != address), None)
    if moved is not None:
        raise moved_error(model, dtype, device, who, f"The first: {moved}. {rebuild}")
    return anchor
