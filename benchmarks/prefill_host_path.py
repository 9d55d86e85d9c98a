"""Where the host time of one ``PrefillRunner.prefill`` call goes, stage by stage (issue 23).

On the CPU (the emulated backend; the graph replay is stubbed, so only the host path runs)::

    python -m benchmarks.prefill_host_path                  # 32 tokens, a tiny Llama
    python -m benchmarks.prefill_host_path --compare .baseline   # the same, old code and new

On a GPU (real replays; CUDA events; a ``torch.profiler`` trace per workload under ``--out``),
before and after in one run: the old code is a checkout at ``--compare`` (each tree is timed in
a process of its own, with that tree first on ``PYTHONPATH``)::

    python -m benchmarks.prefill_host_path --device cuda --compare .baseline --out "$OUT"

What one call is cut into (each piece is the runner's own method, wrapped for the timed pass
by an instance attribute, removed afterwards; the graph's replay steps are wrapped by
swapping the graph's ``Captured`` record for the pass):

* ``validate``, ``write_ids``, ``decide``, ``commit``: ``PrefillRunner._validate``, the step
  buffers' ``write_ids`` and ``commit``, ``BucketedRunner.decide``;
* ``batch``: the ``PackedBatch`` the breaks read;
* ``replay -> launch``: from entering ``BucketedRunner.replay`` to the first segment's launch;
* ``glue``: what ``prefill`` itself does between them (entry to launch minus the stages);
* ``entry -> launch``: the sum: the host time before the device has anything to run;
* after the launch: ``segments`` and ``breaks`` (host time of the graph's steps; on the
  emulated backend with the replay stubbed there are none) and ``output`` (from the replay's
  return to ``prefill``'s: slicing, the ``owned=True`` clone, ``PrefillOutput``); ``clone``
  is also timed alone.

A second pass times the call with only the launch probe (``entry -> launch, probe only``) and
a third with nothing wrapped (``return, unwrapped``): the wrappers' own cost is the difference.
On CUDA, events recorded at entry, at the launch and at return give what the device saw: the
gap before the first kernel of the graph (the host path, plus the input copies) and the
graph's own time; and the variants take turns (``benchmarks.timing.interleaved``): the default
runner, its one-graph variant (``benchmarks.one_graph`` on the buckets it used) and the
exact-length whole-forward graph (``benchmarks.baselines.exact_length_graph``), as in
``benchmarks/bench_prefill.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch

from benchmarks import families as _families

# absolute imports: --compare runs this file with another checkout's packages first on the path
from benchmarks.baselines import exact_length_graph, hf_eager
from benchmarks.families import SMOKE_FAMILIES, Family, config_summary, make_model
from benchmarks.timing import DeviceClock, interleaved, no_sync

try:
    from benchmarks.environment import environment
except ModuleNotFoundError:  # an older tree (--compare) without it: this file's own folder
    from environment import environment  # type: ignore[no-redef]

SCHEMA = "breakgraph-prefill-host-path/1"
STAGES = ("validate", "write_ids", "decide", "commit", "batch", "replay -> launch", "glue")


#: The two small shapes of issue 23 item 1 (4 layers each), where a fixed per-call cost shows
#: (defined with the prefill benchmark's families; a ``--compare`` tree from before they moved
#: there cannot run them).
SMALL_SHAPES = ("mistral-sw256-4l", "mixtral-1k-4l")
FAMILIES: dict[str, Family] = {
    n: _families.FAMILIES[n] for n in SMALL_SHAPES if n in _families.FAMILIES
}
ALL_FAMILIES = {**FAMILIES, **SMOKE_FAMILIES}


# -- instrumentation -----------------------------------------------------------------------------


class Marks:
    """The timestamps and stage durations of the call being timed (seconds)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.stages: dict[str, float] = {}
        self.replay_in = self.launch = self.replay_out = None
        self.segments = self.breaks = 0.0
        self.launch_event = None

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds


def _timed(marks: Marks, stage: str, inner: Callable) -> Callable:
    clock = time.perf_counter

    def timed(*args, **kwargs):
        start = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            marks.add(stage, clock() - start)

    return timed


def _launch_probe(marks: Marks, first: Callable | None, event: bool) -> Callable:
    clock = time.perf_counter

    def launch() -> None:
        if marks.launch is None:
            marks.launch = clock()
            if event:
                marks.launch_event = torch.cuda.Event(enable_timing=True)
                marks.launch_event.record()
        if first is not None:
            start = clock()
            first()
            marks.segments += clock() - start

    return launch


def _step_timer(marks: Marks, step: Callable, kind: str) -> Callable:
    clock = time.perf_counter

    def run() -> None:
        start = clock()
        step()
        setattr(marks, kind, getattr(marks, kind) + clock() - start)

    return run


@contextlib.contextmanager
def instrumented(
    runner, marks: Marks, *, stages: bool, stub: bool, event: bool = False
) -> Iterator[None]:
    """Wrap the runner's per-call pieces (``stages``) and every graph's replay steps for the
    block; ``stub``: the graphs replay nothing (only the launch probe runs)."""
    from breakgraph.integrations.transformers import attention

    from breakgraph.patches import patch_attribute

    graphs = _graphs(runner)
    saved = {bucket: g._captured for bucket, g in graphs.items()}
    with contextlib.ExitStack() as stack:
        for bucket, graph in graphs.items():
            captured = saved[bucket]
            if stub:
                steps = (_launch_probe(marks, None, event),)
            else:
                segments = [s.replay for s in captured.segments]
                steps = [_launch_probe(marks, captured.steps[0], event)]
                for step in captured.steps[1:]:
                    kind = "segments" if any(step == s for s in segments) else "breaks"
                    steps.append(_step_timer(marks, step, kind))
                steps = tuple(steps)
            graph._captured = dataclasses.replace(captured, steps=steps)
        stack.callback(_restore, graphs, saved)
        for ladder in _ladders(runner):  # packed graphs, and single-prompt ones if any
            patch_attribute(stack, ladder, "replay", _replay_marked(marks, ladder.replay))
        if stages:
            patch_attribute(stack, runner, "_validate", _timed(marks, "validate", runner._validate))
            steps = runner._steps
            for name in ("write_ids", "commit"):
                patch_attribute(stack, steps, name, _timed(marks, name, getattr(steps, name)))
            decide = _timed(marks, "decide", runner._runner.decide)
            patch_attribute(stack, runner._runner, "decide", decide)
            batch = _timed(marks, "batch", attention.PackedBatch)
            patch_attribute(stack, attention, "PackedBatch", batch)
        yield


def _ladders(runner) -> list:
    """The runner's ``BucketedRunner`` s: the packed graphs' and the single-prompt graphs'."""
    return [r for r in (runner._runner, getattr(runner, "_single", None)) if r is not None]


def _replay_marked(marks: Marks, replay: Callable) -> Callable:
    clock = time.perf_counter

    def replay_marked(*args, **kwargs):
        marks.replay_in = clock()
        try:
            return replay(*args, **kwargs)
        finally:
            marks.replay_out = clock()

    return replay_marked


@contextlib.contextmanager
def stubbed(runner) -> Iterator[None]:
    """Every graph of ``runner`` replays nothing for the block (its replay() still runs)."""
    graphs = _graphs(runner)
    saved = {bucket: g._captured for bucket, g in graphs.items()}
    for bucket, graph in graphs.items():
        graph._captured = dataclasses.replace(saved[bucket], steps=())
    try:
        yield
    finally:
        _restore(graphs, saved)


def _graphs(runner) -> dict:
    """Every graph a call may replay (``PrefillRunner.graphs``; an older tree, ``--compare``,
    has only the packed graph of each bucket)."""
    if hasattr(runner, "graphs"):
        return runner.graphs()
    return {bucket: runner.graph(bucket) for bucket in runner.buckets}


def _restore(graphs: dict, saved: dict) -> None:
    for bucket, graph in graphs.items():
        graph._captured = saved[bucket]


def breakdown(
    runner,
    prompts: list,
    *,
    iters: int,
    stub: bool,
    sync: Callable[[], None] = no_sync,
    rounds: int = 10,
) -> dict:
    """Host microseconds of each stage of ``runner.prefill(prompts)`` (see the module
    docstring), the device idle at the start of each call: the three passes take turns in
    ``rounds`` rounds of ``iters // rounds`` calls each; a stage's number is the lowest of its
    per-round medians (a shared, busy host inflates some rounds, never deflates one)."""
    marks = Marks()
    rounds_of: dict[str, list[list[float]]] = {}
    calls = max(1, iters // rounds)

    def note(name: str, seconds: float | None) -> None:
        if seconds is not None:
            rounds_of.setdefault(name, [[]])[-1].append(seconds)

    for r in range(rounds):
        for values in rounds_of.values():
            values.append([])
        _stages_pass(runner, prompts, marks, note, calls, stub, sync, warm=r == 0)
        _probe_pass(runner, prompts, marks, note, calls, stub, sync)
        _plain_pass(runner, prompts, note, calls, stub, sync)
    return {
        name: min(statistics.median(v) for v in values if v) * 1e6
        for name, values in rounds_of.items()
    }


def _stages_pass(runner, prompts, marks, note, calls, stub, sync, warm) -> None:
    """Every stage wrapped."""
    with instrumented(runner, marks, stages=True, stub=stub):
        for _ in range(3 if warm else 0):
            runner.prefill(prompts)
        for _ in range(calls):
            sync()
            marks.reset()
            start = time.perf_counter()
            runner.prefill(prompts)
            end = time.perf_counter()
            if marks.launch is None:
                raise RuntimeError("prefill_host_path: the call replayed no graph (eager?)")
            to_launch = marks.launch - start
            for stage in STAGES[:-2]:
                note(stage, marks.stages.get(stage, 0.0))
            note("replay -> launch", marks.launch - marks.replay_in)
            note("glue", to_launch - sum(marks.stages.values()) - (marks.launch - marks.replay_in))
            note("entry -> launch", to_launch)
            note("segments", marks.segments)
            note("breaks", marks.breaks)
            note("output", end - marks.replay_out)
            note("return", end - start)
        sync()


def _probe_pass(runner, prompts, marks, note, calls, stub, sync) -> None:
    """Only the launch probe (and the replay marks)."""
    with instrumented(runner, marks, stages=False, stub=stub):
        for _ in range(calls):
            sync()
            marks.reset()
            start = time.perf_counter()
            runner.prefill(prompts)
            end = time.perf_counter()
            note("entry -> launch, probe only", marks.launch - start)
            note("return, probe only", end - start)
        sync()


def _plain_pass(runner, prompts, note, calls, stub, sync) -> None:
    """Nothing wrapped (with ``stub``, the graphs still replay nothing); then the clone alone."""
    with stubbed(runner) if stub else contextlib.nullcontext():
        for _ in range(calls):
            sync()
            start = time.perf_counter()
            runner.prefill(prompts)
            note("return, unwrapped", time.perf_counter() - start)
        for _ in range(calls):
            sync()
            start = time.perf_counter()
            runner.prefill(prompts, owned=False)
            note("return, owned=False", time.perf_counter() - start)
        logits = runner.prefill(prompts, owned=False).logits
        for _ in range(calls):
            sync()
            start = time.perf_counter()
            logits.clone()
            note("clone (alone)", time.perf_counter() - start)
        sync()


def device_view(runner, prompts: list, *, iters: int) -> dict:
    """CUDA events at entry, at the first segment's launch and at return: what the device saw
    (milliseconds; the device is idle at entry, so the entry -> launch gap is host time plus
    the input copies the call issued before the launch)."""
    marks = Marks()
    gaps, graph_ms, total = [], [], []
    with instrumented(runner, marks, stages=False, stub=False, event=True):
        for _ in range(3):
            runner.prefill(prompts)
        for _ in range(iters):
            torch.cuda.synchronize()
            marks.reset()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.prefill(prompts)
            end.record()
            end.synchronize()
            gaps.append(start.elapsed_time(marks.launch_event))
            graph_ms.append(marks.launch_event.elapsed_time(end))
            total.append(start.elapsed_time(end))
    return {
        "entry_to_launch_ms": statistics.median(gaps),
        "launch_to_return_ms": statistics.median(graph_ms),
        "call_ms": statistics.median(total),
    }


def _ranged(inner: Callable, name: str) -> Callable:
    from torch.profiler import record_function

    label = f"prefill.{name.lstrip('_')}"

    def ranged(*args, **kwargs):
        with record_function(label):
            return inner(*args, **kwargs)

    return ranged


def profile(runner, prompts: list, path: str, calls: int = 3) -> str:
    """A ``torch.profiler`` trace of ``calls`` calls (CPU and CUDA activity), each stage a
    named range, written as a Chrome trace to ``path``."""
    from torch.profiler import ProfilerActivity, record_function

    from breakgraph.patches import patch_attribute

    with contextlib.ExitStack() as stack:
        steps = runner._steps
        pieces = ((runner, "_validate"), (steps, "write_ids"), (runner._runner, "decide"),
                  (steps, "commit"), (runner._runner, "replay"))  # fmt: skip
        for owner, name in pieces:
            patch_attribute(stack, owner, name, _ranged(getattr(owner, name), name))
        runner.prefill(prompts)
        torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(calls):
                with record_function("prefill"):
                    runner.prefill(prompts)
                torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return path


# -- one tree: the runs --------------------------------------------------------------------------


@dataclasses.dataclass
class Settings:
    device: str = "cpu"
    families: list[str] = dataclasses.field(default_factory=lambda: ["tiny-llama"])
    sizes: list[int] = dataclasses.field(default_factory=lambda: [32])
    iters: int = 1000
    rounds: int = 5
    turns: int = 10
    prompt_device: str = "same"  # where the prompts live: "same" as the model, or "cpu"
    split: int = 0  # also time each workload split into this many prompts (0: not)
    out: str | None = None
    trace: bool = True
    neighbours: bool = False  # also take turns beside HF eager and beside pure host work

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def one_graph_runner(model, **kwargs):
    """The one-graph variant (``benchmarks/one_graph.py``) where the timed tree has it; older
    trees (``--compare``) had it as ``PrefillRunner(attention="captured")``."""
    try:
        from benchmarks.one_graph import OneGraphPrefillRunner
    except ModuleNotFoundError as missing:
        if missing.name != "benchmarks.one_graph":
            raise
        from breakgraph.integrations.transformers import PrefillRunner

        return PrefillRunner(model, attention="captured", **kwargs)
    return OneGraphPrefillRunner(model, **kwargs)


def measure_family(settings: Settings, family: Family) -> dict:
    from breakgraph.integrations.transformers import PrefillRunner

    cuda = settings.cuda
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else no_sync
    model = make_model(family.config(), settings.device, dtype)
    result: dict = {"family": family.name, "shape": family.shape}
    result["config"] = config_summary(model.config)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    where = settings.device if settings.prompt_device == "same" else settings.prompt_device
    prompts = {n: torch.randint(vocab, (n,), generator=g).to(where) for n in settings.sizes}
    closers: list[Callable[[], None]] = []
    try:
        start = time.perf_counter()
        if cuda:  # default settings
            runner = PrefillRunner(model)
        else:  # a short ladder: the emulated backend captures slowly, and the replay is stubbed;
            # single-prompt graphs as on CUDA (one prompt replays them)
            runner = PrefillRunner(
                model, token_buckets=(32, 64, 256, 512), backend="emulated",
                single_prompt_graphs=True,
            )  # fmt: skip
        closers.append(runner.close)
        sync()
        result["construction_s"] = time.perf_counter() - start
        result["buckets"] = len(runner.buckets)
        result["routed"] = {str(k): v for k, v in runner.stats.routed.items()}
        one = graphs = None
        if cuda:
            used = sorted({runner._runner.bucket_for(n) for n in settings.sizes})
            one = one_graph_runner(model, token_buckets=used, max_prompts=runner.max_prompts)
            closers.append(one.close)
            pool = torch.cuda.graph_pool_handle()
            graphs = {}
            for n in sorted(prompts, reverse=True):  # largest first: the pool is reused
                graphs[n] = exact_length_graph(model, prompts[n].to(settings.device), pool=pool)
                closers.append(graphs[n].close)
        result["rows"] = []
        for n, p in prompts.items():
            row: dict = {"tokens": n, "bucket": runner._runner.bucket_for(n)}
            graph = runner.prefill([p])._graph  # (bucket, single prompt?)
            row["graph"] = "single-prompt" if graph and graph[1] else "packed"
            row["host_us"] = breakdown(runner, [p], iters=settings.iters, stub=not cuda, sync=sync)
            if settings.split > 1:  # the same tokens as a batch of prompts
                row[f"host_us, {settings.split} prompts"] = breakdown(
                    runner, list(p.chunk(settings.split)), iters=settings.iters, stub=not cuda,
                    sync=sync,
                )  # fmt: skip
            if cuda:
                if n == min(prompts) and p.is_cuda:  # a serving caller's token ids: on the host
                    row["host_us, host prompt"] = breakdown(
                        runner, [p.cpu()], iters=settings.iters, stub=False, sync=sync
                    )
                row["device_ms"] = device_view(runner, [p], iters=max(10, settings.iters // 10))
                fresh = p.to(settings.device)[None]
                fns = {
                    "breakgraph": lambda p=p: runner.prefill([p]),
                    "bg_one_graph": lambda p=p: one.prefill([p]),
                    "hf_graph": lambda n=n, fresh=fresh: graphs[n](input_ids=fresh),
                }
                row.update(ratios(settings, fns))
                if settings.neighbours:
                    row["neighbours"] = neighbours(settings, fns, model, p)
                if settings.trace and settings.out:
                    name = f"trace-{settings_tag()}-{family.name}-{n}.json.gz"
                    row["trace"] = profile(runner, [p], os.path.join(settings.out, name))
            result["rows"].append(row)
    finally:
        for close in closers:
            close()
        del model
        if cuda:
            torch.cuda.empty_cache()
    return result


def ratios(settings: Settings, fns: dict) -> dict:
    """The variants' wall time per call, taking turns (``interleaved``, as bench_prefill), and
    each one's pure device time (``DeviceClock``: a sleep kernel hides the host's issue time):
    what a ratio owes to the device and what to the host."""
    timed = interleaved(
        fns,
        rounds=settings.rounds,
        iters=settings.turns,
        warmup=3,
        sync=torch.cuda.synchronize,
        spread=[("breakgraph", "hf_graph"), ("breakgraph", "bg_one_graph")],
    )
    ms = timed["ms"]
    clock = DeviceClock(hold_ms=10.0)
    device = {name: clock.measure(fn, iters=10) for name, fn in fns.items()}
    return {
        "ms": ms,
        "spread": timed["spread"],
        "device_only_ms": {name: d["device_ms"] for name, d in device.items()},
        "hidden": {name: d["hidden"] for name, d in device.items()},
        "bg/exact": ms["breakgraph"] / ms["hf_graph"],
        "bg/one_graph": ms["breakgraph"] / ms["bg_one_graph"],
        "one_graph/exact": ms["bg_one_graph"] / ms["hf_graph"],
    }


def host_churn(objects: int = 200_000) -> None:
    """Pure host work that walks several megabytes of Python objects (no GPU): what a
    serving loop's scheduler or tokenizer does to the CPU's caches between two prefills."""
    data = list(range(objects))
    sum(data)


def neighbours(settings: Settings, fns: dict, model, prompt) -> dict:
    """The same turns with a neighbour in the rotation (issue 23: ``bench_prefill``, whose
    turns include HF eager, gave breakgraph/exact 4-10 % above this script's): ``hf_eager``
    (an eager forward: host-heavy, the GPU mostly idle) or ``host_churn`` (host only). The
    neighbour is timed too but only the ratios matter; if they move with ``host_churn``, the
    cause is the host's caches, not the GPU's state."""
    out = {}
    extra = {
        "hf_eager": lambda: hf_eager(model, prompt),
        "host_churn": host_churn,
    }
    for name, call in extra.items():
        timed = interleaved(
            {**fns, name: call},
            rounds=settings.rounds,
            iters=settings.turns,
            warmup=3,
            sync=torch.cuda.synchronize,
            spread=[("breakgraph", "hf_graph")],
        )
        ms = timed["ms"]
        out[f"beside {name}"] = {
            "ms": ms,
            "spread": timed["spread"],
            "bg/exact": ms["breakgraph"] / ms["hf_graph"],
            "bg/one_graph": ms["breakgraph"] / ms["bg_one_graph"],
        }
    return out


def cuda_primitives(iters: int = 200) -> dict:
    """Host microseconds of the CUDA calls the per-call path makes (medians of batches of
    ``iters`` calls, synchronised between batches): what is left when the Python is gone."""
    words = 2 * 4096 + 16 + 9  # the default runner's step buffer
    host = torch.zeros(words, dtype=torch.long, pin_memory=True)
    device = torch.zeros(words, dtype=torch.long, device="cuda")
    prompt = torch.zeros(32, dtype=torch.long, device="cuda")
    ids = device[:32]
    event = torch.cuda.Event()
    generic = torch.Event(torch.device("cuda"), enable_timing=False)
    stream = torch.cuda.current_stream()
    calls = {
        "torch.cuda.Event.record()": event.record,
        "torch.cuda.Event.record(stream)": lambda: event.record(stream),
        "torch.cuda.Event.synchronize()": event.synchronize,
        "torch.Event.record()": generic.record,
        "torch.Event.synchronize()": generic.synchronize,
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "H2D copy_ of the step buffer": lambda: device.copy_(host, non_blocking=True),
        "D2D copy_ of 32 ids": lambda: ids.copy_(prompt),
        "device[:32] (a view)": lambda: device[:32],
    }
    out = {}
    for name, call in calls.items():
        samples = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            samples.append((time.perf_counter() - start) / iters * 1e6)
        out[name] = statistics.median(samples)
    torch.cuda.synchronize()
    return out


def settings_tag() -> str:
    return os.environ.get("PREFILL_HOST_PATH_TAG", "this")


def run_tree(settings: Settings) -> dict:

    import breakgraph

    results = {
        "schema": SCHEMA,
        "tree": os.path.dirname(os.path.dirname(os.path.abspath(breakgraph.__file__))),
        "tag": settings_tag(),
        **environment(settings.cuda),  # torch, transformers, gpu, ...: at the top level
        "settings": dataclasses.asdict(settings),
        "families": [],
    }
    if settings.cuda:
        results["cuda_primitives_us"] = cuda_primitives()
    threads = torch.get_num_threads()
    if not settings.cuda:  # the CPU's intra-op threads only add noise to microseconds
        torch.set_num_threads(1)
    try:
        for name in settings.families:
            start = time.perf_counter()
            results["families"].append(measure_family(settings, ALL_FAMILIES[name]))
            results["families"][-1]["seconds"] = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return results


# -- reporting and the before/after run ----------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


HOST_KEYS = (
    *STAGES,
    "entry -> launch",
    "segments",
    "breaks",
    "output",
    "return",
    "entry -> launch, probe only",
    "return, probe only",
    "return, unwrapped",
    "return, owned=False",
    "clone (alone)",
)


def table(results: list[dict]) -> str:
    """One line per measurement and workload, one column per tree."""
    tags = [r["tag"] for r in results]
    header = "".join(f"{t:>12s}" for t in tags)
    lines = []

    def line(label: str, values: list, digits: int = 1) -> None:
        lines.append(f"  {label:34s}" + "".join(f"{_fmt(v, digits):>12s}" for v in values))

    if "cuda_primitives_us" in results[0]:
        lines.append(f"CUDA calls, host microseconds per call{header}")
        for key in results[0]["cuda_primitives_us"]:
            line(key, [r["cuda_primitives_us"].get(key) for r in results], 2)
    for f, family in enumerate(results[0]["families"]):
        for r, row in enumerate(family["rows"]):
            rows = [tree["families"][f]["rows"][r] for tree in results]
            head = f"{family['family']}, {row['tokens']} tokens (bucket {row['bucket']})"
            lines.append(f"{head}: host us (lowest round median){header}")
            for key in HOST_KEYS:
                line(key, [x["host_us"].get(key) for x in rows])
            for extra in [k for k in row if k.startswith("host_us, ")]:
                lines.append(f"  {extra[len('host_us, ') :]}:")
                for key in HOST_KEYS[:8]:
                    line("  " + key, [x.get(extra, {}).get(key) for x in rows])
            if "ms" not in row:
                continue
            for key in ("bg/exact", "bg/one_graph", "one_graph/exact"):
                line(key, [x[key] for x in rows], 3)
            for key in ("breakgraph", "bg_one_graph", "hf_graph"):
                line(f"{key} ms (wall)", [x["ms"][key] for x in rows], 3)
                line(f"{key} ms (device only)", [x["device_only_ms"][key] for x in rows], 3)
            for key in ("entry_to_launch_ms", "launch_to_return_ms", "call_ms"):
                line(f"events: {key}", [x["device_ms"][key] for x in rows], 3)
            for name in row.get("neighbours", {}):
                for key in ("bg/exact", "bg/one_graph"):
                    got = [x.get("neighbours", {}).get(name, {}).get(key) for x in rows]
                    line(f"{key}, {name}", got, 3)
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """The CUDA run in a few lines per workload (the whole table goes to host-path.txt)."""
    tags = "/".join(r["tag"] for r in results)
    lines = [f"per workload, {tags}:"]

    def cells(values: list, digits: int) -> str:
        return " / ".join(_fmt(v, digits) for v in values)

    for f, family in enumerate(results[0]["families"]):
        for r, row in enumerate(family["rows"]):
            rows = [tree["families"][f]["rows"][r] for tree in results]
            host = [x["host_us"] for x in rows]
            lines.append(f"{family['family']} {row['tokens']} tokens (bucket {row['bucket']}):")
            lines.append(
                "  host us entry->launch "
                + cells([h.get("entry -> launch, probe only") for h in host], 1)
                + " | return "
                + cells([h.get("return, unwrapped") for h in host], 1)
                + " | clone "
                + cells([h.get("clone (alone)") for h in host], 1)
            )
            if "host_us, host prompt" in row:
                on_host = [x.get("host_us, host prompt", {}) for x in rows]
                launch = cells([h.get("entry -> launch, probe only") for h in on_host], 1)
                lines.append(f"  host us entry->launch, the prompt on the host {launch}")
            if "ms" not in row:
                continue
            gap = cells([x["device_ms"]["entry_to_launch_ms"] * 1e3 for x in rows], 1)
            lines.append(f"  events: device idle from entry to the launch, us {gap}")
            for key in ("bg/exact", "bg/one_graph", "one_graph/exact"):
                lines.append(f"  {key:16s}" + cells([x[key] for x in rows], 3))
            for name in row.get("neighbours", {}):
                got = [x.get("neighbours", {}).get(name, {}).get("bg/exact") for x in rows]
                lines.append(f"  bg/exact, {name}: " + cells(got, 3))
            for key in ("breakgraph", "bg_one_graph", "hf_graph"):
                wall = cells([x["ms"][key] for x in rows], 3)
                device = cells([x["device_only_ms"][key] for x in rows], 3)
                lines.append(f"  {key:16s}ms wall {wall} | device only {device}")
    return "\n".join(lines)


def compare(
    settings: Settings, baseline: str, argv: list[str], old_first: bool = False
) -> list[dict]:
    """Time this tree, then the old one (``baseline``), each in a process of its own with the
    tree first on ``PYTHONPATH``, on the same settings (this tree first: if the run is cut
    short, the new numbers are the ones kept; ``old_first`` swaps them: the host's state can
    drift between the two processes, so a fair comparison runs both orders); returns the
    results, old first. A tree whose run fails is reported and left out."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("new", here), ("old", os.path.abspath(baseline))]
    if old_first:
        trees.reverse()
    out_dir = settings.out or os.path.join(here, ".benchmarks")
    os.makedirs(out_dir, exist_ok=True)
    results = []
    for tag, tree in trees:
        path = os.path.join(out_dir, f"host-path-{tag}.json")
        env = {**os.environ, "PYTHONPATH": tree, "PREFILL_HOST_PATH_TAG": tag}
        command = [sys.executable, os.path.abspath(__file__), *argv, "--json", path]
        print(f"[{tag}] {tree}", flush=True)
        done = subprocess.run(command, env=env, cwd=tree)
        if done.returncode != 0:
            print(f"[{tag}] failed (exit {done.returncode}); left out", flush=True)
            continue
        with open(path) as f:
            result = json.load(f)
        if os.path.realpath(result["tree"]) != os.path.realpath(tree):
            raise SystemExit(f"prefill_host_path: the {tag} run imported {result['tree']}")
        result["order"] = [t for t, _ in trees]
        results.insert(0 if tag == "old" else len(results), result)
    if not results:
        raise SystemExit("prefill_host_path: no tree could be timed")
    return results


def parse_args(argv: list[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    names = lambda text: [x for x in text.split(",") if x]  # noqa: E731
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--families", type=names, default=None)
    parser.add_argument("--sizes", type=ints, default=None)
    parser.add_argument("--iters", type=int, default=None, help="calls per timed pass")
    parser.add_argument("--prompt-device", choices=("same", "cpu"), default="same")
    parser.add_argument("--split", type=int, default=0, help="also time K prompts per workload")
    parser.add_argument("--no-trace", action="store_true")
    parser.add_argument(
        "--neighbours", action="store_true",
        help="also take turns beside HF eager and beside pure host work (CUDA)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="folder for the JSON and the traces")
    parser.add_argument("--compare", default=None, help="an older checkout to time first")
    parser.add_argument(
        "--old-first", action="store_true", help="with --compare: time the old tree first"
    )
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)  # a --compare child
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    settings = Settings(
        device=args.device,
        families=args.families or (list(FAMILIES) if cuda else ["tiny-llama"]),
        sizes=args.sizes or ([32, 200, 1000] if cuda else [32]),
        iters=args.iters or (100 if cuda else 1000),
        prompt_device=args.prompt_device,
        split=args.split,
        out=os.path.abspath(args.out) if args.out else None,
        trace=not args.no_trace,
        neighbours=args.neighbours,
    )
    unknown = set(settings.families) - set(ALL_FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; known: {', '.join(ALL_FAMILIES)}")
    return settings, args


def _child_argv(argv: list[str], out: str | None) -> list[str]:
    """``argv`` for a ``--compare`` child: no ``--compare``, and ``--out`` made absolute (the
    child runs in the tree it times)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--compare", "--out"):
            skip = True
        elif arg != "--old-first" and not arg.startswith(("--compare=", "--out=")):
            kept.append(arg)
    return kept + (["--out", out] if out else [])


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    settings, args = parse_args(argv)
    if settings.cuda and not torch.cuda.is_available():
        raise SystemExit("prefill_host_path: no CUDA device; run without --device cuda")
    if settings.out:
        os.makedirs(settings.out, exist_ok=True)
    if args.compare:
        child = _child_argv(argv, settings.out)
        results = compare(settings, args.compare, child, old_first=args.old_first)
    else:
        results = [run_tree(settings)]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results[0], f, indent=1)
            return results
    full = table(results)
    if settings.out:
        with open(os.path.join(settings.out, "host-path.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(settings.out, "host-path.txt"), "w") as f:
            f.write(full + "\n")
    print(summary(results) if settings.cuda else full)
    return results


if __name__ == "__main__":
    main()
