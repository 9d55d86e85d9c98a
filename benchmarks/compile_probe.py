"""Does a step of the prefill benchmark's compile variants move what a plain CUDA graph of the HF
forward captured? (CUDA only.)

One 5.24 run of ``bench_prefill`` over nine families hit an illegal memory access at the replay
of the plain HF graph of its last family, after the compile variants had run. This probe builds
that graph (32 tokens, a pool of its own), then runs the variants' steps one at a time —
``PrefillRunner(compile=True)`` and a prefill (``bg``), ``torch.compile(mode="reduce-overhead")``
at several lengths (``ro``), ``torch.cuda.empty_cache()`` after each group — and after every
step lists the parameters and buffers whose data pointer changed, replays the graph and
synchronises, so a fault names the step that caused it::

    python -m benchmarks.compile_probe --family mistral-7b-4l --steps bg
    python -m benchmarks.compile_probe --family mistral-7b-4l --steps ro
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.baselines import exact_length_graph
from benchmarks.families import FAMILIES, make_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="mistral-7b-4l", choices=sorted(FAMILIES))
    parser.add_argument("--steps", default="bg,ro", help="bg, ro or both (comma-separated)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("compile_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from breakgraph.integrations.transformers import PrefillRunner

    torch.manual_seed(0)
    model = make_model(FAMILIES[args.family].config(), "cuda", torch.bfloat16)
    prompt = torch.randint(0, 1000, (32,), device="cuda")

    def pointers() -> dict:
        named = [*model.named_parameters(), *model.named_buffers()]
        return {name: t.data_ptr() for name, t in named}

    start = pointers()
    graph = exact_length_graph(model, prompt, pool=torch.cuda.graph_pool_handle())

    def check(label: str) -> None:
        moved = [name for name, ptr in pointers().items() if start.get(name) != ptr]
        out = graph(input_ids=prompt[None]).float().abs().sum().item()  # raises on a fault
        print(f"{label}: moved {moved[:6]} ({len(moved)}), graph replay ok {out:.3g}", flush=True)

    check("captured")
    steps = set(args.steps.split(","))
    if "bg" in steps:
        runner = PrefillRunner(model, compile=True)
        torch.cuda.synchronize()
        check("PrefillRunner(compile=True) built")
        runner.prefill([prompt]).logits.sum().item()
        check("bg compiled prefill")
        torch.cuda.empty_cache()
        check("empty_cache")
    if "ro" in steps:
        compiled = torch.compile(model, mode="reduce-overhead")
        for n in (32, 200, 32, 32):
            ids = torch.randint(0, 1000, (1, n), device="cuda")
            compiled(ids, use_cache=False, logits_to_keep=1)
            torch.cuda.synchronize()
            check(f"reduce-overhead call at {n}")
        torch.cuda.empty_cache()
        check("empty_cache")
    print("probe done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
