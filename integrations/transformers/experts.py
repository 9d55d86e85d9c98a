"""MoE experts through transformers' own registry: the eager loop as a break, padding skipped.

transformers dispatches every experts module decorated with ``@use_experts_implementation``
through ``ExpertsInterface`` by ``config._experts_implementation``. Its ``"eager"``
implementation (the model file's own ``forward``) loops in Python over the experts that
received tokens (``nonzero`` on the routing): data-dependent, not capturable. breakgraph
registers one more implementation, :data:`EXPERTS_KEY`, that runs that very loop as an
``@eager_on_graph`` break, and the runners switch a model to it around their forward with
transformers' ``set_experts_implementation`` (and back), exactly as attention is switched
through ``AttentionInterface``. ``grouped_mm`` and ``batched_mm`` need no break: they are
captured as they are.

A prefill's bucket ends in a padding tail, and the experts would work on it like on real
tokens. The eager loop runs on the prompts' rows only (``live_tokens`` in the replay
context). For ``grouped_mm`` the prefill runner registers :data:`GROUPED_KEY`
(:func:`grouped_skipping_padding`): inside the graph, the tail's rows get expert id
``num_experts``, which transformers uses for rows another rank owns (the sort puts them last,
the histogram drops them, the grouped GEMMs stop at the last expert's offset), and their
output rows are zeroed. Which rows are padding is a device mask made once per forward from
the step's last-token indices (:class:`PaddingRows`), so one graph serves every prompt length
of its bucket. The mask costs two small kernels per layer, so it is used only where the
padding's expert work is larger (:func:`worth_skipping`).

Example::

    from breakgraph.integrations.transformers.experts import experts_for_prefill
    with experts_for_prefill(model, skip_padding=True):  # the eager loop: breaks;
        ...                                              # grouped_mm: padding skipped
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

import breakgraph

from . import compat
from .models import UnsupportedModelError

__all__ = [
    "EXPERTS_KEY", "GROUPED_KEY", "experts_as_breaks", "experts_for_prefill",
    "PaddingRows", "grouped_mm_captures", "grouped_skipping_padding", "needs_experts_break",
    "padding_rows", "worth_skipping",
]  # fmt: skip

EXPERTS_KEY = "breakgraph_eager_loop"
GROUPED_KEY = "breakgraph_grouped_mm"

_grouped: Any = None  # transformers' grouped_mm experts function (found by register())
# the padding rows of the forward being run or captured (None: no padding mask)
_padding: contextvars.ContextVar[PaddingRows | None] = contextvars.ContextVar(
    "breakgraph_padding_rows", default=None
)


@breakgraph.eager_on_graph
def experts_loop(module: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The model's own eager experts loop (what ``"eager"`` runs), as one eager break.

    On the live rows only, when the replay context says how many there are
    (``live_tokens``, a prefill's :class:`~.attention.PackedBatch`): a bucket's padding tail
    would otherwise be routed to experts like real tokens, and the loop's work grows with the
    rows it gets. The tail's rows come back as zeros (nothing reads them: the tail is a
    sequence of its own, after the prompts)."""
    forward = _eager_forward(module)
    try:
        live = getattr(breakgraph.replay_context(), "live_tokens", None)
    except breakgraph.ReplayError:  # no context (a caller of its own): every row is live
        live = None
    if live is None or kwargs or len(args) != 3:
        return forward(module, *args, **kwargs)
    hidden, index, weights = args  # (tokens, hidden), (tokens, top_k), (tokens, top_k)
    rows = hidden.shape[0]
    if not 0 < live < rows or index.shape[0] != rows or weights.shape[0] != rows:
        return forward(module, *args)
    out = forward(module, hidden[:live], index[:live], weights[:live])
    return torch.cat((out, out.new_zeros((rows - live, *out.shape[1:]))))


def _eager_forward(module: Any):
    """The experts class's original ``forward`` (``use_experts_implementation`` wraps it)."""
    original = compat.eager_experts_forward(module)
    if original is None:
        raise UnsupportedModelError(
            f"breakgraph: {type(module).__name__}.forward does not expose transformers' eager "
            f"experts loop (no __wrapped__); this transformers version dispatches experts "
            f"differently. Load the model with experts_implementation='grouped_mm'."
        )
    return original


@torch.compiler.disable  # Dynamo breaks its graph here too (PrefillRunner(compile=True))
def breakgraph_experts(module: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The function registered as ``ExpertsInterface[EXPERTS_KEY]``."""
    return experts_loop(module, *args, **kwargs)


def register() -> None:
    """Register :data:`EXPERTS_KEY` and :data:`GROUPED_KEY` in transformers'
    ``ExpertsInterface`` (idempotent)."""
    registry = compat.experts_registry()
    registry.register(EXPERTS_KEY, breakgraph_experts)
    if _grouped is None:
        globals()["_grouped"] = compat.grouped_experts()
    registry.register(GROUPED_KEY, grouped_skipping_padding)


#: What routing a bucket's padding rows to no expert costs per layer: two small kernels (the
#: ids' ``masked_fill`` and the output's), about 5 us on an H200, where its bf16 GEMMs do about
#: 2.5 GFLOP. Measured there (``bench_prefill``, 1000 tokens in the 1024 bucket): the mask made
#: Mixtral-8x7B widths (0.7 GFLOP of experts per padding row and layer) 4 % faster, and a
#: Mixtral at hidden 1024 (0.04 GFLOP per row) 1 % slower.
MASK_COST_FLOP = 2.5e9
#: Rows per expert below which a grouped GEMM is bound by reading the expert weights, so padding
#: rows cost next to nothing there.
COMPUTE_BOUND_ROWS = 64


class PaddingRows:
    """Which rows of the forward being run or captured are a bucket's padding, for
    :func:`grouped_skipping_padding`: rows past the largest of the step's last-token indices
    (``last_index``, a device tensor the graph reads; its unused entries are 0), and how many
    padding rows a call of this bucket has on average (``expected``: half the gap to the next
    smaller bucket), which decides whether masking them pays. The mask is computed on first
    use, inside the forward (so inside the graph), once for all layers.

    Example (a bucket of 8 rows; two prompts end at rows 2 and 5, entry 2 unused)::

        >>> rows = PaddingRows(torch.arange(8), torch.tensor([2, 5, 0]), expected=3)
        >>> rows.mask().flatten().tolist()
        [False, False, False, False, False, False, True, True]
    """

    __slots__ = ("row_ids", "last_index", "expected", "_mask")

    def __init__(self, row_ids: torch.Tensor, last_index: torch.Tensor, expected: float):
        self.row_ids, self.last_index, self.expected = row_ids, last_index, expected
        self._mask: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """``[rows, 1]`` bool, True on a padding row."""
        if self._mask is None:
            self._mask = self.row_ids[:, None] > self.last_index.amax()
        return self._mask


@contextlib.contextmanager
def padding_rows(rows: PaddingRows | None) -> Iterator[None]:
    """For the block, ``rows`` tells :func:`grouped_skipping_padding` which rows are padding
    (a context variable: the forward run or captured inside the block, on this thread).

    Example (see :func:`grouped_skipping_padding` for the experts call)::

        >>> rows = PaddingRows(torch.arange(8), torch.tensor([5]), expected=3)
        >>> with padding_rows(rows):
        ...     _padding.get() is rows
        True
        >>> _padding.get() is None
        True
    """
    token = _padding.set(rows)
    try:
        yield
    finally:
        _padding.reset(token)


def worth_skipping(module: Any, rows: int, top_k: int, expected: float) -> bool:
    """Whether routing ``expected`` padding rows (of ``rows``) to no expert saves more than the
    mask costs (:data:`MASK_COST_FLOP`, :data:`COMPUTE_BOUND_ROWS`); never for experts with
    biases: transformers' ``grouped_mm`` indexes them by expert id, and an id past the last
    expert would be out of range there.

    Example (Mixtral's experts at widths 1024, on the meta device: only their shapes count)::

        >>> import transformers
        >>> config = transformers.MixtralConfig(hidden_size=1024, intermediate_size=2816)
        >>> with torch.device("meta"):
        ...     model = transformers.AutoModelForCausalLM.from_config(config)
        >>> experts = next(compat.experts_modules(model))
        >>> worth_skipping(experts, rows=4096, top_k=2, expected=128)
        True
        >>> worth_skipping(experts, rows=4096, top_k=2, expected=16)  # too few padding rows
        False
        >>> worth_skipping(experts, rows=128, top_k=2, expected=32)  # memory-bound: no saving
        False
    """
    shape = compat.experts_shape(module)
    if shape is None:
        return False
    experts, weights = shape
    flop_per_row = 2 * top_k * sum(w.numel() for w in weights) / experts
    compute_bound = rows * top_k >= COMPUTE_BOUND_ROWS * experts
    return compute_bound and expected * flop_per_row >= MASK_COST_FLOP


def grouped_skipping_padding(module: Any, hidden: torch.Tensor, index: torch.Tensor,
                             weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The function registered as ``ExpertsInterface[GROUPED_KEY]``: transformers'
    ``grouped_mm`` experts with the padding rows of :func:`padding_rows` given expert id
    ``num_experts``, which no expert owns (the grouped GEMMs skip them), and zero output.
    Without padding rows for this forward, or where it does not pay (:func:`worth_skipping`),
    it is ``grouped_mm`` itself.

    Example (a bucket of 1024 rows whose two prompts end at rows 9 and 23)::

        >>> import transformers
        >>> config = transformers.MixtralConfig(vocab_size=32, hidden_size=64, num_hidden_layers=1,
        ...     intermediate_size=4096, num_attention_heads=2, num_local_experts=4)
        >>> model = transformers.AutoModelForCausalLM.from_config(config)
        >>> experts = next(compat.experts_modules(model))
        >>> hidden, index = torch.randn(1024, 64), torch.randint(0, 4, (1024, 2))
        >>> rows = PaddingRows(torch.arange(1024), torch.tensor([9, 23]), expected=1000)
        >>> with padding_rows(rows):
        ...     out = grouped_skipping_padding(experts, hidden, index, torch.full((1024, 2), 0.5))
        >>> bool(out[24:].eq(0).all()), bool(out[:24].ne(0).any())  # padding rows: no expert
        (True, True)
    """
    grouped = _grouped or compat.grouped_experts()
    rows = _padding.get()
    n = hidden.shape[0]
    if rows is None or rows.row_ids.shape[0] != n:
        return grouped(module, hidden, index, weights)
    if not worth_skipping(module, n, index.shape[-1], rows.expected):
        return grouped(module, hidden, index, weights)
    pad = rows.mask()
    index = index.masked_fill(pad, module.num_experts)
    return grouped(module, hidden, index, weights).masked_fill_(pad, 0.0)


def needs_experts_break(model: Any) -> bool:
    """True when the model's experts run transformers' eager loop (``nonzero``: not capturable),
    or ``grouped_mm`` where it cannot be captured (:func:`grouped_mm_captures`): the eager loop
    then runs as breaks instead (the same experts, per-expert GEMMs).

    Example::

        >>> import transformers
        >>> config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
        ...     intermediate_size=32, num_attention_heads=2, num_local_experts=4)
        >>> auto = transformers.AutoModelForCausalLM
        >>> model = auto.from_config(config, experts_implementation="eager")
        >>> needs_experts_break(model)
        True
        >>> model.set_experts_implementation("grouped_mm")  # captured as it is (on the CPU)
        >>> needs_experts_break(model)
        False
    """
    key = compat.experts_key(model)
    return key in ("eager", EXPERTS_KEY) or (key == "grouped_mm" and not grouped_mm_captures(model))


#: (device, dtype) -> whether transformers' ``grouped_mm`` experts capture there
_grouped_captures: dict = {}


def grouped_mm_captures(model: Any) -> bool:
    """Whether the model's ``grouped_mm`` experts can be captured on its device and dtype.

    torch's grouped GEMM kernel serves bf16 on some GPUs only (torch 2.10-2.11: compute
    capability 9 and 10); elsewhere (fp32 or fp16 weights, an A100) transformers and torch
    fall back to code that copies the experts' token offsets to the host, which a capture
    refuses (``HostSyncError`` at the first capture: found by the CB fuzzer on the GPU, fp32).
    Probed, not assumed, once per device and dtype: one experts call on two tokens is captured
    (a breakgraph capture, reset when it fails; in CUDA's thread-local mode, so that another
    thread's CUDA work cannot fail it). Off CUDA there is nothing to probe: True. The
    runners ask when they are built, never inside a capture of their own.

    Example::

        >>> grouped_mm_captures(torch.nn.Linear(2, 2))  # on the CPU: nothing to probe
        True
    """
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cuda":
        return True
    key = (parameter.device, parameter.dtype)
    if key not in _grouped_captures:
        if breakgraph.is_capturing():
            raise breakgraph.CaptureError(
                "breakgraph: the grouped_mm experts probe cannot run inside a capture; build "
                "the runner (or enable continuous batching) before capturing."
            )
        _grouped_captures[key] = _capture_grouped_experts(model, parameter.dtype)
    return _grouped_captures[key]


def _capture_grouped_experts(model: Any, dtype: torch.dtype) -> bool:
    """Capture one call of transformers' ``grouped_mm`` experts function on the model's first
    experts module (two tokens routed to expert 0); False when the capture fails."""
    module = next(compat.experts_modules(model), None)  # biased ones too (gpt-oss)
    config = getattr(model, "config", None)
    hidden_size = getattr(config, "hidden_size", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if module is None or not isinstance(hidden_size, int) or not isinstance(top_k, int):
        return True  # nothing this probe knows how to call: served as before
    device = next(module.parameters()).device
    hidden = torch.randn(2, hidden_size, device=device, dtype=dtype)
    index = torch.zeros(2, top_k, device=device, dtype=torch.long)
    weights = torch.full((2, top_k), 1.0 / top_k, device=device, dtype=dtype)
    grouped = compat.grouped_experts()
    with torch.no_grad():
        grouped(module, hidden, index, weights)  # warm up, as before any capture
        try:
            graph = breakgraph.BreakableCUDAGraph()  # thread_local: another thread's CUDA
            with breakgraph.capture(graph, backend="cuda", capture_error_mode="thread_local"):
                grouped(module, hidden, index, weights)
        except breakgraph.CaptureError:
            return False
    return True


@contextlib.contextmanager
def experts_for_prefill(model: Any, skip_padding: bool) -> Iterator[None]:
    """A prefill's experts for the block: the eager loop as breaks (:func:`experts_as_breaks`),
    and with ``skip_padding`` transformers' ``grouped_mm`` as :data:`GROUPED_KEY`; then back.

    Example::

        >>> import transformers
        >>> config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
        ...     intermediate_size=32, num_attention_heads=2, num_local_experts=4)
        >>> model = transformers.AutoModelForCausalLM.from_config(config)  # grouped_mm
        >>> with experts_for_prefill(model, skip_padding=True):
        ...     model.config._experts_implementation
        'breakgraph_grouped_mm'
        >>> model.config._experts_implementation
        'grouped_mm'
    """
    if not (skip_padding and compat.experts_key(model) == "grouped_mm"):
        with experts_as_breaks(model):
            yield
        return
    register()
    model.set_experts_implementation(GROUPED_KEY)
    try:
        yield
    finally:
        model.set_experts_implementation("grouped_mm")


@contextlib.contextmanager
def experts_as_breaks(model: Any) -> Iterator[None]:
    """Run the model's eager experts loop as eager breaks inside the block (then restore).

    Example::

        >>> from transformers import MixtralConfig, MixtralForCausalLM
        >>> model = MixtralForCausalLM(MixtralConfig(num_hidden_layers=1, hidden_size=16,
        ...     intermediate_size=32, num_attention_heads=2, vocab_size=32, num_local_experts=4))
        >>> model.set_experts_implementation("eager")  # transformers' loop over the experts
        >>> with experts_as_breaks(model):
        ...     model.config._experts_implementation
        'breakgraph_eager_loop'
        >>> model.config._experts_implementation
        'eager'
    """
    if not needs_experts_break(model):
        yield
        return
    register()
    original = compat.experts_key(model)
    model.set_experts_implementation(EXPERTS_KEY)
    try:
        yield
    finally:
        model.set_experts_implementation(original)
