"""Digests that every rank computes alike: what :class:`breakgraph.distributed.RankGroup`
compares across ranks to find that they were given the same inputs and settings.

A rank cannot send its inputs to the others on every call (that would cost what the call
costs), so each sends a 62-bit digest (:func:`fingerprint`) and the group checks that they
are equal. Settings are digested as the plain Python values they equal (:func:`plain_setting`),
so equal settings of different types (``np.int64(16)`` and ``16``) agree.

Example::

    >>> from breakgraph.fingerprints import fingerprint, plain_setting
    >>> fingerprint(plain_setting((16, 32))) == fingerprint(plain_setting([16.0, 32]))
    True
"""

from __future__ import annotations

import hashlib
import numbers
from typing import Any

import torch

__all__ = ["fingerprint", "plain_setting"]

_MASK = (1 << 62) - 1  # fingerprints stay positive and can be negated in int64


def fingerprint(*parts: Any) -> int:
    """A 62-bit digest of ints, strings, sequences and tensors, equal in every process.

    Tensors count by dtype, shape and values (copied to the host). Python's ``hash`` of
    strings differs between processes, so this uses BLAKE2b.

    Example::

        >>> import torch
        >>> fingerprint([3, 5], torch.arange(4)) == fingerprint([3, 5], torch.arange(4))
        True
        >>> fingerprint([3, 5]) == fingerprint([5, 3])
        False
    """
    digest = hashlib.blake2b(digest_size=8)
    _digest_into(digest, parts)
    return int.from_bytes(digest.digest(), "little") & _MASK


def _digest_into(digest: Any, part: Any) -> None:
    """Feed ``part`` to ``digest``: tensors and numpy arrays by dtype, shape and every value,
    wherever they are in lists, tuples and dicts (``repr`` would round values, elide long
    tensors and name the device and autograd state), other values by ``repr``. Each container
    is tagged with its kind and length, so ``[[1], 2]`` and ``[1, [2]]`` differ."""
    if isinstance(part, torch.Tensor):
        data = part.detach().to("cpu").contiguous()
        digest.update(f"tensor{data.dtype}{tuple(data.shape)}".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif type(part).__module__ == "numpy" and hasattr(part, "tobytes"):  # arrays, scalars
        digest.update(f"numpy{part.dtype}{getattr(part, 'shape', ())}".encode())
        digest.update(part.tobytes())
    elif isinstance(part, (list, tuple)):
        digest.update(f"{type(part).__name__}[{len(part)}]".encode())
        for item in part:
            _digest_into(digest, item)
    elif isinstance(part, dict):
        digest.update(f"dict[{len(part)}]".encode())
        for key, value in part.items():
            _digest_into(digest, key)
            _digest_into(digest, value)
    else:
        digest.update(f"{repr(part)};".encode())


def plain_setting(value: Any) -> Any:
    """``value`` as the plain Python value it equals, for ``RankGroup.agree_settings``: equal
    settings must agree whatever their type, and a fingerprint tells ``np.int64(16)``
    from ``16`` (dtype and bytes) and ``(16, 32)`` from ``[16, 32]``. Numpy scalars become
    Python's (``.item()``), ints ``int``, a float that holds an int that int (``16.0 == 16``),
    bools stay bools (``True`` is a flag, not ``1``), sequences lists, dict values likewise.

    Example::

        >>> import numpy as np
        >>> plain_setting((np.int64(16), np.float32(0.5), np.bool_(True), 2.0))
        [16, 0.5, True, 2]
    """
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()  # a numpy scalar: its Python number or bool
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return int(value) if value.is_integer() else value
    if isinstance(value, (list, tuple)):
        return [plain_setting(item) for item in value]
    if isinstance(value, dict):
        return {key: plain_setting(item) for key, item in value.items()}
    return value
