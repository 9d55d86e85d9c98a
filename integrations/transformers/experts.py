"""MoE experts through transformers' own registry: the eager experts loop as an eager break.

transformers dispatches every experts module decorated with ``@use_experts_implementation``
through ``ExpertsInterface`` by ``config._experts_implementation``. Its ``"eager"``
implementation (the model file's own ``forward``) loops in Python over the experts that
received tokens (``nonzero`` on the routing): data-dependent, not capturable. breakgraph
registers one more implementation, :data:`EXPERTS_KEY`, that runs that very loop as an
``@eager_on_graph`` break, and the runners switch a model to it around their forward with
transformers' ``set_experts_implementation`` (and back), exactly as attention is switched
through ``AttentionInterface``. ``grouped_mm`` and ``batched_mm`` need no break: they are
captured as they are.

Example::

    from breakgraph.integrations.transformers.experts import experts_as_breaks
    with experts_as_breaks(model):      # only if the model uses the eager loop
        ...                             # capture the forward
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
    "grouped_skipping_padding", "needs_experts_break", "padding_rows",
]  # fmt: skip

EXPERTS_KEY = "breakgraph_eager_loop"
GROUPED_KEY = "breakgraph_grouped_mm"

_grouped: Any = None  # transformers' grouped_mm experts function (found by register())
# [rows, 1] bool, True on a padding row, for the forward being run or captured (None: no mask)
_padding: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
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
    live = getattr(breakgraph.replay_context(), "live_tokens", None)
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


@contextlib.contextmanager
def padding_rows(mask: torch.Tensor | None) -> Iterator[None]:
    """For the block, ``mask`` (``[rows, 1]`` bool on the model's device, True on a padding
    row) tells :func:`grouped_skipping_padding` which rows to route to no expert.

    Example::

        pad = torch.arange(bucket, device=dev)[:, None] > last_index.amax()
        with padding_rows(pad):
            logits = model(input_ids=ids, position_ids=positions).logits
    """
    token = _padding.set(mask)
    try:
        yield
    finally:
        _padding.reset(token)


def skips_padding(module: Any) -> bool:
    """Whether :func:`grouped_skipping_padding` can route ``module``'s padding rows to no
    expert: transformers' ``grouped_mm`` indexes per-expert biases with the ids (an id past
    the last expert would be out of range there), so only experts without biases."""
    return getattr(module, "has_bias", True) is False and hasattr(module, "num_experts")


def grouped_skipping_padding(module: Any, hidden: torch.Tensor, index: torch.Tensor,
                             weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The function registered as ``ExpertsInterface[GROUPED_KEY]``: transformers'
    ``grouped_mm`` experts with the padding rows of :func:`padding_rows` given expert id
    ``num_experts``, which no expert owns (the grouped GEMMs skip them), and zero output.
    Without a mask of this forward's rows it is ``grouped_mm`` itself."""
    grouped = _grouped or compat.grouped_experts()
    pad = _padding.get()
    if pad is None or pad.shape[0] != hidden.shape[0] or not skips_padding(module):
        return grouped(module, hidden, index, weights)
    index = index.masked_fill(pad, module.num_experts)
    return grouped(module, hidden, index, weights).masked_fill_(pad, 0.0)


def needs_experts_break(model: Any) -> bool:
    """True when the model's experts run transformers' eager loop (``nonzero``: not capturable)."""
    return compat.experts_key(model) in ("eager", EXPERTS_KEY)


@contextlib.contextmanager
def experts_for_prefill(model: Any, skip_padding: bool) -> Iterator[None]:
    """A prefill's experts for the block: the eager loop as breaks (:func:`experts_as_breaks`),
    and with ``skip_padding`` transformers' ``grouped_mm`` as :data:`GROUPED_KEY`; then back."""
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
    """Run the model's eager experts loop as eager breaks inside the block (then restore)."""
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
