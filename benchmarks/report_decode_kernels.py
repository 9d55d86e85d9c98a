"""The page's section on the device's part of a 32-request pure-decode step, kernel by kernel.

Why: the floor sections above show the default decoder's device span at more than twice the
HBM floor while the step's GEMMs alone are well under it; a trace of the served steps says
which kernels fill the gap, and so which of them a faster step would have to remove.

The run: ``benchmarks/cb_trace.py`` on llama3-8b-4l (the shape that came closest to twice its
floor), 32 requests, both decoders; the floor is ``bench_cb``'s for the same workload
(:data:`FLOOR_FILE`). Example (the committed runs)::

    python -m benchmarks.report   # the whole page, this section included
"""

from __future__ import annotations

import gzip
import json
import os

from .cb_trace import device_time_by_kernel
from .template import fill, num, pct, table

#: the trace run: its summary and one chrome trace per decoder in the same folder
TRACE_DIR = "h200-cb-trace-llama3-32-5.17"
SUMMARY_FILE = f"{TRACE_DIR}/summary.json"
DECODERS = (("breakgraph", "default"), ("breakgraph_compiled", "compiled"))
#: bench_cb's run of the same workload (32 requests of 16-1024 tokens, 128 new tokens): the floor
FLOOR_FILE = "h200-cb-floor-32-again-5.17.json"
#: kernels of cuBLAS's split-K GEMMs that the trace's kinds count as reductions
SPLIT_K_REDUCE = "splitKreduce"
TOP_KERNELS = 10


def load_kernels(results: str, summary: dict) -> dict[str, list[dict]]:
    """Per decoder, :func:`~benchmarks.cb_trace.device_time_by_kernel` of its committed trace,
    over the window the summary used (its ``settle`` steps left out)."""
    settle = summary["meta"]["args"]["settle"]
    kernels = {}
    for variant, _ in DECODERS:
        trace = os.path.basename(summary["variants"][variant]["trace"])  # the device's path
        path = os.path.join(results, TRACE_DIR, trace)
        with gzip.open(path, "rt") as f:
            kernels[variant] = device_time_by_kernel(json.load(f), settle)
    return kernels


def _short(name: str, limit: int = 64) -> str:
    name = name.replace("void ", "").replace("at::native::", "")
    return name if len(name) <= limit else name[: limit - 1] + "…"


def _gemm_ms(rows: list[dict]) -> float:
    return sum(r["ms_per_step"] for r in rows
               if r["kind"] == "dense GEMM" or SPLIT_K_REDUCE in r["name"])  # fmt: skip


def _of_kind(rows: list[dict], kind: str, what: str = "ms_per_step") -> float:
    return sum(r[what] for r in rows if r["kind"] == kind and SPLIT_K_REDUCE not in r["name"])


def section(summary: dict, kernels: dict[str, list[dict]], floor_run: dict) -> str:
    """The section: kinds per decoder against the floor, the default decoder's largest
    kernels, and the GEMMs' share of HBM bandwidth (``floor_run``: :data:`FLOOR_FILE`)."""
    model = summary["meta"]["model"]
    m = next(m for m in floor_run["models"] if m["model"] == model)
    entry = m["variants"]["breakgraph"]
    floor_ms = entry["decode_floor_ms"]
    roof = m["floor"]
    weights_ms = 1e3 * roof["weight_bytes_per_decode_step"] / roof["hbm_bytes_per_s"]
    variants = summary["variants"]
    names = [n for n, _ in DECODERS]
    every = dict.fromkeys(k for n in names for k in variants[n]["device_ms_per_step_by_kind"])
    kinds = [[kind] + [num(variants[n]["device_ms_per_step_by_kind"].get(kind, 0.0))
                       for n in names] for kind in every]  # fmt: skip
    totals = {n: sum(variants[n]["device_ms_per_step_by_kind"].values()) for n in names}
    kinds.append(["**all kernels**"] + [num(totals[n]) for n in names])
    kinds.append(["all kernels × the floor"] + [f"{num(totals[n] / floor_ms)}×" for n in names])
    kinds.append(["kernels per step"] + [
        num(variants[n]["device_events"] / variants[n]["steps"], 0) for n in names])
    kinds.append(["GPU busy"] + [pct(variants[n]["device_busy_fraction"]) for n in names])
    kinds.append(["ms per step (profiled)"] + [num(variants[n]["wall_ms_per_step"]) for n in names])
    default, compiled = (kernels[n] for n in names)
    top = [[num(1e3 * r["ms_per_step"], 1), num(r["launches_per_step"], 1), r["kind"],
            f"`{_short(r['name'])}`"] for r in default[:TOP_KERNELS]]  # fmt: skip
    gemm = {n: _gemm_ms(kernels[n]) for n in names}
    elementwise = "elementwise / reduce (norms, rotary, activations)"
    fused = "fused by Inductor (torch.compile's Triton kernels)"
    room = 2 * floor_ms - totals["breakgraph_compiled"]
    return fill(
        "cb.decode_kernels",
        file=f"`{SUMMARY_FILE}`", floor_file=f"`{FLOOR_FILE}`",
        device=summary["meta"].get("gpu", "?"), torch=summary["meta"].get("torch", "?"),
        transformers=summary["meta"].get("transformers", "?"),
        date=summary["meta"].get("date", "?"), model=model,
        requests=summary["meta"]["args"]["prompts"], steps=variants["breakgraph"]["steps"],
        floor=num(floor_ms, 3),
        kinds=table(["device ms per pure-decode step", *(f"`{n}`" for n in names)], kinds),
        top=table(["µs per step", "launches per step", "kind", "kernel"], top),
        gemm=" and ".join(f"{num(gemm[n])} ms" for n in names),
        weights_gb=num(roof["weight_bytes_per_decode_step"] / 1e9),
        hbm=num(roof["hbm_bytes_per_s"] / 1e12, 1), weights_ms=num(weights_ms, 3),
        share=pct(weights_ms / gemm["breakgraph"]),
        gemm_over=num(gemm["breakgraph"] / floor_ms),
        rest_default=num(totals["breakgraph"] - gemm["breakgraph"]),
        elementwise=num(_of_kind(default, elementwise)),
        elementwise_launches=num(_of_kind(default, elementwise, "launches_per_step"), 0),
        attention=num(_of_kind(default, "attention")),
        copies=num(_of_kind(default, "copies")),
        rest_compiled=num(totals["breakgraph_compiled"] - gemm["breakgraph_compiled"]),
        fused_launches=num(_of_kind(compiled, fused, "launches_per_step"), 0),
        over_default=num(totals["breakgraph"] / floor_ms),
        over_compiled=num(totals["breakgraph_compiled"] / floor_ms),
        room=num(room, 2),
    )
