"""Shared fixtures: every behavioural test runs on both backends.

``backend`` is ``"emulated"`` (CPU, always) and ``"cuda"`` (marked ``requires_cuda``,
skipped cleanly without a GPU); ``device`` is the matching tensor device.
"""

import functools
import gc
import os
import sys

import pytest
import torch

import breakgraph


def pytest_configure(config):
    # the breakgraph plugin (entry point pytest11) skips `requires_cuda` tests without a GPU;
    # register it by hand when the package was not installed with its entry points
    if not config.pluginmanager.has_plugin("breakgraph"):
        import breakgraph.pytest_plugin as plugin

        config.pluginmanager.register(plugin, "breakgraph")
        plugin.pytest_configure(config)


#: Test modules that exercise transformers (directly or through breakgraph's integration): CI
#: runs every test marked ``transformers`` on the newest tested release too (``.ci/run``).
TRANSFORMERS_MODULES = {
    "test_transformers",
    "test_continuous_batching",
    "test_tensor_parallel",
    "test_examples",
    "test_fuzz_prefill",
    "test_prefill_benchmark_smoke",
    "test_doctests",
    "test_bench_prefill",
}


#: Tests that run first, in this order, with a rough cost in seconds each (per module, where a
#: module is listed whole): the two-process launches (TP, about 20 s each on two cores, and the
#: serve launcher's process), the Dynamo compiles (one module, and the CB decoder's) and, on a
#: GPU, the busy-GPU CB processes and the compiled decoder. pytest-xdist's load scheduling
#: hands tests out in collection order and never moves one once sent: left in place (late in
#: the alphabet) they ran last, one worker alone for the suite's last 5-10 s (the serve
#: launcher did, until it was listed). First, the short tests fill in around them
#: (:func:`layout` deals them over the workers). Whole modules move as a block, so a
#: module-scoped fixture (``tp_runs``) still runs once. The costs only order the dealing;
#: measured: the H200's timelines and the CPU suite's slowest tests (docs/performance.md,
#: *Test-suite time*).
START_FIRST = (
    ("test_tensor_parallel", 45.0),
    ("test_examples.py::test_example_runs[tensor_parallel.py]", 19.0),
    ("test_prefill_compile", 46.0),
    # a server process of its own (imports, model, a completion, shutdown): 13-16 s on 2 cores
    ("test_continuous_batching.py::test_serve_launcher_answers_a_completion", 14.0),
    # the CB decoder compiled at two depths (CPU, AOT autograd): 8-11 s on 2 cores
    ("test_continuous_batching.py::test_compiled_decoder_compiles_once_for_every_layer_and_bucket",
     10.0),  # fmt: skip
    # on a GPU: 15-25 s each in a process of its own, loading the GPU meanwhile
    ("test_continuous_batching.py::test_cuda_tokens_equal_generate_while_the_gpu_is_busy", 20.0),
    # the decoder under torch.compile on a GPU: 40-60 s on the H200 (its longest test)
    ("test_continuous_batching.py::test_cuda_compiled_decoder_agrees_with_paged_sdpa", 50.0),
    # random packed batches per family on a GPU: 6-17 s each, 50 s in all; left to the load
    # scheduling they came as one batch to one worker and ran last (session 31's H200 run)
    ("test_fuzz_prefill.py::test_random_packed_batches_match_each_prompt_alone_cuda", 10.0),
)


def _start_rank(item) -> int:
    """``item``'s place in :data:`START_FIRST` (by module, by file and test name, or by file,
    test name and parameters); after all of them when it is not listed."""
    test = item.nodeid.rpartition("/")[2]  # "test_x.py::test_y[id]"
    keys = (test.partition(".py")[0], test.partition("[")[0], test)
    return next((i for i, (name, _) in enumerate(START_FIRST) if name in keys), len(START_FIRST))


def _skipped(item) -> bool:
    """Whether collection already knows ``item`` will be skipped: a ``skip`` mark, or a
    ``skipif`` whose conditions are all true booleans (the tensor-parallel tests on one GPU)."""
    marks = getattr(item, "iter_markers", lambda name: ())
    if any(True for _ in marks("skip")):
        return True
    return any(m.args and all(a is True for a in m.args) for m in marks("skipif"))


def layout(items: list, workers: int, chunk: int | None = None) -> list:
    """``items`` in the order pytest-xdist should hand them out over ``workers`` workers: the
    tests of :data:`START_FIRST` dealt out over the first chunk of every worker (``chunk``
    tests each; pytest-xdist's size by default), costliest unit first to the worker with the
    least so far that has room for it (a module listed whole is one unit; the other listed tests
    one each); units that do not fit, and units whose tests will all be skipped, right after
    the chunks; every other test fills the chunks and follows, in its order.

    Why: pytest-xdist's load scheduling first sends each worker a chunk of consecutive tests
    (``max(2, tests // workers // 4)`` of them, at most ``--maxschedchunk``), which no other
    worker can take. With the slow tests simply put first they landed in the first one or two
    workers' chunks and ran one after the other: on the H200 one worker of four ran every one
    of them, busy for 186 s while the other three stopped at 54-73 s. One at a time
    (``--maxschedchunk 1``) spreads them but splits every module's tests over the workers, so
    its shared fixtures are built once per worker (the CPU suite took longer in the one run
    tried). Without workers (or with one) the order is just :data:`START_FIRST` first.

    Example::

        >>> from types import SimpleNamespace as T
        >>> ids = [f"tests/test_a.py::test_{i}" for i in range(8)] + [
        ...     "tests/test_prefill_compile.py::test_p", "tests/test_prefill_compile.py::test_q",
        ...     "tests/test_examples.py::test_example_runs[tensor_parallel.py]"]
        >>> [i.nodeid.rpartition("::")[2] for i in layout([T(nodeid=n) for n in ids], 2)]
        ... # doctest: +NORMALIZE_WHITESPACE
        ['test_p', 'test_q', 'test_example_runs[tensor_parallel.py]', 'test_0',
         'test_1', 'test_2', 'test_3', 'test_4', 'test_5', 'test_6', 'test_7']
    """
    ranked = sorted(items, key=_start_rank)  # stable: every other test keeps its place
    first = [item for item in ranked if _start_rank(item) < len(START_FIRST)]
    rest = ranked[len(first) :]
    if workers < 2:
        return first + rest

    def cost(unit: list) -> float:
        return START_FIRST[_start_rank(unit[0])][1]

    units: dict = {}  # a listed module is one unit; any other listed test is one of its own
    for item in first:
        rank = _start_rank(item)
        key = rank if "::" not in START_FIRST[rank][0] else item.nodeid
        units.setdefault(key, []).append(item)
    size = chunk or max(2, len(items) // workers // 4)  # pytest-xdist's first chunk per worker
    chunks: list[list] = [[] for _ in range(workers)]
    load = [0.0] * workers
    after = []  # units that fit no chunk, and units that will be skipped
    dealt = sorted(units.values(), key=lambda unit: -cost(unit))
    for unit in dealt:  # stable: equal costs keep START_FIRST's order
        room = [w for w in range(workers) if len(chunks[w]) + len(unit) <= size]
        if all(_skipped(item) for item in unit) or not room:
            after += unit
            continue
        worker = min(room, key=lambda w: (load[w], w))
        chunks[worker] += unit
        load[worker] += cost(unit)
    ordered = []
    for tests in chunks:
        fill = size - len(tests)
        ordered += tests + rest[:fill]
        rest = rest[fill:]
    return ordered + after + rest


def pytest_itemcollected(item):
    # here, not in pytest_collection_modifyitems: `-m transformers` deselects before ours runs
    module = getattr(item, "module", None)
    if module is not None and module.__name__.rsplit(".", 1)[-1] in TRANSFORMERS_MODULES:
        item.add_marker(pytest.mark.transformers)
        _skip_families_this_transformers_lacks(item)


def _skip_families_this_transformers_lacks(item) -> None:
    """A test of a model family that arrived after the oldest supported transformers (its
    ``arch`` or ``family`` parameter) is skipped where the installed release lacks its config."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    family = params.get("arch", params.get("family"))
    if isinstance(family, str):
        from benchmarks.tiny_models import missing_config

        lacking = missing_config(family)
        if lacking is not None:
            item.add_marker(pytest.mark.skip(reason=f"this transformers has no {lacking}"))


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` deselected: the tests the workers run
def pytest_collection_modifyitems(config, items):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    most = getattr(getattr(config, "option", None), "maxschedchunk", None)  # --maxschedchunk
    chunk = max(2, min(len(items) // workers // 4, most)) if most else None
    items[:] = layout(items, workers, chunk)


def pytest_collection_finish(session):
    """Start the one process of the checks that need their own (``helpers.fresh_process_check``)
    now, so that its start-up (about 11 s on the H200's host) runs beside the other tests. Not
    in a pytest-xdist worker: every worker collects every test, and only the one given those
    tests needs the process (it starts it when the first of them asks)."""
    from tests import helpers

    wanted = any(item.get_closest_marker("fresh_process") for item in session.items)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if wanted and helpers.HAS_CUDA and not worker and not session.config.option.collectonly:
        helpers.start_fresh_process()


BACKENDS = [
    pytest.param("emulated", id="emulated"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.requires_cuda),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def device(backend):
    return "cuda" if backend == "cuda" else "cpu"


@pytest.fixture
def capture(backend):
    """``breakgraph.capture`` bound to the backend under test."""
    return functools.partial(breakgraph.capture, backend=backend)


@pytest.fixture(scope="session", autouse=True)
def cb_stops_without_the_idle_poll():
    """transformers' CB managers stop without waiting out their loop's idle poll
    (``helpers.joins_wake_the_cb_loop``: up to 0.1 s per stop, 134 stops in the suite's test
    processes), for the session, when collection imported transformers' continuous batching (a
    session of other tests does not import transformers for it)."""
    module = sys.modules.get("transformers.generation.continuous_batching.continuous_api")
    manager = getattr(module, "ContinuousBatchingManager", None)
    if manager is None:
        yield
        return
    from tests import helpers

    with pytest.MonkeyPatch.context() as patches:
        helpers.joins_wake_the_cb_loop(patches, manager)
        yield


@pytest.fixture(scope="session", autouse=True)
def one_cpu_thread():
    """Tiny models: intra-op threads cost far more than they save on 2 cores (10-100x; 4 s
    instead of 1 s for the prefill benchmark's smoke run). Every test runs with one; modules
    that name it (``pytest.mark.usefixtures``) say that their timings depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """Every module starts with the objects alive then (torch, transformers, Dynamo, earlier
    modules' caches) frozen: the collector's full collections, automatic or asked for
    (transformers' CB cleanup, ``gc.collect()`` in tests), then walk only what the module made
    since. With everything imported a full collection costs 0.2-0.5 s on CI's CPU, and a
    worker ran dozens (8-16 s of the suite's two workers), plus pytest's five at the end.
    Garbage is collected first, so none is kept; nothing is unfrozen at the end (the next
    module freezes again, and pytest's closing collections then walk only the last module's
    objects). The fuzz modules freeze and unfreeze their own heap on top (test_fuzz.py)."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _busy_gpu(request):
    """``BREAKGRAPH_TEST_BUSY_GPU=N`` (a stress run on a GPU machine): every CUDA test runs
    while ``N`` threads keep the GPU busy (:func:`tests.helpers.busy_gpu`), so the device runs
    far behind the host. A race between the host and the device (a buffer read before its
    write lands, reused while the device still reads it) then shows up as a wrong result."""
    threads = int(os.environ.get("BREAKGRAPH_TEST_BUSY_GPU") or 0)
    if threads and request.node.get_closest_marker("requires_cuda"):
        from tests import helpers

        with helpers.busy_gpu(threads):
            yield
    else:
        yield
