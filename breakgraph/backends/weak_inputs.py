"""Debug mode on the emulated backend: the graph holds what it reads from outside weakly.

A CUDA graph holds no tensor: it reads *addresses*. Memory it reads but did not allocate
(static inputs, parameters, caches, tensors a break stored somewhere) lives only as long as
something outside the graph holds it; once freed, the allocator hands it to other tensors
and replays read whatever is there. The emulated backend's replay steps hold aliases of
every tensor they read, so such memory never dies there and the bug goes unseen.

In debug mode the emulated session therefore tells the tensors its recorded operations made
(their storage is the graph's, as a CUDA graph's pool is) from the others, and each replay
step keeps of the others only a :class:`WeakAlias`: a weak reference to the storage and the
alias's dtype, offset, shape and strides. Each replay re-creates the alias from the live
storage (in-place writes land in the same memory), so a storage nothing outside the graph
holds is really freed, and :class:`~breakgraph.debug.InputWatch` reports it ("was freed")
before the segment that reads it; a step that meets one anyway raises
:class:`~breakgraph.StaleTensorError` naming its operation. Without debug mode none of this
exists: the steps hold frozen aliases, as before.

Held strongly still (not seen): 0-dim tensors (torch makes a Python number given where a
tensor is expected, ``torch.where(c, x, 0.0)``, into a 0-dim tensor that only the operation
holds), tensors without a plain strided storage of their own (subclasses, conjugate or
negative views, quantized), and empty ones.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..errors import StaleTensorError
from ..structure import storage_address

__all__ = ["WeakAlias", "ExternalInputs"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class WeakAlias:
    """An alias of a tensor that does not keep its memory alive: ``tensor()`` makes it again
    from the storage, or raises :class:`~breakgraph.StaleTensorError` once that was freed."""

    __slots__ = ("storage", "dtype", "device", "offset", "shape", "stride", "func")

    def __init__(self, t: torch.Tensor, func: Any):
        # torch keeps one Python object per live storage (what untyped_storage() returns each
        # time), so the weak reference dies exactly when the memory is freed
        self.storage = weakref.ref(t.untyped_storage())
        self.dtype, self.device = t.dtype, t.device
        self.offset, self.shape, self.stride = t.storage_offset(), tuple(t.shape), t.stride()
        self.func = func

    def tensor(self) -> torch.Tensor:
        storage = self.storage()
        if storage is None:
            raise StaleTensorError(
                f"{self.func} in a replayed segment reads a tensor (shape={self.shape}, "
                f"dtype={self.dtype}) that the graph did not make and that was freed since "
                f"capture: nothing outside the graph holds its memory any more, which a CUDA "
                f"graph would go on reading after the allocator gave it to other tensors. Keep "
                f"it alive and refill it in place (static.copy_(new)) instead of replacing it."
            )
        alias = torch.empty(0, dtype=self.dtype, device=self.device)
        return alias.set_(storage, self.offset, self.shape, self.stride)


def _resolved(value: Any) -> Any:
    if isinstance(value, WeakAlias):
        return value.tensor()
    if isinstance(value, (list, tuple)):
        return type(value)(_resolved(v) for v in value)
    return value


class ExternalInputs:
    """The storages a capture's recorded operations made (debug mode on the emulated backend):
    what a step reads from any other storage is held weakly (:class:`WeakAlias`)."""

    def __init__(self, frozen: Callable[[Any], Any]):
        self._frozen = frozen  # the backend's strong alias of a value (non-debug behaviour)
        self._made: dict[int, weakref.ref] = {}  # storage address -> the storage made there

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Count the storages ``func`` made: those of its outputs it did not read (not a view,
        not the argument it wrote). A tensor torch made from host data (``lift_fresh``) is the
        graph's too: its replay step writes its value again every time."""
        read = {storage_address(t) for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        fresh = func.overloadpacket is torch.ops.aten.lift_fresh
        for t in _leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = storage_address(t)
            if ptr != 0 and (fresh or ptr not in read):
                self._made[ptr] = weakref.ref(t.untyped_storage())

    def _weak(self, t: torch.Tensor) -> bool:
        if type(t) not in _PLAIN or t.dim() == 0 or t.layout is not torch.strided:
            return False
        if t.is_quantized or t.is_conj() or t.is_neg() or t.device.type == "meta":
            return False
        ptr = storage_address(t)
        if ptr == 0:
            return False
        made = self._made.get(ptr)
        return made is None or made() is not t.untyped_storage()

    def _held(self, value: Any, func: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return WeakAlias(value, func) if self._weak(value) else self._frozen(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self._held(v, func) for v in value)
        return value

    def hold(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, Callable]:
        """``func``'s arguments as a replay step holds them, and what the step calls: ``func``
        itself where every argument is held strongly, else ``func`` on the aliases made again
        from the live storages (allocations on every replay: debug mode only)."""
        args = self._held(args, func)
        kwargs = {k: self._held(v, func) for k, v in kwargs.items()}
        if not any(isinstance(v, WeakAlias) for v in _leaves((args, kwargs))):
            return args, kwargs, func

        def call(*args: Any, **kwargs: Any) -> Any:
            return func(*_resolved(args), **{k: _resolved(v) for k, v in kwargs.items()})

        return args, kwargs, call


def _leaves(value: Any) -> list:
    """The tensors (and weak aliases) of an operation's arguments or outputs."""
    return [v for v in tree_leaves(value) if isinstance(v, (torch.Tensor, WeakAlias))]
