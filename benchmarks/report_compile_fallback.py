"""The page's section on ``compile=True``'s eager fallback: a batch longer than the ladder.

Why: such a batch runs the compiled forward eagerly; with inputs of their own (before
``StepBuffers.wide_inputs``) it compiled the model's frames again inside the call.

The runs: ``benchmarks/compile_eager_fallback.py``, the variants in processes of their own,
taking turns (:data:`CPU_FILES`; :data:`GPU_FILES` once ``scripts/gpu_check.sh``'s
``RUN_COMPILE_FALLBACK`` section has run on a GPU). Example (the committed runs)::

    python -m benchmarks.report   # the whole page, this section included
"""

from __future__ import annotations

from .template import fill, num, span, table

#: (file, variant, turn) in the order the processes ran: separate, wide | wide, separate
CPU_FILES = tuple((f"cpu-compile-eager-fallback-{v}-{t}.json", v, t)
                  for t, v in enumerate(("separate", "wide", "wide", "separate"), 1))  # fmt: skip
GPU_FILES = tuple((f"h200-compile-eager-fallback-{v}-{t}.json", v, t)
                  for t, v in enumerate(("separate", "wide", "wide", "separate"), 1))  # fmt: skip


def _rows(runs: list) -> list[list[str]]:
    """One row per family, variant and turn: construction, then each batch's two calls."""
    rows = []
    for data, variant, turn in runs:
        for fam in data["families"]:
            calls = {}
            for c in fam["calls"]:
                calls.setdefault(tuple(c["lengths"]), []).append(c)
            cells = [
                f"{num(pair[0]['seconds'], 3)} ({pair[0]['frames']}), "
                f"{num(pair[1]['seconds'], 3)} ({pair[1]['frames']})"
                for pair in calls.values()
            ]
            rows.append([fam["family"], f"`{variant}`", str(turn),
                         num(fam["construction_s"]), *cells])  # fmt: skip
    return rows


def _first_calls(runs: list, variant: str) -> tuple[list[float], list[int]]:
    """The first over-ladder call of every family in ``variant``'s runs: seconds, frames."""
    firsts = [fam["calls"][0] for data, v, _ in runs if v == variant
              for fam in data["families"]]  # fmt: skip
    return [c["seconds"] for c in firsts], [c["frames"] for c in firsts]


def section(runs: list, on_gpu: bool) -> str:
    """``runs``: ``(data, variant, turn)`` in the order they ran; ``on_gpu``: whether they are
    the GPU's runs (:data:`GPU_FILES`) or the CPU's (:data:`CPU_FILES`)."""
    first = runs[0][0]
    meta = first["meta"]
    batches = [c["lengths"] for c in first["families"][0]["calls"] if c["repeat"] == 1]
    header = ["family", "variant", "turn", "construction s"]
    header += [f"{' + '.join(map(str, b))} tokens: s (frames), again" for b in batches]
    sep_s, sep_frames = _first_calls(runs, "separate")
    wide_s, wide_frames = _first_calls(runs, "wide")
    later = sum(c["frames"] for data, *_ in runs for fam in data["families"]
                for c in fam["calls"][1:])  # fmt: skip
    files = CPU_FILES if not on_gpu else GPU_FILES
    return fill(
        "prefill.compile_fallback",
        files="`, `".join(name for name, *_ in files),
        device=meta.get("gpu") or "a 2-core CPU VM (the emulated backend, AOT autograd without "
        "Inductor)",
        torch=meta.get("torch", "?"),
        transformers=meta.get("transformers", "?"),
        date=meta.get("date", "?"),
        buckets=", ".join(map(str, first["families"][0]["buckets"])),
        table=table(header, _rows(runs)),
        sep_frames=span(sep_frames, 0),
        sep_s=span(sep_s, 2),
        wide_frames=span(wide_frames, 0),
        wide_s=span(wide_s, 3),
        later="compiled nothing either way" if not later
        else f"compiled {later} frame{'' if later == 1 else 's'} in all",
        gpu_note=fill("prefill.compile_fallback.gpu_note", again=span(_first_over_again(runs), 1))
        .rstrip("\n") if on_gpu else fill("prefill.compile_fallback.gpu_pending").strip("\n"),
    )


def _first_over_again(runs: list) -> list[float]:
    """``wide``: each batch's first call over its repeat (no frames compiled in either)."""
    ratios = []
    for data, variant, _ in runs:
        if variant != "wide":
            continue
        for fam in data["families"]:
            calls = {}
            for c in fam["calls"]:
                calls.setdefault(tuple(c["lengths"]), []).append(c["seconds"])
            ratios += [pair[0] / pair[1] for pair in calls.values() if len(pair) == 2]
    return ratios
