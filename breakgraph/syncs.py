"""Host-synchronisation detection for captured segments.

A CUDA graph runs no Python on replay, so any operation whose *result reaches
the host* (``.item()``, ``if tensor:``, ``nonzero`` whose output size depends on
the data, a blocking device-to-host copy) cannot be captured. CUDA reports such
an operation late and far from its cause (often as an invalidated capture at
``capture_end``). breakgraph watches the aten operations of every segment with a
``TorchDispatchMode`` and raises :class:`~breakgraph.HostSyncError` *before* the
operation runs, naming the operation and the user's line, so the capture is
never invalidated and can be abandoned cleanly.

Example::

    >>> import torch
    >>> from breakgraph.syncs import SegmentMode
    >>> with SegmentMode(all_devices=True):
    ...     torch.ones(2).sum().item()
    Traceback (most recent call last):
    breakgraph.errors.HostSyncError: ...
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
)
from torch.utils._pytree import tree_leaves

from ._layout import OWN_DIRS
from .errors import CaptureError, HostSyncError
from .state import state

__all__ = [
    "SegmentMode",
    "CompileTransparentSegmentMode",
    "SYNC_OPERATIONS",
    "sync_reason",
    "exit_segment_mode",
    "mark_capture_failed",
    "user_frame",
]

aten = torch.ops.aten

_TENSOR_REPEATS = (
    "`repeat_interleave` with a tensor of repeats and no `output_size` (its output size "
    "depends on the data)"
)
# linalg functions that read their error code on the host (_linalg_check_errors: `.item()`);
# their `_ex` variants (`torch.linalg.inv_ex`, `cholesky_ex`, `solve_ex`) leave it on the device
_CHECKED = (
    "`torch.linalg.inv`, `solve`, `cholesky`, `lu_factor` and the like (they read their error "
    "code on the host; `torch.linalg.inv_ex`, `cholesky_ex`, `solve_ex` and `lu_factor_ex` do not)"
)
_CUSOLVER = (
    "`torch.linalg.eigh`, `svd` and what is built on them (cuSOLVER reads its status on the host)"
)
#: aten operations (a whole overload packet, or one overload where only it syncs) that need the
#: host to see device values, with the Python spelling users wrote.
SYNC_OPERATIONS: dict = {
    aten._local_scalar_dense: (
        "`.item()`, `if tensor:` / `bool(t)`, `float(t)` or `int(t)`: a device value read on "
        "the host"
    ),
    aten.is_nonzero: "`if tensor:` / `bool(tensor)` (a Python branch on a device value)",
    aten.item: "`.item()`",
    aten.nonzero: "`nonzero()` / `torch.where(cond)` (its output size depends on the data)",
    # under inference_mode these arrive whole, not as the nonzero / masked_select inside them
    aten.argwhere: "`argwhere` (its output size depends on the data)",
    aten.where.default: (  # where(cond, a, b), the other overloads, needs no sync
        "`torch.where(cond)` with one argument (nonzero: its output size depends on the data)"
    ),
    aten.nonzero_numpy: "`nonzero(as_tuple=True)` (its output size depends on the data)",
    aten.narrow.Tensor: "`narrow` with a tensor `start` (`.item()` of it inside)",
    aten.repeat_interleave.Tensor: _TENSOR_REPEATS,  # an int of repeats (self_int) is no sync
    aten.repeat_interleave.self_Tensor: _TENSOR_REPEATS,
    aten.repeat_interleave.Tensor_out: _TENSOR_REPEATS,
    aten.masked_select: "`masked_select` (its output size depends on the data)",
    aten._unique: "`unique` (its output size depends on the data)",
    aten._unique2: "`unique` (its output size depends on the data)",
    aten.unique_dim: "`unique(dim=...)` (its output size depends on the data)",
    aten.unique_consecutive: "`unique_consecutive` (its output size depends on the data)",
    aten.unique_dim_consecutive: (
        "`unique_consecutive(dim=...)` (its output size depends on the data)"
    ),
    aten.equal: "`torch.equal` (returns a Python bool)",
    aten.allclose: "`torch.allclose` (returns a Python bool)",
    aten.bincount: "`bincount` (its output size depends on the data)",
    aten._linalg_check_errors: _CHECKED,
    # under inference_mode these arrive whole, not as what they decompose into
    **dict.fromkeys(
        (
            aten.linalg_inv,
            aten.inverse,
            aten.linalg_solve,
            aten.linalg_cholesky,
            aten.linalg_lu_factor,
            aten.linalg_ldl_factor,
            aten.linalg_tensorinv,
            aten.linalg_tensorsolve,
        ),
        _CHECKED,
    ),
    **dict.fromkeys(
        (
            aten._linalg_eigh,
            aten.linalg_eigh,
            aten.linalg_eigvalsh,
            aten._linalg_svd,
            aten.linalg_svd,
            aten.linalg_svdvals,
            aten.svd,
            aten.linalg_matrix_rank,
        ),
        _CUSOLVER,
    ),
}


def _dispatched(call: Callable[[], Any]) -> list:
    """The aten operations ``call`` reaches the dispatcher as, composites expanded (they do
    outside ``inference_mode``; this leaves it, so an import under it answers the same).

    Example::

        >>> import torch
        >>> [str(f) for f in _dispatched(lambda: torch.ones(3).nonzero())]
        ['aten.ones.default', 'aten.nonzero.default']
    """
    seen = []

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(False), torch.no_grad(), _Record():
        call()
    return seen


def _decomposes_into_a_sync(call: Callable[[], Any]) -> bool:
    """Whether ``call`` runs an operation of :data:`SYNC_OPERATIONS` once its composite
    operations expand. For operations whose implementation moved between torch releases:
    support is probed, not read off a version.

    Example::

        >>> import torch
        >>> _decomposes_into_a_sync(lambda: torch.ones(3).nonzero())
        True
    """
    return any(
        f in SYNC_OPERATIONS or f.overloadpacket in SYNC_OPERATIONS for f in _dispatched(call)
    )


# Under inference_mode `torch.combinations` reaches the mode whole. Up to torch 2.13 it ran
# masked_select inside (a sync); from 2.14 it runs nonzero_static, whose size is known, and
# is captured like any other operation.
if _decomposes_into_a_sync(lambda: torch.combinations(torch.arange(3.0))):
    SYNC_OPERATIONS[aten.combinations] = "`torch.combinations` (runs masked_select inside)"

# An array made from Python data is copied from pageable host memory, which torch refuses
# during a CUDA capture (the CPU tensor is not pinned). On CUDA the copy runs below the
# dispatcher (torch then raises on its own); only the emulated backend sees it, as lift_fresh.
_HOST_DATA = (
    "`torch.tensor(data)`, `as_tensor(list)`, `new_tensor(data)` or indexing with a list: a "
    "copy of host data to the device, which torch refuses from pageable memory during a CUDA "
    "capture; build the tensor before the capture"
)

# under inference_mode `.cpu()`, `.to("cpu")` and `.tolist()` reach the mode whole, as aten.to
_COPY_OPERATIONS = {aten._to_copy, aten.copy_, aten.to}
# indexing with a boolean mask runs nonzero() inside: the result size depends on the data
_MASK_INDEXING = {
    aten.index: "`x[mask]` (boolean-mask indexing: its output size depends on the data)",
    aten.index_put_: "`x[mask] = v` (boolean-mask assignment runs nonzero inside)",
    aten.index_put: "`x[mask] = v` (boolean-mask assignment runs nonzero inside)",
}

_PACKAGE_DIRS = OWN_DIRS + (os.path.dirname(os.path.abspath(torch.__file__)),)


def _user_stack_frame():
    """The innermost stack frame outside torch and breakgraph: the line that caused it."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_PACKAGE_DIRS) and "contextlib" not in path:
            return frame
    return None


def user_frame() -> str:
    frame = _user_stack_frame()
    if frame is None:
        return "<unknown location>"
    code = f": `{frame.line.strip()}`" if frame.line else ""
    return f"{frame.filename}:{frame.lineno} in {frame.name}{code}"


def copies_host_data(made: torch.Tensor) -> bool:
    """Whether ``lift_fresh(made)`` is torch's own copy of an array of Python data
    (``torch.tensor([..])``, ``x[[0, 2]]``), which becomes a copy from pageable host memory on
    CUDA. Not a tensor over the caller's memory (``torch.from_numpy``, ``as_tensor`` of an
    array: its storage cannot be resized), nor an empty one (torch copies nothing), nor a
    single number: torch makes one for ``x[:, 0] = 0.0``, a device fill on CUDA, and a
    0-dim CPU tensor is a legal operand of CUDA kernels (``torch.tensor(2.0, device="cuda")``
    is refused on CUDA but not seen here)."""
    return made.dim() > 0 and made.numel() > 0 and made.untyped_storage().resizable()


def own_generator(generator: torch.Generator, all_devices: bool) -> bool:
    """Whether ``generator`` is not its device's default generator: a CUDA graph advances only
    the generators registered with it, and each segment registers the default one alone.
    ``all_devices``: CPU generators stand for device ones (the emulated backend). Wrappers
    differ from call to call; ``_cdata`` names the generator itself."""
    device = generator.device
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return generator._cdata != torch.cuda.default_generators[index]._cdata
    return (
        all_devices and device.type == "cpu" and generator._cdata != torch.default_generator._cdata
    )


def sync_reason(func, args, kwargs, all_devices: bool) -> str | None:
    """Why ``func(*args, **kwargs)`` needs the host to see device values (the spelling users
    wrote), or None. ``all_devices=True`` counts CPU tensors as device tensors (the emulated
    backend, where every tensor stands for a device tensor)."""
    packet = func.overloadpacket
    reason = SYNC_OPERATIONS.get(func) or SYNC_OPERATIONS.get(packet)
    if reason is not None:
        if kwargs.get("output_size") is not None:  # repeat_interleave told its output size
            return None
        read = args[2:3] if func is aten.narrow.Tensor else (args, kwargs)  # reads `start` only
        tensors = [t for t in tree_leaves(read) if isinstance(t, torch.Tensor)]
        if all_devices or any(t.device.type != "cpu" for t in tensors):
            return reason
        return None
    if packet is aten.lift_fresh:  # the emulated backend's stand-in for a host-to-device copy
        return _HOST_DATA if all_devices and copies_host_data(args[0]) else None
    if packet in _MASK_INDEXING and len(args) > 1:
        masks = [
            i
            for i in args[1]
            if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        ]
        if masks and (all_devices or args[0].device.type != "cpu"):
            return _MASK_INDEXING[packet]
        return None
    if packet in _COPY_OPERATIONS and not all_devices:
        at = 3 if func is aten.to.device else 2  # copy_(self, src, non_blocking), to(self, x, nb)
        if kwargs.get("non_blocking", False) or (
            packet is not aten._to_copy and len(args) > at and args[at]
        ):
            return None
        if packet is aten.copy_:
            target, source = args[0], args[1]
            target_is_cpu = isinstance(target, torch.Tensor) and target.device.type == "cpu"
        else:
            source, target = args[0], _copy_target(func, args, kwargs)
            target_is_cpu = target is not None and torch.device(target).type == "cpu"
        if target_is_cpu and isinstance(source, torch.Tensor) and source.device.type != "cpu":
            return "a blocking device-to-host copy (`.cpu()`, `.tolist()`, `.numpy()`, `print(t)`)"
    return None


def _copy_target(func, args: tuple, kwargs: dict) -> Any:
    """The device ``_to_copy`` or ``to`` copies to, or None (it stays on the source's)."""
    if func is aten.to.device:
        return args[1]
    if func is aten.to.other:
        return args[1].device
    return kwargs.get("device")


def mark_capture_failed(error: Exception) -> Exception:
    """Mark this thread's running capture as failed by ``error`` and return it to raise.

    The operation did not run, so the segment is missing it: code that catches the error
    inside the capture block (a library's ``except RuntimeError`` fallback) would otherwise
    have its fallback captured, and every replay would silently differ from eager. With the
    mark, the capture raises when the block ends (as after an eager function that raised)."""
    if state.capture is not None:
        state.capture.fail(f"{type(error).__name__} refused an operation in a segment ({error})")
    return error


class SegmentMode(TorchDispatchMode):
    """Watches (and optionally records) the aten operations of one captured segment.

    ``all_devices=True`` treats CPU tensors as device tensors: the emulated
    backend runs everything on the CPU and must flag ``.item()`` there too.
    ``on_operation(func, args, kwargs, out)`` is called after each operation ran.
    """

    def __init__(
        self,
        all_devices: bool = False,
        on_operation: Callable[[Any, tuple, dict, Any], None] | None = None,
        check_syncs: bool = True,
    ):
        super().__init__()
        self.all_devices = all_devices
        self.on_operation = on_operation
        self.check_syncs = check_syncs
        self.operations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and own_generator(generator, self.all_devices):
            raise mark_capture_failed(CaptureError(  # checked or not: CUDA refuses it either way
                f"breakgraph.capture: {func} draws from a torch.Generator of your own at "
                f"{user_frame()}, inside a captured segment. A CUDA graph advances only the "
                f"generators registered with it, and each segment registers the default CUDA "
                f'generator alone, so CUDA refuses this draw ("Attempt to increase offset for a '
                f'CUDA generator not in capture mode"). Leave generator= out (seed the default '
                f"generator with torch.manual_seed before the capture), or draw inside a function "
                f"decorated with @breakgraph.eager_on_graph."
            ))
        if self.check_syncs:
            reason = sync_reason(func, args, kwargs, self.all_devices)
            if reason is not None:
                frame = _user_stack_frame()
                target = f"`{frame.name}`" if frame is not None else "the function that contains it"
                raise mark_capture_failed(HostSyncError(
                    f"host synchronisation inside a captured segment: {func} ({reason}) at "
                    f"{user_frame()}. A CUDA graph runs no Python on replay, so this value would "
                    f"be frozen at capture time (and CUDA invalidates the capture). Decorate "
                    f"{target} (or a smaller function holding this code) with "
                    f"@breakgraph.eager_on_graph so it runs eagerly on every replay, or keep it on "
                    f"the device (for example torch.where(mask, a, b) instead of nonzero())."
                ))
        out = func(*args, **kwargs)
        self.operations += 1
        if self.on_operation is not None:
            self.on_operation(func, args, kwargs, out)
        return out


class CompileTransparentSegmentMode(SegmentMode):
    """A :class:`SegmentMode` under which ``torch.compile``'d code still runs compiled.

    Dynamo refuses to run compiled code while a dispatch mode is active unless the
    mode declares that it ignores compile internals. The CUDA backend only *watches*
    for host syncs, so compiled regions (which cannot contain a sync: Dynamo breaks
    its graph there and runs the sync eagerly, where this mode sees it) may run
    unobserved and get captured as compiled kernels. The emulated backend must see
    every operation to replay it, so it uses the plain :class:`SegmentMode` and
    compiled functions run eagerly inside emulated segments.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def exit_segment_mode(mode: SegmentMode, before: str | None = None) -> None:
    """Exit a segment's mode where the segment ends at a break (named by ``before``: the eager
    function, ``"break_graph"``) or at the end of the capture block (None). torch pops the *top*
    of the dispatch mode stack, so a mode the user entered inside the segment and has not left
    would be popped in its place: refused (the caller's ``abort`` still exits ``mode``)."""
    top = _get_current_dispatch_mode()
    if top is not mode:
        where = (
            f"at the break {before!r} (an @eager_on_graph call or break_graph())"
            if before is not None
            else "at the end of the capture block"
        )
        raise CaptureError(
            f"breakgraph.capture: a segment ends {where} inside {type(top).__name__}, a "
            f"TorchDispatchMode entered inside the capture block and not left yet. Each "
            f"segment is captured under a dispatch mode of breakgraph's, which must be left "
            f"where the segment ends, and torch leaves the newest mode first: yours. Enter your "
            f"mode around the `with breakgraph.capture(...)` block, or leave it before "
            f"{'the break' if before is not None else 'the block ends'}."
        )
    mode.__exit__(None, None, None)


def leave_segment_mode(mode: SegmentMode) -> None:
    """Take a failed segment's ``mode`` off the dispatch-mode stack (a backend's ``abort``),
    leaving the modes above it, which the user entered inside the block and has not left, on
    the stack in their order: torch pops the *top*, so exiting ``mode`` under a user's mode
    popped the user's instead, and left breakgraph's on the stack for good (the user's own
    ``__exit__`` then popped breakgraph's, and crashed the process on torch 2.10)."""
    with contextlib.ExitStack() as above:  # pushed back, in order, once ``mode`` is gone
        while (top := _get_current_dispatch_mode()) is not None and top is not mode:
            above.enter_context(_pop_mode_temporarily())
        if top is mode:
            mode.__exit__(None, None, None)
