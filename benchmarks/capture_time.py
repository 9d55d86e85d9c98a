"""Where the construction time of ``PrefillRunner(model)`` goes (issue 23 item 5).

Each variant builds the default runner in a fresh process (cuDNN plans and CUDA kernels are
cached per process, so a second runner in the same process is faster; that second runner is
timed too), on random-weight models of ``benchmarks.families``::

    python -m benchmarks.capture_time --families llama-1b,mistral-sw256-4l --out capture.json

Variants (each changes one thing, for the measurement only):

* ``default``: what a user gets;
* ``no_sync_check``: segments captured without the host-sync detection (the dispatch mode
  that watches every aten operation of a captured segment is not installed);
* ``no_cudnn_sdpa``: ``torch.backends.cuda.enable_cudnn_sdp(False)``, so the single-prompt
  SDPA call builds no cuDNN plan per bucket length (FlashAttention-2 instead);
* ``neither``: both;
* ``no_tune_warmup``: tuning times each bucket without an untimed replay first
  (``BucketedRunner.tune(warmup=0)``; the capture already replayed every segment);
* ``cudnn_ragged``: the process starts with ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``, PyTorch's
  opt-in that keys cuDNN's SDPA plans on the sequence lengths rounded up to powers of two
  (passing the real lengths to the kernel), so 64 bucket lengths need about 10 plans. PyTorch
  reads it once per process, at its first cuDNN attention call, hence a variable of the
  child's environment and not a switch inside it. Its first use warns (the path is marked
  experimental); ``ragged_path_taken`` records whether the child's stderr says so.

``--turns 2`` runs the variants again in the reverse order (ABBA), so a drift of the machine
over the run hits every variant alike.

Prints, per family and variant: the whole construction, the first (largest) bucket, the
mean of the others, and the same for a second runner built right after in the same process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = (
    "default",
    "no_sync_check",
    "no_cudnn_sdpa",
    "neither",
    "no_tune_warmup",
    "cudnn_ragged",
)
# variants that only set an environment variable of the child process
CHILD_ENVIRONMENT = {"cudnn_ragged": {"TORCH_CUDNN_SDPA_AVOID_RECOMPILE": "1"}}


@contextlib.contextmanager
def _variant(name: str):
    from breakgraph.backends import cuda as cuda_backend
    from breakgraph.patches import PatchSet

    patches = PatchSet()
    if name in ("no_cudnn_sdpa", "neither"):
        before = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)
    if name in ("no_sync_check", "neither"):

        class Unwatched:  # counts nothing, watches nothing: no dispatch mode at all
            operations = 1

            def __init__(self, **kwargs):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        patches.attribute(cuda_backend, "CompileTransparentSegmentMode", Unwatched)
    if name == "no_tune_warmup":
        from breakgraph.runner import BucketedRunner

        tune = BucketedRunner.tune
        patches.attribute(
            BucketedRunner, "tune", lambda self, *a, **k: tune(self, *a, **k, warmup=0)
        )
    try:
        with patches:
            yield
    finally:
        if name in ("no_cudnn_sdpa", "neither"):
            torch.backends.cuda.enable_cudnn_sdp(before)


def _ladder(seconds: dict) -> dict:
    values = list(seconds.values())
    rest = values[1:]
    return {
        "first_s": values[0],
        "rest_mean_s": statistics.fmean(rest) if rest else None,
        "rest_median_s": statistics.median(rest) if rest else None,
        "buckets": len(values),
    }


def child(family_name: str, variant: str) -> dict:
    from breakgraph.integrations.transformers import PrefillRunner

    from benchmarks.families import CB_FAMILIES, FAMILIES, SMOKE_FAMILIES, make_model

    family = {**FAMILIES, **CB_FAMILIES, **SMOKE_FAMILIES}[family_name]
    model = make_model(family.config(), "cuda", torch.bfloat16)
    out: dict = {"family": family_name, "variant": variant}
    with torch.no_grad(), _variant(variant):
        for which in ("first", "second"):
            torch.cuda.synchronize()
            start = time.perf_counter()
            runner = PrefillRunner(model)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            captures = dict(runner.stats.capture_seconds)
            out[which] = {
                "construction_s": seconds,
                **_ladder(captures),
                # after the packed ladder's captures: the single-prompt ladder, then tuning
                "after_captures_s": seconds - sum(captures.values()),
                "routed": {str(k): v for k, v in runner._runner.ladder.stats.routed.items()},
            }
            probe = torch.randint(model.config.vocab_size, (200,), device="cuda")
            out[which]["prefill_ok"] = bool(torch.isfinite(runner.prefill([probe]).logits).all())
            runner.close()
    return out


def run_child(family: str, variant: str) -> dict | None:
    """One fresh process: its result, or ``None`` (printed) when it failed."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.capture_time", "--child", family, variant],
        capture_output=True, text=True, env={**os.environ, **CHILD_ENVIRONMENT.get(variant, {})},
    )  # fmt: skip
    if done.returncode:
        print(f"{family} {variant}: failed\n{done.stderr[-2000:]}", flush=True)
        return None
    r = json.loads(done.stdout.strip().splitlines()[-1])
    r["ragged_path_taken"] = "AVOID_RECOMPILE=1 is currently experimental" in done.stderr
    f, s = r["first"], r["second"]
    print(
        f"{family:18s} {variant:14s} construction {f['construction_s']:6.2f} s "
        f"(first bucket {f['first_s']:.3f}, rest mean {f['rest_mean_s']:.4f}) | "
        f"second runner {s['construction_s']:6.2f} s (rest mean {s['rest_mean_s']:.4f})",
        flush=True,
    )
    return r


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="llama-1b,mistral-sw256-4l")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--turns", type=int, default=1, help="even turns reverse the order")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    from benchmarks.families import CB_FAMILIES, FAMILIES, SMOKE_FAMILIES

    families, variants = args.families.split(","), args.variants.split(",")
    known = {**FAMILIES, **CB_FAMILIES, **SMOKE_FAMILIES}
    if unknown := [f for f in families if f not in known]:
        parser.error(f"unknown families {unknown}; known: {', '.join(known)}")
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    results = []
    for turn in range(args.turns):
        order = variants if turn % 2 == 0 else variants[::-1]
        for family in families:
            for variant in order:
                if (r := run_child(family, variant)) is not None:
                    results.append({**r, "turn": turn + 1})
    if args.out:
        from benchmarks.environment import environment

        with open(args.out, "w") as f:
            json.dump({"meta": environment(cuda=True), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
