"""transformers' paged-cache rows of a CB step computed in numpy: no Python int per key.

Every CB step that is not a block-table step, transformers' preparation asks its paged cache
for each request's read and write rows (``PagedAttentionCache.extend_read_and_write_indices``),
layer group by layer group, as Python lists built by Python loops: one int per cached key of
every request and group; a sliding-window group reads ``window - 1`` keys of every request
(511 loop turns for Gemma 3's window of 512) however long the request. On models with sliding
layers that is most of the step: Gemma-3-1B on transformers 5.17 (13 groups of 2 layers)
spent 28 ms of a 31 ms step preparing it on an H100 server's host, its device busy 28% of the
time (``breakgraph_tx_rows`` in ``docs/results/h100-cb-sliding-gemma3-1b-5.17.json``).

While continuous batching is enabled, breakgraph computes the same rows with a few numpy
operations per request and group (the request's blocks, expanded to their rows, then sliced:
:meth:`Group.rows`) and keeps them as arrays (:class:`RowChunks`) in transformers' index
lists' places; :class:`.index_lists.NumpyLists`, transformers' ``torch.tensor`` there,
concatenates them once per step. No list of ints is built or read.

The arithmetic is transformers' own, read from its caches (contract item 20,
:func:`~.compat.index_groups`): key ``j`` of a request is at row ``block * stride + j % page``
of block ``block_table[j // page]``; a sliding group's keys live in a ring of ``window``
slots (a key's slot: its position modulo ``window``), whose read rows are the latest
``window - 1`` keys then a sentinel per new token, and whose writes beyond the ring's
``window`` go to a trash row. It is checked, not trusted: the first :data:`CHECKS` calls of
every cache, each sliding group's first decode call and first longer one after its ring
wrapped, and one call in :data:`CHECK_EVERY` after that also run transformers' method and
compare; a difference turns the numpy rows off for that cache with a warning (that step keeps
transformers' values). Any request, layout or list the numpy path does not know goes to
transformers' method.

Example (one full-attention group, blocks of 4 tokens; a request of 5 cached keys and 1 new)::

    >>> from types import SimpleNamespace
    >>> owner = SimpleNamespace(block_table={"req": [7, 3]})
    >>> group = Group(owner, page=4, stride=4, window=None, sentinel=0, trash=0)
    >>> write, read = group.rows("req", past=5, query=1, reads=True)
    >>> [c.tolist() for c in write], [c.tolist() for c in read]
    ([[13]], [[28, 29, 30, 31, 12, 13]])
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np

from breakgraph.patches import PatchSet

from . import compat

__all__ = ["CHECKS", "CHECK_EVERY", "Group", "RowChunks", "install"]

logger = logging.getLogger(__name__)

#: Calls per cache checked against transformers' own method (besides the wrapped rings').
CHECKS = 4
#: Then one call in this many (a check costs what transformers' method costs: 1/64 of it).
CHECK_EVERY = 64


class RowChunks:
    """One layer group's read or write rows of a step: numpy arrays until converted.

    Stands where transformers keeps a Python list of ints: ``extend`` (transformers' own
    method still extends it with lists), ``len`` (the rows it holds) and iteration work as on
    that list; :meth:`array` joins the chunks (what :class:`.index_lists.NumpyLists` converts).

    >>> chunks = RowChunks([4, 5])
    >>> chunks.add(np.array([9]))
    >>> len(chunks), chunks.array().tolist(), list(chunks)
    (3, [4, 5, 9], [4, 5, 9])
    """

    __slots__ = ("chunks", "size")

    def __init__(self, values: Any = ()) -> None:
        self.chunks: list[np.ndarray] = []
        self.size = 0
        if len(values):
            self.extend(values)

    def add(self, chunk: np.ndarray) -> None:
        """Append the int64 rows ``chunk`` (kept as given: never written to afterwards)."""
        self.chunks.append(chunk)
        self.size += chunk.shape[0]

    def extend(self, values: Any) -> None:
        """Append ``values`` (a list of ints, as transformers' own method extends with)."""
        self.add(np.asarray(values, dtype=np.int64))

    def array(self) -> np.ndarray:
        """Every row, in order (int64)."""
        if len(self.chunks) == 1:
            return self.chunks[0]
        return np.concatenate(self.chunks) if self.chunks else np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        return iter(self.array().tolist())


class Group:
    """One layer group's row arithmetic (contract item 20): ``(owner, page, stride, window,
    sentinel, trash)`` of :func:`~.compat.index_groups`."""

    __slots__ = ("owner", "page", "stride", "window", "sentinel", "trash", "offsets", "one")

    def __init__(self, owner: Any, page: int, stride: int, window: int | None, sentinel: int,
                 trash: int) -> None:  # fmt: skip
        self.owner, self.page, self.stride, self.window = owner, page, stride, window
        self.sentinel, self.trash = sentinel, trash
        self.offsets = np.arange(page, dtype=np.int64)
        self.one = np.full(1, sentinel, dtype=np.int64)  # a decode step's sentinel

    def rows(self, request_id: str, past: int, query: int, reads: bool) -> tuple | None:
        """``(write chunks, read chunks or None)`` of a request with ``past`` cached keys and
        ``query`` new ones, as transformers' ``get_write_indices`` / ``get_read_indices``
        number them; None where the cache holds no block list long enough (transformers'
        method then raises its own error)."""
        ids = self.owner.block_table.get(request_id)
        window = self.window
        keys = past + query if window is None else min(past + query, window)
        if ids is None or len(ids) * self.page < keys:
            return None
        rows = (np.array(ids, dtype=np.int64)[:, None] * self.stride + self.offsets).ravel()
        if window is None:  # written after the cached keys, then every key is read
            return (rows[past : past + query],), ((rows[: past + query],) if reads else None)
        kept = min(query, window)  # a query longer than the ring keeps its last `window` keys
        start = (past + query - kept) % window
        end = start + kept
        write = (rows[start:end],) if end <= window else (rows[start:window], rows[: end - window])
        if query > kept:
            write = (np.full(query - kept, self.trash, dtype=np.int64), *write)
        if not reads:
            return write, None
        if past < window:  # the ring has not wrapped: its first `past` slots
            read = (rows[:past],)
        else:  # the latest window - 1 keys: every slot but the oldest one's, oldest first
            first = (past + 1) % window
            read = (rows[first:window], rows[: first - 1]) if first else (rows[: window - 1],)
        return write, (*read, self.one if query == 1 else np.full(query, self.sentinel))


class _CacheRows:
    """One paged cache's groups (None: served by transformers' method) and checks left."""

    __slots__ = ("groups", "checks", "calls", "unwrapped", "first_wrap", "__weakref__")

    def __init__(self, cache: Any) -> None:
        found = compat.index_groups(cache)
        self.groups = None if found is None else [Group(*g) for g in found]
        self.checks = CHECKS
        self.calls = 0
        # (sliding group, decode step) not yet checked on a wrapped ring: a one-token query
        # and a longer one each get a check
        self.unwrapped = {(i, decode) for i, g in enumerate(self.groups or ())
                          if g.window is not None for decode in (True, False)}  # fmt: skip
        self.first_wrap = min((g.window for g in self.groups or () if g.window is not None),
                              default=0)  # a shorter past wraps no ring: nothing to check


_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state_of(cache: Any) -> _CacheRows:
    try:
        return _caches[cache]
    except KeyError:
        state = _caches[cache] = _CacheRows(cache)
        return state
    except TypeError:  # not weak-referenceable: transformers' method serves it
        state = _CacheRows(None)
        return state


def _chunks(lists: list, group: int) -> RowChunks:
    """``lists[group]`` as :class:`RowChunks` (transformers gives empty lists each step)."""
    found = lists[group]
    if type(found) is not RowChunks:
        found = lists[group] = RowChunks(found)
    return found


def extend_indices(original, cache: Any, request_id: str, past_length: int, query_length: int,
                   read_index: list | None, write_index: list) -> None:  # fmt: skip
    """``original(cache, ...)`` (transformers' ``extend_read_and_write_indices``: append a
    request's rows to each group's ``write_index`` and, where not None, ``read_index``) with
    the rows computed by :meth:`Group.rows` where the cache's layout is known."""
    state = _state_of(cache)
    groups = state.groups
    if groups is None or len(write_index) != len(groups):
        return original(cache, request_id, past_length, query_length, read_index, write_index)
    reads = read_index is not None
    found = []
    for group in groups:
        rows = group.rows(request_id, past_length, query_length, reads)
        if rows is None:
            return original(cache, request_id, past_length, query_length, read_index, write_index)
        found.append(rows)
    if _due(state, past_length, query_length, reads):
        found = _checked(original, state, cache, request_id, past_length, query_length, found,
                         reads)  # fmt: skip
    for g, (write, read) in enumerate(found):
        target = _chunks(write_index, g)
        for chunk in write:
            target.add(chunk)
        if reads:
            target = _chunks(read_index, g)
            for chunk in read:
                target.add(chunk)


def _due(state: _CacheRows, past: int, query: int, reads: bool) -> bool:
    """Whether this call is compared with transformers' method (counts it)."""
    state.calls += 1
    if state.checks > 0:
        state.checks -= 1
        return True
    if state.calls % CHECK_EVERY == 0:
        return True
    if reads and state.unwrapped and past >= state.first_wrap:
        wrapped = {(i, decode) for i, decode in state.unwrapped
                   if decode == (query == 1) and past >= state.groups[i].window}  # fmt: skip
        state.unwrapped -= wrapped
        return bool(wrapped)
    return False


def _checked(original, state: _CacheRows, cache: Any, request_id: str, past: int, query: int,
             found: list, reads: bool) -> list:  # fmt: skip
    """``found``, or transformers' own rows (numpy rows then off for the cache) where they
    differ."""
    theirs_write = [[] for _ in found]
    theirs_read = [[] for _ in found] if reads else None
    original(cache, request_id, past, query, theirs_read, theirs_write)
    for g, (write, read) in enumerate(found):
        same = np.array_equal(np.concatenate(write), theirs_write[g]) and (
            not reads or np.array_equal(np.concatenate(read), theirs_read[g]))
        if not same:
            state.groups = None
            logger.warning(
                "breakgraph: the paged cache's rows computed in numpy differ from transformers' "
                "own (extend_read_and_write_indices, layer group %d, past %d, query %d): this "
                "cache's steps keep transformers' index lists (contract item 20)", g, past, query)
            reads_of = theirs_read or [None] * len(found)
            return [((np.asarray(w, dtype=np.int64),),
                     None if r is None else (np.asarray(r, dtype=np.int64),))
                    for w, r in zip(theirs_write, reads_of)]  # fmt: skip
    return found


def install(patches: PatchSet, lists_installed: bool) -> bool:
    """Replace ``PagedAttentionCache.extend_read_and_write_indices`` by
    :func:`extend_indices` (until ``patches`` restores it). False, and nothing replaced, where
    the probe does not find the method (item 20) or transformers' lists do not convert through
    :class:`.index_lists.NumpyLists` (``lists_installed`` false: item 12 not found)."""
    cache_class = compat.index_list_builder()
    if cache_class is None or not lists_installed:
        return False
    original = cache_class.__dict__["extend_read_and_write_indices"]

    def extend_read_and_write_indices(self, request_id: str, past_length: int,
                                      query_length: int, read_index: list | None,
                                      write_index: list) -> None:  # fmt: skip
        extend_indices(original, self, request_id, past_length, query_length, read_index,
                       write_index)  # fmt: skip

    extend_read_and_write_indices.__wrapped__ = original
    patches.attribute(cache_class, "extend_read_and_write_indices", extend_read_and_write_indices)
    return True
