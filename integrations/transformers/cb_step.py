"""Continuous batching: one model's CB steps as breakable graphs (the step runner).

transformers' continuous batching keeps everything it owns (scheduler, paged KV cache,
request lifecycle, logits processing and sampling) and calls ``model(**kwargs)`` once per
step with the step's packed query tokens and paged-attention metadata. While
:func:`~.continuous_batching.enable_continuous_batching` is on, that call reaches
:meth:`StepRunner.forward`, which runs the step through two graph ladders
(:class:`breakgraph.ladder.GraphLadder`) of its own:

* **tokens** (keyed by the query-token bucket ``B``): the decoder over static ``[1, B]`` ids
  and positions. Everything is captured except each layer's paged-cache write + read +
  varlen causal attention, an eager break (:class:`PagedAttention`) that reads the live
  step's exact lengths and indices (:class:`CBStep`, the replay context). The graph ends by
  copying the last hidden states into one shared buffer;
* **logits** (keyed by the logits-row bucket ``L``): ``lm_head`` over the rows of that buffer
  picked by a static index (the step's ``logits_to_keep``), so a step computes logits for
  about as many rows as it has requests, not one per token. Under tensor parallelism the
  ``lm_head`` all-gather stays inside a graph too.

The step's inputs are copied into the buckets' static buffers (:mod:`.step_inputs`: one or
two small copies, a third where the step shrank) and the
logits come back as a fresh fp32 tensor (what transformers' ``.float()`` would make), so the
next step can reuse graph memory at once. Every bucket is captured before serving (when a
manager is created), with a fake one-sequence step that touches no cache. A pure-decode step
(one query per sequence) goes to :class:`~.decode_graph.DecodeGraphs` first: a third kind of
graph, with the cache write and read captured and no break, captured while serving.

Example (what the handle does for every CB forward)::

    runner = StepRunner(model, backend="cuda", kernel="flash", debug=False, ranks=None,
                        query_buckets=None)
    runner.plan(max_batch_tokens=2048)     # capture every bucket
    logits = runner.forward(**cb_kwargs).logits
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import torch

import breakgraph
from breakgraph import distributed
from breakgraph.buckets import Action
from breakgraph.errors import InputError
from breakgraph.ladder import GraphLadder
from breakgraph.ladder_stats import combined
from breakgraph.memory import weak_method

from . import compat
from .attention import (
    FLASH_WRITES_IN_PLACE,
    NOT_PASSED,
    check_sinks,
    flash_varlen,
    layer_window,
    reference_attention,
    refuse_mask_and_softcap,
)
from .block_table import read_slots, write_slots
from .compiled import CompiledForward
from .decode_graph import DecodeGraphs, cache_rows
from .logits_head import logits_after_head
from .models import (
    UnsupportedModelError,
    attention_heads,
    default_query_buckets,
    key_changed,
    layer_attention,
    query_heads,
)
from .paged_decode import break_splits, fits, paged_decode, query_rows, triton_available, warm_up
from .step_inputs import StepInputs, StepOrder, logits_rows
from .tensor_parallel import graph_safe_tensor_parallel

logger = logging.getLogger("breakgraph")

__all__ = ["CB_ATTENTION_KEY", "CBStep", "PagedAttention", "StepRunner", "paged_attention"]

#: The attention key a model holds while continuous batching is enabled (a plain key: from
#: transformers 5.19 the ``paged|`` prefix is stripped, and any key but its own is refused).
CB_ATTENTION_KEY = "breakgraph_paged"

_FULL, _SLIDING = "full_attention", "sliding_attention"
_STEPS = (  # what the ranks must agree on for each step, and how to fix a mismatch
    "continuous-batching steps",
    "run the same transformers version and options on every rank; transformers schedules the "
    "requests of TP rank 0 on all ranks",
)

#: eager-step reasons by the steps use_cuda_graph turns graphs off for (models.eager_steps)
_GRAPHS_OFF = {"all": "graphs off (use_cuda_graph=False)",
               "mixed": "graphs off for mixed steps (use_cuda_graph=(False, True))",
               "decode": "graphs off for pure-decode steps (use_cuda_graph=(True, False))"}
_KEEPS_GRAPHS = ("decode", "mixed")  # [step.pure_decode]: the kind that keeps that step's graphs


class CBStep:
    """Host description of the step being run: everything an attention break reads.

    One object per runner, refilled before every step from the CB forward's keyword
    arguments (no allocation per layer). ``warmup`` marks the eager warm-up and capture
    passes, which run on a fake step of one sequence filling the bucket and touch no cache.
    """

    __slots__ = ("kernel", "update_takes_kwargs", "tokens", "cache", "cu_q", "max_q", "cu_k",
                 "max_k", "read_index", "write_index", "table", "positions", "warmup",
                 "pure_decode", "decode", "_q_bounds", "_no_reads")  # fmt: skip

    def __init__(self, kernel: str, update_takes_kwargs: bool) -> None:
        self.kernel, self.update_takes_kwargs = kernel, update_takes_kwargs
        self.tokens, self.warmup, self.pure_decode = 0, False, False
        self.cache = self.cu_q = self.max_q = self.cu_k = self.max_k = self.read_index = None
        self.write_index = self.table = self.positions = None  # table, positions: block tables
        self.decode = None  # the DecodeGraphs capturing this step's bucket, if any
        self._q_bounds = self._no_reads = None

    def refill(self, kwargs: dict, names: compat.StepKwargs, tokens: int) -> None:
        """The live step (views of transformers' static buffers; no device sync)."""
        self.tokens, self.warmup = tokens, False
        self.cache = kwargs[names.cache]
        self.cu_q, self.max_q = kwargs[names.cu_q], kwargs[names.max_q]
        self.cu_k, self.max_k = kwargs[names.cu_k], kwargs[names.max_k]
        self.read_index, self.write_index = kwargs[names.read_index], kwargs[names.write_index]
        # transformers' decode fast path: a block table instead of index lists (.block_table)
        self.table = kwargs.get(names.block_table)
        self.positions = kwargs[names.position_ids] if self.table is not None else None
        # one query per sequence (once per step, for every layer; max_q = 1 with a block table)
        self.pure_decode = self.max_q == 1 and tokens == self.cu_q.shape[0] - 1
        self._q_bounds = self._no_reads = None

    def release(self) -> None:
        """Drop the step's references once it ran: the runner outlives the manager, and the
        cache and index views must not keep a finished manager's memory alive."""
        self.cache = self.cu_q = self.cu_k = self.read_index = self.write_index = None
        self.table = self.positions = None
        self._q_bounds = self._no_reads = None

    def materialise(self) -> None:
        """A block-table step's exact read and write indices, one tensor per layer group, in
        place of transformers' empty ones, and its exact longest key length (transformers
        passes 1): what the break path reads. One device sync (the key offsets); a decode
        graph derives its indices without it (:meth:`.decode_graph.DecodeBuffers.fill`)."""
        if self.table is None:
            return
        page = compat.block_table_page(self.cache)
        if page is None:
            raise UnsupportedModelError(
                "enable_continuous_batching: this transformers release's block-table layout is "
                "unknown (contract item 15); pass ContinuousBatchingConfig("
                "max_blocks_per_request=0) to serve decode steps through index lists."
            )
        n = self.tokens
        cu_k = self.cu_k[_FULL] if isinstance(self.cu_k, dict) else self.cu_k
        offsets = cu_k[: n + 1].tolist()
        positions = self.positions[0, :n]
        self.write_index = [write_slots(t[:n], positions, page) for t in self.table]
        self.read_index = [read_slots(t[:n], cu_k, page, offsets[-1]) for t in self.table]
        longest = max(b - a for a, b in zip(offsets, offsets[1:]))
        self.max_k = {k: longest for k in self.max_k} if isinstance(self.max_k, dict) else longest
        self.table = self.positions = None  # materialised: the lists path from here on
        self._no_reads = None

    def fake(self, bucket: int) -> CBStep:
        """The warm-up / capture step of ``bucket``: one sequence filling it, no cache."""
        self.tokens, self.warmup, self.cache, self._q_bounds = bucket, True, None, None
        self.decode, self.pure_decode = None, False
        return self

    def no_reads(self) -> list:
        """Empty read indices, one per layer group (transformers' ``update`` then only writes)."""
        if self._no_reads is None:
            self._no_reads = [index[:0] for index in self.read_index]
        return self._no_reads

    def q_bounds(self) -> list:
        """Host ``(start, end)`` query rows per sequence (reference kernel only: reads ``cu_q``)."""
        if self._q_bounds is None:
            self._q_bounds = _bounds(self.cu_q)
        return self._q_bounds


def _bounds(cu: torch.Tensor) -> list:
    return list(zip(cumulative := cu.tolist(), cumulative[1:]))


class PagedAttention:
    """One layer's paged-cache write + read + varlen causal attention: the eager break.

    Built during the capture from the layer's ``query`` ``[1, Hq, B, D]`` and new
    ``key``/``value`` ``[1, Hkv, B, D]`` (RoPE applied); calling it returns ``[B, Hq, D]``
    for the step in ``replay_context()``: rows of the step's ``n`` real tokens attend to
    their sequences' cached keys (the cache gets the new ones), rows past them are zero (where
    a kernel writes in place, FlashAttention on torch >= 2.12 and the paged decode kernel on
    any: finite values of earlier steps, never read for a real token). A pure-decode step (one
    query per sequence) on a full-attention layer reads the cache rows in place where Triton
    runs, :func:`.paged_decode.fits` its heads and :func:`.compat.layer_kv_rows` finds them
    (:meth:`_paged`; not when nothing is cached yet: a step of one-token prompts has an empty
    read index), else calls FlashAttention without the causal mask (:meth:`_decode`).
    """

    def __init__(self, layer, query, key, value, scaling: float, window, kernel: str, sinks=None):
        self.__qualname__ = self.__name__ = f"paged attention[layer {layer}]"
        self.layer, self.sinks = layer, sinks  # sinks: [Hq] logits (gpt-oss), or None
        self.q = query_rows(query)
        self.key, self.value = key, value
        self.scaling, self.window, self.kernel = scaling, window, kernel
        self.layer_type = _SLIDING if window is not None else _FULL
        # the kernels write here (FlashAttention in place on torch >= 2.12, else copied; the paged
        # decode kernel always); the break returns this, the graph's tensor: no per-replay copy
        self.out = None
        if kernel == "flash":
            with torch.inference_mode(False):
                self.out = torch.zeros(self.q.shape, dtype=self.q.dtype, device=self.q.device)
        # pure-decode steps of a full-attention layer read the cache in place (no gather)
        self.paged = (
            kernel == "flash" and window is None and triton_available(self.q.device)
            and fits(self.q.shape[1], key.shape[1], self.q.shape[2])
        )  # fmt: skip

    def __call__(self) -> torch.Tensor:
        step: CBStep = breakgraph.replay_context()
        if step.warmup:
            return self._own_keys()
        if step.table is not None:  # a block-table step outside a decode graph
            step.materialise()
        n = step.tokens
        decode = step.pure_decode and self.window is None
        if decode and self.paged and (rows := cache_rows(step.cache, self.layer)) is not None:
            if step.read_index[rows[0]].shape[0]:  # empty: one-token prompts, nothing cached
                return self._paged(step, rows, n)
        k, v, cu_k, max_k = compat.cache_read_write(
            step, self.key[:, :, :n], self.value[:, :, :n], self.layer, self.layer_type
        )
        if self.kernel == "reference":
            return reference_attention(self.q, k, v, step.q_bounds(), self.scaling, self.window,
                                       _bounds(cu_k), self.out, self.sinks)  # fmt: skip
        if decode:
            return self._decode(k, v, step.cu_q, cu_k, max_k, n)
        out = flash_varlen(
            self.q, k.contiguous(), v.contiguous(), step.cu_q, cu_k, step.max_q, max_k,
            self.scaling, self.window, self.out, sinks=self.sinks, rows=n,
        )  # fmt: skip
        if not FLASH_WRITES_IN_PLACE:
            out[n:].zero_()  # copied from the kernel's result: rows it skipped, uninitialised
        return out

    def _decode(self, k, v, cu_q, cu_k, max_k, n: int) -> torch.Tensor:
        """A pure-decode step on a full-attention layer: ``n`` sequences, one query each.

        With one query per sequence (its last position) attention without the causal mask
        is the same, and the kernel then folds the query heads of each key head into one
        tile (see :func:`flash_varlen`). That folded path reads query row ``i`` as sequence
        ``i``'s and takes exactly ``n`` rows, so it gets the real rows only (the caller
        checked ``n`` sequences of one token each), and its result is copied into place.
        """
        result = flash_varlen(
            self.q[:n], k.contiguous(), v.contiguous(), cu_q, cu_k, 1, max_k,
            self.scaling, None, causal=False, sinks=self.sinks,
        )  # fmt: skip
        self.out[:n].copy_(result)
        return self.out

    def _paged(self, step: CBStep, rows: tuple, n: int) -> torch.Tensor:
        """A pure-decode step read in place: transformers writes the new keys and values
        (``update`` with empty read indices), then :func:`.paged_decode.paged_decode` reads
        each sequence's rows through the step's read index; no gather, and the query heads
        of a key head share one program.

        Launched from a break, a kernel costs the host about as much as the device spends on
        a short sequence, so the keys are split across programs (a second launch) only once
        the longest sequence is long enough (:func:`.paged_decode.break_splits`); a decode
        graph, which launches nothing, always takes :func:`.paged_decode.default_splits`."""
        group, keys, values = rows
        _, _, cu_k, max_k = compat.cache_read_write(
            step, self.key[:, :, :n], self.value[:, :, :n], self.layer, self.layer_type,
            read=False,
        )  # fmt: skip
        read_index = step.read_index[group]
        splits = break_splits(n, max_k, keys)
        paged_decode(self.q[:n], keys, values, read_index, cu_k, self.scaling,
                     self.out[:n], splits=splits, sinks=self.sinks)  # fmt: skip
        return self.out

    def _own_keys(self) -> torch.Tensor:
        """Warm-up and capture: causal attention over the bucket's own keys, as one sequence."""
        rows = self.q.shape[0]
        k, v = self.key[0].transpose(0, 1), self.value[0].transpose(0, 1)
        return reference_attention(self.q, k, v, [(0, rows)], self.scaling, self.window,
                                   out=self.out, sinks=self.sinks)  # fmt: skip


@torch.compiler.disable
def paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = NOT_PASSED,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
):
    """The function registered as ``AttentionInterface[CB_ATTENTION_KEY]``; ``s_aux``: sinks."""
    try:
        step = breakgraph.replay_context()
    except breakgraph.ReplayError:
        step = None
    if not isinstance(step, CBStep):
        raise InputError(
            "breakgraph's continuous-batching attention was called outside a CB step: the model "
            "is in breakgraph continuous-batching mode, which serves generate_batch() and the CB "
            "manager only. Call handle.disable() (or leave the `with` block) before "
            "model.generate() or a plain forward."
        )
    refuse_mask_and_softcap("breakgraph CB attention", attention_mask, softcap,
                            "continuous batching with this key reads the step's exact lengths")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    capturing = step.decode is not None or breakgraph.is_capturing()
    sliding_window = layer_window(module, sliding_window, check=capturing)
    layer = module.layer_idx
    if capturing and s_aux is not None:
        check_sinks("breakgraph CB attention", layer, s_aux, query)
    if step.decode is not None:  # a pure-decode graph is being captured: no break
        out = step.decode.attention(layer, query, key, value, scale, sliding_window, s_aux)
        return out.unsqueeze(0), None
    call = PagedAttention(layer, query, key, value, scale, sliding_window, step.kernel, s_aux)
    if capturing:  # a break; an eager step calls it (a decoration costs 7 us)
        return breakgraph.eager_on_graph(call)().unsqueeze(0), None
    return call().unsqueeze(0), None


class StepRunner:
    """One model's continuous-batching steps: two graph ladders and their static buffers.

    Shared by every CB manager of the model (one step at a time: a lock, and on CUDA a
    :class:`StepOrder` for steps issued on different streams). ``plan`` captures the buckets
    for a manager's ``max_batch_tokens``; ``forward`` serves one step.
    """

    def __init__(self, model, *, backend: str, kernel: str, debug: bool, ranks, query_buckets,
                 who: str, decode_graphs: bool = True, compile: Any = False) -> None:  # fmt: skip
        self.model, self.who, self.query_buckets = model, who, query_buckets
        self.decoder = model.get_decoder()
        self.compiled = compile is not False  # True or a dict (an empty one: the defaults)
        self.lm_head = model.get_output_embeddings()
        # what the causal LM does after lm_head, checked against its forward when enabled
        self.after_head = logits_after_head(model.config)
        self.names = compat.step_kwargs()
        from transformers.modeling_outputs import CausalLMOutputWithPast

        self._output = CausalLMOutputWithPast  # what the CausalLM's forward returns
        self.step = CBStep(kernel, compat.update_takes_kwargs())
        parameter = next(model.parameters())
        self.device = parameter.device
        options = dict(backend=backend, ranks=ranks, debug=debug, on_miss="eager", who=who)
        self.tokens = GraphLadder(**options)
        self.logits = GraphLadder(**options)
        self.ranks = ranks
        self.debug = debug
        # the graphs' static ids, positions, row indices and hidden states between the ladders
        self.inputs = StepInputs(self.device)
        self._lock = threading.Lock()
        self._order = StepOrder() if self.tokens.backend == "cuda" else None
        self._eager_steps: dict = weakref.WeakKeyDictionary()  # manager -> models.eager_steps
        self._eager_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # pure-decode steps as graphs without breaks (not under TP; on CUDA bf16/fp16)
        self.decode: DecodeGraphs | None = None
        wanted = decode_graphs and ranks is None and (q_heads := query_heads(model.config))
        if wanted and (self.tokens.backend != "cuda" or kernel == "flash"):
            self.decode = DecodeGraphs(weak_method(self._record_tokens), q_heads,
                                       backend=self.tokens.backend, debug=debug,
                                       who=who)  # fmt: skip
        # transformers' decode fast path (.block_table) where the decode graphs serve its steps
        # (all layers full, heads the kernel takes; else each step syncs to materialise rows)
        self.block_tables = False
        # the heads whose decode kernels plan() compiles: the decode graphs' (the manager's page;
        # page 0 beside sliding layers: index lists), else the full-attention breaks' (page 0);
        # not under tensor parallelism (a rank holds a share of the heads). Sinks: their variant
        self.heads: tuple[tuple[int, int, int], ...] | None = None  # (query, key heads, size)
        self._break_kernels = False  # the heads' kernels launch with a flat index (page 0)
        self._sinks = compat.has_attention_sinks(model)  # gpt-oss: the kernels' sinks variant
        heads, kinds = attention_heads(model.config), layer_attention(model.config)
        if heads is not None and self.decode is not None and kinds == "full":
            self.heads = heads
            self.block_tables = self.decode.kernel_problem(*heads[0][1:], self.device) is None
        elif heads is not None and (self.decode is not None or (
                kernel == "flash" and ranks is None and kinds != "sliding")):  # fmt: skip
            self.heads, self._break_kernels = heads, True
        #: the split counts whose decode kernels :meth:`plan` compiled (every page so far), and
        #: the seconds it took
        self.kernels_warmed: list[int] = []
        self.kernel_warm_up_s = 0.0
        self._warmed_pages: set[int] = set()
        #: steps that came with a block table: {"graph": served by a decode graph, "break":
        #: materialised (one device sync) for the query-token graph's breaks}
        self.block_table_steps = {"graph": 0, "break": 0}
        # the decoder under torch.compile (attention a Dynamo graph break); opened last
        self._forward = CompiledForward(self.decoder, compile, backend) if self.compiled else (
            self.decoder)  # fmt: skip

    @property
    def stats(self):
        """:class:`~breakgraph.ladder.LadderStats` of the query-token ladder and the pure-decode
        graphs together (``decode.stats`` alone: the decode graphs, captured while serving);
        a bucket's ``breaks`` are its query-token graph's."""
        if self.decode is None:  # a copy: the ladder's own grows while another thread reads
            return combined(self.tokens.stats)
        return combined(self.tokens.stats, self.decode.stats)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.tokens.buckets

    # -- planning: capture before serving ------------------------------------------------------
    def plan(self, max_batch_tokens: int, page: int = 0) -> None:
        """Capture every bucket up to ``max_batch_tokens`` (once, all or none; later managers
        must fit), and compile the decode kernels the pure-decode graphs of those buckets will
        launch (``page``: the block table's tokens per entry, 0 with index lists; see
        :func:`.paged_decode.warm_up`; another page compiles its own): none while serving."""
        with self._lock:
            sizes = default_query_buckets(self.query_buckets, max_batch_tokens, self.who)
            if self.tokens.buckets:
                if max_batch_tokens > self.tokens.buckets[-1]:
                    raise InputError(
                        f"{self.who}: this model's steps were captured for at most "
                        f"{self.tokens.buckets[-1]} query tokens; a manager with "
                        f"max_batch_tokens={max_batch_tokens} does not fit. Pass "
                        f"ContinuousBatchingConfig(max_batch_tokens<={self.tokens.buckets[-1]}), "
                        f"or disable and enable again before the first manager."
                    )
                self._warm_kernels(self.tokens.buckets, page)
                return
            weight = self.lm_head.weight
            self.inputs.allocate(sizes, weight.shape[-1], weight.dtype)
            # the ladders capture thread-local: other managers may be stepping other models on
            # other threads meanwhile
            try:
                with torch.no_grad(), self.tokens.capture_window(), self.logits.capture_window():
                    self.tokens.capture(sizes, self._record_tokens, warm_up=self._record_tokens,
                                        warm_up_each=self.compiled, context=self.step.fake)
                    self.logits.capture(sizes, self._record_logits, warm_up=self._record_logits)
            except BaseException:  # nothing half-captured: the next manager captures afresh
                self.tokens.discard(), self.logits.discard(), self.inputs.clear(self.ranks)
                raise
            self._warm_kernels(sizes, page)

    def _warm_kernels(self, sizes, page: int) -> None:
        """:func:`.paged_decode.warm_up` for ``page``, once per page. A failure is logged and
        left to the steps: the first one that needs the kernel compiles it (or its decode graph
        falls back to the breaks), as without the warm-up."""
        page = 0 if self._break_kernels else page  # the breaks read a flat index
        if self.heads is None or page in self._warmed_pages:
            return
        self._warmed_pages.add(page)
        start = time.perf_counter()
        try:
            dtype = next(self.decoder.parameters()).dtype  # the activations' and the cache's
            warmed = [split for heads in self.heads for split in warm_up(
                *heads, sizes, dtype, self.device, page, sinks=self._sinks)]  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a compile problem must not stop serving
            logger.warning("%s: compiling the decode kernels before serving failed (%s: %s); "
                           "the first steps that need them compile them", self.who,
                           type(exc).__name__, exc)  # fmt: skip
            return
        self.kernels_warmed = sorted(set(self.kernels_warmed) | set(warmed))
        self.kernel_warm_up_s += time.perf_counter() - start

    def _decoder(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if compat.attention_key(self.model) != CB_ATTENTION_KEY:  # captures, eager steps
            raise key_changed(self.model, CB_ATTENTION_KEY, self.who)
        with graph_safe_tensor_parallel(self.model):
            out = self._forward(input_ids=ids, position_ids=positions, use_cache=False)
        return out.last_hidden_state

    def _record_tokens(self, bucket: int) -> None:
        inputs = self.inputs.tokens[bucket]
        hidden = self._decoder(inputs[0:1], inputs[1:2])
        self.inputs.hidden[:, :bucket].copy_(hidden)

    def _record_logits(self, rows: int) -> torch.Tensor:
        return self._head(self.inputs.hidden.index_select(1, self.inputs.rows[rows]))

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        for op, value in self.after_head:
            logits = op(logits, value)
        return logits

    # -- serving -------------------------------------------------------------------------------
    def graphs_off(self, manager, steps: str = "all") -> None:
        """``manager`` runs eager steps: ``steps`` says which (:func:`.models.eager_steps`)."""
        with self._lock:  # the steps of other managers loop over the mapping under it
            self._eager_steps[manager] = steps

    def serves_eagerly(self, manager=None, cache=None) -> bool:
        """Whether every step of ``manager`` (or of the manager of ``cache``) runs eagerly."""
        with self._lock:  # graphs_off may add a manager meanwhile (the listing would fail)
            kind = self._eager_kind(cache) if manager is None else self._eager_steps.get(manager)
        return kind == "all"

    def forward(self, **kwargs: Any) -> Any:
        """One CB step: logits ``[1, rows, vocab]`` (fp32) for ``logits_to_keep``."""
        names = self.names
        ids, positions = kwargs[names.input_ids], kwargs[names.position_ids]
        n = ids.shape[-1]
        keep = kwargs.get(names.logits_to_keep)
        rows = logits_rows(keep, n, self.who)  # refuses a step with no query token
        with self._lock, torch.no_grad():
            if self._order is not None:  # after a step another manager issued on another stream
                self._order.follow()
            step = self.step
            step.refill(kwargs, names, n)
            decision = None  # set once the ranks agreed to run the step (tensor parallelism)
            try:
                eager = self._eager_kind(step.cache)  # graphs off for its manager's steps?
                if eager is not None and eager != _KEEPS_GRAPHS[step.pure_decode]:
                    self.tokens.record_eager(_GRAPHS_OFF[eager])
                    logits = self._eager(ids, positions, keep, n)
                else:
                    decision = self.tokens.decide(n, self._fingerprint(n, rows, ids), *_STEPS)
                    if decision.action is Action.REPLAY:
                        logits = self._replay(decision.bucket, ids, positions, keep, n, rows)
                    else:
                        self.tokens.record_eager(decision.reason)
                        logits = self._eager(ids, positions, keep, n)
            except BaseException as exc:  # after the agreement, the others may wait for this one
                if decision is not None and self.ranks is not None:
                    self.ranks.failed_mid_call(exc, self.who)
                raise
            finally:
                step.release()
            # fresh fp32 memory (what transformers' .float() makes): the next step, maybe of
            # another manager on another thread, reuses the graph's output at once
            logits = logits.to(torch.float32, copy=True)
        return self._output(logits=logits)

    def _replay(self, bucket: int, ids, positions, keep, n: int, rows: int) -> torch.Tensor:
        self.inputs.stage(bucket, ids, positions, n)
        step = self.step
        decode = self.decode is not None and step.pure_decode
        if decode and self.decode.replay(step, bucket, n, self.tokens.buckets[-1]):
            if step.table is not None:
                self.block_table_steps["graph"] += 1
        else:
            if step.table is not None:
                self.block_table_steps["break"] += 1
            self.tokens.replay(bucket, step, size=n)
        rows_bucket = self.logits.choose(rows).bucket
        self.inputs.stage_rows(rows_bucket, keep, rows, n)
        return self.logits.replay(rows_bucket, None, size=rows)[:, :rows]

    def _eager(self, ids, positions, keep, n: int) -> torch.Tensor:
        with breakgraph.context_scope(self.step):
            hidden = self._decoder(ids, positions)
        if isinstance(keep, torch.Tensor):
            hidden = hidden[:, keep.to(torch.long)]  # as the model: -1 is the last token
        return self._head(hidden)

    def _eager_kind(self, cache) -> str | None:
        """Which steps of the manager of ``cache`` run eagerly (None: none)."""
        if not self._eager_steps:
            return None
        kind = self._eager_caches.get(cache)
        if kind is None:
            for manager, steps in list(self._eager_steps.items()):
                if compat.manager_cache(manager) is cache:
                    kind = self._eager_caches[cache] = steps
                    break
        return kind

    def _fingerprint(self, n: int, rows: int, ids: torch.Tensor) -> int:
        """What every rank must agree on for this step (tensor parallelism only): its sizes;
        in debug mode also its tokens and sequence boundaries (host copies)."""
        if self.ranks is None:
            return 0
        digest = (n << 32) | rows
        if self.debug:
            digest = distributed.fingerprint(digest, ids, self.step.cu_q)
        return digest

    def close(self) -> None:
        """Release the graphs and buffers (final)."""
        with self._lock:
            self.tokens.close()
            self.logits.close()
            if self.decode is not None:
                self.decode.close()
            if self.compiled:  # torch.compile's mark off the decoder
                self._forward.close()
            self.inputs.clear(self.ranks)  # kept with the graphs after a failed NCCL step


