"""Bucketed graphs for variable-size inputs: one breakable graph per size bucket.

Real inputs change size every step; a graph is frozen to one size. A
``BucketedRunner`` captures one :class:`~breakgraph.BreakableCUDAGraph` per bucket
(say token counts 64, 256, 1024) at start-up, all in one memory pool, and serves
any input by copying it into the static buffers of the smallest bucket that fits
and filling the rest of the bucket (the *tail*) with a defined value.

Three small pieces, one job each:

* a :class:`~breakgraph.ladder.GraphLadder` owns the graphs: it captures every bucket
  largest first into one pool, decides per call (:func:`choose_bucket`: replay a bucket,
  capture a new one, run eagerly, or refuse), replays, counts and releases;
* :class:`~breakgraph.static_inputs.StaticInputs` owns the static input buffers: their
  spec, validation, copy-in and tail padding;
* :class:`BucketedRunner` holds one of each, plus the output trimming, the eager
  fallback and the dispatch of each call.

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

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import distributed
from .buckets import (
    Action,
    Decision,
    choose_bucket,
    faster_buckets,
    validate_buckets,
    validate_callable,
    validate_count,
    validate_flag,
)
from .eager import eager_on_graph
from .errors import CaptureError, InputError
from .graph import BreakableCUDAGraph
from .ladder import GraphLadder, LadderStats
from .modes import any_autocast, autocast_as, autocast_now
from .state import context_scope
from .static_inputs import StaticInputs
from .structure import map_tensors

__all__ = [
    "BucketedRunner",
    "RunnerStats",
    "Decision",
    "choose_bucket",
    "StaticInputs",
    "faster_buckets",
]


# -- the runner -----------------------------------------------------------------------------------


#: The counters of a runner: the ladder's (see :class:`~breakgraph.ladder.LadderStats`).
RunnerStats = LadderStats


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
        sizes = validate_buckets(buckets, "BucketedRunner")
        validate_callable(fn, "BucketedRunner: fn", optional=False)
        validate_callable(capture_context, "BucketedRunner: capture_context")
        for flag, value in (
            ("warmup_each", warmup_each), ("eager_region", eager_region), ("progress", progress)
        ):  # a flag taken for its truth value would read "no" as on, 0 as off
            validate_flag(value, f"BucketedRunner: {flag}")
        if not callable(slice_outputs):  # 0 or None would trim, as True does: say so here
            validate_flag(slice_outputs, "BucketedRunner: slice_outputs (or a callable)")
        warmup = validate_count(warmup, 0, "BucketedRunner: warmup")
        if ranks is not None and warmup < 1:
            raise InputError(
                "BucketedRunner: with ranks=, collectives must run eagerly before capture "
                "(warmup >= 1)."
            )
        # duck types would fail later as a bare AttributeError ('str' has no 'agree_settings')
        for name, value, kind in (
            ("ranks", ranks, distributed.RankGroup), ("static_inputs", static_inputs, StaticInputs)
        ):
            if value is not None and not isinstance(value, kind):
                raise InputError(
                    f"BucketedRunner: {name} must be a {kind.__module__}.{kind.__name__} or "
                    f"None, got {type(value).__name__}."
                )
        self.ladder = GraphLadder(
            backend=backend,
            pool=pool,
            ranks=ranks,
            debug=debug,
            on_miss=on_miss,
            max_padding_fraction=max_padding_fraction,
            agree_size=agree_size,
            progress=progress,
            who="BucketedRunner",
        )
        self.inputs = (
            static_inputs
            if static_inputs is not None
            else StaticInputs(example_inputs, dims, pad_values, who="BucketedRunner")
        )
        self.fn = fn
        self._captured_fn = eager_on_graph(fn) if eager_region else fn
        self.slice_outputs = slice_outputs
        self.ranks = ranks
        self.warmup = warmup
        self.warmup_each = warmup_each
        self.backend = self.ladder.backend
        self.context = context
        self.capture_context = capture_context
        self._autocast = autocast_now()  # the graphs' autocast: the eager fallback's too
        self._buffers: dict[int, tuple] = {}  # bucket -> its static input buffers
        if ranks is not None:  # the same buckets, captured alike, and the same decisions
            shapes = [(dtype, device.type, shape) for dtype, device, shape in self.inputs.specs]
            ranks.agree_settings("BucketedRunner", {
                "buckets": sizes, "dims": self.inputs.dims, "pad_values": self.inputs.pads,
                "input shapes": shapes, "on_miss": on_miss, "warmup": warmup,
                "max_padding_fraction": max_padding_fraction, "warmup_each": warmup_each,
                "eager_region": eager_region, "backend": self.backend, "debug": self.debug,
            })  # fmt: skip
        try:
            self._capture(sizes)
        except BaseException:  # nobody gets this runner to close: the buckets captured go now
            self.close()
            raise

    # -- capture phase ----------------------------------------------------------------
    @contextlib.contextmanager
    def capture_window(self) -> Iterator[BucketedRunner]:
        """Allow new captures (``add_buckets``, and calls larger than every bucket).

        Capturing mid-run can grow shared workspaces and move addresses that earlier
        graphs baked in: open the window only at a quiet point, e.g. start-up.
        """
        with self.ladder.capture_window():
            yield self

    def add_buckets(self, buckets: Sequence[int]) -> None:
        """Capture more buckets; only inside ``capture_window()``."""
        self.ladder._check_open("add_buckets")
        if not self.ladder.window_open:
            raise CaptureError(
                "BucketedRunner.add_buckets: the capture phase is over; open it again with "
                "`with runner.capture_window(): runner.add_buckets(...)`."
            )
        self._capture(validate_buckets(buckets, "BucketedRunner.add_buckets", allow_empty=True))

    def _capture(self, sizes: Sequence[int]) -> None:
        """One capture phase: one warm-up (or one per bucket) and one gc pass in all."""
        try:
            for size in sizes:  # before any capture: allocated inside one, they'd be recorded
                self._buffers_of(size)
            self.ladder.capture(
                sizes,
                self._record,
                warm_up=self._warm_up if self.warmup > 0 else None,
                warm_up_each=self.warmup_each,
                context=self._capture_context,
            )
        finally:  # a failed bucket's buffers go (also those allocated before an allocation
            # failed), unless a failed NCCL step must keep them
            if self.ranks is None or not self.ranks.keeps_memory:
                for size in [s for s in self._buffers if s not in self.ladder.buckets]:
                    del self._buffers[size]

    def _buffers_of(self, size: int) -> tuple:
        buffers = self._buffers.get(size)
        if buffers is None:
            buffers = self._buffers[size] = self.inputs.allocate(size)
        return buffers

    def _record(self, size: int) -> Any:
        """The capture, under ``no_grad``: replays run no autograd, and captured in the
        caller's grad mode (the default) an ``nn.Module`` with trainable weights handed out
        outputs carrying a stale capture-time ``grad_fn``, and an eager break whose result
        autograd saved (``sigmoid``, ``softmax``) failed the first call with ``CopyBackError``
        (its output was held by autograd, not by the graph). And under the autocast the runner
        was built under, as its eager fallback: a bucket added later (``add_buckets``, a call
        above every bucket inside ``capture_window()``) under another autocast (the caller's)
        gave its sizes other dtypes than the other buckets' and the fallback's."""
        with torch.no_grad(), autocast_as(self._autocast):
            return self._captured_fn(*self._buffers[size])

    def _warm_up(self, size: int) -> None:
        inputs = self._buffers[size]
        # as the capture (a compiled fn must not compile again there)
        with torch.no_grad(), autocast_as(self._autocast):
            for _ in range(self.warmup):
                self.fn(*inputs)

    def _capture_context(self, size: int) -> Any:
        return self.capture_context(size) if self.capture_context else self.context

    # -- serving ------------------------------------------------------------------------
    @property
    def buckets(self) -> tuple[int, ...]:
        """The captured bucket sizes, ascending."""
        return self.ladder.buckets

    @property
    def stats(self) -> LadderStats:
        """The counters (a :class:`~breakgraph.ladder.LadderStats`, alias ``RunnerStats``)."""
        return self.ladder.stats

    @property
    def on_miss(self) -> str:
        return self.ladder.on_miss

    @property
    def max_padding_fraction(self) -> float | None:
        return self.ladder.max_padding_fraction

    @property
    def agree_size(self) -> Callable[[int], int] | None:
        return self.ladder.agree_size

    @property
    def debug(self) -> bool:
        return self.ladder.debug

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
        # the ladder validates the size (as "BucketedRunner.decide") and, with ranks, tells the
        # others first: refused here, they waited and paired this call with the next one
        return self.ladder.decide(size, fingerprint)

    def bucket_for(self, size: int) -> int | None:
        """The bucket a call of ``size`` would replay, or None when it would not replay a graph:
        the decision ``__call__`` makes (``agree_size`` and the capture window included). With
        ``ranks`` it looks at this rank's size only: it exchanges nothing."""
        size = validate_count(size, 0, "BucketedRunner.bucket_for: size")
        agree = self.ladder.agree_size
        decision = self.ladder.choose(agree(size) if agree is not None else size)
        return decision.bucket if decision.action is Action.REPLAY else None

    def tune(self, repeats: int = 1, margin: float = 0.02, warmup: int = 1) -> dict[int, float]:
        """Time every bucket's graph; send each size to the fastest bucket that holds it.

        GEMM libraries pick kernels by shape, and some sizes are slow: on an H200 a
        Llama-1B prefill padded to 208 tokens took longer than one padded to 224 or 256.
        After tuning, a bucket that a larger bucket beats by more than ``margin`` routes its calls
        there (``stats.routed``; the times are in ``stats.replay_ms``). Each bucket replays
        ``repeats`` times (after ``warmup`` untimed replays) on its capture-time inputs and context.
        CUDA only (the emulated backend's times mean nothing: nothing is routed); not with ``ranks``
        (timings differ between ranks, and every rank must take the same bucket). Returns the
        milliseconds per replay of each bucket (:meth:`GraphLadder.tune
        <breakgraph.ladder.GraphLadder.tune>`).
        """
        return self.ladder.tune(self._capture_context, repeats, margin, warmup)

    def graph(self, size: int) -> BreakableCUDAGraph:
        """The captured graph of bucket ``size``."""
        return self.ladder.graph(size)

    def static_inputs(self, size: int) -> tuple:
        """The static input buffers of bucket ``size`` (what :meth:`replay` reads)."""
        self.ladder.graph(size, what="static_inputs")  # a named error for a size not a bucket
        return self._buffers[size]

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
            if owned is not True and owned is not False:  # "no" would copy, as True does
                validate_flag(owned, "BucketedRunner: owned")
            size = self.inputs.size_of(inputs)
        except BaseException:  # an InputError, or an interrupt: before the call's exchange
            if self.ranks is not None:  # the others raise, not pair it with this rank's next
                self.ranks.report_failure()
            raise
        ladder = self.ladder
        decision = ladder.decide(size, fingerprint)
        context = self.context if context is None else context
        action = decision.action
        if action is Action.CAPTURE:
            self._capture([decision.bucket])
            decision = ladder.decide(size)
            action = decision.action
        if action is Action.RAISE:
            raise InputError(
                f"BucketedRunner: input size {size} exceeds the largest bucket "
                f"{ladder.buckets[-1]}; add a bucket (inside runner.capture_window()) or "
                f"construct the runner with on_miss='eager'."
            )
        try:
            if action is Action.EAGER:
                output = self.run_eagerly(inputs, context, decision.reason)
            else:
                bucket = decision.bucket
                self.inputs._copy_in(self._buffers[bucket], inputs, size)
                output = self._slice(ladder.replay(bucket, context, size=size), size, bucket)
        except BaseException as exc:  # the other ranks may wait in a collective for this one
            if self.ranks is not None:
                self.ranks.failed_mid_call(exc, "BucketedRunner")
            raise
        return map_tensors(torch.Tensor.clone, output) if owned else output

    def replay(self, bucket: int, context: Any = None, size: int | None = None) -> Any:
        """Replay bucket ``bucket`` on what its static inputs hold now; its whole output.

        For callers that fill the static inputs themselves (:meth:`static_inputs`);
        ``size`` (the live size, for the padding counter) defaults to the bucket.
        """
        return self.ladder.replay(bucket, self.context if context is None else context, size=size)

    def run_eagerly(self, inputs: tuple, context: Any, reason: str) -> Any:
        """Run ``fn`` on the live inputs (a tuple; counted as an eager fallback for
        ``reason``), under the autocast the graphs were captured under (none, unless the runner
        was built inside ``torch.autocast``): an input longer than every bucket gets the dtypes
        a bucket's graph would have given, whatever autocast the caller has on."""
        if not isinstance(inputs, tuple):  # a tensor would be unpacked into its rows
            raise InputError(
                f"BucketedRunner.run_eagerly: inputs must be a tuple of the inputs, got "
                f"{type(inputs).__name__}; pass (x,) for one input."
            )
        self.ladder.record_eager(reason)
        context = self.context if context is None else context
        if self._autocast is None and not any_autocast():  # the common case: nothing to pin
            with context_scope(context):
                return self.fn(*inputs)
        with context_scope(context), autocast_as(self._autocast):
            return self.fn(*inputs)

    def _slice(self, output: Any, size: int, bucket_size: int) -> Any:
        if self.slice_outputs is False:
            return output
        if self.slice_outputs is not True:  # a callable: at an exact size too, so that one
            return self.slice_outputs(output, size)  # that reshapes gives one type always
        if size == bucket_size:
            return output
        d = self.inputs.dims[0]  # the first input's bucketed dimension, counted from the start

        def trim(t: torch.Tensor) -> torch.Tensor:
            if t.dim() > d and t.shape[d] == bucket_size:
                return t.narrow(d, 0, size)
            return t

        return map_tensors(trim, output)

    def close(self) -> None:
        """Release every graph and static buffer, for good: later calls, ``decide``,
        ``capture_window`` and ``add_buckets`` raise ``ReplayError``. (After a failed
        multi-rank NCCL capture: keep them until the process exits, see
        ``RankGroup.capture_step``.)"""
        self.ladder.close()
        if self.ranks is None or not self.ranks.keeps_memory:
            self._buffers.clear()
