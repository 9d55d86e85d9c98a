"""Where transformers' paged cache keeps a layer's rows and a request's block table, and how a
step's index lists are built and converted: items 12, 13, 13b, 15, 16 and 20 of the
transformers contract, whose list is :mod:`.compat`'s docstring (the single list of every
transformers name breakgraph reads). These probes read a paged cache's layout
(5.17's, and the allocators of later releases) and answer None where it is neither known one;
:mod:`.compat` re-exports them, and the rest of the integration calls them through it.

Example::

    >>> from breakgraph.integrations.transformers.compat import layer_kv_rows
    >>> layer_kv_rows(object(), 0) is None  # no known layout: read through update() instead
    True
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = [
    "layer_kv_rows",
    "sliding_kv_rows",
    "block_table_page",
    "block_table_filler",
    "block_table_writers",
    "index_groups",
    "index_list_builder",
    "index_lists_module",
]


def layer_kv_rows(cache: Any, layer: int) -> tuple | None:
    """13. ``(group, keys, values)`` of one full-attention layer of transformers' paged cache:
    ``keys``/``values`` are ``[rows, Hkv, D]`` tensors (each row contiguous) whose rows the
    step's ``read_index[group]`` and ``write_index[group]`` number; None where the cache has
    neither known layout or the layer is not a full-attention one."""
    found = _layer_rows(cache, layer)
    return found[:3] if found is not None and found[3] is None else None


def sliding_kv_rows(cache: Any, layer: int) -> tuple | None:
    """13b. ``(group, keys, values, window)`` of one sliding-window layer of transformers'
    paged cache, as :func:`layer_kv_rows` (None for a full-attention layer or an unknown
    layout). Its rows are a ring of ``window`` slots per sequence (a token's slot is its
    position modulo ``window``); a step reads each sequence's ``window - 1`` latest rows at
    most, then a sentinel where the new token goes: so a decode step may write the new row
    first (the slot it overwrites is older than every row it reads), then read in place."""
    found = _layer_rows(cache, layer)
    return found if found is not None and found[3] is not None else None


def _layer_rows(cache: Any, layer: int) -> tuple | None:
    """``(group, keys, values, window)`` of one layer (``window`` None: full attention)."""
    allocators = getattr(cache, "layer_to_allocator", None)
    if isinstance(allocators, dict):  # after 5.17: one allocator per attention type
        allocator = allocators.get(layer)
        views = getattr(allocator, "_kv_token_views", None)
        by_type = getattr(cache, "cache_allocators", None)  # 5.18's allocators: no layer_type
        if not isinstance(by_type, dict) or not isinstance(views, dict):
            return None
        if by_type.get("full_attention") is allocator:
            window = None
        elif by_type.get("sliding_attention") is allocator:
            window = getattr(allocator, "sliding_window", None)
            if not isinstance(window, int) or window < 1:
                return None
        else:
            return None
        found = (getattr(allocator, "index", None), *views.get(layer, (None, None)), window)
    else:  # 5.17: one cache tensor per layer of a group
        groups = getattr(cache, "layer_index_to_group_indices", None)
        windows = getattr(cache, "sliding_windows", None)
        keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
        if not isinstance(groups, dict) or layer not in groups or None in (windows, keys, values):
            return None
        window = windows[layer]  # 1: transformers' mark of a full-attention layer
        if not isinstance(window, int) or window < 1:
            return None
        group, index = groups[layer]
        found = (group, keys[index], values[index], None if window == 1 else window)
    group, keys, values, window = found
    if not isinstance(group, int) or not all(_rows(t) for t in (keys, values)):
        return None
    return found


def _rows(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 3 and t.stride(-1) == 1 and (
        t.stride(1) == t.shape[2]
    )


def block_table_page(cache: Any) -> int | None:
    """15. ``P``: tokens per block-table entry of the full-attention layers (None: unknown)."""
    allocators = getattr(cache, "cache_allocators", None)
    if isinstance(allocators, dict):  # after 5.17: keyed by attention type
        ca = allocators.get("full_attention")  # transformers names its allocators `ca`
        page, stride = getattr(ca, "tokens_per_page", 0), getattr(ca, "block_physical_stride", 0)
        known = isinstance(page, int) and isinstance(stride, int) and page > 0
        return page if known and stride % page == 0 else None
    page = getattr(cache, "block_size", None)  # 5.17
    return page if isinstance(page, int) and page > 0 else None


def block_table_filler() -> Any:
    """16. The paged cache class whose ``fill_block_table`` has the known signature, or None."""
    return _cache_class_with("fill_block_table", "block_table")


def _cache_class_with(method: str, *last: str) -> Any:
    """``PagedAttentionCache`` where its own ``method`` takes ``(self, request_id, past_length,
    query_length, *last)``, else None."""
    try:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
    except ImportError:
        return None
    try:
        parameters = list(inspect.signature(PagedAttentionCache.__dict__.get(method)).parameters)
    except (TypeError, ValueError):
        return None
    known = ["self", "request_id", "past_length", "query_length", *last]
    return PagedAttentionCache if parameters == known else None


def block_table_writers(cache: Any) -> list[tuple[int, Any, int, int]] | None:
    """16. What ``cache.fill_block_table`` writes, as ``(row, owner, page, scale)`` per layer
    group: row ``row`` of a request's table view gets ``owner.block_table[request_id]`` (its
    first ``ceil(keys / page)`` ids where ``page`` > 0, else all of them) times ``scale``.
    None where the layout is not one of the two known, or a group is not full attention."""
    writers = []
    allocators = getattr(cache, "cache_allocators", None)
    if isinstance(allocators, dict):  # after 5.17
        for kind, allocator in allocators.items():  # keyed by attention type
            row = getattr(allocator, "index", None)
            page = getattr(allocator, "tokens_per_page", None)
            stride = getattr(allocator, "block_physical_stride", None)
            ids = getattr(allocator, "block_table", None)
            if (kind != "full_attention"
                    or not all(isinstance(v, int) for v in (row, page, stride)) or page <= 0
                    or stride % page or not isinstance(ids, dict)):  # fmt: skip
                return None
            writers.append((row, allocator, 0, stride // page))
        return writers or None
    managers = getattr(cache, "group_cache_managers", None)  # 5.17
    if not isinstance(managers, list):
        return None
    for row, manager in enumerate(managers):
        page = getattr(manager, "block_size", None)
        if (hasattr(manager, "sliding_window") or not isinstance(page, int) or page <= 0
                or not isinstance(getattr(manager, "block_table", None), dict)):  # fmt: skip
            return None
        writers.append((row, manager, page, 1))
    return writers or None


def index_list_builder() -> Any:
    """20. The paged cache class whose ``extend_read_and_write_indices`` has the known
    signature, or None."""
    return _cache_class_with("extend_read_and_write_indices", "read_index", "write_index")


def index_groups(cache: Any) -> list[tuple[Any, int, int, Any, int, int]] | None:
    """20. How ``cache.extend_read_and_write_indices`` numbers each group's rows, as
    ``(owner, page, stride, window, sentinel, trash)`` in the order of its index lists: key
    ``j`` of a request is in block ``owner.block_table[request_id][j // page]``, at row
    ``block * stride + j % page``; ``window`` is None for full attention, else the ring's
    size (a key's slot is its position modulo ``window``), whose read lists end with
    ``sentinel`` once per new token and whose writes past the ring go to row ``trash``.
    None where the layout is neither known one."""
    allocators = getattr(cache, "cache_allocators", None)
    if isinstance(allocators, dict):  # after 5.17: keyed by attention type
        found = [(kind, a, getattr(a, "tokens_per_page", None),
                  getattr(a, "block_physical_stride", None)) for kind, a in allocators.items()]
    else:  # 5.17: one manager per group of layers
        managers = getattr(cache, "group_cache_managers", None)
        if not isinstance(managers, list):
            return None
        found = [("sliding_attention" if hasattr(m, "sliding_window") else "full_attention", m,
                  getattr(m, "block_size", None), getattr(m, "block_size", None))
                 for m in managers]  # fmt: skip
    groups = []
    for kind, owner, page, stride in found:
        sliding = kind == "sliding_attention"
        window = getattr(owner, "sliding_window", None) if sliding else None
        sentinel = getattr(owner, "sentinel_index", None) if sliding else 0
        trash = getattr(owner, "write_trash_index", None) if sliding else 0
        numbers = (page, stride, sentinel, trash) + ((window,) if sliding else ())
        if (kind not in ("full_attention", "sliding_attention")
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers)
                or page <= 0 or stride < page or (window is not None and window < 1)
                or not isinstance(getattr(owner, "block_table", None), dict)):  # fmt: skip
            return None
        groups.append((owner, page, stride, window, sentinel, trash))
    return groups or None


def index_lists_module() -> Any:
    """12. transformers' ``input_outputs`` module when ``ContinuousBatchingIOs.
    prepare_batch_tensors`` converts its lists with ``torch.tensor`` through the module's global
    ``torch`` (source text ``partial(torch.tensor``), still torch itself; else None."""
    try:
        from transformers.generation.continuous_batching import input_outputs
    except ImportError:
        return None
    if getattr(input_outputs, "torch", None) is not torch:  # another view installed already
        return None
    try:
        source = inspect.getsource(input_outputs.ContinuousBatchingIOs.prepare_batch_tensors)
    except (AttributeError, OSError, TypeError):
        return None
    return input_outputs if "partial(torch.tensor" in source else None
