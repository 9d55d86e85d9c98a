"""Bucketed graphs for variable-size inputs: one breakable graph per size bucket.

Real inputs change size every step; a graph is frozen to one size. A
``BucketedRunner`` captures one :class:`~breakgraph.BreakableCUDAGraph` per bucket
(say token counts 64, 256, 1024) at start-up, all in one memory pool, and serves
any input by copying it into the static buffers of the smallest bucket that fits
and filling the rest of the bucket (the *tail*) with a defined value.

Three small pieces, one job each:

* :func:`choose_bucket` decides, as a pure function of the sizes, what a call does
  (replay a bucket, capture a new one, run eagerly, or refuse);
* :class:`StaticInputs` owns the static input buffers: their spec, validation,
  copy-in and tail padding;
* :class:`BucketedRunner` is the capture lifecycle (warm up once, capture every
  bucket largest first into one pool, capture windows) plus dispatch.

Rules it enforces (each one a bug in a peer):

* inputs are validated before copying: rank, dtype, device and every
  non-bucketed dimension must match; a wrong shape never broadcasts;
* the tail is written on every call, so stale or NaN rows never linger;
* capture happens only in an explicit capture phase: the constructor or
  ``with runner.capture_window():``. Outside it a size with no bucket runs
  eagerly or raises (``on_miss``), it never captures on the fly;
* with ``ranks=RankGroup(...)`` (:mod:`breakgraph.distributed`) every rank captures the
  same buckets and takes the same bucket-or-eager decision on every call, agreed in one
  small all-reduce, so collectives inside segments line up (tensor parallelism).

Outputs live in graph memory and are overwritten by the next call; pass
``owned=True`` to get a copy.

Example::

    >>> import torch
    >>> from breakgraph.runner import BucketedRunner
    >>> w = torch.randn(8, 8)
    >>> runner = BucketedRunner(lambda x: (x @ w).relu(), buckets=(4, 16),
    ...                         example_inputs=(torch.randn(1, 8),), backend="emulated")
    >>> x = torch.randn(3, 8)
    >>> torch.allclose(runner(x), (x @ w).relu())
    True
    >>> dict(sorted(runner.stats.calls.items()))
    {4: 1, 16: 0}
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import numbers
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import distributed
from .backends import select_backend
from .eager import eager_on_graph
from .errors import CaptureError, InputError, ReplayError
from .graph import BreakableCUDAGraph, capture
from .state import context_scope
from .structure import map_tensors

__all__ = [
    "BucketedRunner",
    "RunnerStats",
    "Decision",
    "choose_bucket",
    "StaticInputs",
    "faster_buckets",
]

logger = logging.getLogger("breakgraph")


# -- the decision -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What a call of some size does.

    ``action`` is ``"replay"`` (the graph of ``bucket``), ``"capture"`` (a new bucket of
    ``bucket`` first, inside a capture window), ``"eager"`` (run the function on the live
    inputs; ``reason`` says why) or ``"raise"``.
    """

    action: str
    bucket: int | None = None
    reason: str = ""


def choose_bucket(
    buckets: Sequence[int],
    size: int,
    *,
    max_padding_fraction: float | None = None,
    can_capture: bool = False,
    on_miss: str = "eager",
    faster: Mapping[int, int] | None = None,
) -> Decision:
    """The one bucket decision: the smallest captured bucket that holds ``size``.

    ``buckets`` are ascending. A size above every bucket is captured (``can_capture``:
    a capture window is open), run eagerly or refused (``on_miss``); a bucket whose tail
    would exceed ``max_padding_fraction`` of it runs eagerly. ``faster`` maps a bucket to
    a larger one that was measured faster (:meth:`BucketedRunner.tune`): the call goes
    there. With several ranks, pass the size agreed across them, so every rank takes the
    same path.

    Example::

        >>> from breakgraph.runner import choose_bucket
        >>> choose_bucket((4, 16), 5)
        Decision(action='replay', bucket=16, reason='')
        >>> choose_bucket((4, 16), 20).action
        'eager'
    """
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        if can_capture:
            return Decision("capture", size)
        if on_miss == "raise":
            return Decision("raise", None, "larger than every bucket")
        return Decision("eager", None, "larger than every bucket")
    bucket = buckets[index]
    if max_padding_fraction is not None and bucket - size > max_padding_fraction * bucket:
        return Decision("eager", None, "too much padding")
    return Decision("replay", faster.get(bucket, bucket) if faster else bucket)


# -- static inputs --------------------------------------------------------------------------------


class StaticInputs:
    """The static input buffers of a runner: spec, validation, copy-in, tail padding.

    One tensor per input of the captured function; ``dims`` is the bucketed dimension
    of each, ``pad_values`` what its tail is filled with. ``allocate(size)`` makes the
    buffers of a bucket; ``size_of(inputs)`` validates live inputs and returns their
    size along the bucketed dimension; ``fill(buffers, inputs, size)`` copies them in
    and writes the tail.

    Example::

        >>> import torch
        >>> from breakgraph.runner import StaticInputs
        >>> spec = StaticInputs((torch.zeros(1, 2),), dims=0, pad_values=-1.0)
        >>> buffers = spec.allocate(4)
        >>> x = torch.ones(3, 2)
        >>> spec.fill(buffers, (x,), spec.size_of((x,)))
        >>> buffers[0][:, 0].tolist()
        [1.0, 1.0, 1.0, -1.0]
    """

    def __init__(
        self,
        example_inputs: Sequence[torch.Tensor],
        dims: int | Sequence[int] = 0,
        pad_values: float | Sequence[float] = 0,
    ):
        if isinstance(example_inputs, torch.Tensor) or not isinstance(
            example_inputs, (tuple, list)
        ):
            raise InputError(
                "BucketedRunner: example_inputs must be a tuple or list of tensors (one per "
                f"input of fn), got {type(example_inputs).__name__}; wrap one tensor as (t,)."
            )
        examples = tuple(example_inputs)
        if not examples or not all(isinstance(t, torch.Tensor) for t in examples):
            raise InputError(
                "BucketedRunner: example_inputs must be a non-empty sequence of tensors."
            )
        n = len(examples)
        dims = _per_input(dims, n, "dims")
        self.pads = _per_input(pad_values, n, "pad_values")
        for i, (t, d) in enumerate(zip(examples, dims)):
            if not isinstance(d, int) or not -t.dim() <= d < t.dim():
                raise InputError(
                    f"BucketedRunner: dims[{i}]={d!r} is out of range for a {t.dim()}-D input."
                )
        self.dims = tuple(d % t.dim() for t, d in zip(examples, dims))
        self.specs = tuple((t.dtype, t.device, tuple(t.shape)) for t in examples)

    @property
    def device(self) -> torch.device:
        return self.specs[0][1]

    def allocate(self, size: int) -> tuple:
        """The buffers of a bucket of ``size``, filled with the pad values."""
        with torch.inference_mode(False):  # writable by callers outside inference_mode too
            return tuple(
                torch.full(_with_dim(shape, d, size), pad, dtype=dtype, device=device)
                for (dtype, device, shape), d, pad in zip(self.specs, self.dims, self.pads)
            )

    def size_of(self, inputs: tuple) -> int:
        """Validate live inputs against the spec; their size along the bucketed dimension."""
        if len(inputs) != len(self.specs):
            raise InputError(
                f"BucketedRunner: expected {len(self.specs)} inputs, got {len(inputs)}."
            )
        size = None
        for i, (value, (dtype, device, shape), d) in enumerate(zip(inputs, self.specs, self.dims)):
            if not isinstance(value, torch.Tensor):
                raise InputError(
                    f"BucketedRunner: input {i} must be a tensor, got {type(value).__name__}."
                )
            problem = None
            if value.dim() != len(shape):
                problem = f"{value.dim()} dimensions, expected {len(shape)}"
            elif value.dtype != dtype:
                problem = f"dtype {value.dtype}, expected {dtype}"
            elif value.device != device:
                problem = f"device {value.device}, expected {device}"
            elif any(value.shape[j] != shape[j] for j in range(len(shape)) if j != d):
                expected = list(_with_dim(shape, d, "N"))
                problem = (
                    f"shape {tuple(value.shape)}, expected {expected} "
                    f"(N is the bucketed dimension {d})"
                )
            elif size is not None and value.shape[d] != size:
                problem = f"bucketed size {value.shape[d]}, but input 0 has {size}"
            if problem is not None:
                raise InputError(f"BucketedRunner: input {i} has {problem}. Nothing was copied.")
            size = value.shape[d]
        if size == 0:
            raise InputError("BucketedRunner: inputs are empty along the bucketed dimension.")
        return size

    def fill(self, buffers: tuple, inputs: tuple, size: int) -> None:
        """Copy ``inputs`` into ``buffers`` and write the tail with the pad values."""
        for buffer, value, d, pad in zip(buffers, inputs, self.dims, self.pads):
            bucket = buffer.shape[d]
            buffer.narrow(d, 0, size).copy_(value)
            if size < bucket:
                buffer.narrow(d, size, bucket - size).fill_(pad)


# -- the runner -----------------------------------------------------------------------------------


@dataclass
class RunnerStats:
    """Counters of a :class:`BucketedRunner`; ``str(stats)`` prints a small table."""

    calls: dict[int, int] = field(default_factory=dict)
    padded_elements: dict[int, int] = field(default_factory=dict)  # tail size (bucketed dim)
    eager_fallbacks: dict[str, int] = field(default_factory=dict)  # by reason
    capture_seconds: dict[int, float] = field(default_factory=dict)
    graph_memory_bytes: dict[int, int] = field(default_factory=dict)  # pool growth (CUDA)
    warmup_seconds: float = 0.0
    replay_ms: dict[int, float] = field(default_factory=dict)  # measured by tune() (CUDA)
    routed: dict[int, int] = field(default_factory=dict)  # bucket -> faster larger bucket

    def __str__(self) -> str:
        rows = ["bucket   calls  padded rows  capture s  graph MiB"]
        for size in sorted(self.calls):
            rows.append(
                f"{size:>6} {self.calls[size]:>7} {self.padded_elements.get(size, 0):>12} "
                f"{self.capture_seconds.get(size, 0.0):>10.3f} "
                f"{self.graph_memory_bytes.get(size, 0) / 2**20:>10.1f}"
            )
        fallbacks = ", ".join(f"{k}: {v}" for k, v in sorted(self.eager_fallbacks.items()))
        rows.append(f"eager fallbacks: {fallbacks or 'none'}")
        return "\n".join(rows)


class _Bucket:
    __slots__ = ("size", "graph", "inputs", "output")

    def __init__(self, size: int, graph: BreakableCUDAGraph, inputs: tuple, output: Any):
        self.size, self.graph, self.inputs, self.output = size, graph, inputs, output


class BucketedRunner:
    """Serve ``fn(*inputs)`` from one captured breakable graph per size bucket.

    Args:
        fn: the callable to capture; it takes the static input tensors and may
            call ``@eager_on_graph`` functions (they read per-call state from
            :func:`breakgraph.replay_context`, which is the ``context`` of the call).
        buckets: the sizes of the bucketed dimension to capture, e.g. ``(64, 256, 1024)``.
        example_inputs: a tuple with one tensor per input of ``fn``; their dtype, device
            and non-bucketed dimensions define the static buffers (values unused).
        dims: the bucketed dimension of each input (one int for all).
        pad_values: the value written into each input's tail (one value for all).
        on_miss: ``"eager"`` (run ``fn`` on the live inputs) or ``"raise"`` when the
            size exceeds the largest bucket.
        max_padding_fraction: run eagerly when the tail would exceed this fraction
            of the bucket (None: always pad).
        slice_outputs: trim output tensors whose bucketed dimension equals the
            bucket back to the input size (views); False returns them whole, or a
            callable ``(output, size) -> output`` does it your way.
        agree_size: ``size -> size`` called before every decision (a custom policy in
            one process); it must not return less than the size. For several ranks pass
            ``ranks`` instead.
        ranks: a :class:`~breakgraph.distributed.RankGroup` when segments hold
            collectives (tensor parallelism): every call agrees its size (the largest over
            the ranks) and a ``fingerprint`` of the call in one all-reduce, and every
            warm-up and capture is checked on all ranks, with a timeout.
        warmup: eager runs of ``fn`` before the first capture of a capture phase (on
            the largest new bucket); later buckets reuse that warm-up.
        warmup_each: warm up before every bucket instead (``torch.compile``d functions
            compile per shape, which must not happen inside a capture).
        backend, pool, context: as for :func:`breakgraph.capture`.
        capture_context: ``size -> context`` for the warm-up and capture of bucket
            ``size`` (default: ``context``), when eager functions need a batch
            description that matches the bucket.
        debug: capture every bucket in debug mode (see :mod:`breakgraph.debug`).
        eager_region: run all of ``fn`` as ONE eager break through the same buffers,
            padding and replay path: if results are right then and wrong without it,
            the bug is in what was captured, not in the runner.
        static_inputs: a :class:`StaticInputs` (or subclass: where the buffers live) to
            use instead of one built from ``example_inputs``, ``dims``, ``pad_values``.
        progress: print one line per captured bucket to stderr (log lines on the
            ``breakgraph`` logger are always written at INFO level).
    """

    def __init__(
        self,
        fn: Callable,
        buckets: Sequence[int],
        example_inputs: Sequence[torch.Tensor] | None = None,
        *,
        dims: int | Sequence[int] = 0,
        pad_values: float | Sequence[float] = 0,
        on_miss: str = "eager",
        max_padding_fraction: float | None = None,
        slice_outputs: bool | Callable[[Any, int], Any] = True,
        agree_size: Callable[[int], int] | None = None,
        ranks: distributed.RankGroup | None = None,
        warmup: int = 2,
        warmup_each: bool = False,
        backend: str | None = None,
        pool: Any = None,
        context: Any = None,
        capture_context: Callable[[int], Any] | None = None,
        debug: bool | None = None,
        eager_region: bool = False,
        static_inputs: StaticInputs | None = None,
        progress: bool = False,
    ):
        sizes = _bucket_sizes(buckets, "BucketedRunner")
        if on_miss not in ("eager", "raise"):
            raise InputError(
                f"BucketedRunner: on_miss must be 'eager' or 'raise', got {on_miss!r}."
            )
        if max_padding_fraction is not None and not 0.0 <= max_padding_fraction < 1.0:
            raise InputError("BucketedRunner: max_padding_fraction must be in [0, 1).")
        if ranks is not None and (agree_size is not None or warmup < 1):
            raise InputError(
                "BucketedRunner: with ranks=, the ranks agree the size themselves (drop "
                "agree_size) and collectives must run eagerly before capture (warmup >= 1)."
            )
        self.inputs = (
            static_inputs
            if static_inputs is not None
            else StaticInputs(example_inputs, dims, pad_values)
        )
        self.fn = fn
        self._captured_fn = eager_on_graph(fn) if eager_region else fn
        self.debug = debug
        self.on_miss = on_miss
        self.max_padding_fraction = max_padding_fraction
        self.slice_outputs = slice_outputs
        self.agree_size = agree_size
        self.ranks = ranks
        self.warmup = warmup
        self.warmup_each = warmup_each
        self.backend = select_backend(backend).name
        self.context = context
        self.capture_context = capture_context
        self.progress = progress
        self.stats = RunnerStats()
        self._pool = pool
        self._buckets: dict[int, _Bucket] = {}
        self._sizes: tuple = ()
        self._decisions: dict[int, Decision] = {}  # size -> decision (outside capture windows)
        self._faster: dict[int, int] = {}  # bucket -> a larger bucket measured faster (tune)
        self._window_open = True
        if ranks is not None:  # every rank must capture the same buckets in the same order
            shapes = [(dtype, device.type, shape) for dtype, device, shape in self.inputs.specs]
            spec = distributed.fingerprint(sizes, self.inputs.dims, self.inputs.pads, shapes)
            ranks.agree(0, spec, "buckets")
        try:
            self._capture_buckets(sizes)
        finally:
            self._window_open = False

    # -- capture phase ----------------------------------------------------------------
    @contextlib.contextmanager
    def capture_window(self) -> Iterator[BucketedRunner]:
        """Allow new captures (``add_buckets``, and calls larger than every bucket).

        Capturing mid-run can grow shared workspaces and move addresses that earlier
        graphs baked in: open the window only at a quiet point, e.g. start-up.
        """
        self._window_open = True
        self._decisions.clear()
        try:
            yield self
        finally:
            self._window_open = False
            self._decisions.clear()

    def add_buckets(self, buckets: Sequence[int]) -> None:
        """Capture more buckets; only inside ``capture_window()``."""
        if not self._window_open:
            raise CaptureError(
                "BucketedRunner.add_buckets: the capture phase is over; open it again with "
                "`with runner.capture_window(): runner.add_buckets(...)`."
            )
        sizes = _bucket_sizes(buckets, "BucketedRunner.add_buckets", allow_empty=True)
        self._capture_buckets([s for s in sizes if s not in self._buckets])

    def _capture_buckets(self, sizes: Sequence[int]) -> None:
        """Largest first (smaller ones reuse its pool); one warm-up and one gc pass in all."""
        ordered = sorted(sizes, reverse=True)
        for i, size in enumerate(ordered):
            self._capture_one(size, first=i == 0, position=f"{i + 1}/{len(ordered)}")

    def _capture_one(self, size: int, first: bool, position: str) -> None:
        inputs = self.inputs.allocate(size)
        context = self.capture_context(size) if self.capture_context else self.context
        start = time.perf_counter()
        if first or self.warmup_each:
            with context_scope(context):
                self._on_all_ranks(
                    f"warm-up of bucket {size}",
                    lambda: self._warm_up(inputs),
                    keep=(self._buckets, inputs),
                )
            self.stats.warmup_seconds += time.perf_counter() - start
        graph = BreakableCUDAGraph()
        backend = select_backend(self.backend)
        pool_before = backend.pool_bytes(self._pool) if self._pool is not None else 0

        def record() -> Any:
            with capture(
                graph,
                pool=self._pool,
                backend=self.backend,
                context=context,
                debug=self.debug,
                collect_garbage=first,
                capture_error_mode="global"
                if self.ranks is None
                else distributed.CAPTURE_ERROR_MODE,
            ):
                return self._captured_fn(*inputs)

        output = self._on_all_ranks(
            f"capture of bucket {size}",
            record,
            lambda _: distributed.fingerprint(repr(graph)),
            keep=(self._buckets, graph, inputs),
        )
        self._pool = graph.pool()
        self.stats.graph_memory_bytes[size] = (backend.pool_bytes(self._pool) or 0) - (
            pool_before or 0
        )
        seconds = self.stats.capture_seconds[size] = time.perf_counter() - start
        self.stats.calls.setdefault(size, 0)
        self.stats.padded_elements.setdefault(size, 0)
        self._buckets[size] = _Bucket(size, graph, inputs, output)
        self._sizes = tuple(sorted(self._buckets))
        self._decisions.clear()
        message = f"breakgraph: captured bucket {position} (size {size}) in {seconds:.3f} s"
        logger.info("%s: %r", message, graph)
        if self.progress:
            print(message, file=sys.stderr, flush=True)

    def _on_all_ranks(
        self, what: str, step: Callable, fingerprint: Callable | None = None, keep: Any = None
    ):
        """Run a capture-phase step; with ``ranks``, check it succeeded alike on every rank
        (``keep``: what must not be freed if it failed; see RankGroup.capture_step)."""
        if self.ranks is None:
            return step()
        return self.ranks.capture_step(what, step, fingerprint, keep)

    def _warm_up(self, inputs: tuple) -> None:
        if self.warmup <= 0:
            return
        if self.backend == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.fn(*inputs)
            torch.cuda.current_stream().wait_stream(side)
        else:
            for _ in range(self.warmup):
                self.fn(*inputs)

    # -- serving ------------------------------------------------------------------------
    @property
    def buckets(self) -> tuple[int, ...]:
        """The captured bucket sizes, ascending."""
        return self._sizes

    def decide(self, size: int, fingerprint: int = 0) -> Decision:
        """What a call of ``size`` does, decided on the agreed size.

        With ``ranks`` this is the call's one exchange: the largest size over the ranks,
        and ``fingerprint`` (:func:`breakgraph.distributed.fingerprint` of the call's
        inputs) must be equal on every rank; else ``agree_size`` if given.

        Example::

            >>> import torch
            >>> from breakgraph.runner import BucketedRunner
            >>> r = BucketedRunner(lambda x: x * 2, (4, 16), (torch.zeros(1),), backend="emulated")
            >>> r.decide(5).bucket
            16
        """
        if not self._sizes:
            raise ReplayError("BucketedRunner: the runner is closed; build a new one.")
        agreed = size
        if self.ranks is not None:
            agreed = self.ranks.agree(size, fingerprint)
        elif self.agree_size is not None:
            agreed = self.agree_size(size)
            if not isinstance(agreed, int) or agreed < size:
                raise InputError(
                    f"BucketedRunner: agree_size({size}) returned {agreed!r}; it must return an "
                    f"int no smaller than the size (the largest size over all ranks)."
                )
        decision = self._decisions.get(agreed)
        if decision is None:
            decision = self._choose(agreed)
            if not self._window_open:
                self._decisions[agreed] = decision
        return decision

    def _choose(self, size: int) -> Decision:
        return choose_bucket(
            self._sizes,
            size,
            max_padding_fraction=self.max_padding_fraction,
            can_capture=self._window_open,
            on_miss=self.on_miss,
            faster=self._faster,
        )

    def bucket_for(self, size: int) -> int | None:
        """The bucket a call of ``size`` would replay, or None when it would not replay a graph:
        the decision ``__call__`` makes (``agree_size`` and the capture window included). With
        ``ranks`` it looks at this rank's size only: it exchanges nothing."""
        decision = self._choose(self.agree_size(size) if self.agree_size is not None else size)
        return decision.bucket if decision.action == "replay" else None

    def tune(self, repeats: int = 5, margin: float = 0.02) -> dict[int, float]:
        """Time every bucket's graph; send each size to the fastest bucket that holds it.

        GEMM libraries pick kernels by shape, and some sizes are slow: on an H200 a
        Llama-1B prefill padded to 208 tokens took longer than one padded to 224 or 256.
        After tuning, a bucket that a larger bucket beats by more than ``margin`` routes
        its calls there (``stats.routed``; the times are in ``stats.replay_ms``). Each
        bucket replays ``repeats`` times (plus two warm-ups) on its capture-time inputs and
        context. CUDA only (the emulated backend's times mean nothing: nothing is routed);
        not with ``ranks`` (timings differ between ranks, and every rank must take the same
        bucket). Returns the milliseconds per replay of each bucket.
        """
        if self.ranks is not None:
            raise InputError(
                "BucketedRunner.tune: timings differ between ranks, so the routes would too; "
                "every rank must replay the same bucket. Tune in one process, or not at all."
            )
        if self.backend != "cuda" or not self._sizes:
            return {}
        times = {}
        for size in self._sizes:
            graph = self._buckets[size].graph
            context = self.capture_context(size) if self.capture_context else self.context
            for _ in range(2):
                graph.replay(context=context)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                graph.replay(context=context)
            end.record()
            end.synchronize()
            times[size] = start.elapsed_time(end) / repeats
        faster = faster_buckets(times, margin)
        self._faster = faster
        self._decisions.clear()
        self.stats.replay_ms, self.stats.routed = dict(times), dict(faster)
        return times

    def graph(self, size: int) -> BreakableCUDAGraph:
        """The captured graph of bucket ``size``."""
        return self._buckets[size].graph

    def static_inputs(self, size: int) -> tuple:
        """The static input buffers of bucket ``size`` (what :meth:`replay` reads)."""
        return self._buckets[size].inputs

    def __call__(
        self, *inputs: torch.Tensor, context: Any = None, owned: bool = False, fingerprint: int = 0
    ) -> Any:
        """Run ``fn(*inputs)`` through the smallest bucket that fits (or eagerly).

        ``context`` is what eager functions see through ``replay_context()`` (default:
        the runner's). The result lives in graph memory and is overwritten by the next
        call unless ``owned=True``. With ``ranks``, ``fingerprint`` must be equal on every
        rank (see :meth:`decide`).
        """
        try:
            size = self.inputs.size_of(inputs)
        except InputError:
            if self.ranks is not None:
                self.ranks.report_failure()  # the other ranks raise instead of waiting
            raise
        decision = self.decide(size, fingerprint)
        context = self.context if context is None else context
        if decision.action == "capture":
            self._capture_buckets([decision.bucket])
            decision = self.decide(size)
        if decision.action == "raise":
            raise InputError(
                f"BucketedRunner: input size {size} exceeds the largest bucket "
                f"{self._sizes[-1]}; add a bucket (inside runner.capture_window()) or "
                f"construct the runner with on_miss='eager'."
            )
        if decision.action == "eager":
            output = self.run_eagerly(inputs, context, decision.reason)
        else:
            bucket = self._buckets[decision.bucket]
            self.inputs.fill(bucket.inputs, inputs, size)
            output = self._slice(self.replay(decision.bucket, context, size), size, bucket.size)
        return map_tensors(torch.Tensor.clone, output) if owned else output

    def replay(self, bucket: int, context: Any = None, size: int | None = None) -> Any:
        """Replay bucket ``bucket`` on what its static inputs hold now; its whole output.

        For callers that fill the static inputs themselves (:meth:`static_inputs`);
        ``size`` (the live size, for the padding counter) defaults to the bucket.
        """
        entry = self._buckets[bucket]
        entry.graph.replay(context=self.context if context is None else context)
        self.stats.calls[bucket] += 1
        if size is not None:
            self.stats.padded_elements[bucket] += bucket - size
        return entry.output

    def run_eagerly(self, inputs: tuple, context: Any, reason: str) -> Any:
        """Run ``fn`` on the live inputs (counted as an eager fallback for ``reason``)."""
        self.stats.eager_fallbacks[reason] = self.stats.eager_fallbacks.get(reason, 0) + 1
        if self.ranks is not None:
            self.ranks.before_eager()
        with context_scope(self.context if context is None else context):
            return self.fn(*inputs)

    def _slice(self, output: Any, size: int, bucket_size: int) -> Any:
        if self.slice_outputs is False or size == bucket_size:
            return output
        if callable(self.slice_outputs):
            return self.slice_outputs(output, size)
        d = self.inputs.dims[0]

        def trim(t: torch.Tensor) -> torch.Tensor:
            if t.dim() > d and t.shape[d] == bucket_size:
                return t.narrow(d, 0, size)
            return t

        return map_tensors(trim, output)

    def close(self) -> None:
        """Release every graph and static buffer (after a failed multi-rank NCCL capture:
        keep them until the process exits, see ``RankGroup.capture_step``)."""
        distributed.release_graphs((b.graph for b in self._buckets.values()), self.ranks)
        self._buckets.clear()
        self._sizes = ()
        self._decisions.clear()


def faster_buckets(times: Mapping[int, float], margin: float = 0.02) -> dict[int, int]:
    """Where each bucket's calls go instead: the smallest larger bucket that beats it by more
    than ``margin`` and is itself within ``margin`` of the fastest larger bucket.

    Example::

        >>> from breakgraph.runner import faster_buckets
        >>> faster_buckets({192: 3.7, 200: 3.8, 208: 4.0, 224: 3.9, 256: 3.88})
        {208: 224}
    """
    sizes = sorted(times)
    faster = {}
    for i, size in enumerate(sizes):
        larger = sizes[i + 1 :]
        if not larger:
            break
        best = min(times[b] for b in larger)
        for b in larger:  # ascending: the least padding first
            if times[b] < times[size] * (1 - margin) and times[b] <= best * (1 + margin):
                faster[size] = b
                break
    return faster


def _bucket_sizes(buckets: Any, where: str, allow_empty: bool = False) -> list[int]:
    """Validate bucket sizes: positive ints (bools and floats refused), sorted, unique."""
    try:
        sizes = list(buckets)
    except TypeError:
        raise InputError(
            f"{where}: buckets must be a sequence of sizes, got {buckets!r}."
        ) from None
    bad = [b for b in sizes if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0]
    if bad or (not sizes and not allow_empty):
        raise InputError(
            f"{where}: bucket sizes must be positive ints, got {sizes!r}"
            + (f" (bad: {bad!r})." if bad else ".")
        )
    return sorted({int(b) for b in sizes})


def _per_input(value: Any, n: int, name: str) -> tuple:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InputError(f"BucketedRunner: {name} has {len(value)} entries for {n} inputs.")
        return tuple(value)
    return (value,) * n


def _with_dim(shape: tuple, dim: int, size: Any) -> tuple:
    return tuple(size if j == dim else s for j, s in enumerate(shape))
