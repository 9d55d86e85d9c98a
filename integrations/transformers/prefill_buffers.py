"""Where one prefill's inputs live: ``StepBuffers``, the static inputs of ``PrefillRunner``.

A prefill step is the prompts' ids, their positions, each prompt's last-token index and
the packed sequences' boundaries (``cu_seqlens``). All four live in ONE pinned host buffer,
mirrored by ONE device buffer whose views are every bucket's static inputs. The copy from
one to the other is not made by the host: it is the first node of every captured graph
(:meth:`StepBuffers.upload`, called at the start of the captured forward), so a call's
host work before its graph launch is numpy writes into the host buffer and nothing else.
That copy was the largest piece of that host work (a ``cudaMemcpyAsync`` on an idle GPU,
10 to 15 microseconds on an H200 server's host; ``benchmarks/prefill_host_path.py``).

Example::

    >>> import torch
    >>> from breakgraph.integrations.transformers.prefill_buffers import StepBuffers
    >>> steps = StepBuffers(max_tokens=16, max_prompts=4, device=torch.device("cpu"), pad_id=0)
    >>> prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    >>> steps.write_ids(prompts, [3, 2], vocab_size=10)
    True
    >>> steps.commit(prompts, [3, 2], bucket=8)  # the prompts' bounds, then the tail's
    [(0, 3), (3, 5), (5, 8)]
    >>> steps.upload()  # what the graph's first node does
    >>> steps.ids[:8].tolist(), steps.positions[:8].tolist()  # the tail: pad ids, any positions
    ([5, 6, 7, 8, 9, 0, 0, 0], [0, 1, 2, 0, 1, 5, 6, 7])
    >>> steps.cu_seqlens.tolist(), steps.last_index.tolist()
    ([0, 3, 5, 8, 8, 8], [2, 4, 0, 0])
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from breakgraph.errors import InputError
from breakgraph.static_inputs import StaticInputs

from .attention import PackedBatch

__all__ = ["StepBuffers", "as_prompt_list", "prompt_lengths"]


_FEW_PROMPTS = 8  # up to this many prompts, a step is staged with scalar writes
_SHORT_CHECK = 64  # up to this many ids, the vocabulary check is Python's max (see _largest_id)
_memmove = ctypes.memmove


class _HostView:
    """Numpy views of the pinned host buffer, made once (a ``.numpy()`` call or a slice is
    host time on every step): ``ids`` (and ``unsigned_ids``, the same memory as uint64),
    ``positions``, ``last`` (last-token indices), ``cu`` (int32 boundaries); and memoryviews
    of ``unsigned_ids``, ``ids``, ``last`` and ``cu`` (``*_memory``) for the writes and the
    check of a one-prompt step, which make no numpy call."""

    __slots__ = (
        "ids", "unsigned_ids", "unsigned_memory", "positions", "last", "cu", "ids_memory",
        "last_memory", "cu_memory",
    )  # fmt: skip

    def __init__(self, buffer: torch.Tensor, max_tokens: int, max_prompts: int):
        host, t, p = buffer.numpy(), max_tokens, max_prompts
        self.ids, self.positions = host[:t], host[t : 2 * t]
        self.unsigned_ids = self.ids.view(np.uint64)  # a negative id is a huge unsigned one
        self.unsigned_memory = memoryview(self.unsigned_ids)  # the same, for Python's max
        self.last = host[2 * t : 2 * t + p]
        self.cu = host[2 * t + p :].view(np.int32)[: p + 2]
        # the same memory as memoryviews, for the one-prompt staging: a memoryview write is
        # plain Python, where numpy's first call after other work is slow (see _largest_id)
        self.ids_memory = memoryview(self.ids)
        self.last_memory, self.cu_memory = memoryview(self.last), memoryview(self.cu)


class StepBuffers(StaticInputs):
    """Where one prefill's inputs live: a pinned host buffer the graphs copy from.

    Layout (int64): ``ids [T] | positions [T] | last-token indices [P] | cu_seqlens``
    (``P + 2`` int32 values in the int64 words after), the same in the host buffer and in
    the device buffer. Every bucket's static inputs are views of the device buffer's start,
    so the bucket graphs read the same memory (they never run at the same time).

    A call writes the host buffer (:meth:`write_ids`, then :meth:`commit`) and launches a
    graph whose first node copies the whole host buffer to the device (:meth:`upload`,
    captured); the next call's :meth:`write_ids` waits until that copy has run. With
    ``marks_in_graph`` (the CUDA backend) the mark is an event recorded by the graph itself,
    right after its copy node (an *external* event: captured, it is a node of the graph that
    CUDA records when it runs), so a call queued behind a running one waits only until the
    running graph has started; else the host records it after each launch
    (:meth:`launched`; the emulated backend replays aten operations, not event records), so
    such a call waits for the whole previous graph. One host buffer, because the graphs copy
    from its fixed address: a call waits when the previous call's graph has not started yet
    (the host is two calls ahead), never in a synchronous loop. Prompts already on the device reach
    their place in the host buffer by device-to-host copies issued before the launch, in
    stream order, so the graph's copy carries them too (they are not checked against the
    vocabulary: that would cost a host sync).

    Per call this is host work on a model step (each numpy call is about a microsecond on a
    GPU server's host), so it writes only what changed:

    * every view it writes through (numpy views of the host buffer, ``cu_seqlens[: k]``
      for every count ``k``) is made here, once;
    * the positions region holds ``0, 1, 2, ...`` between calls, so a first prompt's
      positions are already there; only later prompts' are written (and put back by the
      next call). The padding tail, a dummy sequence of its own, keeps these positions too:
      any position below the bucket is valid, and the tail of a given (length, bucket) is
      always the same;
    * ``cu_seqlens[0]`` is 0 for good; last-token indices a larger batch left behind are
      cleared only when there are some;
    * up to ``_FEW_PROMPTS`` prompts (one is the common case) are staged with scalar
      writes, with no numpy call over the lengths;
    * a first prompt on the device is copied into a view of the ids made once per length
      (``id_views``): a slice per call was most of the device-to-host copy's host time;
    * one prompt's staging makes no numpy call at all: its ids by ``memmove``, the vocabulary
      check by Python's ``max`` (:func:`_largest_id`), its last-token index, the boundaries'
      tail and the padding tail through memoryviews (from arrays of pad ids and of each
      bucket's boundary, made once). A served call starts on a host whose caches other work
      just filled, and there numpy's first call of the call is the slow one
      (``benchmarks/prefill_host_lines.py``).
    """

    def __init__(
        self,
        max_tokens: int,
        max_prompts: int,
        device: torch.device,
        pad_id: int,
        *,
        marks_in_graph: bool = False,
    ):
        example = torch.zeros(1, 1, dtype=torch.long, device=device)
        super().__init__((example, example), dims=1, pad_values=(pad_id, 0), who="PrefillRunner")
        self.max_tokens, self.max_prompts, self.pad_id = max_tokens, max_prompts, pad_id
        cu_words = (max_prompts + 3) // 2
        self.words = 2 * max_tokens + max_prompts + cu_words
        pin = device.type == "cuda"
        t, p = max_tokens, max_prompts
        with torch.inference_mode(False):
            self.host = torch.zeros(self.words, dtype=torch.long, pin_memory=pin)
            self.host[t : 2 * t] = torch.arange(t)  # the positions' resting state (see above)
            self.device_buffer = self.host.to(device, copy=True)
        self.view = _HostView(self.host, max_tokens, max_prompts)
        self.host_ids = self.host[:t]  # where device prompts' ids are copied to
        # ids[:n] per length n of a first prompt on the device: slicing a tensor is host time
        # on every call (a copy into a cached view took 3.8 us against 5.8 us with the slice, in
        # a loop on an H200 server's host: docs/results/h200-copy-issue.json)
        self.id_views: dict[int, torch.Tensor] = {}  # at most one per length up to max_tokens
        self.host_address = self.host.data_ptr()  # host prompts' ids are copied here (memmove)
        # the positions [start, end) that differ from the resting state, and how many
        # last-token indices the last step set; both are marked before a write (a write cut
        # short, by KeyboardInterrupt say, must leave nothing the next step would not undo)
        self.moved = (0, 0)
        self.every_position = (1, max_tokens)  # `moved` while a step's positions are written
        self.last_set = 0
        # "the host buffer was read": recorded by the graphs (external event) or by the host
        # after each launch (torch.Event: its record() finds the current stream in C++, where
        # torch.cuda.Event.record builds a Python torch.cuda.Stream, a few microseconds)
        self.marks_in_graph = marks_in_graph and pin
        self.read: torch.Event | torch.cuda.Event | None = None
        if self.marks_in_graph:
            self.read = torch.cuda.Event(external=True)
            self.read.record(torch.cuda.current_stream(device))  # created before any capture
        elif pin:
            self.read = torch.Event(device, enable_timing=False)
        self.ids, self.positions = self.device_buffer[:t], self.device_buffer[t : 2 * t]
        self.last_index = self.device_buffer[2 * t : 2 * t + p]
        self.cu_seqlens = self.device_buffer[2 * t + p :].view(torch.int32)[: p + 2]
        # cu_views[k] = cu[:k], made once for every batch a graph serves (at most max_tokens
        # prompts and a tail); an eager batch of more prompts slices its own (one view each
        # for every count up to a huge max_prompts took seconds and hundreds of MB)
        self.cu_views = [self.cu_seqlens[:k] for k in range(min(p, t) + 3)]
        self.arange = np.arange(max_tokens, dtype=np.int64)
        self.pad_ids = memoryview(np.full(max_tokens, pad_id, dtype=np.int64))  # a tail's ids
        self.cu_tails: dict = {}  # bucket -> memoryview of max_prompts + 1 int32 copies of it
        self.capture_ids: torch.Tensor | None = None  # see stage_capture

    def allocate(self, size: int) -> tuple:
        return self.ids[:size].view(1, size), self.positions[:size].view(1, size)

    def upload(self) -> None:
        """The host buffer to the device buffer: the first operation of the captured forward,
        so inside a graph it is the graph's first node (a copy from pinned memory reads the
        host buffer when the node runs, not when it was captured); with ``marks_in_graph``,
        the event the next call waits on is recorded right after it (the graph's next node)."""
        self.device_buffer.copy_(self.host, non_blocking=True)
        if self.marks_in_graph:  # on the stream the copy went to (the capture stream, capturing)
            self.read.record(torch.cuda.current_stream(self.device_buffer.device))

    def launched(self) -> None:
        """After a launch: unless the graphs mark it themselves, mark the host buffer as read
        by the work issued so far (the next :meth:`write_ids` waits for it)."""
        if self.read is not None and not self.marks_in_graph:
            self.read.record()

    def settle(self) -> None:
        """Wait until everything issued so far has read the host buffer (off the hot path:
        before staging a capture's or a tuning's batch)."""
        if self.read is not None:
            self.read.record()
            self.read.synchronize()

    def write_ids(self, prompts: list, lengths: list, vocab_size: int) -> bool:
        """First half of a step: the prompts' ids into the host buffer, checked against the
        vocabulary (host prompts, one pass over the staged ids). Runs before the bucket is decided,
        so a bad batch fails on this rank before any rank agrees to run it. False when the
        batch is longer than the buffer (an eager fallback builds its own tensors)."""
        total = sum(lengths)
        if total > self.max_tokens:
            for prompt in prompts:
                if prompt.is_meta or prompt.layout is not torch.strided:
                    raise _unreadable_error(prompts, prompt)
            _check_vocabulary([p for p in prompts if p.is_cpu], vocab_size)
            return False
        if self.read is not None:
            self.read.synchronize()  # the previous call's graph has copied the host buffer
        view = self.view
        address = self.host_address
        start = 0
        on_device = False
        for prompt, n in zip(prompts, lengths):
            if not prompt.is_cpu:
                if prompt.is_meta:  # no data (raised by the device-to-host copy after the decision)
                    raise _unreadable_error(prompts, prompt)
                on_device = True
            elif prompt.is_contiguous() and not prompt.is_neg():
                # a plain memory copy: `ids[a:b] = prompt.numpy()` is two numpy calls, and the
                # first numpy call after the GPU wait took 23-26 us on an H200 server's host,
                # against 9-10 us for this (docs/results/h200-host-path-lines.json)
                _memmove(address + 8 * start, prompt.data_ptr(), 8 * n)
            else:  # strided (or a negated view): numpy reads it element by element
                if prompt.layout is not torch.strided:  # numpy's TypeError, not ours
                    raise _unreadable_error(prompts, prompt)
                view.ids[start : start + n] = prompt.resolve_neg().numpy()
            start += n
        if on_device:  # device prompts are not checked: it would cost a host sync
            _check_vocabulary([p for p in prompts if p.is_cpu], vocab_size)
        elif total and _largest_id(view, total) >= vocab_size:  # < 0 or >= vocab
            raise _vocabulary_error(vocab_size)
        return True

    def commit(self, prompts: list, lengths: list, bucket: int) -> list:
        """Second half: positions, tail, last-token indices, boundaries into the host buffer;
        device prompts' ids into it by device-to-host copies. Returns the ``(start, end)``
        bounds of the prompts and of the tail (a dummy sequence, so every row is written).
        The call's graph (or eager forward) then copies the buffer to the device
        (:meth:`upload`)."""
        view = self.view
        positions, last, cu = view.positions, view.last, view.cu
        low, high = self.moved
        if high:  # a batch of several prompts left later prompts' positions here
            positions[low:high] = self.arange[low:high]
            self.moved = (0, 0)
        n = len(lengths)
        self._clear_stale_last(n)
        if n > 1:
            self.moved = self.every_position  # until the exact range is known (see __init__)
        if n == 1:  # the common case: the positions are in place
            total = lengths[0]
            view.last_memory[0] = total - 1
            view.cu_memory[1] = total
            bounds = [(0, total)]
        elif n <= _FEW_PROMPTS:  # scalar writes: cheaper than numpy's per-call cost for a few
            arange, bounds, start = self.arange, [], 0
            for j, length in enumerate(lengths):
                end = start + length
                if j:
                    positions[start:end] = arange[:length]
                last[j] = end - 1
                cu[j + 1] = end
                bounds.append((start, end))
                start = end
            total = start
        else:
            ends = np.cumsum(lengths)
            starts = ends - lengths
            total = int(ends[-1])
            positions[:total] = self.arange[:total] - np.repeat(starts, lengths)
            last[:n] = ends - 1
            cu[1 : n + 1] = ends
            bounds = list(zip(starts.tolist(), ends.tolist()))
        if n > 1:
            self.moved = (lengths[0], total)
        tail = self.cu_tails.get(bucket)
        if tail is None:
            tail = self.cu_tails[bucket] = memoryview(
                np.full(self.max_prompts + 1, bucket, np.int32)
            )
        view.cu_memory[n + 1 :] = tail[n:]  # the tail's end, then zero-length sequences
        if bucket > total:
            view.ids_memory[total:bucket] = self.pad_ids[: bucket - total]
            bounds.append((total, bucket))
        start = 0
        for prompt, length in zip(prompts, lengths):
            if not prompt.is_cpu:  # device prompts: into the host buffer, in stream order
                if start:
                    target = self.host_ids[start : start + length]
                else:  # a batch's first prompt: a view made once per length
                    target = self.id_views.get(length)
                    if target is None:
                        target = self.id_views[length] = self.host_ids[:length]
                target.copy_(prompt, non_blocking=True)
            start += length
        return bounds

    def stage_capture(self, size: int, vocab_size: int) -> list:
        """A capture's (or a timed tuning replay's) batch: one prompt of random ids filling
        ``size`` rows, after everything issued so far has read the buffer. Random, not the pad
        id: a MoE router sends equal tokens to the same experts, and a bucket timed on a load
        no prompt has is routed wrongly (on an H200, qwen3-moe-8l's buckets 960 and 1024 went
        to 1152: 1000-token prompts 4 % slower). Seeded, so every rank and every construction
        stages the same ids. Returns the prompt's bounds."""
        if self.capture_ids is None:
            seeded = torch.Generator().manual_seed(0)
            self.capture_ids = torch.randint(vocab_size, (self.max_tokens,), generator=seeded)
        self.settle()
        prompt = self.capture_ids[:size]
        self.write_ids([prompt], [size], vocab_size)
        return self.commit([prompt], [size], size)

    def wide_inputs(self, prompts: list, lengths: list) -> tuple:
        """A batch longer than the buffer (an eager run): its ids, positions and a place for
        its last-token indices, ``(1, total)``, ``(1, total)`` and ``(max_prompts,)``, in a
        device buffer of its own laid out as this one (one base, the positions at an offset,
        the indices after them; the forward copies the indices in after its upload). Why: a
        compiled forward (``compile=True``) guards on how its inputs view their base (one
        base for all three, offsets of at least 2); tensors of their own broke those guards,
        and Dynamo compiled the model's frames again at the first batch longer than the ladder
        (a tiny Llama on a CPU, AOT autograd: 6 frames, 4-6 s; docs/performance.md)."""
        total = sum(lengths)
        device = self.device_buffer.device
        wide = torch.empty(self.words + 2 * (total - self.max_tokens), dtype=torch.long,
                           device=device)  # fmt: skip
        ids, positions = wide[:total], wide[total : 2 * total]
        torch.cat([p.to(device) for p in prompts], out=ids)
        torch.cat([torch.arange(n, device=device) for n in lengths], out=positions)
        return ids.view(1, total), positions.view(1, total), wide[2 * total :][: self.max_prompts]

    def commit_boundaries(self, lengths: list) -> list:
        """A batch longer than the buffer (an eager run with its own ids and positions): only
        the last-token indices and boundaries, which the forward still reads from the device
        buffer. Returns the prompts' bounds."""
        self.settle()  # write_ids did not wait: it wrote nothing
        view = self.view
        ends = np.cumsum(lengths)
        n = len(lengths)
        self._clear_stale_last(n)  # before the writes: see __init__
        view.last[:n] = ends - 1
        view.cu[1 : n + 1] = ends
        view.cu[n + 1 :] = int(ends[-1])
        return list(zip((ends - lengths).tolist(), ends.tolist()))

    def packed_batch(self, bounds: list, prompts: int) -> PackedBatch:
        """What the attention breaks read about a staged batch of ``prompts`` prompts: its
        bounds (the padding tail's last, if any)."""
        longest = max(b - a for a, b in bounds)  # a prompt or the tail
        views, count = self.cu_views, len(bounds) + 1
        return PackedBatch(
            bounds,  # more prompts than a bucket has tokens: an eager batch (see StepBuffers)
            views[count] if count < len(views) else self.cu_seqlens[:count],
            longest,
            one_prompt=prompts == 1,
            live_tokens=bounds[prompts - 1][1],
        )

    def _clear_stale_last(self, n: int) -> None:
        """Before a step writes ``n`` last-token indices: zero those a larger step left, and
        count ``n`` as set (an index left past a smaller bucket failed every later call)."""
        if self.last_set > n:  # a larger batch's last-token indices (they could be past
            self.view.last[n : self.last_set] = 0  # this bucket: the graph gathers every entry)
        self.last_set = n


_largest = np.maximum.reduce  # ndarray.max() without its Python wrapper


def _largest_id(view: _HostView, total: int) -> int:
    """The largest of the staged ids read as unsigned (a negative id is a huge one). Up to
    ``_SHORT_CHECK`` ids, Python's ``max`` over a memoryview, else numpy's reduction. A served
    call runs on a host whose caches other work just filled (the GPU wait, a scheduler), and
    there numpy's first call is slow: ``benchmarks/prefill_host_lines.py`` on the CI-class CPU
    (32 ids, after an emulated replay) timed this check at 12.5-20.6 us with numpy and
    2.7-2.8 us with ``max``. Warm, both take about 1.5 us at 32 ids; ``max`` grows by about
    0.02 us per id, numpy's stays flat."""
    if total <= _SHORT_CHECK:
        return max(view.unsigned_memory[:total])
    return int(_largest(view.unsigned_ids[:total]))


def _check_vocabulary(prompts: list, vocab_size: int) -> None:
    for p in prompts:
        if int(p.min()) < 0 or int(p.max()) >= vocab_size:
            raise _vocabulary_error(vocab_size)


def _unreadable_error(prompts: list, prompt: torch.Tensor) -> InputError:
    i = next(j for j, p in enumerate(prompts) if p is prompt)
    what = "on the meta device (no data)" if prompt.is_meta else f"of layout {prompt.layout}"
    return InputError(
        f"PrefillRunner.prefill: prompt {i} is a tensor {what}; pass its token ids as a dense "
        f"tensor with data (.to_dense(), or the ids on the CPU or the model's device)."
    )


def _vocabulary_error(vocab_size: int) -> InputError:
    # on the GPU an out-of-range id is a device-side assert that kills the process
    return InputError(
        f"PrefillRunner.prefill: a prompt holds token ids outside the vocabulary "
        f"(0..{vocab_size - 1})."
    )


def as_prompt_list(prompts) -> list:
    """``prompts`` (not a list: a list is taken as it is) as a list; ``InputError`` for one
    tensor, a tokenizer's output, a string or what is not iterable (each with what to pass)."""
    if isinstance(prompts, torch.Tensor):
        hint = "wrap a single prompt as [ids]"
        if prompts.ndim == 2:  # a batch of rows: padded by a tokenizer, usually
            hint = "pass its rows as a list (list(ids)), each prompt at its length (no padding)"
        raise InputError(
            f"PrefillRunner.prefill: pass a non-empty list of 1-D LongTensors (one per "
            f"prompt), not one tensor; {hint}."
        )
    # a mapping iterates over its keys, a string over its characters: neither is ids
    if isinstance(prompts, Mapping | str) or not isinstance(prompts, Iterable):
        raise InputError(
            f"PrefillRunner.prefill: pass a non-empty list of 1-D LongTensors (one per "
            f"prompt), got {type(prompts).__name__}{_prompt_hint(prompts)}."
        )
    return list(prompts)


def _prompt_hint(p) -> str:
    """What to pass instead of ``p`` (a refused prompt, or batch), for the error's end."""
    if isinstance(p, Mapping):  # transformers' BatchEncoding: a tokenizer's output
        return (
            f" (a tokenizer's output? keys {list(p)[:3]}): pass its token ids, one tensor per "
            f"prompt, e.g. [torch.tensor(ids) for ids in encoding['input_ids']]"
        )
    if isinstance(p, str):
        return ": pass token ids, not text (the tokenizer's input_ids)"
    if isinstance(p, list | tuple):
        return ": make each prompt a tensor, torch.tensor(ids)"
    if isinstance(p, int):  # one prompt's ids as the batch
        return ": pass a list of prompts, each a tensor, [torch.tensor(ids)]"
    if isinstance(p, np.ndarray):
        return ": make each prompt a tensor, torch.from_numpy(ids).long()"
    if not isinstance(p, torch.Tensor):
        return ""
    if p.ndim == 2 and p.shape[0] == 1:
        return ": a tokenizer's [1, n] row, pass ids[0]"
    if p.ndim == 1 and p.numel() and not p.dtype.is_floating_point:
        return ": convert it, ids.long()"
    if p.ndim == 1 and not p.numel():
        return ": an empty prompt has no last token to predict from"
    return ""


def prompt_lengths(prompts: list, max_prompts: int) -> list[int]:
    """The prompts' lengths; ``InputError`` unless ``prompts`` holds 1 to ``max_prompts``
    non-empty 1-D LongTensors (per call: the common case is one pass of attribute reads)."""
    if not prompts:
        raise InputError("PrefillRunner.prefill: pass a non-empty list of 1-D LongTensors.")
    if len(prompts) > max_prompts:
        raise InputError(
            f"PrefillRunner.prefill: {len(prompts)} prompts exceed max_prompts={max_prompts}; "
            f"split the batch or build the runner with a larger max_prompts."
        )
    long = torch.long
    lengths = []
    for p in prompts:  # the common case first: one pass of cheap attribute reads
        if not isinstance(p, torch.Tensor) or p.ndim != 1 or p.dtype is not long:
            break
        n = p.numel()
        if not n:
            break
        lengths.append(n)
    else:
        return lengths
    i = len(lengths)  # the first bad prompt
    p = prompts[i]
    raise InputError(
        f"PrefillRunner.prefill: prompt {i} must be a non-empty 1-D LongTensor of token ids, "
        f"got {type(p).__name__}"
        + (f" of shape {tuple(p.shape)} and dtype {p.dtype}" if isinstance(p, torch.Tensor) else "")
        + _prompt_hint(p)
        + "."
    )
