"""Decode attention read straight from a paged cache (``paged_decode``): the torch reference
against plain attention on the CPU, the Triton kernel against the reference on a GPU (bf16) and,
where Triton is installed, in Triton's CPU interpreter (fp32 and fp16; the interpreter has no
bf16)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from breakgraph.integrations.transformers import paged_decode as pd

from breakgraph.errors import BackendError, InputError

HAS_TRITON = pd.triton is not None or (
    subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0
)


def paged_case(seed: int, q_heads: int, kv_heads: int, head_dim: int, lengths, dtype, device):
    """A paged cache in random slot order, one query per sequence and the step's index."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    slots = total + 37
    q = torch.randn(len(lengths), q_heads, head_dim, generator=g).to(device, dtype)
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(device, dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(device, dtype)
    read_index = torch.randperm(slots, generator=g)[:total].to(device, torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, read_index, cu_k.to(device)


def paged_table_case(seed: int, q_heads: int, kv_heads: int, head_dim: int, lengths, page: int,
                     dtype, device):  # fmt: skip
    """A paged cache whose sequences own whole pages in random order: the step's block table
    ``[B, blocks]`` (unused entries -1, as transformers leaves them) and the same keys as a
    flat read index (what ``block_table.read_slots`` derives)."""
    g = torch.Generator().manual_seed(seed)
    blocks = max(1, max(-(-n // page) for n in lengths))
    pages = torch.randperm(len(lengths) * blocks + 3, generator=g)
    table = torch.full((len(lengths), blocks), -1, dtype=torch.int32)
    read = []
    for i, n in enumerate(lengths):
        used = -(-n // page)
        table[i, :used] = pages[i * blocks : i * blocks + used].to(torch.int32)
        read += [int(table[i, j // page]) * page + j % page for j in range(n)]
    slots = (len(lengths) * blocks + 3) * page
    q = torch.randn(len(lengths), q_heads, head_dim, generator=g).to(device, dtype)
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(device, dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(device, dtype)
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    read_index = torch.tensor(read, dtype=torch.int64)
    return q, k_cache, v_cache, table.to(device), read_index.to(device), cu_k.to(device)


def dense_attention(q, k_cache, v_cache, read_index, cu_k, scaling):
    """Each sequence's keys gathered, then torch's SDPA with GQA expanded (an independent path)."""
    out = torch.zeros_like(q)
    bounds = cu_k.tolist()
    groups = q.shape[1] // k_cache.shape[1]
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end > start:
            k = k_cache[read_index[start:end].long()].repeat_interleave(groups, 1).transpose(0, 1)
            v = v_cache[read_index[start:end].long()].repeat_interleave(groups, 1).transpose(0, 1)
            out[i] = torch.nn.functional.scaled_dot_product_attention(
                q[i][:, None], k, v, scale=scaling
            )[:, 0]
    return out


def sink_attention(q, k_cache, v_cache, read_index, cu_k, scaling, sinks):
    """Attention with sinks as transformers' eager gpt-oss writes it, one head at a time in
    float64: the scaled scores and the head's sink as one more column, a softmax, the sink's
    column dropped (an independent path)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    bounds = cu_k.tolist()
    groups = q.shape[1] // k_cache.shape[1]
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        slots = read_index[start:end].long().cpu()
        for h in range(q.shape[1]):
            k = k_cache.cpu()[slots, h // groups].double()  # [n, D]
            v = v_cache.cpu()[slots, h // groups].double()
            scores = k @ q[i, h].cpu().double() * scaling
            logits = torch.cat([scores, sinks[h : h + 1].cpu().double()])
            out[i, h] = logits.softmax(0)[:-1] @ v
    return out


def poison_stale_rows(k_cache, v_cache, read_index) -> torch.Tensor:
    """Fill the cache rows no sequence reads with NaN and inf (rows never written hold
    anything) and return 19 of them: stale rows to append past ``cu_k[-1]``."""
    unused = torch.ones(k_cache.shape[0], dtype=torch.bool)
    unused[read_index.long()] = False
    unused = unused.nonzero().flatten()
    k_cache[unused[::2]], v_cache[unused[::2]] = float("nan"), float("nan")
    k_cache[unused[1::2]], v_cache[unused[1::2]] = float("inf"), float("-inf")
    return unused[torch.randint(0, unused.numel(), (19,))].to(read_index.dtype)


def random_sinks(seed: int, q_heads: int, dtype=torch.float32, device="cpu"):
    """One sink per query head, of both signs and magnitudes up to 5 (never zero)."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 0.25 + 4.75 * torch.rand(q_heads, generator=g)
    sign = torch.tensor([(-1.0) ** h for h in range(q_heads)])
    return (sign * magnitude)[torch.randperm(q_heads, generator=g)].to(device, dtype)


@pytest.mark.parametrize("heads", [(8, 2, 16), (4, 2, 8), (8, 4, 32)], ids=str)
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_with_sinks_is_a_softmax_with_a_sink_column(heads, sink_dtype):
    """gpt-oss's attention sinks: each query head's sink joins its softmax unscaled and adds
    no value; a sequence with no keys still gets zeros; ``sinks=None`` is the plain call."""
    q_heads, kv_heads, head_dim = heads
    case = paged_case(6, q_heads, kv_heads, head_dim, [5, 1, 0, 33, 2], torch.float32, "cpu")
    scaling = head_dim**-0.5
    sinks = random_sinks(7, q_heads, sink_dtype)
    assert (sinks > 0).any() and (sinks < 0).any()
    got = pd.paged_decode_reference(*case, scaling, sinks=sinks)
    expected = sink_attention(*case, scaling, sinks)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert (got[2] == 0).all()  # no keys: zeros
    plain = pd.paged_decode_reference(*case, scaling)
    assert torch.equal(pd.paged_decode_reference(*case, scaling, sinks=None), plain)
    assert not torch.allclose(got, plain, atol=1e-3)  # the sinks took a share
    q, k_cache, v_cache, read_index, cu_k = case
    for i, (start, end) in enumerate(zip(cu_k.tolist(), cu_k[1:].tolist())):
        if end > start:  # out_with_sinks = out_without * sigmoid(lse - sink)
            k = k_cache[read_index[start:end].long()].repeat_interleave(q_heads // kv_heads, 1)
            lse = (torch.einsum("hd,nhd->hn", q[i], k) * scaling).logsumexp(-1)
            share = torch.sigmoid(lse - sinks.float())
            torch.testing.assert_close(got[i], plain[i] * share[:, None], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(8, 2, 16), (4, 4, 8), (6, 2, 32)], ids=str)
def test_reference_is_attention_over_the_indexed_keys(heads):
    q_heads, kv_heads, head_dim = heads
    case = paged_case(0, q_heads, kv_heads, head_dim, [5, 1, 0, 33], torch.float32, "cpu")
    got = pd.paged_decode_reference(*case, head_dim**-0.5)
    assert torch.allclose(got, dense_attention(*case, head_dim**-0.5), atol=1e-5)
    assert (got[2] == 0).all()  # no keys: zeros


@pytest.mark.parametrize("heads", [(8, 2, 16), (4, 4, 8), (6, 2, 24)], ids=str)
def test_dense_reads_the_whole_index_with_fixed_shapes(heads):
    """The emulated backend's decode-graph kernel: every row of an index longer than the
    step's keys (stale rows past ``cu_k[-1]``, as a static buffer holds) is read and masked
    per sequence; padded sequences (no keys, as a bucket's tail) give zeros, not NaN. A stale
    row may be one never written (``torch.empty``'s memory: NaN, inf): a zero weight times NaN
    was NaN, the logits of a whole decode step (found by the CB fuzzer, seed 14004)."""
    q_heads, kv_heads, head_dim = heads
    q, k_cache, v_cache, read_index, cu_k = paged_case(
        1, q_heads, kv_heads, head_dim, [5, 1, 0, 33, 0, 0], torch.float32, "cpu"
    )
    stale = poison_stale_rows(k_cache, v_cache, read_index)
    got = pd.paged_decode_dense(q, k_cache, v_cache, torch.cat([read_index, stale]).long(),
                                cu_k, head_dim**-0.5)  # fmt: skip
    expected = dense_attention(q, k_cache, v_cache, read_index, cu_k, head_dim**-0.5)
    assert torch.allclose(got, expected, atol=1e-5)
    assert (got[[2, 4, 5]] == 0).all()


@pytest.mark.parametrize("heads", [(8, 2, 16), (4, 2, 8)], ids=str)
def test_dense_with_sinks_is_the_reference_with_sinks(heads):
    """The decode-graph kernel of the emulated backend with sinks: the same stale rows past
    ``cu_k[-1]`` (never written: NaN, inf) and padded sequences (zeros, not NaN) as without."""
    q_heads, kv_heads, head_dim = heads
    q, k_cache, v_cache, read_index, cu_k = paged_case(
        8, q_heads, kv_heads, head_dim, [5, 1, 0, 33, 0, 0], torch.float32, "cpu")  # fmt: skip
    stale = poison_stale_rows(k_cache, v_cache, read_index)
    sinks = random_sinks(9, q_heads)
    got = pd.paged_decode_dense(q, k_cache, v_cache, torch.cat([read_index, stale]).long(),
                                cu_k, head_dim**-0.5, sinks=sinks)  # fmt: skip
    expected = pd.paged_decode_reference(q, k_cache, v_cache, read_index, cu_k, head_dim**-0.5,
                                         sinks=sinks)  # fmt: skip
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got[[2, 4, 5]] == 0).all()
    plain = pd.paged_decode_dense(q, k_cache, v_cache, torch.cat([read_index, stale]).long(),
                                  cu_k, head_dim**-0.5)  # fmt: skip
    assert not torch.allclose(got, plain, atol=1e-3)


@pytest.mark.parametrize(
    "sinks",
    [torch.zeros(5), torch.zeros(3), torch.zeros(1, 4), torch.tensor(0.5),
     torch.zeros(4, device="meta")],
    ids=["too-many", "too-few", "2-d", "0-d", "other-device"],
)  # fmt: skip
def test_sinks_of_the_wrong_shape_are_refused_before_anything_runs(sinks):
    """One sink per query head (``[Hq]``, on ``q``'s device), checked first: ``out`` stays as
    it was, and the kernel names the shape even where Triton is not installed."""
    case = paged_case(2, 4, 2, 16, [2, 0, 3], torch.float32, "cpu")
    expected = re.escape(f"sinks of shape {tuple(sinks.shape)}") + r".*shape \(4,\)"
    out = torch.full_like(case[0], float("nan"))
    with pytest.raises(InputError, match="paged_decode_reference: " + expected):
        pd.paged_decode_reference(*case, 0.1, out=out, sinks=sinks)
    assert out.isnan().all()
    with pytest.raises(InputError, match="paged_decode_dense: " + expected):
        pd.paged_decode_dense(*case, 0.1, sinks=sinks)
    with pytest.raises(InputError, match="paged_decode: " + expected):
        pd.paged_decode(*case, 0.1, out=out, sinks=sinks)
    assert out.isnan().all()


def test_reference_writes_into_out():
    case = paged_case(1, 4, 2, 8, [3, 4], torch.float32, "cpu")
    out = torch.full_like(case[0], float("nan"))
    assert pd.paged_decode_reference(*case, 0.3, out=out) is out
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("heads", [(6, 4, 16), (4, 2, 8), (4, 2, 24)], ids=str)
def test_kernel_refuses_shapes_it_cannot_tile(heads):
    q, k_cache, v_cache, read_index, cu_k = paged_case(2, *heads, [2], torch.float32, "cpu")
    assert not pd.fits(*heads)
    with pytest.raises(InputError, match="whole number of query heads per key head"):
        pd.paged_decode(q, k_cache, v_cache, read_index, cu_k, 0.1)
    assert pd.fits(16, 4, 64) and pd.fits(8, 8, 16)


def test_kernel_refuses_a_flat_index_with_a_page():
    q, k_cache, v_cache, table, read_index, cu_k = paged_table_case(
        2, 4, 2, 16, [3, 5], 4, torch.float32, "cpu")  # fmt: skip
    for index, page in ((read_index, 4), (table[:1], 4), (table, -1)):
        with pytest.raises(InputError, match=r"page=-?\d+ with a read_index of shape"):
            pd.paged_decode(q, k_cache, v_cache, index, cu_k, 0.1, page=page)


@pytest.mark.skipif(pd.triton is not None, reason="Triton is installed")
def test_kernel_without_triton_names_the_fallback():
    case = paged_case(2, 4, 2, 16, [2], torch.float32, "cpu")
    with pytest.raises(BackendError, match="Triton is not installed.*paged_decode_reference"):
        pd.paged_decode(*case, 0.1)


#: (splits, block_n) per head shape: every setting on one shape, the defaults and one split on
#: the others (each setting is a Triton compile of its own, about half a second)
KERNEL_SETTINGS = {
    (16, 2, 128): ((None, None), (1, 64), (1, 128), (2, 64), (16, 128)),
    **dict.fromkeys(
        [(16, 4, 64), (32, 4, 64), (8, 8, 128), (8, 1, 256)], ((None, None), (4, None))
    ),
}


@pytest.mark.requires_cuda
@pytest.mark.parametrize("heads", list(KERNEL_SETTINGS), ids=str)
def test_kernel_matches_reference_cuda_bf16(heads):
    """Split counts (1: one kernel; more: shares of whole blocks, then the combine), both
    blocks of keys, sequences shorter than a share, empty ones and a padded tail (no keys:
    zeros)."""
    if pd.triton is None:
        pytest.skip("Triton is not installed")
    q_heads, kv_heads, head_dim = heads
    lengths = [1, 63, 64, 65, 0, 700, 129, 2049, 0, 0]
    case = paged_case(3, q_heads, kv_heads, head_dim, lengths, torch.bfloat16, "cuda")
    scaling = head_dim**-0.5
    expected = pd.paged_decode_reference(*case, scaling)
    for splits, block_n in KERNEL_SETTINGS[heads]:
        out = torch.full_like(case[0], float("nan"))
        got = pd.paged_decode(*case, scaling, out=out, splits=splits, block_n=block_n)
        assert got is out and (got[[4, 8, 9]] == 0).all(), (splits, block_n)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("width", [6, 17], ids=["width-6", "width-17"])
def test_cuda_warm_up_compiles_the_kernel_a_decode_graph_launches(width):
    """``warm_up``, then the kernel as a decode graph launches it (queries as ``query_rows``
    views of ``[1, Hq, B, D]``, the block table in ``DecodeBuffers``, padded from a width
    transformers chose, key offsets from them): Triton compiles nothing more, and the result
    is the reference's. Heads (10 over 5) and page (16) no other test launches with."""
    from breakgraph.integrations.transformers.decode_graph import DecodeBuffers

    from tests.helpers import compiled_decode_kernels

    if pd.triton is None or compiled_decode_kernels() is None:
        pytest.skip("Triton is not installed, or keeps its kernels where this cannot count")
    q_heads, kv_heads, head_dim, page, bucket = 10, 5, 32, 16, 32
    device = torch.device("cuda")
    assert pd.warm_up(q_heads, kv_heads, head_dim, [bucket], torch.bfloat16, device, page)
    compiled = compiled_decode_kernels()
    lengths = [1 + (7 * i) % (width * page) for i in range(bucket - 3)]  # 3 padded sequences
    q, k_cache, v_cache, table, read_index, cu_k = paged_table_case(
        4, q_heads, kv_heads, head_dim, lengths, page, torch.bfloat16, device)  # fmt: skip
    live = torch.zeros(1, bucket, width, dtype=torch.int32, device=device)
    live[0, : len(lengths), : table.shape[1]] = table
    buffers = DecodeBuffers((0,), bucket, 0, device, width=width, page=page, reads=False)
    step = types.SimpleNamespace(table=live, cu_k=cu_k)
    buffers.fill(step, len(lengths), bucket, page=page)
    query = torch.zeros(1, q_heads, bucket, head_dim, dtype=torch.bfloat16, device=device)
    query[0, :, : len(lengths)] = q.transpose(0, 1)
    offsets = buffers.cu_k[buffers.kinds[0]][: bucket + 1]  # group 0's attention type's
    got = pd.paged_decode(pd.query_rows(query), k_cache, v_cache, buffers.table[0], offsets,
                          head_dim**-0.5, page=page)  # fmt: skip
    assert compiled_decode_kernels() == compiled, "the step compiled a kernel of its own"
    expected = pd.paged_decode_reference(q, k_cache, v_cache, read_index, cu_k, head_dim**-0.5)
    torch.testing.assert_close(got[: len(lengths)].float(), expected.float(), atol=2e-2,
                               rtol=2e-2)  # fmt: skip
    assert (got[len(lengths):] == 0).all()


@pytest.mark.requires_cuda
def test_cuda_one_split_binary_pair_serves_every_split_count():
    """The split count is the split kernel's grid and the combine kernel's plain argument:
    after ``warm_up`` of batches that split (and one that does not), calls with every count
    from 2 to ``MAX_SPLITS`` compile nothing more and match the reference, read through a flat
    ``int64`` index as the attention breaks read it. Heads (12 over 4, size 64) no other test
    launches with."""
    from tests.helpers import compiled_decode_kernels

    if pd.triton is None or compiled_decode_kernels() is None:
        pytest.skip("Triton is not installed, or keeps its kernels where this cannot count")
    q_heads, kv_heads, head_dim = 12, 4, 64
    device = torch.device("cuda")
    before = compiled_decode_kernels()
    warmed = pd.warm_up(q_heads, kv_heads, head_dim, [1, 4096], torch.bfloat16, device)
    assert warmed[0] == 1 and warmed[-1] > 1, warmed  # one batch unsplit, one split
    compiled = compiled_decode_kernels()
    # the unsplit and split kernels for these heads; the combine kernel depends on the head
    # size alone, and an earlier test may have compiled it for 64
    assert compiled - before in (2, 3), (before, compiled)
    lengths = [1, 300, 0, 1500, 129, 4100, 0]
    q, k_cache, v_cache, read_index, cu_k = paged_case(
        5, q_heads, kv_heads, head_dim, lengths, torch.bfloat16, device)  # fmt: skip
    read_index = read_index.long()
    expected = pd.paged_decode_reference(q, k_cache, v_cache, read_index, cu_k, head_dim**-0.5)
    splits = 1
    while splits <= pd.MAX_SPLITS:
        out = torch.full_like(q, float("nan"))
        pd.paged_decode(q, k_cache, v_cache, read_index, cu_k, head_dim**-0.5, out=out,
                        splits=splits)  # fmt: skip
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
        assert (out[[2, 6]] == 0).all(), splits
        splits *= 2
    assert compiled_decode_kernels() == compiled, "a split count compiled a kernel of its own"


@pytest.mark.requires_cuda
@pytest.mark.parametrize("page", [256, 16, 3])
def test_kernel_reads_a_block_table_as_its_read_index_cuda_bf16(page):
    """With ``page``, the kernel reads transformers' block table itself: the same result as
    over the flat read index of the same keys (pages smaller than, equal to and not a
    divisor of the kernel's block of keys; split and not)."""
    if pd.triton is None:
        pytest.skip("Triton is not installed")
    lengths = [1, 63, 256, 257, 0, 700, 129, 2049, 0]
    q, k_cache, v_cache, table, read_index, cu_k = paged_table_case(
        4, 16, 2, 128, lengths, page, torch.bfloat16, "cuda")  # fmt: skip
    scaling = 128**-0.5
    for splits in (None, 1, 4):
        flat = pd.paged_decode(q, k_cache, v_cache, read_index, cu_k, scaling, splits=splits)
        got = pd.paged_decode(q, k_cache, v_cache, table, cu_k, scaling, splits=splits,
                              page=page)  # fmt: skip
        assert torch.equal(got, flat), (page, splits)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("heads", [(64, 8, 64), (16, 2, 128)], ids=str)
def test_kernel_with_sinks_matches_reference_cuda_bf16(heads):
    """Sinks (gpt-oss's heads, and another), float32 and bf16, of both signs plus one so large
    it takes all the weight (zeros) and one so small it takes none: the single kernel and the
    combine kernel after splits of 4 and 16, over a flat read index and a block table; no
    keys still gives zeros."""
    if pd.triton is None:
        pytest.skip("Triton is not installed")
    q_heads, kv_heads, head_dim = heads
    lengths = [1, 63, 64, 65, 0, 700, 129, 2049, 0]
    q, k_cache, v_cache, table, read_index, cu_k = paged_table_case(
        10, q_heads, kv_heads, head_dim, lengths, 16, torch.bfloat16, "cuda")  # fmt: skip
    scaling = head_dim**-0.5
    for sink_dtype in (torch.float32, torch.bfloat16):
        sinks = random_sinks(11, q_heads)
        sinks[0], sinks[1] = 1e4, -1e4
        sinks = sinks.to("cuda", sink_dtype)
        expected = pd.paged_decode_reference(q, k_cache, v_cache, read_index, cu_k, scaling,
                                             sinks=sinks)  # fmt: skip
        plain = pd.paged_decode_reference(q, k_cache, v_cache, read_index, cu_k, scaling)
        for splits in (1, 4, 16):
            for index, page in ((read_index, 0), (table, 16)):
                out = torch.full_like(q, float("nan"))
                got = pd.paged_decode(q, k_cache, v_cache, index, cu_k, scaling, out=out,
                                      splits=splits, page=page, sinks=sinks)  # fmt: skip
                where = (sink_dtype, splits, page)
                assert got is out and (got[[4, 8]] == 0).all(), where
                assert (got[:, 0] == 0).all(), where  # the sink took all the weight
                torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(got[:, 1].float(), plain[:, 1].float(), atol=2e-2,
                                           rtol=2e-2)  # fmt: skip


@pytest.mark.requires_cuda
def test_cuda_warm_up_with_sinks_compiles_the_sink_kernels():
    """``warm_up(sinks=True)`` compiles the kernels with sinks of its dtype (a model's sinks are
    parameters of the model's dtype): steps with such sinks, unsplit and at every split count,
    compile nothing more and match the reference.
    Heads (24 over 4, size 32) no other test launches with."""
    from tests.helpers import compiled_decode_kernels

    if pd.triton is None or compiled_decode_kernels() is None:
        pytest.skip("Triton is not installed, or keeps its kernels where this cannot count")
    q_heads, kv_heads, head_dim = 24, 4, 32
    device = torch.device("cuda")
    before = compiled_decode_kernels()
    warmed = pd.warm_up(q_heads, kv_heads, head_dim, [1, 4096], torch.bfloat16, device,
                        sinks=True)  # fmt: skip
    assert warmed[0] == 1 and warmed[-1] > 1, warmed
    compiled = compiled_decode_kernels()
    assert compiled > before, (before, compiled)
    q, k_cache, v_cache, read_index, cu_k = paged_case(
        12, q_heads, kv_heads, head_dim, [1, 300, 0, 1500, 129], torch.bfloat16, device
    )
    read_index = read_index.long()
    sinks = random_sinks(13, q_heads, torch.bfloat16, device)
    expected = pd.paged_decode_reference(q, k_cache, v_cache, read_index, cu_k, head_dim**-0.5,
                                         sinks=sinks)  # fmt: skip
    splits = 1
    while splits <= pd.MAX_SPLITS:
        got = pd.paged_decode(q, k_cache, v_cache, read_index, cu_k, head_dim**-0.5,
                              splits=splits, sinks=sinks)  # fmt: skip
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
        assert (got[2] == 0).all(), splits
        splits *= 2
    assert compiled_decode_kernels() == compiled, "a step with sinks compiled a kernel"


def test_default_splits_fill_the_gpu_and_stay_a_power_of_two(monkeypatch):
    """The split count follows the grid's size only: many programs already, no split; few,
    up to 16 (132 multiprocessors, as an H200)."""
    monkeypatch.setitem(pd._SM_COUNT, 0, 132)
    cuda = torch.device("cuda", 0)
    assert pd.default_splits(256, 8, cuda) == 1
    assert pd.default_splits(128, 4, cuda) == 1
    assert pd.default_splits(128, 2, cuda) == 2
    assert pd.default_splits(32, 8, cuda) == 2
    assert pd.default_splits(32, 2, cuda) == 8
    assert pd.default_splits(8, 2, cuda) == 16
    assert pd.default_splits(1, 1, cuda) == 16
    assert pd.default_splits(100, 8, torch.device("cpu")) == 1


def test_kernel_refuses_splits_and_blocks_that_are_not_powers_of_two_or_too_many_splits():
    case = paged_case(2, 4, 2, 16, [2], torch.float32, "cpu")
    if pd.triton is None:
        pytest.skip("Triton is not installed: the kernel refuses before the split count")
    with pytest.raises(InputError, match="splits=3; it must be a power of two from 1 to 16"):
        pd.paged_decode(*case, 0.1, splits=3)
    with pytest.raises(InputError, match="splits=32; it must be a power of two from 1 to 16"):
        pd.paged_decode(*case, 0.1, splits=32)  # past the combine kernel's tile
    with pytest.raises(InputError, match="block_n=8; it must be a power of two, at least 16"):
        pd.paged_decode(*case, 0.1, splits=1, block_n=8)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test runs the kernel itself")
def test_kernel_matches_reference_in_triton_interpreter():
    """Triton's CPU interpreter runs the kernel itself (it must be chosen before Triton is
    imported, hence a fresh process). Where a GPU is present the CUDA test covers the kernel
    (the interpreter of Triton 3.9 runs it; older ones fail on its loop bounds). The
    interpreter of Triton 3.6 (torch 2.10's) cannot turn a loaded loop bound into an int with
    numpy >= 2.4: a one-line kernel probes that first, and the test skips where it fails."""
    script = textwrap.dedent(
        """
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def _loop_over_a_loaded_bound(bounds, out):
            total = 0
            for i in range(tl.load(bounds), tl.load(bounds + 1)):
                total += i
            tl.store(out, total)

        out = torch.zeros(1, dtype=torch.int32)
        try:
            _loop_over_a_loaded_bound[(1,)](torch.tensor([1, 4], dtype=torch.int32), out)
        except Exception as error:
            print("interpreter fails:", repr(error)[:300])
            raise SystemExit(0)
        assert out.item() == 6, out

        from breakgraph.integrations.transformers import paged_decode as pd
        from tests.test_paged_decode import paged_case
        for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            for heads in ((16, 4, 64), (6, 2, 32), (4, 4, 16)):
                case = paged_case(4, *heads, [1, 0, 63, 64, 65, 130], dtype, "cpu")
                scaling = heads[2] ** -0.5
                expected = pd.paged_decode_reference(*case, scaling)
                for splits in (1, 2, 4):
                    got = pd.paged_decode(*case, scaling, block_n=32, splits=splits)
                    assert (got[1] == 0).all(), (heads, splits)
                    torch.testing.assert_close(got.float(), expected.float(), atol=atol,
                                               rtol=atol)
        from tests.test_paged_decode import paged_table_case
        for page in (16, 3):  # the block table read by the kernel itself
            q, k, v, table, read, cu_k = paged_table_case(
                5, 8, 2, 32, [1, 0, 40, 16, 70], page, torch.float32, "cpu")
            expected = pd.paged_decode_reference(q, k, v, read, cu_k, 0.2)
            for splits in (1, 2):
                got = pd.paged_decode(q, k, v, table, cu_k, 0.2, block_n=32, splits=splits,
                                      page=page)
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        from tests.test_paged_decode import random_sinks
        q, k, v, table, read, cu_k = paged_table_case(  # sinks: both kernels that normalise
            6, 8, 2, 32, [1, 0, 40, 16, 70], 16, torch.float32, "cpu")
        sinks = random_sinks(7, 8)
        sinks[0] = 1e4
        expected = pd.paged_decode_reference(q, k, v, read, cu_k, 0.2, sinks=sinks)
        for splits in (1, 2, 4):
            for index, page in ((read, 0), (table, 16)):
                got = pd.paged_decode(q, k, v, index, cu_k, 0.2, block_n=16, splits=splits,
                                      page=page, sinks=sinks)
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
                assert (got[1] == 0).all() and (got[:, 0] == 0).all(), (splits, page)
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    if run.returncode == 0 and "interpreter fails:" in run.stdout:
        pytest.skip(f"this Triton's interpreter cannot run a loop over loaded bounds: {run.stdout}")
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


def test_a_break_splits_from_4096_keys_at_every_head_size(monkeypatch):
    """``break_split``: the default split once the longest sequence reaches 4096 keys, and only
    for a default of at least ``BREAK_SPLIT_AT_LEAST`` (session 36 split heads of 256 from 2048
    keys; served in continuous batching that lost, performance.md); ``break_splits`` asks for
    the default only on a long step, at any head size."""
    at_least = pd.BREAK_SPLIT_AT_LEAST
    assert pd.BREAK_SPLIT_FROM_KEYS == 4096
    assert pd.break_split(16, 4096) == 16 and pd.break_split(16, 4095) == 1
    assert pd.break_split(at_least - 1, 8 * 4096) == 1
    assert pd.break_split(at_least, 4096) == at_least
    monkeypatch.setattr(pd, "default_splits", lambda *a: 16)
    for head in (64, 128, 256):
        cache = torch.empty(0, 1, head)
        assert pd.break_splits(8, 4095, cache) == 1 and pd.break_splits(8, 4096, cache) == 16
    asked = []
    monkeypatch.setattr(pd, "default_splits", lambda *a: asked.append(a) or 16)
    cache = torch.empty(0, 4, 128)
    assert pd.break_splits(8, 4095, cache) == 1 and not asked
    assert pd.break_splits(8, 4096, cache) == 16 and asked == [(8, 4, cache.device)]
