"""Where the construction of ``PrefillRunner(model)`` spends its time, under ``cProfile``.

Builds the default runner twice in one process on a random-weight model of
``benchmarks.families`` (the first pays per-process costs: cuDNN plans, kernel loading; the
second shows what every runner pays) and sums the profile into named parts::

    python -m benchmarks.capture_profile --family llama-1b --out capture-profile.json

The parts (seconds; cProfile's own overhead inflates Python-heavy parts, so compare parts
with each other, and take the construction time from ``benchmarks.capture_time``):

* ``sdpa``, ``linear``: the model's attention and matmul calls at warm-up and capture
  (cuDNN builds a plan for every new attention length inside the first);
* ``gpu wait: tuning``: ``GraphLadder.tune`` waiting for its timed replays;
* ``gpu wait: staging``: the step buffers waiting for the copy of two steps ago (the GPU is
  still running earlier buckets' replays);
* ``gpu wait: capture start``: ``torch.cuda.synchronize()`` before each capture;
* ``graph instantiation``, ``capture begin``: CUDA's per-segment capture calls;
* ``segment replays``: the replays at capture (real values for the breaks) and tuning's;
* ``ownership census``: copy-back's check of who holds each break's output;
* ``pool snapshots``: the graph memory counted per bucket;
* ``module walks``: ``nn.Module.named_modules`` (transformers' attention switch);
* ``gc``: garbage collections.

Parts overlap (a replay includes its waits), so they do not add up to the total.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

SCHEMA = "breakgraph-capture-profile/1"

#: part name -> (substring of pstats' "file:line(function)" key, "tottime" or "cumtime")
PARTS: dict[str, tuple[str, str]] = {
    "sdpa": ("scaled_dot_product_attention", "tottime"),
    "linear": ("torch._C._nn.linear", "tottime"),
    "gpu wait: tuning": ("Event.synchronize at", "tottime"),
    "gpu wait: staging": ("'synchronize' of 'torch.Event'", "tottime"),
    "gpu wait: capture start": ("_cuda_synchronize", "tottime"),
    "graph instantiation": ("cuda/graphs.py:", "capture_end"),
    "capture begin": ("cuda/graphs.py:", "capture_begin"),
    "segment replays": ("cuda/graphs.py:", "replay"),
    "ownership census": ("breakgraph/ownership.py:", "_held_elsewhere"),
    "pool snapshots": ("_cuda_memorySnapshot", "tottime"),
    "module walks": ("named_modules", "tottime"),
    "gc": ("gc.collect", "tottime"),
}


def summarize(stats: pstats.Stats) -> dict:
    """Seconds per part of :data:`PARTS` from a ``pstats.Stats``."""
    parts = {}
    for name, (needle, how) in PARTS.items():
        total = 0.0
        for (file, line, function), (_, _, tottime, cumtime, _) in stats.stats.items():
            key = f"{file}:{line}({function})"
            if how in ("tottime", "cumtime"):
                if needle in key:
                    total += tottime if how == "tottime" else cumtime
            elif needle in key and function == how:  # a Python function: its cumulative time
                total += cumtime
        parts[name] = round(total, 4)
    return parts


def profile_runs(family_name: str) -> list[dict]:
    from breakgraph.integrations.transformers import PrefillRunner

    from benchmarks.families import FAMILIES, make_model

    model = make_model(FAMILIES[family_name].config(), "cuda", torch.bfloat16)
    runs = []
    with torch.no_grad():
        for which in ("first", "second"):
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            start = time.perf_counter()
            profiler.enable()
            runner = PrefillRunner(model)
            torch.cuda.synchronize()
            profiler.disable()
            seconds = time.perf_counter() - start
            stats = pstats.Stats(profiler, stream=io.StringIO())
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            runs.append(
                {
                    "which": which,
                    "construction_s": round(seconds, 3),
                    "profiled_total_s": round(stats.total_tt, 3),
                    "graphs": len(runner.graphs()),
                    "buckets": len(runner.buckets),
                    "parts_s": summarize(stats),
                    "top_tottime": text.getvalue().splitlines()[:50],
                }
            )
            print(f"{family_name} {which}: {seconds:.2f} s under cProfile", flush=True)
            runner.close()
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="llama-1b")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from benchmarks.environment import environment

    result = {
        "schema": SCHEMA,
        "meta": environment(cuda=True),
        "family": args.family,
        "runs": profile_runs(args.family),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
