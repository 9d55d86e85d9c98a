"""Tensor parallelism that can be captured: the vocab-parallel embedding, looked up on the device.

Under tensor parallelism (TP) transformers may shard the input embedding over the
vocabulary: from 5.21 every model's ``embed_tokens`` (``EmbeddingParallel``), and before
that the embedding of models with tied weights, Gemma's for one (``RowwiseParallel`` on an
``nn.Embedding``). Its forward hook looks the ids up on DTensors: torch's ``_MaskPartial``
placement shifts the ids into this rank's rows, zeroes the rows of ids another rank holds
with a boolean-mask assignment (``tensor[mask, :] = 0``: ``index_put_`` runs ``nonzero``, a
host sync) and all-reduces. A host sync cannot be captured (breakgraph raises
``HostSyncError``; a plain CUDA graph capture fails), and the ``_MaskPartial`` DTensor that
Gemma's scaled embedding returns breaks replay and, after a failure, every later lookup
(``MaskBuffer has been materialized with conflicting data``).

:func:`graph_safe_tensor_parallel` replaces the forward of each such embedding, for the
block only, with the same computation on plain tensors (as vLLM's vocab-parallel
embedding does)::

    shifted = input_ids - offset                  # this rank's rows: offset .. offset+rows-1
    outside = (shifted < 0) | (shifted >= rows)
    out = forward_of_the_class(module_on_its_shard, shifted.masked_fill(outside, 0))
    out = out.masked_fill(outside[..., None], 0)  # a device mask: no nonzero, no sync
    torch.distributed.all_reduce(out, group)      # captured, like the row-parallel ones

The class's own forward runs on a shallow copy of the module that holds the local shard,
so a subclass's extra work (Gemma's scale) happens as in the hook. Each output row is one
rank's row plus zeros, so the result equals the unsharded model's embedding exactly. The
all-reduce is the module attribute ``torch.distributed.all_reduce``, so with
``PrefillRunner(tp_collectives="eager")`` it becomes an eager break like the others.

Why not run the stock lookup as an eager break instead: that break would hold a host sync
and an NCCL collective between captured segments (a sync in a break between NCCL segments
can stall, pytorch #196133; transformers' continuous batching sets
``NCCL_GRAPH_MIXING_SUPPORT=0``, which forbids eager collectives between captured ones),
and it would add a break, DTensor's Python dispatch and a segment boundary to every step.
The device lookup adds nothing to a replay: two small masked writes inside the first
segment.

Support is decided by probing, never by a version: a module is replaced when it is an
``nn.Embedding`` whose weight is a ``DTensor`` sharded on dim 0 of a 1-D mesh and whose
``forward`` is an instance attribute (transformers' TP hook). The first entry for a model
then checks, once, that the replacement gives exactly what the hook gives (ids at the
edges of every rank's rows, on every rank: the model's own collectives run), and raises
:class:`UnsupportedModelError` if not. Models without such an embedding (no TP, or an
untied embedding before transformers 5.21) are left alone.

The interface, for every runner of the integration (``PrefillRunner``, continuous
batching):

* ``with graph_safe_tensor_parallel(model): ...`` around every warm-up, capture and eager
  forward of ``model``. Cheap to enter (a dictionary lookup and one attribute patch per
  vocab-parallel embedding, through :mod:`breakgraph.patches`); a no-op for other models.
* Enter it for the first time on every rank and outside any capture (a runner's warm-up
  does), because that entry runs the check: inside a capture it raises ``CaptureError``.

Example::

    >>> import torch
    >>> from breakgraph.integrations.transformers.tensor_parallel import (
    ...     graph_safe_tensor_parallel)
    >>> model = torch.nn.Sequential(torch.nn.Embedding(8, 4))   # not tensor-parallel
    >>> with graph_safe_tensor_parallel(model):                 # nothing to replace
    ...     model(torch.tensor([1, 2])).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from breakgraph.errors import CaptureError
from breakgraph.patches import patch_attribute
from breakgraph.state import current_capture

from .models import UnsupportedModelError

__all__ = ["graph_safe_tensor_parallel", "vocab_parallel_embeddings", "VocabParallelLookup"]

#: model -> ((embedding module, its graph-safe forward), ...), checked once per model
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CHECKING = threading.Lock()


@contextlib.contextmanager
def graph_safe_tensor_parallel(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s vocab-parallel embeddings look up on the device (see the
    module doc); outside, the model is exactly as before.

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> with graph_safe_tensor_parallel(model):
        ...     model.forward == torch.nn.Linear.forward.__get__(model)
        True
    """
    replacements = _CHECKED.get(model)
    if replacements is None:
        replacements = _check(model)
    if not replacements:
        yield
        return
    with contextlib.ExitStack() as stack:
        for module, lookup in replacements:
            patch_attribute(stack, module, "forward", lookup)
        yield


def vocab_parallel_embeddings(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of each embedding of ``model`` that transformers' TP hook looks up
    vocab-parallel: an ``nn.Embedding`` whose weight is a DTensor sharded on dim 0 of a 1-D
    mesh, with the hook installed as the instance's ``forward``.

    Example::

        >>> import torch
        >>> vocab_parallel_embeddings(torch.nn.Embedding(8, 4))
        []
    """
    if not dist.is_available():
        return []
    from torch.distributed.tensor import DTensor, Shard

    found = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Embedding):
            continue
        weight = module._parameters.get("weight")
        if (
            isinstance(weight, DTensor)
            and weight.device_mesh.ndim == 1
            and tuple(weight.placements) == (Shard(0),)
            and "forward" in module.__dict__
        ):
            found.append((name, module))
    return found


class VocabParallelLookup:
    """The graph-safe forward of one vocab-parallel embedding (see the module doc).

    Built once per module. Each call reads the module's current weight (one view of its
    local shard), so a weight replaced after the check (``load_state_dict``, a dtype
    change) is the one looked up; otherwise it allocates only what the lookup produces.
    """

    def __init__(self, module: torch.nn.Embedding, name: str = "embedding"):
        weight = module.weight
        mesh = weight.device_mesh
        total, world, coordinate = weight.shape[0], mesh.size(), mesh.get_local_rank()
        per_rank = -(-total // world)  # DTensor's Shard: torch.chunk's sizes
        self.offset = min(coordinate * per_rank, total)
        self.rows = weight.to_local().shape[0]
        if self.rows != max(0, min(per_rank, total - self.offset)):
            raise _unsupported(
                f"{name}: rank {coordinate} holds {self.rows} of {total} rows, not the even "
                f"split of torch.chunk"
            )
        if module.max_norm is not None:
            raise _unsupported(f"{name}: max_norm renormalises the weight in place")
        self.group = mesh.get_group()
        self.name = name
        self.module = module
        # the class's forward runs on a shallow copy whose own parameter dict holds the local
        # shard: no DTensor, and the model's module is never modified. padding_idx only
        # shapes gradients (and is a global index, perhaps outside this shard).
        shard = copy.copy(module)
        shard._parameters = dict(module._parameters)
        shard.padding_idx = None
        self._shard = shard
        self._forward = type(module).forward

    def __call__(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        shard = self._shard
        shard._parameters["weight"] = self.module.weight.to_local()  # this rank's rows, now
        shifted = input_ids - self.offset
        outside = (shifted < 0) | (shifted >= self.rows)
        out = self._forward(shard, shifted.masked_fill(outside, 0), *args, **kwargs)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)  # looked up per call: all_reduce_as_breaks
        return out

    def probe_ids(self, device: torch.device) -> torch.Tensor:
        """The first and last id of every rank's rows, as ``[1, n]``: the edges of the masks."""
        total, world = self._shard.num_embeddings, dist.get_world_size(self.group)
        per_rank = -(-total // world)
        edges = set()
        for rank in range(world):
            start = min(rank * per_rank, total)
            end = min(start + per_rank, total)
            if end > start:
                edges.update((start, end - 1))
        return torch.tensor(sorted(edges), dtype=torch.long, device=device)[None]


def _check(model: torch.nn.Module) -> tuple:
    """Find the model's vocab-parallel embeddings and check each replacement once against
    transformers' hook (runs the model's collectives: every rank, outside a capture)."""
    with _CHECKING:
        if model in _CHECKED:
            return _CHECKED[model]
        found = vocab_parallel_embeddings(model)
        if found and (current_capture() is not None or _cuda_capturing()):
            raise CaptureError(
                "graph_safe_tensor_parallel: the first use for a tensor-parallel model checks "
                "its vocab-parallel embedding with the model's collectives, which cannot run "
                "inside a capture. Enter graph_safe_tensor_parallel(model) once before "
                "capturing, on every rank (a warm-up run does it)."
            )
        replacements = []
        for name, module in found:
            lookup = VocabParallelLookup(module, name)
            _compare_with_hook(module, lookup)
            replacements.append((module, lookup))
        _CHECKED[model] = tuple(replacements)
        return _CHECKED[model]


def _compare_with_hook(module: torch.nn.Module, lookup: VocabParallelLookup) -> None:
    """Raise unless ``lookup`` gives exactly what the module's TP hook gives. Every rank
    compares the same all-reduced values, so every rank decides the same way."""
    from torch.distributed.tensor import DTensor

    ids = lookup.probe_ids(module.weight.device)
    with torch.no_grad():
        expected = module.forward(ids)
        got = lookup(ids)
    if isinstance(expected, DTensor) or not isinstance(expected, torch.Tensor):
        raise _unsupported(
            f"{lookup.name}: transformers' TP hook returns {type(expected).__name__}, not the "
            f"replicated plain tensor of a vocab-parallel embedding"
        )
    if expected.shape != got.shape or expected.dtype != got.dtype or not torch.equal(expected, got):
        raise _unsupported(
            f"{lookup.name}: transformers' TP hook computes something other than a "
            f"vocab-parallel lookup (its output differs from the masked local lookup summed "
            f"over the ranks)"
        )


def _unsupported(reason: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"graph_safe_tensor_parallel: {reason}, so breakgraph cannot replace its host-syncing "
        f"masked write with a graph-safe lookup. Load the model without sharding the embedding "
        f"(a tp_plan without embed_tokens), or run it without tensor parallelism."
    )


def _cuda_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
