"""What keeps graph memory alive: borrowed tensors, and methods held weakly.

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

An object that hands one of its own methods to a runner it keeps (``BucketedRunner(self.forward,
...)``) makes a reference cycle: the object holds the runner, the runner the bound method, the
method the object. Reference counting never frees a cycle, so a dropped object's graphs, and
the pool memory they hold, would wait for Python's cyclic collector. :func:`weak_method` hands
the runner the method without the object.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .errors import InputError, ReplayError

__all__ = ["borrowed", "weak_method"]


def borrowed(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s memory (same shape, strides, offset) that does not own it.

    Only a dense tensor with data has memory to borrow: anything else is an ``InputError``
    here (torch's own errors would be an ``AttributeError``, "Cannot access storage of
    SparseTensorImpl" or, for a meta tensor, "Trying to resize storage").
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided or tensor.is_meta:
        what = type(tensor).__name__
        if isinstance(tensor, torch.Tensor):
            what = "a meta tensor" if tensor.is_meta else f"a {tensor.layout} tensor"
        raise InputError(
            f"borrowed: expected a dense tensor with data (torch.strided, not on the meta "
            f"device), got {what}; borrow the dense tensor that owns the memory."
        )
    storage = tensor.untyped_storage()
    alias_storage = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), tensor.device, storage.nbytes()
    )
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)  # allocates nothing
    return alias.set_(alias_storage, tensor.storage_offset(), tensor.shape, tensor.stride())


def weak_method(method: Callable) -> Callable:
    """``method`` (a bound method) as a callable that does not keep its object alive; called
    after the object is gone, it raises ``ReplayError``.

    Example::

        >>> import torch
        >>> from breakgraph.runner import BucketedRunner
        >>> class Doubler:
        ...     def __init__(self):
        ...         self.runner = BucketedRunner(weak_method(self.forward), (4,),
        ...                                      (torch.zeros(1),), backend="emulated")
        ...     def forward(self, x):
        ...         return x * 2
        >>> doubler = Doubler()
        >>> doubler.runner(torch.ones(3)).tolist()
        [2.0, 2.0, 2.0]
        >>> del doubler  # no cycle: freed at once, with its runner and graphs
    """
    if not isinstance(method, types.MethodType):
        raise InputError(
            f"weak_method: expected a bound method (obj.method), got {method!r}; a plain "
            f"function holds no object and can be passed as it is."
        )
    try:
        owner = weakref.ref(method.__self__)
    except TypeError as exc:  # __slots__ without __weakref__ (dataclass(slots=True) too)
        raise InputError(
            f"weak_method: {method.__qualname__}'s object cannot be referenced weakly ({exc}); "
            f"add '__weakref__' to its class's __slots__ (dataclass(weakref_slot=True)), or "
            f"pass the method as it is."
        ) from exc
    function, name = method.__func__, method.__qualname__

    def call(*args: Any, **kwargs: Any) -> Any:
        obj = owner()
        if obj is None:
            raise ReplayError(
                f"{name}: its object was deleted (a runner kept it weakly); keep the object "
                f"alive while its runner is used."
            )
        return function(obj, *args, **kwargs)

    call.__name__, call.__qualname__ = method.__name__, name  # not __wrapped__: that holds it
    call.__module__ = function.__module__
    return call
