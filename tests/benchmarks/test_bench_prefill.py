"""Workloads 3 and 4: transformers prefill (eager, breakgraph, full graph, torch.compile) and
capture time / graph memory against the number of buckets. Explicit buckets, as in the earlier
runs; ``python -m benchmarks.bench_prefill`` measures the default settings against the
exact-length graph."""

import time

import pytest
import torch
from breakgraph.integrations.transformers import PrefillRunner

from benchmarks.families import FAMILIES, make_model
from benchmarks.one_graph import OneGraphPrefillRunner

MODEL = "llama-1b"
TOKENS = (32, 128, 512, 2048)
BUCKETS = (32, 128, 512, 2048)


def mixed_batch(vocab: int) -> list:
    """16 prompts of 8-199 tokens (1176 in all), the same every run."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 200, (16,), generator=g).tolist()
    return [torch.randint(vocab, (n,), generator=g).cuda() for n in lengths]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = make_model(FAMILIES[MODEL].config(), "cuda", torch.bfloat16)
    runners = {
        "breakgraph": PrefillRunner(model, token_buckets=BUCKETS, max_prompts=16),
        "full_graph": OneGraphPrefillRunner(model, token_buckets=BUCKETS, max_prompts=16),
    }
    vocab = model.config.vocab_size
    prompts = {n: [torch.randint(vocab, (n,), device="cuda")] for n in TOKENS}
    prompts["mixed batch"] = mixed_batch(vocab)
    yield model, runners, prompts
    for runner in runners.values():
        runner.close()


@pytest.mark.parametrize("variant", ["hf_eager", "breakgraph", "full_graph", "compile_ro"])
@pytest.mark.parametrize("workload", list(TOKENS) + ["mixed batch"])
@torch.no_grad()
def test_prefill(benchmark, timed, setup, workload, variant):
    model, runners, prompts = setup
    batch = prompts[workload]
    if variant == "hf_eager":
        fn = lambda: [model(p[None], use_cache=False, logits_to_keep=1) for p in batch]  # noqa: E731
    elif variant == "compile_ro":
        if len(batch) > 1 or workload not in (32, 128):
            pytest.skip("torch.compile reduce-overhead is timed on single short prompts only")
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
        fn = lambda: compiled(batch[0][None], use_cache=False, logits_to_keep=1)  # noqa: E731
        for _ in range(3):
            fn()
    else:
        fn = lambda: runners[variant].prefill(batch)  # noqa: E731
    benchmark.group = (
        f"prefill {MODEL}: {workload if isinstance(workload, str) else f'{workload} tokens'}"
    )
    benchmark.extra_info.update(
        workload="prefill",
        model=MODEL,
        case=str(workload),
        variant=variant,
        tokens=sum(len(p) for p in batch),
    )
    timed(fn)


@pytest.mark.parametrize("buckets", [1, 2, 4, 8])
@torch.no_grad()
def test_capture_time_and_memory_vs_buckets(benchmark, setup, buckets):
    model = setup[0]
    sizes = (2048, 1024, 512, 256, 128, 64, 32, 16)[:buckets]
    result = {}

    def build():
        start = time.perf_counter()
        runner = PrefillRunner(model, token_buckets=sizes, max_prompts=16)
        result["seconds"] = time.perf_counter() - start
        result["graph_bytes"] = sum(runner.stats.graph_memory_bytes.values())
        runner.close()

    benchmark.group = "capture vs buckets"
    benchmark.pedantic(build, rounds=1, iterations=1)
    benchmark.extra_info.update(workload="buckets", buckets=buckets, **result)
