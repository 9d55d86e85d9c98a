"""The page's section on cuDNN's ragged dense attention path, tried as a cut of capture time.

Why: in a process's first runner most of a bucket's capture time is cuDNN building the plan of
the single-prompt graph's attention for that bucket's length (*Capture time, split*). PyTorch's
opt-in ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` keys those plans on the lengths rounded up to
powers of two and hands the kernel the real lengths, so a 64-bucket ladder needs about ten.
It is read once per process, so each setting ran in processes of its own, taking turns.

The runs: ``benchmarks/capture_time.py --variants default,cudnn_ragged --turns 2``
(:data:`CAPTURE_FILE`) and ``benchmarks/bench_prefill.py`` on two families with the variable
unset and set, in the order of :data:`PREFILL_FILES` (the JSON does not record the variable:
its logs, committed beside them, show PyTorch's warning in the processes that set it).
Example (the committed runs)::

    python -m benchmarks.report   # the whole page, this section included
"""

from __future__ import annotations

import statistics

from . import targets as T
from .template import fill, num, span, table

CAPTURE_FILE = "h200-capture-time-ragged.json"
#: (file, the variable set, turn), in the order the processes ran: off, on | on, off
PREFILL_FILES = (
    ("h200-prefill-ragged-off.json", False, 1),
    ("h200-prefill-ragged-on.json", True, 1),
    ("h200-prefill-ragged-on-2.json", True, 2),
    ("h200-prefill-ragged-off-2.json", False, 2),
)


def _capture_rows(capture: dict) -> tuple[list[list[str]], dict]:
    """One row per family and variant (the turns' values side by side), and each runner's
    mean ms per extra bucket per (family, variant, "first" or "second")."""
    per: dict = {}
    for r in capture["results"]:
        per.setdefault((r["family"], r["variant"]), []).append(r)
    rows, extra = [], {}
    for (family, variant), runs in per.items():
        runs.sort(key=lambda r: r["turn"])
        for which in ("first", "second"):
            extra[(family, variant, which)] = [1000 * r[which]["rest_mean_s"] for r in runs]
        rows.append([
            family, f"`{variant}`", ", ".join("yes" if r["ragged_path_taken"] else "no"
                                              for r in runs),
            ", ".join(num(r["first"]["construction_s"]) for r in runs),
            ", ".join(num(1000 * r["first"]["rest_mean_s"], 0) for r in runs),
            ", ".join(num(r["second"]["construction_s"]) for r in runs),
            ", ".join(num(1000 * r["second"]["rest_mean_s"], 0) for r in runs),
        ])  # fmt: skip
    return rows, extra


def _within(extra: dict) -> str:
    """Per family, how many first runners met the per-bucket capture target with the path
    (``extra``: :func:`_capture_rows`' second value)."""
    limit = 1000 * T.TARGET_CAPTURE_S_PER_EXTRA_BUCKET
    return "; ".join(
        f"{family} {sum(ms <= limit for ms in values)} of {len(values)}"
        for (family, variant, which), values in extra.items()
        if variant == "cudnn_ragged" and which == "first"
    ) + f" (target ≤ {num(limit, 0)} ms)"


def _target(tokens: int) -> float:
    """The prefill target for a prompt of ``tokens`` (``targets.py``: short prompts have their
    own)."""
    if tokens <= T.SHORT_PROMPT_TOKENS:
        return T.TARGET_BG_VS_EXACT_GRAPH_32
    return T.TARGET_BG_VS_EXACT_GRAPH


def _single_rows(runs: list[tuple[dict, bool, int]]) -> dict:
    """``{(family, tokens): {on: [(turn, breakgraph device ms, exact graph device ms, ratio)]}}``
    of the single-prompt rows."""
    out: dict = {}
    for data, on, turn in runs:
        for fam in data["families"]:
            for row in fam["rows"]:
                if row["kind"] != "single":
                    continue
                host, ms = row["host"], row["ms"]
                out.setdefault((fam["family"], row["tokens"]), {}).setdefault(on, []).append((
                    turn, host["breakgraph"]["device_ms"], host["hf_graph"]["device_ms"],
                    ms["breakgraph"] / ms["hf_graph"]))  # fmt: skip
    return out


def section(capture: dict, runs: list[tuple[dict, bool, int]]) -> str:
    """``capture``: :data:`CAPTURE_FILE`; ``runs``: ``(data, on, turn)`` of
    :data:`PREFILL_FILES`, loaded, in their order."""
    capture_rows, extra = _capture_rows(capture)
    families = list(dict.fromkeys(f for f, *_ in extra))

    def cuts(which: str) -> str:
        return "; ".join(f"{family} {span(extra[(family, 'default', which)], 0)} → "
                         f"{span(extra[(family, 'cudnn_ragged', which)], 0)} ms"
                         for family in families)  # fmt: skip

    singles = _single_rows(runs)
    rows, added, graph_moves, over, over_off = [], [], [], 0, 0
    for (family, tokens), by in singles.items():
        off, on = sorted(by[False]), sorted(by[True])
        layers = next(f["config"]["num_hidden_layers"] for f in runs[0][0]["families"]
                      if f["family"] == family)  # fmt: skip
        for (t, bg_off, hf_off, r_off), (_, bg_on, hf_on, r_on) in zip(off, on):
            added.append(1000 * (bg_on - bg_off) / layers)
            graph_moves.append(hf_on / hf_off - 1)
            over += r_on > _target(tokens)
            over_off += r_off > _target(tokens)
            rows.append([
                family, str(tokens), str(t), f"{num(bg_off, 3)} → {num(bg_on, 3)}",
                f"{num(hf_off, 3)} → {num(hf_on, 3)}", f"{num(r_off, 3)} → {num(r_on, 3)}",
            ])  # fmt: skip
    meta = capture["meta"]
    return fill(
        "prefill.cudnn_ragged",
        capture_file=f"`{CAPTURE_FILE}`",
        prefill_files=", ".join(f"`{name}`" for name, *_ in PREFILL_FILES),
        device=meta.get("gpu", "?"), torch=meta.get("torch", "?"),
        transformers=meta.get("transformers", "?"), date=meta.get("date", "?"),
        capture_table=table(["family", "variant", "ragged path taken", "first runner s",
                             "ms per extra bucket", "second runner s", "ms per extra bucket"],
                            capture_rows),  # fmt: skip
        cuts=cuts("first"), second=cuts("second"),
        within=_within(extra),
        prefill_table=table(["family", "tokens", "turn", "breakgraph device ms, off → on",
                             "exact graph device ms, off → on", "breakgraph / exact graph"],
                            rows),  # fmt: skip
        added=span(added, 0), added_median=num(statistics.median(added), 0),
        graph_moves=f"{span([100 * g for g in graph_moves], 1)}%",
        over=f"{over} of {len(rows)}",
        target=span([T.TARGET_BG_VS_EXACT_GRAPH_32, T.TARGET_BG_VS_EXACT_GRAPH]),
        over_off=f"{over_off} of {len(rows)}",
    )
