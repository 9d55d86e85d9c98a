"""Continuous batching: transformers' ``ModelRunner`` with one breakable graph per query bucket.

transformers 5.17 runs every CB step through ``ModelRunner.compute_batch``:
``_forward_process_and_sample`` (model forward with ``logits_to_keep``, fp32
logits, logits processors, argmax or multinomial, copy into the static
``output_ids``) runs eagerly, or as a plain CUDA graph keyed by
``(query tokens, KV tokens read, max_seqlen_k)`` with upper-bound lengths baked in.

:class:`BreakgraphModelRunner` keeps all of transformers' host side (scheduler,
static input buffers, padding sequences of length 0, trash slots for padded
tokens) and changes three things:

* ``maybe_pad_inputs``: query tokens pad up to a bucket; the KV read is not padded;
* ``compute_batch``: one :class:`~breakgraph.BreakableCUDAGraph` per query bucket,
  captured on first use (after an eager warm-up that touches no cache) and replayed
  with the live step (:class:`~.cb_attention.CBStep`) as its context, so each
  attention break sees the step's exact lengths;
* ``warmup``: captures every bucket up front (largest first, so smaller ones reuse
  its memory pool), with fake one-request batches that read no cache.

With asynchronous batching (two IO pairs of static buffers, CUDA only) both pairs share
one graph per bucket: the graphs read a third set of static tensors (:class:`SharedStepIO`),
and each step copies its pair's inputs in and its output ids out (three small copies).

Under tensor parallelism (the handle holds a :class:`~breakgraph.distributed.RankGroup`)
transformers keeps the ranks in lock step: rank 0 broadcasts the requests and every rank's
scheduler builds the same steps. On top of that, every step agrees its bucket and mode
(graph or eager) across ranks before anything runs, so a rank that would replay while
another runs eagerly raises instead of hanging, and every warm-up and capture is a
capture step of the group (a failure on one rank raises on all, within the timeout).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from typing import Any

import torch

import breakgraph
from breakgraph import distributed
from breakgraph.errors import ReplayError
from transformers.generation.continuous_batching.input_outputs import (
    ContinuousBatchingAsyncIOs,
)
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.continuous_batching.utils import create_warmup_future_states

from .cb_attention import CBStep
from .prefill import UnsupportedModelError

__all__ = ["BreakgraphModelRunner", "bucket_sizes"]


#: The default query buckets grow by this factor from DEFAULT_FIRST_BUCKET: 32, 128, 512, 2048.
#: Coarse on purpose. The attention breaks run at the exact lengths, so padding costs only in
#: the dense layers, and a CB step is either decode (a few tokens per request: the GEMMs read
#: their weights whatever the row count) or a large prefill chunk (in the largest bucket).
DEFAULT_BUCKET_FACTOR, DEFAULT_FIRST_BUCKET = 4, 32


def bucket_sizes(query_buckets, max_batch_tokens: int) -> tuple[int, ...]:
    """The query-token buckets of a runner: the given sizes (default: 32, 128, 512, ..., a
    factor of 4 apart) below ``max_batch_tokens``, which is always the last bucket.

    Example::

        >>> bucket_sizes(None, 2048), bucket_sizes(None, 1000), bucket_sizes((8, 64), 256)
        ((32, 128, 512, 2048), (32, 128, 512, 1000), (8, 64, 256))
    """
    if query_buckets is None:
        query_buckets, size = [], DEFAULT_FIRST_BUCKET
        while size < max_batch_tokens:
            query_buckets.append(size)
            size *= DEFAULT_BUCKET_FACTOR
    sizes = {int(b) for b in query_buckets if 0 < int(b) < max_batch_tokens}
    return tuple(sorted(sizes)) + (max_batch_tokens,)


class SharedStepIO:
    """Asynchronous batching: the static tensors that the graphs read, shared by both IO pairs.

    transformers' asynchronous IO alternates two pairs of static buffers so the host can
    stage step N+1 while the device runs step N; a plain graph reads fixed addresses, so
    it would need one graph per pair. The captured kernels of a step read only three
    tensors of the pairs: the pair's bulk input tensor (ids, positions, logits indices,
    carry-over ids, logits-processor arguments, all in one int32 tensor), the other
    pair's output ids (tokens carried over from the step before) and the pair's output ids
    (written). The attention breaks read the live pair through :class:`CBStep`. So the
    graphs are captured over copies of those three, and every step copies in, replays and
    copies out, on the compute stream: one graph per bucket for both pairs.

    Example (what a step does; ``pair`` and ``previous`` are transformers' device IOs)::

        shared = SharedStepIO(io.io_pairs[0].device_io)
        args = shared.rebase(args, pair)        # once, for the capture
        shared.load(pair, previous); graph.replay(); shared.store(pair)
    """

    def __init__(self, device_io: Any) -> None:
        self.bulk = torch.zeros_like(device_io._bulk_input_tensor)
        self.previous_output = torch.zeros_like(device_io.output_ids)
        self.output = torch.zeros_like(device_io.output_ids)

    def rebase(self, args: tuple, device_io: Any) -> tuple:
        """``(model, batch_data, carry_over_ids, prev_output_ids, output_ids)`` of a step of
        ``device_io``, with every view of its bulk tensor moved onto the shared one."""
        model, batch_data, carry_over_ids, _, _ = args
        base = device_io._bulk_input_tensor

        def moved(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
                    return value
                offset = value.storage_offset() - base.storage_offset()
                return self.bulk.as_strided(value.shape, value.stride(), offset)
            if isinstance(value, list):
                return [moved(v) for v in value]
            if isinstance(value, dict):
                return {k: moved(v) for k, v in value.items()}
            return value

        data = {k: moved(v) for k, v in batch_data.items()}
        return model, data, moved(carry_over_ids), self.previous_output, self.output

    def load(self, device_io: Any, previous_io: Any) -> None:
        """Copy a step's inputs in (on the current stream, after its host-to-device copy)."""
        self.bulk.copy_(device_io._bulk_input_tensor)
        self.previous_output.copy_(previous_io.output_ids)

    def store(self, device_io: Any) -> None:
        """Copy the step's output ids back into its pair (read by the device-to-host copy)."""
        device_io.output_ids.copy_(self.output)


class BreakgraphModelRunner(ModelRunner):
    """A CB ``ModelRunner`` whose steps replay breakable graphs (one per query bucket).

    Built by transformers' ``ContinuousBatchProcessor`` (through the factory that
    :func:`~.continuous_batching.enable_continuous_batching` installs) with the
    same arguments as ``ModelRunner``, plus the enabling ``handle`` and
    ``use_graphs`` (False: eager steps through the same attention breaks).
    """

    def __init__(self, *, handle: Any, use_graphs: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # transformers' own graphs are off: no pools, no padding
        self.handle = handle
        self.use_graphs = use_graphs
        self.pad_inputs = use_graphs
        self.buckets = bucket_sizes(handle.query_buckets, self.cache.max_batch_tokens)
        self.async_io = isinstance(self.inputs_and_outputs, ContinuousBatchingAsyncIOs)
        self.step = CBStep(handle.kernel, self._ios()[1].cumulative_seqlens_k.keys())
        # asynchronous batching alternates two IO pairs of static buffers; the graphs read a
        # third set, shared (see SharedStepIO)
        self.shared = SharedStepIO(self._ios()[1]) if self.async_io and use_graphs else None
        self._graphs: dict[int, breakgraph.BreakableCUDAGraph] = {}
        self._pool = None
        self._closed = False
        self.thread: threading.Thread | None = None  # the generation loop that ran the last step
        self._warmer: threading.Thread | None = None  # the thread that ran warmup()
        if handle.ranks is not None:  # the same buckets and modes on every rank, or none
            settings = (use_graphs, self.buckets, self.async_io, self.do_sample, handle.kernel)
            handle.ranks.agree(
                0,
                distributed.fingerprint(repr(settings)),
                "continuous-batching settings",
                "pass the same ContinuousBatchingConfig and GenerationConfig on every rank",
            )

    def _ios(self) -> tuple[Any, Any, int]:
        """(host IO, device IO, pair) of the step being prepared or run."""
        io = self.inputs_and_outputs
        if not self.async_io:
            return io, io, 0
        pair = io.io_pairs[io.current_pair]
        return pair.host_io, pair.device_io, io.current_pair

    def _previous_device_io(self) -> Any:
        """The other pair's device IO: its output ids are the tokens carried over."""
        io = self.inputs_and_outputs
        return io.io_pairs[1 - io.current_pair].device_io

    # -- buckets ---------------------------------------------------------------------------
    def bucket_for(self, num_q_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_q_tokens)]

    def maybe_pad_inputs(
        self, num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool
    ) -> tuple[int, int]:
        if use_decode_fast_path:
            raise UnsupportedModelError(
                "enable_continuous_batching: the block-table decode path is a flash_attn kernel; "
                "it cannot run under paged|breakgraph (max_blocks_per_request must be 0)."
            )
        if not self.use_graphs:
            return num_q_tokens, max_kv_read
        return self.bucket_for(num_q_tokens), max_kv_read  # the break reads the exact KV

    # -- one step --------------------------------------------------------------------------
    def compute_batch(self, model: torch.nn.Module, batch_data: dict) -> None:
        if self._closed:
            raise ReplayError(
                "breakgraph continuous batching was disabled while a manager still used it; "
                "stop the manager before handle.disable()."
            )
        self.thread = threading.current_thread()
        io = self.inputs_and_outputs
        host_io, device_io, pair = self._ios()
        step = self.step
        step.refill(host_io, device_io, self.cache)
        bucket = host_io.num_q_tokens
        if self.handle.ranks is not None:
            self._agree(host_io, bucket, pair)
        stream = io.compute_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the step's inputs were staged there
        if not self.use_graphs:
            with breakgraph.context_scope(step):
                super().compute_batch(model, batch_data)
            self.handle.stats._record(bucket, eager_steps=1)
            return
        if self.supports_logits_to_keep(model):
            batch_data["logits_to_keep"] = batch_data["logits_indices"]
        graph = self._graphs.get(bucket)
        if graph is None:
            if self.handle.ranks is not None and threading.current_thread() is not self._warmer:
                raise ReplayError(
                    f"breakgraph continuous batching under tensor parallelism: bucket {bucket} "
                    f"was not captured before serving. Capture every bucket in the calling "
                    f"thread first: generate_batch() does, and with the manager API call "
                    f"manager.warmup() before manager.start(). A capture in transformers' "
                    f"generation thread could not fail cleanly on every rank."
                )
            self._capture(bucket, (model, batch_data, *io.get_cb_kwargs()), device_io)
        elif stream is None:
            graph.replay(context=step)
            self.handle.stats._record(bucket, replays=1)
        else:
            shared = self.shared
            with torch.cuda.stream(stream):
                if shared is not None:
                    shared.load(device_io, self._previous_device_io())
                graph.replay(context=step)
                if shared is not None:
                    shared.store(device_io)
            self.handle.stats._record(bucket, replays=1)

    def _agree(self, host_io: Any, bucket: int, pair: int) -> None:
        """Check that every rank runs this step the same way (one host all-reduce).

        The fingerprint packs bucket, IO pair and mode into one int (no hashing per
        step); in debug mode it also covers each request's id, query length and position.
        """
        digest = (bucket << 2) | (pair << 1) | int(self.use_graphs)
        if self.handle.debug:
            digest = distributed.fingerprint(
                digest,
                [
                    (f.state.request_id, f.query_length, f.state.position_offset)
                    for f in host_io.requests_in_batch
                ],
            )
        self.handle.ranks.agree(
            bucket,
            digest,
            "continuous-batching steps",
            "run the same transformers version and options on every rank; transformers "
            "schedules the requests of TP rank 0 on all ranks",
        )

    def _capture(self, bucket: int, args: tuple, device_io: Any) -> None:
        """Warm up eagerly (no cache access), then capture; the capture pass computes the step.

        Under tensor parallelism both happen in one capture step of the rank group."""
        start = time.perf_counter()
        graph = breakgraph.BreakableCUDAGraph()
        ranks = self.handle.ranks
        if self.shared is not None:
            args = self.shared.rebase(args, device_io)
        if ranks is None:
            self._warm_up_and_capture(graph, args, device_io)
        else:
            ranks.capture_step(
                f"capture of continuous-batching bucket {bucket}",
                lambda: self._warm_up_and_capture(graph, args, device_io),
                lambda _: distributed.fingerprint(repr(graph)),
                keep=(self._graphs, graph),
            )
        self._pool = graph.pool()
        self._graphs[bucket] = graph
        self.handle.stats._record(
            bucket, captures=1, capture_s=time.perf_counter() - start, breaks=graph.num_breaks
        )

    def _warm_up_and_capture(
        self, graph: breakgraph.BreakableCUDAGraph, args: tuple, device_io: Any
    ) -> None:
        io, step, shared = self.inputs_and_outputs, self.step, self.shared
        stream = io.compute_stream
        step.warmup = True
        try:
            with (
                torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
                breakgraph.context_scope(step),
            ):
                if shared is not None:
                    shared.load(device_io, self._previous_device_io())
                self._forward_process_and_sample(*args)
        finally:
            step.warmup = False
        with breakgraph.capture(
            graph,
            pool=self._pool,
            stream=stream,
            capture_error_mode="thread_local",
            backend=self.handle.backend,
            context=step,
            debug=self.handle.debug,
        ):
            self._forward_process_and_sample(*args)
        if shared is not None:
            with torch.cuda.stream(stream):
                shared.store(device_io)  # the capture pass computed this step
        if stream is not None:
            stream.synchronize()  # count the capture pass in the capture time

    # -- warm-up: capture every bucket before serving ---------------------------------------
    @torch.no_grad()
    def warmup(self, model: torch.nn.Module) -> None:
        if not self.use_graphs:
            return
        self._warmer = threading.current_thread()
        for bucket in sorted(self.buckets, reverse=True):  # largest first: the rest reuse its pool
            if bucket not in self._graphs:
                self._warm_bucket(model, bucket)

    def _warm_bucket(self, model: torch.nn.Module, bucket: int) -> None:
        """Capture ``bucket`` with a fake one-request prefill that reads no cache.

        Like transformers' ``run_one_warmup`` but errors propagate (it only logs them).
        """
        states = create_warmup_future_states(1, RequestStatus.PREFILLING, bucket, 0, self.cache)
        if not states:
            raise UnsupportedModelError(
                f"enable_continuous_batching: the KV cache ({self.cache.num_blocks} blocks of "
                f"{self.cache.block_size}) cannot hold one {bucket}-token request to capture "
                f"bucket {bucket}; give ContinuousBatchingConfig more num_blocks or fewer "
                f"max_batch_tokens."
            )
        io = self.inputs_and_outputs
        try:
            io.prepare_batch_tensors(
                states, self.logit_processor, False, bucket, 0, use_padding=True
            )
            self.compute_batch(model, io.get_model_kwargs(use_padding=True))
            if io.compute_stream is not None:
                io.compute_stream.synchronize()
        finally:
            for state in states:
                self.cache.free_blocks(state.state.request_id)

    # -- lifetime --------------------------------------------------------------------------
    @property
    def graphs(self) -> dict[int, breakgraph.BreakableCUDAGraph]:
        """Captured graphs by query bucket (one for both IO pairs with asynchronous batching)."""
        return dict(self._graphs)

    @property
    def in_use(self) -> bool:
        """True while the generation loop that ran its last step is alive (another thread)."""
        thread = self.thread
        return thread is not None and thread.is_alive() and thread is not threading.current_thread()

    def close(self) -> None:
        """Release the graphs; later steps raise. (After a failed multi-rank NCCL capture the
        graphs are kept until the process exits, see ``RankGroup.capture_step``.)"""
        self._closed = True
        distributed.release_graphs(self._graphs.values(), self.handle.ranks)
        self._graphs.clear()
        self._pool = None
