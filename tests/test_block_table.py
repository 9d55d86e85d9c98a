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

from tests.test_continuous_batching import (  # noqa: E402
    BUCKETS,
    assert_logprobs_close,
    build_model,
    cb_config,
    generate_batch,
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


@needs_cb
def test_the_step_indices_equal_transformers_own_lists(monkeypatch):
    """Every block-table step's indices, derived from the table, equal what transformers'
    ``extend_read_and_write_indices`` builds for the same requests (read before the step's
    update moves them on)."""
    from transformers.generation.continuous_batching import input_outputs

    checked = []
    original = input_outputs.ContinuousBatchingIOs.prepare_batch_tensors

    def prepare(self, *args, **kwargs):
        requests = kwargs["requests_in_batch"] if "requests_in_batch" in kwargs else args[0]
        states = [(r.state.request_id, r.state.position_offset, r.query_length) for r in requests]
        original(self, *args, **kwargs)
        if not self.use_block_table:
            return
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
            assert block_table.read_slots(table, cu_k, page, int(cu_k[-1])).tolist() == reads[group]
            assert block_table.write_slots(table, positions, page).tolist() == writes[group]
        checked.append(n)

    monkeypatch.setattr(input_outputs.ContinuousBatchingIOs, "prepare_batch_tensors", prepare)
    model = build_model("llama")
    prompts = random_prompts(seed=21)
    with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS):
        generate_batch(model, prompts, cbc=cb_config(block_size=8))
    assert len(checked) > 1 and max(checked) > 1, checked  # several steps of several requests


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
@pytest.mark.requires_cuda
@pytest.mark.parametrize("async_batching", [False, None], ids=["sync", "async"])
def test_cuda_bf16_block_table_steps_equal_the_index_list_steps(async_batching):
    """bf16 on the GPU (the Triton kernel in the decode graphs): the same read rows in the same
    order, so the tokens through the block table equal those through index lists, exactly,
    synchronous and asynchronous (transformers copies the table from its host buffers)."""
    model = build_model("llama", device="cuda", dtype=torch.bfloat16)
    prompts = random_prompts(seed=24)
    runs = {}
    for blocks in (0, None):
        cbc = cb_config(max_blocks_per_request=blocks, use_async_batching=async_batching)
        with enable_continuous_batching(model, query_buckets=BUCKETS) as handle:
            runs[blocks] = generate_batch(model, prompts, cbc=cbc)
            steps = dict(handle.runner.block_table_steps)
        assert handle.decode_graphs.off is None, handle.decode_graphs.off
        assert (steps["graph"] > 0) == (blocks is None) and steps["break"] == 0, steps
    assert runs[None] == runs[0]
