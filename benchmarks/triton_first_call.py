"""What the first call of each ``paged_decode`` kernel variant costs a process (CUDA only).

Triton compiles a kernel the first time it is called with a new set of compile-time
constants (here the heads, the head size and the page size; until the split pair served every
split count, the split count too), then keeps the
binary in its on-disk cache (``TRITON_CACHE_DIR``, ``~/.triton/cache`` by default); a later
process loads it from there. A continuous-batching server pays that compile inside the step
that first needs the variant (a pure-decode graph's capture, or an attention break), unless
something compiled it before serving. This times, for every CB shape's heads, both kinds of
read index (``page`` 0: flat index; the block size: transformers' block table) and every
split count, the first call and the second (synchronised, host wall clock), in a process
that starts with whatever cache ``TRITON_CACHE_DIR`` holds: run it twice on one empty
directory to see the compile, then the load from disk::

    export TRITON_CACHE_DIR=$(mktemp -d)
    python -m benchmarks.triton_first_call --label cold --out first-call-cold.json
    python -m benchmarks.triton_first_call --label disk --out first-call-disk.json

The inputs are not laid out exactly as a decode graph's (a flat read index of ``int32``
here, ``int64`` there; a block table two entries wide here, a multiple of sixteen there), so
these are not the very binaries a server compiles; the compile and load times compare.

``--from-log`` rebuilds a run's JSON from what it printed (with ``--meta-from``, a JSON of the
same call for the machine's metadata), for a run whose JSON was not written.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch
from breakgraph.integrations.transformers.paged_decode import paged_decode

from benchmarks.decode_attention import SHAPES
from benchmarks.environment import environment

SPLITS = (1, 2, 4, 8, 16)
PAGES = (0, 256)


def _inputs(q_heads: int, kv_heads: int, head_dim: int, page: int, batch: int = 4) -> tuple:
    """A small decode step: ``batch`` sequences of 300 keys each in a 2048-row cache."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(2048, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    keys = 300
    cu_k = torch.arange(0, (batch + 1) * keys, keys, device=device, dtype=torch.int32)
    if page:
        blocks = 2048 // page
        table = torch.randperm(blocks, device=device, dtype=torch.int32)[: batch * 2]
        index = table.view(batch, 2)  # 2 pages of 256 hold 300 keys
    else:
        index = torch.randperm(2048, device=device)[: batch * keys].to(torch.int32)
    return q, k, v, index, cu_k


def first_calls(shapes=SHAPES, pages=PAGES, splits=SPLITS) -> list[dict]:
    """One row per (shape, page, split): first and second call in ms, host wall clock."""
    rows = []
    for name, q_heads, kv_heads, head_dim in shapes:
        for page in pages:
            q, k, v, index, cu_k = _inputs(q_heads, kv_heads, head_dim, page)
            for s in splits:
                times = []
                for _ in range(2):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    paged_decode(q, k, v, index, cu_k, head_dim**-0.5, splits=s, page=page)
                    torch.cuda.synchronize()
                    times.append(1e3 * (time.perf_counter() - start))
                rows.append({"shape": name, "heads": [q_heads, kv_heads, head_dim],
                             "page": page, "splits": s, "first_ms": times[0],
                             "second_ms": times[1]})  # fmt: skip
    return rows


_LINE = re.compile(r"^\s*(\S+) page\s+(\d+) splits\s+(\d+):\s+([\d.]+) ms, then ([\d.]+) ms$")


def rows_from_log(text: str) -> list[dict]:
    """The rows of a run from what it printed (``main``'s lines), for a run whose JSON was
    not written; the heads come from :data:`SHAPES`.

    >>> rows_from_log("  llama3-8b-4l page 256 splits  2:    612.5 ms, then 0.216 ms")
    [{'shape': 'llama3-8b-4l', 'heads': [32, 8, 128], 'page': 256, 'splits': 2, 'first_ms': 612.5, 'second_ms': 0.216}]
    """  # noqa: E501
    heads = {name: [q, kv, d] for name, q, kv, d in SHAPES}
    rows = []
    for line in text.splitlines():
        if (m := _LINE.match(line)) is not None:
            rows.append({"shape": m[1], "heads": heads[m[1]], "page": int(m[2]),
                         "splits": int(m[3]), "first_ms": float(m[4]),
                         "second_ms": float(m[5])})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", required=True, help="cold (empty cache) or disk")
    parser.add_argument("--out", required=True)
    parser.add_argument("--from-log", help="rebuild the JSON from a run's printed output")
    parser.add_argument("--meta-from", help="with --from-log: a JSON of the same machine and call "
                        "whose meta to take")  # fmt: skip
    args = parser.parse_args()
    if args.from_log:
        with open(args.from_log) as f:
            rows = rows_from_log(f.read())
        with open(args.meta_from) as f:
            meta = json.load(f)["meta"]
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "label": args.label, "rows": rows,
                       "rebuilt_from_log": True}, f, indent=1)  # fmt: skip
        return
    start = time.perf_counter()
    rows = first_calls()
    total = time.perf_counter() - start
    first = sum(r["first_ms"] for r in rows)
    print(f"{args.label}: {len(rows)} variants, first calls {first / 1e3:.2f} s in all "
          f"({total:.1f} s)")  # fmt: skip
    for r in rows:
        print(f"  {r['shape']:>15} page {r['page']:>3} splits {r['splits']:>2}: "
              f"{r['first_ms']:8.1f} ms, then {r['second_ms']:.3f} ms")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"meta": environment(cuda=True), "label": args.label, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
