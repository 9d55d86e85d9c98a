"""Continuous batching with transformers' ``generate_batch`` under breakable graphs (no download).

Runs on a GPU (CUDA graphs, FlashAttention varlen in bf16) or, without one, on the
CPU through the emulated backend (fp32, exact reference attention). Each step of
transformers' continuous batching mixes prefill chunks and decode tokens; while the
integration is enabled, everything but each layer's paged-cache access and
attention is captured, one graph per query-token bucket; a pure-decode step (one
new token per sequence) replays a graph with the cache write and read inside, no
break at all.

    python examples/continuous_batching.py
    python examples/continuous_batching.py --compile   # the decoder under torch.compile

``--compile`` runs the decoder under ``torch.compile``, so the graphs hold Inductor's fused
kernels (compiled once when the manager is created: seconds on a GPU, longer on a CPU).
"""

import sys

import torch
import transformers
from breakgraph.integrations.transformers import enable_continuous_batching
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

cuda = torch.cuda.is_available()
device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
backend = "cuda" if cuda else "emulated"

torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()

prompts = [torch.randint(0, 999, (n,)).tolist() for n in (5, 70, 17, 40, 9)]
generation = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=999)
# max_batch_tokens below the longest prompt: it is prefilled in chunks, next to decode tokens
batching = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=32)


def generate(**kwargs) -> list:
    outs = model.generate_batch(
        prompts, generation_config=generation, continuous_batching_config=batching, **kwargs
    )
    return [out.generated_tokens for out in outs.values()]


stock = generate()  # transformers' own continuous batching (sdpa with a mask, no graphs)

compile_decoder = "--compile" in sys.argv[1:]
with enable_continuous_batching(model, backend=backend, compile=compile_decoder) as handle:
    print("attention implementation while enabled:", model.config._attn_implementation)
    tokens = generate()

print(handle.stats)  # one capture per query bucket; every later step is a replay
decode = handle.decode_graphs.stats  # pure-decode steps, captured when first needed
print(f"pure-decode steps replayed as one graph: {decode.replays} ({decode.captures} captured)")
same = sum(a == b for a, b in zip(tokens, stock))
print(f"same tokens as transformers' continuous batching: {same}/{len(prompts)} prompts")
if not cuda:  # fp32 with the exact reference attention: token for token
    print("token for token:", tokens == stock)
print("every step replayed a graph:", handle.stats.replays > 0 and handle.stats.eager_steps == 0)
print("attention implementation after disable:", model.config._attn_implementation)
