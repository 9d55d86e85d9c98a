"""Serve every causal LM of the installed transformers on a tiny config, to see which families
breakgraph could support (how session 47 chose the families it added).

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (or those named on the command
line), in a process of its own (some defaults allocate gigabytes, some hang): build a tiny
random-weight model (hidden 64, 2 layers, ``sdpa``), let breakgraph accept the type for this
run only, and compare

* ``prefill``: ``PrefillRunner`` (emulated backend) against the eager model's last logits on
  three prompts (exact: ≤ 1e-4 in fp32);
* ``cb``: ``enable_continuous_batching``'s greedy tokens against ``generate()``.

One line per type: ``OK`` where both agree, else ``MISMATCH`` with the largest difference, or
``FAIL`` with the stage and the error. A pass here is where vetting starts, not support: a
family is supported once its distinguishing features run in the tests
(``benchmarks/tiny_models.py``) and the fuzzers draw it; hybrids with state besides the KV
cache can pass a prefill and must still be refused (docs/integration-transformers.md).

Usage::

    python scripts/family_sweep.py                 # every causal LM (about 20 min, one at a time)
    python scripts/family_sweep.py llama gpt2      # some
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-4
#: the tiny shape; token ids outside its vocabulary are unset (several defaults are larger)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=512,
             pad_token_id=None, eos_token_id=None, bos_token_id=None)  # fmt: skip


def sweep_one(model_type: str) -> str:
    """The verdict line of one model type (run in this process)."""
    import torch
    import transformers
    from breakgraph.integrations.transformers import (
        PrefillRunner,
        enable_continuous_batching,
        models,
    )

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    supported = models.SUPPORTED_MODEL_TYPES
    models.SUPPORTED_MODEL_TYPES = (*supported, model_type)  # for this call only
    try:
        return _serve(model_type, torch, transformers, PrefillRunner, enable_continuous_batching)
    finally:
        models.SUPPORTED_MODEL_TYPES = supported


def _serve(model_type, torch, transformers, PrefillRunner, enable_continuous_batching) -> str:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        return f"{model_type} FAIL config no config class"
    stage = "config"
    try:
        config = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])(**SHAPE)
        stage = "model"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model.eval()
        generator = torch.Generator().manual_seed(1)
        prompts = [torch.randint(128, (n,), generator=generator) for n in (7, 20, 13)]
        stage = "prefill"
        with torch.no_grad():
            runner = PrefillRunner(model, backend="emulated", token_buckets=(16, 48),
                                   max_prompts=4, warmup=1, tune_buckets=False)  # fmt: skip
            logits = runner.prefill(prompts).logits
            runner.close()
            worst = max((logits[i].float() - model(p[None], use_cache=False).logits[0, -1].float())
                        .abs().max().item() for i, p in enumerate(prompts))  # fmt: skip
        if worst > TOLERANCE:
            return f"{model_type} MISMATCH prefill {worst:.2e}"
        stage = "cb"
        gen = transformers.GenerationConfig(max_new_tokens=6, do_sample=False,
                                            eos_token_id=None, pad_token_id=127)  # fmt: skip
        lists = [p.tolist() for p in prompts]
        with torch.no_grad():
            expected = [model.generate(p[None], attention_mask=torch.ones_like(p[None]),
                                       generation_config=gen)[0, len(p):].tolist()
                        for p in prompts]  # fmt: skip
        cbc = transformers.ContinuousBatchingConfig(block_size=8, num_blocks=64,
                                                    max_batch_tokens=16)  # fmt: skip
        with enable_continuous_batching(model, backend="emulated", query_buckets=(8, 16)):
            outs = model.generate_batch(
                lists, generation_config=gen, continuous_batching_config=cbc, progress_bar=False
            )
        got = {tuple(o.prompt_ids): (o.generated_tokens, o.error) for o in outs.values()}
        wrong = [i for i, p in enumerate(lists) if got.get(tuple(p), (None,))[0] != expected[i]]
        if wrong:
            errors = {error for _, error in got.values() if error}
            return f"{model_type} MISMATCH cb prompts {wrong} {sorted(errors)[:1]}"
        return f"{model_type} OK prefill {worst:.1e}"
    except Exception as error:  # noqa: BLE001 (a sweep reports every failure)
        message = " ".join(str(error).split())[:200]
        return f"{model_type} FAIL {stage} {type(error).__name__}: {message}"


def _limit_memory() -> None:
    """8 GiB of address space per type: some defaults allocate more (an OOM kill otherwise)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        print(sweep_one(argv[1]), flush=True)
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type in argv or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            done = subprocess.run([sys.executable, __file__, "--one", model_type], cwd=ROOT,
                                  capture_output=True, text=True, timeout=180,
                                  preexec_fn=_limit_memory)  # fmt: skip
            line = done.stdout.strip().splitlines()[-1:] or [f"{model_type} FAIL crashed "
                                                             f"(exit {done.returncode})"]
            print(line[0], flush=True)
        except subprocess.TimeoutExpired:
            print(f"{model_type} FAIL timeout 180 s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
