"""Continuous batching: breakgraph against what a transformers user would run instead.

On an H200, once per transformers release (about 6 minutes each; the script prints its
estimate first and skips whole models that would run past ``--budget-s``)::

    bash scripts/gpu_check.sh cb_bench "$OUT/cb-5.17.json"          # the image's transformers
    bash scripts/gpu_check.sh cb_bench "$OUT/cb-5.24.json" WHEEL    # a carried 5.24 wheel

(``cb_bench`` runs ``python -m benchmarks.bench_cb --out FILE``), and on any machine in about
20 seconds (tiny model, CPU, fp32, the emulated backend; it fails unless every variant's
tokens equal stock transformers' exactly)::

    python -m benchmarks.bench_cb --smoke --out cb-smoke.json

Workload (issue 23): ``--prompts`` random prompts of ``--min-len``..``--max-len`` tokens,
submitted at once to one manager (``init_continuous_batching``), ``--new-tokens`` greedy
tokens each, no EOS, prefix sharing off; every variant uses the same
``ContinuousBatchingConfig`` (``--block-size``, ``--num-blocks``, ``--max-batch-tokens``).

Variants:

  stock_sdpa          transformers as shipped without flash_attn: ``sdpa`` with a dense
                      mask, no graphs, synchronous steps (its default there)
  stock_graphs        stock_sdpa with ``use_cuda_graph=True``: transformers' own whole-step
                      graphs (one per padded query x KV x max key length, captured lazily
                      while serving), synchronous
  stock_graphs_async  the same with ``use_async_batching=True`` (CUDA only)
  breakgraph          ``enable_continuous_batching`` with its defaults: one graph per query
                      bucket (each layer's paged attention an eager break) and one lm_head
                      graph per logits-row bucket, all captured when the manager is created;
                      asynchronous steps on CUDA
  breakgraph_sync     breakgraph with ``use_async_batching=False``
  breakgraph_pow2     breakgraph with the earlier query buckets (powers of two from 8)
  breakgraph_breaks   breakgraph with ``decode_graphs=False``: pure-decode steps through the
                      query-token graphs and their attention breaks (before the decode graphs)
  breakgraph_compiled breakgraph with ``compile=True``: the decoder under ``torch.compile``,
                      so every graph holds Inductor's fused kernels (compiled when the first
                      round's manager captures; *manager s* holds that compile)
  breakgraph_autotuned breakgraph with ``compile={"mode": "max-autotune-no-cudagraphs"}``:
                      Inductor times candidate kernels for each GEMM (a longer compile)
  breakgraph_unsplit  breakgraph with ``paged_decode`` as before the flash-decoding split:
                      one program per sequence and key head reads all of its keys, 64 a block
  breakgraph_lists    breakgraph with ``max_blocks_per_request=0``: pure-decode steps carry
                      transformers' per-key index lists, as before breakgraph took its block
                      table (``integrations/transformers/block_table.py``)
  breakgraph_tx_fill  breakgraph with transformers' own ``fill_block_table``: each request's
                      row of the block table written with small tensors, as before breakgraph
                      wrote host tables through numpy
  breakgraph_tx_rows  breakgraph with transformers' own ``extend_read_and_write_indices``: each
                      step's cache rows built as Python lists (one int per key of every request
                      and layer group), as before breakgraph computed them in numpy
                      (``integrations/transformers/index_rows.py``)
  breakgraph_cold_kernels  breakgraph without ``paged_decode.warm_up`` at the manager's
                      creation: a decode kernel compiles inside the first step that needs it
                      (as before; compare the first rounds, each variant in a process of its
                      own with an empty ``TRITON_CACHE_DIR``)
  breakgraph_breaks_keys2048  breakgraph_breaks with breaks splitting their sequences' keys
                      from 2048 keys (``paged_decode.BREAK_SPLIT_FROM_KEYS`` is 4096): session
                      36's rule for heads of 256, which lost in continuous batching (session
                      38's run named the two ``breakgraph_breaks`` and ``..._keys4096``)
  generate            ``model.generate`` one prompt at a time on a few median-length prompts
                      (tokens/s measured, the queue's time to first token extrapolated)

The three shapes issue 23 asks for (``qwen2.5-3b-12l``, ``llama3-8b-4l``, ``mixtral-1k-8l``) run
the first five variants; the shapes measured since issue 14 (``llama-1b``, ``qwen3-0.6b``,
``qwen3-moe``) run stock_sdpa, breakgraph and breakgraph_sync; the sliding-window shapes
(``gemma3-1b``, ``gpt-oss-20b-4l``) stock_sdpa, stock_graphs, breakgraph, breakgraph_breaks and
breakgraph_tx_rows (``--variants`` replaces every list). ``breakgraph`` takes ``--rounds`` turns
with the variants in ``--repeat`` (median round reported, with the spread); the others run once
(their noise cannot move a 2x or 5x target). stock_graphs* capture while serving, so they serve
a cold pass first (``--cold-new-tokens`` each; captures the keys) and report the warm pass with
fresh prompts of the same lengths; breakgraph has captured everything before serving.

Dropped since transformers 5.19: ``whole_graph`` (transformers' whole-step graphs around
torch's varlen kernel under a custom attention key). From 5.19 CB refuses a custom attention
key unless its name says "flash" (and then looks it up as a flash kernel and turns on
flash_attn's block-table decode path); from 5.24 the model calls ``cache.update`` itself.
Keeping it would need a benchmark-side replacement of ``switch_to_cb_friendly_attn`` and
three attention signatures that only a GPU can check; stock_graphs is transformers' own
whole-step design on what a user without flash_attn has. Its last numbers (5.17) are in
``docs/results/h200-cb.json``.

Reported per variant and pass: tokens/s, time to first token (mean, p50, p90 from
submission), steps and wall ms per step, transformers' host scheduling ms per step
(``prepare_next_batch``), graphs and capture seconds; where breakgraph's (or stock eager's)
forward is wrapped: its host ms per step and, on CUDA, its device span per step (CUDA events
around the forward) and the share of the pass the device spent inside forwards
(``gpu_forward_fraction``: bubbles inside a forward count as busy, transformers' sampling and
waits between forwards as idle). Pure-decode steps come from the requests' token timestamps:
between the last request's first token and the first request's last token every step decodes
one token of every request; their median interval is the decode step's wall time, set against
its HBM floor (:mod:`benchmarks.roofline`), as is the whole pass against the workload's floor.
How each number is taken, and the transformers internals read to take it (breakgraph reads
none of them), is in :mod:`benchmarks.cb_instruments`; they are probed before anything runs.
``--prep-lists`` also splits out of the scheduling time transformers' conversions of its
long index lists to tensors (``lists``; it wraps ``torch.tensor`` for the run, so it is off by
default)::

    python -m benchmarks.bench_cb --prep-lists --models mixtral-1k-8l \
        --variants breakgraph,breakgraph_sync --rounds 1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
import types

import torch

if __package__ in (None, ""):  # python benchmarks/bench_cb.py: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transformers  # noqa: E402
from breakgraph.integrations.transformers import block_table as block_table_module  # noqa: E402
from breakgraph.integrations.transformers import cb_step as cb_step_module  # noqa: E402
from breakgraph.integrations.transformers import compat, enable_continuous_batching  # noqa: E402
from breakgraph.integrations.transformers import index_rows as index_rows_module  # noqa: E402
from breakgraph.integrations.transformers import paged_decode as paged_decode_module  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from benchmarks import roofline  # noqa: E402
from benchmarks.cb_instruments import (  # noqa: E402
    INTERNALS,
    GraphLog,
    StepCounter,
    StepTimer,
    decode_window,
    require_internals,
)
from benchmarks.environment import environment  # noqa: E402
from benchmarks.families import (  # noqa: E402
    CB_FAMILIES,
    FAMILIES,
    HELD_OUT_FAMILIES,
    SMOKE_FAMILIES,
    Family,
    config_summary,
    make_model,
    stock_attention,
)
from breakgraph.patches import PatchSet  # noqa: E402

SCHEMA = 2  # the JSON layout (1: the 5.17-only layout with paged_sdpa and whole_graph)


# -- models and variants ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    what: str
    breakgraph: bool
    use_cuda_graph: bool | None = None  # stock variants only (breakgraph decides its own)
    use_async_batching: bool | None = None
    pow2: bool = False  # breakgraph's earlier query buckets
    decode_graphs: bool = True  # breakgraph's pure-decode graphs (off: every layer a break)
    compile: bool | str = False  # breakgraph's decoder under torch.compile (a str: its mode)
    decode_splits: bool = True  # paged_decode's split and block (off: one program, 64 keys)
    max_blocks_per_request: int | None = None  # 0: no block table (index lists every step)
    numpy_fill: bool = True  # breakgraph writes block tables through numpy (off: transformers)
    numpy_rows: bool = True  # breakgraph computes index lists' rows in numpy (off: transformers)
    warm_kernels: bool = True  # decode kernels compiled when the manager is created (off: later)
    break_split_keys: int | None = None  # a break splits from this many keys (None: the rule's)
    needs_cuda: str = ""  # why it cannot run on the CPU (empty: it can)


VARIANTS = {
    v.name: v
    for v in (
        Variant("stock_sdpa", "transformers without flash_attn: sdpa, dense mask, no graphs",
                False),  # fmt: skip
        Variant("stock_graphs", "stock_sdpa + use_cuda_graph=True (whole-step graphs), sync",
                False, use_cuda_graph=True, use_async_batching=False),  # fmt: skip
        Variant("stock_graphs_async", "stock_sdpa + use_cuda_graph=True, async batching", False,
                use_cuda_graph=True, use_async_batching=True,
                needs_cuda="async batching runs on CUDA streams"),  # fmt: skip
        Variant("breakgraph", "enable_continuous_batching defaults (async on CUDA)", True),
        Variant("breakgraph_sync", "breakgraph with use_async_batching=False", True,
                use_async_batching=False),  # fmt: skip
        Variant("breakgraph_pow2", "breakgraph with query buckets 8, 16, 32, ... (earlier)", True,
                pow2=True),  # fmt: skip
        Variant("breakgraph_breaks", "breakgraph with decode_graphs=False (a break per layer in "
                "pure-decode steps too, as before)", True, decode_graphs=False),  # fmt: skip
        Variant("breakgraph_compiled", "breakgraph with compile=True (the decoder under "
                "torch.compile: Inductor's fused kernels in every graph)", True,
                compile=True),  # fmt: skip
        Variant("breakgraph_autotuned", "breakgraph with compile={'mode': "
                "'max-autotune-no-cudagraphs'} (Inductor picks each GEMM's kernel by timing)",
                True, compile="max-autotune-no-cudagraphs"),  # fmt: skip
        Variant("breakgraph_unsplit", "breakgraph with paged_decode as before (one program per "
                "sequence and key head, blocks of 64 keys)", True,
                decode_splits=False),  # fmt: skip
        Variant("breakgraph_lists", "breakgraph with max_blocks_per_request=0 (pure-decode "
                "steps with per-key index lists, as before)", True,
                max_blocks_per_request=0),  # fmt: skip
        Variant("breakgraph_tx_fill", "breakgraph with transformers' own fill_block_table (the "
                "block table filled request by request with small tensors, as before)", True,
                numpy_fill=False),  # fmt: skip
        Variant("breakgraph_tx_rows", "breakgraph with transformers' own "
                "extend_read_and_write_indices (each step's cache rows built as Python lists, "
                "one int per key, as before)", True, numpy_rows=False),  # fmt: skip
        Variant("breakgraph_cold_kernels", "breakgraph without compiling the decode kernels "
                "when the manager is created (each compiles in the first step that needs it, as "
                "before)", True, warm_kernels=False),  # fmt: skip
        Variant("breakgraph_breaks_keys2048", "breakgraph_breaks with breaks splitting from "
                "2048 keys (session 36's rule for heads of 256)", True, decode_graphs=False,
                break_split_keys=2048),  # fmt: skip
    )
}
GENERATE = "generate"
STOCK = ("stock_sdpa", "stock_graphs", "stock_graphs_async")
NEW_SHAPE_VARIANTS = ("stock_sdpa", "stock_graphs", "stock_graphs_async", "breakgraph",
                      "breakgraph_sync")  # fmt: skip
CONTINUITY_VARIANTS = ("stock_sdpa", "breakgraph", "breakgraph_sync")
SLIDING_VARIANTS = ("stock_sdpa", "stock_graphs", "breakgraph", "breakgraph_breaks",
                    "breakgraph_tx_rows")  # fmt: skip
SMOKE_VARIANTS = ("stock_sdpa", "stock_graphs", "stock_graphs_async", "breakgraph",
                  "breakgraph_sync", "breakgraph_pow2", "breakgraph_breaks")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CBModel:
    family: Family
    variants: tuple[str, ...]  # the default variants (``--variants`` replaces them)


MODELS = {
    **{n: CBModel(CB_FAMILIES[n], NEW_SHAPE_VARIANTS)
       for n in ("qwen2.5-3b-12l", "llama3-8b-4l", "mixtral-1k-8l")},  # fmt: skip
    "llama-1b": CBModel(FAMILIES["llama-1b"], CONTINUITY_VARIANTS),
    "qwen3-0.6b": CBModel(FAMILIES["qwen3-0.6b"], CONTINUITY_VARIANTS),
    "qwen3-moe": CBModel(CB_FAMILIES["qwen3-moe"], CONTINUITY_VARIANTS),
    # held out from the CB shapes: heads of 256 (the break split rule's wide case), MQA
    "gemma-2b": CBModel(FAMILIES["gemma-2b"], CONTINUITY_VARIANTS),
    # held out: the whole Llama-3-8B (32 layers) that llama3-8b-4l cuts to four
    "llama3-8b": CBModel(CB_FAMILIES["llama3-8b"], NEW_SHAPE_VARIANTS),
    # held out: the whole Qwen2.5-3B (36 layers) and a whole many-expert MoE (Qwen3-30B-A3B)
    "qwen2.5-3b": CBModel(CB_FAMILIES["qwen2.5-3b"], NEW_SHAPE_VARIANTS),
    "qwen3-30b-a3b": CBModel(CB_FAMILIES["qwen3-30b-a3b"], NEW_SHAPE_VARIANTS),
    # held out: sliding-window layers (pure-decode graphs read their rings in place, the breaks
    # as before: breakgraph_breaks; the cache rows in numpy, transformers' own lists as before:
    # breakgraph_tx_rows): a whole Gemma-3-1B, and gpt-oss-20b cut to 4 layers
    "gemma3-1b": CBModel(CB_FAMILIES["gemma3-1b"], SLIDING_VARIANTS),
    "gpt-oss-20b-4l": CBModel(HELD_OUT_FAMILIES["gpt-oss-20b-4l"], SLIDING_VARIANTS),
    **{n: CBModel(f, SMOKE_VARIANTS) for n, f in SMOKE_FAMILIES.items()},
}
DEFAULT_MODELS = ("qwen2.5-3b-12l", "llama3-8b-4l", "mixtral-1k-8l", "llama-1b", "qwen3-0.6b",
                  "qwen3-moe")  # fmt: skip
CONFIGS = {name: m.family.config for name, m in MODELS.items()}  # (benchmarks.cb_agreement)

#: Rough generated tokens/s on the H200 at the default workload, for the time estimate only
#: (from docs/results/h200-cb.json and issue 23's runs, rounded down).
ESTIMATE_TOK_S = {"stock_sdpa": 750, "stock_graphs": 1300, "stock_graphs_async": 1500,
                  "breakgraph": 4000, "breakgraph_sync": 3000, "breakgraph_pow2": 4000,
                  "breakgraph_breaks": 4000, "breakgraph_compiled": 4000,
                  "breakgraph_autotuned": 4000, "breakgraph_unsplit": 4000,
                  "breakgraph_lists": 4000,
                  "breakgraph_tx_fill": 4000, "breakgraph_tx_rows": 4000,
                  "breakgraph_cold_kernels": 4000,
                  "breakgraph_breaks_keys2048": 4000}  # fmt: skip
ESTIMATE_FIXED_S = {"model": 4.0, "manager": 1.5, GENERATE: 6.0}


# -- workload ---------------------------------------------------------------------------------
def make_prompts(count, min_len, max_len, vocab, seed) -> list[list[int]]:
    """Random prompts; their lengths depend on ``count`` and the bounds only (not ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(
        min_len, max_len + 1, (count,), generator=torch.Generator().manual_seed(0)
    )
    return [torch.randint(0, vocab - 1, (int(n),), generator=generator).tolist() for n in lengths]


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def serve(manager, prompts, new_tokens) -> tuple[list, float, list]:
    """Submit every prompt at once; (tokens per prompt, seconds, the finished outputs)."""
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
    return [r.generated_tokens for r in ordered], seconds, ordered


def pass_summary(tokens, seconds, outputs, prompts, run, captures_before: int) -> dict:
    """One pass: throughput, time to first token, steps, host scheduling, captures during it,
    pure-decode steps against their floor, forward times (where wrapped); a full-length
    pass also against the workload's floor."""
    ttft = sorted(o.timestamps[0] - o.created_time for o in outputs)
    generated = sum(len(t) for t in tokens)
    steps = run.counter.steps
    out = {
        "seconds": seconds,
        "tokens": generated,
        "tokens_per_s": generated / seconds,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p90_s": ttft[int(len(ttft) * 0.9)],
        "steps": steps,
        "wall_ms_per_step": 1e3 * seconds / max(1, steps),
        **run.counter.summary(),
        "captures": run.graphs.captures - captures_before,
    }
    out.update(decode_window(outputs, [len(p) for p in prompts]))
    if "decode_requests" in out:
        floor = roofline.decode_step_floor(run.shape, out["decode_requests"],
                                           out["decode_context"], *run.peaks)  # fmt: skip
        out["decode_floor_ms"] = floor["floor_ms"]
        out["decode_over_floor"] = out["decode_step_ms"] / floor["floor_ms"]
    if run.timer is not None:
        out.update(run.timer.summary(seconds, min(32, len(prompts)), run.counter.each))
    if generated == len(prompts) * run.args.new_tokens:  # the workload the floor is for
        out["over_roofline"] = seconds / run.floor["roofline_s"]
    return out


def cb_config(args, variant: Variant):
    """One ``ContinuousBatchingConfig`` for every variant (``page_size`` from 5.18,
    ``block_size`` before; transformers' switch to flash attention off where it has one)."""
    from transformers import ContinuousBatchingConfig

    fields = vars(ContinuousBatchingConfig())
    size = "page_size" if "page_size" in fields else "block_size"
    extra = {"auto_switch_to_flash": False} if "auto_switch_to_flash" in fields else {}
    if variant.max_blocks_per_request is not None:
        extra["max_blocks_per_request"] = variant.max_blocks_per_request
    return ContinuousBatchingConfig(
        **{size: args.block_size},
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        allow_block_sharing=False,
        use_cuda_graph=variant.use_cuda_graph,
        use_async_batching=variant.use_async_batching,
        **extra,
    )


# -- one variant, one round -------------------------------------------------------------------
def compile_argument(variant: Variant):
    """``enable_continuous_batching``'s ``compile``: ``True``/``False``, or a mode as a dict."""
    return {"mode": variant.compile} if isinstance(variant.compile, str) else variant.compile


def run_round(model, variant: Variant, run) -> dict:
    """A manager of ``variant``: created (breakgraph captures here), warmed up, then the
    passes (stock graphs: cold, then warm; else warm), stopped and destroyed."""
    args, device = run.args, run.device
    lazy_graphs = bool(variant.use_cuda_graph) and device.type == "cuda"
    passes = [("warm", run.warm, args.new_tokens)]
    if lazy_graphs:
        passes.insert(0, ("cold", run.cold, args.cold_new_tokens))
    handle, result = None, {}
    compiled_before = _compiled_graphs()
    with PatchSet() as patches:
        if variant.breakgraph:
            if not variant.decode_splits:  # the kernel as before: no split, 64 keys a block
                patches.attribute(paged_decode_module, "PROGRAMS_PER_SM", 0)
                patches.attribute(paged_decode_module, "BLOCK_N", 64)
            if not variant.numpy_fill:  # transformers' own fill (installed at enable: not made)
                patches.attribute(block_table_module, "install_fill", lambda patches: False)
            if not variant.numpy_rows:  # transformers' own index lists (installed at enable)
                patches.attribute(index_rows_module, "install", lambda patches, lists: False)
            if not variant.warm_kernels:  # nothing compiled at plan: the steps compile
                patches.attribute(cb_step_module, "warm_up", lambda *args, **kwargs: [])
            if variant.break_split_keys is not None:  # another threshold for the breaks' split
                patches.attribute(paged_decode_module, "BREAK_SPLIT_FROM_KEYS",
                                  variant.break_split_keys)  # fmt: skip
            buckets = None
            if variant.pow2:
                buckets = [8 * 2**i for i in range(20) if 8 * 2**i < args.max_batch_tokens]
            handle = enable_continuous_batching(model, backend=run.backend, query_buckets=buckets,
                                                decode_graphs=variant.decode_graphs,
                                                compile=compile_argument(variant))  # fmt: skip
        else:
            model.set_attn_implementation(stock_attention(model.config))
        run.timer = None
        if not variant.use_cuda_graph:  # never around transformers' own graphs
            run.timer = StepTimer(device.type == "cuda")
            if handle is not None:  # its forward, its breaks and their cache updates
                run.timer.install(patches, handle.runner, breaks=True)
            else:
                run.timer.install(patches, model)
        try:
            run.graphs.reset()
            start = time.perf_counter()
            manager = model.init_continuous_batching(
                generation_config=run.gen, continuous_batching_config=cb_config(args, variant)
            )
            manager.warmup()
            synchronize(device)
            result["manager_s"] = time.perf_counter() - start
            result["warmup_captures"] = run.graphs.captures
            manager.start()
            try:
                for label, prompts, new_tokens in passes:
                    run.counter.reset()
                    captures = run.graphs.captures
                    if run.timer is not None:
                        run.timer.reset()
                    tokens, seconds, outputs = serve(manager, prompts, new_tokens)
                    result[label] = pass_summary(tokens, seconds, outputs, prompts, run, captures)
                    result["_tokens"] = tokens
            finally:
                manager.stop(block=True)
                manager.destroy()
        finally:
            if handle is not None:
                runner = handle.runner
                tokens_stats, logits_stats = runner.tokens.stats, runner.logits.stats
                decode = runner.decode  # pure-decode graphs (None with decode_graphs=False)
                decode_stats = decode.stats if decode is not None else None
                handle.disable()
            model.set_attn_implementation(stock_attention(model.config))
    if handle is not None:
        result.update(
            graphs=tokens_stats.captures + logits_stats.captures,
            capture_s=tokens_stats.capture_s + logits_stats.capture_s,
            replays=tokens_stats.replays + (decode_stats.replays if decode_stats else 0),
            eager_steps=tokens_stats.eager_steps,
            breaks_per_graph=max((b.breaks for b in tokens_stats.buckets.values()), default=0),
            buckets=sorted(tokens_stats.buckets),
            logits_buckets=sorted(logits_stats.buckets),
            stats_table=str(tokens_stats),
        )
        if decode_stats is not None:  # pure-decode graphs, captured while serving
            result.update(
                decode_graph_replays=decode_stats.replays,
                decode_graph_captures=decode_stats.captures,
                decode_graph_capture_s=decode_stats.capture_s,
                decode_graph_layouts=decode.layouts,
                decode_graph_fallbacks=dict(decode.fallbacks),
                decode_graph_off=decode.off,
                block_table_steps=dict(runner.block_table_steps),
                kernels_warmed=list(runner.kernels_warmed),
                kernel_warm_up_s=runner.kernel_warm_up_s,
            )
    else:
        result.update(graphs=run.graphs.captures, capture_s=run.graphs.capture_s)
    if variant.compile:  # Dynamo graphs compiled in this round (0 once Dynamo's cache holds them)
        result["compiled_graphs"] = _compiled_graphs() - compiled_before
    if variant.use_cuda_graph and device.type != "cuda":
        result["note"] = "no CUDA: transformers turns its graphs off"
    headline = dict(result["warm"])  # the row of the page
    result["warm_captures"] = headline.pop("captures")
    result.update(headline)
    return result


def _compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@torch.no_grad()
def run_generate(model, prompts, args) -> dict:
    """``model.generate`` one prompt at a time on a few median-length prompts."""
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
        "what": "model.generate, one prompt at a time",
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


# -- one model: variants in turns, medians, ratios --------------------------------------------
def agreement(got, ref) -> float:
    return sum(g == r for g, r in zip(got, ref)) / len(ref)


def _ratios(rounds: dict) -> tuple[dict, dict]:
    """breakgraph / stock tokens/s per round (a baseline that ran once divides every round);
    the lower median and the spread."""
    ratios, spread = {}, {}
    for bg in (v for v in rounds if VARIANTS[v].breakgraph):
        for base in (v for v in STOCK if v in rounds):
            mine, theirs = rounds[bg], rounds[base]
            if len(theirs) != len(mine):
                theirs = [statistics.median_low([r["tokens_per_s"] for r in theirs])] * len(mine)
            else:
                theirs = [r["tokens_per_s"] for r in theirs]
            per_round = [m["tokens_per_s"] / t for m, t in zip(mine, theirs)]
            ratios[f"{bg}_over_{base}"] = statistics.median_low(per_round)
            spread[f"{bg}_over_{base}"] = [min(per_round), max(per_round)]
    return ratios, spread


def model_variants(name: str, args) -> list[str]:
    chosen = args.variants or list(MODELS[name].variants)
    return list(dict.fromkeys(chosen))


def build_model(name: str, device, dtype) -> tuple:
    """(config, model) of ``MODELS[name]``: random weights, no BOS/EOS, pad id 0."""
    config = MODELS[name].family.config()
    for key in ("bos_token_id", "eos_token_id"):
        setattr(config, key, None)
    config.pad_token_id = 0
    return config, make_model(config, device, dtype)


def generation_config(new_tokens: int) -> GenerationConfig:
    """Greedy, exactly ``new_tokens`` per request (no EOS), as every CB variant serves."""
    return GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )


def run_model(name: str, args, run) -> dict:
    started = time.perf_counter()
    config, model = build_model(name, run.device, run.dtype)
    vocab = config.vocab_size
    run.cold = make_prompts(args.prompts, args.min_len, args.max_len, vocab, seed=1)
    run.warm = make_prompts(args.prompts, args.min_len, args.max_len, vocab, seed=2)
    run.shape = roofline.shape_of(model)
    run.floor = roofline.workload_floor(run.shape, [len(p) for p in run.warm], args.new_tokens,
                                        args.max_batch_tokens, *run.peaks)  # fmt: skip
    variants = model_variants(name, args)
    out = {
        "model": name,
        "shape": MODELS[name].family.shape,
        "config": config_summary(config),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "prompts": args.prompts,
        "prompt_tokens": sum(map(len, run.warm)),
        "new_tokens": args.new_tokens,
        "floor": dict(run.floor, shape=run.shape.as_dict()),
        "variants": {},
    }
    runnable = []
    for v in variants:
        if v != GENERATE and VARIANTS[v].needs_cuda and run.device.type != "cuda":
            out["variants"][v] = {"skipped": f"needs CUDA ({VARIANTS[v].needs_cuda})"}
        elif v != GENERATE and cpu_run_with_a_gpu(VARIANTS[v], run.device):
            out["variants"][v] = {"skipped": CPU_RUN_WITH_A_GPU}
        elif v != GENERATE:
            runnable.append(v)
    rounds: dict[str, list] = {}
    failures: dict[str, str] = {}
    for turn in range(args.rounds):  # the repeated variants take turns: drift hits them alike
        for v in runnable:
            if (turn > 0 and v not in args.repeat) or v in failures:
                continue
            print(f"[{name}] {v} (round {turn + 1}) ...", flush=True)
            try:
                result = run_round(model, VARIANTS[v], run)
            except Exception as exc:  # one variant's failure must not cost the others' numbers
                if not args.keep_going:
                    raise
                traceback.print_exc()
                failures[v] = f"round {turn + 1}: {type(exc).__name__}: {exc}"[:400]
                print(f"[{name}] {v} failed ({failures[v]})", flush=True)
            else:
                rounds.setdefault(v, []).append(result)
                print(f"[{name}] {v}: {result['tokens_per_s']:.0f} tok/s, {result['steps']} "
                      f"steps", flush=True)  # fmt: skip
            gc.collect()
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
    for v, why in failures.items():
        if v not in rounds:
            out["variants"][v] = {"failed": why}
    tokens = {}
    for v, results in rounds.items():  # the median round stands for the variant
        ordered = sorted(results, key=lambda r: r["tokens_per_s"])
        median_round = ordered[(len(ordered) - 1) // 2]  # the lower middle, as median_low
        tokens[v] = median_round.pop("_tokens")
        for r in results:
            r.pop("_tokens", None)
        out["variants"][v] = dict(
            median_round,
            what=VARIANTS[v].what,
            rounds=len(results),
            rounds_tokens_per_s=[r["tokens_per_s"] for r in results],
            rounds_manager_s=[r.get("manager_s") for r in results],  # round 1: compile, if any
            # captured while serving: a decode kernel's compile lands here, if not warmed up
            rounds_decode_capture_s=[r.get("decode_graph_capture_s") for r in results],
        )
        if v in failures:
            out["variants"][v]["failed_round"] = failures[v]
    if "stock_sdpa" in tokens:
        for v, got in tokens.items():
            out["variants"][v]["tokens_agree_with_stock"] = agreement(got, tokens["stock_sdpa"])
    if GENERATE in variants:
        print(f"[{name}] generate ...", flush=True)
        out["variants"][GENERATE] = run_generate(model, run.warm, args)
    out["variants"] = {v: out["variants"][v] for v in variants if v in out["variants"]}
    out["ratios"], out["ratio_spread"] = _ratios(rounds)
    out["seconds"] = time.perf_counter() - started
    del model
    gc.collect()
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def check_smoke_tokens(result: dict) -> None:
    """The smoke run's proof: in fp32 every variant's greedy tokens equal stock transformers'."""
    for v, entry in result.get("variants", {}).items():
        agree = entry.get("tokens_agree_with_stock")
        if agree is not None and agree != 1.0:
            raise SystemExit(
                f"bench_cb --smoke: {result['model']} {v}: {agree:.0%} of the prompts got "
                f"stock_sdpa's tokens in fp32 (expected all)"
            )


# -- the time estimate and budget -------------------------------------------------------------
def estimate_s(name: str, args) -> float:
    """Rough H200 seconds for one model (ESTIMATE_TOK_S; cold passes count 1.5x)."""
    tokens = args.prompts * args.new_tokens
    cold = args.prompts * args.cold_new_tokens
    total = ESTIMATE_FIXED_S["model"]
    for v in model_variants(name, args):
        if v == GENERATE:
            total += ESTIMATE_FIXED_S[GENERATE]
            continue
        rounds = args.rounds if v in args.repeat else 1
        per_round = ESTIMATE_FIXED_S["manager"] + tokens / ESTIMATE_TOK_S[v]
        if VARIANTS[v].use_cuda_graph:
            per_round += 1.5 * cold / ESTIMATE_TOK_S[v]
        total += rounds * per_round
    return total


# -- output -----------------------------------------------------------------------------------
#: The summary's columns: (header, width, the variant's key, format).
COLUMNS = (
    ("tok/s", 7, "tokens_per_s", ".0f"),
    ("s", 6, "seconds", ".2f"),
    ("xfloor", 7, "over_roofline", ".1f"),
    ("TTFTp50", 7, "ttft_p50_s", ".2f"),
    ("steps", 5, "steps", "d"),
    ("ms/step", 7, "wall_ms_per_step", ".1f"),
    ("prep", 5, "host_prepare_ms_per_step", ".1f"),
    ("lists", 5, "host_prepare_lists_ms_per_step", ".1f"),
    ("fwd", 5, "forward_host_ms_per_step", ".1f"),
    ("brk", 5, "break_host_ms_per_step", ".1f"),
    ("upd", 5, "cache_update_host_ms_per_step", ".1f"),
    ("dev", 5, "forward_device_ms_per_step", ".1f"),
    ("busy", 4, "gpu_forward_fraction", ".0%"),
    ("dec ms", 6, "decode_step_ms", ".2f"),
    ("xfl", 5, "decode_over_floor", ".1f"),
    ("graphs", 6, "graphs", "d"),
    ("cap s", 5, "capture_s", ".2f"),
    ("agree", 5, "tokens_agree_with_stock", ".2f"),
)


def _cell(entry: dict, key: str, width: int, spec: str) -> str:
    value = entry.get(key)
    return ("-" if value is None else format(value, spec)).rjust(width)


def print_summary(results: dict) -> None:
    """Per model: the floor, one row per variant (COLUMNS), the ratios, the decode steps."""
    for m in results["models"]:
        if "floor" not in m:
            print(f"\n{m['model']}: {m.get('skipped') or 'failed: ' + m['failed']}")
            continue
        f = m["floor"]
        print(
            f"\n{m['model']} ({m['params_m']:.0f}M params; {m['prompts']} prompts, "
            f"{m['prompt_tokens']} prompt tokens, {m['new_tokens']} new tokens each)\n"
            f"  floor {f['roofline_s']:.3f} s (prefill {f['prefill_s']:.3f} + decode "
            f"{f['decode_s']:.3f}; strict bound {f['bound_s']:.3f}); "
            f"{f['weight_bytes_per_decode_step'] / 1e9:.2f} GB of weights per decode step"
        )
        print("  " + "variant".ljust(19) + " ".join(h.rjust(w) for h, w, _, _ in COLUMNS))
        for name, v in m["variants"].items():
            if "skipped" in v or "failed" in v:
                print(f"  {name:<19}{'skipped' if 'skipped' in v else 'failed'}: "
                      f"{v.get('skipped') or v['failed']}")  # fmt: skip
            elif name == GENERATE:
                print(f"  {name:<19}{v['tokens_per_s']:>7.1f}  ({v['note']})")
            else:
                print(f"  {name:<19}" + " ".join(_cell(v, k, w, f) for _, w, k, f in COLUMNS))
        for key, value in m["ratios"].items():
            low, high = m["ratio_spread"][key]
            print(f"  {key}: {value:.2f} (rounds {low:.2f}-{high:.2f})")
        for name, v in m["variants"].items():
            if "decode_floor_ms" in v:
                print(f"  {name}: pure decode at {v['decode_requests']} requests x "
                      f"{v['decode_context']:.0f} keys: {v['decode_step_ms']:.2f} ms/step, "
                      f"floor {v['decode_floor_ms']:.3f} ms")  # fmt: skip
        if "stats_table" in m["variants"].get("breakgraph", {}):
            table = m["variants"]["breakgraph"]["stats_table"].replace("\n", "\n    ")
            print("  breakgraph query-bucket stats:\n    " + table)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = lambda text: [n for n in text.split(",") if n]  # noqa: E731
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU, emulated backend")
    parser.add_argument("--models", type=names, default=None,
                        help=f"comma-separated, of {', '.join(MODELS)} (default: "
                        f"{','.join(DEFAULT_MODELS)}; --smoke: tiny-llama)")  # fmt: skip
    parser.add_argument("--variants", type=names, default=None,
                        help=f"comma-separated, of {', '.join(VARIANTS)}, {GENERATE} (default: "
                        "per model, see above)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3,
                        help="turns taken by the --repeat variants (median and spread)")
    parser.add_argument("--repeat", type=names, default=["breakgraph"],
                        help="variants that take every round; the others run once")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cold-new-tokens", type=int, default=32,
                        help="new tokens per prompt of the stock graphs' cold (capturing) pass")
    parser.add_argument("--block-size", type=int, default=256, help="page size of the cache")
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--generate-prompts", type=int, default=2)
    parser.add_argument("--generate-new-tokens", type=int, default=32)
    parser.add_argument("--hbm-tbs", type=float, default=None,
                        help="HBM bandwidth of the floor, TB/s (default: the card's, "
                        "roofline.CARDS; an H200's on the CPU)")  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak of the floor, TFLOP/s (default: the card's)")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="skip a model whose estimate would end the run past this many "
                        "seconds (0: no budget)")  # fmt: skip
    parser.add_argument("--prep-lists", action="store_true",
                        help="also time transformers' conversions of its long index lists to "
                        "tensors inside its step preparation (wraps torch.tensor for the run)")
    parser.add_argument("--keep-going", action="store_true",
                        help="record a variant that fails and go on (always without --smoke)")
    args = parser.parse_args(argv)
    args.keep_going = args.keep_going or not args.smoke
    if args.smoke:
        args.models = args.models or ["tiny-llama"]
        args.prompts, args.min_len, args.max_len, args.new_tokens = 8, 4, 40, 12
        args.cold_new_tokens = 3
        args.block_size, args.num_blocks, args.max_batch_tokens = 16, 64, 32
        args.generate_prompts, args.generate_new_tokens = 2, 4
        args.rounds, args.budget_s = 2, 0.0
    args.models = args.models or list(DEFAULT_MODELS)
    unknown = set(args.models) - set(MODELS)
    unknown |= set(args.variants or ()) - set(VARIANTS) - {GENERATE}
    if unknown:
        parser.error(f"unknown model or variant: {sorted(unknown)}")
    return args


CPU_RUN_WITH_A_GPU = (
    "a CPU run on a machine with a GPU: transformers turns CUDA graphs on when "
    "torch.cuda.is_available(), whatever the model's device"
)


def cpu_run_with_a_gpu(variant, device: torch.device) -> bool:
    """Whether transformers would capture CUDA graphs of a CPU model (``--smoke`` on a GPU
    machine): it decides ``use_cuda_graph`` on ``torch.cuda.is_available()`` alone."""
    return bool(variant.use_cuda_graph) and device.type != "cuda" and torch.cuda.is_available()


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    every_variant = {v for name in args.models for v in model_variants(name, args)}
    compat.require("continuous_batching", "bench_cb")
    require_internals(any(VARIANTS[v].use_cuda_graph for v in every_variant if v in VARIANTS))
    if not cuda:
        torch.set_num_threads(1)  # tiny model: threads cost more than they save
    estimates = {name: estimate_s(name, args) for name in args.models}
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {device}; "
          f"estimate on an H200: {sum(estimates.values()):.0f} s "
          f"({', '.join(f'{n} {s:.0f}' for n, s in estimates.items())})", flush=True)  # fmt: skip
    card = torch.cuda.get_device_name() if cuda else None
    peaks = roofline.floor_peaks(args.hbm_tbs, args.peak_tflops, card)
    args.hbm_tbs, args.peak_tflops = peaks[0] / 1e12, peaks[1] / 1e12  # recorded with the args
    gen = generation_config(args.new_tokens)
    run = types.SimpleNamespace(
        args=args, device=device, dtype=dtype, backend="cuda" if cuda else "emulated", gen=gen,
        peaks=peaks, counter=StepCounter(lists=args.prep_lists), graphs=GraphLog(), timer=None,
    )  # fmt: skip
    meta = environment(cuda)
    meta.update(
        schema=SCHEMA,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        backend=run.backend,
        dtype=str(dtype),
        flash_attn_installed=transformers.utils.is_flash_attn_2_available(),
        hbm_bytes_per_s=peaks[0],
        peak_flops=peaks[1],
        internals=list(INTERNALS),
        estimate_s=estimates,
        args=vars(args),
    )
    results = {"meta": meta, "models": []}
    started = time.perf_counter()
    spent_estimate = 0.0  # estimates of the models already run (the pace corrects them)
    with contextlib.ExitStack() as stack:
        run.counter.install(stack.enter_context(PatchSet()))
        run.graphs.install(stack)
        for name in args.models:
            elapsed = time.perf_counter() - started
            pace = elapsed / spent_estimate if spent_estimate else 1.0
            if args.budget_s and elapsed + pace * estimates[name] > args.budget_s:
                results["models"].append({"model": name, "skipped": (
                    f"time budget: {elapsed:.0f} s spent, about {pace * estimates[name]:.0f} s "
                    f"more needed, --budget-s {args.budget_s:.0f}")})  # fmt: skip
                print(f"[{name}] skipped: {results['models'][-1]['skipped']}", flush=True)
            else:
                try:
                    result = run_model(name, args, run)
                except Exception as exc:
                    if not args.keep_going:
                        raise
                    traceback.print_exc()
                    result = {"model": name, "failed": f"{type(exc).__name__}: {exc}"[:400]}
                spent_estimate += estimates[name]
                results["models"].append(result)
                if args.smoke:
                    check_smoke_tokens(result)
            meta["elapsed_s"] = time.perf_counter() - started
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=2, default=str)
    print_summary(results)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return results


if __name__ == "__main__":
    main()
