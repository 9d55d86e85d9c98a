"""Pairwise greedy-token agreement of continuous-batching implementations (a diagnostic).

Why: in bf16 on random weights, top logits are nearly tied, so any two implementations
whose arithmetic differs (attention kernel, GEMM row count, batch composition) produce
different greedy sequences after a while. This separates that from a bug: each
implementation runs twice or through two APIs (it must agree with itself), and every pair
is compared by whole sequences and by common prefix, and against ``model.generate``.

    python -m benchmarks.cb_agreement     # H200: llama-1b shape, bf16, about a minute
                                          # CPU: a tiny model, fp32, emulated backend

Result on the H200: docs/results/h200-cb-agreement.log.
"""

from __future__ import annotations

import torch
import transformers
from breakgraph.integrations.transformers import enable_continuous_batching
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from . import bench_cb as B

NEW_TOKENS = 32


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    transformers.logging.set_verbosity_error()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    config = B.CONFIGS["llama-1b" if cuda else "tiny-llama"]()
    for key in ("bos_token_id", "eos_token_id"):
        setattr(config, key, None)
    config.pad_token_id = 0
    model = B.make_model(config, device, torch.bfloat16 if cuda else torch.float32)
    prompts = B.make_prompts(48 if cuda else 6, 16, 512 if cuda else 40, config.vocab_size, 2)
    gen = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
    )

    def run(kind: str, use_graph=None, use_async=None, api: str = "manager") -> list:
        handle = None
        if kind == "breakgraph":
            handle = enable_continuous_batching(model, backend="cuda" if cuda else "emulated")
        else:
            model.set_attn_implementation("sdpa")
        batching = ContinuousBatchingConfig(
            block_size=256 if cuda else 16,
            num_blocks=256 if cuda else 64,
            max_batch_tokens=2048 if cuda else 32,
            allow_block_sharing=False,
            use_cuda_graph=use_graph,
            use_async_batching=use_async,
        )
        try:
            if api == "batch":
                outs = model.generate_batch(
                    prompts,
                    generation_config=gen,
                    continuous_batching_config=batching,
                    progress_bar=False,
                )
                order = sorted(outs, key=lambda request: int(request.split("_")[1]))
                return [outs[request].generated_tokens for request in order]
            manager = model.init_continuous_batching(
                generation_config=gen, continuous_batching_config=batching
            )
            manager.warmup()
            manager.start()
            try:
                return B.serve(manager, prompts, NEW_TOKENS)[0]
            finally:
                manager.stop(block=True)
                manager.destroy()
        finally:
            if handle is not None:
                handle.disable()
            model.set_attn_implementation("sdpa")

    with torch.no_grad():
        reference = [
            model.generate(torch.tensor([p], device=device), generation_config=gen)[
                0, len(p) :
            ].tolist()
            for p in prompts[:8]
        ]
    runs = {
        "sdpa_mgr_1": run("sdpa"),
        "sdpa_mgr_2": run("sdpa"),
        "sdpa_batch": run("sdpa", api="batch"),
        "bg_mgr": run("breakgraph"),
        "bg_mgr_eager": run("breakgraph", use_graph=False),
        "bg_batch": run("breakgraph", api="batch"),
    }
    if cuda:
        runs["sdpa_graphs"] = run("sdpa", use_graph=True, use_async=True)  # stock whole-step
    print(f"pairwise: same full sequences / mean common prefix (of {NEW_TOKENS})")
    for a, tokens_a in runs.items():
        cells = []
        for tokens_b in runs.values():
            same = sum(x == y for x, y in zip(tokens_a, tokens_b)) / len(prompts)
            prefix = sum(map(common_prefix, tokens_a, tokens_b)) / len(prompts)
            cells.append(f"{same:4.2f}/{prefix:4.1f}")
        print(f"{a:>13} " + " ".join(cells))
    for name, tokens in runs.items():
        same = sum(x == y for x, y in zip(tokens, reference)) / len(reference)
        prefix = sum(map(common_prefix, tokens, reference)) / len(reference)
        print(
            f"vs model.generate ({len(reference)} prompts): {name:>13} same {same:.2f}, "
            f"prefix {prefix:.1f}"
        )


if __name__ == "__main__":
    main()
