"""The continuous-batching section of docs/performance.md (from ``benchmarks/bench_cb.py``).

Used by ``benchmarks/report.py`` when ``docs/results/h200-cb.json`` exists::

    python benchmarks/bench_cb.py --out docs/results/h200-cb.json   # on the GPU
    python benchmarks/report.py                                      # the page and img/cb.png
"""

from __future__ import annotations

import os

from . import targets as T

FILE = "h200-cb.json"


def cb_section(data: dict) -> list:
    """Continuous batching (benchmarks/bench_cb.py): throughput, time to first token, graphs."""
    a = data["meta"]["args"]
    lines = [
        "## Continuous batching (transformers `generate_batch` / manager)",
        "",
        f"`python benchmarks/bench_cb.py`: {a['prompts']} prompts of {a['min_len']}-{a['max_len']}"
        f" tokens submitted at once, {a['new_tokens']} greedy tokens each, block size "
        f"{a['block_size']}, {a['num_blocks']} blocks, max_batch_tokens {a['max_batch_tokens']}"
        f" ({data['meta']['dtype']}, random weights). (a) `paged_sdpa`: transformers' CB without"
        " flash_attn (dense mask, no graphs); (b) `breakgraph`: `enable_continuous_batching`, one"
        " graph per query bucket, attention an eager break per layer, synchronous steps"
        " (`use_async_batching=False`); (c) `whole_graph`:"
        " transformers' own whole-step CUDA graphs keyed by query x KV x max_seqlen_k with"
        " upper-bound lengths (torch's varlen kernel, async batching); (d) `generate`:"
        " `model.generate` one prompt at a time, measured on a few prompts and extrapolated;"
        " `breakgraph_async`: (b) with asynchronous batching, the default on CUDA (two IO"
        " pairs sharing one graph per bucket, in runs since the sharing; two graphs per bucket"
        " before)."
        " (c) captures lazily: its row is the second (warm) pass; breakgraph captures every"
        " bucket before serving. Time to first token counts from submission. *Same tokens"
        " as (a)*: the share of prompts whose greedy tokens all equal (a)'s. In bf16 on random"
        " weights the top logits are nearly tied, so any two implementations whose arithmetic"
        " differs (attention kernel, GEMM row count, batch composition) part ways after a few"
        " tokens; `python -m benchmarks.cb_agreement` measures that pairwise, against"
        " `model.generate` too (`docs/results/h200-cb-agreement.log`), and the tests check"
        " token equality in fp32.",
        "",
    ]
    for m in data["models"]:
        lines += [
            f"### {m['model']} ({m['params_m']:.0f}M parameters, "
            f"{m['prompt_tokens']} prompt tokens)",
            "",
            "| variant | tokens/s | TTFT mean s | TTFT p50 s | steps | host ms/step | graphs "
            "| capture s | same tokens as (a) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, v in m["variants"].items():
            if "skipped" in v:
                lines.append(f"| {name} | skipped: {v['skipped']} | | | | | | | |")
                continue
            run = v.get("warm", v)
            steps = run.get("steps", "-")
            host = run.get("host_prepare_ms_per_step")
            agree = v.get("tokens_agree_with_paged_sdpa")
            host = "-" if host is None else f"{host:.1f}"
            agree = "-" if agree is None else f"{100 * agree:.0f}%"
            lines.append(
                f"| {name} | {v['tokens_per_s']:.0f} | {v['ttft_mean_s']:.2f} "
                f"| {v['ttft_p50_s']:.2f} | {steps} | {host} | {v.get('graphs', '-')} "
                f"| {v.get('capture_s', 0.0):.2f} | {agree} |"
            )
        lines += [""] + cb_target_lines(m) + [""]
    return lines


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def cb_target_lines(m: dict) -> list:
    """The issue's targets, met or missed, from the numbers (each breakgraph variant)."""
    r, v = m["ratios"], m["variants"]
    spreads = m.get("ratio_spread", {})

    def rounds(key: str) -> str:  # the spread over rounds, where the run had several
        low_high = spreads.get(key)
        return f", rounds {low_high[0]:.2f}-{low_high[1]:.2f}" if low_high else ""

    eager, whole = T.TARGET_CB_THROUGHPUT_VS_EAGER, T.TARGET_CB_THROUGHPUT_VS_WHOLE_GRAPH
    fewest, capture = T.TARGET_CB_FEWER_GRAPHS, T.TARGET_CB_CAPTURE_S
    lines = []
    for bg in ("breakgraph", "breakgraph_async"):
        if f"{bg}_over_paged_sdpa" in r:
            ratio = r[f"{bg}_over_paged_sdpa"]
            lines.append(
                f"- {bg} throughput vs (a): {ratio:.2f}x (target >= {eager:g}x: "
                f"{_verdict(ratio >= eager)}{rounds(f'{bg}_over_paged_sdpa')})"
            )
        if f"{bg}_over_whole_graph" in r:
            ratio, fewer = r[f"{bg}_over_whole_graph"], r[f"whole_graph_graphs_over_{bg}"]
            lines.append(
                f"- {bg} throughput vs (c): {ratio:.2f}x (target >= {whole:g}x: "
                f"{_verdict(ratio >= whole)}{rounds(f'{bg}_over_whole_graph')}); graphs: "
                f"{v['whole_graph']['graphs']} for (c) "
                f"against {v[bg]['graphs']}, {fewer:.1f}x fewer (target >= {fewest:g}x: "
                f"{_verdict(fewer >= fewest)})"
            )
        if "capture_s" in v.get(bg, {}):
            seconds = v[bg]["capture_s"]
            lines.append(
                f"- {bg} capture time, all buckets: {seconds:.2f} s (target <= {capture:g} s: "
                f"{_verdict(seconds <= capture)}); {v[bg].get('breaks_per_graph', '-')} eager "
                f"breaks per graph, {v[bg].get('eager_steps', 0)} eager steps"
            )
    return lines


def write_cb_plot(data: dict, plt, save: dict, img: str) -> str:
    """Tokens/s per model and variant (log scale)."""
    names = ["paged_sdpa", "breakgraph", "breakgraph_async", "whole_graph", "generate"]
    models = data["models"]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    width = 0.16
    for k, name in enumerate(names):
        values = [m["variants"].get(name, {}).get("tokens_per_s", 0) for m in models]
        if any(values):
            x = [i + (k - 2) * width for i in range(len(models))]
            ax.bar(x, values, width, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("generated tokens/s (log)")
    ax.set_xticks(list(range(len(models))), [m["model"] for m in models])
    ax.set_title("continuous batching, H200, bf16", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(img, "cb.png")
    fig.savefig(path, **save)
    plt.close(fig)
    return path
