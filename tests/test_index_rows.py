"""transformers' paged-cache rows computed in numpy (``index_rows``, contract item 20).

The row arithmetic against a plain Python transcription of transformers' own (full-attention
blocks, sliding rings wrapping, queries longer than the ring, strides wider than a page);
real CB runs whose every call is compared with transformers' method, tokens and logprobs equal
stock's; a release whose rows differ turns the numpy rows off (a warning, the right tokens);
unknown layouts and requests go to transformers; and the replacement's scope.
"""

from __future__ import annotations

import doctest
import logging
import random

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from breakgraph.integrations.transformers import (  # noqa: E402
    compat,
    enable_continuous_batching,
    index_rows,
)
from breakgraph.integrations.transformers.index_lists import NumpyLists  # noqa: E402
from breakgraph.integrations.transformers.index_rows import Group, RowChunks  # noqa: E402

from breakgraph.patches import PatchSet  # noqa: E402
from tests.test_continuous_batching import (  # noqa: E402
    BUCKETS,
    assert_logprobs_close,
    build_model,
    cb_config,
    generate_batch,
    generation_config,
    needs_cb,
    random_prompts,
)

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("one_cpu_thread")]
original_rows = Group.rows


def test_docstring_examples():
    result = doctest.testmod(index_rows)
    assert result.attempted > 0 and result.failed == 0


def reference(ids, page, stride, window, sentinel, trash, past, query):
    """transformers' ``get_write_indices`` / ``get_read_indices`` (5.17's full and sliding
    managers, in one int at a time): ``(write rows, read rows)``."""

    def row(slot):
        return ids[slot // page] * stride + slot % page

    if window is None:
        return [row(j) for j in range(past, past + query)], [row(j) for j in range(past + query)]
    kept = min(query, window)
    start = (past + query - kept) % window
    write = [trash] * (query - kept) + [row((start + i) % window) for i in range(kept)]
    cached = min(past, window - 1)
    first = (past - cached) % window
    read = [row((first + i) % window) for i in range(cached)] + [sentinel] * query
    return write, read


@pytest.mark.parametrize("seed", range(4))
def test_rows_equal_transformers_arithmetic(seed):
    """Random requests: full-attention groups and sliding rings (windows shorter than, equal to
    and longer than a page, rings wrapping many times, queries longer than the ring), pages of
    1 to 16 tokens, strides of one page and wider (later releases' blocks of several layers)."""
    rng = random.Random(seed)
    for _ in range(500):
        page = rng.choice([1, 2, 4, 8, 16])
        stride = page * rng.choice([1, 3])
        window = rng.choice([None, None, 1, 2, 3, 5, 8, 16, 17, 40])
        past, query = rng.randrange(0, 120), rng.choice([1, 1, 2, 7, 30, 64])
        keys = past + query if window is None else min(past + query, window)
        ids = rng.sample(range(2, 500), -(-keys // page) + rng.randrange(0, 2))
        owner = type("Owner", (), {})()
        owner.block_table = {"r": ids}
        group = Group(owner, page, stride, window, sentinel=1, trash=9999)
        for reads in (True, False):
            write, read = group.rows("r", past, query, reads)
            want_write, want_read = reference(ids, page, stride, window, 1, 9999, past, query)
            assert np.concatenate(write).tolist() == want_write, (page, window, past, query)
            if reads:
                assert np.concatenate(read).tolist() == want_read, (page, window, past, query)
            else:
                assert read is None


def test_unknown_requests_and_short_block_lists_go_to_transformers():
    owner = type("Owner", (), {"block_table": {"r": [3]}})()
    assert Group(owner, 4, 4, None, 0, 0).rows("other", 0, 1, True) is None
    assert Group(owner, 4, 4, None, 0, 0).rows("r", 4, 1, True) is None  # 5 keys, 1 block
    assert Group(owner, 4, 4, 8, 1, 99).rows("r", 4, 1, True) is None  # 5 slots of 8
    assert Group(owner, 4, 4, 4, 1, 99).rows("r", 40, 1, True) is not None  # a ring of 4


def test_row_chunks_stand_for_the_list_they_replace():
    """``extend`` with a list (transformers' own method), ``len`` and iteration as on a list;
    :class:`NumpyLists` converts them to the tensor ``torch.tensor`` makes of the list."""
    chunks = RowChunks()
    assert len(chunks) == 0 and chunks.array().dtype == np.int64
    assert NumpyLists().tensor(chunks, dtype=torch.int64).shape == (0,)
    values = torch.randint(0, 2**40, (300,)).tolist()
    chunks.extend(values[:100])
    chunks.add(np.asarray(values[100:250], dtype=np.int64))
    chunks.add(np.asarray(values[250:], dtype=np.int64))
    assert len(chunks) == 300 and list(chunks) == values
    for dtype in (torch.int64, None):
        got = NumpyLists().tensor(chunks, dtype=dtype)
        assert got.dtype == torch.int64 and torch.equal(got, torch.tensor(values))
    small = RowChunks(list(range(50)))
    assert torch.equal(NumpyLists().tensor(small, dtype=torch.int32),
                       torch.arange(50, dtype=torch.int32))  # fmt: skip


def test_the_layout_probe_knows_only_its_two_layouts():
    class Full:
        block_size = 4
        block_table: dict = {}

    class Sliding(Full):
        sliding_window, sentinel_index, write_trash_index = 6, 1, 999

    class Cache517:
        group_cache_managers = [Full(), Sliding()]

    groups = compat.index_groups(Cache517())
    assert [g[1:] for g in groups] == [(4, 4, None, 0, 0), (4, 4, 6, 1, 999)]

    class Allocator:
        tokens_per_page, block_physical_stride = 4, 12
        block_table: dict = {}
        sliding_window, sentinel_index, write_trash_index = 6, 1, 999

    class Cache:
        cache_allocators = {"full_attention": Allocator(), "sliding_attention": Allocator()}

    assert [g[1:] for g in compat.index_groups(Cache())] == [(4, 12, None, 0, 0),
                                                            (4, 12, 6, 1, 999)]  # fmt: skip
    Cache.cache_allocators = {"chunked_attention": Allocator()}
    assert compat.index_groups(Cache()) is None  # an attention type it does not know
    Allocator.sliding_window = None
    Cache.cache_allocators = {"sliding_attention": Allocator()}
    assert compat.index_groups(Cache()) is None  # a ring without its window
    Sliding.sentinel_index = None
    assert compat.index_groups(Cache517()) is None
    assert compat.index_groups(object()) is None


def _warnings(caplog) -> list[str]:
    """The messages ``index_rows`` logged (transformers' own loggers may propagate too)."""
    return [r.getMessage() for r in caplog.records if r.name == index_rows.logger.name]


@pytest.fixture
def every_call_checked(monkeypatch):
    """Every call compares its rows with transformers' method; returns the calls' count."""
    calls = []
    checked = index_rows._checked

    def counted(*args, **kwargs):
        calls.append(1)
        return checked(*args, **kwargs)

    monkeypatch.setattr(index_rows, "CHECKS", 10**9)
    monkeypatch.setattr(index_rows, "_checked", counted)
    return calls


@needs_cb
@pytest.mark.parametrize("arch, window, page", [
    ("qwen2_hybrid", 5, 4), ("mistral", 8, 8), ("llama", None, 4), ("llama", None, 8)])
def test_cb_rows_equal_transformers_own_at_every_call(arch, window, page, every_call_checked,
                                                      caplog):  # fmt: skip
    """Real runs (emulated backend): rings wrapping, prompts chunked past the ring, decode
    steps, and (full attention, pages of 8) prompts sharing a prefix, whose later requests read
    the first one's blocks; every call of the run computes its rows in numpy, compares them
    with transformers' method (none differs) and the tokens and logprobs equal stock
    continuous batching's."""
    extra = {} if window is None else {"sliding_window": window}
    model = build_model(arch, **extra)
    prompts = random_prompts(seed=31, lengths=(1, 23, 2, 40, 9))
    if page == 8 and window is None:  # a shared prefix of 33 tokens (4 blocks and one)
        base = random_prompts(seed=9, lengths=(33,))[0]
        prompts = [base + tail for tail in random_prompts(seed=10, lengths=(3, 7, 12))] + [base]
    gen = generation_config(max_new_tokens=14)
    cbc = lambda: cb_config(block_size=page, num_blocks=256, return_logprobs=True,  # noqa: E731
                            max_blocks_per_request=0)  # index lists on decode steps too
    expected, ref_logprobs = generate_batch(model, prompts, gen=gen, cbc=cbc(), logprobs=True)
    with caplog.at_level(logging.WARNING, logger=index_rows.__name__):
        with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS):
            tokens, logprobs = generate_batch(model, prompts, gen=gen, cbc=cbc(), logprobs=True)
    assert not _warnings(caplog), _warnings(caplog)
    assert len(every_call_checked) >= 5 * 10, len(every_call_checked)
    assert tokens == expected
    assert_logprobs_close(logprobs, ref_logprobs)
    cache_class = compat.index_list_builder()
    assert not hasattr(cache_class.extend_read_and_write_indices, "__wrapped__")  # restored


def _allocator(kind: str):
    """transformers' ``FullAttentionCacheAllocator`` or ``SlidingAttentionCacheAllocator``
    (5.18 on, then 5.17)."""
    try:
        from transformers.generation.continuous_batching import cache_allocators as module
    except ImportError:
        from transformers.generation.continuous_batching import cache_manager as module
    return getattr(module, f"{kind}AttentionCacheAllocator")


@needs_cb
def test_one_call_in_check_every_is_compared_for_the_cache_s_life(monkeypatch, caplog):
    """After the first calls, one call in ``CHECK_EVERY`` is still compared: a release whose
    full-attention rows differ only late in a request (here: a decode step's keys in reverse
    order past 25 keys, which attention serves the same) is caught there, with the warning,
    and the tokens stay stock's on that release."""
    full = _allocator("Full")
    original = full.get_read_indices

    def reversed_late(self, request_id, past_length, query_length):
        read = original(self, request_id, past_length, query_length)
        return read[::-1] if query_length == 1 and past_length > 25 else read

    monkeypatch.setattr(full, "get_read_indices", reversed_late)
    monkeypatch.setattr(index_rows, "CHECKS", 0)
    monkeypatch.setattr(index_rows, "CHECK_EVERY", 7)
    model = build_model("llama")
    prompts = random_prompts(seed=23, lengths=(20, 3, 9))
    gen = generation_config(max_new_tokens=14)
    cbc = lambda: cb_config(max_blocks_per_request=0)  # noqa: E731  (index lists every step)
    expected = generate_batch(model, prompts, gen=gen, cbc=cbc())
    with caplog.at_level(logging.WARNING, logger=index_rows.__name__):
        with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS):
            assert generate_batch(model, prompts, gen=gen, cbc=cbc()) == expected
    warned = _warnings(caplog)
    assert len(warned) == 1 and "contract item 20" in warned[0], warned


@needs_cb
def test_rows_that_differ_from_transformers_turn_off_for_the_cache(monkeypatch, caplog):
    """A release whose sliding read rows are laid out otherwise (here: the sentinel first on
    decode steps, which transformers' own attention serves as well) is caught by the check:
    a warning naming item 20, transformers' rows from then on, the tokens those of stock on
    that release."""
    Allocator = _allocator("Sliding")
    original = Allocator.get_read_indices

    def sentinel_first(self, request_id, past_length, query_length):
        read = original(self, request_id, past_length, query_length)
        return read[-1:] + read[:-1] if query_length == 1 else read

    monkeypatch.setattr(Allocator, "get_read_indices", sentinel_first)
    model = build_model("qwen2_hybrid", sliding_window=5)
    prompts = random_prompts(seed=22, lengths=(13, 2, 30))
    gen = generation_config(max_new_tokens=12)
    expected = generate_batch(model, prompts, gen=gen)
    rows = []
    monkeypatch.setattr(Group, "rows", lambda self, *a: rows.append(1) or original_rows(self, *a))
    with caplog.at_level(logging.WARNING, logger=index_rows.__name__):
        with enable_continuous_batching(model, backend="emulated", query_buckets=BUCKETS):
            assert generate_batch(model, prompts, gen=gen) == expected
    warned = _warnings(caplog)
    assert len(warned) == 1 and "contract item 20" in warned[0], warned
    assert rows, "the numpy rows never ran"


def test_installed_only_with_the_numpy_conversion_and_a_known_method(monkeypatch):
    cache_class = compat.index_list_builder()
    assert cache_class is not None, "extend_read_and_write_indices not found (item 20)"
    method = cache_class.__dict__["extend_read_and_write_indices"]
    with PatchSet() as patches:
        assert not index_rows.install(patches, lists_installed=False)
        assert cache_class.__dict__["extend_read_and_write_indices"] is method
        assert index_rows.install(patches, lists_installed=True)
        assert cache_class.__dict__["extend_read_and_write_indices"].__wrapped__ is method
    assert cache_class.__dict__["extend_read_and_write_indices"] is method

    def renamed(self, request_id, past_length, query_length, read, write):
        return None

    monkeypatch.setattr(cache_class, "extend_read_and_write_indices", renamed)
    assert compat.index_list_builder() is None
    with PatchSet() as patches:
        assert not index_rows.install(patches, lists_installed=True)
