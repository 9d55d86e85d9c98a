"""Tensor-parallel prefill latency: TP=2 eager, whole graph and breakgraph, and TP=1 breakgraph.

On 2 GPUs (bf16, an 8B-Llama-shaped model with random weights, NCCL, CUDA graphs)::

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --out tp.json

On the CPU, in seconds (a tiny model, gloo, the emulated backend; timings mean nothing)::

    python benchmarks/bench_tp.py --smoke --out tp-smoke.json

Started with plain ``python``, it relaunches itself under ``torchrun --nproc-per-node 2``.

Variants. The TP=2 ones take turns call by call, in every order, on the same inputs:
  tp_eager       transformers' TP forward, eagerly (the mixed batch: one prompt at a time)
  tp_full_graph  OneGraphPrefillRunner (benchmarks/one_graph.py): the whole forward in ONE
                 CUDA graph, attention with upper-bound lengths, collectives captured (CUDA)
  tp_breakgraph  PrefillRunner: attention as an eager break per layer, collectives captured
  tp_bg_eager_ar PrefillRunner(tp_collectives="eager"): also an eager break at every all-reduce
  tp1_breakgraph PrefillRunner on rank 0 alone with an unsharded model (after the TP runs)

Model creation: there is no ``from_config`` path for TP, and writing 16 GB of random bf16
weights (then reading them back) would take most of the time budget. Rank 0 therefore
writes the config and ONE small tensor, and transformers initialises every missing weight
itself, on each rank's GPU and for its shard only. Both ranks seed alike, so the replicated
weights (embeddings, norms) are equal on every rank. The TP=1 model is a separate random
model of the same shape: the latencies compare, the logits do not.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch

if __package__ in (None, ""):  # torchrun benchmarks/bench_tp.py: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from benchmarks.families import LLAMA3_8B, TINY  # noqa: E402

LLAMA_8B = dict(LLAMA3_8B, max_position_embeddings=4096)
FULL = {"config": LLAMA_8B, "lengths": (32, 128, 512, 2048), "batch": (8, 200), "rounds": 5}
SMOKE = {"config": TINY, "lengths": (8, 16, 32, 64), "batch": (1, 5), "rounds": 1}
TP_VARIANTS = ("tp_eager", "tp_full_graph", "tp_breakgraph", "tp_bg_eager_ar")


class Bench:
    """The distributed set-up shared by every measurement."""

    def __init__(self, smoke: bool, iters: int | None):
        import torch.distributed as dist

        self.smoke = smoke
        self.cuda = not smoke
        if self.cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():  # a caller's group (the TP tests' processes) is kept
            if self.cuda:
                dist.init_process_group("nccl", device_id=self.device)
            else:
                dist.init_process_group("gloo")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # a host-side group to park rank 1 while rank 0 runs TP=1 (no NCCL kernel spinning)
        self.host = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
        self.setting = SMOKE if smoke else FULL
        self.iters = iters if iters is not None else (1 if smoke else 4)
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.backend = "emulated" if smoke else "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.host)


def write_checkpoint(bench: Bench, config) -> str:
    """Rank 0 writes the config and one small tensor; transformers initialises the rest."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    path = [tempfile.mkdtemp(prefix="bench-tp-") if bench.rank == 0 else None]
    dist.broadcast_object_list(path, group=bench.host)
    if bench.rank == 0:
        config.save_pretrained(path[0])
        norm = torch.ones(config.hidden_size, dtype=bench.dtype)
        save_file({"model.norm.weight": norm}, os.path.join(path[0], "model.safetensors"))
    bench.barrier()
    return path[0]


def workloads(bench: Bench, vocab: int) -> dict:
    """Single prompts of each length and one mixed batch of 16; the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    loads = {
        f"{n} tokens": [torch.randint(vocab, (n,), generator=generator)]
        for n in bench.setting["lengths"]
    }
    low, high = bench.setting["batch"]
    lengths = torch.randint(low, high, (16,), generator=generator).tolist()
    loads[f"batch of 16 ({sum(lengths)} tokens)"] = [
        torch.randint(vocab, (n,), generator=generator) for n in lengths
    ]
    return {name: [p.to(bench.device) for p in prompts] for name, prompts in loads.items()}


def take_turns(bench: Bench, fns: dict, rounds: int, iters: int, warmup: int = 2) -> dict:
    """Per variant: the median ms over all calls and the median of each round.

    The variants take turns call by call, each turn in the next of all their orders, so
    drift and the previous call's GPU state hit every variant alike. Every call is
    synchronised; under TP every call is also collective, so both ranks run the same turns.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    bench.sync()
    orders = list(itertools.permutations(fns))
    per_round = {name: [] for name in fns}
    samples = {name: [] for name in fns}
    turn = 0
    for _ in range(rounds):
        block = {name: [] for name in fns}
        for _ in range(iters):
            for name in orders[turn % len(orders)]:
                start = time.perf_counter()
                fns[name]()
                bench.sync()
                block[name].append((time.perf_counter() - start) * 1e3)
            turn += 1
        for name, times in block.items():
            samples[name] += times
            per_round[name].append(statistics.median(times))
    return {
        name: {"median_ms": statistics.median(samples[name]), "round_medians_ms": per_round[name]}
        for name in fns
    }


@torch.no_grad()
def eager_logits(model, prompts) -> torch.Tensor:
    if prompts[0].is_cuda:  # no graph launch in flight when eager NCCL starts (graph mixing off)
        torch.cuda.synchronize()
    rows = [model(p[None], use_cache=False, logits_to_keep=1).logits[0, -1] for p in prompts]
    return torch.stack(rows).float()


def compare(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    logits = logits.float()
    return {
        "max_abs_diff": (logits - reference).abs().max().item(),
        "argmax_agree": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
    }


@torch.no_grad()
def run_tp(bench: Bench, path: str, loads: dict) -> dict:
    import transformers
    from breakgraph.integrations.transformers import PrefillRunner
    from transformers.distributed.configuration_utils import DistributedConfig

    from benchmarks.one_graph import OneGraphPrefillRunner

    torch.manual_seed(0)  # every rank initialises its shards and the replicated weights alike
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=bench.dtype, distributed_config=DistributedConfig(tp_size=bench.world)
    ).eval()
    result = {"model_load_s": time.perf_counter() - start}
    buckets = tuple(bench.setting["lengths"])
    options = dict(token_buckets=buckets, max_prompts=16, backend=bench.backend)
    variants = {  # name -> (runner class, extra arguments)
        "tp_breakgraph": (PrefillRunner, {}),
        "tp_bg_eager_ar": (PrefillRunner, {"tp_collectives": "eager"}),
        "tp_full_graph": (OneGraphPrefillRunner, {}),
    }
    runners, result["capture_s"], result["skipped"] = {}, {}, {}
    for name, (runner_class, extra) in variants.items():
        if name == "tp_full_graph" and not bench.cuda:
            result["skipped"][name] = "captured attention needs CUDA (FlashAttention)"
            continue
        if name == "tp_bg_eager_ar" and os.environ.get("NCCL_GRAPH_MIXING_SUPPORT") == "0":
            result["skipped"][name] = "NCCL_GRAPH_MIXING_SUPPORT=0"
            continue
        start = time.perf_counter()
        runners[name] = runner_class(model, **options, **extra)
        result["capture_s"][name] = time.perf_counter() - start
    runner = runners["tp_breakgraph"]
    result["topology"] = {name: repr(r.graph(buckets[0]))[:160] for name, r in runners.items()}
    # the per-call agreement alone: one gloo all-reduce (and the lengths' fingerprint)
    from breakgraph.distributed import fingerprint

    times = []
    for _ in range(200):
        start = time.perf_counter()
        runner.ranks.agree(128, fingerprint([128]))
        times.append((time.perf_counter() - start) * 1e6)
    result["agreement_us"] = {"median": statistics.median(times), "p90": sorted(times)[179]}
    if bench.cuda:  # the alternative: the same values through NCCL, then a host read (a sync)
        import torch.distributed as dist

        values = torch.zeros(3 + bench.world, dtype=torch.int64, device=bench.device)
        bench.sync()
        times = []
        for _ in range(200):
            start = time.perf_counter()
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            values.tolist()
            times.append((time.perf_counter() - start) * 1e6)
        result["agreement_nccl_us"] = {
            "median": statistics.median(times),
            "p90": sorted(times)[179],
        }

    rows, correctness = [], {}
    for name, prompts in loads.items():
        reference = eager_logits(model, prompts)
        correctness[name] = {
            variant: compare(reference, r.prefill(prompts).logits) for variant, r in runners.items()
        }
        fns = {"tp_eager": lambda: eager_logits(model, prompts)}
        fns.update({variant: (lambda r=r: r.prefill(prompts)) for variant, r in runners.items()})
        iters = max(1, bench.iters // 2) if len(prompts) > 1 else bench.iters  # eager: 16 calls
        row = {"workload": name, "tokens": sum(len(p) for p in prompts)}
        row.update(take_turns(bench, fns, bench.setting["rounds"], iters))
        rows.append(row)
        if bench.rank == 0:
            print(
                f"  TP={bench.world} {name}: "
                + ", ".join(f"{v} {row[v]['median_ms']:.3f} ms" for v in fns),
                flush=True,
            )
    result["rows"], result["correctness_vs_tp_eager"] = rows, correctness
    result["stats"] = {name: str(r.stats) for name, r in runners.items()}
    for r in runners.values():
        r.close()
    if bench.cuda:
        result["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


@torch.no_grad()
def run_tp1(bench: Bench, config, loads: dict) -> dict:
    """Rank 0 alone: an unsharded random model of the same shape through breakgraph."""
    import transformers
    from breakgraph.integrations.transformers import PrefillRunner

    torch.manual_seed(0)
    start = time.perf_counter()
    with bench.device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=bench.dtype).eval()
    result = {"model_init_s": time.perf_counter() - start}
    start = time.perf_counter()
    runner = PrefillRunner(
        model, token_buckets=tuple(bench.setting["lengths"]), max_prompts=16, backend=bench.backend
    )
    result["capture_s"] = time.perf_counter() - start
    rows = []
    for name, prompts in loads.items():
        row = {"workload": name, "tokens": sum(len(p) for p in prompts)}
        row.update(
            take_turns(
                bench,
                {"tp1_breakgraph": lambda: runner.prefill(prompts)},
                bench.setting["rounds"],
                bench.iters,
            )
        )
        rows.append(row)
        print(
            f"  TP=1 {name}: tp1_breakgraph {row['tp1_breakgraph']['median_ms']:.3f} ms", flush=True
        )
    result["rows"] = rows
    runner.close()
    return result


def summarise(results: dict) -> dict:
    """Ratios per workload and the issue's targets."""
    tp1 = {row["workload"]: row["tp1_breakgraph"]["median_ms"] for row in results["tp1"]["rows"]}
    table, targets = [], {}
    for row in results["tp"]["rows"]:
        ms = {v: row[v]["median_ms"] for v in TP_VARIANTS if v in row}
        ms["tp1_breakgraph"] = tp1[row["workload"]]
        entry = {"workload": row["workload"], "tokens": row["tokens"], "ms": ms}
        bg = ms["tp_breakgraph"]
        entry["eager_over_bg"] = ms["tp_eager"] / bg
        entry["tp1_over_tp2_bg"] = ms["tp1_breakgraph"] / bg
        if "tp_bg_eager_ar" in ms:
            entry["eager_ar_over_bg"] = ms["tp_bg_eager_ar"] / bg
        if "tp_full_graph" in ms:
            entry["bg_over_full"] = bg / ms["tp_full_graph"]
            rounds = zip(
                row["tp_breakgraph"]["round_medians_ms"], row["tp_full_graph"]["round_medians_ms"]
            )
            ratios = [a / b for a, b in rounds]
            entry["bg_over_full_rounds"] = (min(ratios), max(ratios))
        table.append(entry)
        if results["meta"]["smoke"]:
            continue  # a tiny model on the CPU: no target applies
        single = row["workload"].endswith(" tokens")
        if "bg_over_full" in entry and row["tokens"] >= 128:
            targets[f"bg <= 1.05x full graph, {row['workload']}"] = entry["bg_over_full"] <= 1.05
        if single and row["tokens"] <= 128:
            targets[f"bg >= 5x TP eager, {row['workload']}"] = entry["eager_over_bg"] >= 5
        if row["tokens"] >= 512:
            targets[f"TP=2 bg faster than TP=1 bg, {row['workload']}"] = (
                entry["tp1_over_tp2_bg"] > 1
            )
    return {"table": table, "targets": targets}


def print_summary(results: dict) -> None:
    meta = results["meta"]
    print(
        f"\n{meta['device']} x{meta['world_size']}, torch {meta['torch']}, transformers "
        f"{meta['transformers']}, NCCL {meta['nccl']}, NCCL_GRAPH_MIXING_SUPPORT="
        f"{meta['nccl_graph_mixing_support']}"
        + (" (SMOKE: timings mean nothing)" if meta["smoke"] else "")
    )
    tp = results["tp"]
    print(
        f"capture s: { {k: round(v, 1) for k, v in tp['capture_s'].items()} }, TP=1 "
        f"{results['tp1']['capture_s']:.1f}; agreement per call "
        f"{tp['agreement_us']['median']:.0f} us "
        f"(p90 {tp['agreement_us']['p90']:.0f})"
        + (
            f", through NCCL + host read {tp['agreement_nccl_us']['median']:.0f} us"
            if "agreement_nccl_us" in tp
            else ""
        )
    )
    head = [
        "eager",
        "full",
        "bg",
        "bg+ar",
        "tp1 bg",
        "bg/full",
        "(rounds)",
        "eager/bg",
        "ar/bg",
        "tp1/tp2",
    ]
    print(f"{'workload':<30}" + "".join(f"{h:>10}" for h in head))
    for e in results["summary"]["table"]:
        ms = e["ms"]
        cell = lambda k, d=ms: f"{d[k]:>10.3f}" if k in d else f"{'-':>10}"  # noqa: E731
        rounds = (
            "{:.2f}-{:.2f}".format(*e["bg_over_full_rounds"]) if "bg_over_full_rounds" in e else "-"
        )
        print(
            f"{e['workload']:<30}{cell('tp_eager')}{cell('tp_full_graph')}{cell('tp_breakgraph')}"
            f"{cell('tp_bg_eager_ar')}{cell('tp1_breakgraph')}{cell('bg_over_full', e)}{rounds:>10}"
            f"{cell('eager_over_bg', e)}{cell('eager_ar_over_bg', e)}{cell('tp1_over_tp2_bg', e)}"
        )
    worst = {
        variant: max(c[variant]["max_abs_diff"] for c in tp["correctness_vs_tp_eager"].values())
        for variant in next(iter(tp["correctness_vs_tp_eager"].values()))
    }
    print(f"max |logits - TP eager|: { {k: f'{v:.3g}' for k, v in worst.items()} }")
    for target, met in results["summary"]["targets"].items():
        print(f"  target {'met   ' if met else 'MISSED'} {target}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="results JSON (written by rank 0)")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model on the CPU (gloo, emulated)"
    )
    parser.add_argument("--iters", type=int, default=None, help="calls per variant per round")
    parser.add_argument(
        "--no-graph-mixing",
        action="store_true",
        help="set NCCL_GRAPH_MIXING_SUPPORT=0 before NCCL starts (tp_bg_eager_ar is then skipped)",
    )
    args = parser.parse_args()
    if args.smoke:  # the CPU only, even on a GPU machine (set before CUDA is first touched)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.no_graph_mixing:
        os.environ["NCCL_GRAPH_MIXING_SUPPORT"] = "0"

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    bench = Bench(args.smoke, args.iters)
    run(bench, args.out)
    import torch.distributed as dist

    dist.destroy_process_group()


def run(bench: Bench, out: str | None = None) -> dict | None:
    """The whole benchmark on ``bench``'s ranks; rank 0 writes ``out`` and returns the results
    (the other ranks None). The process group stays up (its owner ends it)."""
    import transformers

    config = transformers.LlamaConfig(**bench.setting["config"])
    started = time.perf_counter()
    path = write_checkpoint(bench, config)
    loads = workloads(bench, config.vocab_size)
    if bench.rank == 0:
        print(f"TP={bench.world}: {len(loads)} workloads, variants take turns", flush=True)
    results = {
        "meta": {
            **environment(bench.cuda),
            "device": torch.cuda.get_device_name() if bench.cuda else "cpu",
            "world_size": bench.world,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if bench.cuda else None,
            "nccl_graph_mixing_support": os.environ.get("NCCL_GRAPH_MIXING_SUPPORT", "unset (1)"),
            "smoke": bench.smoke,
        },
        "settings": {
            "config": bench.setting["config"],
            "dtype": str(bench.dtype),
            "buckets": bench.setting["lengths"],
            "rounds": bench.setting["rounds"],
            "iters_per_round": bench.iters,
            "batch_lengths_range": bench.setting["batch"],
            "max_prompts": 16,
        },
        "tp": run_tp(bench, path, loads),
    }
    gc.collect()  # the TP model and its graphs go before rank 0 builds the TP=1 model
    if bench.cuda:
        torch.cuda.empty_cache()
    bench.barrier()
    if bench.rank == 0:
        results["tp1"] = run_tp1(bench, config, loads)
        results["summary"] = summarise(results)
        results["total_s"] = time.perf_counter() - started
        if out:
            with open(out, "w") as f:
                json.dump(results, f, indent=2, default=str)
        print_summary(results)
    bench.barrier()  # rank 1 waits (on the host) while rank 0 runs TP=1
    return results if bench.rank == 0 else None


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:  # plain `python`: relaunch under torchrun with 2 processes
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        sys.exit(subprocess.call(command + [os.path.abspath(__file__)] + sys.argv[1:]))
