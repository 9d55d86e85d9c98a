"""Tensor parallelism: two ranks run a TP=2 transformers model through breakgraph.

Every scenario runs in two fresh processes (gloo and the emulated backend on the CPU,
NCCL and CUDA graphs on two GPUs; without CUDA they fork from a server that imported torch
and transformers once, see ``_start_method``). The model is sharded by transformers itself
(``DistributedConfig(tp_size=2)``): its row-parallel layers all-reduce and its ``lm_head``
all-gathers, inside breakgraph's segments or, with ``tp_collectives="eager"``, in breaks.
One launch per backend runs the scenarios one after the other in the same two processes
(starting a pair costs more than most scenarios; ``main`` last: its capture failure leaves
the process group broken; on CUDA continuous batching gets a launch of its own, for its NCCL
setting; on the CPU the TP benchmark's smoke run goes before it, since CB sets that setting in
the environment) and the tests below check their results. The launch has a hard timeout, so a hang
fails the tests instead of stalling CI. A rank that dies without a result (a signal, a native
abort: once on CI, during a gloo collective, with no Python stack) gets one more launch, with a
``tests.helpers.RankDiedWarning`` that carries the first launch's report (exit codes, and the
stacks faulthandler wrote on the fatal signal; ``-W error::tests.helpers.RankDiedWarning`` makes
the first death fail); a second death, a hang or a scenario's error fails the tests.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

import numpy as np
import pytest
import torch

from benchmarks.tiny_models import (
    DENSE_FAMILIES,
    MOE_FAMILIES,
    OTHER_DENSE_FAMILIES,
    from_config,
    tiny_config,
)
from tests.helpers import RankDiedWarning

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORLD = 2
VOCAB = 128
BUCKETS = (16, 32)
SCENARIO_TIMEOUT = 120.0  # seconds per scenario of a launch (start-up included)

BACKENDS = [
    pytest.param("emulated", id="gloo-emulated"),
    pytest.param(
        "cuda",
        id="nccl-cuda",
        marks=[
            pytest.mark.requires_cuda,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
        ],
    ),
]


# -- the launcher ----------------------------------------------------------------------------------
class RankDied(AssertionError):
    """A rank's process ended without reporting a result (killed by a signal, a native abort)."""


def launch_again_if_a_rank_dies(
    scenarios: tuple, backend: str, path: str, env: dict | None = None
) -> dict:
    """:func:`launch`, once more in a fresh folder if a rank died without a result (the first
    death's report, cut to its last lines, is a :class:`RankDiedWarning`); a second death
    raises."""
    try:
        return launch(scenarios, backend, path, env)
    except RankDied as died:
        report = str(died)
        if len(report) > 6000:  # rank 0's results can be long: the exit codes and the stacks
            report = report[:2000] + "\n[...]\n" + report[-4000:]
        warnings.warn(f"launched {scenarios} again: {report}", RankDiedWarning, stacklevel=2)
        return launch(scenarios, backend, os.path.join(path, "again"), env)


def launch(scenarios: tuple, backend: str, path: str, env: dict | None = None) -> dict:
    """Run ``scenarios``, in order, on 2 fresh processes; return ``{scenario: [each rank's
    result dict (rank order)]}``.

    A rank whose scenario raised returns ``{"error": ..., "traceback": ...}`` for it and goes
    on with the next; ranks still running at the deadline are killed and the launch fails.
    """
    context = _start_method()
    results = context.Queue()
    port = _free_port()
    stacks = tempfile.mkdtemp(prefix="breakgraph-tp-stacks-")
    timeout = SCENARIO_TIMEOUT * len(scenarios)
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if backend == "emulated" else {}
    environment = {**hidden, **(env or {})}
    processes = [
        context.Process(
            target=_worker,
            args=(rank, port, scenarios, backend, path, results, time.time() + timeout, stacks),
            kwargs={"environment": environment},  # a forked rank has the server's, not ours
            daemon=True,
        )
        for rank in range(WORLD)
    ]
    with _environment(environment):  # gloo ranks stay on the CPU on a GPU machine too
        for process in processes:
            process.start()
    deadline = time.monotonic() + timeout
    collected = {}
    try:
        while len(collected) < WORLD:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"scenarios {scenarios} ({backend}) hung: ranks {sorted(collected)} answered "
                    f"within {timeout:g} s\n" + _hang_report(stacks, collected)
                )
            try:
                rank, result = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:  # every rank reports before it exits (code 0): a crash
                crashed = {r: p.exitcode for r, p in enumerate(processes) if p.exitcode}
                if crashed:
                    _collect_the_others(results, collected, crashed)
                    raise RankDied(
                        f"scenarios {scenarios} ({backend}): rank(s) died without a result, "
                        f"exit codes {crashed} (negative: the signal's number)\n"
                        + _hang_report(stacks, collected)
                    ) from None
                continue
            collected[rank] = result
    finally:
        stuck = []
        for rank, process in enumerate(processes):
            process.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
            if process.is_alive():
                stuck.append(rank)
                process.kill()
                process.join()
        shutil.rmtree(stacks, ignore_errors=True)
    # a rank that reported but could not exit (say, a device sync in its teardown) is a hang too
    assert not stuck, f"scenarios {scenarios} ({backend}): rank(s) {stuck} did not exit"
    return {name: [collected[rank][name] for rank in range(WORLD)] for name in scenarios}


@contextlib.contextmanager
def _environment(values: dict):
    """Set environment variables for the processes started inside (spawn copies them)."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _hang_report(stacks: str, collected: dict) -> str:
    """What the answered ranks said and where the others were (their stacks, dumped by
    faulthandler shortly before the deadline)."""
    lines = []
    for rank, by_scenario in sorted(collected.items()):
        for name, result in by_scenario.items():
            said = result.get("traceback") or {k: v for k, v in result.items() if k != "traceback"}
            lines.append(f"--- rank {rank} answered ({name}): {said}")
    for rank in range(WORLD):
        if rank in collected:
            continue
        stack = os.path.join(stacks, f"stack-rank{rank}.txt")
        text = "(no stack dumped)"
        if os.path.exists(stack):
            with open(stack) as dumped:
                text = dumped.read()
        lines.append(f"--- rank {rank} did not answer; its threads:\n{text}")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_method():
    """How the ranks start: on a machine without CUDA, forked from a server process that
    imported this module (torch, transformers) once per test process, which saves two
    interpreter start-ups and imports per launch (about 10 s of a CI core each); with CUDA,
    spawned, since a process that asked CUDA for its devices (this module's import does)
    must not fork ranks that use it."""
    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def _collect_the_others(results, collected: dict, crashed: dict, grace: float = 5.0) -> None:
    """Once a rank has died, what the others answered, for the report: a rank can answer
    while its peer dies (the queue's feeder thread delivers it a moment later), which the
    report named as no answer when the parent looked in between (a CI flake under load)."""
    end = time.monotonic() + grace
    while len(collected) + len(crashed) < WORLD and time.monotonic() < end:
        try:
            rank, result = results.get(timeout=0.2)
        except queue.Empty:
            continue
        collected[rank] = result


def _worker(rank, port, scenarios, backend, path, results, deadline, stack_dir,
            environment=None) -> None:  # fmt: skip
    import faulthandler

    os.environ.update(environment or {})  # before anything reads it (CUDA_VISIBLE_DEVICES)

    # the parent gives up at `deadline` (its start-up counts): dump the stacks shortly before
    stacks = open(os.path.join(stack_dir, f"stack-rank{rank}.txt"), "w")  # noqa: SIM115 (until exit)
    faulthandler.enable(file=stacks, all_threads=True)  # a fatal signal writes the stacks there
    faulthandler.dump_traceback_later(max(1.0, deadline - time.time() - 5), file=stacks)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
    )
    import torch.distributed as dist

    def failed(exc: BaseException) -> dict:  # reported to the parent, which asserts on it
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc(),
        }

    result = {}
    try:
        if backend == "cuda":
            torch.cuda.set_device(rank)
            dist.init_process_group(
                "nccl", device_id=torch.device("cuda", rank), timeout=timedelta(seconds=60)
            )
        else:
            torch.set_num_threads(1)  # two ranks on a 2-core CI machine
            dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        for name in scenarios:  # each in a folder of its own (rank 0 saves its model there)
            # what is alive now (torch, transformers, earlier scenarios' imports) is frozen, so
            # transformers' CB cleanup (a full gc.collect() per manager) walks only this
            # scenario's objects: 0.3 s a collection otherwise, 3.5 s of a rank's 13 s
            gc.collect()
            gc.freeze()
            try:
                result[name] = SCENARIOS[name](rank, backend, os.path.join(path, name))
            except BaseException as exc:
                result[name] = failed(exc)
    except BaseException as exc:  # the process group did not start
        result = {name: failed(exc) for name in scenarios}
    faulthandler.cancel_dump_traceback_later()
    results.put((rank, result))
    results.close()
    results.join_thread()
    os._exit(0)  # a failed rank may hold a broken process group: no teardown


# -- shared pieces of the scenarios ----------------------------------------------------------------
def load_models(
    rank: int, backend: str, path: str, dtype: torch.dtype | None = None, family: str = "llama"
):
    """Rank 0 saves a tiny random model of ``family``; every rank loads it with TP=2 and
    unsharded."""
    import torch.distributed as dist
    import transformers
    from transformers.distributed.configuration_utils import DistributedConfig

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if rank == 0:
        torch.manual_seed(0)
        class_name, extra = {**DENSE_FAMILIES, **OTHER_DENSE_FAMILIES, **MOE_FAMILIES}[family]
        config = tiny_config(class_name, vocab_size=VOCAB, max_position_embeddings=256, **extra)
        from_config(config).save_pretrained(path)  # routing biases drawn (tiny_models)
    dist.barrier()
    if dtype is None:
        dtype = torch.bfloat16 if backend == "cuda" else torch.float32
    device = torch.device("cuda", rank) if backend == "cuda" else torch.device("cpu")
    sharded = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, distributed_config=DistributedConfig(tp_size=WORLD)
    ).eval()
    full = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(device)
    return sharded, full


def prompts_for(seed: int, lengths) -> list:
    """The same prompts on every rank (drawn from ``seed``), on the host."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]


def reference_logits(model, prompts) -> torch.Tensor:
    """Each prompt's next-token logits from the unsharded model, run eagerly one by one."""
    device = next(model.parameters()).device
    with torch.no_grad():
        rows = [model(p[None].to(device), use_cache=False).logits[0, -1] for p in prompts]
    return torch.stack(rows).float().cpu()


def max_diff(runner, reference, seed: int, lengths=(3, 7, 5)) -> float:
    """Largest |logits - unsharded| over the batch, relative to max(1, max|unsharded|)."""
    prompts = prompts_for(seed, lengths)
    logits = runner.prefill(prompts).logits.float().cpu()
    expected = reference_logits(reference, prompts)
    return (logits - expected).abs().max().item() / max(1.0, expected.abs().max().item())


def error_of(call) -> str:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__
    return "no error"


def error_text_of(call) -> str:
    """``"ErrorName: message"`` of what ``call`` raises."""
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# -- scenarios -------------------------------------------------------------------------------------
def scenario_main(rank: int, backend: str, path: str) -> dict:
    """Every scenario in one launch; the capture failure last."""
    import torch.distributed as dist
    from breakgraph.integrations.transformers import PrefillRunner

    sharded, full = load_models(rank, backend, path)
    out: dict = embedding_under_capture(rank, backend, sharded, full)
    original_all_reduce = dist.all_reduce

    # collectives captured inside the segments
    runner = PrefillRunner(sharded, token_buckets=BUCKETS, max_prompts=4, backend=backend, warmup=1)
    out["detected"] = runner.ranks is not None
    out["captured_graph"] = repr(runner.graph(BUCKETS[0]))
    out["captured_diff"] = max(max_diff(runner, full, seed) for seed in (1, 2, 3))
    out["captured_vocab"] = runner.prefill(prompts_for(4, (5,))).logits.shape[-1]
    # different prompt lengths on the two ranks: both raise before anything runs
    out["lengths_mismatch"] = error_of(lambda: runner.prefill(prompts_for(5, (3, 4 + rank))))
    # one rank above the largest bucket, the other not
    out["over_largest"] = error_of(lambda: runner.prefill(prompts_for(6, (10 + 25 * rank,))))
    # a batch that only rank 1 rejects (too many prompts): rank 0 must not wait for it
    too_many = prompts_for(7, (2,) * (3 if rank == 0 else 5))
    out["one_rank_invalid"] = error_of(lambda: runner.prefill(too_many))
    # refused before the lengths are read: a bare tensor, owned= not a bool (rank 1 only)
    one = prompts_for(7, (3,))
    out["one_rank_tensor"] = error_of(lambda: runner.prefill(one[0] if rank else one))
    out["one_rank_owned"] = error_of(lambda: runner.prefill(one, owned="yes" if rank else True))

    def prompts_failing_on_rank_1():  # not breakgraph's error: the caller's own iterator
        yield one[0]
        if rank:
            raise ValueError("tokenizer failed")

    out["one_rank_iterator"] = error_of(lambda: runner.prefill(prompts_failing_on_rank_1()))
    weights, name, _ = runner._weights  # rank 1's anchor weight replaced: the graphs refuse
    kept = weights[name]
    if rank:
        weights[name] = torch.nn.Parameter(kept.detach().clone(), requires_grad=False)
    out["one_rank_moved"] = error_of(lambda: runner.prefill(one))
    weights[name] = kept
    out["after_errors_diff"] = max_diff(runner, full, seed=8)
    out["calls"] = dict(runner.stats.calls)
    runner.close()

    # each all-reduce an eager break; debug mode checks the ids on every call
    runner = PrefillRunner(
        sharded,
        token_buckets=BUCKETS,
        max_prompts=4,
        backend=backend,
        warmup=1,
        tp_collectives="eager",
        debug=True,
    )
    out["eager_graph"] = repr(runner.graph(BUCKETS[0]))
    out["eager_diff"] = max(max_diff(runner, full, seed) for seed in (1, 2))
    same_lengths_other_ids = prompts_for(9 + rank, (4, 6))
    out["ids_mismatch_debug"] = error_of(lambda: runner.prefill(same_lengths_other_ids))
    out["after_mismatch_diff"] = max_diff(runner, full, seed=10)
    runner.close()
    out["all_reduce_restored"] = dist.all_reduce is original_all_reduce

    out.update(bucket_agreement(rank, backend))
    out["capture_failure"] = capture_failure(rank, backend, sharded)
    return out


def embedding_under_capture(rank: int, backend: str, sharded, full) -> dict:
    """The input embedding captured alone (in graph_safe_tensor_parallel), replayed with fresh
    ids that fall in both ranks' vocabulary shards: it must equal the unsharded embedding
    exactly, and the model's TP hook must be back afterwards."""
    from breakgraph.integrations.transformers.tensor_parallel import (
        graph_safe_tensor_parallel,
        vocab_parallel_embeddings,
    )
    from torch.distributed.tensor import DTensor, Shard

    import breakgraph
    from breakgraph.distributed import CAPTURE_ERROR_MODE

    embedding = sharded.model.embed_tokens
    weight, hook = embedding.weight, embedding.__dict__.get("forward")  # TP hook (or None)
    device = weight.device
    out = {
        # the feature, seen directly: an embedding weight sharded over the vocabulary
        "embedding_sharded": isinstance(weight, DTensor) and weight.placements == (Shard(0),),
        "vocab_parallel": [name for name, _ in vocab_parallel_embeddings(sharded)],
    }
    ids = torch.zeros(1, 24, dtype=torch.long, device=device)
    graph = breakgraph.BreakableCUDAGraph()
    generator = torch.Generator().manual_seed(20)
    exact = []
    with torch.no_grad():
        with graph_safe_tensor_parallel(sharded):
            embedding(ids)  # the first use checks the lookup; collectives run before capture
            with breakgraph.capture(graph, backend=backend, capture_error_mode=CAPTURE_ERROR_MODE):
                looked_up = embedding(ids)
        for _ in range(3):  # the same fresh ids on both ranks, every replay
            ids.copy_(torch.randint(0, VOCAB, (1, 24), generator=generator))
            graph.replay()
            exact.append(torch.equal(looked_up, full.model.embed_tokens(ids)))
    graph.reset()
    out["embedding_exact"] = exact
    out["embedding_restored"] = embedding.__dict__.get("forward") is hook
    if out["vocab_parallel"]:  # a weight replaced after the check is the one looked up
        embedding.weight = torch.nn.Parameter(
            DTensor.from_local(weight.to_local() * 2, weight.device_mesh, [Shard(0)]),
            requires_grad=False,
        )
        with torch.no_grad(), graph_safe_tensor_parallel(sharded):
            doubled = embedding(ids)
        embedding.weight = weight
        with torch.no_grad():
            out["embedding_follows_weight"] = torch.equal(doubled, 2 * full.model.embed_tokens(ids))
    return out


def bucket_agreement(rank: int, backend: str) -> dict:
    """BucketedRunner with a collective in its segment, ranks proposing different sizes."""
    import torch.distributed as dist

    from breakgraph.distributed import RankGroup
    from breakgraph.runner import BucketedRunner

    device = torch.device("cuda", rank) if backend == "cuda" else torch.device("cpu")

    def fn(x):  # the all-reduced statistic has a fixed shape, so padded rows (zeros) do not count
        total = x.abs().sum(0)
        dist.all_reduce(total)
        return x / (1 + total)

    def inputs(sizes, seed):  # every rank draws every rank's input, to know the expected result
        generator = torch.Generator().manual_seed(seed)
        xs = [torch.randn(n, 8, generator=generator).to(device) for n in sizes]
        expected = xs[rank] / (1 + sum(x.abs().sum(0) for x in xs))
        return xs[rank], expected

    out: dict = {}
    ranks = RankGroup(timeout=60)
    for on_miss in ("eager", "raise"):
        runner = BucketedRunner(
            fn,
            (8, 16),
            (torch.zeros(1, 8, device=device),),
            backend=backend,
            ranks=ranks,
            warmup=1,
            on_miss=on_miss,
        )
        x, expected = inputs((5, 12), seed=1)  # rank 0 alone would take bucket 8
        got = runner(x)
        out[f"{on_miss}_different_sizes_diff"] = (got - expected).abs().max().item()
        x, expected = inputs((5, 20), seed=2)  # rank 1 above the largest bucket
        try:
            got = runner(x)
            out[f"{on_miss}_one_over_diff"] = (got - expected).abs().max().item()
        except Exception as exc:
            out[f"{on_miss}_one_over_error"] = type(exc).__name__
        out[f"{on_miss}_stats"] = (dict(runner.stats.calls), dict(runner.stats.eager_fallbacks))
        runner.close()
    buckets = (8, 16) if rank == 0 else (8, 32)
    out["different_buckets"] = error_of(
        lambda: BucketedRunner(
            fn, buckets, (torch.zeros(1, 8, device=device),), backend=backend, ranks=ranks
        )
    )
    # settings that decide which calls replay, run eagerly, raise, or warm up how often: a
    # difference made ranks part ways (one replays, one runs eagerly), hang, or time out raw
    for setting, value in (("on_miss", ("eager", "raise")[rank]), ("warmup", 1 + rank),
                           ("max_padding_fraction", (None, 0.5)[rank]),
                           ("pad_values", float(rank))):  # fmt: skip
        out[f"different_{setting}"] = error_text_of(lambda: BucketedRunner(
            fn, (8, 16), (torch.zeros(1, 8, device=device),), backend=backend, ranks=ranks,
            **{"warmup": 1, setting: value},
        ))  # fmt: skip
    ranks.close()
    return out


def capture_failure(rank: int, backend: str, sharded) -> dict:
    """Rank 1's attention raises while the second bucket is captured; rank 0 is then blocked
    in the o_proj all-reduce (gloo) or has it pending on the GPU (NCCL)."""
    from breakgraph.integrations.transformers import PrefillRunner, attention

    calls = {"n": 0}
    original = attention.LayerAttention.__call__

    def failing(self):
        calls["n"] += 1
        # bucket 32: warm-up (2 layers) and capture (2); bucket 16 (no warm-up: one per
        # capture phase): its capture's first attention call
        if rank == 1 and calls["n"] == 5:
            raise RuntimeError("injected failure on rank 1")
        return original(self)

    attention.LayerAttention.__call__ = failing
    start = time.monotonic()
    try:
        PrefillRunner(
            sharded, token_buckets=BUCKETS, max_prompts=4, backend=backend, warmup=1, tp_timeout=6
        )
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "notes": getattr(exc, "__notes__", []),
            "seconds": time.monotonic() - start,
        }
    return {"error": "no error", "seconds": time.monotonic() - start}


def scenario_cb(rank: int, backend: str, path: str) -> dict:
    """Continuous batching of the TP model: transformers schedules rank 0's requests on every
    rank; breakgraph captures the same buckets everywhere and agrees every step. fp32, so the
    tokens can be compared exactly (the reference attention kernel on CUDA too)."""
    from breakgraph.integrations.transformers import enable_continuous_batching
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    sharded, full = load_models(rank, backend, path, dtype=torch.float32)
    prompts = [p.tolist() for p in prompts_for(11, (5, 30, 17, 9, 3, 22))]
    generation = GenerationConfig(
        max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0
    )

    def generate(model, **config) -> list:  # max_batch_tokens 16: chunked prefill, mixed steps
        batching = ContinuousBatchingConfig(
            **{**dict(block_size=16, num_blocks=32, max_batch_tokens=16), **config}
        )
        outs = model.generate_batch(
            prompts,
            generation_config=generation,
            continuous_batching_config=batching,
            progress_bar=False,
        )
        errors = [outs[key].error for key in sorted(outs) if outs[key].error]
        if errors:  # a step failed in transformers' generation thread: its requests carry it
            raise RuntimeError(f"a request failed: {errors[0]}")
        return [outs[key].generated_tokens for key in sorted(outs)]

    out: dict = {"stock_tp": generate(sharded), "stock_unsharded": generate(full)}
    with enable_continuous_batching(sharded, backend=backend, query_buckets=(8,)) as handle:
        out["breakgraph_tp"] = generate(sharded)
    stats = handle.stats
    out["stats"] = (stats.captures, stats.replays, stats.eager_steps, str(stats))
    out["breaks"] = {bucket: entry.breaks for bucket, entry in stats.buckets.items()}
    with enable_continuous_batching(sharded, backend=backend, tp_timeout=30):
        # graphs on one rank only: the runners' settings differ, both raise before any step
        out["settings_mismatch"] = error_text_of(
            lambda: generate(sharded, use_cuda_graph=rank == 0)
        )
    with enable_continuous_batching(sharded, backend=backend, tp_timeout=30) as handle:
        # the per-step check: rank 1 fingerprints its steps in debug mode (tokens too), so
        # the very first step differs and both ranks raise before it runs
        handle.runner.debug = rank == 1
        out["step_mismatch"] = error_text_of(lambda: generate(sharded))
    with enable_continuous_batching(sharded, backend=backend, tp_timeout=30):
        # the manager API without warmup(): every bucket was captured when the manager was
        # created, in the calling thread, so the generation thread only replays
        manager = sharded.init_continuous_batching(
            generation_config=generation,
            continuous_batching_config=ContinuousBatchingConfig(
                block_size=16, num_blocks=32, max_batch_tokens=16
            ),
        )
        manager.start()
        try:
            request = manager.add_request(prompts[0], max_new_tokens=2)
            result = manager.get_result(request_id=request, timeout=60)
            out["manager_api"] = "no result" if result is None else str(result.error)
        finally:
            manager.stop(block=True)
            manager.destroy()
    # different query buckets: enable raises on both ranks
    buckets = (8,) if rank == 0 else (4, 8)
    out["options_mismatch"] = error_of(
        lambda: enable_continuous_batching(sharded, backend=backend, query_buckets=buckets)
    )
    # torch.compile under TP: refused on every rank before anything is enabled
    out["compile_refused"] = error_text_of(
        lambda: enable_continuous_batching(sharded, backend=backend, compile=True)
    )
    # one rank refuses its call (an invalid option there only): it tells the other, which
    # raises at once instead of pairing its exchange with the refusing rank's next call
    out["one_rank_refuses_enable"] = error_text_of(
        lambda: enable_continuous_batching(
            sharded, backend=backend, query_buckets=(0,) if rank == 0 else (8,), tp_timeout=30
        )
    )
    with enable_continuous_batching(sharded, backend=backend, query_buckets=(8,), tp_timeout=30):
        out["one_rank_refuses_manager"] = error_text_of(
            lambda: generate(sharded, use_cuda_graph="bad" if rank == 0 else None)
        )
        out["after_refusals"] = generate(sharded)  # the ranks are still in step
        # an equal max_batch_tokens of another type: its repr differed (RankMismatchError)
        out["numpy_max_batch_tokens"] = error_text_of(
            lambda: generate(sharded, max_batch_tokens=np.int64(16) if rank else 16)
        )
        out["numpy_async"] = error_text_of(  # so did np.False_ against False
            lambda: generate(sharded, use_async_batching=np.False_ if rank else False)
        )
    out["restored"] = sharded.config._attn_implementation == "sdpa"
    return out


def greedy_batch(model, seed: int) -> list:
    """``model.generate_batch`` (continuous batching) of three prompts, 4 greedy tokens each:
    ``(error, tokens)`` per request."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    outs = model.generate_batch(
        [p.tolist() for p in prompts_for(seed, (5, 19, 9))],
        generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0
        ),
        continuous_batching_config=ContinuousBatchingConfig(
            block_size=16, num_blocks=16, max_batch_tokens=16
        ),
        progress_bar=False,
    )
    return [(outs[key].error, outs[key].generated_tokens) for key in sorted(outs)]


def scenario_gemma(rank: int, backend: str, path: str) -> dict:
    """Gemma (tied embeddings: vocab-parallel on every transformers; its embedding scales the
    lookup): two runners in turn, collectives captured then as eager breaks, then continuous
    batching. fp32, so CB's greedy tokens can be compared exactly."""
    from breakgraph.integrations.transformers import PrefillRunner, enable_continuous_batching

    sharded, full = load_models(rank, backend, path, dtype=torch.float32, family="gemma")
    out = embedding_under_capture(rank, backend, sharded, full)
    runner = PrefillRunner(sharded, token_buckets=BUCKETS, max_prompts=4, backend=backend, warmup=1)
    out["captured_diff"] = max(max_diff(runner, full, seed) for seed in (1, 2))
    runner.close()
    runner = PrefillRunner(
        sharded, token_buckets=BUCKETS, max_prompts=4, backend=backend, warmup=1,
        tp_collectives="eager",
    )  # fmt: skip
    out["eager_graph"] = repr(runner.graph(BUCKETS[0]))
    out["eager_diff"] = max(max_diff(runner, full, seed) for seed in (3, 4))
    runner.close()
    # the model itself still runs as transformers made it (its own hook, eagerly)
    prompts = prompts_for(5, (7,))
    with torch.no_grad():
        stock = sharded(prompts[0][None].to(full.device), use_cache=False).logits[0, -1].float()
    out["stock_after_diff"] = (stock.cpu() - reference_logits(full, prompts)[0]).abs().max().item()

    out["cb_stock"] = greedy_batch(sharded, 6)  # transformers' own TP continuous batching
    with enable_continuous_batching(sharded, backend=backend, query_buckets=(8,)):
        out["cb_breakgraph"] = greedy_batch(sharded, 6)
    return out


#: added families under TP: Phi-3's fused qkv_proj (gathered: every rank attends with every
#: head), OLMo-2's and OLMo-3's gathered k_proj (continuous batching refused), Granite's
#: multipliers, Gemma 3's sliding and global layers, Cohere's per-head qk-norm (refused),
#: EXAONE 4's sliding layers with RoPE and full ones without. (Command R7B matched by hand; after
#: Gemma 3 in one process, torch 2.10's DTensor failed in transformers' own embedding hook, an
#: embedding mask cached across same-shaped embeddings: pytorch#185356). HyperCLOVA X's logits
#: multiplied by logits_scaling; MiniMax-M2's experts and its q/k/v gathered for a qk-norm over
#: every head (continuous batching refused). Laguna's query heads per layer (4 and 8), each layer's
#: shared by the ranks. (Session 50's other eight matched by hand.)
TP_FAMILIES = ("phi3", "olmo2", "granite", "gemma3_text", "cohere", "olmo3", "exaone4",
               "hyperclovax", "minimax_m2", "laguna")  # fmt: skip
#: the families whose TP plan gathers k_proj: continuous batching refused
GATHERS_KEYS = ("olmo2", "olmo3", "minimax_m2")


def scenario_families(rank: int, backend: str, path: str) -> dict:
    """Each of :data:`TP_FAMILIES` in fp32: prefill against the unsharded model, continuous
    batching against transformers' own TP continuous batching (or refused)."""
    from breakgraph.integrations.transformers import (
        PrefillRunner,
        UnsupportedModelError,
        enable_continuous_batching,
    )

    out = {}
    for family in TP_FAMILIES:
        sharded, full = load_models(
            rank, backend, os.path.join(path, family), dtype=torch.float32, family=family
        )
        try:
            runner = PrefillRunner(
                sharded, token_buckets=(32,), max_prompts=4, backend=backend, warmup=1
            )
        except UnsupportedModelError as exc:  # Cohere's qk-norm: both entry points refuse
            try:
                enable_continuous_batching(sharded, backend=backend, query_buckets=(8,))
            except UnsupportedModelError as cb_exc:
                out[family] = {"refused": str(exc), "cb_refused": str(cb_exc)}
                continue
        result = {"detected": runner.ranks is not None, "diff": max_diff(runner, full, 1)}
        runner.close()
        result["cb_full"] = greedy_batch(full, 7)  # unsharded, stock continuous batching
        result["cb_stock"] = greedy_batch(sharded, 7) if family not in GATHERS_KEYS else None
        try:
            with enable_continuous_batching(sharded, backend=backend, query_buckets=(8,)):
                result["cb_breakgraph"] = greedy_batch(sharded, 7)
        except Exception as exc:
            result["cb_breakgraph"] = f"{type(exc).__name__}: {exc}"
        out[family] = result
    return out


def scenario_settings(rank: int, backend: str, path: str) -> dict:
    """Ranks building PrefillRunner with different settings: RankMismatchError on every rank,
    naming the setting, before any collective; the ranks stay usable."""
    from breakgraph.integrations.transformers import PrefillRunner

    sharded, full = load_models(rank, backend, path)

    def build(**settings):
        options = dict(token_buckets=BUCKETS, max_prompts=4, backend=backend, warmup=1)
        return PrefillRunner(sharded, **{**options, **settings}, tp_timeout=30)

    out = {
        "max_prompts": error_text_of(lambda: build(max_prompts=4 + rank)),
        "warmup": error_text_of(lambda: build(warmup=1 + rank)),
        "pad_token_id": error_text_of(lambda: build(pad_token_id=rank)),
        "token_buckets": error_text_of(lambda: build(token_buckets=(16, 32 + 16 * rank))),
        "debug": error_text_of(lambda: build(debug=rank == 1)),  # ids checked on one rank
        # refused under TP, on rank 1 only: rank 0 went on to capture and met a closed group
        "single_prompt_graphs": error_text_of(
            lambda: build(single_prompt_graphs=True if rank else None)
        ),
    }
    # None and False both mean off under TP: not a difference (was a RankMismatchError)
    runner = build(single_prompt_graphs=False if rank else None)
    out["after_diff"] = max_diff(runner, full, seed=1)
    runner.close()
    # equal settings of other types agree: a numpy int (its repr differed) and a list
    runner = build(max_prompts=np.int64(4) if rank else 4, pad_token_id=np.int32(0) if rank else 0,
                   token_buckets=list(BUCKETS) if rank else tuple(BUCKETS))  # fmt: skip
    out["numpy_diff"] = max_diff(runner, full, seed=2)
    runner.close()
    out["uneven_heads"] = uneven_heads(rank, backend, os.path.join(path, "uneven"))
    return out


def uneven_heads(rank: int, backend: str, path: str) -> dict:
    """A Llama with 3 KV heads (6 query heads) sharded over 2 ranks: both entry points refuse
    it before anything runs (the prefill failed in its first warm-up with a raw view error)."""
    import torch.distributed as dist
    import transformers
    from breakgraph.integrations.transformers import PrefillRunner, enable_continuous_batching
    from transformers.distributed.configuration_utils import DistributedConfig

    if rank == 0:
        config = tiny_config("LlamaConfig", vocab_size=VOCAB, hidden_size=96, head_dim=16,
                             num_attention_heads=6, num_key_value_heads=3)  # fmt: skip
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    dist.barrier()
    sharded = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=WORLD)
    ).eval()

    def enable():
        enable_continuous_batching(sharded, backend=backend, tp_timeout=30).disable()

    return {
        "prefill": error_text_of(lambda: PrefillRunner(
            sharded, token_buckets=BUCKETS, backend=backend, warmup=1, tp_timeout=30)),
        "cb": error_text_of(enable),
    }  # fmt: skip


def scenario_bench(rank: int, backend: str, path: str) -> dict:
    """``benchmarks/bench_tp.py --smoke`` on these two processes (its whole path: every
    variant, TP=1, the summary and the JSON), so the GPU run does not fail late. Its relaunch
    under torchrun from plain ``python`` is the example's (test_examples.py)."""
    import io

    from benchmarks import bench_tp

    os.makedirs(path, exist_ok=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench = bench_tp.Bench(smoke=True, iters=None)
        data = bench_tp.run(bench, os.path.join(path, "tp.json") if rank == 0 else None)
    return {"data": data, "printed": printed.getvalue()}


def scenario_die(rank: int, backend: str, path: str) -> dict:
    """Rank 1 dies of a segmentation fault (the launcher's own test); rank 0 answers."""
    if rank == 1:
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)
    return {}


def scenario_unbuilt(rank: int, backend: str, path: str) -> dict:
    """Rank 1 never builds its RankGroup (a runner that refused an argument there raises
    before it); rank 0, building its own, must raise breakgraph's error within the timeout."""
    from breakgraph import distributed

    if rank == 1:
        time.sleep(4.0)  # alive (rank 0 holds the store) until rank 0 has given up
        return {}
    start = time.monotonic()
    return {"error": error_text_of(lambda: distributed.RankGroup(timeout=2.0)),
            "seconds": time.monotonic() - start}  # fmt: skip


def one_rank_fails_mid_call(rank: int, call, inject, calls: int = 3) -> dict:
    """``call()`` ``calls`` times (the model group's gloo timeout cut to 3 s); rank 1's second call
    raises ``KeyboardInterrupt`` inside an attention break (``inject(arm)`` arms it), after
    the ranks agreed to run the call: ``{"call <i>": "ErrorName: message" or "ok", ...}``,
    with the notes of a call's error and its seconds."""
    out = {}
    for i in range(calls):
        inject(rank == 1 and i == 1)
        start = time.monotonic()
        try:
            call(i)
            out[f"call {i}"] = "ok"
        except BaseException as exc:  # KeyboardInterrupt too: the injected one
            out[f"call {i}"] = f"{type(exc).__name__}: {exc}"
            out[f"notes {i}"] = getattr(exc, "__notes__", [])
        out[f"seconds {i}"] = time.monotonic() - start
    return out


def scenario_replay_failure(rank: int, backend: str, path: str) -> dict:
    """Rank 1's attention break raises mid-replay, after the ranks agreed to run the prefill:
    rank 0 waits in the o_proj all-reduce until the model group's timeout. That timeout closes
    gloo's connections, so this scenario runs alone (the model group is unusable after it)."""
    from breakgraph.integrations.transformers import PrefillRunner, attention

    from breakgraph.distributed import tensor_parallel_group

    sharded, full = load_models(rank, backend, path)
    tensor_parallel_group(sharded).set_timeout(timedelta(seconds=3))
    runner = PrefillRunner(
        sharded, token_buckets=BUCKETS, max_prompts=4, backend=backend, warmup=1, tp_timeout=10
    )
    original, armed = attention.LayerAttention.__call__, [False]

    def failing(self):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt("injected on rank 1")
        return original(self)

    attention.LayerAttention.__call__ = failing
    try:
        return one_rank_fails_mid_call(
            rank,
            lambda i: max_diff(runner, full, seed=i) < tolerance(backend) or 1 / 0,
            lambda arm: armed.__setitem__(0, arm),
        )
    finally:
        attention.LayerAttention.__call__ = original


def scenario_cb_step_failure(rank: int, backend: str, path: str) -> dict:
    """Continuous batching: rank 1's paged-attention break raises in a step (after the step's
    agreement); transformers fails the requests, and the next manager is refused on both."""
    from breakgraph.integrations.transformers import cb_step, enable_continuous_batching

    import breakgraph
    from breakgraph.distributed import tensor_parallel_group

    sharded, full = load_models(rank, backend, path, dtype=torch.float32)
    tensor_parallel_group(sharded).set_timeout(timedelta(seconds=3))
    original, armed = cb_step.PagedAttention.__call__, [False]

    def failing(self):
        if armed[0] and not breakgraph.replay_context().warmup:
            armed[0] = False
            raise KeyboardInterrupt("injected on rank 1")
        return original(self)

    def generate(i):  # a failed step fails the requests (transformers' generation thread)
        results = greedy_batch(sharded, seed=i)
        if results != greedy_batch(full, seed=i):
            raise AssertionError(f"not the unsharded model's tokens: {results}")

    cb_step.PagedAttention.__call__ = failing
    try:
        with enable_continuous_batching(sharded, backend=backend, query_buckets=(8,),
                                        tp_timeout=10):  # fmt: skip
            return one_rank_fails_mid_call(rank, generate, lambda arm: armed.__setitem__(0, arm))
    finally:
        cb_step.PagedAttention.__call__ = original


SCENARIOS = {
    "replay_failure": scenario_replay_failure,
    "cb_step_failure": scenario_cb_step_failure,
    "die": scenario_die,
    "unbuilt": scenario_unbuilt,
    "bench": scenario_bench,
    "main": scenario_main,
    "cb": scenario_cb,
    "gemma": scenario_gemma,
    "settings": scenario_settings,
    "families": scenario_families,
}


# -- tests -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=BACKENDS)
def tp_runs(request, tmp_path_factory):
    """``{scenario: (backend, [each rank's result])}``: every scenario on this backend."""
    backend = request.param
    path = str(tmp_path_factory.mktemp("tp"))
    if backend == "cuda":
        # transformers' CB recommends NCCL_GRAPH_MIXING_SUPPORT=0 under TP (set before NCCL
        # starts), which the eager all-reduce breaks of `main` must not run under; breakgraph's
        # CB steps never issue an eager collective while a graph launch is in flight
        scenarios = ("settings", "gemma", "families", "main")
        results = launch_again_if_a_rank_dies(scenarios, backend, path)
        env = {"NCCL_GRAPH_MIXING_SUPPORT": "0"}
        cb_path = os.path.join(path, "cb-launch")
        results.update(launch_again_if_a_rank_dies(("cb",), backend, cb_path, env=env))
    else:
        scenarios = ("settings", "bench", "cb", "gemma", "families", "main")
        results = launch_again_if_a_rank_dies(scenarios, backend, path)
    return {name: (backend, by_rank) for name, by_rank in results.items()}


def scenario_run(tp_runs, name: str) -> tuple:
    backend, results = tp_runs[name]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('traceback')}"
    return backend, results


@pytest.fixture
def main_run(tp_runs):
    return scenario_run(tp_runs, "main")


@pytest.fixture
def gemma_run(tp_runs):
    return scenario_run(tp_runs, "gemma")


@pytest.fixture
def families_run(tp_runs):
    return scenario_run(tp_runs, "families")


@pytest.fixture
def settings_run(tp_runs):
    return scenario_run(tp_runs, "settings")


@pytest.fixture
def cb_run(tp_runs):
    return scenario_run(tp_runs, "cb")


def tolerance(backend: str) -> float:
    # bf16 and FlashAttention on the GPU (as in test_transformers); reduction order on the CPU
    return 5e-2 if backend == "cuda" else 1e-4


def test_prefill_runner_detects_tp_and_matches_the_unsharded_model(main_run):
    backend, results = main_run
    for result in results:
        assert result["detected"]
        assert result["captured_diff"] < tolerance(backend)
        assert result["captured_vocab"] == VOCAB  # full vocabulary on every rank
        assert "attention[layer 1]" in result["captured_graph"]
        assert "all_reduce" not in result["captured_graph"]  # captured inside the segments


def test_breaking_at_each_all_reduce_gives_the_same_logits(main_run):
    backend, results = main_run
    for result in results:
        assert result["eager_diff"] < tolerance(backend)
        # o_proj and down_proj of 2 layers, and the embedding's where it is vocab-parallel
        expected = 4 + len(result["vocab_parallel"])
        assert result["eager_graph"].count("all_reduce") == expected
        assert result["all_reduce_restored"]


def test_the_vocab_parallel_embedding_is_found_by_its_sharding(main_run):
    """transformers 5.21+ shards every embedding over the vocabulary, earlier ones only tied
    embeddings (see the Gemma test): the probe follows the weight, not the version."""
    for result in main_run[1]:
        assert result["vocab_parallel"] == (
            ["model.embed_tokens"] if result["embedding_sharded"] else []
        )


def test_the_captured_embedding_equals_the_unsharded_one_exactly(main_run):
    for result in main_run[1]:
        assert result["embedding_exact"] == [True, True, True]
        assert result["embedding_restored"]
        assert result.get("embedding_follows_weight", True)


def test_gemma_under_tp_matches_the_unsharded_model(gemma_run):
    """Gemma's scaled embedding returned a _MaskPartial DTensor: the first prefill raised a
    raw DTensor error, the next runner 'MaskBuffer has been materialized with conflicting
    data', and continuous batching failed every request."""
    backend, results = gemma_run
    for result in results:
        assert result["embedding_sharded"] and result["vocab_parallel"] == ["model.embed_tokens"]
        assert result["embedding_exact"] == [True, True, True]
        assert result["embedding_restored"] and result["embedding_follows_weight"]
        assert result["captured_diff"] < tolerance(backend)
        assert result["eager_diff"] < tolerance(backend)
        assert result["eager_graph"].count("all_reduce") == 5  # the embedding's too
        assert result["stock_after_diff"] < tolerance(backend)
        assert all(error is None for error, _ in result["cb_stock"])
        assert result["cb_breakgraph"] == result["cb_stock"]  # CB failed every request


def test_added_families_under_tp_match_or_are_refused(families_run):
    """Phi-3, OLMo-2, Granite, Gemma 3, OLMo-3, EXAONE 4, HyperCLOVA X, MiniMax-M2 and Laguna
    (query heads per layer) sharded by transformers:
    prefill equals the unsharded model; continuous batching gives the unsharded model's tokens
    and transformers' own TP tokens (where its TP continuous batching runs),
    except OLMo-2's and OLMo-3's, refused (their gathered k_proj gives every rank every key
    head, the paged cache holds a share: stock continuous batching failed every request,
    breakgraph's with a raw index_copy_ error). Cohere with qk-norm is refused by both entry
    points: its ``(heads, head_dim)`` norm weights stay whole while the heads are sharded, so
    the model's own forward failed (a raw size mismatch, stock continuous batching too)."""
    backend, results = families_run
    for result in results:
        for family in TP_FAMILIES:
            got = result[family]
            if family == "cohere":
                for key in ("refused", "cb_refused"):
                    assert "q_norm normalizes with a weight row for every head" in got[key], got
                continue
            assert got["detected"] and got["diff"] < tolerance(backend), (family, got)
            if family in GATHERS_KEYS:
                assert got["cb_breakgraph"].startswith("UnsupportedModelError: "), got
                assert "gathers every head on every rank" in got["cb_breakgraph"], got
                continue
            # the unsharded model's tokens; and transformers' own TP tokens where its TP
            # continuous batching runs (Gemma 3's fails every request with an empty error on
            # torch 2.10 and Python 3.10, CI's floor leg)
            assert all(error is None for error, _ in got["cb_full"]), (family, got)
            assert got["cb_breakgraph"] == got["cb_full"], (family, got)
            if all(error is None for error, _ in got["cb_stock"]):
                assert got["cb_breakgraph"] == got["cb_stock"], family
            else:
                assert family == "gemma3_text", (family, got)


def test_ranks_built_with_different_settings_raise_the_named_error_on_every_rank(settings_run):
    """Different max_prompts killed rank 0 in gloo (SIGABRT: an all-gather of another size),
    different warm-ups timed out in a raw recv, a pad_token_id said 'different buckets'."""
    backend, results = settings_run
    for result in results:
        for setting in ("max_prompts", "warmup", "pad_token_id", "token_buckets", "debug",
                        "single_prompt_graphs"):  # fmt: skip
            message = result[setting]
            assert message.startswith("RankMismatchError: PrefillRunner"), message
            assert f"different {setting} (" in message, message
        assert "buckets" not in result["pad_token_id"]
        assert result["after_diff"] < tolerance(backend)  # nothing ran: the ranks are in step
        assert result["numpy_diff"] < tolerance(backend)  # np.int64(4) on one rank, 4 on one


def test_heads_that_do_not_divide_by_the_tp_size_are_refused_up_front(settings_run):
    """3 KV heads over 2 ranks: PrefillRunner failed in its first warm-up with a raw view error
    ("shape '[1, 32, -1, 16]' is invalid"), which left the process group unusable, and
    enable_continuous_batching accepted the model."""
    for result in settings_run[1]:
        for entry in ("prefill", "cb"):
            message = result["uneven_heads"][entry]
            assert message.startswith("UnsupportedModelError: "), message
            assert "the model's layers have 3 key/value heads, which do not divide by 2" in message


def test_different_prompts_raise_the_named_error_on_every_rank(main_run):
    _, results = main_run
    for result in results:
        assert result["lengths_mismatch"] == "RankMismatchError"  # checked without debug
        assert result["over_largest"] == "RankMismatchError"
        assert result["ids_mismatch_debug"] == "RankMismatchError"  # debug mode: ids too
        # nothing ran, so the ranks are still in step
        assert result["after_mismatch_diff"] < tolerance(main_run[0])


def test_a_call_rejected_on_one_rank_raises_on_the_other(main_run):
    _, results = main_run
    assert results[0]["one_rank_invalid"] == "RankFailedError"
    assert results[1]["one_rank_invalid"] == "InputError"
    for call in ("one_rank_tensor", "one_rank_owned"):  # rank 0 used to wait for its timeout
        assert (results[0][call], results[1][call]) == ("RankFailedError", "InputError"), call
    # any error before the agreement, not only breakgraph's: rank 0's call ran with rank 1's
    # NEXT call (and so on, every call off by one) when rank 1's iterator of prompts raised
    assert (results[0]["one_rank_iterator"], results[1]["one_rank_iterator"]) == (
        "RankFailedError", "ValueError")  # fmt: skip
    assert (results[0]["one_rank_moved"], results[1]["one_rank_moved"]) == (
        "RankFailedError", "ReplayError")  # fmt: skip
    for result in results:
        assert result["after_errors_diff"] < tolerance(main_run[0])
        assert result["calls"] == results[0]["calls"]  # the same graphs replayed everywhere


def test_bucket_agreement_with_different_sizes(main_run):
    _, results = main_run
    for result in results:
        assert result["eager_different_sizes_diff"] < 1e-5  # both padded to bucket 16
        assert result["raise_different_sizes_diff"] < 1e-5
        calls, fallbacks = result["eager_stats"]
        assert calls == {8: 0, 16: 1}
        # one rank above the largest bucket: both ran eagerly together ...
        assert result["eager_one_over_diff"] < 1e-5
        assert fallbacks == {"larger than every bucket": 1}
        # ... or both raised
        assert result["raise_one_over_error"] == "InputError"
        assert result["different_buckets"] == "RankMismatchError"
        for setting in ("on_miss", "warmup", "max_padding_fraction", "pad_values"):
            message = result[f"different_{setting}"]
            assert message.startswith("RankMismatchError: BucketedRunner"), message
            assert f"different {setting} (" in message, message


def test_a_capture_failure_on_one_rank_raises_on_both(main_run):
    other, failing_rank = (result["capture_failure"] for result in main_run[1])
    assert failing_rank["error"] == "RuntimeError", failing_rank
    assert "injected failure on rank 1" in failing_rank["message"]
    assert any("RankFailedError" in note for note in failing_rank["notes"])
    assert other["error"] == "RankFailedError", other
    assert "capture of bucket 16 failed on rank(s) [1]" in other["message"]
    assert other["seconds"] < 20 and failing_rank["seconds"] < 20  # tp_timeout=6, not forever


def test_continuous_batching_under_tp_gives_the_tokens_of_eager_tp(cb_run):
    _, results = cb_run
    for result in results:
        assert result["breakgraph_tp"] == result["stock_tp"]  # transformers' TP CB, eager
        assert result["stock_tp"] == result["stock_unsharded"]
        assert all(len(tokens) == 6 for tokens in result["breakgraph_tp"])
        captures, replays, eager_steps, table = result["stats"]
        assert captures == 2 and replays > 0 and eager_steps == 0, table  # buckets 8 and 16
        assert set(result["breaks"].values()) == {2}, table  # attention of each layer
    assert results[0]["stats"][:3] == results[1]["stats"][:3]  # the same steps on both ranks
    assert results[0]["breakgraph_tp"] == results[1]["breakgraph_tp"]


def test_continuous_batching_under_tp_refuses_different_settings_on_every_rank(cb_run):
    _, results = cb_run
    for result in results:
        assert result["settings_mismatch"].startswith("RankMismatchError")
        assert "continuous-batching settings" in result["settings_mismatch"]
        # raised in transformers' generation thread: the requests fail with it
        assert "different continuous-batching steps" in result["step_mismatch"]
        assert result["manager_api"] == "None"  # no error
        assert result["options_mismatch"] == "RankMismatchError"
        assert result["compile_refused"].startswith("InputError")
        assert "compile is not supported under tensor parallelism" in result["compile_refused"]
        assert result["restored"]
        assert result["after_refusals"] == result["breakgraph_tp"]
        assert result["numpy_max_batch_tokens"] == "no error"  # np.int64(16) on one rank
        assert result["numpy_async"] == "no error"  # np.False_ on one rank, False on the other
    # a call refused on rank 0 alone (before its exchange): rank 1 is told, and raises
    refused, told = results[0], results[1]
    assert refused["one_rank_refuses_enable"].startswith("InputError: enable_continuous_batching")
    assert "query_buckets" in refused["one_rank_refuses_enable"]
    assert refused["one_rank_refuses_manager"].startswith("InputError")
    assert "use_cuda_graph" in refused["one_rank_refuses_manager"]
    for name in ("one_rank_refuses_enable", "one_rank_refuses_manager"):
        assert told[name].startswith("RankFailedError"), told[name]
        assert "rank(s) [0] failed this call before it ran" in told[name]


# -- in one process: the keep-alive after a failed NCCL capture ------------------------------------
def test_close_keeps_the_graphs_of_a_failed_nccl_capture_until_exit(monkeypatch):
    """After a failed NCCL capture step a runner's close() must not free its graphs (a device
    sync could wait for ever on collectives no peer joins); gloo and healthy groups free them."""
    import torch.distributed as dist

    from breakgraph import distributed
    from breakgraph.runner import BucketedRunner

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = distributed.RankGroup(timeout=30)
        runner = BucketedRunner(
            lambda x: x * 2, (4, 8), (torch.zeros(1, 3),), backend="emulated", ranks=ranks
        )
        graphs = [runner.graph(bucket) for bucket in runner.buckets]
        kept = len(distributed._KEPT_UNTIL_EXIT)
        # a healthy group: close() resets the graphs
        assert not ranks.keeps_memory
        # the state capture_step leaves after a failure with NCCL
        monkeypatch.setattr(ranks, "nccl", True)
        ranks._broken = "capture of bucket 4 failed on rank(s) [1]"
        assert ranks.keeps_memory
        runner.close()
        assert len(distributed._KEPT_UNTIL_EXIT) == kept + 1
        held = distributed._KEPT_UNTIL_EXIT[-1]
        assert {id(graph) for graph in held} == {id(g) for g in graphs}
        assert all(g.num_segments > 0 for g in graphs)  # not reset
        # capture_step's own keep is a snapshot: clearing the owner's dict keeps the values
        owner = {4: "graph"}
        ranks.keep_until_exit((owner, "buffer"))
        owner.clear()
        assert distributed._KEPT_UNTIL_EXIT[-1] == (("graph",), "buffer")
        ranks._broken = None
        ranks.close()
    finally:
        del distributed._KEPT_UNTIL_EXIT[kept:]
        dist.destroy_process_group()


def test_equal_settings_of_other_types_agree(monkeypatch):
    """agree_settings fingerprinted each value as given, so a setting that was np.int64(16) on
    one rank and 16 on another (or np.float32(0.5) and 0.5, np.bool_(True) and True, a list
    and a tuple of them) raised RankMismatchError for equal settings. Another rank is
    simulated by folding its exchanged values into this one's (the exchange is a MAX)."""
    import torch.distributed as dist

    from breakgraph import distributed
    from breakgraph.errors import RankMismatchError

    plain = {"max_prompts": 16, "scale": 0.5, "debug": True, "buckets": (16, 32), "timeout": 2.0,
             "dtype": torch.float32, "nested": {"a": [1, 2.5]}}  # fmt: skip
    numpy = {"max_prompts": np.int64(16), "scale": np.float32(0.5), "debug": np.bool_(True),
             "buckets": [np.int32(16), np.uint8(32)], "timeout": 2, "dtype": torch.float32,
             "nested": {"a": (np.int16(1), np.float64(2.5))}}  # fmt: skip
    different = dict(plain, max_prompts=np.int64(17), debug=1, scale=np.float32(0.1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = distributed.RankGroup(timeout=30)
        sent, other = [], []
        exchange = ranks._all_reduce_max

        def record(values):
            sent.append(values.clone())
            exchange(values)

        def with_the_other_rank(values):
            record(values)
            values.copy_(torch.maximum(values, other[len(sent) - 1]))

        def agree(here, there):
            """``here`` on this rank, against what ``there`` sends from the other one."""
            sent.clear()
            monkeypatch.setattr(ranks, "_all_reduce_max", record)
            ranks.agree_settings("Runner", there)
            other[:] = sent
            sent.clear()
            monkeypatch.setattr(ranks, "_all_reduce_max", with_the_other_rank)
            ranks.agree_settings("Runner", here)

        agree(plain, numpy)  # agrees, both ways
        agree(numpy, plain)
        with pytest.raises(RankMismatchError, match="different debug, max_prompts, scale "):
            agree(numpy, different)
        monkeypatch.undo()
        ranks.close()
    finally:
        dist.destroy_process_group()


def test_a_capture_step_on_a_broken_or_closed_group_does_not_run():
    """After a failed capture step, the next step ran (a warm-up or capture, with the model's
    collectives) before the exchange refused it; one that failed too replaced the first cause
    with its own and blamed this rank. On a closed group the whole step ran before "closed"."""
    import torch.distributed as dist

    from breakgraph import distributed
    from breakgraph.errors import RankFailedError

    ran = []

    def step(fail: bool):
        def run():
            ran.append(fail)
            if fail:
                raise ValueError("the first failure")
            return 3
        return run

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = distributed.RankGroup(timeout=30)
        assert repr(ranks) == "RankGroup(rank 0 of [0], timeout=30 s)"
        assert ranks.capture_step("warm-up of bucket 4", step(False)) == 3
        with pytest.raises(ValueError, match="the first failure"):
            ranks.capture_step("warm-up of bucket 8", step(True))
        for fail in (False, True):
            with pytest.raises(RankFailedError, match="warm-up of bucket 8 failed on rank"):
                ranks.capture_step("capture of bucket 4", step(fail))
        assert ran == [False, True]
        assert "broken: warm-up of bucket 8 failed" in repr(ranks)
        ranks.close()
        closed = distributed.RankGroup(timeout=30)
        closed.close()
        with pytest.raises(RankFailedError, match="closed by close"):
            closed.capture_step("capture of bucket 4", step(False))
        with pytest.raises(RankFailedError, match="closed by close"):
            closed.agree(4)
        assert ran == [False, True]
    finally:
        dist.destroy_process_group()


def test_a_rank_group_dropped_without_close_destroys_its_gloo_group():
    """A runner (its RankGroup) deleted without close() left the gloo group the RankGroup
    created in torch.distributed's registry for good, with its connections to the other ranks:
    one more group per runner built and dropped. A collected RankGroup hands its group on (a
    collection runs on any thread, maybe inside torch.distributed's own registry code), and the
    next RankGroup made or closed destroys it; close() destroys its own, once."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from breakgraph import distributed
    from breakgraph.runner import BucketedRunner

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        groups = len(distributed_c10d._world.pg_map)
        for _ in range(3):
            ranks = distributed.RankGroup(timeout=30)
            runner = BucketedRunner(
                lambda x: x * 2, (4,), (torch.zeros(1, 3),), backend="emulated", ranks=ranks
            )
            fresh = torch.randn(3, 3)
            assert torch.equal(runner(fresh), fresh * 2)
            del ranks, runner
            gc.collect()
            assert len(distributed._DROPPED_GROUPS) == 1  # not destroyed by the collection
        assert len(distributed_c10d._world.pg_map) == groups + 1
        closed = distributed.RankGroup(timeout=30)
        assert not distributed._DROPPED_GROUPS
        closed.close()
        closed.close()
        assert len(distributed_c10d._world.pg_map) == groups
        del closed  # its finalizer already ran: nothing is destroyed twice
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_doubler(monkeypatch):
    """A one-rank gloo group and a ``BucketedRunner`` of ``x * 2`` (bucket 4) with ranks,
    whose failure reports to the other ranks are recorded: yields ``(ranks, runner,
    reported)``; everything is closed and the process group destroyed afterwards."""
    import torch.distributed as dist

    from breakgraph import distributed
    from breakgraph.runner import BucketedRunner

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = distributed.RankGroup(timeout=30)
        runner = BucketedRunner(
            lambda x: x * 2, (4,), (torch.zeros(1, 3),), backend="emulated", ranks=ranks
        )
        reported = []
        monkeypatch.setattr(ranks, "report_failure", lambda: reported.append("failed"))
        yield ranks, runner, reported
        runner.close()
        ranks.close()
    finally:
        dist.destroy_process_group()


def test_a_runner_call_interrupted_before_its_exchange_tells_the_other_ranks(monkeypatch):
    """BucketedRunner told the other ranks of an InputError before the call's exchange, but not
    of anything else (an interrupt while it read the inputs): the rank raised without taking
    part, and the others paired the call with its next one, every later call off by one (as
    PrefillRunner did; fixed there for any exception)."""

    def interrupted(inputs):
        raise KeyboardInterrupt

    with one_rank_doubler(monkeypatch) as (_, runner, reported):
        monkeypatch.setattr(runner.inputs, "size_of", interrupted)
        with pytest.raises(KeyboardInterrupt):
            runner(torch.randn(2, 3))
        assert reported == ["failed"]
        monkeypatch.undo()
        fresh = torch.randn(2, 3)
        assert torch.equal(runner(fresh), fresh * 2)


def test_a_decide_of_a_size_that_is_not_a_size_tells_the_other_ranks(monkeypatch):
    """runner.decide("3") (or a negative size) with ranks: refused here, and the other ranks
    told (they raise RankFailedError) instead of waiting for this call's exchange; a bad
    owned= is told too, before the size is read."""
    from breakgraph.errors import InputError

    with one_rank_doubler(monkeypatch) as (_, runner, reported):
        for bad in ("3", -1):
            with pytest.raises(InputError, match="BucketedRunner.decide: size must be an int"):
                runner.decide(bad)
        with pytest.raises(InputError, match="owned must be True or False"):
            runner(torch.randn(2, 3), owned="no")
        assert reported == ["failed"] * 3
        fresh = torch.randn(2, 3)
        assert torch.equal(runner(fresh), fresh * 2)


def test_a_fingerprint_that_is_not_an_int64_is_refused_on_every_rank(monkeypatch):
    """BucketedRunner(ranks=...)(x, fingerprint=f) with ``f`` not an int64 on one rank (2**64,
    None, a float) raised numpy's raw OverflowError or TypeError there before the call's
    exchange, unseen by the others: on 2 ranks the other rank's call paired with this rank's
    NEXT call and returned its all-reduce of other inputs (wrong results, every call after off
    by one). Now InputError, after telling the others (RankFailedError there); numpy's ints
    pass."""
    import numpy as np

    from breakgraph.errors import InputError

    with one_rank_doubler(monkeypatch) as (ranks, runner, reported):
        for bad in (2**64, -(2**63), None, 1.5, "7", True):
            with pytest.raises(InputError, match="fingerprint must be an int of int64"):
                runner(torch.randn(2, 3), fingerprint=bad)
        assert reported == ["failed"] * 6
        with pytest.raises(InputError, match="size must be an int of int64"):
            ranks.agree(2**63, 0)
        monkeypatch.undo()
        for good in (np.int64(5), 2**63 - 1, -(2**63) + 1):
            fresh = torch.randn(2, 3)
            assert torch.equal(runner(fresh, fingerprint=good), fresh * 2)


@pytest.mark.parametrize("size", [2, 6], ids=["replay", "eager"])
def test_a_runner_call_that_fails_after_its_exchange_breaks_the_rank_group(size):
    """A BucketedRunner call that raised after the ranks agreed to run it (a break of its replay,
    or its eager forward) left the group usable: the ranks it left waiting in the call's
    collectives paired their next calls with its own and failed with raw gloo errors. Now the
    error has a note and every later call raises RankFailedError at once."""
    import torch.distributed as dist

    import breakgraph
    from breakgraph import distributed
    from breakgraph.errors import RankFailedError
    from breakgraph.runner import BucketedRunner

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = distributed.RankGroup(timeout=30)
        failing = [False]

        @breakgraph.eager_on_graph
        def interrupted(x):
            if failing[0]:
                raise KeyboardInterrupt("injected")
            return x

        runner = BucketedRunner(
            lambda x: interrupted(x * 2) + 1, (4,), (torch.zeros(1, 3),), backend="emulated",
            ranks=ranks,
        )  # fmt: skip
        fresh = torch.randn(size, 3)
        assert torch.equal(runner(fresh), fresh * 2 + 1)
        failing[0] = True
        with pytest.raises(KeyboardInterrupt) as raised:
            runner(torch.randn(size, 3))
        assert "BucketedRunner failed on rank 0 of [0] mid-call" in raised.value.__notes__[0]
        failing[0] = False
        with pytest.raises(RankFailedError, match="BucketedRunner failed mid-call on rank 0"):
            runner(torch.randn(size, 3))
        runner.close()
        ranks.close()
    finally:
        dist.destroy_process_group()


def test_a_capture_step_interrupted_on_one_rank_tells_the_others(monkeypatch):
    """capture_step caught Exception only: a KeyboardInterrupt in a warm-up or capture left
    without the failure flag, and a peer blocked in a collective with this rank (released by
    the model group's timeout) found no answer at the status exchange and raised gloo's raw
    'Connection closed by peer', its note blaming itself (2 ranks, by hand). Now the
    interrupted rank reports the failure, like any error, with a note, and stays broken."""
    import torch.distributed as dist

    from breakgraph import distributed
    from breakgraph.errors import RankFailedError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = distributed.RankGroup(timeout=30)
        sent = []
        exchange = ranks._exchange
        monkeypatch.setattr(ranks, "_exchange", lambda *a: sent.append(a) or exchange(*a))

        def interrupted():
            raise KeyboardInterrupt("interrupted")

        with pytest.raises(KeyboardInterrupt) as raised:
            ranks.capture_step("capture of bucket 4", interrupted)
        assert sent == [(0, 0, distributed._PRIMARY)]
        assert "capture of bucket 4 failed on rank 0 of [0]" in raised.value.__notes__[0]
        with pytest.raises(RankFailedError, match="capture of bucket 4 failed on rank"):
            ranks.agree(1, 0)
        monkeypatch.undo()
        ranks.close()
    finally:
        dist.destroy_process_group()


def test_an_exchange_that_lost_its_peer_says_so_not_no_answer_within_the_timeout(monkeypatch):
    """A RankFailedError raised at once because the peer closed its group (gloo's "Connection
    closed by peer") said "no answer from every rank within 30 s". It now says the exchange
    failed before the timeout, in gloo's words, and that the peer closed its RankGroup or
    exited; a failure at the timeout keeps "no answer", and later calls repeat the reason."""
    import types

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from breakgraph import distributed
    from breakgraph.errors import RankFailedError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for took, expected in ((0.0, r"failed after 0.0 s, before the 30 s timeout \(\[pair.cc"
                                r":553\] Connection closed by peer \[127.0.0.1\]:12345\).*"
                                r"another rank closed its RankGroup"),
                               (30.0, r"no answer from every rank within 30 s")):  # fmt: skip
            ranks = distributed.RankGroup(timeout=30)
            clock = iter((100.0, 100.0 + took))
            monkeypatch.setattr(distributed, "time", types.SimpleNamespace(monotonic=lambda: next(
                clock)))  # fmt: skip

            def peer_gone(*args, **kwargs):  # gloo's words (torch 2.11) once the peer closed
                raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:12345. "
                                   "This is typically caused by a remote worker crashing.")

            monkeypatch.setattr(distributed_c10d, "all_reduce", peer_gone)
            with pytest.raises(RankFailedError, match=expected):
                ranks.agree(4)
            monkeypatch.undo()
            with pytest.raises(RankFailedError, match=expected.split(".*")[0] + " earlier;"):
                ranks.agree(4)  # broken: the same reason, at once
            ranks.close()
    finally:
        dist.destroy_process_group()


def test_a_capture_step_whose_peer_never_answers_keeps_its_graphs_with_nccl(monkeypatch):
    """A step that succeeded here, then no answer at the status exchange (a peer exited
    mid-capture): with NCCL this rank's captured collectives wait for that peer for ever, so
    the step's graphs and buffers must be kept until exit, as after a failed step."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from breakgraph import distributed
    from breakgraph.errors import RankFailedError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    kept = len(distributed._KEPT_UNTIL_EXIT)
    try:
        ranks = distributed.RankGroup(timeout=30)
        monkeypatch.setattr(ranks, "nccl", True)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)

        def peer_gone(*args, **kwargs):  # what gloo raises once the peer's process ended
            raise RuntimeError("Connection closed by peer [127.0.0.1]:12345")

        monkeypatch.setattr(distributed_c10d, "all_reduce", peer_gone)
        with pytest.raises(RankFailedError, match=r"before the 30 s timeout \(Connection clo"):
            ranks.capture_step("capture of bucket 4", lambda: "output", keep=("graph", "buffer"))
        assert ranks.keeps_memory
        assert distributed._KEPT_UNTIL_EXIT[kept:] == [("graph", "buffer")]
        monkeypatch.undo()
        ranks.close()
    finally:
        del distributed._KEPT_UNTIL_EXIT[kept:]
        dist.destroy_process_group()


def test_a_prefill_that_fails_on_one_rank_mid_call_breaks_the_group_on_both(tmp_path):
    """Rank 1 raised inside a replay, after the ranks agreed to run the call: rank 0 got gloo's
    raw timeout from its replay, and every later call on both ranks paired in the agreement and
    failed with raw gloo errors in the model's collectives ("Application timeout caused pair
    closure", "Connection closed by peer"). Now the failing rank's error says what happened,
    the other's is RankFailedError, and later calls raise RankFailedError at once."""
    ranks = launch(("replay_failure",), "emulated", str(tmp_path))["replay_failure"]
    check_one_rank_failed_mid_call(ranks, "PrefillRunner.prefill")


def test_a_cb_step_that_fails_on_one_rank_breaks_the_group_on_both(tmp_path):
    """The same in a continuous-batching step: the next manager is refused on both ranks (it
    captured and served, every step failing with raw gloo errors)."""
    ranks = launch(("cb_step_failure",), "emulated", str(tmp_path))["cb_step_failure"]
    told, failed = ranks
    assert told["call 0"] == "ok" and failed["call 0"] == "ok", ranks
    for result in ranks:  # transformers fails the requests of the failed step (no raise)
        assert result["seconds 1"] < 20, result
        assert result["call 2"].startswith("RankFailedError: RankGroup: "), result
        assert "failed mid-call on" in result["call 2"], result
        assert result["seconds 2"] < 5, result  # refused at once, not after a timeout
    assert "failed mid-call on rank 1" in failed["call 2"]
    assert "failed mid-call on another rank" in told["call 2"]


def check_one_rank_failed_mid_call(ranks: list, what: str) -> None:
    told, failed = ranks
    assert told["call 0"] == "ok" and failed["call 0"] == "ok", ranks
    assert failed["call 1"] == "KeyboardInterrupt: injected on rank 1", failed
    assert any(f"{what} failed on rank 1 of [0, 1] mid-call" in n for n in failed["notes 1"])
    assert told["call 1"].startswith(f"RankFailedError: {what}: a collective failed on rank 0")
    assert "another rank failed during this call" in told["call 1"], told
    for result in ranks:
        assert result["seconds 1"] < 20, result
        assert result["call 2"].startswith("RankFailedError: RankGroup: "), result
        assert "cannot be used any more" in result["call 2"], result
        assert result["seconds 2"] < 5, result  # refused at once, not after a timeout


def test_a_rank_group_that_a_peer_never_builds_raises_rank_failed(tmp_path):
    result = launch(("unbuilt",), "emulated", str(tmp_path))["unbuilt"][0]
    assert result["error"].startswith("RankFailedError: RankGroup: not every rank"), result
    assert "Build it on every rank at the same point" in result["error"]
    assert result["seconds"] < 4.0


def test_a_rank_that_dies_fails_the_launch_with_its_signal_and_stack(tmp_path):
    with pytest.raises(RankDied) as died:
        launch(("die",), "emulated", str(tmp_path))
    report = str(died.value)
    assert "exit codes {1: -11}" in report  # SIGSEGV
    assert "rank 0 answered (die)" in report
    assert "Fatal Python error: Segmentation fault" in report  # faulthandler's dump
    assert "scenario_die" in report  # the dying rank's Python stack


def test_a_launch_that_loses_a_rank_runs_once_more_in_a_fresh_folder(monkeypatch, tmp_path):
    """The relaunch itself (the processes' side is the test above): one death, a warning
    and the second launch's results; two deaths raise."""
    launches = []

    def launch_losing(deaths):
        def fake(scenarios, backend, path, env=None):
            launches.append(path)
            if len(launches) <= deaths:
                raise RankDied(f"rank(s) died, exit codes {{1: -11}} {'x' * 9000}")
            return {"main": ("emulated", [{}, {}])}

        return fake

    monkeypatch.setattr(sys.modules[__name__], "launch", launch_losing(1))
    with pytest.warns(RankDiedWarning, match=r"launched \('main',\) again: .*exit codes") as caught:
        results = launch_again_if_a_rank_dies(("main",), "emulated", str(tmp_path))
    assert results == {"main": ("emulated", [{}, {}])}
    assert launches == [str(tmp_path), os.path.join(tmp_path, "again")]
    assert len(caught) == 1 and len(str(caught[0].message)) < 7000  # the report, cut
    launches.clear()
    monkeypatch.setattr(sys.modules[__name__], "launch", launch_losing(2))
    with pytest.warns(RankDiedWarning), pytest.raises(RankDied):
        launch_again_if_a_rank_dies(("main",), "emulated", str(tmp_path))
    assert len(launches) == 2  # not a third time


def test_bench_tp_smoke_writes_every_variant(tp_runs):
    if "bench" not in tp_runs:
        pytest.skip("bench_tp --smoke is a CPU run (gloo, emulated)")
    _, results = scenario_run(tp_runs, "bench")
    data = results[0]["data"]
    assert data["meta"]["smoke"] and data["meta"]["world_size"] == 2
    rows = data["tp"]["rows"]
    assert [row["workload"].split()[0] for row in rows] == ["8", "16", "32", "64", "batch"]
    for row in rows:
        for variant in ("tp_eager", "tp_breakgraph", "tp_bg_eager_ar"):
            assert row[variant]["median_ms"] > 0
    assert data["tp"]["skipped"] == {
        "tp_full_graph": "captured attention needs CUDA (FlashAttention)"
    }
    for by_variant in data["tp"]["correctness_vs_tp_eager"].values():
        for variant in ("tp_breakgraph", "tp_bg_eager_ar"):
            assert by_variant[variant]["max_abs_diff"] < 1e-4
    assert len(data["tp1"]["rows"]) == len(rows)
    assert len(data["summary"]["table"]) == len(rows) and data["summary"]["targets"] == {}
    assert "max |logits - TP eager|" in results[0]["printed"]
    assert results[1]["data"] is None  # rank 1 returns nothing, writes nothing


def test_tensor_parallel_group_names_its_caller_and_refuses_what_is_not_a_module(monkeypatch):
    """``tensor_parallel_group("model")`` was a bare ``AttributeError`` ('str' object has no
    attribute 'parameters'), and a model sharded on a 2-D mesh raised "breakgraph: ...",
    naming no function the user called (PrefillRunner, enable_continuous_batching)."""
    from torch.distributed import tensor as dtensor

    from breakgraph import InputError
    from breakgraph.distributed import tensor_parallel_group

    with pytest.raises(InputError, match="tensor_parallel_group: model must be a torch.nn.Mod"):
        tensor_parallel_group("model")

    class Sharded:  # a DTensor parameter on a 2-D mesh (FSDP x TP), without a process group
        device_mesh = type("Mesh", (), {"ndim": 2})()

    class Model(torch.nn.Module):
        def parameters(self, recurse=True):
            return iter([Sharded()])

    monkeypatch.setattr(dtensor, "DTensor", Sharded)
    with pytest.raises(InputError, match=r"PrefillRunner: parameters are sharded on a 2-D dev"):
        tensor_parallel_group(Model(), "PrefillRunner")


def test_the_graph_mixing_refusal_names_the_runner_and_its_setting(monkeypatch):
    """With ``NCCL_GRAPH_MIXING_SUPPORT=0``, ``PrefillRunner(tp_collectives='eager')`` was
    refused with "breakgraph: eager collectives ...", naming neither the runner nor the
    setting to change."""
    from types import SimpleNamespace

    from breakgraph import InputError
    from breakgraph.distributed import RankGroup

    monkeypatch.setenv("NCCL_GRAPH_MIXING_SUPPORT", "0")
    nccl = SimpleNamespace(nccl=True)  # the check reads only whether the group is NCCL's
    RankGroup.check_graph_mixing(nccl, False)  # captured collectives: nothing to refuse
    who = "PrefillRunner(tp_collectives='eager')"
    with pytest.raises(InputError, match=r"^PrefillRunner\(tp_collectives='eager'\): eager col"):
        RankGroup.check_graph_mixing(nccl, True, who)
