"""The suite's own scheduling (``tests/conftest.py``): the slow tests dealt over the
pytest-xdist workers' first chunks, and the ``transformers`` marker set before ``-m`` selects."""

import sys
import threading
import types

import pytest

from tests import conftest, helpers

COMPILE = ["tests/test_prefill_compile.py::test_a[cuda]",  # a module listed whole: one unit
           "tests/test_prefill_compile.py::test_b"]  # fmt: skip
BUSY = "tests/test_continuous_batching.py::test_cuda_tokens_equal_generate_while_the_gpu_is_busy"
COMPILED = "tests/test_continuous_batching.py::test_cuda_compiled_decoder_agrees_with_paged_sdpa"
SLOW = [*COMPILE, f"{BUSY}[x]", f"{BUSY}[y]", COMPILED]


def _items(ids, skipped=()):
    def item(nodeid):
        marks = [types.SimpleNamespace(args=(True,))] if nodeid in skipped else []
        return types.SimpleNamespace(
            nodeid=nodeid, iter_markers=lambda name: marks if name == "skipif" else []
        )

    return [item(i) for i in ids]


def _chunks(order, size, workers):
    return [order[k * size : (k + 1) * size] for k in range(workers)]


def test_the_costliest_slow_tests_go_to_the_least_loaded_workers_first_chunks():
    others = [f"tests/test_z.py::test_{i}" for i in range(95)]
    ids = others[:40] + SLOW + others[40:]  # 100 tests: chunks of 100 // 4 // 4 = 6
    order = [i.nodeid for i in conftest.layout(_items(ids), 4)]
    assert sorted(order) == sorted(ids)
    chunks = _chunks(order, 6, 4)
    # the compiled decoder (50 s), the compiles (46 s, together), then a busy case each
    assert chunks[0][0] == COMPILED and chunks[1][:2] == COMPILE
    assert chunks[2][0] == f"{BUSY}[x]" and chunks[3][0] == f"{BUSY}[y]"
    assert [i for i in order if i in others] == others  # every other test keeps its order
    # one worker, or none: the slow tests first, in START_FIRST's order
    assert [i.nodeid for i in conftest.layout(_items(ids), 1)] == SLOW + others


def test_a_unit_larger_than_a_chunk_or_skipped_whole_is_not_dealt_and_never_split():
    others = [f"tests/test_z.py::test_{i}" for i in range(20)]
    tp = [f"tests/test_tensor_parallel.py::test_{i}" for i in range(5)]  # one unit of 5
    ids = tp + [COMPILED] + others + [f"{BUSY}[x]"]
    order = [i.nodeid for i in conftest.layout(_items(ids, skipped={f"{BUSY}[x]"}), 2, chunk=3)]
    assert sorted(order) == sorted(ids)
    assert _chunks(order, 3, 2) == [[COMPILED, *others[:2]], others[2:5]]
    assert order[6:12] == [*tp, f"{BUSY}[x]"]  # right after the chunks, the module whole
    assert order[12:] == others[5:]


def test_the_layout_follows_the_worker_count_and_maxschedchunk(monkeypatch):
    ids = [f"tests/test_z.py::test_{i}" for i in range(30)] + [f"{BUSY}[x]", f"{BUSY}[y]"]
    config = types.SimpleNamespace(option=types.SimpleNamespace(maxschedchunk=None))
    for count, most, second in (("2", None, 4), ("2", 3, 3), (None, None, 1)):
        if count:  # pytest-xdist's workers: chunks of 32 // 2 // 4 = 4, or --maxschedchunk 3
            monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
        else:
            monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
        config.option.maxschedchunk = most
        items = _items(ids)
        conftest.pytest_collection_modifyitems(config, items)
        assert items[0].nodeid == f"{BUSY}[x]" and items[second].nodeid == f"{BUSY}[y]"


def test_the_layout_runs_after_deselection():
    """trylast: after ``-m``/``-k`` deselected, so the chunks are those of the tests the
    workers run."""
    assert conftest.pytest_collection_modifyitems.pytest_impl["trylast"]


@pytest.mark.parametrize("module, marked", [("tests.test_transformers", True),
                                            ("tests.test_graph", False)])  # fmt: skip
def test_transformers_tests_are_marked_as_they_are_collected(module, marked):
    added = []
    item = types.SimpleNamespace(module=types.SimpleNamespace(__name__=module),
                                 add_marker=added.append)  # fmt: skip
    conftest.pytest_itemcollected(item)
    assert [m.name for m in added] == (["transformers"] if marked else [])


@pytest.mark.parametrize("params, skipped", [({"arch": "ghost"}, True), ({"family": "ghost"}, True),
                                              ({"arch": "llama"}, False), ({}, False)])
def test_a_family_the_installed_transformers_lacks_is_skipped(params, skipped, monkeypatch):
    """A family that arrived after the oldest supported release: its tests are skipped where
    the installed transformers has no config class for it (a stand-in family whose class no
    release has); other families and tests without one run."""
    pytest.importorskip("transformers")
    from benchmarks import tiny_models

    monkeypatch.setitem(tiny_models.OTHER_DENSE_FAMILIES, "ghost", ("GhostConfig", {}))
    added = []
    item = types.SimpleNamespace(module=types.SimpleNamespace(__name__="tests.test_transformers"),
                                 add_marker=added.append,
                                 callspec=types.SimpleNamespace(params=params))  # fmt: skip
    conftest.pytest_itemcollected(item)
    reasons = [m.kwargs["reason"] for m in added if m.name == "skip"]
    assert reasons == (["this transformers has no GhostConfig"] if skipped else [])


def test_this_sessions_transformers_tests_carry_the_marker(request):
    """Wired end to end, without a second pytest (10 s on two cores): every test of a
    transformers module in this session was marked while it was collected, so ``-m
    transformers`` (.ci/run's second leg) sees it; ``-m "not transformers"`` has none here."""
    ours = [
        item
        for item in request.session.items
        if item.nodeid.partition(".py")[0].rpartition("/")[2] in conftest.TRANSFORMERS_MODULES
    ]
    if not ours:
        pytest.skip("no transformers test selected in this session")
    assert all(item.get_closest_marker("transformers") for item in ours)


def test_the_layout_docstring_example_runs():
    import doctest

    assert doctest.testmod(conftest, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0


def _manager_class(event_name):
    class Manager:
        def __init__(self):
            setattr(self, event_name, threading.Event())
            self.joined = None

        def join(self, stop_trigger_time, timeout=None):
            # what transformers' own join finds when it runs: the idle loop woken, or not
            event = getattr(self, event_name, None)
            self.joined = (event is not None and event.is_set(), stop_trigger_time, timeout)

    return Manager


@pytest.mark.parametrize("event_name", ["_has_new_requests", "_wake_up_loop"])  # 5.17; 5.24 on
def test_a_join_wakes_the_cb_loop_before_transformers_join_waits(event_name):
    """``helpers.joins_wake_the_cb_loop``: the join sets the loop's event, then runs the
    original join with the caller's arguments; a manager without the event is joined as
    before; the patch is undone with the monkeypatch."""
    manager = _manager_class(event_name)
    original = manager.join
    with pytest.MonkeyPatch.context() as patches:
        helpers.joins_wake_the_cb_loop(patches, manager)
        woken = manager()
        woken.join(12.5, 60)
        assert woken.joined == (True, 12.5, 60)
        woken = manager()
        woken.join(3.0)
        assert woken.joined == (True, 3.0, None)
        eventless = manager()
        delattr(eventless, event_name)
        eventless.join(1.0)
        assert eventless.joined == (False, 1.0, None)
    assert manager.join is original


def test_the_session_wraps_transformers_join():
    """The session fixture (``conftest.cb_stops_without_the_idle_poll``) wraps the manager's
    join for the session, where collection imported transformers' continuous batching."""
    module = sys.modules.get("transformers.generation.continuous_batching.continuous_api")
    if module is None:
        pytest.skip("transformers' continuous batching is not imported in this session")
    join = module.ContinuousBatchingManager.join
    assert join.__qualname__.startswith("joins_wake_the_cb_loop.")
