"""The vocab-parallel embedding under capture: breakgraph's graph-safe lookup, captured, against
transformers' DTensor hook run as an eager break (the alternative it was chosen over).

One process on one GPU (a 1-rank NCCL mesh: the hook runs the same code as on N ranks:
``_MaskPartial``, the boolean-mask ``index_put_`` with its ``nonzero`` host sync, the
all-reduce), an embedding of Llama-3-8B's shape (vocabulary 128256, hidden 4096, bf16)
followed by one 4096x4096 projection so the graph has a segment after the break::

    python benchmarks/bench_tp_embedding.py --tokens 128 2048

Without a GPU it runs on the CPU (gloo, the emulated backend, a small shape; timings mean
nothing there). Prints one JSON object per token count: replay time (median and p90 over
300 replays with fresh ids, each synchronised) of both graphs, the eager forward of both,
and whether the lookup equals the hook exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from breakgraph.integrations.transformers.tensor_parallel import VocabParallelLookup

import breakgraph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--replays", type=int, default=300)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    if cuda:
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for tokens in args.tokens:
            print(json.dumps(measure(tokens, args.replays, cuda), indent=1), flush=True)
    finally:
        dist.destroy_process_group()


def measure(tokens: int, replays: int, cuda: bool) -> dict:
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_tensor,
        init_device_mesh,
    )

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    vocab, hidden = (128256, 4096) if cuda else (1024, 64)
    backend = "cuda" if cuda else "emulated"
    mesh = init_device_mesh(device, (1,))
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(vocab, hidden, device=device, dtype=dtype)
    embedding.weight = torch.nn.Parameter(
        distribute_tensor(embedding.weight.detach(), mesh, [Shard(0)]), requires_grad=False
    )
    projection = torch.nn.Linear(hidden, hidden, bias=False, device=device, dtype=dtype)

    def stock_hook(ids: torch.Tensor) -> torch.Tensor:
        """transformers 5.21+ ``EmbeddingParallel(shard_dim=0)`` on its inference path."""
        x = DTensor.from_local(ids, mesh, [Replicate()], run_check=False)
        out = torch.nn.Embedding.forward(embedding, x)
        return out.redistribute(placements=[Replicate()]).to_local()

    lookup = VocabParallelLookup(embedding, "embedding")
    variants = {
        "graph_safe_captured": lookup,
        "stock_eager_break": breakgraph.eager_on_graph(stock_hook),
    }
    ids = torch.randint(0, vocab, (1, tokens), device=device)
    result: dict = {"vocab": vocab, "hidden": hidden, "tokens": tokens, "backend": backend}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with torch.no_grad():
        result["exact"] = torch.equal(stock_hook(ids), lookup(ids))
        for name, embed in variants.items():
            for _ in range(3):  # warm-up: the communicator and the kernels exist before capture
                projection(embed(ids))
            sync()
            graph = breakgraph.BreakableCUDAGraph()
            with breakgraph.capture(graph, backend=backend, capture_error_mode="thread_local"):
                out = projection(embed(ids))
            times = []
            for _ in range(replays):
                ids.copy_(torch.randint(0, vocab, (1, tokens), device=device))
                sync()
                start = time.perf_counter()
                graph.replay()
                sync()
                times.append((time.perf_counter() - start) * 1e6)
            result[name] = {
                "median_us": statistics.median(times),
                "p90_us": sorted(times)[int(0.9 * len(times))],
                "graph": repr(graph),
                "equals_eager_hook": torch.equal(out, projection(stock_hook(ids))),
            }
            graph.reset()
        for name, embed in (("graph_safe_eager", lookup), ("stock_eager", stock_hook)):
            times = []
            for _ in range(100):
                sync()
                start = time.perf_counter()
                projection(embed(ids))
                sync()
                times.append((time.perf_counter() - start) * 1e6)
            result[name] = {"median_us": statistics.median(times)}
    return result


if __name__ == "__main__":
    main()
