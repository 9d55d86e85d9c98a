"""transformers' CB index lists to tensors through numpy: the largest host cost of a CB step.

Every continuous-batching step, transformers' ``prepare_batch_tensors`` builds the step's
paged-cache read indices (one Python int per cached key of every request in the step), its
write indices, token ids and positions as Python lists, then converts each with
``torch.tensor(values, dtype=..., device=...)``. ``torch.tensor`` reads a list of ints at
63-98 ns per entry on an H200 server's host; for 100 decoding requests (about 52,000 indices)
that was 3.2-5.1 ms of a 8-16 ms step, 52-62 % of transformers' preparation
(``bench_cb --prep-lists``, docs/performance.md). ``numpy.array`` reads the same list about
four times faster (in a loop), and ``torch.from_numpy`` shares its memory: on the H200's host
the conversions of a step went from 3.4-5.3 ms to 1.4-1.8 ms.

While continuous batching is enabled on some model, transformers' ``input_outputs`` module
sees, under its global name ``torch``, a :class:`NumpyLists` view of torch: the same module in
every attribute but ``tensor``, whose lists of ints convert through numpy; anything else
(another type, a list of something else, other keyword arguments) goes to ``torch.tensor``.
The tensors are equal, with the same dtype and device, so every CB manager of the process
(breakgraph's or stock) gets the same steps, faster. The replacement goes through
:mod:`breakgraph.patches` (shared by the enabled models, restored with the last), and is
made only where :func:`~.compat.index_lists_module` finds the module converting its lists
that way (contract item 12); a release that does not is served as it is.

Example::

    >>> import torch
    >>> from breakgraph.integrations.transformers.index_lists import NumpyLists
    >>> fast = NumpyLists(torch)
    >>> values = list(range(40))
    >>> torch.equal(fast.tensor(values, dtype=torch.int64), torch.tensor(values))
    True
    >>> fast.int32 is torch.int32
    True
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import torch

from breakgraph.patches import PatchSet

from . import compat
from .index_rows import RowChunks

__all__ = ["NumpyLists", "install"]

#: The dtypes whose lists convert through numpy (transformers' index and id lists).
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}
_SHORT = 16  # below this many values torch.tensor's own cost is no larger


class NumpyLists(types.ModuleType):
    """A view of the torch module whose ``tensor`` converts long lists of ints with numpy.

    Every other attribute is torch's own, looked up on torch at each use (so a later
    replacement of a torch attribute is seen through the view too)."""

    def __init__(self, module: types.ModuleType = torch) -> None:
        super().__init__(module.__name__, module.__doc__)
        self.__dict__["_module"] = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)

    def tensor(self, data: Any, *args: Any, dtype=None, device=None, **kwargs: Any):
        """``torch.tensor(data, dtype=dtype, device=device)``; a list of ints with an int32 or
        int64 dtype is read by numpy (the same values; an int that does not fit raises
        ``OverflowError`` where torch raises ``RuntimeError``). Without a device, only where
        torch's default device is the CPU (``from_numpy`` makes CPU tensors)."""
        kind = _NUMPY_DTYPES.get(dtype)
        if type(data) is RowChunks:  # a step's rows kept in numpy (:mod:`.index_rows`)
            if kind is None or args or kwargs:
                return torch.tensor(data.array(), *args, dtype=dtype, device=device, **kwargs)
            return self._joined(data.array().astype(kind, copy=False), device)
        if (kind is None or args or kwargs or type(data) is not list or len(data) < _SHORT
                or type(data[0]) is not int):  # fmt: skip
            return torch.tensor(data, *args, dtype=dtype, device=device, **kwargs)
        # fromiter: 15 % faster than np.array on a list of ints, the same values and errors
        return self._joined(np.fromiter(data, dtype=kind, count=len(data)), device)

    @staticmethod
    def _joined(values: np.ndarray, device: Any) -> torch.Tensor:
        if device is None:
            device = torch.get_default_device()
        elif not isinstance(device, torch.device):
            device = torch.device(device)
        result = torch.from_numpy(values)
        return result if device.type == "cpu" else result.to(device)


def install(patches: PatchSet) -> bool:
    """Show transformers' ``input_outputs`` module a :class:`NumpyLists` as ``torch`` (until
    ``patches`` restores it). False, and nothing replaced, where the probe does not find the
    module converting its lists with ``torch.tensor``."""
    module = compat.index_lists_module()
    if module is None:
        return False
    patches.attribute(module, "torch", NumpyLists(module.torch))
    return True
