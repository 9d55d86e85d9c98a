"""The transformers contract: every transformers name breakgraph reads, next to its probe.

breakgraph supports a transformers release when the names below are there and behave as
described; support is decided by probing them (:func:`require`, :func:`supported`), never
by comparing version strings. The library and its tests use the same probes. Every other
module reaches transformers through this one (public extension points aside:
``AttentionInterface``, ``ExpertsInterface``, ``generate_batch`` and friends, which are
used where they are documented).

The contract, by feature (P = public API, I = internal name):

prefill
  1. P ``AttentionInterface.register``: the attention of every layer becomes an eager break.
  2. I ``config._attn_implementation`` (read) and P ``model.set_attn_implementation``.
  3. P ``ExpertsInterface.register``, ``model.set_experts_implementation``; I
     ``config._experts_implementation`` and ``model._can_set_experts_implementation``; I the
     experts class's original ``forward`` under ``__wrapped__`` (the eager loop); P
     ``ExpertsInterface()["grouped_mm"]`` and I how it treats an expert id equal to
     ``num_experts`` (transformers' expert-parallel "sentinel": the row goes to no expert and
     costs no GEMM work), with I the experts module's ``num_experts``, ``has_bias``,
     ``has_gate`` and weights (:func:`experts_shape`; a module without them keeps plain
     ``grouped_mm``). A release that indexed weights by such an id would fail loudly at
     capture (an index out of range); one that clamped it would route padding to the last
     expert (slower, still exact).
  4. I ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (which class is the causal LM of a model type).
 18. I RoPE that ``dynamic_rope_update`` switches per call (``"dynamic"``, ``"longrope"``;
     :func:`switched_rope`, for :mod:`.rope`): the rotary module's ``rope_type`` (a str, or a
     dict by layer type), its ``inv_freq`` buffer (``{layer_type}_inv_freq``) and
     ``original_inv_freq`` (``{layer_type}_original_inv_freq``), dynamic's
     ``original_max_seq_len`` and longrope's ``config.rope_parameters[...]
     ["original_max_position_embeddings"]`` (by layer type where keyed so); and that the
     decorator, found on the module's ``forward`` (through ``__wrapped__``), reads
     ``self.rope_type`` at each call and switches nothing for ``"default"``. Where any of it is
     not found, PrefillRunner refuses the model as it refuses any RoPE it cannot capture.
 19. P the ``s_aux`` keyword of an attention call (attention sinks, gpt-oss: served by every
     attention kernel) and I the attention module's ``sinks`` parameter it passes
     (:func:`has_attention_sinks`: continuous batching warms the decode kernels' sinks variant
     for such a model). A release that renamed the parameter would compile that variant in the
     first step that needs it (once, still exact); one that renamed the keyword would reach
     breakgraph's attention without sinks, which the gpt-oss tests would show.

continuous batching (transformers keeps its scheduler, paged cache, sampling and request
lifecycle; breakgraph takes over the model's forward for the CB steps only)
  5. P ``model.init_continuous_batching`` (wrapped on the model instance: every entry point,
     ``generate_batch``, the manager API, ``transformers serve``, goes through it) and the
     ``ContinuousBatchingConfig`` fields :data:`CB_CONFIG_FIELDS`.
  6. I the keyword arguments of one CB forward (``PagedAttentionArgs``): :data:`STEP_KWARGS`,
     with ``max_seqlen_*`` renamed ``max_length_*`` in 5.19.
  7. I ``PagedAttentionCache.update``: ``(key, value, layer_idx, read_index, write_index)``
     up to 5.18, ``(key, value, layer_idx, kwargs)`` from 5.19 (:func:`cache_read_write`).
  8. I ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` (replaced for enabled models
     through ``breakgraph.patches``: from 5.19 it refuses any attention key but its own).
  9. I ``model._cached_continuous_batching_manager`` with P
     ``destroy_cached_continuous_batching_manager``, P ``manager.is_running`` and P
     ``manager.pause`` (5.18 on; wrapped per manager where present, :mod:`.managers`).
 10. I ``manager.batch_processor.cache`` (which paged cache a manager steps with; read only
     for managers whose graphs are off).
 12. I the module global ``torch`` of ``transformers.generation.continuous_batching.
     input_outputs``, through which ``prepare_batch_tensors`` converts its index and id lists
     (``torch.tensor``): shown a view of torch whose ``tensor`` reads lists with numpy
     (:mod:`.index_lists`; optional: a release that converts otherwise is served as it is,
     :func:`index_lists_module` returns None).
 13. I one full-attention layer's cache rows (13, 15 and 16 are probed in
     :mod:`.compat_paged`, re-exported here), read in place by pure-decode steps
     (:func:`layer_kv_rows`; optional: where neither layout is found, or the rows are not
     ``[rows, Hkv, D]`` with contiguous rows, decode steps read through ``update`` as
     before): in 5.17 ``cache.layer_index_to_group_indices``, ``sliding_windows`` and
     ``cache.key_cache`` / ``value_cache``; in later releases ``cache.layer_to_allocator``, the
     allocator filed under ``"full_attention"`` in ``cache.cache_allocators``, and its
     ``index`` and ``_kv_token_views``. With it, inside a pure-decode break ``update`` is called
     with empty read indices (its write-only branch, in every tested release), so transformers
     still writes; a pure-decode *graph* (:mod:`.decode_graph`) writes the rows itself as
     ``update`` does in every tested release (``index_copy_`` at ``write_index[group]``).
 13b. I a sliding-window layer's rows and window, the same names (5.17: ``sliding_windows``
     not 1; later: ``"sliding_attention"``'s allocator, its ``sliding_window``; optional as 13):
     its read index holds each sequence's latest ``window - 1`` rows of a ring of ``window``,
     then a sentinel (every tested release; decode graphs only, ``decode_graph.ring_problem``).

 14. I ``initialization.ensure_decode_fast_path_is_available(config, cb_config,
     user_requested)``, which zeroes ``max_blocks_per_request`` unless the model's attention is
     flash_attn's: replaced while a model is enabled (:func:`decode_path_gate`), so that a
     model whose pure-decode steps breakgraph reads through a block table keeps transformers'
     decode fast path (optional: without it every step carries index lists, as before).
 15. I the block table of a pure-decode step (the ``block_table`` keyword of item 6,
     ``[groups, sequences, blocks]``): entry ``e`` of a sequence's ``b``-th block of
     ``P`` tokens holds its key ``b * P + o`` at cache row ``e * P + o`` of the rows of item 13
     (:func:`block_table_page`: ``P`` is 5.17's ``cache.block_size``; later, the
     full-attention allocator's ``tokens_per_page``, whose ``block_physical_stride`` is a
     multiple of it). Checked against transformers' own index lists by the tests.
 16. I ``PagedAttentionCache.fill_block_table(request_id, past_length, query_length,
     block_table)``, called once per request of a block-table step with that request's
     ``[groups, blocks]`` view of the table, and what it writes (:func:`block_table_writers`):
     in 5.17, row ``i`` of ``cache.group_cache_managers[i]`` (full attention: no
     ``sliding_window``) gets the first ``ceil((past + query) / block_size)`` ids of
     ``manager.block_table[request_id]``; later, row ``allocator.index`` of every
     ``cache.cache_allocators`` value (filed under ``"full_attention"``) gets all of
     ``allocator.block_table[request_id]`` times ``block_physical_stride // tokens_per_page``.
     Replaced while a model is enabled, for host tables only, by a numpy write of the same
     values (:func:`.block_table.install_fill`; optional: elsewhere transformers' own runs).
     Checked against transformers' own method by the tests.
 17. I ``ContinuousBatchingManager._create_batch_processor()``, which (re)sets the static
     device buffers on the generation thread's stream: wrapped on enabled models' managers
     (optional) so that those writes end before the first upload on transformers' copy stream.
 20. I ``PagedAttentionCache.extend_read_and_write_indices(request_id, past_length,
     query_length, read_index, write_index)``, called once per request of a step with index
     lists, and its row arithmetic (:func:`index_groups`: the groups in list order; in 5.17
     ``cache.group_cache_managers``' ``block_size``, ``sliding_window``, ``sentinel_index``,
     ``write_trash_index``, ``block_table``; later the ``cache.cache_allocators`` values'
     ``tokens_per_page`` and ``block_physical_stride`` instead of ``block_size``): replaced
     while a model is enabled by the same rows computed in numpy (:mod:`.index_rows`; optional;
     checked against transformers' method at run time, and by the tests).

serve (the ``transformers serve`` launcher, :mod:`.serve`)
 11. I ``transformers.cli.serving.model_manager.ModelManager`` (subclassed: the model must be
     given; up to 5.24 its ``_load_model`` enables breakgraph on the model it loads) and
     ``transformers.cli.serving.utils.GenerationState`` (subclassed up to 5.24: remembered, to
     stop its CB worker at exit), replaced in their modules for the server's life; from 5.25
     ``transformers.cli.serving.model_manager.ModelLoader`` instead (subclassed at module
     level in :mod:`.serve`, so that the copy pickled into each model's process finds it:
     ``_load_model`` enables breakgraph there); :func:`serve_layout` tells the two apart; P the
     CLI ``app`` (``transformers.cli.transformers``) and its dependency ``requests``.

Tested: the newest patch of every minor release from 5.17 to 5.24 (:data:`TESTED_VERSIONS`;
CI runs each; 5.25.0 tried).

Example::

    >>> from breakgraph.integrations.transformers import compat
    >>> compat.supported("prefill")
    True
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .compat_paged import (  # noqa: F401  (items 12, 13, 13b, 15, 16, 20: layouts)
    block_table_filler,
    block_table_page,
    block_table_writers,
    index_groups,
    index_list_builder,
    index_lists_module,
    layer_kv_rows,
    sliding_kv_rows,
)
from .errors import UnsupportedModelError

__all__ = [
    "TESTED_VERSIONS",
    "FEATURES",
    "problems",
    "supported",
    "require",
    "unsupported_message",
    "STEP_KWARGS",
    "StepKwargs",
    "cache_read_write",
]

#: The releases CI runs the suite on (`.ci/run` reads this list): the newest patch of every
#: minor release in the declared range, 5.17 to the newest of these.
TESTED_VERSIONS = ("5.17.0", "5.18.0", "5.19.0", "5.20.2", "5.21.1", "5.22.2", "5.23.0", "5.24.0")
FEATURES = ("prefill", "continuous_batching", "serve")


def _version() -> str:
    try:  # problems() says "not installed"; the messages name no version then
        import transformers
    except ImportError:
        return "(not installed)"
    return transformers.__version__


# -- 1-4: prefill -----------------------------------------------------------------------------
def attention_registry() -> Any:
    """1. ``transformers.AttentionInterface`` (public)."""
    from transformers import AttentionInterface

    return AttentionInterface


def attention_key(model: Any) -> str | None:
    """2. The model's attention implementation key (``config._attn_implementation``)."""
    return model.config._attn_implementation


def experts_registry() -> Any:
    """3. ``ExpertsInterface`` (public, ``transformers.integrations.moe``)."""
    from transformers.integrations.moe import ExpertsInterface

    return ExpertsInterface


def grouped_experts() -> Callable:
    """3. The function ``ExpertsInterface`` holds under ``"grouped_mm"`` (public: an instance
    of the registry, indexed by key)."""
    return experts_registry()()["grouped_mm"]


def has_attention_sinks(model: Any) -> bool:
    """19. Whether some attention module of ``model`` holds attention sinks (``sinks``)."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())


def experts_modules(model: Any) -> Iterator[Any]:
    """3. The model's experts modules that ``ExpertsInterface`` dispatches: those carrying the
    ``num_experts`` and ``has_bias`` that ``@use_experts_implementation`` sets (biased ones
    too, which :func:`experts_shape` leaves out)."""
    for module in model.modules():
        if isinstance(getattr(module, "num_experts", None), int) and hasattr(module, "has_bias"):
            yield module


def experts_shape(module: Any) -> tuple[int, list] | None:
    """3. What the padding mask's cost model reads of an experts module (the attributes
    ``@use_experts_implementation`` sets, and its weights): ``(num_experts, [gate_up or up,
    down])``, or None when the module has biases (``grouped_mm`` indexes them by expert id)
    or lacks one of them."""
    if getattr(module, "has_bias", True) is not False:
        return None
    experts = getattr(module, "num_experts", None)
    names = ("gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", "down_proj")
    weights = [getattr(module, name, None) for name in names]
    if not isinstance(experts, int) or not all(isinstance(w, torch.Tensor) for w in weights):
        return None
    return experts, weights


def experts_key(model: Any) -> str | None:
    """3. The model's experts implementation when it can be set, else None (dense models)."""
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if not (can_set and can_set()):
        return None
    return getattr(model.config, "_experts_implementation", None)


def eager_experts_forward(module: Any) -> Callable | None:
    """3. The experts class's own ``forward`` (the eager loop) that
    ``@use_experts_implementation`` wraps, or None."""
    return getattr(type(module).forward, "__wrapped__", None)


def causal_lm_class_name(model_type: str) -> str | None:
    """4. The ``*ForCausalLM`` class name of a model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


#: 18. The RoPE types transformers' ``dynamic_rope_update`` switches per call.
SWITCHED_ROPE_TYPES = ("dynamic", "longrope")


@functools.cache
def _rope_update_code() -> Any:
    """18. The code of ``dynamic_rope_update``'s wrapper, where it reads ``rope_type``; else
    None."""
    try:
        from transformers.modeling_rope_utils import dynamic_rope_update
    except ImportError:
        return None
    code = dynamic_rope_update(lambda self, x, position_ids: None).__code__
    return code if "rope_type" in code.co_names else None


def switched_rope(module: Any) -> list[tuple] | None:
    """18. What a rotary module whose frequencies ``dynamic_rope_update`` switches holds, per
    switched RoPE: ``(layer type or None, its inv_freq buffer's name, original frequencies,
    longest sequence that keeps them)``; ``[]`` for a module without one (no ``rope_type``, or
    only static types); None where the layout is not the known one (a type that merely
    contains ``"dynamic"`` among them: transformers switches it, breakgraph knows it not)."""
    rope_type = getattr(module, "rope_type", None)
    types = rope_type.items() if isinstance(rope_type, dict) else [(None, rope_type)]
    types = [(k, t) for k, t in types if isinstance(t, str) and ("dynamic" in t or t == "longrope")]
    if not types:
        return []
    forward, code = type(module).forward, _rope_update_code()
    while forward is not None and getattr(forward, "__code__", None) is not code:
        forward = getattr(forward, "__wrapped__", None)
    if forward is None or code is None:
        return None
    found = []
    for layer_type, kind in types:
        prefix = "" if layer_type is None else f"{layer_type}_"
        current = getattr(module, "_buffers", {}).get(f"{prefix}inv_freq")
        original = getattr(module, f"{prefix}original_inv_freq", None)
        if kind == "dynamic":
            limit = getattr(module, "original_max_seq_len", None)
        else:
            settings = getattr(getattr(module, "config", None), "rope_parameters", None)
            if layer_type is not None and isinstance(settings, dict):
                settings = settings.get(layer_type)
            limit = settings.get("original_max_position_embeddings") if isinstance(
                settings, dict) else None  # fmt: skip
        if kind not in SWITCHED_ROPE_TYPES or isinstance(limit, bool) or not (
            isinstance(limit, int) and limit > 0 and isinstance(current, torch.Tensor)
            and isinstance(original, torch.Tensor) and current.shape == original.shape
        ):  # fmt: skip
            return None
        found.append((layer_type, f"{prefix}inv_freq", original, limit))
    return found


def _probe_prefill() -> list[str]:
    found = []
    try:
        if not callable(getattr(attention_registry(), "register", None)):
            found.append("AttentionInterface.register is missing")
        from transformers import PreTrainedModel

        for name in ("set_attn_implementation", "get_decoder"):
            if not callable(getattr(PreTrainedModel, name, None)):
                found.append(f"PreTrainedModel.{name} is missing")
        if causal_lm_class_name("llama") is None:
            found.append("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES has no 'llama'")
    except ImportError as exc:
        found.append(f"an import failed ({exc})")
    return found


# -- 5-10: continuous batching ----------------------------------------------------------------
#: 5. The ``ContinuousBatchingConfig`` fields breakgraph reads or sets on its copy of a config.
CB_CONFIG_FIELDS = (
    "use_cuda_graph",
    "use_async_batching",
    "max_batch_tokens",
    "max_blocks_per_request",
    "varlen_compile_config",
    "decode_compile_config",
)
#: 5. Fields only some releases have; set when present.
CB_OPTIONAL_FIELDS = ("auto_switch_to_flash",)
#: 5. A block's tokens: ``page_size`` from 5.18 on (``block_size`` then a deprecated alias,
#: None by default), ``block_size`` before (``block_table.page_size`` reads them).
CB_PAGE_FIELDS = ("page_size", "block_size")


class StepKwargs:
    """6. The names of the CB forward's keyword arguments, resolved once per release."""

    input_ids = "input_ids"
    position_ids = "position_ids"
    cache = "cache"
    cu_q = "cu_seq_lens_q"
    cu_k = "cu_seq_lens_k"
    max_q = "max_length_q"  # "max_seqlen_q" before 5.19
    max_k = "max_length_k"  # "max_seqlen_k" before 5.19
    read_index = "read_index"
    write_index = "write_index"
    block_table = "block_table"
    logits_to_keep = "logits_to_keep"


STEP_KWARGS = StepKwargs()


@functools.lru_cache(maxsize=1)
def _step_kwargs_problem() -> str | None:
    from transformers.generation.continuous_batching import input_outputs

    names = set(getattr(input_outputs.PagedAttentionArgs, "__annotations__", {}))
    if "max_seqlen_q" in names:  # 5.17, 5.18
        STEP_KWARGS.max_q, STEP_KWARGS.max_k = "max_seqlen_q", "max_seqlen_k"
    wanted = ("input_ids", "position_ids", "cache", "cu_seq_lens_q", "cu_seq_lens_k",
              STEP_KWARGS.max_q, STEP_KWARGS.max_k, "read_index", "write_index",
              "block_table")  # fmt: skip
    missing = [name for name in wanted if name not in names]
    return f"PagedAttentionArgs lacks {missing}" if missing else None


@functools.lru_cache(maxsize=1)
def _update_takes_kwargs() -> bool | None:
    """7. True: ``update(key, value, layer_idx, kwargs)``; False: ``(..., read_index,
    write_index)``; None: neither."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    parameters = list(inspect.signature(PagedAttentionCache.update).parameters)[1:]
    if parameters[:4] == ["key_states", "value_states", "layer_idx", "kwargs"]:
        return True
    if parameters[:5] == ["key_states", "value_states", "layer_idx", "read_index", "write_index"]:
        return False
    return None


def cache_read_write(step: Any, key: torch.Tensor, value: torch.Tensor, layer: int,
                     layer_type: str, read: bool = True) -> tuple:  # fmt: skip
    """7. Write one layer's new keys and values into transformers' paged cache and read back
    every key row its sequences see.

    ``key``/``value`` are ``[1, Hkv, n, D]`` (the step's real tokens); ``step`` holds the CB
    forward's ``cache``, indices and key lengths. Returns ``(k, v, cu_k, max_k)`` with
    ``k``/``v`` as ``[rows, Hkv, D]`` and the layer's cumulative key lengths (device, int32)
    and longest key length (host int). With ``read=False`` the read indices passed are empty
    (``update``'s write-only branch: no gather) and ``k``/``v`` are the new rows only.
    """
    reads = step.read_index if read else step.no_reads()
    if step.update_takes_kwargs:
        kwargs = {
            "cu_seq_lens_k": step.cu_k,
            STEP_KWARGS.max_k: step.max_k,
            "read_index": reads,
            "write_index": step.write_index,
        }
        k, v = step.cache.update(key, value, layer, kwargs=kwargs)
        cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs[STEP_KWARGS.max_k]
        return k[0].transpose(0, 1), v[0].transpose(0, 1), cu_k, max_k
    k, v = step.cache.update(key, value, layer, reads, step.write_index)
    cu_k, max_k = step.cu_k, step.max_k
    if isinstance(cu_k, dict):
        cu_k, max_k = cu_k[layer_type], max_k[layer_type]
    return k, v, cu_k, max_k


def manager_class() -> Any:
    """8. ``ContinuousBatchingManager`` (see also 17)."""
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager,
    )

    return ContinuousBatchingManager


def batch_processor_factory() -> Callable | None:
    """17. ``ContinuousBatchingManager._create_batch_processor`` (None where it is missing)."""
    found = manager_class().__dict__.get("_create_batch_processor")
    return found if callable(found) else None


def cached_manager(model: Any) -> Any:
    """9. The persistent CB manager a model holds (``generate_batch(persistent_manager=True)``)."""
    return getattr(model, "_cached_continuous_batching_manager", None)


def manager_cache(manager: Any) -> Any:
    """10. The paged cache a manager's steps use, once its batch processor exists."""
    return getattr(getattr(manager, "batch_processor", None), "cache", None)


def decode_path_gate() -> tuple[Any, str] | None:
    """14. ``(module, name)`` of the decode-fast-path gate of the known signature, or None."""
    try:
        from transformers.generation.continuous_batching import initialization
    except ImportError:
        return None
    gate = getattr(initialization, "ensure_decode_fast_path_is_available", None)
    try:
        parameters = list(inspect.signature(gate).parameters)
    except (TypeError, ValueError):
        return None
    if parameters[:3] != ["config", "cb_config", "user_requested"]:
        return None
    return initialization, "ensure_decode_fast_path_is_available"


def _probe_continuous_batching() -> list[str]:
    found = []
    try:
        from transformers import ContinuousBatchingConfig, GenerationMixin

        for name in ("init_continuous_batching", "destroy_cached_continuous_batching_manager"):
            if not callable(getattr(GenerationMixin, name, None)):
                found.append(f"GenerationMixin.{name} is missing")
        fields = vars(ContinuousBatchingConfig())
        missing = [name for name in CB_CONFIG_FIELDS if name not in fields]
        if missing:
            found.append(f"ContinuousBatchingConfig has no {missing}")
        problem = _step_kwargs_problem()
        if problem:
            found.append(problem)
        if _update_takes_kwargs() is None:
            found.append("PagedAttentionCache.update has an unknown signature")
        manager = manager_class()
        for name in ("switch_to_cb_friendly_attn", "is_running"):
            if not callable(getattr(manager, name, None)):
                found.append(f"ContinuousBatchingManager.{name} is missing")
    except ImportError as exc:
        found.append(f"continuous batching cannot be imported ({exc})")
    return found


def serving() -> tuple:
    """11. ``(model_manager module, utils module, CLI app)`` of ``transformers serve``."""
    from transformers.cli.serving import utils
    from transformers.cli.transformers import app

    return serving_model_manager(), utils, app


def serving_model_manager() -> Any:
    """11. ``transformers.cli.serving.model_manager`` alone: what a model's process needs
    (5.25 on), without importing the CLI app there."""
    from transformers.cli.serving import model_manager

    return model_manager


def serve_layout(manager_module: Any) -> str | None:
    """11. Where ``transformers serve`` loads its models: ``"in process"`` (up to 5.24:
    ``ModelManager._load_model`` in the server's process), ``"model process"`` (5.25: each model
    in a ``spawn``ed process of its own, through a pickled copy of the server's ``ModelLoader``,
    whose ``_load_model`` loads it), or ``None`` (neither: not supported)."""
    if callable(getattr(manager_module.ModelManager, "_load_model", None)):
        return "in process"
    if callable(getattr(getattr(manager_module, "ModelLoader", None), "_load_model", None)):
        return "model process"
    return None


def _probe_serve() -> list[str]:
    found = list(_probe_continuous_batching())
    try:
        from transformers.utils.import_utils import is_serve_available

        if not is_serve_available():
            return [*found, "transformers' serving extras (fastapi, uvicorn, openai) are missing"]
        manager_module, state_module, _ = serving()
        if serve_layout(manager_module) is None:
            found.append("neither ModelManager._load_model nor ModelLoader._load_model exists")
        if not isinstance(getattr(state_module, "GenerationState", None), type):
            found.append("transformers.cli.serving.utils.GenerationState is missing")
    except ImportError as exc:  # requests: imported by the CLI, not installed by [serving]
        found.append(f"transformers' CLI cannot be imported ({exc})")
    return found


_PROBES = {
    "prefill": _probe_prefill,
    "continuous_batching": _probe_continuous_batching,
    "serve": _probe_serve,
}


# -- the gate ---------------------------------------------------------------------------------
@functools.cache
def problems(feature: str) -> tuple[str, ...]:
    """What the installed transformers lacks for ``feature`` (empty: supported).

    Example::

        >>> problems("prefill")
        ()
    """
    if feature not in _PROBES:
        raise ValueError(f"unknown feature {feature!r}; one of {FEATURES}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ("transformers is not installed",)
    return tuple(_PROBES[feature]())


def supported(feature: str) -> bool:
    """Whether the installed transformers has everything ``feature`` reads (the tests ask)."""
    return not problems(feature)


def require(feature: str, who: str) -> None:
    """Raise :class:`~.errors.UnsupportedModelError` unless ``feature`` is supported, naming
    the installed version, what is missing and the tested releases."""
    if found := problems(feature):
        raise UnsupportedModelError(unsupported_message(feature, who, found))


def unsupported_message(feature: str, who: str, found: tuple[str, ...]) -> str:
    """The message of :func:`require` (also what the serve launcher prints): the installed
    version, what is missing (``found``), the tested releases and the fix."""
    return (
        f"{who}: transformers {_version()} is not supported for {feature.replace('_', ' ')}: "
        f"{'; '.join(found)}. Tested releases: {', '.join(TESTED_VERSIONS)} (declared "
        f"range >=5.17,<5.25); install one of them."
    )


def clear_probes() -> None:
    """Forget the cached probe results (tests that swap a transformers name at run time)."""
    for probe in (problems, _step_kwargs_problem, _update_takes_kwargs, _rope_update_code):
        probe.cache_clear()


def update_takes_kwargs() -> bool:
    """7. This release's ``PagedAttentionCache.update`` signature (after :func:`require`)."""
    return bool(_update_takes_kwargs())


def step_kwargs() -> StepKwargs:
    """6. The CB forward's keyword names for this release (after :func:`require`)."""
    _step_kwargs_problem()
    return STEP_KWARGS
