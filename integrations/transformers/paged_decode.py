"""Decode attention straight from transformers' paged cache: no gather, fixed shapes.

A pure-decode CB step has one query per sequence. The break path (:class:`.cb_step.
PagedAttention`) asks transformers' cache for every key the step's sequences see
(``index_select`` writes them all once more: the *gather*) and calls FlashAttention-2's
varlen kernel on the copy. This kernel reads the cache rows through the step's read index
instead, one program per (sequence, key head) holding the query heads of that key head
together, so it reads each key once and writes nothing but the output. Where sequences x key
heads are too few programs to fill the GPU (few requests, few key heads, long sequences), each
sequence's keys are split across several programs and a second kernel combines their partial
results (flash-decoding). Its shapes depend only on the bucket (the index and the key lengths
are read on the device), which is what a captured graph needs.

The three attention functions take optional attention *sinks* (gpt-oss): one learned logit
per query head, ``sinks[h]`` (not scaled), that joins the softmax's denominator as
``exp(sinks[h])`` and adds no value, so a head can attend to "nothing": the output is the
sink-free one times ``sigmoid(lse - sinks[h])``, ``lse`` the log-sum-exp of the head's scaled
scores. ``None`` runs the code without them.

``paged_decode_reference`` is the same computation in plain torch (loops on the host): the
tests' oracle, and what runs where Triton does not.

Example (CUDA with Triton; the reference runs anywhere)::

    >>> import torch
    >>> from breakgraph.integrations.transformers.paged_decode import paged_decode_reference
    >>> q = torch.randn(2, 4, 8)                      # 2 sequences, 4 query heads
    >>> k_cache, v_cache = torch.randn(10, 2, 8), torch.randn(10, 2, 8)  # 2 key heads
    >>> read_index = torch.tensor([3, 7, 1, 0, 9])    # sequence 0: slots 3, 7; 1: 1, 0, 9
    >>> cu_k = torch.tensor([0, 2, 5], dtype=torch.int32)
    >>> paged_decode_reference(q, k_cache, v_cache, read_index, cu_k, 8**-0.5).shape
    torch.Size([2, 4, 8])
"""

from __future__ import annotations

import torch

from breakgraph.errors import BackendError, InputError

try:  # optional: the CPU build of torch comes without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = tl = None

__all__ = [
    "BREAK_SPLIT_AT_LEAST",
    "BREAK_SPLIT_FROM_KEYS",
    "break_split",
    "break_splits",
    "default_splits",
    "fits",
    "paged_decode",
    "paged_decode_dense",
    "paged_decode_reference",
    "query_rows",
    "split_count",
    "triton_available",
    "warm_up",
    "TABLE_WIDTH_MULTIPLE",
]

#: block tables handed to the kernel are this many entries wide, or a multiple of it: Triton
#: compiles one binary per divisibility class of each integer argument (a row stride divisible
#: by 16 or not), and the padding makes the kernel a step launches the one :func:`warm_up`
#: compiled, whatever width transformers chose
TABLE_WIDTH_MULTIPLE = 16


def triton_available(device: torch.device) -> bool:
    """True where :func:`paged_decode` can launch its kernel on ``device``.

    >>> triton_available(torch.device("cpu"))  # the kernel runs on CUDA only
    False
    """
    return triton is not None and torch.device(device).type == "cuda"


def fits(q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel can tile these heads: a whole number of query heads per key head and
    a power-of-two head size of at least 16 (``tl.dot``'s smallest inner size).

    >>> fits(32, 8, 128), fits(16, 4, 80), fits(12, 8, 64)
    (True, False, False)
    """
    return q_heads % kv_heads == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def query_rows(query: torch.Tensor) -> torch.Tensor:
    """A layer's ``query`` ``[1, Hq, B, D]`` as the ``[B, Hq, D]`` rows the kernels read: a view,
    copied only if its last dimension is not contiguous (RoPE leaves it contiguous).

    >>> query_rows(torch.zeros(1, 4, 3, 8)).shape
    torch.Size([3, 4, 8])
    """
    q = query[0].transpose(0, 1)
    return q if q.stride(-1) == 1 else q.contiguous()


def _check_sinks(name: str, q, sinks) -> None:
    """Refuse ``sinks`` other than one per query head on ``q``'s device (before any work)."""
    if sinks is None:
        return
    heads = q.shape[1]
    if sinks.dim() != 1 or sinks.shape[0] != heads or sinks.device != q.device:
        raise InputError(
            f"{name}: sinks of shape {tuple(sinks.shape)} on {sinks.device}; expected one sink "
            f"per query head, a 1-D tensor of shape ({heads},) on {q.device}"
        )


def paged_decode_reference(q, k_cache, v_cache, read_index, cu_k, scaling: float, out=None,
                           sinks=None):  # fmt: skip
    """One query per sequence over its keys ``k_cache[read_index[cu_k[i]:cu_k[i + 1]]]``.

    ``q`` ``[B, Hq, D]``, caches ``[slots, Hkv, D]``, ``read_index`` ``[R]``, ``cu_k``
    ``[B + 1]``, ``sinks`` ``[Hq]`` or None (the module's attention sinks: an extra softmax
    term per head, as transformers' eager gpt-oss attention). A sequence with no keys gets
    zeros. Host loop: tests and fallback only.

    A sink takes its share of the softmax from the keys: a large one leaves almost nothing.

    >>> q = torch.randn(2, 4, 8)
    >>> k_cache, v_cache = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    >>> read_index, cu_k = torch.tensor([3, 7, 1, 0, 9]), torch.tensor([0, 2, 5])
    >>> plain = paged_decode_reference(q, k_cache, v_cache, read_index, cu_k, 8**-0.5)
    >>> same = paged_decode_reference(q, k_cache, v_cache, read_index, cu_k, 8**-0.5, sinks=None)
    >>> torch.equal(plain, same)
    True
    >>> sinks = torch.tensor([-1e4, 0.0, 2.0, 1e4])    # none, some, more, all of the weight
    >>> sunk = paged_decode_reference(q, k_cache, v_cache, read_index, cu_k, 8**-0.5, sinks=sinks)
    >>> torch.allclose(sunk[:, 0], plain[:, 0]), bool((sunk[:, 3] == 0).all())
    (True, True)
    >>> bool((sunk[:, 1:3].norm(dim=-1) < plain[:, 1:3].norm(dim=-1)).all())
    True
    """
    _check_sinks("paged_decode_reference", q, sinks)
    out = torch.zeros_like(q) if out is None else out
    groups = q.shape[1] // k_cache.shape[1]
    bounds = cu_k.tolist()
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end <= start:
            out[i].zero_()
            continue
        slots = read_index[start:end].long()
        k = k_cache[slots].float().repeat_interleave(groups, 1)  # [n, Hq, D]
        v = v_cache[slots].float().repeat_interleave(groups, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * scaling
        if sinks is None:
            weights = scores.softmax(-1)
        else:  # the sink's column takes its share of the softmax, then goes
            weights = torch.cat([scores, sinks.float()[:, None]], -1).softmax(-1)[:, :-1]
        out[i] = torch.einsum("hn,nhd->hd", weights, v).to(out.dtype)
    return out


def paged_decode_dense(q, k_cache, v_cache, read_index, cu_k, scaling: float,
                       sinks=None) -> torch.Tensor:  # fmt: skip
    """:func:`paged_decode_reference` with fixed shapes and no host sync: every row of
    ``read_index`` is read, and each sequence keeps its own range ``cu_k[i]:cu_k[i + 1]``
    by a mask (rows past ``cu_k[-1]`` must still be valid cache rows, but may hold anything:
    a row never written is ``torch.empty``'s memory, NaN maybe, and a zero weight times NaN is
    NaN, so their values are zeroed). What a decode graph captures on the emulated backend
    (:mod:`.decode_graph`); its cost grows with the whole index, so it is not a CUDA kernel.

    >>> q = torch.randn(2, 4, 8)
    >>> k_cache, v_cache = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    >>> read_index = torch.tensor([3, 7, 1, 0, 9, 0, 6])   # two stale rows at the end
    >>> v_cache[6] = float("nan")                         # one of them never written
    >>> cu_k = torch.tensor([0, 2, 5], dtype=torch.int32)
    >>> dense = paged_decode_dense(q, k_cache, v_cache, read_index, cu_k, 8**-0.5)
    >>> exact = paged_decode_reference(q, k_cache, v_cache, read_index[:5], cu_k, 8**-0.5)
    >>> torch.allclose(dense, exact, atol=1e-6)
    True

    ``sinks`` (``[Hq]``) join each head's softmax as one more column, dropped after it.
    """
    _check_sinks("paged_decode_dense", q, sinks)
    groups = q.shape[1] // k_cache.shape[1]
    keys = k_cache.index_select(0, read_index).float().repeat_interleave(groups, 1)  # [R, Hq, D]
    values = v_cache.index_select(0, read_index).float().repeat_interleave(groups, 1)
    scores = torch.einsum("bhd,rhd->bhr", q.float(), keys) * scaling
    rows = torch.arange(read_index.shape[0], device=q.device)
    mine = (rows >= cu_k[:-1, None]) & (rows < cu_k[1:, None])  # [B, R]
    scores = scores.masked_fill(~mine[:, None, :], float("-inf"))
    values = values.masked_fill((rows >= cu_k[-1])[:, None, None], 0.0)  # stale rows
    if sinks is not None:  # one more column per head, no value: dropped after the softmax
        sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
        scores = torch.cat([scores, sink], -1)
    weights = scores.softmax(-1).nan_to_num(0.0)  # a sequence with no keys: zeros
    if sinks is not None:
        weights = weights[..., :-1]
    # contiguous [B, Hq, D], as the kernels write it (a model may .view() the attention output)
    return torch.einsum("bhr,rhd->bhd", weights, values).to(q.dtype).contiguous()


if triton is not None:

    @triton.jit
    def _attend(
        q, k_cache, v_cache, read_index, seq, head, start, lo, hi, scaling,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_t,
        GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    ):  # fmt: skip
        """The query heads of key head ``head`` of sequence ``seq`` over its keys ``lo:hi``
        (the sequence's keys start at ``start``), by online softmax: ``(running max, running
        sum, unnormalised output)`` per query head (``-inf``, 0 and zeros where there are no
        keys). Key ``r``'s cache row is ``read_index[r]``; with a ``PAGE``, ``read_index`` is
        a block table (rows ``stride_t`` apart) and key ``j = r - start`` of the sequence is
        at row ``table[seq, j // PAGE] * PAGE + j % PAGE``."""
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        queries = tl.load(
            q + seq * stride_qb + (head * GROUPS + g)[:, None] * stride_qh + d[None, :],
            mask=(g < GROUPS)[:, None], other=0.0,
        )  # fmt: skip
        top = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for first in range(lo, hi, BLOCK_N):
            rows = first + tl.arange(0, BLOCK_N)
            live = rows < hi
            if PAGE == 0:
                slots = tl.load(read_index + rows, mask=live, other=0).to(tl.int64)
            else:
                key = rows - start
                entry = tl.load(read_index + seq * stride_t + key // PAGE, mask=live, other=0)
                slots = entry.to(tl.int64) * PAGE + key % PAGE
            keys = tl.load(
                k_cache + slots[:, None] * stride_ks + head * stride_kh + d[None, :],
                mask=live[:, None], other=0.0,
            )  # fmt: skip
            scores = tl.dot(queries, tl.trans(keys)) * scaling
            scores = tl.where(live[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            weights = tl.exp(scores - new_top[:, None])
            rescale = tl.exp(top - new_top)
            values = tl.load(
                v_cache + slots[:, None] * stride_vs + head * stride_vh + d[None, :],
                mask=live[:, None], other=0.0,
            )  # fmt: skip
            total = total * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values)
            top = new_top
        return top, total, acc

    @triton.jit
    def _sink_share(top, total, sink):
        """Fold a sink into online-softmax state ``(top, total)``: the factor for the keys'
        sum and output, and the new total, both relative to ``max(top, sink)`` (0 where
        both are ``-inf``, so no keys and no sink stay 0, not NaN)."""
        m = tl.maximum(top, sink)
        m = tl.where(m == float("-inf"), 0.0, m)
        rescale = tl.exp(top - m)
        return rescale, total * rescale + tl.exp(sink - m)

    @triton.jit
    def _paged_decode_kernel(
        q, k_cache, v_cache, read_index, cu_k, out, sinks, scaling,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh,
        stride_t,
        GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):  # fmt: skip
        """One (sequence, key head) over all of the sequence's keys, normalised into ``out``
        (with ``HAS_SINKS``, each query head's ``sinks`` entry joins the denominator)."""
        seq, head = tl.program_id(0), tl.program_id(1)
        start = tl.load(cu_k + seq)
        top, total, acc = _attend(
            q, k_cache, v_cache, read_index, seq, head, start, start,
            tl.load(cu_k + seq + 1), scaling, stride_qb, stride_qh, stride_ks, stride_kh,
            stride_vs, stride_vh, stride_t, GROUPS, BLOCK_G, HEAD_DIM, BLOCK_N, PAGE,
        )  # fmt: skip
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        if HAS_SINKS:
            sink = tl.load(sinks + head * GROUPS + g, mask=g < GROUPS, other=0.0)
            rescale, total = _sink_share(top, total, sink.to(tl.float32))
            acc = acc * rescale[:, None]
        total = tl.where(total > 0, total, 1.0)  # no keys: zeros, not NaN
        result = acc / total[:, None]
        tl.store(
            out + seq * stride_ob + (head * GROUPS + g)[:, None] * stride_oh + d[None, :],
            result.to(out.dtype.element_ty), mask=(g < GROUPS)[:, None],
        )  # fmt: skip

    @triton.jit
    def _paged_decode_split_kernel(
        q, k_cache, v_cache, read_index, cu_k, part_out, part_lse, scaling,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_t,
        GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    ):  # fmt: skip
        """One split of one (sequence, key head): its share of the keys, as a partial result
        normalised over that share plus the share's log-sum-exp (``-inf`` when it is empty).
        The split count is the grid's third dimension, not a compile-time constant: one
        binary serves every count."""
        seq, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        splits = tl.num_programs(2)
        start = tl.load(cu_k + seq)
        end = tl.load(cu_k + seq + 1)
        chunk = tl.cdiv(tl.cdiv(end - start, splits), BLOCK_N) * BLOCK_N  # whole blocks
        lo = start + split * chunk
        top, total, acc = _attend(
            q, k_cache, v_cache, read_index, seq, head, start, lo, tl.minimum(lo + chunk, end),
            scaling, stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_t,
            GROUPS, BLOCK_G, HEAD_DIM, BLOCK_N, PAGE,
        )  # fmt: skip
        empty = total == 0
        lse = tl.where(empty, float("-inf"), top + tl.log(tl.where(empty, 1.0, total)))
        result = acc / tl.where(empty, 1.0, total)[:, None]
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        row = (seq * GROUPS * tl.num_programs(1) + head * GROUPS + g) * splits + split
        tl.store(part_lse + row, lse, mask=g < GROUPS)  # [B, Hq, splits]
        tl.store(
            part_out + row[:, None] * HEAD_DIM + d[None, :], result, mask=(g < GROUPS)[:, None]
        )  # fmt: skip

    @triton.jit(do_not_specialize=["splits"])
    def _paged_decode_combine_kernel(
        part_out, part_lse, out, sinks, stride_ob, stride_oh, splits,
        HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):  # fmt: skip
        """One (sequence, query head): the ``splits`` partial results weighted by their share
        of the softmax (with ``HAS_SINKS``, the head's ``sinks`` entry takes a share too);
        zeros where every split was empty. ``splits`` (at most ``MAX_SPLITS``) is a plain
        argument that Triton does not specialise on: one binary for every count."""
        seq, head = tl.program_id(0), tl.program_id(1)
        row = seq * tl.num_programs(1) + head
        s = tl.arange(0, MAX_SPLITS)
        live = s < splits
        d = tl.arange(0, HEAD_DIM)
        lse = tl.load(part_lse + row * splits + s, mask=live, other=float("-inf"))
        top = tl.max(lse, 0)
        weights = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
        parts = tl.load(part_out + (row * splits + s)[:, None] * HEAD_DIM + d[None, :],
                        mask=live[:, None], other=0.0)  # fmt: skip
        total = tl.sum(weights, 0)
        result = tl.sum(weights[:, None] * parts, 0)
        if HAS_SINKS:
            rescale, total = _sink_share(top, total, tl.load(sinks + head).to(tl.float32))
            result = result * rescale
        result = result / tl.where(total > 0, total, 1.0)
        tl.store(out + seq * stride_ob + head * stride_oh + d, result.to(out.dtype.element_ty))


#: programs per streaming multiprocessor that :func:`default_splits` aims the split grid at,
#: and keys per block for heads of up to 128 (larger heads take 64: the block's keys live in
#: registers). Both from ``benchmarks/decode_attention.py``'s sweep on an H200: within 2% of
#: each case's best setting on average (at most 11%, long sequences), see docs/performance.md
PROGRAMS_PER_SM = 4
BLOCK_N = 128
#: the most programs one sequence's keys are split across (the combine kernel's tile)
MAX_SPLITS = 16
_SM_COUNT: dict[int, int] = {}


def split_count(programs: int, multiprocessors: int) -> int:
    """The split for a grid of ``programs`` (sequences x key heads) on a GPU of
    ``multiprocessors``: a power of two between 1 and ``MAX_SPLITS`` that brings the grid to about
    ``PROGRAMS_PER_SM`` programs per multiprocessor.

    >>> split_count(1024, 132), split_count(256, 132), split_count(16, 132)  # an H200
    (1, 2, 16)
    """
    wanted = PROGRAMS_PER_SM * multiprocessors // max(1, programs)
    splits = 1
    while splits * 2 <= min(wanted, MAX_SPLITS):
        splits *= 2
    return splits


def default_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """How many programs share one (sequence, key head)'s keys on ``device``:
    :func:`split_count` of ``batch x kv_heads`` programs (1 off CUDA). It depends on the
    shapes only, so a captured graph keeps it.

    >>> default_splits(100, 8, torch.device("cpu"))  # no GPU: no split
    1
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return split_count(batch * kv_heads, _SM_COUNT[index])


#: An attention break launches its kernels one at a time (a decode graph launches nothing), so
#: a split there costs a second launch and two small allocations on the host, and a step of
#: breaks is bound by the host (its device idles between layers). A break therefore splits only
#: once the step's longest sequence holds ``BREAK_SPLIT_FROM_KEYS`` keys, at every head size,
#: and the default split is at least ``BREAK_SPLIT_AT_LEAST`` programs (a split of 2 lost at
#: every length measured). Timed launched on two H200 hosts (``benchmarks/decode_attention``,
#: threshold rows; performance.md, *The split threshold on a finer grid*): at heads of 64 and
#: 128 it started to pay between about 4096 and 7168 keys. At 256 the kernel alone paid from
#: the shortest length timed, but a rule splitting there from 2048 keys, served in continuous
#: batching (gemma-2b, decode graphs off, sequences of 2048-3072 keys, an H100), gave
#: 0.83-0.91x the tokens/s of this one in every round: the breaks' host time grew by more than
#: the device saved.
BREAK_SPLIT_FROM_KEYS = 4096
BREAK_SPLIT_AT_LEAST = 4


def break_split(default: int, longest: int) -> int:
    """The split an attention break launches: ``default`` (the graphs' split,
    :func:`default_splits`) once the step's longest sequence of ``longest`` keys reaches
    ``BREAK_SPLIT_FROM_KEYS`` and ``default`` is at least ``BREAK_SPLIT_AT_LEAST``; else 1.

    >>> break_split(16, 4096), break_split(16, 4095), break_split(2, 8192)
    (16, 1, 1)
    """
    if default < BREAK_SPLIT_AT_LEAST or longest < BREAK_SPLIT_FROM_KEYS:
        return 1
    return default


def break_splits(batch: int, longest: int, k_cache: torch.Tensor) -> int:
    """:func:`break_split` for a step of ``batch`` sequences over ``k_cache`` (``[rows, Hkv,
    D]``); a short step returns 1 without asking :func:`default_splits`.

    >>> break_splits(8, 100, torch.empty(0, 4, 128))  # 100 keys: no split
    1
    """
    if longest < BREAK_SPLIT_FROM_KEYS:
        return 1
    return break_split(default_splits(batch, k_cache.shape[1], k_cache.device), longest)


def paged_decode(q, k_cache, v_cache, read_index, cu_k, scaling: float, out=None,
                 block_n: int | None = None, splits: int | None = None, page: int = 0,
                 sinks=None):  # fmt: skip
    """:func:`paged_decode_reference` as Triton kernels: ``B x Hkv x splits`` programs.

    With ``page`` > 0, ``read_index`` is a block table instead (``[B, blocks]``, transformers'
    decode fast path; :mod:`.block_table`): key ``j`` of sequence ``i`` is at cache row
    ``read_index[i, j // page] * page + j % page``, the same rows as
    ``block_table.read_slots`` derives, read with no index built first.

    Each sequence's keys are cut into ``splits`` shares of whole ``block_n`` blocks (the
    flash-decoding split: with few sequences or few key heads, one program per (sequence,
    key head) leaves most of the GPU idle while the longest sequences stream); a second
    kernel weighs the shares' partial results by their log-sum-exp. ``splits=None`` takes
    :func:`default_splits`; with 1 a single kernel runs, with no second pass; up to
    ``MAX_SPLITS``, the count is the split kernel's grid and the combine kernel's plain
    argument, so the two binaries Triton compiles for a split serve every count. ``block_n``
    (keys per step of a program's loop, a power of two of at least 16) defaults to
    ``BLOCK_N`` for heads of up to 128 and 64 above.

    ``sinks`` (``[Hq]``, any float dtype, on ``q``'s device) are folded in where the output
    is normalised (the single kernel, or the combine kernel: the split kernel's partial
    log-sum-exps are all it needs): with ``m = max(top, sink)``, the output is ``acc *
    exp(top - m) / (total * exp(top - m) + exp(sink - m))``. A compile-time flag picks the
    kernels with or without them; :func:`warm_up` compiles the ones for sinks of its dtype.

    Shapes and launch depend on ``q``'s and the caches' shapes only (``read_index`` and
    ``cu_k`` are read on the device), so a graph can capture the call. The last dimension
    of every tensor must be contiguous (:func:`fits` says which heads the kernel tiles).
    """
    _check_sinks("paged_decode", q, sinks)
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if not fits(q_heads, kv_heads, head_dim):
        raise InputError(
            f"paged_decode: {q_heads} query heads over {kv_heads} key heads and head size "
            f"{head_dim}; the kernel needs a whole number of query heads per key head and a "
            f"power-of-two head size of at least 16 (use paged_decode_reference)"
        )
    if page < 0 or (page and (read_index.dim() != 2 or read_index.shape[0] < batch)):
        raise InputError(
            f"paged_decode: page={page} with a read_index of shape {tuple(read_index.shape)}; "
            f"a block table is [B, blocks] with B >= {batch} (page 0: a flat read index)"
        )
    if triton is None:
        raise BackendError(
            "paged_decode: Triton is not installed (the CPU build of torch comes without it); "
            "use paged_decode_reference"
        )
    if splits is None:
        splits = default_splits(batch, kv_heads, q.device)
    if block_n is None:
        block_n = BLOCK_N if head_dim <= 128 else 64
    stride_t = read_index.stride(0) if page else 0
    for name, value, least, most in (("splits", splits, 1, MAX_SPLITS),
                                     ("block_n", block_n, 16, None)):  # fmt: skip
        if value < least or value & (value - 1) or (most is not None and value > most):
            bound = f" from {least} to {most}" if most is not None else f", at least {least}"
            raise InputError(f"paged_decode: {name}={value}; it must be a power of two{bound}")
    out = torch.empty_like(q) if out is None else out
    groups = q_heads // kv_heads
    block_g = max(16, triton.next_power_of_2(groups))
    if splits == 1:
        _paged_decode_kernel[(batch, kv_heads)](
            q, k_cache, v_cache, read_index, cu_k, out, q if sinks is None else sinks, scaling,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), stride_t,
            GROUPS=groups, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_N=block_n, PAGE=page,
            HAS_SINKS=sinks is not None,
        )  # fmt: skip
        return out
    part_out = torch.empty(batch, q_heads, splits, head_dim, device=q.device,
                           dtype=torch.float32)  # fmt: skip
    part_lse = torch.empty(batch, q_heads, splits, device=q.device, dtype=torch.float32)
    _paged_decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, read_index, cu_k, part_out, part_lse, scaling,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), stride_t,
        GROUPS=groups, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_N=block_n, PAGE=page,
    )  # fmt: skip
    _paged_decode_combine_kernel[(batch, q_heads)](
        part_out, part_lse, out, out if sinks is None else sinks, out.stride(0), out.stride(1),
        splits, HEAD_DIM=head_dim, MAX_SPLITS=MAX_SPLITS, HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out


def warm_up(q_heads: int, kv_heads: int, head_dim: int, batches, dtype: torch.dtype,
            device: torch.device, page: int = 0, sinks: bool = False) -> list[int]:  # fmt: skip
    """Compile, before serving, the kernels that pure-decode steps of ``batches`` sequences
    will launch; returns the split counts those kernels serve (:func:`default_splits` of
    ``batches``; empty off CUDA or without Triton).

    Triton compiles a kernel at its first launch with new compile-time constants (the
    heads, the page) and integer classes, and keeps the binary in its disk cache; without
    that cache (a fresh machine or container) a compile took 0.4-1.5 s on an H200
    (``benchmarks/triton_first_call.py``), inside whichever decode step first needed it.
    At most two launches: the single kernel where some batch runs unsplit, and the split
    pair where some batch splits (one binary pair serves every split count), on inputs with
    no keys (nothing is read), laid out as the decode graphs and the attention breaks lay
    out theirs: queries as :func:`query_rows` views, cache rows ``[rows, kv_heads,
    head_dim]``, a block table ``TABLE_WIDTH_MULTIPLE`` entries wide (``page`` > 0) or a flat
    ``int64`` read index (``page`` 0), ``int32`` key offsets. With ``sinks`` (a model with
    attention sinks, as gpt-oss), the kernels with sinks instead of those without, on sinks
    of ``dtype`` (``q_heads`` zeros): a model's sinks are parameters of its dtype, and their
    dtype is part of what Triton compiles for.

    Example (no GPU here: nothing to compile)::

        >>> warm_up(32, 8, 128, [32, 128], torch.bfloat16, torch.device("cpu"), page=256)
        []
    """
    device = torch.device(device)
    if not triton_available(device) or not fits(q_heads, kv_heads, head_dim):
        return []
    splits = sorted({default_splits(b, kv_heads, device) for b in batches})
    launches = sorted({1, splits[-1]} & set(splits))  # unsplit, and one split for them all
    batch = 2
    with torch.inference_mode(False), torch.cuda.device(device):  # Triton: the current device
        q = query_rows(torch.zeros(1, q_heads, batch, head_dim, dtype=dtype, device=device))
        rows = torch.zeros(max(page, 16), kv_heads, head_dim, dtype=dtype, device=device)
        if page:
            index = torch.zeros(batch, TABLE_WIDTH_MULTIPLE, dtype=torch.int32, device=device)
        else:
            index = torch.zeros(16, dtype=torch.long, device=device)
        cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=device)  # no keys
        sink = torch.zeros(q_heads, dtype=dtype, device=device) if sinks else None
        for count in launches:
            paged_decode(q, rows, rows, index, cu_k, head_dim**-0.5, splits=count, page=page,
                         sinks=sink)  # fmt: skip
    return splits
