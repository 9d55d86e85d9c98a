"""Where breakgraph's forward of a served pure-decode CB step spends the host's time, part by part.

``bench_cb`` reports the forward's host time of a pure-decode step (*bg forward host* on
``docs/performance.md``: 0.24-0.41 ms on the H200) while a decode graph's launch alone takes
3-17 µs (``decode_launch_probe``). This serves ``bench_cb``'s workload (100 prompts of
16-1024 tokens, ``--new-tokens`` each, ``enable_continuous_batching`` defaults) and wraps the
functions the forward calls with wall-clock timers, for the pure-decode forwards of at least
32 requests only (the issue's steps):

* ``refill``: the step's views of transformers' tensors (``CBStep.refill``);
* ``decide``: the query-token ladder's bucket decision;
* ``staging``: the ids and positions into the bucket's buffer, its tail, and the logits' row
  index (the rest of ``_replay``: ``StepInputs.stage`` and ``stage_rows``);
* ``decode fill``: the table and key offsets into the decode graph's buffers;
* ``decode replay``: the decode graph's ladder replay (its launch);
* ``decode other``: the rest of ``DecodeGraphs.replay`` (layout lookup, checks);
* ``logits``: the logits ladder's replay;
* ``fp32 copy``: the logits to a fresh fp32 tensor (``Tensor.to``);
* ``stream order``: what orders steps issued on different streams (``StepOrder.follow``: the
  current stream, a wait where it changed; CUDA only; before it, an event waited on and
  recorded every step);
* ``output object``: the ``CausalLMOutputWithPast`` the forward returns;
* ``output``: the rest of ``forward`` (the lock, releasing the step, the checks).

The fp32 copy, the stream order and the output object are timed only where ``forward`` calls
them itself, not inside the other parts.

The timers add a wrapper call per part (about a microsecond each, counted in the parts). Also
the pure-decode step's wall time (``cb_instruments.decode_window``: the median interval
between a request's tokens while every request decodes), measured in the timed passes. To
compare two trees, run it once per tree (``PYTHONPATH`` pointing at the other tree's
``breakgraph`` and ``integrations``), the processes taking turns. Run on the GPU machine::

    source scripts/setup_device.sh
    python3 -m benchmarks.decode_forward_probe --out "$OUT/decode-forward-probe.json"

It first times single operations of the kind the forward is made of (:func:`time_operations`).
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

if __package__ in (None, ""):  # python benchmarks/decode_forward_probe.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = ("llama3-8b-4l", "qwen2.5-3b-12l")
MIN_REQUESTS = 32
PARTS = ("refill", "decide", "staging", "decode fill", "decode replay", "decode other",
         "logits", "fp32 copy", "stream order", "output object", "output")  # fmt: skip
#: the parts timed only where the forward calls them itself (no other timed part running)
TOP_LEVEL = ("fp32 copy", "stream order", "output object")


class ForwardTimers:
    """Per pure-decode forward: seconds in each wrapped function, summed over its calls (none
    of them calls itself)."""

    def __init__(self) -> None:
        self.forwards: list[dict] = []
        self.current: dict | None = None
        self.active = 0  # timed calls running now (nested ones included)

    def wrap(self, function, name: str):
        timers, top_level = self, name in TOP_LEVEL

        @functools.wraps(function)
        def timed(*args, **kwargs):
            current = timers.current
            if current is None or (top_level and timers.active):
                return function(*args, **kwargs)
            timers.active += 1
            begin = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                current[name] = current.get(name, 0.0) + time.perf_counter() - begin
                timers.active -= 1

        return timed

    def install(self, patches) -> None:
        from breakgraph.integrations.transformers import cb_step, decode_graph

        from breakgraph.ladder import GraphLadder

        runner_forward = cb_step.StepRunner.forward
        timers, wrapped_outputs = self, set()

        @functools.wraps(runner_forward)
        def forward(runner, **kwargs):
            if id(runner) not in wrapped_outputs:  # the runner's own attribute: once per runner
                wrapped_outputs.add(id(runner))
                patches.attribute(runner, "_output", timers.wrap(runner._output, "output object"))
            names = runner.names
            n = kwargs[names.input_ids].shape[-1]
            decode = kwargs[names.max_q] == 1 and n >= MIN_REQUESTS
            timers.current = {} if decode else None
            begin = time.perf_counter()
            try:
                return runner_forward(runner, **kwargs)
            finally:
                if timers.current is not None:
                    timers.current["forward"] = time.perf_counter() - begin
                    timers.current["n"] = n
                    timers.forwards.append(timers.current)
                timers.current = None

        patches.attribute(cb_step.StepRunner, "forward", forward)
        for owner, name, part in (
            (cb_step.CBStep, "refill", "refill"),
            (GraphLadder, "decide", "decide"),
            (cb_step.StepRunner, "_replay", "_replay"),
            (decode_graph.DecodeGraphs, "replay", "decode graphs"),
            (decode_graph.DecodeBuffers, "fill", "decode fill"),
            (torch.Tensor, "to", "fp32 copy"),
            (cb_step.StepOrder, "follow", "stream order"),
        ):  # fmt: skip
            function = vars(owner).get(name) or getattr(owner, name)  # Tensor.to: inherited
            patches.attribute(owner, name, self.wrap(function, part))
        ladder_replay = GraphLadder.replay

        @functools.wraps(ladder_replay)
        def replay(ladder, *args, **kwargs):
            current = timers.current
            if current is None:
                return ladder_replay(ladder, *args, **kwargs)
            part = "decode replay" if "decode graphs" in ladder.who else "ladder replay"
            timers.active += 1
            begin = time.perf_counter()
            try:
                return ladder_replay(ladder, *args, **kwargs)
            finally:
                current[part] = current.get(part, 0.0) + time.perf_counter() - begin
                timers.active -= 1

        patches.attribute(GraphLadder, "replay", replay)

    def parts(self, f: dict) -> dict:
        """One forward's parts (µs): the wrapped functions' times less what nests inside. The
        logits ladder's replay is the only ladder replay besides the decode graph's; staging
        is what ``_replay`` does besides the two (ids, positions, the tails, the row index)."""
        get = lambda key: f.get(key, 0.0) * 1e6  # noqa: E731
        graphs, logits = get("decode graphs"), get("ladder replay")
        return {
            "refill": get("refill"),
            "decide": get("decide"),
            "staging": get("_replay") - graphs - logits,
            "decode fill": get("decode fill"),
            "decode replay": get("decode replay"),
            "decode other": graphs - get("decode fill") - get("decode replay"),
            "logits": logits,
            "fp32 copy": get("fp32 copy"),
            "stream order": get("stream order"),
            "output object": get("output object"),
            "output": (get("forward") - get("_replay") - get("refill") - get("decide")
                       - sum(get(part) for part in TOP_LEVEL)),  # fmt: skip
            "forward": get("forward"),
        }

    def summary(self) -> dict:
        served = [f for f in self.forwards if "decode replay" in f]
        if not served:
            return {"forwards": len(self.forwards), "decode_graph_forwards": 0}
        rows = [self.parts(f) for f in served]
        out = {"forwards": len(self.forwards), "decode_graph_forwards": len(served),
               "requests_median": statistics.median(f["n"] for f in served),
               "median_us": {}, "p10_us": {}, "p90_us": {}}  # fmt: skip
        for key in (*PARTS, "forward"):
            values = sorted(r[key] for r in rows)
            out["median_us"][key] = statistics.median(values)
            out["p10_us"][key] = values[len(values) // 10]
            out["p90_us"][key] = values[(9 * len(values)) // 10]
        return out


def time_operations(device: torch.device, repeats: int = 2000) -> dict:
    """The host's time (µs, the median of ``repeats`` calls, a hundred calls each) for each
    single operation the forward is made of, on a pure-decode step's sizes (64 requests in a
    bucket of 96, transformers' int32 bulk tensor, a 32000-word vocabulary): what a view, a
    copy, a stream lookup or the output object costs this host, to weigh a lever before
    building it. Nothing in flight: the GPU keeps up with these small operations."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    cuda = device.type == "cuda"
    n, bucket = 64, 96
    bulk = torch.zeros(7, 2080, dtype=torch.int32, device=device)  # transformers' layout
    tokens = torch.zeros(2, bucket, dtype=torch.long, device=device)
    table = torch.zeros(bucket, 64, dtype=torch.int32, device=device)
    live_table = torch.zeros(2, 512, 64, dtype=torch.int32, device=device)
    cu_k = torch.zeros(bucket + 1, dtype=torch.int32, device=device)
    both, dst, last = bulk[0:2, :n], tokens[:, :n], bulk[4, n : n + 1]
    pad = torch.arange(bucket + 1, device=device).clamp(max=n)  # the decode fill's index
    logits = torch.zeros(1, n, 32000, dtype=torch.bfloat16, device=device)
    lock = __import__("threading").Lock()

    def locked():
        with lock, torch.no_grad():
            pass

    operations = {
        "2-d slice (tokens[:, :n])": lambda: tokens[:, :n],
        "1-d slice (cu_k[:n + 1])": lambda: cu_k[: n + 1],
        "copy int32 [2, n] into int64": lambda: dst.copy_(both),
        "copy int32 [n, 64] table rows": lambda: table[:n].copy_(live_table[0, :n]),
        "copy int32 [n + 1], same dtype": lambda: cu_k[: n + 1].copy_(bulk[4, : n + 1]),
        "expand and copy (padded tail)": lambda: cu_k[n + 1 :].copy_(last.expand(bucket - n)),
        "gather int32 [bucket + 1] (index_select, out=)": lambda: torch.index_select(
            bulk[4], 0, pad, out=cu_k),
        "zero a tail": lambda: tokens[:, n:].zero_(),
        "fp32 copy of the logits (Tensor.to)": lambda: logits.to(torch.float32, copy=True),
        "output object (CausalLMOutputWithPast)": lambda: CausalLMOutputWithPast(logits=logits),
        "lock and no_grad": locked,
    }  # fmt: skip
    if cuda:
        event, same = torch.cuda.Event(), torch.cuda.current_stream()
        operations.update({
            "torch.cuda.current_stream()": torch.cuda.current_stream,
            "event wait and record": lambda: (torch.cuda.current_stream().wait_event(event),
                                              event.record()),
            # what StepOrder.follow does on a step issued on the same stream as the one before
            "stream lookup and comparison": lambda: torch.cuda.current_stream() != same,
        })  # fmt: skip
    out = {}
    for name, operation in operations.items():
        samples = []
        for _ in range(max(1, repeats // 100)):
            begin = time.perf_counter()
            for _ in range(100):
                operation()
            samples.append((time.perf_counter() - begin) / 100 * 1e6)
        if cuda:
            torch.cuda.synchronize()
        out[name] = statistics.median(samples)
    return out


def run_model(name: str, new_tokens: int, asynchronous: bool, passes: int) -> dict:
    from breakgraph.integrations.transformers import enable_continuous_batching

    from benchmarks import bench_cb
    from benchmarks.cb_instruments import decode_window
    from breakgraph.patches import PatchSet

    bench = bench_cb.parse_args([])
    config, model = bench_cb.build_model(name, torch.device("cuda"), torch.bfloat16)
    cb_config = bench_cb.cb_config(bench, bench_cb.VARIANTS["breakgraph"])
    cb_config.use_async_batching = asynchronous
    prompts = bench_cb.make_prompts(100, 16, 1024, config.vocab_size, 0)
    handle = enable_continuous_batching(model)
    timers, steps = ForwardTimers(), []
    try:
        for timed in [False] + [True] * passes:  # a first pass captures and compiles
            with PatchSet() as patches:
                if timed:
                    timers.install(patches)
                manager = model.init_continuous_batching(
                    generation_config=bench_cb.generation_config(new_tokens),
                    continuous_batching_config=cb_config,
                )  # fmt: skip
                manager.start()
                try:
                    _, _, outputs = bench_cb.serve(manager, prompts, new_tokens)
                finally:
                    manager.stop(block=True)
            if timed:
                window = decode_window(outputs, [len(p) for p in prompts])
                steps.append(window.get("decode_step_ms"))
        results = timers.summary()
        results["decode_step_ms"] = steps
    finally:
        handle.disable()
        del model
        torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--sync", action="store_true", help="synchronous batching")
    parser.add_argument("--passes", type=int, default=2, help="timed passes per model")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_forward_probe: no CUDA device, nothing to measure")
        return 0
    import breakgraph
    from benchmarks.environment import environment

    results = {"meta": environment(cuda=True),
               "settings": {"prompts": 100, "prompt_lengths": [16, 1024], "passes": args.passes,
                            "new_tokens": args.new_tokens, "asynchronous": not args.sync,
                            "min_requests": MIN_REQUESTS},
               "breakgraph": os.path.dirname(os.path.dirname(breakgraph.__file__)),
               "models": {}}  # fmt: skip
    results["operations_us"] = time_operations(torch.device("cuda"))
    print("single operations (µs, medians): " + ", ".join(
        f"{k} {v:.1f}" for k, v in results["operations_us"].items()), flush=True)  # fmt: skip
    for name in args.models:
        out = run_model(name, args.new_tokens, not args.sync, args.passes)
        results["models"][name] = out
        medians = out.get("median_us", {})
        steps = ", ".join(f"{ms:.2f}" for ms in out["decode_step_ms"] if ms is not None)
        print(f"{name}: {out.get('decode_graph_forwards', 0)} decode-graph forwards, "
              + ", ".join(f"{k} {v:.1f}" for k, v in medians.items())
              + f" (µs, medians); pure-decode step ms {steps}", flush=True)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
