"""Tensor parallelism: prefill a TP=2 HuggingFace Llama through breakable graphs.

transformers shards the model itself (``DistributedConfig(tp_size=2)``); its row-parallel
layers all-reduce and its ``lm_head`` all-gathers. ``PrefillRunner`` detects the sharding:
every rank captures the same graphs, every call agrees its bucket across ranks, and every
rank gets the full-vocabulary logits. Then the same TP model serves through continuous
batching (``enable_continuous_batching``), its steps replayed as breakable graphs.

    torchrun --nproc-per-node 2 examples/tensor_parallel.py   # 2 GPUs: NCCL and CUDA graphs
    python examples/tensor_parallel.py                         # launches itself the same way

Without 2 GPUs, start it with plain ``python``: it runs on the CPU (gloo and the emulated
backend), with any GPU hidden from the two processes. There is no ``from_config``
path for TP, so rank 0 saves a random model and every rank loads it with TP=2.
"""

import os
import shutil
import subprocess
import sys
import tempfile

import torch


def main() -> None:
    import torch.distributed as dist
    import transformers
    from breakgraph.integrations.transformers import PrefillRunner, enable_continuous_batching
    from transformers import GenerationConfig
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cuda = torch.cuda.device_count() >= 2
    rank = int(os.environ["RANK"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    dtype, backend = (torch.bfloat16, "cuda") if cuda else (torch.float32, "emulated")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    # rank 0 saves a random model; every rank loads it sharded (TP=2) and, to compare, whole
    path = [tempfile.mkdtemp(prefix="breakgraph-tp-") if rank == 0 else None]
    dist.broadcast_object_list(path)
    try:
        if rank == 0:
            torch.manual_seed(0)
            config = transformers.LlamaConfig(
                vocab_size=1000,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=2,
                max_position_embeddings=1024,
            )
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path[0])
        dist.barrier()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path[0],
            dtype=dtype,
            distributed_config=DistributedConfig(tp_size=dist.get_world_size()),
        ).eval()
        device = next(model.parameters()).device
        whole = transformers.AutoModelForCausalLM.from_pretrained(path[0], dtype=dtype)
        whole = whole.to(device).eval()
        dist.barrier()  # every rank has loaded the model: its files can go
    finally:  # also when saving or loading failed
        if rank == 0:
            shutil.rmtree(path[0], ignore_errors=True)

    runner = PrefillRunner(model, token_buckets=(64, 128), max_prompts=8, backend=backend)
    if rank == 0:
        print("captured on every rank:", runner.graph(64))

    # the same prompts on every rank (here: the same seed; in a server, broadcast them)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1000, (n,), generator=generator) for n in (5, 17, 40)]
    out = runner.prefill(prompts)
    with torch.no_grad():
        reference = torch.stack(
            [whole(p[None].to(device), use_cache=False).logits[0, -1] for p in prompts]
        )
    diff = (out.logits.float() - reference.float()).abs().max().item()
    tolerance = 0.1 if cuda else 1e-4  # bf16 sums in another order on 2 GPUs
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out.logits.float().cpu())
    print(
        f"rank {rank}: logits {tuple(out.logits.shape)} (full vocabulary), max |diff| vs the "
        f"unsharded model {diff:.2e}, within {tolerance:g}: {diff < tolerance}; "
        f"same logits on every rank: {all(torch.equal(g, gathered[0]) for g in gathered)}"
    )
    if rank == 0:
        print(runner.stats)
    runner.close()

    # continuous batching of the same TP model: transformers schedules rank 0's requests on
    # every rank; breakgraph captures the same buckets everywhere and agrees every step
    generation = GenerationConfig(
        max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    batching = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=32)
    requests = [p.tolist() for p in prompts]

    def generate() -> list:
        outs = model.generate_batch(
            requests,
            generation_config=generation,
            continuous_batching_config=batching,
            progress_bar=False,
        )
        return [outs[key].generated_tokens for key in sorted(outs)]

    stock = generate()  # transformers' own TP continuous batching, eager steps
    with enable_continuous_batching(model, backend=backend) as handle:
        tokens = generate()
    same = sum(a == b for a, b in zip(tokens, stock))
    print(
        f"rank {rank}: continuous batching, same tokens as transformers' TP CB: "
        f"{same}/{len(stock)} prompts; graph steps {handle.stats.replays}, eager steps "
        f"{handle.stats.eager_steps}"
    )
    if rank == 0:
        print(handle.stats)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:  # started with plain `python`: run it the way a user would, under torchrun
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        # fewer than 2 GPUs: hide them, or transformers would place both ranks' shards there
        hide = {} if torch.cuda.device_count() >= 2 else {"CUDA_VISIBLE_DEVICES": ""}
        env = dict(os.environ, **hide)
        sys.exit(subprocess.call(command + [os.path.abspath(__file__)], env=env))
