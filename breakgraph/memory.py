"""Borrowed tensors: read and write memory that something else keeps alive.

A :class:`~breakgraph.BreakableCUDAGraph` holds every tensor that crosses a break
strongly, which is always safe. A runner that captures a ladder of buckets into one
private pool and replays them strictly one at a time can do better: tensors that live
*inside that pool* (activations an eager break reads, a graph's output) may be released
to the pool once their bucket is captured, so the next bucket's capture reuses the
memory, while the runner keeps a *borrowed* alias to read them at replay. The pool never
returns memory to anyone else while one of its graphs lives, and two buckets never run
at the same time, so the memory each graph uses is always its own during its replay.
That is what makes a dense ladder cost about as much memory as its largest bucket.

Never borrow memory from the ordinary caching allocator (it would be handed to other
tensors) or from a pool whose graphs may replay concurrently.

Example::

    >>> import torch
    >>> from breakgraph.memory import borrowed
    >>> owner = torch.arange(4.0)
    >>> alias = borrowed(owner)
    >>> _ = owner.add_(1)
    >>> alias.tolist()
    [1.0, 2.0, 3.0, 4.0]
"""

from __future__ import annotations

import torch

__all__ = ["borrowed"]


def borrowed(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s memory (same shape, strides, offset) that does not own it."""
    storage = tensor.untyped_storage()
    alias_storage = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), tensor.device, storage.nbytes()
    )
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)  # allocates nothing
    return alias.set_(alias_storage, tensor.storage_offset(), tensor.shape, tensor.stride())
