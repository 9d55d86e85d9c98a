"""The page's section on the device's part of a 32-request pure-decode step, kernel by kernel.

Why: the floor sections above show the default decoder's device span at more than twice the
HBM floor while the step's GEMMs alone are well under it; a trace of the served steps says
which kernels fill the gap, and so which of them a faster step would have to remove.

The runs: ``benchmarks/cb_trace.py`` on llama3-8b-4l (the shape that came closest to twice its
floor), 32 requests, both decoders, on the oldest and newest transformers supported; the floor
is ``bench_cb``'s for the same workload (:data:`RUNS`). Example (the committed runs)::

    python -m benchmarks.report   # the whole page, this section included
"""

from __future__ import annotations

import functools
import gzip
import json
import os

from .cb_trace import device_time_by_kernel
from .template import fill, num, pct, span, table

#: the trace runs, each on a fresh machine: (label, folder with summary.json and one chrome
#: trace per decoder, bench_cb's run of the same workload on that release for the floor); the
#: last one is scripts/gpu_check.sh's RUN_DECODE_KERNELS section run again on the oldest release
RUNS = (
    ("5.17", "h200-cb-trace-llama3-32-5.17", "h200-cb-floor-32-again-5.17.json"),
    ("5.24", "h200-cb-trace-llama3-32-5.24", "h200-cb-floor-32-again-5.24.json"),
    ("5.17 again", "h200-cb-trace-llama3-32-5.17-again", "h200-cb-floor-32-again-5.17.json"),
)
SUMMARY_FILES = tuple(f"{folder}/summary.json" for _, folder, _ in RUNS)
FLOOR_FILES = tuple(dict.fromkeys(floor for *_, floor in RUNS))
DECODERS = (("breakgraph", "default"), ("breakgraph_compiled", "compiled"))
#: kernels of cuBLAS's split-K GEMMs that the trace's kinds count as reductions
SPLIT_K_REDUCE = "splitKreduce"
TOP_KERNELS = 10
ELEMENTWISE = "elementwise / reduce (norms, rotary, activations)"
FUSED = "fused by Inductor (torch.compile's Triton kernels)"


def load_kernels(results: str, folder: str, summary: dict) -> dict[str, list[dict]]:
    """Per decoder, :func:`~benchmarks.cb_trace.device_time_by_kernel` of its committed trace
    in ``folder``, over the window the summary used (its ``settle`` steps left out)."""
    settle = summary["meta"]["args"]["settle"]
    kernels = {}
    for variant, _ in DECODERS:
        trace = os.path.basename(summary["variants"][variant]["trace"])  # the device's path
        path = os.path.realpath(os.path.join(results, folder, trace))
        stat = os.stat(path)
        rows = _trace_kernels(path, settle, stat.st_mtime_ns, stat.st_size)
        kernels[variant] = [dict(row) for row in rows]  # the caller's own copies
    return kernels


@functools.lru_cache(maxsize=16)
def _trace_kernels(path: str, settle: int, mtime_ns: int, size: int) -> tuple[dict, ...]:
    """One trace's kernels, read once per process while the file is unchanged (its real path
    and stat are the key): a trace is megabytes of JSON, and the tests render the page many
    times."""
    with gzip.open(path, "rt") as f:
        return tuple(device_time_by_kernel(json.load(f), settle))


def _short(name: str, limit: int = 64) -> str:
    name = name.replace("void ", "").replace("at::native::", "")
    return name if len(name) <= limit else name[: limit - 1] + "…"


def _gemm_ms(rows: list[dict]) -> float:
    return sum(r["ms_per_step"] for r in rows
               if r["kind"] == "dense GEMM" or SPLIT_K_REDUCE in r["name"])  # fmt: skip


def _of_kind(rows: list[dict], kind: str, what: str = "ms_per_step") -> float:
    return sum(r[what] for r in rows if r["kind"] == kind and SPLIT_K_REDUCE not in r["name"])


def _floor(summary: dict, floor_run: dict) -> tuple[float, dict]:
    """The pure-decode step's floor (ms) of the traced model in ``floor_run``, and its roofline."""
    m = next(m for m in floor_run["models"] if m["model"] == summary["meta"]["model"])
    return m["variants"]["breakgraph"]["decode_floor_ms"], m["floor"]


def _busy(columns: list[dict]) -> str:
    """The GPU's busy share of a step per run, default and compiled decoder."""
    by_run: dict = {}
    for c in columns:
        by_run.setdefault(c["label"], []).append(pct(c["v"]["device_busy_fraction"]))
    return "; ".join(f"{' and '.join(shares)} on {label}"
                     for label, shares in by_run.items())  # fmt: skip


def section(runs: list[tuple[str, dict, dict, dict]]) -> str:
    """The section: kinds per run and decoder against the floor, the first run's largest
    kernels of the default decoder, and the GEMMs' share of HBM bandwidth. ``runs``: ``(label,
    summary, kernels of :func:`load_kernels`, floor run)`` per :data:`RUNS` entry."""
    names = [n for n, _ in DECODERS]
    columns, every = [], {}
    for label, summary, kernels, floor_run in runs:
        floor_ms, roof = _floor(summary, floor_run)
        for n in names:
            v = summary["variants"][n]
            total = sum(v["device_ms_per_step_by_kind"].values())
            columns.append(dict(label=label, name=n, v=v, rows=kernels[n], floor=floor_ms,
                                roof=roof, total=total, gemm=_gemm_ms(kernels[n])))  # fmt: skip
            every.update(dict.fromkeys(v["device_ms_per_step_by_kind"]))
    kinds = [[kind] + [num(c["v"]["device_ms_per_step_by_kind"].get(kind, 0.0)) for c in columns]
             for kind in every]  # fmt: skip
    kinds.append(["**all kernels**"] + [num(c["total"]) for c in columns])
    kinds.append(["all kernels × the floor"] + [f"{num(c['total'] / c['floor'])}×"
                                                for c in columns])  # fmt: skip
    kinds.append(["kernels per step"] + [num(c["v"]["device_events"] / c["v"]["steps"], 0)
                                         for c in columns])  # fmt: skip
    kinds.append(["GPU busy"] + [pct(c["v"]["device_busy_fraction"]) for c in columns])
    kinds.append(["ms per step (profiled)"] + [num(c["v"]["wall_ms_per_step"]) for c in columns])
    default = [c for c in columns if c["name"] == "breakgraph"]
    compiled = [c for c in columns if c["name"] == "breakgraph_compiled"]
    first = runs[0][1]
    top = [[num(1e3 * r["ms_per_step"], 1), num(r["launches_per_step"], 1), r["kind"],
            f"`{_short(r['name'])}`"] for r in default[0]["rows"][:TOP_KERNELS]]  # fmt: skip
    roof = default[0]["roof"]
    weights_ms = 1e3 * roof["weight_bytes_per_decode_step"] / roof["hbm_bytes_per_s"]
    gemm = [c["gemm"] for c in columns]
    return fill(
        "cb.decode_kernels",
        files=", ".join(f"`{folder}/summary.json`" for _, folder, _ in RUNS),
        floor_files=", ".join(f"`{name}`" for name in FLOOR_FILES),
        device=first["meta"].get("gpu", "?"), torch=first["meta"].get("torch", "?"),
        releases=", ".join(dict.fromkeys(s["meta"].get("transformers", "?")
                                         for _, s, _, _ in runs)),  # fmt: skip
        date=", ".join(dict.fromkeys(s["meta"].get("date", "?") for _, s, _, _ in runs)),
        model=first["meta"]["model"], requests=first["meta"]["args"]["prompts"],
        steps=first["variants"]["breakgraph"]["steps"],
        floor=span([c["floor"] for c in columns], 3),
        kinds=table(["device ms per pure-decode step",
                     *(f"`{c['name']}` {c['label']}" for c in columns)], kinds),  # fmt: skip
        top_release=runs[0][0], again=runs[-1][0],
        top=table(["µs per step", "launches per step", "kind", "kernel"], top),
        gemm=span(gemm), weights_gb=num(roof["weight_bytes_per_decode_step"] / 1e9),
        hbm=num(roof["hbm_bytes_per_s"] / 1e12, 1), weights_ms=num(weights_ms, 3),
        share=f"{span([100 * weights_ms / g for g in gemm], 0)}%",
        gemm_over=span([g / c["floor"] for g, c in zip(gemm, columns)]),
        rest_default=span([c["total"] - c["gemm"] for c in default]),
        elementwise=span([_of_kind(c["rows"], ELEMENTWISE) for c in default]),
        elementwise_launches=span([_of_kind(c["rows"], ELEMENTWISE, "launches_per_step")
                                   for c in default], 0),  # fmt: skip
        attention=span([_of_kind(c["rows"], "attention") for c in default]),
        copies=span([_of_kind(c["rows"], "copies") for c in default]),
        rest_compiled=span([c["total"] - c["gemm"] for c in compiled]),
        fused_launches=span([_of_kind(c["rows"], FUSED, "launches_per_step") for c in compiled],
                            0),  # fmt: skip
        over_default=span([c["total"] / c["floor"] for c in default]),
        over_compiled=span([c["total"] / c["floor"] for c in compiled]),
        room=span([2 * c["floor"] - c["total"] for c in compiled]),
        busy=_busy(columns),
    )
