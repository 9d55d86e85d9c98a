"""What a user would run instead of breakgraph: the baselines of the prefill benchmark.

* HF eager, one prompt at a time, ``logits_to_keep=1``;
* HF eager on a left-padded batch;
* the exact-length whole-forward CUDA graph: one ``torch.cuda.graph`` of
  ``model(ids, use_cache=False, logits_to_keep=1)`` captured at the prompt's exact
  length with HF's own SDPA attention (warm-up first), or at the padded batch's shape;
* ``torch.compile(mode="reduce-overhead")`` of the HF forward, with its first-call time
  per new length and its recompiles.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


def hf_eager(model, prompt: torch.Tensor) -> torch.Tensor:
    """HF forward of one prompt; returns its last-token logits ``[vocab]``."""
    return model(prompt[None], use_cache=False, logits_to_keep=1).logits[0, -1]


class CapturedForward:
    """``model(**inputs, use_cache=False, logits_to_keep=1)`` in one plain CUDA graph.

    The inputs' shapes are frozen; a call copies fresh values into the static inputs and
    replays. Graphs that never replay concurrently may share ``pool``.

    cuBLAS keeps one workspace per (handle, stream), and every ``torch.cuda.graph`` without a
    ``stream`` captures on one shared stream, so a graph bakes in whatever workspace an
    earlier capture on that stream allocated, possibly in another graph's pool. When
    ``torch.compile``'s CUDA graph trees (or a graph reset, pytorch/pytorch#193402) free the
    workspaces and that pool is released, a replay reads unmapped memory. A 5.24 prefill run
    hit ``cudaErrorIllegalAddress`` at this graph's replay after its compile variants (the
    device synchronised before it); that mechanism is the likely cause, not an established
    one (docs/performance.md). So the workspaces are freed right before the capture, and the
    capture allocates its own inside its pool, where it lives as long as the graph: what the
    graph trees do for their own captures. breakgraph's captures keep theirs in a pool of
    their own (``breakgraph.backends.cuda``).
    """

    def __init__(self, model, inputs: dict[str, torch.Tensor], pool=None, warmup: int = 3):
        self.inputs = {k: v.clone() for k, v in inputs.items()}
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                model(**self.inputs, use_cache=False, logits_to_keep=1)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private: probe it
        if clear is not None:
            torch.cuda.synchronize()  # no matmul in flight uses a workspace freed next
            clear()  # the capture allocates its own, in its pool
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model(**self.inputs, use_cache=False, logits_to_keep=1).logits
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        for name, value in inputs.items():
            self.inputs[name].copy_(value)
        self.graph.replay()
        return self.logits

    def close(self) -> None:
        self.graph.reset()


def exact_length_graph(model, prompt: torch.Tensor, pool=None) -> CapturedForward:
    """The whole HF forward captured at exactly ``len(prompt)`` tokens."""
    return CapturedForward(model, {"input_ids": prompt[None]}, pool=pool)


class PaddedBatch:
    """A batch of prompts left-padded to the longest, as HF runs batches.

    The mask is passed as a ready 4-D additive mask (causal and padding), so HF builds
    none: building one from a 2-D padding mask checks ``mask.all()`` on the host, which
    a CUDA graph cannot capture. Positions count from each prompt's first real token.
    """

    def __init__(self, prompts: Sequence[torch.Tensor], dtype: torch.dtype, pad_token_id: int = 0):
        device = prompts[0].device
        longest = max(len(p) for p in prompts)
        batch = len(prompts)
        self.ids = torch.full((batch, longest), pad_token_id, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, longest, dtype=torch.long, device=device)
        real = torch.zeros(batch, longest, dtype=torch.bool, device=device)
        for i, p in enumerate(prompts):
            pad = longest - len(p)
            self.ids[i, pad:] = p
            self.positions[i, pad:] = torch.arange(len(p), device=device)
            real[i, pad:] = True
        causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
        allowed = causal[None] & real[:, None, :]
        self.mask = torch.zeros(batch, 1, longest, longest, dtype=dtype, device=device)
        self.mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
        self.tokens = batch * longest

    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids, "attention_mask": self.mask, "position_ids": self.positions}

    def eager(self, model) -> torch.Tensor:
        """Last-token logits ``[batch, vocab]`` of HF eager on the padded batch."""
        return model(**self.inputs(), use_cache=False, logits_to_keep=1).logits[:, -1]

    def graph(self, model, pool=None) -> CapturedForward:
        return CapturedForward(model, self.inputs(), pool=pool)


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {
        "frames": counters["frames"].get("ok", 0),
        "graphs": counters["stats"].get("unique_graphs", 0),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


#: where a compile's time goes: phase -> torch's timer for it (a ``dynamo_timed`` name; its
#: seconds are appended to ``torch._dynamo.utils.compilation_time_metrics``, the same names in
#: torch 2.11 to 2.13; a timer a torch lacks reads 0). The timers nest (each line inside the
#: one above it, the ``inductor`` parts inside ``inductor``); :func:`compile_phases` makes them
#: exclusive. The last two run after the compile, at a graph's first runs.
COMPILE_TIMERS = {
    "frame_compile": "_compile.compile_inner",  # Dynamo's compile of one frame, everything
    "backend": "OutputGraph.call_user_compiler",  # the backend on one graph: AOT + Inductor
    "aot_autograd": "create_aot_dispatcher_function",  # includes Inductor's compile
    "inductor": "compile_fx_inner",
    "lowering": "GraphLowering.run",
    "codegen": "GraphLowering.codegen",  # fusion (Scheduler) and kernel sources
    "kernel_compile_wait": "async_compile.wait",  # waiting for the Triton/C++ compile workers
    "module_load": "PyCodeCache.load_by_key_path",
    "guards": "build_guards",
    "triton_autotune": "CachingAutotuner.benchmark_all_configs",  # a kernel's first run
    "cudagraph_record": "CUDAGraphNode.record",  # reduce-overhead's CUDA graph recordings
}


def _compile_timers() -> dict:
    """Per torch timer, how many times it ran so far (its list of seconds is append-only)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: len(times) for name, times in compilation_time_metrics.items()}


def _timer_deltas(before: dict) -> dict:
    """Per torch timer, [runs, seconds] since ``before`` (a cleared list counts whole)."""
    from torch._dynamo.utils import compilation_time_metrics

    out = {}
    for name, times in compilation_time_metrics.items():
        start = before.get(name, 0)
        new = times[start:] if len(times) >= start else times
        if new:
            out[name] = [len(new), sum(new)]
    return out


def compile_phases(timers: dict) -> dict:
    """Exclusive seconds per phase from nested timer deltas (``{name: [runs, seconds]}``).

    ``compile_s`` is every frame compile in all; it splits into ``dynamo_s`` (bytecode
    tracing, fake-tensor propagation, guards: the frame compile outside its backend),
    ``aot_autograd_s`` (functionalization and partitioning, outside Inductor),
    ``inductor_s`` and ``backend_other_s`` (the backend outside AOT autograd).
    ``inductor_s`` holds ``inductor_lowering_s``, ``inductor_codegen_s``,
    ``inductor_kernel_compile_wait_s`` and ``inductor_module_load_s`` (codegen may include
    kernel compiles on the CPU). ``triton_autotune_s`` and ``cudagraph_record_s`` are spent
    at a graph's first runs, outside ``compile_s``.

    Example::

        >>> compile_phases({"_compile.compile_inner": [2, 10.0],
        ...                 "OutputGraph.call_user_compiler": [2, 8.0],
        ...                 "create_aot_dispatcher_function": [2, 7.5],
        ...                 "compile_fx_inner": [2, 7.0]})["dynamo_s"]
        2.0
    """
    t = {phase: timers.get(name, [0, 0.0])[1] for phase, name in COMPILE_TIMERS.items()}
    return {
        "compile_s": t["frame_compile"],
        "dynamo_s": t["frame_compile"] - t["backend"],
        "guards_s": t["guards"],
        "aot_autograd_s": t["aot_autograd"] - t["inductor"],
        "inductor_s": t["inductor"],
        "inductor_lowering_s": t["lowering"],
        "inductor_codegen_s": t["codegen"],
        "inductor_kernel_compile_wait_s": t["kernel_compile_wait"],
        "inductor_module_load_s": t["module_load"],
        "backend_other_s": t["backend"] - t["aot_autograd"],
        "triton_autotune_s": t["triton_autotune"],
        "cudagraph_record_s": t["cudagraph_record"],
    }


def _cache_counts() -> dict:
    """Inductor's FX graph cache and AOT autograd's cache: hits and misses so far (a warm
    cache on disk makes a 'first' compile cheap: the JSON says which it was)."""
    from torch._dynamo.utils import counters

    return {
        f"{group}.{name}": value
        for group in ("inductor", "aot_autograd")
        for name, value in counters[group].items()
        if "cache" in name
    }


def _time_spent() -> dict:
    """``torch._dynamo.utils.calculate_time_spent()`` (seconds per compile phase so far), or
    nothing on a torch without it."""
    from torch._dynamo import utils

    spent = getattr(utils, "calculate_time_spent", None)
    return dict(spent()) if spent is not None else {}


def dynamo_delta(before: dict) -> dict:
    """What Dynamo compiled since ``before`` (from :func:`dynamo_snapshot`): ``frames``,
    ``graphs``, ``graph_breaks``; ``compile_s``, where the compile time went
    (:func:`compile_phases`); ``timers``, every torch timer over 0.05 s as [runs, seconds];
    ``caches``, cache hits and misses; ``time_spent``, torch's own phase totals."""
    now = _dynamo_counts()
    timers = _timer_deltas(before["timers"])
    caches = {k: v - before["caches"].get(k, 0) for k, v in _cache_counts().items()}
    spent = _time_spent()
    return {
        **{k: now[k] - before["counts"][k] for k in now},
        "compile_s": compile_phases(timers),
        "timers": {k: v for k, v in timers.items() if v[1] >= 0.05},
        "caches": {k: v for k, v in caches.items() if v},
        "time_spent": {k: v - before["time_spent"].get(k, 0.0) for k, v in spent.items()},
    }


def dynamo_snapshot() -> dict:
    """Dynamo's counters, torch's compile timers and cache counters now."""
    return {
        "counts": _dynamo_counts(),
        "timers": _compile_timers(),
        "caches": _cache_counts(),
        "time_spent": _time_spent(),
    }


class CompiledForward:
    """``torch.compile(model, mode="reduce-overhead")`` called on one prompt at its exact length.

    ``first_calls`` runs each new length ``calls`` times (compile, CUDA-graph warm-up,
    record) and records the time of the first call and of all of them, and what Dynamo
    compiled (``frames`` counts recompiles: one per new frame or guard failure).
    """

    def __init__(self, model, dynamic: bool | None = None):
        self.fn = torch.compile(model, mode="reduce-overhead", dynamic=dynamic)

    def __call__(self, prompt: torch.Tensor):
        torch.compiler.cudagraph_mark_step_begin()
        return self.fn(prompt[None], use_cache=False, logits_to_keep=1).logits[0, -1]

    def first_calls(self, prompts: Sequence[torch.Tensor], calls: int = 3) -> list[dict]:
        """Per prompt length: ``first_call_s`` (compile, then CUDA-graph trees' eager
        warm-up run), ``call_s`` (each call, synchronized: the second records the graph),
        ``ready_s`` (all of them) and :func:`dynamo_delta` over them."""
        rows = []
        for p in prompts:
            before = dynamo_snapshot()
            start = time.perf_counter()
            call_s = []
            for _ in range(calls):
                began = time.perf_counter()
                self(p)
                torch.cuda.synchronize()
                call_s.append(time.perf_counter() - began)
            rows.append(
                {
                    "tokens": len(p),
                    "calls": calls,
                    "first_call_s": call_s[0],
                    "call_s": call_s,
                    "ready_s": time.perf_counter() - start,
                    **dynamo_delta(before),
                }
            )
        return rows
