"""How ``benchmarks/bench_cb.py`` measures continuous batching, and the transformers
internals it reads to do so (breakgraph itself reads none of them).

* :class:`StepCounter`: steps and the host's scheduling time of each, by wrapping
  ``ContinuousBatchProcessor.prepare_next_batch`` (the one transformers method wrapped); with
  ``lists`` also the conversions of long Python lists to tensors inside it (``torch.tensor``
  wrapped for the run: transformers' cache index lists);
* :class:`GraphLog`: transformers' own whole-step graph captures, from the INFO messages it
  logs around each (no patch);
* :class:`StepTimer`: host time, size and CUDA-event device span of each forward call, by
  wrapping breakgraph's step runner (or the model's own ``forward`` for stock eager steps),
  and for breakgraph the host time of its attention breaks inside it, and of transformers'
  paged-cache update inside those (breakgraph's own ``PagedAttention.__call__`` and
  ``compat.cache_read_write``, wrapped);
* :func:`decode_window`: the wall time of a pure-decode step, from the requests' token
  timestamps (public: ``add_requests(record_timestamps=True)``).

Everything it reads of transformers is listed in :data:`INTERNALS` and probed by
:func:`internals_problems` before a run; a release that lacks one stops the run with a
message (:func:`require_internals`), never an ``AttributeError`` mid-run.

Example::

    >>> import types
    >>> outputs = [types.SimpleNamespace(timestamps=[1.0, 2.0, 3.0]),
    ...            types.SimpleNamespace(timestamps=[1.5, 2.0, 2.5, 3.0])]
    >>> decode_window(outputs, [10, 20])["decode_step_ms"]   # steps of 0.5 s from 1.5 s on
    500.0
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import statistics
import time

import torch
import transformers
from breakgraph.integrations.transformers import compat

from breakgraph.patches import PatchSet

INTERNALS = (
    "ContinuousBatchProcessor.prepare_next_batch (transformers.generation.continuous_batching"
    ".continuous_api): wrapped to count steps and time the host's scheduling of each",
    "the 'Creating graph for' / 'Setting graph for' INFO messages of the "
    "'ContinuousBatchingLogger' logger: count and time transformers' own graph captures",
)


def _processor_class():
    from transformers.generation.continuous_batching import continuous_api

    return getattr(continuous_api, "ContinuousBatchProcessor", None)


def internals_problems(stock_graphs: bool) -> list[str]:
    """What this transformers lacks of ``INTERNALS`` and of the public CB API the benchmark
    uses (the graph messages only when ``stock_graphs``: a stock variant with graphs runs)."""
    found = []
    try:
        processor = _processor_class()
        if not callable(getattr(processor, "prepare_next_batch", None)):
            found.append("ContinuousBatchProcessor.prepare_next_batch is missing (steps, host "
                         "scheduling time)")  # fmt: skip
        if stock_graphs:
            from transformers.generation.continuous_batching import input_outputs

            source = inspect.getsource(input_outputs)
            for message in GraphLog.MESSAGES:
                if message not in source:
                    found.append(f"transformers no longer logs {message!r} (stock graph count)")
        from transformers import ContinuousBatchingConfig

        fields = vars(ContinuousBatchingConfig())
        wanted = ("num_blocks", "max_batch_tokens", "allow_block_sharing", "use_cuda_graph",
                  "use_async_batching")  # fmt: skip
        missing = [f for f in wanted if f not in fields]
        if "page_size" not in fields and "block_size" not in fields:
            missing.append("page_size/block_size")
        if missing:
            found.append(f"ContinuousBatchingConfig has no {missing}")
        manager = compat.manager_class()
        for name in ("add_requests", "get_result", "warmup", "start", "stop", "destroy"):
            if not callable(getattr(manager, name, None)):
                found.append(f"ContinuousBatchingManager.{name} is missing")
        if "record_timestamps" not in inspect.signature(manager.add_requests).parameters:
            found.append("ContinuousBatchingManager.add_requests takes no record_timestamps")
    except ImportError as exc:
        found.append(f"continuous batching cannot be imported ({exc})")
    return found


def require_internals(stock_graphs: bool) -> None:
    """Stop with a message naming the release and what it lacks (never an AttributeError
    mid-run)."""
    found = internals_problems(stock_graphs)
    if found:
        raise SystemExit(
            f"bench_cb: transformers {transformers.__version__} lacks what this benchmark reads: "
            f"{'; '.join(found)}. Update benchmarks/cb_instruments.py (INTERNALS) for this release."
        )


class StepCounter:
    """CB steps and the host time transformers spends scheduling them (``prepare_next_batch``,
    the one transformers method this benchmark wraps; it returns whether a step follows).

    With ``lists`` it also times, inside that method, every ``torch.tensor`` made from a
    Python list of more than :data:`LONG_LIST` entries: transformers builds a step's cache
    read indices (every cached key of every request in the step, each step) and write indices
    as Python lists and converts them with ``torch.tensor``. ``torch.tensor`` is wrapped for
    the run (every caller pays the wrapper's fraction of a microsecond, so the option is off
    by default)."""

    LONG_LIST = 1024  # a step's token ids stay below it at the default max_batch_tokens / 2

    def __init__(self, lists: bool = False) -> None:
        self.lists = lists
        self.steps, self.prepare_s = 0, 0.0
        self.each: list[float] = []  # ms of each step's scheduling, in order
        self.lists_s, self.list_entries = 0.0, 0
        self._inside = False

    def install(self, patches: PatchSet) -> None:
        processor = _processor_class()
        original = processor.prepare_next_batch

        def prepare_next_batch(this):
            lists_s, entries = self.lists_s, self.list_entries
            self._inside = True
            start = time.perf_counter()
            try:
                scheduled = original(this)
            finally:
                self._inside = False
            if scheduled:  # an idle loop polls it too: only steps count
                seconds = time.perf_counter() - start
                self.prepare_s += seconds
                self.each.append(1e3 * seconds)
                self.steps += 1
            else:
                self.lists_s, self.list_entries = lists_s, entries
            return scheduled

        patches.attribute(processor, "prepare_next_batch", prepare_next_batch)
        if self.lists:
            self._wrap_tensor(patches)

    def _wrap_tensor(self, patches: PatchSet) -> None:
        """Time ``torch.tensor`` and breakgraph's numpy conversion (``NumpyLists``, which
        transformers calls instead while CB is enabled), the outermost call only."""
        from breakgraph.integrations.transformers.index_lists import NumpyLists

        long_list, depth = self.LONG_LIST, [0]

        def timed(make, first: int):  # first: where the data is (1 after a method's self)
            @functools.wraps(make)
            def convert(*args, **kwargs):
                data = args[first] if len(args) > first else None
                if depth[0] or not (self._inside and type(data) is list
                                    and len(data) > long_list):  # fmt: skip
                    return make(*args, **kwargs)
                depth[0] += 1
                start = time.perf_counter()
                try:
                    return make(*args, **kwargs)
                finally:
                    depth[0] -= 1
                    self.lists_s += time.perf_counter() - start
                    self.list_entries += len(data)

            return convert

        patches.attribute(torch, "tensor", timed(torch.tensor, 0))
        patches.attribute(NumpyLists, "tensor", timed(NumpyLists.tensor, 1))

    def reset(self) -> None:
        self.steps, self.prepare_s = 0, 0.0
        self.each = []
        self.lists_s, self.list_entries = 0.0, 0

    def summary(self) -> dict:
        """Per step: the scheduling time and (``lists``) the long lists' conversions in it."""
        steps = max(1, self.steps)
        out = {"host_prepare_ms_per_step": 1e3 * self.prepare_s / steps}
        if self.lists:
            out["host_prepare_lists_ms_per_step"] = 1e3 * self.lists_s / steps
            out["host_prepare_list_entries_per_step"] = self.list_entries / steps
            if self.list_entries:
                out["host_prepare_ns_per_list_entry"] = 1e9 * self.lists_s / self.list_entries
        return out


class GraphLog(logging.Handler):
    """transformers' own graph captures, from the INFO messages it logs around each one
    (a capture's seconds: from 'Creating' to 'Setting', its warm-up forward included)."""

    MESSAGES = ("Creating graph for", "Setting graph for")
    LOGGER = "ContinuousBatchingLogger"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.captures, self.capture_s, self._opened = 0, 0.0, None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.MESSAGES[0] in message:
            self._opened = record.created
        elif self.MESSAGES[1] in message:
            self.captures += 1
            if self._opened is not None:
                self.capture_s += record.created - self._opened
            self._opened = None

    def install(self, stack: contextlib.ExitStack) -> None:
        """Listen until ``stack`` closes. transformers' own console handler of that logger
        keeps printing warnings only; every level is restored."""
        logger = logging.getLogger(self.LOGGER)
        stack.callback(logger.setLevel, logger.level)
        for handler in list(logger.handlers):
            stack.callback(handler.setLevel, handler.level)
            handler.setLevel(max(handler.level, logging.WARNING))
        stack.callback(logger.removeHandler, self)
        logger.addHandler(self)
        logger.setLevel(logging.INFO)

    def reset(self) -> None:
        self.captures, self.capture_s, self._opened = 0, 0.0, None


class StepTimer:
    """Each forward call's host time, size and (CUDA) device span: wraps one ``forward``
    (breakgraph's step runner, or the model's own for stock eager steps) in a PatchSet.
    Never used around transformers' graphs: an event recorded while capturing would be
    captured."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.records: list[tuple] = []  # (host s, start event, end event, tokens, rows)
        self.split: list[tuple] = []  # per forward: (breaks' host s, cache updates' host s)
        self._events: list = []
        self._inside = [0.0, 0.0]  # the current forward's breaks and cache updates, so far

    def install(self, patches: PatchSet, owner, breaks: bool = False) -> None:
        """Wrap ``owner.forward``; with ``breaks`` (breakgraph's step runner) also time its
        attention breaks and the cache updates inside them."""
        original = owner.forward
        names = compat.step_kwargs()
        if breaks:
            self._wrap_breaks(patches)

        @functools.wraps(original)  # transformers reads the signature (logits_to_keep)
        def forward(*args, **kwargs):
            start = end = None
            if self.cuda:
                start, end = self._pair(len(self.records))
                start.record()
            self._inside[0] = self._inside[1] = 0.0
            begin = time.perf_counter()
            out = original(*args, **kwargs)
            host = time.perf_counter() - begin
            if self.cuda:
                end.record()
            self.split.append(tuple(self._inside))
            ids, keep = kwargs.get(names.input_ids), kwargs.get(names.logits_to_keep)
            tokens = ids.shape[-1] if ids is not None else 0
            rows = keep.numel() if isinstance(keep, torch.Tensor) else tokens
            self.records.append((host, start, end, tokens, rows))
            return out

        patches.attribute(owner, "forward", forward)

    def _wrap_breaks(self, patches: PatchSet) -> None:
        from breakgraph.integrations.transformers import cb_step

        inside = self._inside

        def timed(function, slot: int):
            @functools.wraps(function)
            def run(*args, **kwargs):
                begin = time.perf_counter()
                try:
                    return function(*args, **kwargs)
                finally:
                    inside[slot] += time.perf_counter() - begin

            return run

        # the graphs call each break instance, whose __call__ is looked up on the class
        patches.attribute(
            cb_step.PagedAttention, "__call__", timed(cb_step.PagedAttention.__call__, 0)
        )
        patches.attribute(compat, "cache_read_write", timed(compat.cache_read_write, 1))

    def _pair(self, index: int) -> tuple:
        while len(self._events) <= index:
            self._events.append(tuple(torch.cuda.Event(enable_timing=True) for _ in range(2)))
        return self._events[index]

    def reset(self) -> None:
        self.records.clear()
        self.split.clear()

    def summary(self, seconds: float, decode_min_rows: int, prepare_ms=()) -> dict:
        """Per forward: host time, device span (CUDA), breaks' and cache updates' host time;
        the medians over pure-decode forwards (every row a query, ``decode_min_rows`` or more),
        with their steps' scheduling time from ``prepare_ms`` (:attr:`StepCounter.each`: the
        k-th scheduled step is the k-th forward)."""
        if not self.records:
            return {}
        host = [r[0] * 1e3 for r in self.records]
        out = {"forward_calls": len(host), "forward_host_ms_per_step": statistics.mean(host)}
        if any(b for b, _ in self.split):
            out["break_host_ms_per_step"] = statistics.mean(b * 1e3 for b, _ in self.split)
            out["cache_update_host_ms_per_step"] = statistics.mean(u * 1e3 for _, u in self.split)
        spans = None
        if self.cuda:
            torch.cuda.synchronize()
            spans = [s.elapsed_time(e) for _, s, e, _, _ in self.records]
            out["forward_device_ms_per_step"] = statistics.mean(spans)
            out["gpu_forward_fraction"] = sum(spans) / 1e3 / seconds
        decode = [i for i, r in enumerate(self.records) if r[3] == r[4] >= decode_min_rows]
        if decode:
            out["decode_forward_steps"] = len(decode)
            out["decode_forward_host_ms"] = statistics.median(host[i] for i in decode)
            if "break_host_ms_per_step" in out:
                out["decode_break_host_ms"] = statistics.median(
                    self.split[i][0] * 1e3 for i in decode
                )
            if spans is not None:
                out["decode_forward_device_ms"] = statistics.median(spans[i] for i in decode)
            if len(prepare_ms) == len(self.records):  # one scheduling per forward
                out["decode_prepare_ms"] = statistics.median(prepare_ms[i] for i in decode)
        return out


def decode_window(outputs, prompt_lengths) -> dict:
    """The pure-decode steps of a pass, from the requests' token timestamps.

    Between the last request's first token (every prompt prefilled) and the first request's
    last token (none finished yet) each step decodes one token of every request: the median
    interval between a request's tokens there is one decode step's wall time. Also returns
    the requests and their mean key count in those steps (for the HBM floor).
    """
    start = max(o.timestamps[0] for o in outputs)
    end = min(o.timestamps[-1] for o in outputs)
    intervals, keys = [], []
    for output, length in zip(outputs, prompt_lengths):
        stamps = output.timestamps
        for i in range(1, len(stamps)):
            if stamps[i - 1] >= start and stamps[i] <= end:
                intervals.append(stamps[i] - stamps[i - 1])
                keys.append(length + i)  # token i is decoded over the prompt and i tokens
    if not intervals:
        return {}
    return {
        "decode_step_ms": 1e3 * statistics.median(intervals),
        "decode_requests": len(outputs),
        "decode_context": statistics.mean(keys),
        "decode_intervals": len(intervals),
    }
