"""The suite's own scheduling (``tests/conftest.py``): the slow tests first, spread over the
pytest-xdist workers' first chunks, and the ``transformers`` marker set before ``-m`` selects."""

import types

import pytest

from tests import conftest

SLOW = [
    "tests/test_prefill_compile.py::test_a[cuda]",  # a module listed whole: one unit
    "tests/test_prefill_compile.py::test_b",
    "tests/test_continuous_batching.py::test_cuda_tokens_equal_generate_while_the_gpu_is_busy[x]",
    "tests/test_continuous_batching.py::test_cuda_tokens_equal_generate_while_the_gpu_is_busy[y]",
    "tests/test_continuous_batching.py::test_cuda_compiled_decoder_agrees_with_paged_sdpa",
]


def _items(ids):
    return [types.SimpleNamespace(nodeid=i) for i in ids]


def test_each_workers_first_chunk_starts_with_its_share_of_the_slow_tests():
    others = [f"tests/test_z.py::test_{i}" for i in range(95)]
    ids = others[:40] + SLOW + others[40:]  # 100 tests: chunks of 100 // 4 // 4 = 6
    order = [i.nodeid for i in conftest.layout(_items(ids), 4)]
    assert sorted(order) == sorted(ids)
    chunks = [order[k * 6 : (k + 1) * 6] for k in range(4)]
    assert chunks[0][:2] == SLOW[:2]  # the module, together
    assert chunks[1][0] == SLOW[2] and chunks[2][0] == SLOW[3] and chunks[3][0] == SLOW[4]
    assert [i for i in order if i in others] == others  # every other test keeps its order
    # one worker, or none: the slow tests first, in START_FIRST's order
    assert [i.nodeid for i in conftest.layout(_items(ids), 1)] == SLOW + others


def test_the_layout_follows_the_worker_count_pytest_xdist_sets(monkeypatch):
    ids = [f"tests/test_z.py::test_{i}" for i in range(30)] + SLOW[2:4]
    for count, second in (("2", 4), (None, 1)):  # chunks of 32 // 2 // 4 = 4
        if count:
            monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
        else:
            monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
        items = _items(ids)
        conftest.pytest_collection_modifyitems(None, items)
        assert items[0].nodeid == SLOW[2] and items[second].nodeid == SLOW[3]


@pytest.mark.parametrize("module, marked", [("tests.test_transformers", True),
                                            ("tests.test_graph", False)])  # fmt: skip
def test_transformers_tests_are_marked_as_they_are_collected(module, marked):
    added = []
    item = types.SimpleNamespace(module=types.SimpleNamespace(__name__=module),
                                 add_marker=added.append)  # fmt: skip
    conftest.pytest_itemcollected(item)
    assert [m.name for m in added] == (["transformers"] if marked else [])
