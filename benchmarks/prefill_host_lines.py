"""One ``PrefillRunner.prefill`` of one prompt, line by line: where the host time before the launch
goes (issue 23 item 1).

``benchmarks/prefill_host_path.py`` times the runner's own methods; this goes one level
finer. ``one_prompt_lines`` repeats, statement by statement, what ``prefill`` does for one
prompt (validation, the wait for the staging buffer, the ids into it, the vocabulary check,
the bucket decision, the rest of the staging, the batch description, the launch), with a clock
read between the statements, on the runner's own buffers and graphs. It is a copy of that
path, so it must follow ``prefill`` when that changes: ``tests/test_prefill_host_path.py``
checks that a traced call stages exactly what ``prefill`` stages and returns its logits.

Each call starts as a served call does: on CUDA after a short kernel and a sync (the GPU idle,
the host just back from waiting), on the CPU right away. The ids are written either as
``prefill`` writes them (``memmove`` for a contiguous prompt) or with numpy, the two taking
turns, so the one lever's effect is measured beside the other on the same host::

    python -m benchmarks.prefill_host_lines --device cuda --out h200-host-path-lines.json
    python -m benchmarks.prefill_host_lines        # the CPU: the emulated backend, a tiny model
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from breakgraph.integrations.transformers.prefill_buffers import _largest_id

from benchmarks.environment import environment
from benchmarks.families import FAMILIES, SMOKE_FAMILIES, make_model

SCHEMA = "breakgraph-prefill-host-lines/1"
LINES = (
    "checks",
    "validate",
    "sum",
    "wait for the staging buffer",
    "ids into the staging buffer",
    "vocabulary check",
    "decide",
    "rest of the staging",
    "batch description",
    "launch (replay to return)",
    "mark the buffer read",
)
_memmove = __import__("ctypes").memmove


def one_prompt_lines(runner, prompt: torch.Tensor, *, ids_by: str = "memmove") -> tuple:
    """One call of ``runner.prefill([prompt])`` (a host prompt), statement by statement.
    Returns ``(nanoseconds between statements, logits)``; ``ids_by``: ``"memmove"`` (what
    ``prefill`` does) or ``"numpy"``."""
    steps, clock = runner._steps, time.perf_counter_ns
    t = [clock()]
    if runner._closed or isinstance(prompt, list) or not prompt.is_cpu:
        raise ValueError("one_prompt_lines: one host prompt, an open runner")
    prompts = [prompt]
    t.append(clock())
    (total,) = lengths = runner._validate(prompts)
    t.append(clock())
    total = sum(lengths)
    t.append(clock())
    if steps.read is not None:
        steps.read.synchronize()
    t.append(clock())
    view = steps.view
    if ids_by == "numpy":
        view.ids[:total] = prompt.numpy()
    elif prompt.is_contiguous() and not prompt.is_neg():
        _memmove(steps.host_address, prompt.data_ptr(), 8 * total)
    else:
        raise ValueError("one_prompt_lines: a contiguous prompt")
    t.append(clock())
    if _largest_id(view, total) >= runner.vocab_size:
        raise ValueError("one_prompt_lines: an id outside the vocabulary")
    t.append(clock())
    bucket = runner._runner.decide(total, 0).bucket
    t.append(clock())
    bounds = steps.commit(prompts, lengths, bucket)
    t.append(clock())
    batch = runner._one_prompt_batches.get((total, bucket))
    if batch is None:
        batch = runner._one_prompt_batches[total, bucket] = steps.packed_batch(bounds, 1)
    t.append(clock())
    ladder = runner._single if runner._single is not None else runner._runner
    logits = ladder.replay(bucket, batch, total)[0, :1]
    t.append(clock())
    steps.launched()
    t.append(clock())
    return [b - a for a, b in zip(t, t[1:])], logits


def measure(runner, prompt: torch.Tensor, *, calls: int, idle: bool) -> dict:
    """Median microseconds of every line over ``calls`` calls per way of writing the ids (the
    two ways taking turns call by call), and of the entry to the launch."""
    samples = {way: [[] for _ in LINES] for way in ("memmove", "numpy")}
    for i in range(2 * calls + 20):
        way = ("memmove", "numpy")[i % 2]
        if idle:
            torch.cuda._sleep(200_000)  # about 0.1 ms of GPU work, then the host waits
            torch.cuda.synchronize()
        lines, _ = one_prompt_lines(runner, prompt, ids_by=way)
        if i >= 20:  # warm
            for values, ns in zip(samples[way], lines):
                values.append(ns)
    result = {}
    for way, per_line in samples.items():
        row = {name: statistics.median(v) / 1e3 for name, v in zip(LINES, per_line)}
        row["entry -> launch"] = sum(row[name] for name in LINES[:-2])
        result[f"ids by {way}"] = row
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--families", default=None, help="comma-separated (CUDA)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from breakgraph.integrations.transformers import PrefillRunner

    cuda = args.device == "cuda"
    names = args.families.split(",") if args.families else (
        ["mixtral-1k-4l", "mistral-sw256-4l"] if cuda else ["tiny-llama"]
    )  # fmt: skip
    result = {"schema": SCHEMA, **environment(cuda), "settings": vars(args), "families": {}}
    for name in names:
        family = (FAMILIES if cuda else SMOKE_FAMILIES)[name]
        model = make_model(family.config(), args.device, torch.bfloat16 if cuda else torch.float32)
        buckets = (32, 64, 128, 200, 256)
        runner = PrefillRunner(
            model, token_buckets=buckets, tune_buckets=False, single_prompt_graphs=True,
            backend="cuda" if cuda else "emulated",
        )  # fmt: skip
        try:
            g = torch.Generator().manual_seed(0)
            prompt = torch.randint(model.config.vocab_size, (args.tokens,), generator=g)
            result["families"][name] = measure(runner, prompt, calls=args.calls, idle=cuda)
        finally:
            runner.close()
        row = result["families"][name]["ids by memmove"]
        print(f"{name}: entry -> launch {row['entry -> launch']:.1f} us; " + ", ".join(
            f"{k} {v:.1f}" for k, v in row.items() if k != "entry -> launch"
        ), flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
