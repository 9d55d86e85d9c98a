"""Pure-decode CB steps as whole graphs: the paged-cache write and read inside the capture.

A continuous-batching step through the query-token ladder (:mod:`.cb_step`) runs each
layer's paged-cache access and attention as an eager break. In a pure-decode step (one query
per sequence) that break is small, but there is one per layer: the host launches segment,
break, segment, ... in lockstep with the device, and transformers' preparation of the next
step cannot overlap the forward (the decode trace on ``docs/performance.md``). Here such a
step replays **one graph without breaks** (MoE experts breaks aside), so the forward costs
the host one launch.

What makes that possible is that, for a pure-decode step of ``n`` sequences in bucket ``B``,
every shape depends on ``B`` only:

* the new keys and values are written as transformers' ``update`` writes them
  (``index_copy_`` at the step's write index, contract item 13 says where the rows are);
  the ``B - n`` padded rows write sequence 0's row again, to sequence 0's slot (a duplicate
  write of equal values: the result does not depend on the order);
* attention reads the cache rows in place through the step's read index:
  :func:`.paged_decode.paged_decode` on CUDA (Triton), :func:`.paged_decode.paged_decode_dense`
  on the emulated backend (every row of the index, masked per sequence; fixed shapes);
  padded sequences have no keys and get zeros.

The step's indices are copied into static buffers (:class:`DecodeBuffers`) before the
replay, as the ids and positions are; a step that comes with transformers' block table
instead of index lists has its table copied in: the graph derives each sequence's write row
from it and the key offsets (:meth:`DecodeBuffers.write_rows`, :mod:`.block_table`), and on
CUDA the kernel reads the table itself (on the emulated backend the read rows are derived,
exactly, before the replay). A graph
bakes the cache tensors' addresses in, so a ladder belongs to one cache *layout* (the
tensors' addresses, shapes and strides): a manager
whose cache lies elsewhere gets a ladder of its own, one whose cache reuses the addresses
(the allocator often hands a new manager the old one's memory) reuses the graphs. The ladders
of the :attr:`DecodeGraphs.KEEP` most recently used layouts are kept, so managers serving in
turn do not capture again. Buckets are captured when a decode step first needs them, with
that step's own data (its writes are idempotent: the replay right after writes the same rows
again).

The read-index buffers are sized from the steps (twice the first decode step's keys, a power
of two), not from the cache, which may hold millions of rows; a step that outgrows them gets
buffers twice as large and new graphs.

A sliding-window layer's rows are a ring of ``window`` slots per sequence (contract item
13b): the step's read index lists the ``window - 1`` latest rows and then a sentinel for the
new token, and the row the new token overwrites is older than any of them; so the graph
writes first, puts the new rows where the sentinels are (:meth:`DecodeBuffers.window_reads`)
and reads the ring in place, from the group's own key offsets.

Not used (the step goes through the query-token ladder): under tensor parallelism, with a
cache layout contract items 13 and 13b do not know, where Triton does not
run on CUDA or cannot tile the heads, when a step's read index is empty (a first step of
one-token prompts), or after a capture or an allocation failed (``off`` says why; a warning
is logged once).

Example (what :class:`.cb_step.StepRunner` does for a pure-decode step; ``handle.
decode_graphs`` is this object)::

    graphs = DecodeGraphs(runner._record_tokens, q_heads=(4, 4), backend="emulated",
                          debug=False, who="enable_continuous_batching")
    if not graphs.replay(step, bucket, n, largest=runner.buckets[-1]):  # False: cannot run
        runner.tokens.replay(bucket, step, size=n)
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from breakgraph.errors import InputError
from breakgraph.ladder import GraphLadder, LadderStats
from breakgraph.ladder_stats import combined

from . import compat
from .block_table import read_slots, write_slots
from .paged_decode import (
    TABLE_WIDTH_MULTIPLE,
    fits,
    paged_decode,
    paged_decode_dense,
    query_rows,
    triton_available,
)
from .step_inputs import view

__all__ = ["DecodeBuffers", "DecodeGraphs", "cache_rows", "ring_problem"]

_FULL, _SLIDING = "full_attention", "sliding_attention"
logger = logging.getLogger("breakgraph")

#: transformers' paged cache -> {layer: compat.layer_kv_rows}: each layout looked up once per
#: cache, and held weakly, so a finished manager's cache is freed (the rows are views of it)
_LAYER_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: transformers' paged cache -> (every layer's rows, their layout key, the layer groups) or None
#: (held weakly)
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_rows(cache: Any, layer: int) -> tuple | None:
    """``compat.layer_kv_rows(cache, layer)``, looked up once per cache and layer."""
    rows = _LAYER_ROWS.get(cache)
    if rows is None:
        rows = _LAYER_ROWS[cache] = {}
    if layer not in rows:
        rows[layer] = compat.layer_kv_rows(cache, layer)
    return rows[layer]


class NotDecodable(Exception):
    """Raised inside a decode warm-up when a layer cannot run in the graph. The layers before it
    may have written the step's rows already: the same values the breaks then write again."""


class DecodeBuffers:
    """The decode graphs' static inputs beside the ids and positions, sized for the largest
    bucket: the key offsets ``[B + 1]`` and the source row of each write ``[B]``, and per layer
    group either the step's write index ``[B]`` and read index ``[capacity]`` (index-list
    steps) or, for block-table steps (``width`` > 0), the block table ``[B, width]``: each
    sequence's write row is derived from it inside the graph (:meth:`write_rows`), and the
    CUDA kernel reads it directly; the emulated backend's dense kernel still reads a read
    index (``reads``), derived exactly per step. A read index is sized from the steps
    (``capacity`` rows; :func:`.paged_decode.paged_decode_dense` reads all of it), not from the
    cache, which may hold millions of rows."""

    def __init__(self, groups, largest: int, capacity: int, device: torch.device,
                 width: int = 0, page: int = 0, reads: bool = True,
                 kinds: dict | None = None) -> None:  # fmt: skip
        self.width, self.page = width, page if width else 0
        # each group's attention type (full unless said): which key offsets its layers read
        self.kinds = {group: (kinds or {}).get(group, _FULL) for group in groups}
        self.capacity = capacity if reads or not width else 0
        with torch.inference_mode(False):
            zeros = lambda *shape, dtype=torch.long: {  # noqa: E731
                g: torch.zeros(*shape, dtype=dtype, device=device) for g in groups}
            self.write = {} if width else zeros(largest)
            self.read = zeros(capacity) if self.capacity else {}
            # padded to a multiple of TABLE_WIDTH_MULTIPLE: the kernel paged_decode.warm_up
            # compiled before serving (extra columns are never read: keys end first)
            padded = -(-width // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
            self.table = zeros(largest, padded, dtype=torch.int32) if width else {}
            # the key offsets per attention type (the sliding-window layers' count fewer keys)
            self.cu_k = {kind: torch.zeros(largest + 1, dtype=torch.int32, device=device)
                         for kind in dict.fromkeys(self.kinds.values())}  # fmt: skip
            self.source = torch.zeros(largest, dtype=torch.long, device=device)
            self.iota = torch.arange(largest + 1, dtype=torch.long, device=device)
            # the key offsets' gather index for (n, bucket): [0, 1, .., n, n, .., n]
            self.pad = torch.zeros(largest + 1, dtype=torch.long, device=device)
        self._source_for: tuple[int, int] | None = None  # (n, bucket) source and pad hold
        self._views: dict[tuple, torch.Tensor] = {}  # the buffers' views a step copies into

    def fill(self, step: Any, n: int, bucket: int, page: int = 0, rows: int = 0) -> None:
        """Copy the live step's indices in (device copies, no sync; every read index fits):
        an index-list step's write and read indices, a block-table step's table (and, for
        the emulated backend, its ``rows`` read rows, derived from the table: blocks of
        ``page`` tokens, :mod:`.block_table`), and the key offsets (one gather, padding
        included, through a static index rewritten where the step's size changed, like the
        write source rows). The views it copies into are made once
        (:func:`.step_inputs.view`): views only, so the cache owns no device memory."""
        views = self._views
        for kind in self.cu_k:
            cu_k = _offsets(step, kind)
            if cu_k.shape[0] <= n:  # before any copy; on CUDA the gather would assert there
                raise InputError(f"breakgraph decode graphs: the step's key offsets hold "
                                 f"{cu_k.shape[0]} entries for {n} sequences; expected at "
                                 f"least {n + 1}")  # fmt: skip
        if self._source_for != (n, bucket):  # static buffers, rewritten in stream order
            self.source[:n].copy_(self.iota[:n])
            self.source[n:bucket].zero_()
            torch.clamp(self.iota[: bucket + 1], max=n, out=self.pad[: bucket + 1])
            self._source_for = (n, bucket)
        for group, write in self.write.items():  # index-list steps
            live = step.write_index[group]
            index = step.read_index[group]
            self.read[group][: index.shape[0]].copy_(index)
            write[:n].copy_(live)
            if n < bucket:  # padded rows: sequence 0's slot again
                write[n:bucket].copy_(live[:1].expand(bucket - n))
        for group, table in self.table.items():  # block-table steps
            live = step.table[group, :n]
            view(views, (group, n), lambda t=table: t[:n, : self.width]).copy_(live)
            if self.read:
                self.read[group][:rows].copy_(read_slots(live, _offsets(step, _FULL), page, rows))
        # the key offsets, those of the padded sequences (no keys) repeating the last: one
        # gather per attention type through the pad index (its bounds checked first)
        index = view(views, ("pad", bucket), lambda: self.pad[: bucket + 1])
        for kind in self.cu_k:
            cu_k = _offsets(step, kind)
            offsets = view(views, (kind, bucket), lambda k=kind: self.cu_k[k][: bucket + 1])
            if cu_k.dtype == offsets.dtype and cu_k.device == offsets.device:
                torch.index_select(cu_k, 0, index, out=offsets)
            else:  # not transformers' int32 offsets on the model's device: a temporary
                offsets.copy_(cu_k.to(offsets.device).index_select(0, index))

    def write_rows(self, group: Any, bucket: int) -> torch.Tensor:
        """Each sequence's write row ``[bucket]`` from the table and the key offsets alone (run
        inside the graph, so nothing is derived on the host per step): a sequence's new key
        is its last, at position ``keys - 1``; a padded sequence (no keys) writes sequence 0's
        slot again, as the index-list path does.

        Example (pages of 4 tokens; 6 keys in blocks 3, 1 and 1 key in block 2; bucket 4)::

            >>> from types import SimpleNamespace
            >>> buffers = DecodeBuffers((0,), 4, 0, torch.device("cpu"), width=2, page=4,
            ...                         reads=False)
            >>> table = torch.tensor([[[3, 1], [2, 0]]], dtype=torch.int32)
            >>> step = SimpleNamespace(table=table, cu_k=torch.tensor([0, 6, 7]))
            >>> buffers.fill(step, 2, 4, page=4)
            >>> buffers.write_rows(0, 4).tolist()  # key 5 in block 1, key 0 in block 2, padding
            [5, 8, 5, 5]
        """
        cu_k = self.cu_k[_FULL]
        keys = cu_k[1 : bucket + 1] - cu_k[:bucket]
        slots = write_slots(self.table[group][:bucket], (keys - 1).clamp_(min=0), self.page)
        return torch.where(keys > 0, slots, slots[:1])

    def window_reads(self, group: Any, bucket: int) -> torch.Tensor:
        """A sliding-window group's read index with each sequence's new row in place of the
        sentinel transformers puts last in its part (contract item 13b; run inside the graph,
        after the new rows are written). A padded sequence (no keys) targets sequence 0's
        entry with sequence 0's row, as its write does: equal values, whatever the order.

        Example (window 4: a sequence of 3 cached keys and one of none; bucket 3)::

            >>> from types import SimpleNamespace
            >>> kinds = {0: "sliding_attention"}
            >>> buffers = DecodeBuffers((0,), 3, 8, torch.device("cpu"), kinds=kinds)
            >>> step = SimpleNamespace(cu_k={"sliding_attention": torch.tensor([0, 4, 5])},
            ...                        read_index=[torch.tensor([5, 6, 7, -1, -1])],
            ...                        write_index=[torch.tensor([4, 9])])
            >>> buffers.fill(step, 2, 3)
            >>> buffers.window_reads(0, 3)[:5].tolist()
            [5, 6, 7, 4, 9]
        """
        cu_k, write = self.cu_k[self.kinds[group]], self.write[group][:bucket]
        ends = cu_k[1 : bucket + 1].long() - 1
        ends = torch.where(cu_k[1 : bucket + 1] > cu_k[:bucket], ends, ends[:1])
        return self.read[group].index_copy_(0, ends, write)


class _LayoutGraphs:
    """The decode graphs of one cache layout: a ladder and the static buffers it baked in."""

    __slots__ = ("ladder", "buffers")

    def __init__(self, ladder: GraphLadder, buffers: DecodeBuffers) -> None:
        self.ladder, self.buffers = ladder, buffers


class DecodeGraphs:
    """Pure-decode steps of one model as graphs without attention breaks (see the module).

    ``record(bucket)`` runs the decoder over the bucket's static ids and positions (the
    query-token ladder's own record function); while it is captured here, the model's
    attention calls :meth:`attention` instead of creating a break. Graphs are kept for the
    :data:`KEEP` most recently used cache layouts (managers serving in turn keep theirs); on
    the emulated backend, whose graphs hold the cache, a layout's graphs go with its cache.
    """

    #: cache layouts whose graphs are kept (least recently used released first)
    KEEP = 4

    def __init__(self, record: Callable[[int], Any], q_heads: Sequence[int], backend: str,
                 debug: bool, who: str) -> None:  # fmt: skip
        # each layer's query heads (Laguna's differ per layer; the kernel tiles each count)
        self.record, self.q_heads, self.num_layers = record, tuple(q_heads), len(q_heads)
        self.backend, self.debug, self.who = backend, debug, who
        self.off: str | None = None  # why this model's decode steps never run here
        self.fallbacks: dict[str, int] = {}  # decode steps that took the break path, by reason
        self.layouts = 0  # cache layouts captured for (one ladder each)
        self.regrowths = 0  # new ladders for larger read-index buffers (same layout)
        self._graphs: OrderedDict[tuple, _LayoutGraphs] = OrderedDict()  # layout key -> graphs
        self._past = LadderStats()  # the counters of released ladders
        self._dead: list[tuple] = []  # layouts whose cache was freed (emulated backend)
        self._layers: dict[int, tuple] = {}  # layer -> (group, keys, values), while capturing
        self.buffers: DecodeBuffers | None = None  # the capturing layout's, while capturing
        # rows derived inside the graph once per group and pass, while capturing: a block-table
        # step's write rows (group -> rows), a sliding group's read index (("read", group) -> it)
        self._derived: dict = {}

    @property
    def stats(self) -> LadderStats:
        """Captures and replays per bucket, summed over every cache layout's ladder."""
        # a list first: another thread may read the stats while a step moves its layout to the
        # end or captures a new one (iterating the dict meanwhile raises)
        live = [graphs.ladder.stats for graphs in list(self._graphs.values())]
        return combined(*live, self._past)  # a copy: the caller may keep it

    @property
    def held(self) -> int:
        """How many cache layouts have graphs now."""
        return len(self._graphs)

    def replay(self, step: Any, bucket: int, n: int, largest: int) -> bool:
        """Run the pure-decode ``step`` (``n`` sequences) in ``bucket``'s decode graph, capturing
        it first if needed; False (nothing done) where it cannot run here."""
        if self.off is not None:
            return False
        while self._dead:  # a freed cache's layout: every graph of it
            dead = self._dead.pop()
            for key in [key for key in self._graphs if key[0] == dead]:
                self._release(key)
        layout = self._layout(step.cache)
        if layout is None:
            return self._fallback("cache layout unknown")
        layers, key, groups, page, kinds = layout
        width, reads = 0, self.backend != "cuda"  # the CUDA kernel reads a table itself
        if step.table is not None:
            if page is None or _SLIDING in kinds.values():
                return self._fallback("block-table layout unknown")
            width = step.table.shape[-1]
            if reads:  # host memory: the exact count (the dense kernel reads every row)
                rows = int(_offsets(step, _FULL)[n])
            else:  # no rows to read, no sync: at least the new key of every sequence
                rows = n
        else:  # every group's rows; an empty index: a first step of one-token prompts
            rows = 0
            for group in groups:
                if (size := step.read_index[group].shape[0]) == 0:
                    return self._fallback("nothing cached yet (empty read index)")
                rows = max(rows, size)
        key = (key, width, page if width else 0)  # tables and read indices: their own graphs
        graphs = self._graphs.get(key)
        if graphs is None or rows > graphs.buffers.capacity > 0:  # new, or more keys to read
            if graphs is None and (problem := self._kernel_problem(layers)) is not None:
                self.off = problem
                return False
            if graphs is None and (problem := ring_problem(step, n, kinds)) is not None:
                self.off = problem  # checked once per layout (a capture follows: it syncs)
                return False
            try:
                graphs = self._new_graphs(key, layers, groups, largest, _capacity(rows),
                                          width, page, reads, kinds)  # fmt: skip
            except Exception as exc:  # e.g. out of memory: the breaks serve the step
                return self._turn_off("static buffers failed", exc)
        self._graphs.move_to_end(key)
        graphs.buffers.fill(step, n, bucket, page, rows)
        if bucket not in graphs.ladder.buckets:
            step.decode, self._layers, self.buffers = self, layers, graphs.buffers
            try:
                graphs.ladder.capture(
                    [bucket], self._record, warm_up=self._record, context=lambda size: step,
                    collect_garbage=False,
                )  # fmt: skip
            except NotDecodable as exc:
                self.close()
                self.off = str(exc)
                return False
            except Exception as exc:  # the breaks serve the step; say why, once, and stay off
                return self._turn_off("capture failed", exc)
            finally:  # nothing of the cache held past the capture
                step.decode, self._layers, self.buffers = None, {}, None
        graphs.ladder.replay(bucket, step, size=n)
        return True

    def attention(self, layer: int, query, key, value, scaling: float, window,
                  sinks=None) -> torch.Tensor:  # fmt: skip
        """One layer's decode attention inside the graph (the model's attention function calls
        it while a decode graph is captured): write the new rows, read every sequence's rows
        in place. ``query`` ``[1, Hq, B, D]``, ``key``/``value`` ``[1, Hkv, B, D]``; returns
        ``[B, Hq, D]``. ``sinks``: the layer's attention sinks (``[Hq]``), or None. A
        sliding-window layer (``window``) reads its ring's rows (contract item 13b): at most
        ``window - 1`` cached rows and the new one, the window itself."""
        rows = self._layers.get(layer)
        if rows is None or window != rows[3] or query.shape[1] != self.q_heads[layer]:
            raise NotDecodable(f"layer {layer}'s rows are not known for a window of {window} "
                               f"and {query.shape[1]} query heads")  # fmt: skip
        group, keys, values, _ = rows
        bucket = query.shape[2]
        buffers = self.buffers
        if buffers.width:  # a block-table step: derived once per group in the graph
            if group not in self._derived:
                self._derived[group] = buffers.write_rows(group, bucket)
            write = self._derived[group]
        else:
            write = buffers.write[group][:bucket]
        source = buffers.source[:bucket]
        keys.index_copy_(0, write, key[0].transpose(0, 1).index_select(0, source))
        values.index_copy_(0, write, value[0].transpose(0, 1).index_select(0, source))
        q = query_rows(query)
        cu_k = buffers.cu_k[buffers.kinds[group]][: bucket + 1]
        if buffers.width and not buffers.read:  # CUDA: the kernel reads the table itself
            return paged_decode(q, keys, values, buffers.table[group], cu_k, scaling,
                                page=buffers.page, sinks=sinks)  # fmt: skip
        if window is None:
            read = buffers.read[group]
        else:  # the sentinels replaced by the new rows, once per group and pass
            if ("read", group) not in self._derived:
                self._derived["read", group] = buffers.window_reads(group, bucket)
            read = self._derived["read", group]
        if self.backend == "cuda":
            return paged_decode(q, keys, values, read, cu_k, scaling, sinks=sinks)
        return paged_decode_dense(q, keys, values, read, cu_k, scaling, sinks=sinks)

    def close(self) -> None:
        """Release every layout's graphs and buffers (the counters stay)."""
        for key in list(self._graphs):
            self._release(key)

    # -- internals ------------------------------------------------------------------------------
    def _layout(self, cache: Any) -> tuple | None:
        """``(layers, key, groups, block-table page, each group's attention type)`` of
        ``cache`` (looked up once per cache), or None. ``layers``: ``{layer: (group, keys,
        values, window)}``, ``window`` None for a full-attention layer."""
        try:
            return _LAYOUTS[cache]
        except KeyError:
            pass
        layers = {layer: _decode_rows(cache, layer) for layer in range(self.num_layers)}
        found = None
        kinds = {}  # group -> attention type; a group of both kinds is not a known layout
        for group, _, _, window in filter(None, layers.values()):
            kind = _FULL if window is None else _SLIDING
            kinds[group] = kind if kinds.get(group, kind) == kind else None
        if None not in layers.values() and None not in kinds.values():
            groups = tuple(kinds)
            found = (layers, _layout_key(layers), groups, compat.block_table_page(cache), kinds)
            if self.backend != "cuda":  # these graphs hold the cache: release them with it
                weakref.finalize(cache, self._dead.append, found[1])
        _LAYOUTS[cache] = found
        return found

    def _kernel_problem(self, layers: dict[int, tuple]) -> str | None:
        """Why the attention kernel cannot run these layers (checked before anything runs)."""
        _, keys, _, _ = next(iter(layers.values()))
        return self.kernel_problem(keys.shape[1], keys.shape[2], keys.device)

    def kernel_problem(self, kv_heads: int, head_dim: int, device: torch.device) -> str | None:
        """Why the attention kernel cannot run ``kv_heads`` key heads of size ``head_dim`` on
        ``device`` (None: it can)."""
        if self.backend != "cuda":
            return None  # paged_decode_dense runs any heads
        if not triton_available(device):
            return "Triton is not available"
        for q_heads in dict.fromkeys(self.q_heads):
            if not fits(q_heads, kv_heads, head_dim):
                return (f"the Triton decode kernel cannot tile {q_heads} query heads over "
                        f"{kv_heads} key heads of size {head_dim}")  # fmt: skip
        return None

    def _record(self, bucket: int) -> Any:
        """``record(bucket)``, each pass (warm-up, capture) deriving its own rows."""
        self._derived = {}
        try:
            return self.record(bucket)
        finally:
            self._derived = {}

    def _new_graphs(self, key: tuple, layers: dict[int, tuple], groups: tuple, largest: int,
                    capacity: int, width: int = 0, page: int = 0, reads: bool = True,
                    kinds: dict | None = None) -> _LayoutGraphs:  # fmt: skip
        """Graphs for a new cache layout, or larger buffers for one (its old graphs baked the
        old addresses in: released, and buckets are captured again when needed)."""
        if key in self._graphs:
            self.regrowths += 1
            self._release(key)
        else:
            self.layouts += 1
            while len(self._graphs) >= self.KEEP:
                self._release(next(iter(self._graphs)))
        device = next(iter(layers.values()))[1].device
        buffers = DecodeBuffers(groups, largest, capacity, device, width, page, reads, kinds)
        ladder = GraphLadder(backend=self.backend, debug=self.debug, on_miss="eager",
                             who=f"{self.who} (decode graphs)")  # fmt: skip
        graphs = self._graphs[key] = _LayoutGraphs(ladder, buffers)
        return graphs

    def _release(self, key: tuple) -> None:
        graphs = self._graphs.pop(key, None)
        if graphs is not None:
            graphs.ladder.close()
            self._past = combined(graphs.ladder.stats, self._past)

    def _turn_off(self, what: str, exc: Exception) -> bool:
        """Off for good (the breaks serve every pure-decode step), saying why, once."""
        self.close()
        self.off = f"{what}: {type(exc).__name__}: {exc}"
        logger.warning("%s: pure-decode graphs off, %s", self.who, self.off)
        return False

    def _fallback(self, reason: str) -> bool:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        return False


def _capacity(rows: int) -> int:
    """Read-index rows to allocate for a step reading ``rows``: room to grow (decode steps add
    one key per sequence), a power of two so that regrowth, which means new graphs, is rare."""
    return max(1024, 1 << (2 * rows - 1).bit_length())


def ring_problem(step: Any, n: int, kinds: dict) -> str | None:
    """Why a pure-decode step's sliding-window read indices are not laid out as contract item
    13b says (None: they are): each of the ``n`` sequences' part ends with one entry of the
    same sentinel, which appears nowhere else. Reads the step's indices on the host (one sync):
    run once per cache layout, before its graphs are captured.

    >>> from types import SimpleNamespace
    >>> read = torch.tensor([5, 6, -1, 7, -1])           # two sequences: 2 rows + new, 1 + new
    >>> step = SimpleNamespace(read_index=[read], cu_k=torch.tensor([0, 3, 5]))
    >>> ring_problem(step, 2, {0: "sliding_attention"}) is None
    True
    >>> step.read_index = [torch.tensor([5, -1, 6, 7, -1])]  # the sentinel not last
    >>> ring_problem(step, 2, {0: "sliding_attention"})[:58]
    "sliding-window group 0's read index is not laid out as con"
    """
    for group, kind in kinds.items():
        if kind != _SLIDING:
            continue
        read, offsets = step.read_index[group], _offsets(step, kind)[: n + 1].tolist()
        if offsets[-1] <= read.shape[0]:  # else indexing would fail (on CUDA: assert)
            last = read[torch.tensor(offsets[1:], device=read.device) - 1].tolist()
            if len(set(last)) == 1 and int((read == last[0]).sum()) == n:
                continue
        return (f"sliding-window group {group}'s read index is not laid out as contract "
                f"item 13b says (a sentinel last in each sequence's part, nowhere else); "
                f"its pure-decode steps take the attention breaks")  # fmt: skip
    return None


def _offsets(step: Any, kind: str) -> torch.Tensor:
    """The step's key offsets of the layers of one attention type (transformers passes one
    tensor where every layer has the same type, a dict by type otherwise)."""
    return step.cu_k[kind] if isinstance(step.cu_k, dict) else step.cu_k


def _decode_rows(cache: Any, layer: int) -> tuple | None:
    """``(group, keys, values, window)`` of one layer (``window`` None: full attention)."""
    full = cache_rows(cache, layer)
    return (*full, None) if full is not None else compat.sliding_kv_rows(cache, layer)


def _layout_key(layers: dict[int, tuple]) -> tuple:
    """What a decode graph baked in of the cache: every layer's tensors' addresses, layout,
    dtype and device, and its window."""
    return tuple(
        (group, window, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
        for group, keys, values, window in layers.values()
        for t in (keys, values)
    )
