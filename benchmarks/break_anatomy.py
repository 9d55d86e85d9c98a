"""What one attention break costs, piece by piece (GPU only; a measurement, not an API).

Four prefill runners of the same model, timed call by call in turns:

  full graph       attention captured inside ONE graph (``benchmarks/one_graph.py``)
  + cuts           the same, plus an empty ``break_graph()`` after every layer's attention
                   (``cut_after_attention=True``): the cost of cutting the graph alone (same
                   kernels, nothing eager)
  + eager flash    breakgraph with the attention kernel launched eagerly, its result NOT
                   copied back (timing only: the answer is wrong); what the in-place
                   FlashAttention op of torch >= 2.12 would cost
  breakgraph       the real thing: eager attention kernel plus the copy-back

    python -m benchmarks.break_anatomy --out anatomy.json   # also part of scripts/gpu_check.sh
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
from breakgraph.integrations.transformers import PrefillRunner
from breakgraph.integrations.transformers import attention as _attention

from breakgraph.patches import patch_attribute

from .environment import environment
from .families import FAMILIES, make_model
from .one_graph import OneGraphPrefillRunner
from .timing import interleaved

TOKENS = (32, 128, 2048)


class _LaunchWithoutCopyBack(_attention.LayerAttention):
    """Launches the attention kernel on replay, then returns the capture-time output, so
    copy-back skips it (``new is captured``): timing only, the result is stale."""

    def __call__(self):
        out = super().__call__()
        if not hasattr(self, "captured_out"):
            self.captured_out = out
        return self.captured_out


def runner_without_copy_back(model, buckets):
    with contextlib.ExitStack() as stack:  # the breaks built during capture keep the class
        patch_attribute(stack, _attention, "LayerAttention", _LaunchWithoutCopyBack)
        return PrefillRunner(model, token_buckets=buckets, max_prompts=16)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-1b", choices=list(FAMILIES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = FAMILIES[args.model].config()
    model = make_model(config, "cuda", torch.bfloat16)
    runners = {
        "full_graph": OneGraphPrefillRunner(model, token_buckets=TOKENS, max_prompts=16),
        "cuts_only": OneGraphPrefillRunner(
            model, token_buckets=TOKENS, max_prompts=16, cut_after_attention=True
        ),
        "eager_flash_no_copy": runner_without_copy_back(model, TOKENS),
        "breakgraph": PrefillRunner(model, token_buckets=TOKENS, max_prompts=16),
    }
    breaks = config.num_hidden_layers
    assert runners["cuts_only"].graph(TOKENS[0]).num_breaks == breaks
    rows = []
    for n in TOKENS:
        prompt = torch.randint(config.vocab_size, (n,), device="cuda")
        times = interleaved(
            {k: (lambda r=r: r.prefill([prompt])) for k, r in runners.items()},
            rounds=20,
            iters=10,
            warmup=5,
            sync=torch.cuda.synchronize,
        )["ms"]
        full = times["full_graph"]
        rows.append(
            {
                "tokens": n,
                "ms": times,
                "us_per_break": {k: (t - full) * 1e3 / breaks for k, t in times.items()},
            }
        )
    for r in runners.values():
        r.close()
    print(f"{args.model}, {breaks} breaks; µs added per break over the full graph (device time)")
    print(f"{'tokens':>7}{'full ms':>10}{'cuts only':>11}{'+ eager flash':>15}{'breakgraph':>12}")
    for row in rows:
        per = row["us_per_break"]
        print(
            f"{row['tokens']:>7}{row['ms']['full_graph']:>10.3f}{per['cuts_only']:>11.2f}"
            f"{per['eager_flash_no_copy']:>15.2f}{per['breakgraph']:>12.2f}"
        )
    if args.out:
        meta = {**environment(cuda=True), "model": args.model, "breaks": breaks}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
