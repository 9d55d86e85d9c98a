"""A decode graph's launch, host time, inside a served CB process, with and without the profiler.

``benchmarks/cb_trace.py``'s traces show ``cudaGraphLaunch`` of a pure-decode graph holding the
host 0.55-0.70 ms per step (547 nodes, qwen2.5-3b-12l), with the device idle until it returns,
while ``benchmarks/graph_launch.py`` launches graphs of up to 1,024 nodes in a few µs. This
script settles which one a served step pays: it serves ``bench_cb``'s workload once (100
prompts of 16-1024 tokens, 32 new tokens, ``enable_continuous_batching`` defaults, async),
then, with the manager idle, replays each decode graph the steps used (its buffers emptied
first: no keys to read, so a replay outside a step stays in bounds) and times the launch on
the host: device idle before each (a sync outside the timed span), and back to back. Then the
same under ``torch.profiler`` (CPU and CUDA activity, as ``cb_trace``), CPU activity only, and
after the profiler has stopped. The query-token and logits graphs' first segments for scale.

On an H200 (about 20 s after the model is built)::

    source scripts/setup_device.sh
    python3 -m benchmarks.decode_launch_probe --out "$OUT/decode-launch-probe.json"

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

if __package__ in (None, ""):  # python benchmarks/decode_launch_probe.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = "qwen2.5-3b-12l"


def timed(replay, reps: int = 30, idle: bool = True) -> dict:
    """Host µs of ``replay()``: median, min; the device idle before each call or not."""
    samples = []
    for _ in range(reps):
        if idle:
            torch.cuda.synchronize()
        start = time.perf_counter()
        replay()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return {"median_us": statistics.median(samples), "min_us": min(samples)}


def probe(handle) -> dict:
    """The launch timings of ``handle``'s graphs (see the module docstring)."""
    out: dict = {"decode": {}, "tokens": {}, "logits": {}}
    decode = []
    for graphs in handle.decode_graphs._graphs.values():
        buffers = graphs.buffers
        buffers.cu_k.zero_()  # every sequence without keys: nothing read
        for index in (*buffers.table.values(), *buffers.read.values()):
            index.zero_()
        torch.cuda.synchronize()
        for bucket, rung in graphs.ladder._rungs.items():
            segments = rung.graph._captured.segments
            replay = segments[0].graph.replay
            decode.append(segments[0].graph)
            out["decode"][bucket] = {"segments": len(segments), "idle": timed(replay),
                                     "back_to_back": timed(replay, 10, False)}  # fmt: skip
    for name in ("tokens", "logits"):
        for bucket, rung in list(getattr(handle.runner, name)._rungs.items())[-2:]:
            segments = rung.graph._captured.segments
            out[name][bucket] = {"segments": len(segments),
                                 "first_segment": timed(segments[0].graph.replay, 20)}  # fmt: skip
    if decode:
        graph = decode[-1]
        activity = torch.profiler.ProfilerActivity
        with torch.profiler.profile(activities=[activity.CPU, activity.CUDA]):
            out["profiler_cpu_cuda"] = timed(graph.replay, 20)
        with torch.profiler.profile(activities=[activity.CPU]):
            out["profiler_cpu"] = timed(graph.replay, 20)
        out["after_profiler"] = timed(graph.replay, 20)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_launch_probe: no CUDA device, nothing to measure")
        return 0
    from breakgraph.integrations.transformers import enable_continuous_batching

    from benchmarks import bench_cb
    from benchmarks.environment import environment

    bench = bench_cb.parse_args([])
    config, model = bench_cb.build_model(MODEL, torch.device("cuda"), torch.bfloat16)
    handle = enable_continuous_batching(model)
    manager = model.init_continuous_batching(
        generation_config=bench_cb.generation_config(32),
        continuous_batching_config=bench_cb.cb_config(bench, bench_cb.VARIANTS["breakgraph"]),
    )
    manager.start()
    try:
        prompts = bench_cb.make_prompts(100, 16, 1024, config.vocab_size, 0)
        bench_cb.serve(manager, prompts, 32)
        results = {"meta": environment(cuda=True), "model": MODEL, "prompts": len(prompts),
                   "new_tokens": 32, **probe(handle)}  # fmt: skip
    finally:
        manager.stop(block=True)
        handle.disable()
    for bucket, row in results["decode"].items():
        print(f"decode graph, bucket {bucket}: launch {row['idle']['median_us']:.1f} us "
              f"(device idle), {row['back_to_back']['median_us']:.1f} us back to back")  # fmt: skip
    for key in ("profiler_cpu_cuda", "profiler_cpu", "after_profiler"):
        if key in results:
            print(f"{key}: {results[key]['median_us']:.1f} us")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
