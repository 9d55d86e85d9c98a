"""Where transformers' preparation of a continuous-batching step goes, part by part (host only).

The step time of breakgraph's continuous batching is bound by transformers' own host work
(``prepare_next_batch`` and ``update_batch``, one Python thread). This times that work with a
wall-clock timer around the functions that do each part (the outermost call only) and reports
the pure-decode steps (every request decoding: the steps the HBM-floor target is about):

* ``index lists``: ``PagedAttentionCache.extend_read_and_write_indices``, which builds the
  step's read and write indices as Python lists (one int per cached key of every request);
* ``block table``: ``PagedAttentionCache.fill_block_table``, which writes each request's
  block entries into the step's block table, request by request (transformers' decode fast
  path, which breakgraph keeps on for the models it serves with graphs: ``--block-table``);
* ``list conversion``: those lists and the ids to tensors (``torch.tensor`` in transformers'
  ``input_outputs``, which breakgraph's :class:`~breakgraph.integrations.transformers.
  index_lists.NumpyLists` serves through numpy while continuous batching is enabled);
* ``scheduler``: ``schedule_batch``;
* ``other batch tensors``: the rest of ``prepare_batch_tensors`` (per-request loops, resets,
  copies into the static tensors);
* ``other preparation``: the rest of ``prepare_next_batch``;
* ``update``: ``update_batch`` (the sampled tokens into the requests' states).

By default the steps run eagerly (``use_cuda_graph=False``), which keeps every step on the
index lists; ``--block-table`` serves them through breakgraph's graphs (emulated), where
pure-decode steps come with transformers' block table instead.

The work is transformers' Python and the same on any machine kind, so it runs on the CPU with
a tiny model (breakgraph enabled, emulated backend): the parts' shares carry over, absolute
times depend on the host. A first pass without the timers gives the wall time per call; the
timed passes add two clock reads and a wrapper per timed call (``pass_s`` in the JSON compares
the passes' seconds with and without them), and the parts' means are reported::

    python -m benchmarks.cb_prep_profile --out cb-prep-profile.json
    python -m benchmarks.cb_prep_profile --block-table --out cb-prep-profile-table.json

``--sliding`` profiles a tiny model with Gemma-3-1B's layers (sliding-window groups, whose
index lists read a whole window per request), ``--tx-rows`` with transformers' own index lists
instead of breakgraph's numpy rows (:mod:`~breakgraph.integrations.transformers.index_rows`);
every step's medians (``steps_median_ms``) are written whether or not pure-decode steps of
``MIN_REQUESTS`` came (on 5.17 such a model's steps hold fewer requests)::

    python -m benchmarks.cb_prep_profile --sliding --requests 40 --new-tokens 8 --rounds 1 \
        --plain-passes 1 --block-table --out cpu-cb-prep-profile-sliding.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

from benchmarks.environment import environment

#: (part, module, method): the outermost calls of the method, on every class of the module that
#: defines it, make the part
PARTS = (
    ("index lists", "transformers.generation.continuous_batching.cache",
     "extend_read_and_write_indices"),
    ("block table", "transformers.generation.continuous_batching.cache", "fill_block_table"),
    ("list conversion", "breakgraph.integrations.transformers.index_lists", "tensor"),
    ("scheduler", "transformers.generation.continuous_batching.scheduler", "schedule_batch"),
    ("batch tensors", "transformers.generation.continuous_batching.input_outputs",
     "prepare_batch_tensors"),
    ("prepare", "transformers.generation.continuous_batching.continuous_api",
     "prepare_next_batch"),
    ("update", "transformers.generation.continuous_batching.continuous_api", "update_batch"),
)  # fmt: skip
MIN_REQUESTS = 32  # the pure-decode steps reported hold at least this many requests
PROMPT_LENGTHS = (16, 1024)  # each prompt's length: uniform in this range


def build(requests: int, seed: int = 0, block_table: bool = False, sliding: bool = False):
    """A tiny Llama (random weights), its prompts (``PROMPT_LENGTHS``) and a CB config like
    ``bench_cb``'s: pages of 256 tokens, 1024 pages, 2048 tokens per step, synchronous;
    breakgraph's graphs off (index lists every step) unless ``block_table``. ``sliding``: a
    tiny model with Gemma-3-1B's layers instead (26, a window of 512 on 5 of 6: transformers
    5.17 makes 13 layer groups of them, later releases 2), with 256 pages (1024 would not fit
    a CPU's memory in 5.24's reckoning)."""
    from transformers import ContinuousBatchingConfig

    torch.manual_seed(seed)
    small = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, bos_token_id=None,
                 eos_token_id=None, pad_token_id=0)  # fmt: skip
    if sliding:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        from benchmarks.families import GEMMA3_1B

        config = Gemma3TextConfig(**{**GEMMA3_1B, **small, "head_dim": 16,
                                     "query_pre_attn_scalar": 16})  # fmt: skip
        model = Gemma3ForCausalLM(config).eval()
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**small, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
        model = LlamaForCausalLM(config).eval()
    low, high = PROMPT_LENGTHS
    lengths = torch.randint(low, high + 1, (requests,), generator=torch.Generator().manual_seed(0))
    prompts = [torch.randint(1, 999, (int(n),)).tolist() for n in lengths]
    fields = vars(ContinuousBatchingConfig())
    size = "page_size" if "page_size" in fields else "block_size"
    extra = {"auto_switch_to_flash": False} if "auto_switch_to_flash" in fields else {}
    cb_config = ContinuousBatchingConfig(
        **{size: 256}, num_blocks=256 if sliding else 1024, max_batch_tokens=2048,
        allow_block_sharing=False,
        use_cuda_graph=None if block_table else False, use_async_batching=False, **extra,
    )  # fmt: skip
    return model, prompts, cb_config


def _pure_decode(processor) -> bool:
    """Whether the batch just prepared holds one query token per request (5.17 and 5.24
    spell the longest query differently)."""
    io = processor.inputs_and_outputs
    return getattr(io, "max_seqlen_q", getattr(io, "max_length_q", 0)) == 1


def _requests(processor) -> int:
    """How many requests the batch just prepared holds."""
    return len(processor.inputs_and_outputs.requests_in_batch)


class StepTimers:
    """Wall-clock time of each part's outermost calls, summed per CB step (a step starts at
    ``prepare_next_batch``), with whether the step was pure decode. ``install`` wraps the
    methods through a :class:`~breakgraph.patches.PatchSet` (restored with it)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []  # one per step: part -> ms, and "decode"
        self._depth = {part: 0 for part, _, _ in PARTS}

    def install(self, patches) -> None:
        import importlib

        for part, module_name, method in PARTS:
            module = importlib.import_module(module_name)
            owners = [o for o in vars(module).values() if isinstance(o, type) and method in vars(o)]
            if not owners:  # a renamed function would silently drop out of the parts
                raise RuntimeError(f"cb_prep_profile: no class of {module_name} defines {method}")
            for owner in owners:
                patches.attribute(owner, method, self._timed(part, vars(owner)[method]))

    def _timed(self, part: str, function):
        timers = self

        def call(*args, **kwargs):
            if part == "prepare":
                timers.steps.append({"decode": False})
            timers._depth[part] += 1
            start = time.perf_counter()
            result = None
            try:
                result = function(*args, **kwargs)
                return result
            finally:
                timers._depth[part] -= 1
                if timers._depth[part] == 0 and timers.steps:
                    step = timers.steps[-1]
                    step[part] = step.get(part, 0.0) + (time.perf_counter() - start) * 1e3
                    if part == "prepare" and result is not True:  # no batch: not a step
                        timers.steps.pop()
                    elif part == "prepare":
                        step["decode"] = _pure_decode(args[0])
                        step["requests"] = _requests(args[0])

        return call

    def decode_steps(self) -> list[dict]:
        """The pure-decode steps of at least ``MIN_REQUESTS`` requests (the target's steps;
        the last steps of a pass hold only the few requests still decoding)."""
        return [s for s in self.steps
                if s["decode"] and "prepare" in s and s["requests"] >= MIN_REQUESTS]  # fmt: skip

    def decode_parts(self) -> dict:
        """Means over :meth:`decode_steps`, ms (means, so that the parts add up to the whole):
        the timed parts, and the rest of ``prepare_batch_tensors`` and of
        ``prepare_next_batch`` computed step by step."""
        steps = self.decode_steps()
        for s in steps:
            s["other batch tensors"] = (s.get("batch tensors", 0.0) - s.get("index lists", 0.0)
                                        - s.get("block table", 0.0)
                                        - s.get("list conversion", 0.0))  # fmt: skip
            s["other preparation"] = (s["prepare"] - s.get("batch tensors", 0.0)
                                      - s.get("scheduler", 0.0))  # fmt: skip
        names = ("index lists", "block table", "list conversion", "scheduler",
                 "other batch tensors", "other preparation", "prepare", "update")  # fmt: skip
        return {n: statistics.fmean(s.get(n, 0.0) for s in steps) for n in names} if steps else {}


def serve(model, prompts, cb_config, new_tokens: int, timers: StepTimers | None) -> float:
    """One pass (every prompt submitted at once, ``new_tokens`` each); seconds. ``timers``
    (installed for the pass) records the steps."""
    from transformers import GenerationConfig

    from breakgraph.patches import PatchSet

    generation = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                  pad_token_id=0)  # fmt: skip
    with PatchSet() as patches:
        if timers is not None:
            timers.install(patches)
        start = time.perf_counter()
        manager = model.init_continuous_batching(generation_config=generation,
                                                 continuous_batching_config=cb_config)  # fmt: skip
        manager.start()
        try:
            ids = manager.add_requests(prompts, max_new_tokens=new_tokens)
            done = 0
            while done < len(ids):
                result = manager.get_result(timeout=600)
                if result is None:
                    raise RuntimeError("the CB manager stopped answering")
                done += result.is_finished()
        finally:
            manager.stop(block=True)
        return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed passes (steps pooled)")
    parser.add_argument("--plain-passes", type=int, default=2, help="passes without timers")
    parser.add_argument("--sliding", action="store_true",
                        help="a tiny model with Gemma-3-1B's 26 layers, 5 of 6 sliding")
    parser.add_argument("--tx-rows", action="store_true",
                        help="transformers' own index lists (breakgraph's numpy rows off)")
    parser.add_argument("--block-table", action="store_true",
                        help="serve through breakgraph's graphs: pure-decode steps come with "
                             "transformers' block table instead of index lists")  # fmt: skip
    args = parser.parse_args(argv)
    from breakgraph.integrations.transformers import enable_continuous_batching, index_rows

    from breakgraph.patches import PatchSet

    model, prompts, cb_config = build(args.requests, block_table=args.block_table,
                                      sliding=args.sliding)  # fmt: skip
    meta = environment(cuda=False)
    meta["gpu"] = f"none ({os.cpu_count()} CPU cores)"
    results = {"meta": meta,
               "settings": {"requests": args.requests, "new_tokens": args.new_tokens,
                            "prompt_tokens": sum(map(len, prompts)), "rounds": args.rounds,
                            "prompt_lengths": list(PROMPT_LENGTHS), "min_requests": MIN_REQUESTS,
                            "model": ("tiny Gemma 3, Gemma-3-1B's 26 layers, hidden 64"
                                      if args.sliding else "tiny Llama, 2 layers, hidden 64"),
                            "rows": "transformers" if args.tx_rows else "numpy",
                            "page_size": 256, "pages": 256 if args.sliding else 1024,
                            "max_batch_tokens": 2048, "batching": "synchronous",
                            "block_table": args.block_table}}  # fmt: skip
    with contextlib.ExitStack() as stack, torch.no_grad():
        if args.tx_rows:  # transformers' own lists (installed at enable: not made)
            patches = stack.enter_context(PatchSet())
            patches.attribute(index_rows, "install", lambda patches, lists: False)
        stack.enter_context(enable_continuous_batching(model, backend="emulated"))
        if args.block_table:  # breakgraph's numpy fill replaced transformers' (contract item 16)?
            from breakgraph.integrations.transformers import compat

            filler = compat.block_table_filler()
            numpy = filler is not None and hasattr(filler.fill_block_table, "__wrapped__")
            results["settings"]["table_fill"] = "numpy" if numpy else "transformers"
        plain = [serve(model, prompts, cb_config, args.new_tokens, None)
                 for _ in range(max(1, args.plain_passes))]  # fmt: skip
        timers = StepTimers()
        timed = [serve(model, prompts, cb_config, args.new_tokens, timers)
                 for _ in range(args.rounds)]  # fmt: skip
    results["pass_s"] = {"plain": plain, "timed": timed}
    steps = timers.decode_steps()
    results["steps"] = len(timers.steps)
    results["decode_steps"] = len(steps)
    every = [s for s in timers.steps if "prepare" in s]  # every step, pure-decode or not
    results["steps_median_ms"] = {part: statistics.median(s.get(part, 0.0) for s in every)
                                  for part in ("prepare", "index lists", "list conversion")}
    results["steps_requests_median"] = statistics.median(s["requests"] for s in every)
    if not steps:  # the steps' medians are still written (transformers 5.17's sliding models)
        print(f"cb_prep_profile: no pure-decode step of {MIN_REQUESTS} requests or more",
              file=sys.stderr)  # fmt: skip
        print(json.dumps(results["steps_median_ms"]), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        return 1
    results["decode_requests_median"] = statistics.median(s["requests"] for s in steps)
    results["decode_parts_ms"] = timers.decode_parts()
    print(json.dumps({k: results[k] for k in ("pass_s", "decode_steps", "decode_requests_median",
                                              "decode_parts_ms", "steps_median_ms")},
                     indent=1), flush=True)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
