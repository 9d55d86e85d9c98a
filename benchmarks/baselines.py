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


def dynamo_delta(before: dict) -> dict:
    """Dynamo's compile counters since ``before`` (from :func:`dynamo_snapshot`)."""
    now = _dynamo_counts()
    return {k: now[k] - before[k] for k in now}


def dynamo_snapshot() -> dict:
    return _dynamo_counts()


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
        rows = []
        for p in prompts:
            before = dynamo_snapshot()
            start = time.perf_counter()
            self(p)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            for _ in range(calls - 1):
                self(p)
            torch.cuda.synchronize()
            rows.append(
                {
                    "tokens": len(p),
                    "calls": calls,
                    "first_call_s": first,
                    "ready_s": time.perf_counter() - start,
                    **dynamo_delta(before),
                }
            )
        return rows
