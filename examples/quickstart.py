"""Quickstart: prefill a tiny HuggingFace Llama through breakable graphs (no download).

Runs on a GPU (CUDA graphs, FlashAttention varlen in bf16) or, without one, on the
CPU through the emulated backend. Prompts of different lengths are packed into one
row; everything but attention is captured; attention runs as an eager break per
layer with the exact lengths of the live batch.

    python examples/quickstart.py
"""

import torch
import transformers
from breakgraph.integrations.transformers import PrefillRunner

cuda = torch.cuda.is_available()
device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
backend = "cuda" if cuda else "emulated"

torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()

runner = PrefillRunner(model, token_buckets=(64, 256), max_prompts=8, backend=backend)
print("captured:", runner.graph(64))

prompts = [torch.randint(1000, (n,)) for n in (5, 17, 40)]
out = runner.prefill(prompts)
print("logits:", tuple(out.logits.shape), "(one row of next-token logits per prompt)")

with torch.no_grad():
    for i, p in enumerate(prompts):
        ref = model(p[None].to(device), use_cache=False).logits[0, -1]
        diff = (out.logits[i].float() - ref.float()).abs().max().item()
        same = bool(out.logits[i].argmax() == ref.argmax())
        print(
            f"prompt {i}: {len(p):>3} tokens, max |diff| vs eager {diff:.2e}, "
            f"same next token: {same}"
        )

first = out.logits[0].argmax()
more = model.generate(
    torch.cat([prompts[0].to(device), first[None]])[None],
    past_key_values=out.cache(0),
    max_new_tokens=5,
    do_sample=False,
)
print("greedy continuation from the prefill cache:", more[0, len(prompts[0]) :].tolist())
print(runner.stats)
runner.close()
