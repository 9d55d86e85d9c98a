"""Issue 11.8: breakgraph's graphs after torch.compile(mode="reduce-overhead") in one process.

CUDA graph trees free every cuBLAS workspace around their captures
(``torch._C._cuda_clearCublasWorkspaces``). A captured matmul writes scratch data into
the workspace address it saw at capture; if that memory went back to the ordinary
allocator, replays corrupt whatever tensor got it next. Scenarios, each in a fresh
process, with breakgraph's workspace isolation on (the library) and off (the old behaviour,
which this benchmark restores for its own run: see ``cublas_workspaces``):

  clear     capture a breakable graph, clear the workspaces, fill the freed memory with
            sentinels, replay: are the sentinels intact and the outputs right?
  plain     the same with one plain torch.cuda.graph (what users capture by hand)
  compiled  the issue's sequence: PrefillRunner(compile=True), prefill, then
            torch.compile(model, mode="reduce-overhead") at 32 and 200 tokens, prefill again

Usage (GPU): python -m benchmarks.compile_interplay --out interplay.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator

from .environment import environment

SCENARIOS = ("clear", "plain", "compiled")


def _prepare_cublas_in_the_ordinary_allocator(device: int, stream) -> None:
    """The old preparation: the cuBLAS handles created on the caller's stream, then the
    capture stream's workspace allocated by a matmul on it, in torch's ordinary allocator
    (where ``_cuda_clearCublasWorkspaces`` hands it to other tensors)."""
    import torch

    from breakgraph.backends import cuda as bg_cuda

    bg_cuda._small_matmuls(device)
    with torch.cuda.stream(stream):
        bg_cuda._small_matmuls(device)


@contextlib.contextmanager
def cublas_workspaces(isolated: bool) -> Iterator[None]:
    """Unless ``isolated``, breakgraph's captures prepare cuBLAS the old way for the block
    (the CUDA backend's ``_prepare_cublas``, replaced through ``breakgraph.patches``)."""
    from breakgraph.backends import cuda as bg_cuda
    from breakgraph.patches import patch_attribute

    with contextlib.ExitStack() as stack:
        if not isolated:
            patch_attribute(
                stack, bg_cuda, "_prepare_cublas", _prepare_cublas_in_the_ordinary_allocator
            )
        yield


def _clear(plain: bool) -> dict:
    import torch

    import breakgraph

    torch.manual_seed(0)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)  # split-K: uses the workspace

    @breakgraph.eager_on_graph
    def host(t):
        return t * 1

    graphs = []
    for _ in range(2):
        if plain:
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                (x @ w) @ w  # warm-up on the capture stream, as users do
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(g, stream=side):
                y = (x @ w) @ w
        else:
            g = breakgraph.BreakableCUDAGraph()
            with breakgraph.capture(g):
                y = host(x @ w) @ w
        graphs.append((g, y))
    torch._C._cuda_clearCublasWorkspaces()
    # many small blocks, so some land in the freed workspace (a few MiB to 32 MiB)
    junk = [torch.full((1 << 19,), 7.0, device="cuda") for _ in range(512)]
    worst = 0.0
    for _ in range(10):
        x.copy_(torch.randn_like(x))
        for g, y in graphs:
            g.replay()
            worst = max(worst, float((y - (x @ w) @ w).abs().max() / (x @ w @ w).abs().max()))
    torch.cuda.synchronize()
    intact = all(bool((j == 7.0).all()) for j in junk)
    return {"sentinels_intact": intact, "max_rel_error": worst}


def _compiled() -> dict:
    import torch
    import transformers
    from breakgraph.integrations.transformers import PrefillRunner

    cfg = transformers.Qwen2Config(
        vocab_size=32000, hidden_size=1536, intermediate_size=8960, num_hidden_layers=4,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda().eval()  # fmt: skip
    runner = PrefillRunner(model, (64, 256), compile=True)
    prompts = [torch.randint(32000, (n,)) for n in (30, 150)]

    def worst_error() -> float:
        out = runner.prefill(prompts)
        worst = 0.0
        with torch.no_grad():
            for i, p in enumerate(prompts):
                ref = model(p[None].cuda(), use_cache=False).logits[0, -1].float()
                worst = max(worst, float((out.logits[i].float() - ref).abs().max()))
        return worst

    before = worst_error()
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for n in (32, 200):
            for _ in range(3):
                compiled(torch.randint(32000, (1, n), device="cuda"), use_cache=False)
    after = [worst_error() for _ in range(3)]
    torch.cuda.synchronize()
    return {"max_abs_error_before": before, "max_abs_error_after": max(after)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # scenario:isolate (child process)
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="names, each optionally :1 (isolation on only) or :0 (off only)",
    )
    args = parser.parse_args()
    if args.one:
        name, isolate = args.one.split(":")
        isolate = isolate == "1"
        with cublas_workspaces(isolated=isolate):
            result = _compiled() if name == "compiled" else _clear(name == "plain")
        print("RESULT " + json.dumps(result))
        return
    results = []
    for spec in args.scenarios.split(","):
        name, _, only = spec.partition(":")
        for isolate in (True, False) if not only else (only == "1",):
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.compile_interplay", "--one",
                 f"{name}:{int(isolate)}"],
                capture_output=True, text=True, timeout=400, env=dict(os.environ),
            )  # fmt: skip
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            row = {"scenario": name, "isolated_workspaces": isolate, "returncode": proc.returncode}
            row.update(json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-1500:]})
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": environment(cuda=True), "scenarios": results}, f, indent=1)


if __name__ == "__main__":
    main()
