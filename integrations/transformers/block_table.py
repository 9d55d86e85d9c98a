"""Pure-decode CB steps through transformers' block table: no per-key index lists.

Every CB step, transformers' preparation builds the step's paged-cache read indices as a
Python list with one int per cached key of every request (about 50,000 for 100 requests of
~500 keys) and converts it to a tensor: 62-67 % of a pure-decode step's preparation
(``benchmarks/cb_prep_profile``). For pure-decode steps transformers has a *decode fast path*
that skips those lists: it fills a block table instead (``[groups, sequences, blocks]``, one
int per cache block of every request) and passes ``block_table`` to the model; but it turns
that path on only for flash_attn's ``flash_attn_with_kvcache``.

breakgraph reads such steps itself. While a model is enabled, transformers' gate
(``ensure_decode_fast_path_is_available``, contract item 14) keeps the path on for that
model's managers where breakgraph's pure-decode graphs serve it (every layer full attention,
no tensor parallelism); any other config goes to transformers' own gate. A block-table step
then reaches :class:`~.cb_step.StepRunner` with empty index lists, and breakgraph derives the
indices on the device from the table, the positions and the key offsets (contract item 15:
key ``j`` of a sequence is at row ``table[j // P] * P + j % P``):

* :func:`write_slots`: each sequence's new key row (``n`` values; a decode graph runs it inside
  the graph, :meth:`.decode_graph.DecodeBuffers.write_rows`);
* :func:`read_slots`: every key row of the step, sequence after sequence (the exact count,
  after one sync: :meth:`.cb_step.CBStep.materialise` for the breaks, and the emulated
  backend's decode graphs). A CUDA decode graph needs no read rows: its Triton kernel reads
  the table itself (:func:`.paged_decode.paged_decode` with ``page``), so nothing is derived
  over the keys and nothing syncs.

Example::

    >>> import torch
    >>> table = torch.tensor([[4, 1], [2, 0]])    # sequence 0: blocks 4, 1; sequence 1: 2
    >>> cu_k = torch.tensor([0, 5, 7])             # 5 and 2 keys; blocks of 4 tokens
    >>> write_slots(table, torch.tensor([4, 1]), page=4)      # each sequence's last key
    tensor([4, 9])
    >>> read_slots(table, cu_k, page=4, rows=8)    # row 7 is past the keys: row 0
    tensor([16, 17, 18, 19,  4,  8,  9,  0])
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from breakgraph.patches import PatchSet

from . import compat

__all__ = ["fill_block_table", "install", "install_fill", "page_size", "read_slots", "write_slots"]


def write_slots(table: torch.Tensor, positions: torch.Tensor, page: int) -> torch.Tensor:
    """Cache row of each sequence's key at ``positions`` (``[n]``): ``table`` ``[n, blocks]``
    holds the sequences' block entries. int64, on ``table``'s device."""
    positions = positions.to(torch.long)
    blocks = table.gather(1, (positions // page).unsqueeze(1)).squeeze(1).to(torch.long)
    return blocks * page + positions % page


def read_slots(table: torch.Tensor, cu_k: torch.Tensor, page: int, rows: int) -> torch.Tensor:
    """The cache rows of every key of the ``n`` sequences of ``table`` ``[n, blocks]``, in
    order (sequence ``i``'s keys at ``cu_k[i]:cu_k[i + 1]``, ``cu_k`` ``[n + 1]``), padded
    with row 0 to ``rows`` values (``rows`` at least ``cu_k[n]``: an upper bound needs no
    device sync). int64, on ``table``'s device."""
    n = table.shape[0]
    row = torch.arange(rows, device=table.device)
    starts = cu_k[: n + 1].to(torch.long)
    seq = torch.searchsorted(starts[1:], row, right=True).clamp_(max=n - 1)
    key = (row - starts.index_select(0, seq)).clamp_(0, table.shape[1] * page - 1)
    entry = table[seq, key // page].to(torch.long)
    return torch.where(row < starts[n], entry * page + key % page, 0)


def forks(generation_config: Any) -> bool:
    """Whether a manager of ``generation_config`` forks its requests (``num_return_sequences``
    above 1): breakgraph then turns transformers' decode fast path off for it, as transformers'
    own gate does on a CPU or without flash_attn.

    Why: transformers' scheduler lets a decode-eligible request (one query token) skip the read
    budget of the step (a block-table step reads no index list), and decides whether the step
    *is* a block-table step only after scheduling each request. A request with children whose
    prompt has one token left (a shared prefix, or a chunk's remainder) is eligible, then
    scheduled with no token (it is forked first): the step becomes an index-list step whose
    reads were never budgeted. Forked children share their parent's blocks, so those reads pass
    the read-index storage (``num_pages + max_batch_tokens``) and the step fails every request
    ("The expanded size of the tensor ... must match the existing size"), where stock
    transformers on the same device, without the fast path, serves them.

    >>> from transformers import GenerationConfig
    >>> forks(GenerationConfig(do_sample=True, num_return_sequences=3)), forks(GenerationConfig())
    (True, False)
    """
    return (getattr(generation_config, "num_return_sequences", None) or 1) > 1


def install(patches: PatchSet, wants_block_table) -> bool:
    """Replace transformers' decode-fast-path gate (until ``patches`` restores it): a config
    for which ``wants_block_table(config)`` is true keeps ``max_blocks_per_request`` as
    given; any other goes to transformers' gate. False, and nothing replaced, where the probe
    does not find the gate (item 14)."""
    found = compat.decode_path_gate()
    if found is None:
        return False
    module, name = found
    original = getattr(module, name)

    def ensure_decode_fast_path_is_available(config: Any, cb_config: Any, user_requested: bool):
        if wants_block_table(config):
            return None
        return original(config, cb_config, user_requested)

    ensure_decode_fast_path_is_available.__wrapped__ = original
    patches.attribute(module, name, ensure_decode_fast_path_is_available)
    return True


#: Per paged cache, its :class:`_CacheFill`: looked up once per cache, not once per request.
_fills: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Host tables whose views a cache keeps: transformers fills one table per batch of inputs and
#: outputs, two with asynchronous batching; a cache given more forgets the views it kept
MAX_TABLES = 4


class _CacheFill:
    """What one paged cache's ``fill_block_table`` writes (contract item 16; ``writers`` is
    None where the layout is unknown) and the numpy views of the host tables it was given.

    transformers passes a fresh view of the same slot of the same table every step: its numpy
    view is kept (a ``.numpy()`` costs 1.0-1.7 µs, a sixth of the call) by the view's address,
    strides and dtype, its shape checked. A kept array holds its tensor, so no other tensor can
    take that address while it is kept; at most ``MAX_TABLES`` tables are held.
    """

    __slots__ = ("writers", "views", "tables")

    def __init__(self, cache: Any) -> None:
        self.writers = compat.block_table_writers(cache)
        self.views: dict = {}  # (address, strides, dtype) -> the numpy view
        self.tables: set = set()  # the storages those views are over

    def write(self, block_table: torch.Tensor, request_id: str, keys: int) -> bool:
        """Write ``request_id``'s block ids for ``keys`` keys into ``block_table``; False
        (for transformers' own error) where the cache does not hold the request."""
        key = (block_table.data_ptr(), block_table.stride(), block_table.dtype)
        target = self.views.get(key)
        if target is None or target.shape != block_table.shape:
            table = block_table.untyped_storage().data_ptr()
            if table not in self.tables and len(self.tables) >= MAX_TABLES:
                self.views.clear()  # new tables keep coming: hold none of the old ones
                self.tables.clear()
            self.tables.add(table)
            target = self.views[key] = block_table.numpy()
        for row, owner, page, scale in self.writers:
            ids = owner.block_table.get(request_id)
            if ids is None:
                return False
            if page:
                ids = ids[: -(-keys // page)]
            line = target[row, : len(ids)]
            line[:] = ids
            if scale != 1:
                line *= scale
        return True


def _fill_of(cache: Any) -> _CacheFill:
    try:
        return _fills[cache]
    except KeyError:
        fill = _fills[cache] = _CacheFill(cache)
        return fill
    except TypeError:  # not weak-referenceable: looked up every time
        return _CacheFill(cache)


def fill_block_table(original, cache: Any, request_id: str, past_length: int,
                     query_length: int, block_table: torch.Tensor) -> None:  # fmt: skip
    """``original(cache, request_id, past_length, query_length, block_table)`` (transformers'
    ``PagedAttentionCache.fill_block_table``) as one numpy write per layer group, where
    ``block_table`` (the request's ``[groups, blocks]`` view of the step's table) is in host
    memory and the cache's layout is known; anything else goes to ``original``.

    transformers fills the table request by request, each with two or three small tensor
    operations (``torch.tensor`` of the ids, a multiply, a copy): 23-24 µs per request on
    CI's host, about half of a pure-decode step's preparation (``benchmarks/cb_prep_profile
    --block-table``). The same values written through a numpy view of the host table cost a
    few µs (:class:`_CacheFill`). On CUDA, transformers' asynchronous batching fills a pinned
    host table (then copies it to the device at once); its synchronous batching fills the
    device table, which stays transformers' own.

    Example (a 5.17-style cache: one full-attention group, pages of 4 tokens)::

        >>> from types import SimpleNamespace
        >>> group = SimpleNamespace(block_size=4, block_table={"req": [7, 3, 9]})
        >>> cache = SimpleNamespace(group_cache_managers=[group])
        >>> table = torch.full((1, 4), -1, dtype=torch.int32)   # [groups, blocks]
        >>> fill_block_table(None, cache, "req", 4, 1, table)    # 5 keys: 2 blocks
        >>> table.tolist()
        [[7, 3, -1, -1]]
    """
    if block_table.is_cpu:
        fill = _fill_of(cache)
        keys = past_length + query_length
        if fill.writers is not None and fill.write(block_table, request_id, keys):
            return None
    return original(cache, request_id, past_length, query_length, block_table)


def install_fill(patches: PatchSet) -> bool:
    """Replace ``PagedAttentionCache.fill_block_table`` by :func:`fill_block_table` (until
    ``patches`` restores it). False, and nothing replaced, where the probe does not find it
    (item 16)."""
    cache_class = compat.block_table_filler()
    if cache_class is None:
        return False
    original = cache_class.__dict__["fill_block_table"]

    def filled(self, request_id: str, past_length: int, query_length: int,
               block_table: torch.Tensor) -> None:  # fmt: skip
        fill_block_table(original, self, request_id, past_length, query_length, block_table)

    filled.__wrapped__ = original
    filled.__name__ = filled.__qualname__ = "fill_block_table"
    patches.attribute(cache_class, "fill_block_table", filled)
    return True


def page_size(config: Any) -> int:
    """The tokens of one paged-cache block that ``config`` (a ``ContinuousBatchingConfig``)
    asks for (:data:`.compat.CB_PAGE_FIELDS`), 0 where neither field holds a positive int.

    >>> from types import SimpleNamespace
    >>> page_size(SimpleNamespace(page_size=128, block_size=None))
    128
    >>> page_size(SimpleNamespace(block_size=256)), page_size(SimpleNamespace())
    (256, 0)
    """
    for name in compat.CB_PAGE_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0
