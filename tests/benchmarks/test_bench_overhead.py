"""Workloads 1 and 2: per-break overhead (vs one CUDA graph, eager, separate graphs and the
``breakable-cuda-graphs`` package) and copy-back cost (fresh result vs in-place)."""

import pytest
import torch

import breakgraph
from benchmarks.bench_overhead import REGIMES, segment_work

REPEATS = 20  # replays per timed call: the per-call synchronisation is amortised
VARIANTS = ["full_graph", "breakgraph", "separate_graphs", "eager", "peer"]


def _work(x, kernels, segments, cut):
    for s in range(segments):
        segment_work(x, kernels)
        if s < segments - 1:
            cut()


def build(variant, elements, kernels, segments):
    x = torch.randn(elements, device="cuda")
    for _ in range(3):
        _work(x, kernels, segments, lambda: None)
    torch.cuda.synchronize()
    if variant == "eager":
        return lambda: _work(x, kernels, segments, lambda: None)
    if variant == "full_graph":
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _work(x, kernels, segments, lambda: None)
        return g.replay
    if variant == "separate_graphs":
        pool, graphs = torch.cuda.graph_pool_handle(), []
        for _ in range(segments):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                segment_work(x, kernels)
            graphs.append(g)
        replays = tuple(g.replay for g in graphs)
        return lambda: [r() for r in replays]
    if variant == "breakgraph":
        g = breakgraph.BreakableCUDAGraph()
        with breakgraph.capture(g, backend="cuda"):
            _work(x, kernels, segments, breakgraph.break_graph)
        return g.replay
    peer = pytest.importorskip("breakable_cuda_graphs")
    g = peer.BreakableCUDAGraph()
    with peer.breakable_graph(g):
        _work(x, kernels, segments, peer.force_no_graph)
    return g.replay


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("regime", list(REGIMES))
def test_per_break_overhead(benchmark, timed, regime, variant):
    elements, kernels, segments = REGIMES[regime]
    replay = build(variant, elements, kernels, segments)
    benchmark.group = f"overhead: {regime}"
    benchmark.extra_info.update(
        workload="overhead", regime=regime, variant=variant, breaks=segments - 1, repeats=REPEATS
    )
    timed(lambda: [replay() for _ in range(REPEATS)])


@breakgraph.eager_on_graph
def fresh_result(x):
    return x * 2  # a new tensor: copied back into the capture-time output


@breakgraph.eager_on_graph
def in_place(x):
    return x.mul_(2)  # the argument itself: no copy


@pytest.mark.parametrize("kind", ["fresh", "in_place"])
@pytest.mark.parametrize("elements", [4096, 16 * 2**20])
def test_copy_back_cost(benchmark, timed, kind, elements):
    breaks = 8
    fn = fresh_result if kind == "fresh" else in_place
    x = torch.randn(elements, device="cuda")
    g = breakgraph.BreakableCUDAGraph()
    with breakgraph.capture(g, backend="cuda"):
        y = x
        for _ in range(breaks):
            y = fn(y + 1)
    benchmark.group = f"copy-back: {elements} floats"
    benchmark.extra_info.update(
        workload="copy-back", kind=kind, elements=elements, breaks=breaks, repeats=REPEATS
    )
    timed(lambda: [g.replay() for _ in range(REPEATS)])
