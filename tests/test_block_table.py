"""Pure-decode CB steps through transformers' block table (integrations/transformers/block_table).

The slot arithmetic against a plain Python reference; the steps' indices against transformers'
own index lists for the same requests (contract item 15, on the installed release); the gate
replacement's scope; and whole runs whose fp32 logprobs equal the index-list path's, through
the decode graphs and through the breaks (the table materialised).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from breakgraph.integrations.transformers import (  # noqa: E402
    block_table,
    cb_step,  # noqa: E402
    compat,
    enable_continuous_batching,  # noqa: E402
)

from breakgraph.errors import InputError  # noqa: E402
from tests.test_continuous_batching import (  # noqa: E402
    BUCKETS,
    assert_logprobs_close,
    build_model,
    cb_config,
    generate_batch,
    generate_queued,
    needs_cb,
    random_prompts,
)

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("one_cpu_thread")]


def reference_slots(table: list[list[int]], lengths: list[int], page: int) -> list[int]:
    return [table[i][j // page] * page + j % page for i, n in enumerate(lengths) for j in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_slots_match_the_block_arithmetic(seed):
    """Random tables, lengths and pages: every key's row, the padding rows 0, each sequence's
    last key the write row."""
    g = torch.Generator().manual_seed(seed)
    page = int(torch.randint(1, 9, (1,), generator=g))
    n, blocks = int(torch.randint(1, 6, (1,), generator=g)), 5
    table = torch.randint(0, 50, (n, blocks), generator=g, dtype=torch.int32)
    lengths = torch.randint(1, blocks * page + 1, (n,), generator=g).tolist()
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    expected = reference_slots(table.tolist(), lengths, page)
    rows = len(expected) + 7
    got = block_table.read_slots(table, cu_k, page, rows)
    assert got.dtype == torch.long and got.tolist() == expected + [0] * 7
    last = torch.tensor(lengths) - 1
    assert block_table.write_slots(table, last, page).tolist() == [
        expected[int(cu_k[i + 1]) - 1] for i in range(n)
    ]


@pytest.mark.parametrize("seed", range(6))
def test_in_graph_write_rows_are_each_sequences_last_key_through_several_steps(seed):
    """What a decode graph derives from its static buffers, step after step (the buffers
    reused, as a replay reuses them): random tables, lengths, pages and buckets, with fewer
    sequences than the bucket and stale rows left in the table by a larger step before. Each
    live sequence's write row is its last key's row by the Python reference; each padded one
    is the first sequence's."""
    from types import SimpleNamespace

    from breakgraph.integrations.transformers.decode_graph import DecodeBuffers

    g = torch.Generator().manual_seed(seed)
    page, blocks, largest = int(torch.randint(1, 9, (1,), generator=g)), 5, 8
    buffers = DecodeBuffers((0, 1), largest, 0, torch.device("cpu"), blocks, page, reads=False)
    for n in (largest, *torch.randint(1, largest + 1, (3,), generator=g).tolist()):
        bucket = int(torch.randint(n, largest + 1, (1,), generator=g))
        table = torch.randint(-1, 50, (2, n, blocks), generator=g, dtype=torch.int32)
        lengths = torch.randint(1, blocks * page + 1, (n,), generator=g)
        table[..., 0] = table[..., 0].abs()  # every sequence has a first block
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
        buffers.fill(SimpleNamespace(table=table, cu_k=cu_k), n, bucket, page=page)
        for group in (0, 1):
            rows = table[group].tolist()
            for i, length in enumerate(lengths.tolist()):  # fill the blocks the keys use
                for b in range((length - 1) // page + 1):
                    rows[i][b] = abs(rows[i][b])
            buffers.table[group][:n, :blocks].copy_(torch.tensor(rows, dtype=torch.int32))
            expected = [reference_slots(rows, lengths.tolist(), page)[int(cu_k[i + 1]) - 1]
                        for i in range(n)]  # fmt: skip
            got = buffers.write_rows(group, bucket).tolist()
            assert got == expected + [expected[0]] * (bucket - n), (n, bucket, page)


def test_decode_buffers_hold_the_table_and_derive_the_write_rows():
    """A block-table step's buffers (``width`` > 0) take its table as it is; each sequence's
    write row comes from the table and the key offsets alone (what the graph runs), the new
    key being a sequence's last, and a bucket's padded sequences (no keys) write sequence 0's
    slot again. The CUDA kernel reads the table (no read index); the emulated backend's dense
    kernel reads the exact rows, derived per step."""
    from types import SimpleNamespace

    from breakgraph.integrations.transformers.decode_graph import DecodeBuffers

    table = torch.tensor([[[4, 1, -1], [2, -1, -1]]], dtype=torch.int32)  # 1 group, 2 sequences
    cu_k = torch.tensor([0, 6, 8], dtype=torch.int32)  # 6 and 2 keys, pages of 4
    step = SimpleNamespace(table=table, positions=torch.tensor([[5, 1]]), cu_k=cu_k)
    cuda = DecodeBuffers((0,), 4, 1024, torch.device("cpu"), width=3, page=4, reads=False)
    cuda.fill(step, 2, 4, page=4, rows=2)
    assert cuda.read == {} and cuda.write == {} and cuda.capacity == 0
    assert cuda.table[0][:2, :3].tolist() == table[0].tolist()
    # as wide as paged_decode.warm_up's table (a multiple of 16): the kernel it compiled
    assert cuda.table[0].shape == (4, 16) and cuda.table[0][:, 3:].eq(0).all()
    assert cuda.cu_k["full_attention"].tolist() == [0, 6, 8, 8, 8]
    assert cuda.write_rows(0, 4).tolist() == [5, 9, 5, 5]  # padded: sequence 0's slot again
    assert cuda.write_rows(0, 2).tolist() == block_table.write_slots(
        table[0], step.positions[0], 4).tolist()  # fmt: skip
    emulated = DecodeBuffers((0,), 4, 1024, torch.device("cpu"), width=3, page=4)
    emulated.fill(step, 2, 4, page=4, rows=8)
    assert emulated.read[0][:8].tolist() == [16, 17, 18, 19, 4, 5, 8, 9]
    assert emulated.write_rows(0, 4).tolist() == [5, 9, 5, 5]
    assert DecodeBuffers((0,), 4, 0, torch.device("cpu"), width=17, page=4).table[0].shape == (
        4, 32)  # fmt: skip
    lists = DecodeBuffers((0,), 4, 1024, torch.device("cpu"))
    assert lists.table == {} and lists.width == 0 and lists.capacity == 1024


def test_a_cuda_table_step_costs_the_host_two_device_operations():
    """Before a CUDA decode graph's replay a block-table step only copies its table and gathers
    its key offsets in, the padded sequences' with them (the write rows are derived inside the
    graph, the kernel reads the table): no per-step derivation on the host (its launches were
    what the table path added to the forward's host time over index lists), and each operation
    costs the host about ten microseconds on the H200 (``decode_forward_probe``)."""
    from types import SimpleNamespace

    from breakgraph.integrations.transformers.decode_graph import DecodeBuffers
    from torch.utils._python_dispatch import TorchDispatchMode

    VIEWS = ("slice", "select", "view", "expand", "alias", "squeeze", "as_strided")

    class Launches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in VIEWS:  # views launch nothing
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    n, bucket, blocks = 5, 8, 4
    table = torch.randint(0, 50, (1, n, blocks), dtype=torch.int32)
    cu_k = torch.arange(0, (n + 1) * 7, 7, dtype=torch.int32)
    step = SimpleNamespace(table=table, positions=cu_k[1:][None] - 1, cu_k=cu_k)
    buffers = DecodeBuffers((0,), bucket, 1024, torch.device("cpu"), blocks, 4, reads=False)
    buffers.fill(step, n, bucket, page=4, rows=n)  # the first fill also sets the source rows
    with Launches() as launches:
        buffers.fill(step, n, bucket, page=4, rows=n)
    assert launches.ops == ["copy_.default", "index_select.out"], launches.ops
    two = DecodeBuffers((0, 1), bucket, 1024, torch.device("cpu"), blocks, 4, reads=False)
    # fresh offsets, shrinking, steady, a full bucket, one sequence, the same size in a smaller
    # bucket: each step's own offsets and padding, each group's own table rows
    for n, size in ((5, 8), (3, 8), (3, 8), (8, 8), (1, 8), (3, 4), (3, 8)):
        cu_k = torch.randint(1, 40, (n + 1,), dtype=torch.int32).cumsum(0, dtype=torch.int32)
        step = SimpleNamespace(table=torch.randint(0, 50, (2, n, blocks), dtype=torch.int32),
                               cu_k=cu_k)  # fmt: skip
        for each in (buffers, two):
            each.fill(step, n, size, page=4, rows=n)
            offsets = each.cu_k["full_attention"][: size + 1].tolist()
            assert offsets == cu_k.tolist() + [cu_k[-1].item()] * (size - n)
        assert buffers.table[0][:n, :blocks].equal(step.table[0])
        assert two.table[0][:n, :blocks].equal(step.table[0])
        assert two.table[1][:n, :blocks].equal(step.table[1])
    with pytest.raises(InputError, match="key offsets hold 3 entries for 3 sequences"):
        short, table_before = torch.arange(3, dtype=torch.int32), buffers.table[0].clone()
        buffers.fill(SimpleNamespace(table=step.table, cu_k=short), 3, bucket, page=4, rows=3)
    assert buffers.table[0].equal(table_before)  # refused before any copy


@needs_cb
def test_the_step_indices_and_tables_equal_transformers_own(monkeypatch):
    """Every block-table step's indices, derived from the table, equal what transformers'
    ``extend_read_and_write_indices`` builds for the same requests (read before the step's
    update moves them on); and every request's row of the table, written through numpy while
    the model is enabled (the emulated backend's tables are in host memory, as asynchronous
    batching's are on CUDA), equals what transformers' own ``fill_block_table`` writes. The
    cache's layout is looked up once; ``disable()`` restores transformers' method."""
    from transformers.generation.continuous_batching import input_outputs

    cache_class = compat.block_table_filler()
    assert cache_class is not None, "fill_block_table not found (contract item 16)"
    fill = cache_class.__dict__["fill_block_table"]
    layouts = []
    writers = compat.block_table_writers
    monkeypatch.setattr(compat, "block_table_writers",
                        lambda cache: layouts.append(writers(cache)) or layouts[-1])  # fmt: skip
    checked = []
    original = input_outputs.ContinuousBatchingIOs.prepare_batch_tensors

    def prepare(self, *args, **kwargs):
        requests = kwargs["requests_in_batch"] if "requests_in_batch" in kwargs else args[0]
        states = [(r.state.request_id, r.state.position_offset, r.query_length) for r in requests]
        original(self, *args, **kwargs)
        if not self.use_block_table:
            return
        assert cache_class.fill_block_table is not fill  # breakgraph's, while enabled
        theirs = torch.full_like(self.block_table, -1)
        for i, (request_id, past, query) in enumerate(states):
            fill(self.cache, request_id, past, query, theirs[:, i])
        assert torch.equal(self.block_table[:, : len(states)], theirs[:, : len(states)])
        groups = self.block_table.shape[0]
        reads, writes = [[] for _ in range(groups)], [[] for _ in range(groups)]
        for request_id, past, query in states:
            self.cache.extend_read_and_write_indices(request_id, past, query, reads, writes)
        page = compat.block_table_page(self.cache)
        n = len(states)
        lengths = [past + query for _, past, query in states]
        cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        positions = torch.tensor([past for _, past, _ in states])
        for group in range(groups):
            table = self.block_table[group, :n]
            rows = int(cu_k[-1])
            assert block_table.read_slots(table, cu_k, page, rows).tolist() == list(reads[group])
            assert block_table.write_slots(table, positions, page).tolist() == list(writes[group])
        checked.append(n)

    monkeypatch.setattr(input_outputs.ContinuousBatchingIOs, "prepare_batch_tensors", prepare)
    model = build_model("llama")
    prompts = random_prompts(seed=21)
    with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS):
        generate_batch(model, prompts, cbc=cb_config(block_size=8))
    assert len(checked) > 1 and max(checked) > 1, checked  # several steps of several requests
    assert cache_class.__dict__["fill_block_table"] is fill
    assert len(layouts) == 1 and layouts[0] is not None, layouts  # one lookup, a known layout


@needs_cb
@pytest.mark.parametrize("through", ["graph", "break"])
def test_block_table_steps_equal_the_index_list_steps(through):
    """fp32 logprobs through the block table equal those through index lists
    (``max_blocks_per_request=0``), the steps served by the decode graphs or, with their
    capture failing, materialised for the breaks; every pure-decode step came with a table."""
    model = build_model("llama")
    prompts = random_prompts(seed=22)
    with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS) as handle:
        lists = generate_batch(model, prompts, cbc=cb_config(max_blocks_per_request=0,
                                                             return_logprobs=True), logprobs=True)
        assert handle.runner.block_table_steps == {"graph": 0, "break": 0}
    with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS) as handle:
        if through == "break":  # as after a failed capture
            handle.decode_graphs.off = "turned off by the test"
        tables = generate_batch(model, prompts, cbc=cb_config(return_logprobs=True),
                                logprobs=True)
        steps = dict(handle.runner.block_table_steps)
    assert tables[0] == lists[0]
    assert_logprobs_close(tables[1], lists[1])
    other = "break" if through == "graph" else "graph"
    assert steps[through] > 0 and steps[other] == 0, steps


@needs_cb
def test_the_gate_keeps_the_fast_path_for_enabled_models_only():
    """While a model is enabled, transformers' gate keeps ``max_blocks_per_request`` for that
    model's config and still zeroes it for any other non-flash config; ``disable()`` restores
    the gate. A model with sliding-window layers keeps the index lists."""
    found = compat.decode_path_gate()
    assert found is not None, "transformers' decode-fast-path gate not found (contract item 14)"
    module, name = found
    original = getattr(module, name)
    model, other = build_model("llama"), build_model("llama")

    def gated(config) -> int:
        cbc = cb_config(max_blocks_per_request=8)
        getattr(module, name)(config, cbc, True)
        return cbc.max_blocks_per_request

    with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS) as handle:
        assert handle.runner.block_tables
        assert gated(model.config) == 8
        assert gated(other.config) == 0
    assert getattr(module, name) is original
    sliding = build_model("mistral")
    with enable_continuous_batching(sliding, backend="emulated", query_buckets=BUCKETS) as handle:
        assert not handle.runner.block_tables
        assert gated(sliding.config) == 0


@needs_cb
def test_heads_the_kernel_cannot_take_keep_the_index_lists(monkeypatch):
    """Where the decode kernel cannot run the model's heads (no Triton, a head size it cannot
    tile), the decode graphs would never serve a table step: the lists stay, and no step
    comes with a table."""
    from breakgraph.integrations.transformers import decode_graph

    asked = []

    def problem(self, kv_heads, head_dim, device):
        asked.append((kv_heads, head_dim))
        return "the test's kernel takes no heads"

    monkeypatch.setattr(decode_graph.DecodeGraphs, "kernel_problem", problem)
    model = build_model("llama")
    prompts = random_prompts(seed=25)
    expected = generate_batch(model, prompts)
    with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS) as handle:
        assert not handle.runner.block_tables
        assert generate_batch(model, prompts) == expected
        assert handle.runner.block_table_steps == {"graph": 0, "break": 0}
    config = model.config  # asked when enabled, and again by the first decode step's graphs
    assert asked[0] == (config.num_key_value_heads,
                        config.hidden_size // config.num_attention_heads)  # fmt: skip
    assert handle.decode_graphs.off == "the test's kernel takes no heads"


def test_the_fill_leaves_other_tables_and_layouts_to_transformers():
    """A device table, a layout the probe does not know, or a request the cache does not hold
    go to transformers' own method (which raises its own error for the last)."""
    calls = []

    def original(cache, request_id, past, query, table):
        calls.append(request_id)

    class Manager:
        block_size, block_table = 4, {"a": [7, 3, 9]}

    class Cache:
        group_cache_managers = [Manager()]

    table = torch.full((1, 4), -1, dtype=torch.int32)
    block_table.fill_block_table(original, Cache(), "a", 4, 1, table)  # 5 keys: 2 blocks
    assert table.tolist() == [[7, 3, -1, -1]] and calls == []
    block_table.fill_block_table(original, Cache(), "b", 4, 1, table)
    block_table.fill_block_table(original, Cache(), "a", 4, 1, table.to("meta"))
    block_table.fill_block_table(original, object(), "a", 4, 1, table)
    assert calls == ["b", "a", "a"]


def test_the_fill_keeps_one_numpy_view_per_slot_and_writes_through_its_own_strides():
    """transformers passes a fresh view of the same slot of the same table every step: the
    fill keeps its numpy view (by address, strides and dtype) instead of converting each
    call; a view at the same address with other strides, shape or dtype is written as
    itself, new tables do not pile up, and the kept views go with the cache."""
    import gc
    import weakref

    class Manager:
        block_size, block_table = 4, {"a": [7, 3, 9], "b": [5]}

    class Cache:
        group_cache_managers = [Manager()]

    cache = Cache()
    kept_before = len(block_table._fills)
    table = torch.full((1, 4, 4), -1, dtype=torch.int32)  # [groups, slots, blocks]
    for past in (4, 5, 6):  # 5-7 keys: 2 blocks
        block_table.fill_block_table(None, cache, "a", past, 1, table[:, 0])
        block_table.fill_block_table(None, cache, "b", 0, 1, table[:, 2])
    assert table[0].tolist() == [[7, 3, -1, -1], [-1] * 4, [5, -1, -1, -1], [-1] * 4]
    assert len(block_table._fills[cache].views) == 2  # one view per slot, kept across steps
    across = table.permute(0, 2, 1)[:, 0]  # block 0 of every slot: slot 0's address and shape
    block_table.fill_block_table(None, cache, "a", 8, 1, across)  # 3 blocks
    assert table[0, :, 0].tolist() == [7, 3, 9, -1] and table[0, 0].tolist() == [7, 3, -1, -1]
    block_table.fill_block_table(None, cache, "b", 0, 1, table[:, 1])
    as_float = table.view(torch.float32)[:, 1]  # slot 1's address, strides and shape
    block_table.fill_block_table(None, cache, "b", 0, 1, as_float)
    assert as_float[0, 0].item() == 5.0  # written as floats, not through the int32 view
    block_table.fill_block_table(None, cache, "b", 0, 1, table[:, 3])
    shorter = table[:, 3, :2]  # slot 3's address and strides, two blocks: three do not fit
    with pytest.raises(ValueError):
        block_table.fill_block_table(None, cache, "a", 8, 1, shorter)
    assert table[0, 3].tolist() == [5, -1, -1, -1]
    # a caller handing in a new table every step: the cache holds at most MAX_TABLES of them
    fill = block_table._fills[cache]
    for _ in range(3 * block_table.MAX_TABLES):
        fresh = torch.full((1, 4, 4), -1, dtype=torch.int32)
        block_table.fill_block_table(None, cache, "a", 4, 1, fresh[:, 1])
        assert fresh[0, 1].tolist() == [7, 3, -1, -1]
        assert len(fill.tables) <= block_table.MAX_TABLES
    alive = weakref.ref(cache)
    del cache
    gc.collect()
    assert alive() is None and len(block_table._fills) <= kept_before


@needs_cb
def test_eager_steps_and_unknown_layouts_keep_working(monkeypatch):
    """With ``use_cuda_graph=False`` the steps keep the index lists (no table to materialise
    every step); a release whose table layout the probe does not know fails the step with the
    fix named, not with a wrong answer."""
    model = build_model("llama")
    prompts = random_prompts(seed=23)
    expected = generate_batch(model, prompts)
    with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS) as handle:
        assert generate_batch(model, prompts, cbc=cb_config(use_cuda_graph=False)) == expected
        assert handle.runner.block_table_steps == {"graph": 0, "break": 0}
    monkeypatch.setattr(compat, "block_table_page", lambda cache: None)
    monkeypatch.setattr(cb_step.compat, "block_table_page", lambda cache: None)
    with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS):
        outs = model.generate_batch(prompts, continuous_batching_config=cb_config(),
                                    progress_bar=False)  # fmt: skip
    errors = [o.error for o in outs.values() if o.error]
    assert errors and all("max_blocks_per_request=0" in e for e in errors), errors


@needs_cb
@pytest.mark.parametrize(
    "where", ["emulated", pytest.param("cuda-async", marks=pytest.mark.requires_cuda)]
)
def test_a_decode_steps_positions_are_its_key_counts_less_one(monkeypatch, where):
    """Every block-table decode step's new key sits at position ``keys - 1`` of its sequence
    (its position id equals its key count, from the step's key offsets, less one): what a
    write row derived from the table and the key offsets alone would rely on. On CUDA with
    asynchronous batching, where such a derivation inside the decode graph once gave tokens
    unlike the index lists' (issue 23's notes), this checks the invariant itself."""
    from breakgraph.integrations.transformers import decode_graph

    seen, fill = [], decode_graph.DecodeBuffers.fill

    def checked(self, step, n, bucket, page=0, rows=0):
        if step.table is not None:  # copies on the step's stream, no sync: timing unchanged
            cu_k = step.cu_k["full_attention"] if isinstance(step.cu_k, dict) else step.cu_k
            seen.append((step.positions[0, :n].clone(), (cu_k[1 : n + 1] - cu_k[:n]) - 1))
        return fill(self, step, n, bucket, page, rows)

    monkeypatch.setattr(decode_graph.DecodeBuffers, "fill", checked)
    cuda = where.startswith("cuda")
    model = build_model("llama", **({"device": "cuda", "dtype": torch.bfloat16} if cuda else {}))
    backend = {} if cuda else {"backend": "emulated"}
    with enable_continuous_batching(model, query_buckets=BUCKETS, **backend):
        generate_batch(model, random_prompts(seed=27), cbc=cb_config())
    assert seen, "no block-table decode step reached the decode graphs"
    for positions, last_keys in seen:
        assert positions.tolist() == last_keys.tolist(), (positions, last_keys)


@needs_cb
@pytest.mark.requires_cuda
@pytest.mark.parametrize("async_batching", [False, None], ids=["sync", "async"])
def test_cuda_bf16_block_table_steps_equal_the_index_list_steps(async_batching):
    """bf16 on the GPU (the Triton kernel in the decode graphs): the same read rows in the same
    order, so the tokens through the block table equal those through index lists, exactly,
    synchronous and asynchronous (transformers copies the table from its host buffers). Every
    request is queued before transformers' loop starts, so both runs batch alike (bf16 tokens
    of differently composed batches may differ on near ties)."""
    model = build_model("llama", device="cuda", dtype=torch.bfloat16)
    prompts = random_prompts(seed=24)
    runs = {}
    for blocks in (0, None):
        cbc = cb_config(max_blocks_per_request=blocks, use_async_batching=async_batching)
        with enable_continuous_batching(model, query_buckets=BUCKETS) as handle:
            runs[blocks] = generate_queued(model, prompts, cbc=cbc)
            steps = dict(handle.runner.block_table_steps)
        assert handle.decode_graphs.off is None, handle.decode_graphs.off
        assert (steps["graph"] > 0) == (blocks is None) and steps["break"] == 0, steps
    assert runs[None] == runs[0]
