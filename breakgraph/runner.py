"""Bucketed graphs for variable-size inputs: one breakable graph per size bucket.

Real inputs change size every step; a graph is frozen to one size. A
``BucketedRunner`` captures one :class:`~breakgraph.BreakableCUDAGraph` per bucket
(say token counts 64, 256, 1024) at start-up, all in one memory pool, and serves
any input by copying it into the static buffers of the smallest bucket that fits
and filling the rest of the bucket (the *tail*) with a defined value.

Rules it enforces (each one a bug in a peer):

* inputs are validated before copying: rank, dtype, device and every
  non-bucketed dimension must match; a wrong shape never broadcasts;
* the tail is written on every call, so stale or NaN rows never linger;
* capture happens only in an explicit capture phase: the constructor (all
  buckets, largest first so smaller ones reuse the pool, warm-up before each) or
  ``with runner.capture_window():``. Outside it a size with no bucket runs
  eagerly or raises (``on_miss``), it never captures on the fly;
* with ``ranks=RankGroup(...)`` (:mod:`breakgraph.distributed`) every rank captures the
  same buckets and takes the same bucket or eager decision on every call, so collectives
  inside segments line up (tensor parallelism).

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
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from .debug import pool_bytes
from .distributed import CAPTURE_ERROR_MODE
from .distributed import fingerprint as fingerprint_of
from .eager import eager_on_graph
from .errors import CaptureError, InputError, ReplayError
from .graph import BreakableCUDAGraph, capture, context_scope

if TYPE_CHECKING:
    from .distributed import RankGroup

__all__ = ["BucketedRunner", "RunnerStats"]

logger = logging.getLogger("breakgraph")


@dataclass
class RunnerStats:
    """Counters of a :class:`BucketedRunner`; ``str(stats)`` prints a small table."""

    calls: dict[int, int] = field(default_factory=dict)
    padded_elements: dict[int, int] = field(
        default_factory=dict
    )  # tail size (along the bucketed dim)
    eager_fallbacks: dict[str, int] = field(default_factory=dict)  # by reason
    capture_seconds: dict[int, float] = field(default_factory=dict)
    graph_memory_bytes: dict[int, int] = field(
        default_factory=dict
    )  # pool growth per capture (CUDA)

    def __str__(self) -> str:
        rows = ["bucket   calls  padded rows  capture s  graph MiB"]
        for size in sorted(self.calls):
            rows.append(
                f"{size:>6} {self.calls[size]:>7} {self.padded_elements.get(size, 0):>12} "
                f"{self.capture_seconds.get(size, 0.0):>10.3f} "
                f"{self.graph_memory_bytes.get(size, 0) / 2**20:>10.1f}"
            )
        fallbacks = (
            ", ".join(f"{k}: {v}" for k, v in sorted(self.eager_fallbacks.items())) or "none"
        )
        rows.append(f"eager fallbacks: {fallbacks}")
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
        example_inputs: one tensor per input of ``fn``; their dtype, device and
            non-bucketed dimensions define the static buffers (their values are unused).
        dims: the bucketed dimension of each input (one int for all).
        pad_values: the value written into each input's tail (one value for all).
        on_miss: ``"eager"`` (run ``fn`` on the live inputs) or ``"raise"`` when the
            size exceeds the largest bucket.
        max_padding_fraction: run eagerly when the tail would exceed this fraction
            of the bucket (None: always pad).
        slice_outputs: trim output tensors whose bucketed dimension equals the
            bucket back to the input size (views); False returns them whole, or a
            callable ``(output, size) -> output`` does it your way.
        agree_size: ``size -> size`` called before every decision (a custom policy
            in one process; for several ranks pass ``ranks``).
        ranks: a :class:`~breakgraph.distributed.RankGroup` when segments hold
            collectives (tensor parallelism): every call agrees its size (the largest
            over the ranks) and the ``fingerprint`` of the call in one all-reduce, and
            every warm-up and capture is checked on all ranks, with a timeout.
        warmup: eager runs of ``fn`` before each capture.
        backend, pool, context: as for :func:`breakgraph.capture`.
        capture_context: ``size -> context`` for the warm-up and capture of bucket
            ``size`` (default: ``context``), when eager functions need a batch
            description that matches the bucket.
        debug: capture every bucket in debug mode (see :mod:`breakgraph.debug`).
        eager_region: run all of ``fn`` as ONE eager break through the same buffers,
            padding and replay path: if results are right then and wrong without it,
            the bug is in what was captured, not in the runner.
    """

    def __init__(
        self,
        fn: Callable,
        buckets: Sequence[int],
        example_inputs: Sequence[torch.Tensor],
        *,
        dims: int | Sequence[int] = 0,
        pad_values: float | Sequence[float] = 0,
        on_miss: str = "eager",
        max_padding_fraction: float | None = None,
        slice_outputs: bool | Callable[[Any, int], Any] = True,
        agree_size: Callable[[int], int] | None = None,
        ranks: RankGroup | None = None,
        warmup: int = 2,
        backend: str | None = None,
        pool: Any = None,
        context: Any = None,
        capture_context: Callable[[int], Any] | None = None,
        debug: bool | None = None,
        eager_region: bool = False,
    ):
        sizes = sorted({int(b) for b in buckets})
        if not sizes or sizes[0] <= 0:
            raise InputError(
                f"BucketedRunner: buckets must be positive sizes, got {list(buckets)}."
            )
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
        examples = tuple(example_inputs)
        if not examples or not all(isinstance(t, torch.Tensor) for t in examples):
            raise InputError(
                "BucketedRunner: example_inputs must be a non-empty sequence of tensors."
            )
        n = len(examples)
        self._dims = _per_input(dims, n, "dims")
        self._pads = _per_input(pad_values, n, "pad_values")
        for i, (t, d) in enumerate(zip(examples, self._dims)):
            if not -t.dim() <= d < t.dim():
                raise InputError(
                    f"BucketedRunner: dims[{i}]={d} is out of range for a {t.dim()}-D input."
                )
        self._dims = tuple(d % t.dim() for t, d in zip(examples, self._dims))
        self._examples = tuple((t.dtype, t.device, tuple(t.shape)) for t in examples)
        self.fn = fn
        self._captured_fn = eager_on_graph(fn) if eager_region else fn
        self.debug = debug
        self.on_miss = on_miss
        self.max_padding_fraction = max_padding_fraction
        self.slice_outputs = slice_outputs
        self.agree_size = agree_size
        self.ranks = ranks
        self.warmup = warmup
        self.backend = backend
        self.context = context
        self.capture_context = capture_context
        self.stats = RunnerStats()
        self._pool = pool
        self._buckets: dict[int, _Bucket] = {}
        self._sizes: list = []
        self._window_open = True
        if ranks is not None:  # every rank must capture the same buckets in the same order
            shapes = [(dtype, device.type, shape) for dtype, device, shape in self._examples]
            ranks.agree(0, fingerprint_of(sizes, self._dims, self._pads, shapes), "buckets")
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
        try:
            yield self
        finally:
            self._window_open = False

    def add_buckets(self, buckets: Sequence[int]) -> None:
        """Capture more buckets; only inside ``capture_window()``."""
        if not self._window_open:
            raise CaptureError(
                "BucketedRunner.add_buckets: the capture phase is over; open it again with "
                "`with runner.capture_window(): runner.add_buckets(...)`."
            )
        self._capture_buckets(sorted({int(b) for b in buckets} - set(self._buckets)))

    def _capture_buckets(self, sizes: list) -> None:
        for size in sorted(sizes, reverse=True):  # largest first: smaller ones reuse its pool
            self._capture_one(size)

    def _capture_one(self, size: int) -> None:
        inputs = tuple(
            torch.full(_with_dim(shape, d, size), pad, dtype=dtype, device=device)
            for (dtype, device, shape), d, pad in zip(self._examples, self._dims, self._pads)
        )
        context = self.capture_context(size) if self.capture_context else self.context
        logger.info("breakgraph: capturing bucket %d", size)
        start = time.perf_counter()
        with context_scope(context):
            self._on_all_ranks(f"warm-up of bucket {size}", lambda: self._warm_up(inputs))
        graph = BreakableCUDAGraph()
        pool_before = pool_bytes(self._pool, inputs[0].device) or 0

        def record() -> Any:
            with capture(
                graph,
                pool=self._pool,
                backend=self.backend,
                context=context,
                debug=self.debug,
                capture_error_mode=CAPTURE_ERROR_MODE if self.ranks is not None else "global",
            ):
                return self._captured_fn(*inputs)

        output = self._on_all_ranks(
            f"capture of bucket {size}", record, lambda _: fingerprint_of(repr(graph))
        )
        if self._pool is None:
            self._pool = graph.pool()
        self.stats.graph_memory_bytes[size] = (
            pool_bytes(self._pool, inputs[0].device) or 0
        ) - pool_before
        self.stats.capture_seconds[size] = time.perf_counter() - start
        self.stats.calls.setdefault(size, 0)
        self.stats.padded_elements.setdefault(size, 0)
        self._buckets[size] = _Bucket(size, graph, inputs, output)
        self._sizes = sorted(self._buckets)
        logger.info(
            "breakgraph: bucket %d captured in %.3f s (%s)",
            size,
            self.stats.capture_seconds[size],
            graph,
        )

    def _on_all_ranks(self, what: str, step: Callable, fingerprint: Callable | None = None):
        """Run a capture-phase step; with ``ranks``, check it succeeded alike on every rank."""
        if self.ranks is None:
            return step()
        return self.ranks.capture_step(what, step, fingerprint)

    def _warm_up(self, inputs: tuple) -> None:
        if self.warmup <= 0:
            return
        if inputs[0].device.type == "cuda" and self.backend != "emulated":
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
        return tuple(self._sizes)

    def bucket_for(self, size: int) -> int | None:
        """The bucket a call of ``size`` would use, or None when it would not replay a graph."""
        index = bisect.bisect_left(self._sizes, size)
        if index == len(self._sizes):
            return None
        bucket = self._sizes[index]
        if (
            self.max_padding_fraction is not None
            and bucket - size > self.max_padding_fraction * bucket
        ):
            return None
        return bucket

    def graph(self, size: int) -> BreakableCUDAGraph:
        """The captured graph of bucket ``size``."""
        return self._buckets[size].graph

    def __call__(
        self, *inputs: torch.Tensor, context: Any = None, owned: bool = False, fingerprint: int = 0
    ) -> Any:
        """Run ``fn(*inputs)`` through the smallest bucket that fits (or eagerly).

        ``context`` is what eager functions see through ``replay_context()`` (default:
        the runner's). The result lives in graph memory and is overwritten by the next
        call unless ``owned=True``. With ``ranks``, ``fingerprint`` (see
        :func:`breakgraph.distributed.fingerprint`) must be equal on every rank.
        """
        if not self._sizes:
            raise ReplayError("BucketedRunner: the runner is closed; build a new one.")
        try:
            size = self._validate(inputs)
        except InputError:
            if self.ranks is not None:
                self.ranks.report_failure()  # the other ranks raise instead of waiting
            raise
        if self.ranks is not None:
            agreed = self.ranks.agree(size, fingerprint)
        else:
            agreed = self.agree_size(size) if self.agree_size is not None else size
        context = self.context if context is None else context
        index = bisect.bisect_left(self._sizes, agreed)
        if index == len(self._sizes):
            if self._window_open:
                self._capture_buckets([agreed])
                index = self._sizes.index(agreed)
            elif self.on_miss == "raise":
                raise InputError(
                    f"BucketedRunner: input size {size} exceeds the largest bucket "
                    f"{self._sizes[-1]}; add a bucket (inside runner.capture_window()) or "
                    f"construct the runner with on_miss='eager'."
                )
            else:
                return self._eager(inputs, context, "larger than every bucket")
        bucket = self._buckets[self._sizes[index]]
        if (  # decided on the agreed size, so every rank takes the same path
            self.max_padding_fraction is not None
            and (bucket.size - agreed) > self.max_padding_fraction * bucket.size
        ):
            return self._eager(inputs, context, "too much padding")
        for buffer, value, d, pad in zip(bucket.inputs, inputs, self._dims, self._pads):
            buffer.narrow(d, 0, size).copy_(value)
            if size < bucket.size:
                buffer.narrow(d, size, bucket.size - size).fill_(pad)
        bucket.graph.replay(context=context)
        self.stats.calls[bucket.size] += 1
        self.stats.padded_elements[bucket.size] += bucket.size - size
        output = self._slice(bucket.output, size, bucket.size)
        return tree_map(_clone, output) if owned else output

    def _eager(self, inputs: tuple, context: Any, reason: str) -> Any:
        self.stats.eager_fallbacks[reason] = self.stats.eager_fallbacks.get(reason, 0) + 1
        if self.ranks is not None:
            self.ranks.before_eager()
        with context_scope(context):
            return self.fn(*inputs)

    def _validate(self, inputs: tuple) -> int:
        if len(inputs) != len(self._examples):
            raise InputError(
                f"BucketedRunner: expected {len(self._examples)} inputs, got {len(inputs)}."
            )
        size = None
        for i, (value, (dtype, device, shape), d) in enumerate(
            zip(inputs, self._examples, self._dims)
        ):
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

    def _slice(self, output: Any, size: int, bucket_size: int) -> Any:
        if self.slice_outputs is False or size == bucket_size:
            return output
        if callable(self.slice_outputs):
            return self.slice_outputs(output, size)
        d = self._dims[0]

        def trim(t):
            if isinstance(t, torch.Tensor) and t.dim() > d and t.shape[d] == bucket_size:
                return t.narrow(d, 0, size)
            return t

        return tree_map(trim, output)

    def close(self) -> None:
        """Release every graph and static buffer."""
        for bucket in self._buckets.values():
            bucket.graph.reset()
        self._buckets.clear()
        self._sizes = []


def _per_input(value: Any, n: int, name: str) -> tuple:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InputError(f"BucketedRunner: {name} has {len(value)} entries for {n} inputs.")
        return tuple(value)
    return (value,) * n


def _with_dim(shape: tuple, dim: int, size: Any) -> tuple:
    return tuple(size if j == dim else s for j, s in enumerate(shape))


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
