"""Prefill of transformers models: breakgraph against what a user would otherwise run.

On the H200 (bf16, random weights, no download; budgeted to seven minutes, 9 families)::

    python -m benchmarks.bench_prefill --out prefill-baselines.json
    python -m benchmarks.bench_prefill --smoke      # seconds: tiny models, CPU, emulated

Variants, timed in one run on the same prompts, taking turns call by call (see
``VARIANTS`` for the exact definitions, also written into the JSON). Per model family:
single prompts of ``--sizes`` tokens and one mixed batch; correctness of every variant
against HF eager; the default runner's construction and per-bucket capture time; graph
memory of its whole ladder against its largest bucket alone; host time of ``prefill()``
(to return, and to its first graph replay) against its device time; and, for
``--compile-families``, the first-call time of both compiled variants over
``--first-call-lengths``. Whatever is skipped (CUDA-only variants in the smoke run, the
time budget, an error) is listed in the JSON with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import torch

from .baselines import (
    CompiledForward,
    PaddedBatch,
    dynamo_delta,
    dynamo_snapshot,
    exact_length_graph,
    hf_eager,
)
from .environment import environment
from .families import (
    FAMILIES,
    HELD_OUT_FAMILIES,
    SMOKE_FAMILIES,
    Family,
    config_summary,
    make_model,
)
from .timing import DeviceClock, host_times, interleaved, median_ms, no_sync, probe_replays

SCHEMA = "breakgraph-prefill-baselines/1"

VARIANTS = {
    "hf_eager": "HF forward (sdpa), one prompt at a time, use_cache=False, logits_to_keep=1",
    "hf_eager_padded": "HF forward (sdpa) on the batch left-padded to its longest prompt "
    "(a ready 4-D causal+padding mask, explicit position_ids)",
    "hf_graph": "the exact-length whole-forward CUDA graph: one torch.cuda.graph of "
    "model(ids, use_cache=False, logits_to_keep=1) captured at the prompt's exact length "
    "(sdpa, 3 warm-up runs first); for a batch, captured at the left-padded batch's shape",
    "breakgraph": "PrefillRunner(model): default settings (bucket ladder, max_prompts, warm-up)",
    "bg_one_graph": "OneGraphPrefillRunner(model, token_buckets=<the buckets breakgraph used>, "
    "max_prompts=<breakgraph's>) (benchmarks/one_graph.py): the same packed forward in ONE "
    "graph, attention captured at upper-bound lengths, no breaks",
    "compile_ro": 'torch.compile(model, mode="reduce-overhead") at exact lengths (single '
    "prompts; torch's default dynamic=None unless --compile-dynamic)",
    "bg_compiled": "PrefillRunner(model, compile=True): Inductor-fused segments, default ladder",
}

# which ratios get a per-round spread (the noise of that ratio)
SPREAD_PAIRS = (
    ("breakgraph", "hf_graph"),
    ("bg_one_graph", "hf_graph"),
    ("breakgraph", "bg_one_graph"),
    ("bg_compiled", "compile_ro"),
    ("breakgraph", "hf_eager"),
)

# H200 seconds per family as measured on 2026-12-01 (h200-prefill-baselines.log), only used to
# skip work that would overrun --budget-s
FAMILY_ESTIMATE_S = {
    "llama-1b": 37,
    "qwen2-1.5b": 41,
    "qwen3-0.6b": 44,
    "gemma-2b": 44,
    "mistral-7b-4l": 19,
    "mixtral-4l": 33,
    "qwen3-moe-8l": 36,
    "mistral-sw256-4l": 13,
    "mixtral-1k-4l": 18,
}
COMPILE_ESTIMATE_S = 70  # PrefillRunner(compile=True) and reduce-overhead at 5 lengths: ~60 s
NOT_COMPILED = (
    "not in --compile-families: compiling a model takes about a minute or more, which the "
    "default time budget cannot give every family"
)


@dataclasses.dataclass
class Settings:
    """Every knob of a run; written into the JSON as it was used."""

    families: list[str]
    sizes: list[int]
    batch_prompts: int = 16
    batch_min_len: int = 8
    batch_max_len: int = 200  # exclusive
    rounds: int = 8
    iters: int = 10
    warmup: int = 3
    eager_batch_calls: int = 3
    host_iters: int = 20
    device_iters: int = 10
    hold_ms: float = 10.0
    compile_families: list[str] = dataclasses.field(default_factory=list)
    first_call_lengths: list[int] = dataclasses.field(default_factory=list)
    compile_dynamic: str = "auto"
    budget_s: float = 420.0
    smoke: bool = False
    device: str = "cuda"
    dtype: str = "bfloat16"
    backend: str = "cuda"
    runner_kwargs: dict = dataclasses.field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def smoke_settings(families: list[str] | None = None) -> Settings:
    """A tiny model on the CPU through the emulated backend: the script runs end to end in
    seconds (CUDA-only variants are skipped and listed)."""
    return Settings(
        families=families or ["tiny-llama"],
        sizes=[5, 12, 30],
        batch_prompts=3,
        batch_min_len=2,
        batch_max_len=10,
        rounds=2,
        iters=2,
        warmup=1,
        eager_batch_calls=1,
        host_iters=2,
        device_iters=0,
        compile_families=[],
        first_call_lengths=[],
        budget_s=60.0,
        smoke=True,
        device="cpu",
        dtype="float32",
        backend="emulated",
        # the default ladder is sized for real models; two buckets keep the CPU run short
        runner_kwargs={"token_buckets": (16, 32), "max_prompts": 4, "backend": "emulated"},
    )


class Run:
    """State of one benchmark run: its settings, the clock against the budget, what was
    skipped and why."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.start = time.perf_counter()
        self.skipped: list[dict] = []
        self.sync = torch.cuda.synchronize if settings.cuda else no_sync
        self.clock = (
            DeviceClock(settings.hold_ms) if settings.cuda and settings.device_iters else None
        )

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, estimate_s: float) -> bool:
        return self.elapsed() + estimate_s <= self.settings.budget_s

    def skip(self, family: str, what: str, reason: str) -> None:
        self.skipped.append({"family": family, "what": what, "reason": reason})


@contextlib.contextmanager
def attempt(result: dict, what: str) -> Iterator[None]:
    """Run one part of a family's benchmark; on failure record the error and go on (one
    GPU run must not lose every other number to one broken variant)."""
    start = time.perf_counter()
    try:
        yield
    except Exception as exc:  # reported in the JSON and on stderr, never swallowed silently
        result.setdefault("errors", {})[what] = f"{type(exc).__name__}: {str(exc)[:400]}"
        print(f"[{result['family']}] {what} failed:", file=sys.stderr)
        traceback.print_exc()
    finally:
        result.setdefault("phase_s", {})[what] = time.perf_counter() - start


def bucket_for(buckets, tokens: int) -> int | None:
    """The smallest bucket holding ``tokens`` (how the runner pads), or None."""
    fitting = [b for b in buckets if b >= tokens]
    return min(fitting) if fitting else None


def serving(runners: dict, prompts: list) -> dict:
    """The runners that can take the prompts: their largest bucket holds them (on_miss is
    'raise' otherwise) and there are at most max_prompts of them."""
    tokens = sum(map(len, prompts))
    return {
        name: r
        for name, r in runners.items()
        if tokens <= max(r.buckets) and len(prompts) <= r.max_prompts
    }


def mixed_lengths(settings: Settings) -> list[int]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(
        settings.batch_min_len, settings.batch_max_len, (settings.batch_prompts,), generator=g
    )
    return lengths.tolist()


def make_prompts(settings: Settings, vocab: int) -> tuple[dict[int, torch.Tensor], list]:
    g = torch.Generator().manual_seed(2)
    singles = {
        n: torch.randint(vocab, (n,), generator=g).to(settings.device) for n in settings.sizes
    }
    batch = [
        torch.randint(vocab, (n,), generator=g).to(settings.device) for n in mixed_lengths(settings)
    ]
    return singles, batch


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Last-token logits of a variant against HF eager (``[prompts, vocab]`` each).

    The whole device is synchronised first (every stream, not only the current one), so an
    asynchronous fault of this variant's work, side streams included, is raised here, under
    its name, rather than at a later variant's read (a 5.24 run's illegal memory access
    surfaced at the plain HF graph's read with no way to tell whose work it was)."""
    if got.is_cuda:
        torch.cuda.synchronize()
    got, ref = got.float().reshape(ref.shape), ref.float()
    return {
        "max_abs_diff": (got - ref).abs().max().item(),
        "argmax_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }


def runner_record(runner, construction_s: float) -> dict:
    stats = runner.stats
    return {
        "construction_s": construction_s,
        "buckets": list(runner.buckets),
        # capture order kept (dicts keep insertion order): the first bucket pays the warm-up
        "capture_seconds": [[int(b), s] for b, s in stats.capture_seconds.items()],
        "graph_memory_bytes": {str(b): int(v) for b, v in stats.graph_memory_bytes.items()},
        "attention": getattr(runner, "attention", None),
        "max_prompts": runner.max_prompts,
        # where tuning sent a bucket's calls (a larger bucket timed faster), per ladder: a
        # cell's time depends on it
        "routed": {str(b): int(to) for b, to in runner._runner.stats.routed.items()},
        "routed_single": (
            {}
            if runner._single is None
            else {str(b): int(to) for b, to in runner._single.stats.routed.items()}
        ),
    }


@torch.no_grad()
def run_family(run: Run, family: Family) -> dict:
    from breakgraph.integrations.transformers import PrefillRunner

    from .one_graph import OneGraphPrefillRunner

    s = run.settings
    config = family.config()
    result: dict = {"family": family.name, "shape": family.shape, "config": config_summary(config)}
    start = time.perf_counter()
    model = make_model(config, s.device, s.torch_dtype)
    result["model_build_s"] = time.perf_counter() - start
    result["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    result["config"] = config_summary(model.config)
    vocab = config.vocab_size
    singles, batch = make_prompts(s, vocab)
    workloads = {f"single {n}": [p] for n, p in singles.items()}
    workloads[f"batch of {len(batch)} ({sum(map(len, batch))} tokens)"] = batch
    runners: dict[str, object] = {}
    graphs: dict = {}
    compiled: dict = {}
    closers: list[Callable[[], None]] = []
    padded = PaddedBatch(batch, s.torch_dtype)
    try:
        with attempt(result, "breakgraph"):
            start = time.perf_counter()
            runner = PrefillRunner(model, **s.runner_kwargs)
            run.sync()
            result["runner"] = runner_record(runner, time.perf_counter() - start)
            runners["breakgraph"] = runner
            closers.append(runner.close)
        ladder = result.get("runner", {}).get("buckets", [])
        used = sorted({bucket_for(ladder, sum(map(len, p))) for p in workloads.values()} - {None})
        result["used_buckets"] = used
        for name, prompts in workloads.items():
            if ladder and bucket_for(ladder, sum(map(len, prompts))) is None:
                run.skip(family.name, f"breakgraph variants, {name}", "larger than every bucket")
            if "runner" in result and len(prompts) > result["runner"]["max_prompts"]:
                run.skip(
                    family.name, f"breakgraph variants, {name}", "more prompts than max_prompts"
                )
        if not s.cuda:
            run.skip(family.name, "bg_one_graph", "needs CUDA FlashAttention (smoke run)")
        elif used:
            with attempt(result, "bg_one_graph"):
                start = time.perf_counter()
                one = OneGraphPrefillRunner(
                    model, token_buckets=used, max_prompts=result["runner"]["max_prompts"]
                )
                run.sync()
                result["one_graph_runner"] = runner_record(one, time.perf_counter() - start)
                runners["bg_one_graph"] = one
                closers.append(one.close)
        if not s.cuda:
            run.skip(family.name, "hf_graph", "torch.cuda.graph needs CUDA (smoke run)")
        else:
            pool = torch.cuda.graph_pool_handle()
            with attempt(result, "hf_graph"):
                for n in sorted(singles, reverse=True):  # largest first: the pool is reused
                    graphs[n] = exact_length_graph(model, singles[n], pool=pool)
                    closers.append(graphs[n].close)
            window = getattr(config, "sliding_window", None)
            with attempt(result, "hf_graph batch"):  # the single prompts' graphs stand alone
                if window is not None and max(map(len, batch)) > window:
                    raise ValueError("the padded batch's 4-D mask would drop the sliding window")
                graphs["batch"] = padded.graph(model, pool=pool)
                closers.append(graphs["batch"].close)
            result["hf_graph_capture_s"] = {str(k): g.capture_s for k, g in graphs.items()}
        compiled = compile_variants(run, family, model, result, runners, closers)
        with attempt(result, "correctness"):
            result["correctness"] = correctness(
                model, singles, batch, padded, runners, graphs, compiled
            )
        result["rows"] = []
        for n, p in singles.items():
            with attempt(result, f"timing single {n}"):
                result["rows"].append(time_single(run, model, n, p, runners, graphs, compiled))
        with attempt(result, "timing batch"):
            result["rows"].append(time_batch(run, model, batch, padded, runners, graphs))
        for row in result["rows"]:
            with attempt(result, f"host {row['workload']}"):
                prompts = [singles[row["tokens"]]] if row["kind"] == "single" else batch
                key = row["tokens"] if row["kind"] == "single" else "batch"
                fresh = {"input_ids": prompts[0][None]} if key != "batch" else padded.inputs()
                row["host"] = host_and_device(run, prompts, runners, graphs.get(key), fresh)
    finally:
        for close in closers:
            close()
    if "runner" in result and s.cuda:
        with attempt(result, "largest_bucket_alone"):
            largest = max(result["runner"]["buckets"])
            start = time.perf_counter()
            alone = PrefillRunner(model, **{**s.runner_kwargs, "token_buckets": (largest,)})
            run.sync()
            result["largest_bucket_alone"] = runner_record(alone, time.perf_counter() - start)
            alone.close()
    del model, runners, graphs, compiled
    if s.cuda:
        torch.cuda.empty_cache()
    return result


def compile_variants(run: Run, family: Family, model, result, runners, closers) -> dict:
    """``PrefillRunner(compile=True)`` and ``torch.compile(mode="reduce-overhead")``, with
    the first-call time of each over ``--first-call-lengths`` (breakgraph's first: it
    compiles with cold caches, the baseline after it may find some kernels cached).

    Where the time goes, for both: ``dynamo`` (breakgraph: over the construction) and each
    reduce-overhead length carry :func:`~benchmarks.baselines.dynamo_delta`'s ``compile_s``
    (Dynamo, AOT autograd, Inductor's lowering, codegen, kernel compiles; autotuning and CUDA
    graph recording at first runs), the raw torch ``timers`` and the compile ``caches`` hit;
    breakgraph's ``breakdown`` splits its construction (:func:`construction_breakdown`),
    reduce-overhead's ``call_s`` its calls (compile + eager warm-up, record, replay)."""
    from breakgraph.integrations.transformers import PrefillRunner

    s = run.settings
    compiled: dict[str, object] = {}
    if family.name not in s.compile_families:
        return compiled
    if not s.cuda:
        run.skip(family.name, "compile", "CUDA only (smoke run)")
        return compiled
    if not run.allows(COMPILE_ESTIMATE_S + FAMILY_ESTIMATE_S.get(family.name, 30)):
        run.skip(family.name, "compile", f"time budget ({s.budget_s:.0f} s) would be exceeded")
        return compiled
    g = torch.Generator().manual_seed(3)
    lengths = {
        n: torch.randint(model.config.vocab_size, (n,), generator=g).to(s.device)
        for n in s.first_call_lengths
    }
    info: dict = {"order": ["bg_compiled", "compile_ro"], "dynamic": s.compile_dynamic}
    result["compile"] = info
    with attempt(result, "inductor_warmup"):
        start = time.perf_counter()
        torch.compile(lambda x: x.relu() + 1)(torch.randn(8, device=s.device))
        run.sync()
        info["inductor_warmup_s"] = time.perf_counter() - start
    with attempt(result, "bg_compiled"):
        before = dynamo_snapshot()
        start = time.perf_counter()
        bgc = PrefillRunner(model, **s.runner_kwargs, compile=True)
        run.sync()
        record = runner_record(bgc, time.perf_counter() - start)
        record["dynamo"] = dynamo_delta(before)
        record["breakdown"] = construction_breakdown(bgc, record)
        record["lengths"] = []
        closers.append(bgc.close)
        for n, p in lengths.items():
            before = dynamo_snapshot()
            start = time.perf_counter()
            bgc.prefill([p])
            run.sync()
            first = time.perf_counter() - start
            frames = dynamo_delta(before)["frames"]  # 0: a first call compiles nothing
            record["lengths"].append({"tokens": n, "first_call_s": first, "frames": frames})
        info["bg_compiled"] = record
        runners["bg_compiled"] = bgc
    with attempt(result, "compile_ro"):
        dynamic = {"auto": None, "true": True, "false": False}[s.compile_dynamic]
        ro = CompiledForward(model, dynamic=dynamic)
        calls = 3  # reduce-overhead: compile + eager warm-up, record, replay
        info["compile_ro"] = {
            "calls_per_length": calls,
            "lengths": ro.first_calls(list(lengths.values()), calls=calls),
        }
        compiled["compile_ro"] = ro
    return compiled


def construction_breakdown(runner, record: dict) -> dict:
    """Where ``PrefillRunner(compile=True)``'s construction went, in seconds: ``compile_s``
    (every Dynamo frame compile, split as in ``record["dynamo"]["compile_s"]``) happens inside
    the warm-ups (``warmup_s``, all buckets), whose remainder is the forward's runs
    (``warmup_runs_s``: kernel autotuning at first runs included); ``capture_s`` is the
    captures alone (every bucket's ``capture_seconds`` holds its warm-up too); ``other_s``
    the rest of the construction (model checks, buffers, ``tune_buckets``). ``compile_s``
    comes from torch's compile timers, which read the wall clock (``time.time_ns``), the
    other spans from a monotonic clock: a clock step during the construction shows as a
    negative ``warmup_runs_s``."""
    stats = runner.stats
    compile_s = record["dynamo"]["compile_s"]["compile_s"]
    ladder_s = sum(s for _, s in record["capture_seconds"])
    return {
        "construction_s": record["construction_s"],
        "compile_s": compile_s,
        "warmup_s": stats.warmup_seconds,
        "warmup_runs_s": stats.warmup_seconds - compile_s,
        "capture_s": ladder_s - stats.warmup_seconds,
        "other_s": record["construction_s"] - ladder_s,
        "first_bucket_s": record["capture_seconds"][0][1] if record["capture_seconds"] else None,
    }


def correctness(model, singles, batch, padded, runners, graphs, compiled) -> dict:
    """Every variant's last-token logits against HF eager, per workload."""
    out: dict = {}
    for n, p in singles.items():
        ref = hf_eager(model, p)[None]
        if ref.is_cuda:  # its faults are its own, not the first variant's (see compare)
            torch.cuda.synchronize()
        row = {
            name: compare(r.prefill([p]).logits, ref) for name, r in serving(runners, [p]).items()
        }
        if n in graphs:
            row["hf_graph"] = compare(graphs[n](input_ids=p[None])[:, -1], ref)
        if "compile_ro" in compiled:
            row["compile_ro"] = compare(compiled["compile_ro"](p)[None], ref)
        out[f"single {n}"] = row
    ref = torch.stack([hf_eager(model, p) for p in batch])
    row = {
        name: compare(r.prefill(batch).logits, ref) for name, r in serving(runners, batch).items()
    }
    row["hf_eager_padded"] = compare(padded.eager(model), ref)
    if "batch" in graphs:
        row["hf_graph"] = compare(graphs["batch"](**padded.inputs())[:, -1], ref)
    out["batch"] = row
    return out


def time_single(run: Run, model, n: int, p, runners, graphs, compiled) -> dict:
    """One prompt of ``n`` tokens: medians of all variants, taking turns."""
    fns = {"hf_eager": lambda: hf_eager(model, p)}
    if n in graphs:
        fns["hf_graph"] = lambda: graphs[n](input_ids=p[None])
    for name, r in serving(runners, [p]).items():
        fns[name] = lambda r=r: r.prefill([p])
    if "compile_ro" in compiled:
        fns["compile_ro"] = lambda: compiled["compile_ro"](p)
    timed = take_turns(run, fns)
    buckets = runners["breakgraph"].buckets if "breakgraph" in runners else ()
    row = {"workload": f"single {n}", "kind": "single", "tokens": n, "prompts": 1}
    return {**row, "bucket": bucket_for(buckets, n), **timed}


def take_turns(run: Run, fns: dict) -> dict:
    """The variants in ``fns`` timed taking turns, with the run's rounds and spread pairs."""
    s = run.settings
    return interleaved(
        fns,
        rounds=s.rounds,
        iters=s.iters,
        warmup=s.warmup,
        sync=run.sync,
        spread=[x for x in SPREAD_PAIRS if set(x) <= set(fns)],
    )


def time_batch(run: Run, model, batch, padded, runners, graphs) -> dict:
    """The mixed batch: the packed and padded variants take turns; HF eager one prompt at a
    time is timed apart (too slow to take turns)."""
    s = run.settings
    fns = {"hf_eager_padded": lambda: padded.eager(model)}
    if "batch" in graphs:
        fns["hf_graph"] = lambda: graphs["batch"](**padded.inputs())
    for name, r in serving(runners, batch).items():
        fns[name] = lambda r=r: r.prefill(batch)
    timed = take_turns(run, fns)
    timed["ms"]["hf_eager"] = median_ms(
        lambda: [hf_eager(model, p) for p in batch], calls=s.eager_batch_calls, sync=run.sync
    )
    timed["apart"] = {"hf_eager": s.eager_batch_calls}
    tokens = sum(map(len, batch))
    buckets = runners["breakgraph"].buckets if "breakgraph" in runners else ()
    return {
        "workload": f"batch of {len(batch)} ({tokens} tokens)",
        "kind": "batch",
        "tokens": tokens,
        "prompts": len(batch),
        "padded_tokens": padded.tokens,
        "bucket": bucket_for(buckets, tokens),
        **timed,
    }


def host_and_device(run: Run, prompts: list, runners: dict, graph, fresh: dict) -> dict:
    """Host time of each graph variant's call (to return; for runners also to their first
    graph replay, probed) against its pure device time. ``graph`` is the workload's
    exact-length graph (or None), called with ``fresh`` inputs."""
    s = run.settings
    calls: dict[str, tuple[Callable, list]] = {}
    for name, r in serving(runners, prompts).items():
        if name != "bg_compiled":
            calls[name] = (lambda r=r: r.prefill(prompts), replayable_graphs(r))
    if graph is not None:
        calls["hf_graph"] = (lambda: graph(**fresh), [])
    host = {}
    for name, (call, graph_list) in calls.items():
        with probe_replays(graph_list) as probe:
            entry = host_times(
                call, iters=s.host_iters, sync=run.sync, probe=probe if graph_list else None
            )
        if run.clock is not None:
            entry.update(run.clock.measure(call, iters=s.device_iters))
        host[name] = entry
    return host


def replayable_graphs(runner) -> list:
    """Every graph a runner's call may replay first (``PrefillRunner.graphs``)."""
    return list(runner.graphs().values())


def run_all(settings: Settings, out: str | None = None) -> dict:
    """Every family of ``settings`` (compile families last, so the budget cuts compile
    work before it cuts families); the JSON is rewritten after each family."""
    run = Run(settings)
    catalogue = SMOKE_FAMILIES if settings.smoke else {**FAMILIES, **HELD_OUT_FAMILIES}
    results = {
        "schema": SCHEMA,
        "meta": environment(settings.cuda),
        "settings": dataclasses.asdict(settings),
        "variants": VARIANTS,
        "skipped": run.skipped,
        "families": [],
    }
    if not settings.smoke:
        for name in settings.families:
            if name not in settings.compile_families:
                run.skip(name, "compile", NOT_COMPILED)
    order = sorted(settings.families, key=lambda n: n in settings.compile_families)
    for name in order:
        estimate = FAMILY_ESTIMATE_S.get(name, 0) if not settings.smoke else 0
        if not run.allows(estimate):
            run.skip(name, "family", f"time budget ({settings.budget_s:.0f} s) would be exceeded")
            continue
        print(f"[{run.elapsed():6.1f} s] {name}", flush=True)
        results["families"].append(run_family(run, catalogue[name]))
        results["meta"]["elapsed_s"] = run.elapsed()
        if out:
            write(results, out)
    results["meta"]["elapsed_s"] = run.elapsed()
    if out:
        write(results, out)
    return results


def write(results: dict, path: str) -> None:
    """Replace ``path`` whole: a run stopped mid-write (a timeout) leaves the last version."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(partial, path)


def parse_args(argv: list[str] | None = None) -> tuple[Settings, str | None]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ints = lambda text: [int(x) for x in text.split(",") if x]
    names = lambda text: [x for x in text.split(",") if x]
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny models, CPU, emulated backend")
    parser.add_argument("--families", type=names, default=None,
                        help="default: every family of FAMILIES (HELD_OUT_FAMILIES when named)")
    parser.add_argument("--sizes", type=ints, default=[32, 200, 1000])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10, help="turns per round")
    parser.add_argument("--batch-prompts", type=int, default=16)
    parser.add_argument("--compile-families", type=names, default=["mistral-7b-4l"])
    parser.add_argument("--first-call-lengths", type=ints, default=[32, 200, 1000, 77, 517])
    parser.add_argument("--compile-dynamic", choices=("auto", "true", "false"), default="auto")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="skip families / compile work that would run past this",
    )
    args = parser.parse_args(argv)
    catalogue = SMOKE_FAMILIES if args.smoke else {**FAMILIES, **HELD_OUT_FAMILIES}
    unknown = set(args.families or ()) - set(catalogue)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; known: {', '.join(catalogue)}")
    if args.smoke:
        return smoke_settings(args.families), args.out
    args.families = args.families or list(FAMILIES)
    settings = Settings(
        families=args.families,
        sizes=args.sizes,
        rounds=args.rounds,
        iters=args.iters,
        batch_prompts=args.batch_prompts,
        compile_families=[f for f in args.compile_families if f in args.families],
        first_call_lengths=args.first_call_lengths,
        compile_dynamic=args.compile_dynamic,
        budget_s=args.budget_s,
    )
    return settings, args.out


def main(argv: list[str] | None = None) -> dict:
    settings, out = parse_args(argv)
    if settings.cuda and not torch.cuda.is_available():
        raise SystemExit("bench_prefill: no CUDA device; use --smoke for the CPU run")
    results = run_all(settings, out)
    from .report_prefill import summary_lines

    print("---- prefill summary ----")
    print("\n".join(summary_lines(results)))
    print("---- end of prefill summary ----")
    return results


if __name__ == "__main__":
    main()
