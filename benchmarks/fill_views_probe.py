"""The block-table fill's own cost per request, this tree against an earlier one, in turn.

``block_table.fill_block_table`` writes one request's block ids into its view of a host
table; transformers calls it once per request of every pure-decode step, with a fresh view
(``table[:, i]``). A whole-step profile (``benchmarks/cb_prep_profile``) moves with the host's
drift by more than a change to this one call, so this times the call alone: the earlier
tree's function (read from git, ``--before``) and this tree's, taking turns round by round in
one process, on the same table, cache layout and requests. A step is every request's call,
with the view made as transformers makes it; the two layouts are transformers 5.17's (one
manager per layer group) and later releases' (allocators), built as plain objects::

    python -m benchmarks.fill_views_probe --before d092991 --out fill-views-probe.json
    # without git (the device machine): that revision's file, carried
    git show d092991:integrations/transformers/block_table.py > .device/block_table_before.py
    python -m benchmarks.fill_views_probe --before d092991 \
        --before-file .device/block_table_before.py --out fill-views-probe.json

Host only (the table is in host memory, as asynchronous batching's pinned table is): the
ratio carries over between machines, the µs do not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

from benchmarks.environment import environment

MODULE = "integrations/transformers/block_table.py"


def load_before(revision: str, path: str | None = None):
    """``fill_block_table`` of ``revision``'s block_table.py (or of the file at ``path``: a
    copy without git, e.g. on the device machine), imported beside this tree's (its relative
    imports resolve in this tree's package)."""
    if path is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        source = subprocess.run(["git", "show", f"{revision}:{MODULE}"], cwd=root, check=True,
                                capture_output=True, text=True).stdout  # fmt: skip
        path = os.path.join(tempfile.mkdtemp(prefix="fill-before-"), "block_table.py")
        with open(path, "w") as f:
            f.write(source)
    name = "integrations.transformers._block_table_before"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.fill_block_table


def layouts(requests: int, page: int, seed: int = 0) -> dict:
    """``{layout: (cache, [(request id, past length)])}``: each request holds 1-4 pages of
    keys (prompts of up to 1,024 tokens, pages of ``page``)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randint(16, 4 * page, (requests,), generator=generator).tolist()
    ids = {f"req_{i}": list(range(i * 8, i * 8 + -(-n // page))) for i, n in enumerate(keys)}
    steps = [(f"req_{i}", n - 1) for i, n in enumerate(keys)]
    manager = SimpleNamespace(block_size=page, block_table=ids)
    allocator = SimpleNamespace(index=0, tokens_per_page=page, block_physical_stride=page,
                                block_table=ids)  # filed by type, as 5.18's (no layer_type)
    return {
        "5.17 (managers)": (Cache(group_cache_managers=[manager]), steps),
        "5.18+ (allocators)": (Cache(cache_allocators={"full_attention": allocator}), steps),
    }


class Cache:
    """A paged cache's layout attributes (weakly referenceable, as transformers' cache is: the
    fill keeps what it learnt of a cache per cache object)."""

    def __init__(self, **layout) -> None:
        self.__dict__.update(layout)


def time_step(fill, cache, steps, table: torch.Tensor, repeats: int) -> float:
    """µs per request of ``repeats`` steps (every request's call, a fresh view each)."""
    start = time.perf_counter()
    for _ in range(repeats):
        for slot, (request_id, past) in enumerate(steps):
            fill(None, cache, request_id, past, 1, table[:, slot])
    return (time.perf_counter() - start) / (repeats * len(steps)) * 1e6


def run(before: str, requests: int, rounds: int, repeats: int,
        before_file: str | None = None) -> dict:  # fmt: skip
    from breakgraph.integrations.transformers.block_table import fill_block_table

    fills = {"before": load_before(before, before_file), "after": fill_block_table}
    result = {}
    for layout, (cache, steps) in layouts(requests, page=256).items():
        tables = {name: torch.full((1, requests, 64), -1, dtype=torch.int32) for name in fills}
        for name, fill in fills.items():  # warm-up; the two write the same values
            time_step(fill, cache, steps, tables[name], 2)
        assert torch.equal(tables["before"], tables["after"]), "the two trees wrote different ids"
        per_round = {name: [] for name in fills}
        for turn in range(rounds):
            order = list(fills) if turn % 2 == 0 else list(reversed(fills))
            for name in order:
                per_round[name].append(time_step(fills[name], cache, steps, tables[name], repeats))
        ratios = [a / b for a, b in zip(per_round["after"], per_round["before"])]
        result[layout] = {
            **{f"{name}_us": statistics.median(v) for name, v in per_round.items()},
            "rounds_us": per_round,
            "after_over_before": statistics.median(ratios),
            "after_over_before_rounds": [min(ratios), max(ratios)],
        }
        print(f"{layout}: {result[layout]['before_us']:.2f} -> {result[layout]['after_us']:.2f} "
              f"us per request ({result[layout]['after_over_before']:.2f}x)", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the earlier tree's git revision")
    parser.add_argument("--before-file", help="that revision's block_table.py, where there is "
                        "no git (default: read with git show)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=50, help="steps per round and tree")
    args = parser.parse_args(argv)
    settings = {"before": args.before, "requests": args.requests, "rounds": args.rounds,
                "repeats": args.repeats, "page": 256, "table": [1, args.requests, 64]}  # fmt: skip
    data = {"meta": environment(cuda=False), "settings": settings,
            "layouts": run(args.before, args.requests, args.rounds, args.repeats,
                           args.before_file)}  # fmt: skip
    data["meta"]["gpu"] = f"none ({os.cpu_count()} CPU cores)"
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
