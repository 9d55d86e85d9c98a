"""The static input buffers of a bucketed runner: spec, validation, copy-in, tail padding.

A graph reads its inputs from fixed addresses, so every call's inputs are copied into one
set of buffers per bucket. :class:`StaticInputs` owns what that takes, once for every
runner (:class:`~breakgraph.runner.BucketedRunner` builds one from its ``example_inputs``;
``PrefillRunner``'s step buffers are a subclass that keeps the buffers elsewhere):

* the spec of each input (dtype, device, shape, the bucketed dimension, the pad value),
  checked when the runner is built: a pad value the input's dtype cannot hold is refused;
* validation of live inputs against it before anything is copied: rank, dtype, device and
  every non-bucketed dimension must match, and a wrong shape never broadcasts;
* the copy-in, and the tail (the bucket's rows past the live size) written with the pad
  value on every call, so stale or NaN rows never linger.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from .errors import InputError

__all__ = ["StaticInputs"]


class StaticInputs:
    """The static input buffers of a runner: spec, validation, copy-in, tail padding.

    One tensor per input of the captured function; ``dims`` is the bucketed dimension
    of each, ``pad_values`` what its tail is filled with (a value the input's dtype holds:
    ``0.5`` for an integer input raises instead of padding with 0). ``allocate(size)``
    makes the buffers of a bucket; ``size_of(inputs)`` validates live inputs and returns
    their size along the bucketed dimension; ``fill(buffers, inputs, size)`` validates the
    same way (a wrong shape never broadcasts, a wrong dtype is never cast), then copies
    them in and writes the tail. Errors start with ``who``: the runner that holds the spec
    (``BucketedRunner`` passes its name), or ``StaticInputs`` for one built by hand.

    Example::

        >>> import torch
        >>> from breakgraph.runner import StaticInputs
        >>> spec = StaticInputs((torch.zeros(1, 2),), dims=0, pad_values=-1.0)
        >>> buffers = spec.allocate(4)
        >>> x = torch.ones(3, 2)
        >>> spec.fill(buffers, (x,), spec.size_of((x,)))
        >>> buffers[0][:, 0].tolist()
        [1.0, 1.0, 1.0, -1.0]
    """

    def __init__(
        self,
        example_inputs: Sequence[torch.Tensor],
        dims: int | Sequence[int] = 0,
        pad_values: float | Sequence[float] = 0,
        *,
        who: str = "StaticInputs",
    ):
        self.who = who  # what errors name: the runner that holds the spec, or this class
        if isinstance(example_inputs, torch.Tensor) or not isinstance(
            example_inputs, (tuple, list)
        ):
            raise InputError(
                f"{who}: example_inputs must be a tuple or list of tensors (one per input of "
                f"the captured function), got {type(example_inputs).__name__}; wrap one tensor "
                f"as (t,)."
            )
        examples = tuple(example_inputs)
        if not examples or not all(isinstance(t, torch.Tensor) for t in examples):
            raise InputError(f"{who}: example_inputs must be a non-empty sequence of tensors.")
        n = len(examples)
        dims = _per_input(dims, n, "dims", who)
        self.pads = _per_input(pad_values, n, "pad_values", who)
        for i, (t, d) in enumerate(zip(examples, dims)):
            if isinstance(d, bool) or not isinstance(d, int) or not -t.dim() <= d < t.dim():
                raise InputError(f"{who}: dims[{i}]={d!r} is out of range for a {t.dim()}-D input.")
        for i, (t, pad) in enumerate(zip(examples, self.pads)):
            _check_pad_value(pad, t.dtype, f"{who}: pad_values[{i}]")
        self.dims = tuple(d % t.dim() for t, d in zip(examples, dims))
        self.specs = tuple((t.dtype, t.device, tuple(t.shape)) for t in examples)

    @property
    def device(self) -> torch.device:
        return self.specs[0][1]

    def allocate(self, size: int) -> tuple:
        """The buffers of a bucket of ``size``, filled with the pad values."""
        with torch.inference_mode(False):  # writable by callers outside inference_mode too
            return tuple(
                torch.full(_with_dim(shape, d, size), pad, dtype=dtype, device=device)
                for (dtype, device, shape), d, pad in zip(self.specs, self.dims, self.pads)
            )

    def size_of(self, inputs: tuple) -> int:
        """Validate live inputs against the spec; their size along the bucketed dimension."""
        if len(inputs) != len(self.specs):
            raise InputError(
                f"{self.who}: expected {len(self.specs)} inputs, got {len(inputs)}. "
                "Nothing was copied."
            )
        size = None
        for i, (value, (dtype, device, shape), d) in enumerate(zip(inputs, self.specs, self.dims)):
            if not isinstance(value, torch.Tensor):
                raise InputError(
                    f"{self.who}: input {i} must be a tensor, got {type(value).__name__}. "
                    "Nothing was copied."
                )
            problem = None
            if value.dim() != len(shape):
                problem = f"{value.dim()} dimensions, expected {len(shape)}"
            elif value.dtype != dtype:
                problem = f"dtype {value.dtype}, expected {dtype}"
            elif value.device != device:
                problem = f"device {value.device}, expected {device}"
            elif any(value.shape[j] != shape[j] for j in range(len(shape)) if j != d):
                expected = list(_with_dim(shape, d, "N"))
                problem = (
                    f"shape {tuple(value.shape)}, expected {expected} "
                    f"(N is the bucketed dimension {d})"
                )
            elif size is not None and value.shape[d] != size:
                problem = f"bucketed size {value.shape[d]}, but input 0 has {size}"
            if problem is not None:
                raise InputError(f"{self.who}: input {i} has {problem}. Nothing was copied.")
            size = value.shape[d]
        if size == 0:
            raise InputError(
                f"{self.who}: inputs are empty along the bucketed dimension. Nothing was copied."
            )
        return size

    def fill(self, buffers: tuple, inputs: tuple, size: int) -> None:
        """Copy ``inputs`` into ``buffers`` (one bucket's, from :meth:`allocate`) and write the
        tail with the pad values. Validates first, as :meth:`size_of` does, and checks that
        ``size`` is the inputs' size and fits the buffers: ``InputError``, nothing copied."""
        held = self.size_of(inputs)
        if held != size:
            raise InputError(
                f"StaticInputs.fill: size={size}, but the inputs hold {held} along the bucketed "
                f"dimension (pass spec.size_of(inputs)). Nothing was copied."
            )
        self._check_buffers(buffers, size)
        self._copy_in(buffers, inputs, size)

    def _check_buffers(self, buffers: tuple, size: int) -> None:
        if len(buffers) != len(self.specs):
            raise InputError(
                f"StaticInputs.fill: {len(buffers)} buffers for {len(self.specs)} inputs."
            )
        for i, (buffer, (dtype, device, shape), d) in enumerate(
            zip(buffers, self.specs, self.dims)
        ):
            fits = (
                isinstance(buffer, torch.Tensor)
                and buffer.dtype == dtype
                and buffer.device == device
                and buffer.dim() == len(shape)
                and _with_dim(tuple(buffer.shape), d, size) == _with_dim(shape, d, size)
                and buffer.shape[d] >= size
            )
            if not fits:
                described = (
                    f"{tuple(buffer.shape)} {buffer.dtype} on {buffer.device}"
                    if isinstance(buffer, torch.Tensor)
                    else type(buffer).__name__
                )
                raise InputError(
                    f"StaticInputs.fill: buffer {i} ({described}) is not a bucket buffer of this "
                    f"spec for size {size} (use allocate(bucket), bucket >= size). Nothing was "
                    f"copied."
                )

    def _copy_in(self, buffers: tuple, inputs: tuple, size: int) -> None:
        """:meth:`fill` without the checks: inputs that :meth:`size_of` validated (``size``)
        and buffers of a bucket; the runner's per-call path. An input that requires grad is
        copied detached: autograd would otherwise record the copy in the buffer, which would
        then require grad and keep every earlier call's input alive through its history."""
        for buffer, value, d, pad in zip(buffers, inputs, self.dims, self.pads):
            if value.requires_grad:
                value = value.detach()
            bucket = buffer.shape[d]
            buffer.narrow(d, 0, size).copy_(value)
            if size < bucket:
                buffer.narrow(d, size, bucket - size).fill_(pad)


def _per_input(value: Any, n: int, name: str, who: str) -> tuple:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InputError(f"{who}: {name} has {len(value)} entries for {n} inputs.")
        return tuple(value)
    return (value,) * n


def _with_dim(shape: tuple, dim: int, size: Any) -> tuple:
    return tuple(size if j == dim else s for j, s in enumerate(shape))


def _check_pad_value(pad: Any, dtype: torch.dtype, where: str) -> None:
    """Refuse a pad value that ``dtype`` cannot hold: an integer or bool dtype must hold it
    exactly (``0.5`` would become 0), a floating dtype up to its rounding (no overflow to
    inf, no underflow to 0)."""
    if not isinstance(pad, numbers.Number):
        raise InputError(f"{where}: a pad value must be a number, got {pad!r}.")
    try:
        held = torch.full((), pad, dtype=dtype).item()
    except (RuntimeError, TypeError, OverflowError) as exc:
        raise InputError(f"{where}: {pad!r} does not fit {dtype} ({exc}).") from None
    if held == pad or (_is_nan(held) and _is_nan(pad) and not dtype.is_complex):
        return
    if dtype.is_floating_point or dtype.is_complex:
        eps = torch.finfo(dtype.to_real()).eps
        if _is_finite(held) and abs(held - pad) <= eps * abs(pad):
            return  # rounded to the dtype's precision, as every assignment of a float is
    raise InputError(
        f"{where}: {dtype} cannot hold the pad value {pad!r} (the tail would hold {held!r}); "
        f"pick a value of the input's dtype."
    )


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _is_finite(value: Any) -> bool:
    return not isinstance(value, (float, complex)) or (
        math.isfinite(value.real) and math.isfinite(value.imag)
    )
