"""Continuous batching throughput and time to first token: stock transformers vs breakgraph.

Run on a GPU machine (bf16, random weights, no download; with 120 prompts and 3 rounds about
4 minutes on an H200, longer with the default 200 prompts)::

    python benchmarks/bench_cb.py --out cb.json

and on any machine, in seconds (tiny model, CPU, the emulated backend; checks that the
script runs and that breakgraph's tokens equal transformers')::

    python benchmarks/bench_cb.py --smoke --out cb-smoke.json

Workload: ``--prompts`` random prompts of ``--min-len``..``--max-len`` tokens, all
submitted at once to one continuous-batching manager, ``--new-tokens`` greedy tokens
each (no EOS). Every CB variant uses the same ``ContinuousBatchingConfig``
(``--block-size``, ``--num-blocks``, ``--max-batch-tokens``; prefix sharing off, so
repeated passes cannot reuse cached blocks). Variants:

  paged_sdpa    (a) transformers CB as shipped without flash_attn: ``paged|sdpa``, a dense
                [tokens x KV] mask, no graphs
  breakgraph    (b) ``enable_continuous_batching`` with ``use_async_batching=False``: one
                breakable graph per query bucket, each layer's cache access + varlen
                attention an eager break, steps synchronous
  breakgraph_async  (b) with asynchronous batching, the default on CUDA: two IO pairs
                sharing one graph per bucket, the host prepares step N+1 while the device
                runs step N (CUDA only)
  breakgraph_pow2  (b) with the earlier default query buckets (powers of two from 8), to
                measure what the coarser default (32, 128, 512, ...) costs or saves
  whole_graph   (c) transformers' own whole-step CUDA graphs (the design it uses with
                flash_attn: keys query x KV x max_seqlen_k, upper-bound lengths baked in),
                built with torch's FlashAttention varlen kernel (``paged|torch_varlen``,
                registered by this script); async batching on, as transformers picks with flash
  generate      (d) ``model.generate`` one prompt at a time, on ``--generate-prompts``
                prompts of median length with ``--generate-new-tokens`` tokens; tokens/s is
                measured there and the queue's time to first token extrapolated (it says so)

(c) captures its graphs lazily while serving, so it runs the workload twice on one manager
with fresh prompts of the same lengths: ``cold`` includes the captures, ``warm`` is the
headline. breakgraph captures every bucket in ``manager.warmup()`` (reported as capture
seconds), so one pass measures it.
Reported per variant: tokens/s, time to first token (mean, p50, p90 from submission),
steps, transformers' host scheduling time per step, graphs captured, capture seconds,
and token agreement with (a) (bf16 runs differ at near-ties; the smoke run must agree
exactly).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import transformers
from breakgraph.integrations.transformers import attention as bg_attention
from breakgraph.integrations.transformers import enable_continuous_batching
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

try:  # python -m benchmarks.bench_cb
    from .families import FAMILIES, SMOKE_FAMILIES, make_model
except ImportError:  # python benchmarks/bench_cb.py
    from families import FAMILIES, SMOKE_FAMILIES, make_model

CONFIGS = {  # the dense shapes are benchmarks/families.py's (bench_prefill uses them too)
    "llama-1b": FAMILIES["llama-1b"].config,
    "qwen3-0.6b": FAMILIES["qwen3-0.6b"].config,
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(  # ~0.4B parameters, grouped_mm experts
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        max_position_embeddings=4096,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "tiny-llama": SMOKE_FAMILIES["tiny-llama"].config,  # --smoke
}
VARLEN_KEY = "paged|torch_varlen"


# -- (c): transformers' whole-step graphs with torch's varlen kernel ---------------------------
def torch_varlen_paged_attention(
    module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs
):
    """transformers' ``paged|flash_attention_2`` without flash_attn: the cache update and
    ATen's FlashAttention varlen kernel with the lengths CB passes (upper bounds under graphs)."""
    layer_type = "sliding_attention" if sliding_window else "full_attention"
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):
        cu_k, max_k = cu_k[layer_type], max_k[layer_type]
    k, v = kwargs["cache"].update(
        key, value, module.layer_idx, kwargs["read_index"], kwargs["write_index"]
    )
    out = bg_attention.flash_varlen(
        query[0].transpose(0, 1).contiguous(),
        k.contiguous(),
        v.contiguous(),
        kwargs["cu_seq_lens_q"],
        cu_k,
        kwargs["max_seqlen_q"],
        max_k,
        scaling,
        sliding_window,
    )
    return out, None


class Instruments:
    """Counts CB steps, transformers' host scheduling time and whole-step graph captures."""

    def __init__(self) -> None:
        from transformers.generation.continuous_batching import continuous_api, model_runner

        self.steps = 0
        self.prepare_s = 0.0
        self.captures = 0
        self.capture_s = 0.0
        self._saved = []
        processor = continuous_api.ContinuousBatchProcessor
        runner = model_runner.ModelRunner
        prepare, capture = processor.prepare_next_batch, runner._capture_graph

        def prepare_next_batch(this):
            start = time.perf_counter()
            scheduled = prepare(this)
            self.prepare_s += time.perf_counter() - start
            self.steps += int(scheduled)
            return scheduled

        def capture_graph(this, *args):
            start = time.perf_counter()
            capture(this, *args)
            torch.cuda.synchronize()
            self.captures += 1
            self.capture_s += time.perf_counter() - start

        for owner, name, fn in (
            (processor, "prepare_next_batch", prepare_next_batch),
            (runner, "_capture_graph", capture_graph),
        ):
            self._saved.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, fn)

    def reset(self) -> None:
        self.steps, self.prepare_s = 0, 0.0

    def remove(self) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)


# -- workload ---------------------------------------------------------------------------------
def make_prompts(count, min_len, max_len, vocab, seed) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(
        min_len, max_len + 1, (count,), generator=torch.Generator().manual_seed(0)
    )
    return [torch.randint(0, vocab - 1, (int(n),), generator=generator).tolist() for n in lengths]


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def serve(manager, prompts, new_tokens) -> tuple[list, float, list]:
    """Submit every prompt at once; (tokens per prompt, seconds, time to first token each)."""
    start = time.perf_counter()
    ids = manager.add_requests(prompts, max_new_tokens=new_tokens, record_timestamps=True)
    results = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=120)
        if result is None:
            raise RuntimeError(
                f"the CB manager stopped answering ({len(results)}/{len(ids)} results)"
            )
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        if result.is_finished():
            results[result.request_id] = result
    seconds = time.perf_counter() - start
    ordered = [results[i] for i in ids]
    return (
        [r.generated_tokens for r in ordered],
        seconds,
        [r.timestamps[0] - r.created_time for r in ordered],
    )


def summary(tokens, seconds, ttft, instruments) -> dict:
    ttft = sorted(ttft)
    generated = sum(len(t) for t in tokens)
    return {
        "seconds": seconds,
        "tokens": generated,
        "tokens_per_s": generated / seconds,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p90_s": ttft[int(len(ttft) * 0.9)],
        "steps": instruments.steps,
        "host_prepare_ms_per_step": 1e3 * instruments.prepare_s / max(1, instruments.steps),
    }


def agreement(got, ref) -> float:
    return sum(g == r for g, r in zip(got, ref)) / len(ref)


def run_cb_variant(model, name, args, sets, gen, instruments, backend) -> tuple[dict, list]:
    """One CB variant: a manager, warm-up, then one or two passes of the workload."""
    cbc = ContinuousBatchingConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        allow_block_sharing=False,
        use_cuda_graph=True if name == "whole_graph" else None,
        use_async_batching=name in ("whole_graph", "breakgraph_async"),
    )
    handle = None
    if name == "breakgraph_pow2":  # the earlier default ladder: powers of two from 8
        buckets = [8 * 2**i for i in range(20) if 8 * 2**i < args.max_batch_tokens]
        handle = enable_continuous_batching(model, backend=backend, query_buckets=buckets)
    elif name == "paged_sdpa":
        model.set_attn_implementation("sdpa")  # CB switches it to paged|sdpa
    elif name == "whole_graph":
        model.set_attn_implementation(VARLEN_KEY)
    else:
        handle = enable_continuous_batching(model, backend=backend)
    instruments.captures, instruments.capture_s = 0, 0.0
    try:
        manager = model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=cbc
        )
        start = time.perf_counter()
        manager.warmup()
        synchronize(model.device)
        warmup_s = time.perf_counter() - start
        manager.start()
        passes = {}
        try:
            for label, prompts in sets:
                instruments.reset()
                tokens, seconds, ttft = serve(manager, prompts, args.new_tokens)
                passes[label] = summary(tokens, seconds, ttft, instruments)
                passes[label]["_tokens"] = tokens
        finally:
            manager.stop(block=True)
            manager.destroy()
    finally:
        if handle is not None:
            stats = handle.stats
            handle.disable()
        model.set_attn_implementation("sdpa")
    result = {"warmup_s": warmup_s, **passes}
    if handle is not None:
        result.update(
            graphs=stats.captures,
            capture_s=stats.capture_s,
            replays=stats.replays,
            eager_steps=stats.eager_steps,
            breaks_per_graph=max((b.breaks for b in stats.buckets.values()), default=0),
            buckets=sorted(stats.buckets),
            stats_table=str(stats),
        )
    elif name == "whole_graph":
        result.update(graphs=instruments.captures, capture_s=instruments.capture_s)
    else:
        result.update(graphs=0, capture_s=0.0)
    headline = passes["warm"] if "warm" in passes else passes["cold"]
    tokens = headline.pop("_tokens")
    for entry in passes.values():
        entry.pop("_tokens", None)
    result.update({k: headline[k] for k in ("tokens_per_s", "ttft_mean_s", "ttft_p50_s")})
    return result, tokens


@torch.no_grad()
def run_generate(model, prompts, args) -> dict:
    """(d): ``model.generate`` one prompt at a time on a few median-length prompts."""
    subset = sorted(prompts, key=len)[len(prompts) // 2 :][: args.generate_prompts]
    gen = GenerationConfig(
        max_new_tokens=args.generate_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    device = model.device
    first = torch.tensor([subset[0]], device=device)
    short = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(first, attention_mask=torch.ones_like(first), generation_config=short)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    for p in subset:
        ids = torch.tensor([p], device=device)
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    synchronize(device)
    seconds = time.perf_counter() - start
    per_token = seconds / (len(subset) * args.generate_new_tokens)
    per_prompt = per_token * args.new_tokens  # a whole request of the workload, extrapolated
    n = args.prompts
    return {
        "measured_prompts": len(subset),
        "measured_new_tokens": args.generate_new_tokens,
        "seconds": seconds,
        "tokens_per_s": 1.0 / per_token,
        "ttft_mean_s": per_prompt * (n - 1) / 2 + per_token,
        "ttft_p50_s": per_prompt * (n // 2) + per_token,
        "note": (
            f"measured on {len(subset)} median-length prompts x {args.generate_new_tokens} "
            f"tokens; time to first token extrapolated for a queue of {n} prompts served one "
            f"at a time ({args.new_tokens} tokens each)"
        ),
    }


def run_model(name, args, device, dtype, backend) -> dict:
    config = CONFIGS[name]()
    for key in ("bos_token_id", "eos_token_id"):
        setattr(config, key, None)
    config.pad_token_id = 0
    model = make_model(config, device, dtype)
    vocab = config.vocab_size
    cold = make_prompts(args.prompts, args.min_len, args.max_len, vocab, seed=1)
    warm = make_prompts(args.prompts, args.min_len, args.max_len, vocab, seed=2)
    gen = GenerationConfig(
        max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    out = {
        "model": name,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "prompt_tokens": sum(map(len, cold)),
        "variants": {},
    }
    instruments = Instruments()
    rounds: dict[str, list] = {}  # variant -> its result in each round
    try:
        tokens = {}
        runnable = []
        for variant in args.variants:
            if variant == "generate":
                continue
            if variant == "whole_graph" and (
                device.type != "cuda" or not bg_attention.flash_available(dtype, device)
            ):
                out["variants"][variant] = {"skipped": "needs CUDA and bf16/fp16"}
            elif variant == "breakgraph_async" and device.type != "cuda":
                out["variants"][variant] = {"skipped": "needs CUDA"}
            else:
                runnable.append(variant)
        for turn in range(args.rounds):  # the variants take turns: noise hits them alike
            for variant in runnable:
                if variant == "paged_sdpa" and turn > 0:
                    continue  # (a) is 4-8x slower: one pass (its noise cannot move a 3x target)
                # (c) captures lazily while serving: a cold pass first; (a) has no graphs and
                # breakgraph captures every bucket in manager.warmup(): one pass each
                sets = (
                    [("cold", cold), ("warm", warm)]
                    if variant == "whole_graph"
                    else [("warm", warm)]
                )
                print(f"[{name}] {variant} (round {turn + 1}) ...", flush=True)
                result, result["_tokens"] = run_cb_variant(
                    model, variant, args, sets, gen, instruments, backend
                )
                rounds.setdefault(variant, []).append(result)
                print(f"[{name}] {variant}: {result['tokens_per_s']:.0f} tok/s", flush=True)
        for variant, results in rounds.items():  # the median round stands for the variant
            ordered = sorted(results, key=lambda r: r["tokens_per_s"])
            median_round = ordered[(len(ordered) - 1) // 2]  # the lower middle, as median_low
            tokens[variant] = median_round.pop("_tokens")
            out["variants"][variant] = dict(
                median_round, rounds_tokens_per_s=[r["tokens_per_s"] for r in results]
            )
        if "paged_sdpa" in tokens:
            for variant, got in tokens.items():
                out["variants"][variant]["tokens_agree_with_paged_sdpa"] = agreement(
                    got, tokens["paged_sdpa"]
                )
        if "generate" in args.variants:
            print(f"[{name}] generate ...", flush=True)
            out["variants"]["generate"] = run_generate(model, warm, args)
    finally:
        instruments.remove()
    variants = out["variants"] = {
        v: out["variants"][v] for v in args.variants if v in out["variants"]
    }
    ratios, spread = {}, {}
    for bg in ("breakgraph", "breakgraph_async"):
        if bg not in rounds:
            continue
        if "paged_sdpa" in rounds:
            per_round = [r["tokens_per_s"] / rounds["paged_sdpa"][0]["tokens_per_s"]
                         for r in rounds[bg]]  # fmt: skip
            ratios[f"{bg}_over_paged_sdpa"] = statistics.median_low(per_round)
            spread[f"{bg}_over_paged_sdpa"] = [min(per_round), max(per_round)]
        if "whole_graph" in rounds:  # round by round: the two ran next to each other
            per_round = [
                r["tokens_per_s"] / w["tokens_per_s"]
                for r, w in zip(rounds[bg], rounds["whole_graph"])
            ]
            ratios[f"{bg}_over_whole_graph"] = statistics.median_low(per_round)
            spread[f"{bg}_over_whole_graph"] = [min(per_round), max(per_round)]
            ratios[f"whole_graph_graphs_over_{bg}"] = variants["whole_graph"]["graphs"] / max(
                1, variants[bg]["graphs"]
            )
    out["ratios"], out["ratio_spread"] = ratios, spread
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def print_summary(results: dict) -> None:
    for m in results["models"]:
        print(
            f"\n{m['model']} ({m['params_m']:.0f}M params), {len(m.get('variants', {}))} variants, "
            f"{m['prompt_tokens']} prompt tokens"
        )
        print(
            f"  {'variant':<18}{'tok/s':>9}{'TTFT mean':>11}{'TTFT p50':>10}{'steps':>7}"
            f"{'host ms/step':>14}{'graphs':>8}{'capture s':>11}{'agree':>7}"
        )
        for name, v in m["variants"].items():
            if "skipped" in v:
                print(f"  {name:<18}skipped: {v['skipped']}")
                continue
            row = v.get("warm", v)
            print(
                f"  {name:<18}{v['tokens_per_s']:>9.1f}{v['ttft_mean_s']:>11.2f}"
                f"{v['ttft_p50_s']:>10.2f}{row.get('steps', '-'):>7}"
                f"{row.get('host_prepare_ms_per_step', float('nan')):>14.1f}"
                f"{v.get('graphs', '-'):>8}{v.get('capture_s', 0.0):>11.2f}"
                f"{v.get('tokens_agree_with_paged_sdpa', float('nan')):>7.2f}"
            )
        for key, value in m["ratios"].items():
            low_high = m.get("ratio_spread", {}).get(key)
            spread = f" (rounds {low_high[0]:.2f}-{low_high[1]:.2f})" if low_high else ""
            print(f"  {key}: {value:.2f}{spread}")
        if "note" in m["variants"].get("generate", {}):
            print(f"  generate: {m['variants']['generate']['note']}")
        if "stats_table" in m["variants"].get("breakgraph", {}):
            print(
                "  breakgraph stats:\n    "
                + m["variants"]["breakgraph"]["stats_table"].replace("\n", "\n    ")
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU, emulated backend")
    parser.add_argument("--models", default="llama-1b,qwen3-0.6b,qwen3-moe")
    parser.add_argument(
        "--variants", default="paged_sdpa,breakgraph,breakgraph_async,whole_graph,generate",
        help="comma-separated subset of paged_sdpa, breakgraph, breakgraph_async, whole_graph, "
        "breakgraph_pow2 (query buckets 8, 16, 32, ...: the earlier default), "
        "generate",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=3,
        help="rounds in which the graph variants take turns (medians and spread reported); "
        "paged_sdpa and generate run once",
    )  # fmt: skip
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--generate-prompts", type=int, default=2)
    parser.add_argument("--generate-new-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.smoke:
        args.models = "tiny-llama"
        args.prompts, args.min_len, args.max_len, args.new_tokens = 8, 4, 40, 6
        args.block_size, args.num_blocks, args.max_batch_tokens = 16, 64, 32
        args.generate_prompts, args.generate_new_tokens = 2, 4
        args.rounds = 1
    args.variants = list(dict.fromkeys(v for v in args.variants.split(",") if v))  # once each
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = "cuda" if cuda else "emulated"
    if not cuda:
        torch.set_num_threads(1)  # tiny model: threads cost more than they save
    transformers.AttentionInterface.register(VARLEN_KEY, torch_varlen_paged_attention)
    results = {
        "meta": {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "backend": backend,
            "dtype": str(dtype),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "args": {k: v for k, v in vars(args).items()},
        },
        "models": [],
    }
    for name in filter(None, args.models.split(",")):
        results["models"].append(run_model(name, args, device, dtype, backend))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2, default=str)
    print_summary(results)
    with contextlib.suppress(KeyError):
        del transformers.AttentionInterface._global_mapping[VARLEN_KEY]


if __name__ == "__main__":
    main()
