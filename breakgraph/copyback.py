"""Copy-back: write an eager function's fresh results into its capture-time outputs.

Captured segments after an eager break read the tensors that the break returned
*at capture time* (their addresses are frozen in the graph). On replay the break
returns new tensors, so their values must be copied into those capture-time
tensors. ``Tensor.copy_`` silently broadcasts and casts, which turns a shape bug
into wrong numbers; this module refuses instead.

The plan is compiled once, at capture, into a tree of small closures that know
the exact structure to expect; replay only walks that tree (no reflection on the
captured side, no allocation). Supported structures: tensors, ``None`` and other
Python values, tuples, lists, namedtuples, dicts (``ModelOutput`` included),
dataclasses and plain objects with attributes.

Example::

    >>> import torch
    >>> from breakgraph.copyback import build_copy_back
    >>> out = (torch.zeros(2), {"k": torch.zeros(3)})
    >>> copy = build_copy_back(out, "my_fn")
    >>> copy((torch.ones(2), {"k": torch.full((3,), 2.0)}))
    >>> out[1]["k"].tolist()
    [2.0, 2.0, 2.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .errors import CopyBackError

__all__ = ["build_copy_back"]

Copier = Callable[[Any], None]


def build_copy_back(captured: Any, function: str, check_values: bool = True) -> Copier:
    """Compile a function that copies a new result into ``captured``, checking it first.

    ``function`` is the eager function's name, used in error messages. With
    ``check_values=False`` Python values (ints, strings, ...) that differ from the
    capture-time ones are accepted: use it when such values are only informational
    and no captured segment depends on them.
    """
    return _build(captured, "output", function, check_values)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _build(captured: Any, path: str, function: str, check: bool) -> Copier:
    if isinstance(captured, torch.Tensor):
        return _tensor_copier(captured, path, function)
    if isinstance(captured, tuple) and hasattr(captured, "_fields"):  # namedtuple
        names = captured._fields
        children = [_build(v, f"{path}.{n}", function, check) for n, v in zip(names, captured)]
        return _sequence_copier(type(captured), children, path, function)
    if isinstance(captured, (tuple, list)):
        children = [_build(v, f"{path}[{i}]", function, check) for i, v in enumerate(captured)]
        return _sequence_copier(type(captured), children, path, function)
    if isinstance(captured, Mapping):  # dict, OrderedDict, transformers ModelOutput
        keys = tuple(captured.keys())
        children = [_build(captured[k], f"{path}[{k!r}]", function, check) for k in keys]
        return _mapping_copier(type(captured), keys, children, path, function)
    if dataclasses.is_dataclass(captured) and not isinstance(captured, type):
        names = tuple(f.name for f in dataclasses.fields(captured))
        return _attribute_copier(captured, names, path, function, check)
    if _is_python_value(captured):
        return _value_copier(captured, path, function, check)
    if hasattr(captured, "__dict__"):
        return _attribute_copier(captured, tuple(vars(captured)), path, function, check)
    return _value_copier(captured, path, function, check)


def _is_python_value(value: Any) -> bool:
    return value is None or isinstance(
        value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
    )


def _tensor_copier(captured: torch.Tensor, path: str, function: str) -> Copier:
    shape, dtype, device = captured.shape, captured.dtype, captured.device
    copy_ = captured.copy_
    if captured.is_inference():  # captured under inference_mode: only writable inside it

        def copy_(new: torch.Tensor, _copy=captured.copy_) -> None:
            with torch.inference_mode():
                _copy(new)

    def copy_tensor(new: Any) -> None:
        if new is captured:  # in-place function: nothing to copy
            return
        if (
            not isinstance(new, torch.Tensor)
            or new.shape != shape
            or new.dtype != dtype
            or new.device != device
        ):
            raise _mismatch(function, path, captured, new)
        copy_(new)

    return copy_tensor


def _mismatch(function: str, path: str, captured: Any, new: Any) -> CopyBackError:
    if not isinstance(new, torch.Tensor):
        problem = "a changed structure"
    elif new.shape != captured.shape:
        problem = "a tensor of another shape"
    elif new.dtype != captured.dtype:
        problem = "a tensor of another dtype"
    else:
        problem = "a tensor on another device"
    return CopyBackError(function, path, problem, _describe(captured), _describe(new))


def _sequence_copier(kind: type, children: list, path: str, function: str) -> Copier:
    n = len(children)

    def copy_sequence(new: Any) -> None:
        if type(new) is not kind or len(new) != n:
            raise CopyBackError(
                function,
                path,
                "a changed structure",
                f"{kind.__name__} of length {n}",
                _describe_container(new),
            )
        for child, item in zip(children, new):
            child(item)

    return copy_sequence


def _mapping_copier(kind: type, keys: tuple, children: list, path: str, function: str) -> Copier:
    n = len(keys)
    pairs = tuple(zip(keys, children))

    def structure_error(new: Any) -> CopyBackError:
        return CopyBackError(
            function,
            path,
            "a changed structure",
            f"{kind.__name__} with keys {list(keys)}",
            _describe_container(new),
        )

    def copy_mapping(new: Any) -> None:
        if not isinstance(new, Mapping) or len(new) != n:
            raise structure_error(new)
        for key, child in pairs:
            try:
                value = new[key]
            except KeyError:
                raise structure_error(new) from None
            child(value)

    return copy_mapping


def _attribute_copier(captured: Any, names: tuple, path: str, function: str, check: bool) -> Copier:
    kind = type(captured)
    children = [_build(getattr(captured, n), f"{path}.{n}", function, check) for n in names]
    pairs = tuple(zip(names, children))

    def copy_attributes(new: Any) -> None:
        if type(new) is not kind:
            raise CopyBackError(
                function, path, "a changed structure", f"a {kind.__name__}", _describe(new)
            )
        for name, child in pairs:
            try:
                value = getattr(new, name)
            except AttributeError:
                raise CopyBackError(
                    function,
                    f"{path}.{name}",
                    "a changed structure",
                    "an attribute",
                    "no such attribute",
                ) from None
            child(value)

    return copy_attributes


def _value_copier(captured: Any, path: str, function: str, check: bool) -> Copier:
    if captured is None:

        def copy_none(new: Any) -> None:
            if new is not None:
                raise CopyBackError(function, path, "a changed structure", "None", _describe(new))

        return copy_none

    def copy_value(new: Any) -> None:
        if isinstance(new, torch.Tensor) or new is None:
            raise CopyBackError(
                function, path, "a changed structure", _describe(captured), _describe(new)
            )
        if check and not _same_value(captured, new):
            raise CopyBackError(
                function, path, "a changed Python value", _describe(captured), _describe(new)
            )

    return copy_value


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        if bool(a == b):
            return True
    except Exception:  # comparisons that do not produce a bool (arrays, ...)
        return False
    return isinstance(a, float) and isinstance(b, float) and a != a and b != b  # NaN == NaN


def _describe_container(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys {list(value.keys())}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of length {len(value)}"
    return _describe(value)
