"""Prefill latency of transformers models: eager vs breakgraph vs one full CUDA graph vs torch.compile.

Run on a GPU machine (bf16, random weights, no download)::

    python benchmarks/bench_prefill.py --out prefill.json

Variants, all measured in the same run on the same inputs:
  hf_eager           HF forward (sdpa), one prompt at a time
  hf_eager_padded    HF forward (sdpa) on the batch left-padded to its longest prompt
  breakgraph         PrefillRunner (attention as an eager break per layer, exact lengths)
  full_graph         the same packed forward in ONE CUDA graph, attention captured with
                     upper-bound lengths (PrefillRunner(attention="captured"): same kernels, no breaks)
  compile_ro         torch.compile(mode="reduce-overhead") of the HF forward (single prompts only)
  bg_compiled        PrefillRunner(compile=True): segments hold Inductor-fused kernels
  full_compiled      the same compiled forward in ONE CUDA graph (attention="captured", compile=True)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
import transformers
from breakgraph.integrations.transformers import PrefillRunner

CONFIGS = {
    "llama-1b": lambda: transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    "qwen3-0.6b": lambda: transformers.Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}
MOE_CONFIG = lambda: transformers.Qwen3MoeConfig(  # noqa: E731  ~0.4B parameters
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
)
SINGLE_LENGTHS = (32, 128, 512, 2048)
BUCKETS = (32, 128, 512, 2048)


def bench(fn, iters: int = 30, warmup: int = 5) -> float:
    """Median wall time of fn() in ms, synchronised around each call."""
    return bench_interleaved({"fn": fn}, rounds=1, iters=iters, warmup=warmup)["fn"]


def bench_interleaved(
    fns: dict, rounds: int = 20, iters: int = 10, warmup: int = 5, spread: tuple | None = None
) -> dict:
    """Median wall time (ms) of each function, synchronised around each call.

    The functions take turns call by call, each turn in the next of all their orders
    (a b c, a c b, b a c, ...): drift (clocks, temperature, a busy host) hits every
    variant alike, and each variant follows each other one equally often (a fast graph
    right after a 20 ms eager call does not run in the same GPU state as after another
    graph). With ``spread=(a, b)`` the
    result also holds ``"spread"``: the lowest and highest ratio median(a)/median(b)
    over rounds of ``iters`` turns each, the noise of that ratio.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in fns}
    ratios = []
    orders = list(itertools.permutations(fns))
    turn = 0
    for _ in range(rounds):
        block = {name: [] for name in fns}
        for _ in range(iters):
            order = orders[turn % len(orders)]
            turn += 1
            for name in order:
                fn = fns[name]
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                block[name].append((time.perf_counter() - start) * 1e3)
        for name, times in block.items():
            samples[name] += times
        if spread:
            ratios.append(statistics.median(block[spread[0]]) / statistics.median(block[spread[1]]))
    result = {name: statistics.median(v) for name, v in samples.items()}
    if spread:
        result["spread"] = (min(ratios), max(ratios))
    return result


def host_enqueue_ms(fn, iters: int = 50) -> float:
    """Median host time to *issue* one call (the GPU idle at the start, no sync inside).

    Below the call's device time, the host runs ahead of the GPU and the breaks' host
    work is hidden; the cost of a break is then the device-side gap it leaves.
    """
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


def attention_break_host_us(model, prompt) -> dict:
    """Host time of each attention break per replay (debug-mode break timers)."""
    runner = PrefillRunner(model, token_buckets=(len(prompt),), max_prompts=16, debug=True)
    try:
        for _ in range(30):
            runner.prefill([prompt])
        torch.cuda.synchronize()
        times = runner.graph(len(prompt)).report().break_host_us
    finally:
        runner.close()
    return {"mean": statistics.mean(times), "max": max(times), "breaks": len(times)}


def make_model(config) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def mixed_batch(vocab: int) -> list:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 200, (16,), generator=g).tolist()
    assert sum(lengths) <= max(BUCKETS), sum(lengths)
    return [torch.randint(vocab, (n,), generator=g).cuda() for n in lengths]


@torch.no_grad()
def check(model, runner, prompts) -> dict:
    out = runner.prefill(prompts)
    diffs, agree = [], 0
    for i, p in enumerate(prompts):
        ref = model(p[None], use_cache=False, logits_to_keep=1).logits[0, -1].float()
        diffs.append((out.logits[i].float() - ref).abs().max().item())
        agree += int(out.logits[i].argmax() == ref.argmax())
    return {"max_abs_diff": max(diffs), "argmax_agree": agree / len(prompts)}


@torch.no_grad()
def run_model(name: str, config, with_compile: bool) -> dict:
    model = make_model(config)
    vocab = config.vocab_size
    result = {"model": name, "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    from breakgraph.integrations.transformers.attention import FLASH_WRITES_IN_PLACE

    result["attention_writes_in_place"] = FLASH_WRITES_IN_PLACE
    t0 = time.perf_counter()
    runner = PrefillRunner(model, token_buckets=BUCKETS, max_prompts=16)
    result["capture_s"] = time.perf_counter() - t0
    result["capture_s_per_bucket"] = dict(runner.stats.capture_seconds)
    result["graph_mib_per_bucket"] = {
        k: v / 2**20 for k, v in runner.stats.graph_memory_bytes.items()
    }
    result["topology"] = repr(runner.graph(BUCKETS[0]))[:200]
    t0 = time.perf_counter()
    full = PrefillRunner(model, token_buckets=BUCKETS, max_prompts=16, attention="captured")
    result["full_graph_capture_s"] = time.perf_counter() - t0
    single = {n: torch.randint(vocab, (n,), device="cuda") for n in SINGLE_LENGTHS}
    batch = mixed_batch(vocab)
    result["correctness_single"] = {n: check(model, runner, [p]) for n, p in single.items()}
    result["correctness_batch"] = check(model, runner, batch)
    result["correctness_full_graph_batch"] = check(model, full, batch)
    rows = []
    for n, p in single.items():
        row = {"workload": f"single {n}", "tokens": n}
        row.update(
            bench_interleaved(
                {
                    "hf_eager": lambda: model(p[None], use_cache=False, logits_to_keep=1),
                    "breakgraph": lambda: runner.prefill([p]),
                    "full_graph": lambda: full.prefill([p]),
                },
                spread=("breakgraph", "full_graph"),
            )
        )
        rows.append(row)
    for row in rows:  # host time to issue a prefill, against its device time (column breakgraph)
        p = single[row["tokens"]]
        row["bg_host_ms"] = host_enqueue_ms(lambda: runner.prefill([p]))
        row["full_host_ms"] = host_enqueue_ms(lambda: full.prefill([p]))
    result["attention_break_host_us"] = attention_break_host_us(model, single[128])
    total = sum(len(p) for p in batch)
    row = {"workload": f"batch of 16 ({total} tokens)", "tokens": total}
    longest = max(len(p) for p in batch)
    padded = torch.zeros(len(batch), longest, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(padded)
    for i, p in enumerate(batch):
        padded[i, longest - len(p) :], mask[i, longest - len(p) :] = p, 1
    row["hf_eager"] = bench(
        lambda: [model(p[None], use_cache=False, logits_to_keep=1) for p in batch], iters=10
    )
    row["hf_eager_padded"] = bench(
        lambda: model(padded, attention_mask=mask, use_cache=False, logits_to_keep=1)
    )
    row.update(
        bench_interleaved(
            {
                "breakgraph": lambda: runner.prefill(batch),
                "full_graph": lambda: full.prefill(batch),
            },
            spread=("breakgraph", "full_graph"),
        )
    )
    rows.append(row)
    if with_compile:
        try:  # breakgraph with Inductor-fused segments, and its no-break twin, on the small buckets
            t0 = time.perf_counter()
            bg_c = PrefillRunner(model, token_buckets=(32, 128), max_prompts=16, compile=True)
            result["bg_compiled_capture_s"] = time.perf_counter() - t0
            full_c = PrefillRunner(
                model, token_buckets=(32, 128), max_prompts=16, attention="captured", compile=True
            )
            result["correctness_bg_compiled"] = check(model, bg_c, [single[32]])
            for row in rows[:2]:
                p = single[row["tokens"]]
                timed = bench_interleaved(
                    {
                        "bg_compiled": lambda: bg_c.prefill([p]),
                        "full_compiled": lambda: full_c.prefill([p]),
                    },
                    spread=("bg_compiled", "full_compiled"),
                )
                row["bgc_spread"] = timed.pop("spread")
                row.update(timed)
                row["bgc_over_fullc"] = row["bg_compiled"] / row["full_compiled"]
                row["eager_over_bgc"] = row["hf_eager"] / row["bg_compiled"]
            bg_c.close()
            full_c.close()
        except Exception as exc:
            result["bg_compiled_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
        for row in rows[:2]:
            p = single[row["tokens"]]
            try:
                t0 = time.perf_counter()
                for _ in range(3):
                    compiled(p[None], use_cache=False, logits_to_keep=1)
                row["compile_ro_compile_s"] = time.perf_counter() - t0
                row["compile_ro"] = bench(
                    lambda: compiled(p[None], use_cache=False, logits_to_keep=1)
                )
            except Exception as exc:  # report, don't die
                row["compile_ro_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for row in rows:
        row["bg_over_full"] = row["breakgraph"] / row["full_graph"]
        row["eager_over_bg"] = row["hf_eager"] / row["breakgraph"]
    result["rows"] = rows
    result["graph_mib_largest_only"] = None
    runner.close()
    full.close()
    alone = PrefillRunner(model, token_buckets=(BUCKETS[-1],), max_prompts=16)
    result["graph_mib_largest_only"] = alone.stats.graph_memory_bytes[BUCKETS[-1]] / 2**20
    alone.close()
    del model
    torch.cuda.empty_cache()
    return result


@torch.no_grad()
def run_moe() -> dict:
    """A ~0.4B Qwen3-MoE: transformers' eager experts loop (data-dependent) and grouped_mm."""
    results = {}
    for experts in ("eager", "grouped_mm"):
        config = MOE_CONFIG()
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(
                config,
                dtype=torch.bfloat16,
                attn_implementation="sdpa",
                experts_implementation=experts,
            ).eval()
        result = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6}
        p = torch.randint(config.vocab_size, (512,), device="cuda")
        for _ in range(2):
            model(p[None], use_cache=False)
        torch.cuda.synchronize()
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                model(p[None], use_cache=False)
            result["whole_graph_capture"] = "succeeded"
        except Exception as exc:
            result["whole_graph_capture"] = (
                f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            )
        torch.cuda.synchronize()
        runner = PrefillRunner(model, token_buckets=(512,), max_prompts=4)
        result["breaks"] = runner.graph(512).num_breaks
        result["correctness"] = check(model, runner, [p])
        result["hf_eager_ms"] = bench(
            lambda: model(p[None], use_cache=False, logits_to_keep=1), iters=10
        )
        result["breakgraph_ms"] = bench(lambda: runner.prefill([p]), iters=10)
        runner.close()
        results[f"experts={experts}"] = result
        del model
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", default=",".join(CONFIGS))
    parser.add_argument(
        "--compile", action="store_true", help="also time torch.compile reduce-overhead"
    )
    parser.add_argument("--no-moe", action="store_true")
    args = parser.parse_args()
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    results = {"meta": meta, "models": []}
    for name in filter(None, args.models.split(",")):
        results["models"].append(
            run_model(name, CONFIGS[name](), args.compile and name == "llama-1b")
        )
        if args.out:
            json.dump(results, open(args.out, "w"), indent=2, default=str)
    if not args.no_moe:
        results["moe"] = run_moe()
    if args.out:
        json.dump(results, open(args.out, "w"), indent=2, default=str)
    print_summary(results)


def print_summary(results: dict) -> None:
    for m in results["models"]:
        print(
            f"\n{m['model']} ({m['params_m']:.0f}M params), capture {m['capture_s']:.1f} s, "
            f"graph MiB per bucket { ({k: round(v) for k, v in m['graph_mib_per_bucket'].items()}) }, "
            f"largest alone {m['graph_mib_largest_only']:.0f}"
        )
        print(f"  correctness batch: {m['correctness_batch']}")
        print(
            f"  {'workload':<28}{'eager':>9}{'padded':>9}{'bg':>9}{'full':>9}{'compile':>9}"
            f"{'bg/full':>9}{'(rounds)':>14}{'eager/bg':>9}"
        )
        for r in m["rows"]:
            fmt = lambda k: f"{r[k]:>9.3f}" if k in r else f"{'-':>9}"  # noqa: E731
            rounds = "{:.3f}-{:.3f}".format(*r["spread"]) if "spread" in r else "-"
            print(
                f"  {r['workload']:<28}{fmt('hf_eager')}{fmt('hf_eager_padded')}{fmt('breakgraph')}"
                f"{fmt('full_graph')}{fmt('compile_ro')}{r['bg_over_full']:>9.3f}{rounds:>14}"
                f"{r['eager_over_bg']:>9.2f}"
            )
        for r in m["rows"]:
            if "bg_host_ms" in r:
                print(
                    f"  host time to issue {r['workload']}: bg {r['bg_host_ms']:.3f} ms, full "
                    f"{r['full_host_ms']:.3f} ms (device: {r['breakgraph']:.3f} / {r['full_graph']:.3f} ms)"
                )
        if "attention_break_host_us" in m:
            h = m["attention_break_host_us"]
            print(
                f"  attention break host time per layer: mean {h['mean']:.1f} us, max {h['max']:.1f} us"
            )
        for r in m["rows"]:
            if "bg_compiled" in r:
                print(
                    f"  compiled segments, {r['workload']}: bg {r['bg_compiled']:.3f} ms, full "
                    f"{r['full_compiled']:.3f} ms, bg/full {r['bgc_over_fullc']:.3f}, eager/bg "
                    f"{r['eager_over_bgc']:.2f}"
                )
        if "bg_compiled_error" in m:
            print(f"  compiled segments failed: {m['bg_compiled_error']}")
    for name, r in results.get("moe", {}).items():
        print(
            f"\nMoE {name}: whole graph {r['whole_graph_capture']}; breakgraph {r['breaks']} breaks, "
            f"{r['breakgraph_ms']:.3f} ms vs eager {r['hf_eager_ms']:.3f} ms; {r['correctness']}"
        )


if __name__ == "__main__":
    main()
