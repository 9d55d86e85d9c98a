"""``PrefillRunner(compile=True, on_miss="eager")``: what a batch longer than the ladder costs.

Such a batch runs the compiled forward eagerly, on inputs of its own. Those inputs used to be
separate tensors, while the ladder's warm-ups had compiled the forward on views of one staging
buffer; Dynamo's guards on those views (one base, offsets of at least 2) then failed, and the
first longer batch compiled the model's frames again, under Inductor, inside a served call.
Now the runner lays a longer batch out as the staging buffer is laid out
(``StepBuffers.wide_inputs``). ``--variant separate`` puts the old inputs back (a patch of
that one method, this process only), so both run from one tree; run each in a process of its
own (Dynamo's caches are per process), taking turns::

    python -m benchmarks.compile_eager_fallback --variant separate --out sep-1.json
    python -m benchmarks.compile_eager_fallback --variant wide --out wide-1.json

Per family: the runner's construction, then each over-ladder batch twice (the second call
of a size is the steady state): seconds (synchronised), Dynamo frames compiled during the
call and torch's compile seconds. ``--smoke`` is a CPU run of a tiny model (the emulated
backend, AOT autograd without Inductor), for the tests.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.baselines import dynamo_delta, dynamo_snapshot
from benchmarks.environment import environment
from benchmarks.families import FAMILIES, make_model

VARIANTS = ("wide", "separate")
BUCKETS = (128, 256, 512)
#: over-ladder batches, each run twice: one prompt, then another size, then two prompts
BATCHES = ((600,), (1000,), (400, 300))
SMOKE_BUCKETS, SMOKE_BATCHES = (16, 32), ((40,), (20, 30))


def separate_inputs(steps, prompts: list, lengths: list) -> tuple:
    """The inputs before ``wide_inputs``: ids and positions as tensors of their own (``--variant
    separate`` patches them in with ``None`` for the indices: the forward then reads the
    staging buffer's, as it did)."""
    device = steps.device_buffer.device
    ids = torch.cat([p.to(device) for p in prompts]).view(1, -1)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    return ids, positions


def run_family(name: str, variant: str, smoke: bool) -> dict:
    from breakgraph.integrations.transformers import PrefillRunner

    if smoke:
        from benchmarks.tiny_models import TINY, tiny_config

        model = make_model(tiny_config("LlamaConfig", **TINY), "cpu", torch.float32)
        options = dict(backend="emulated", compile={"backend": "aot_eager"})
        buckets, batches = SMOKE_BUCKETS, SMOKE_BATCHES
    else:
        model = make_model(FAMILIES[name].config(), "cuda", torch.bfloat16)
        options = dict(compile=True)
        buckets, batches = BUCKETS, BATCHES
    sync = torch.cuda.synchronize if torch.cuda.is_available() and not smoke else (lambda: None)
    torch._dynamo.reset()
    start = time.perf_counter()
    runner = PrefillRunner(model, token_buckets=buckets, on_miss="eager", max_prompts=4,
                           tune_buckets=False, **options)  # fmt: skip
    sync()
    record = {"family": name, "buckets": list(buckets),
              "construction_s": time.perf_counter() - start, "calls": []}  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    try:
        for lengths in batches:
            for repeat in (1, 2):
                prompts = [torch.randint(vocab, (n,), generator=generator) for n in lengths]
                before = dynamo_snapshot()
                sync()
                begin = time.perf_counter()
                runner.prefill(prompts).logits.float().sum().item()
                sync()
                seconds = time.perf_counter() - begin
                delta = dynamo_delta(before)
                record["calls"].append({
                    "lengths": list(lengths), "tokens": sum(lengths), "repeat": repeat,
                    "seconds": seconds, "frames": delta["frames"],
                    "compile_s": delta["compile_s"]["compile_s"],
                })  # fmt: skip
                print(f"{name} {variant} {list(lengths)} #{repeat}: {seconds:.3f} s, "
                      f"{delta['frames']} frames compiled", flush=True)  # fmt: skip
        record["eager_steps"] = runner.stats.eager_steps
    finally:
        runner.close()
    return record


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=VARIANTS, default="wide")
    parser.add_argument("--families", default="mistral-7b-4l,llama-1b")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.variant == "separate":
        from breakgraph.integrations.transformers.prefill_buffers import StepBuffers

        StepBuffers.wide_inputs = lambda self, prompts, lengths: (
            *separate_inputs(self, prompts, lengths), None)  # fmt: skip
    names = ["tiny"] if args.smoke else args.families.split(",")
    data = {
        "meta": {**environment(torch.cuda.is_available() and not args.smoke),
                 "variant": args.variant, "smoke": args.smoke},  # fmt: skip
        "families": [run_family(name, args.variant, args.smoke) for name in names],
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    return data


if __name__ == "__main__":
    main()
