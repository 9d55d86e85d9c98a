"""Copy-back: write an eager function's fresh results into its capture-time outputs.

Captured segments after an eager break read the tensors that the break returned
*at capture time* (their addresses are frozen in the graph). On replay the break
returns new tensors, so their values must be copied into those capture-time
tensors. ``Tensor.copy_`` silently broadcasts and casts, which turns a shape bug
into wrong numbers; this module refuses instead.

Two more ways a copy can silently corrupt, both refused:

* **The output is the function's own argument** (or shares its memory), the zero-copy
  pattern of in-place functions. Segments then read that memory as the argument *and*
  as the output; copying a new result into it would overwrite the argument. So such an
  output must be the same memory on every replay (in-place), never a new tensor.
* **The output's elements overlap** (an ``expand()``-ed view): nothing can be copied
  into it. Refused at capture.

The plan is compiled once, at capture, into a tree of small closures that know the
exact structure to expect (see :mod:`breakgraph.structure` for what is supported);
replay only walks that tree (no reflection, no allocation).

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

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .errors import CopyBackError
from .structure import Split, StructureError, describe, iter_tensors, split

__all__ = ["build_copy_back", "storages_of"]

Copier = Callable[[Any], None]


def storages_of(*values: Any) -> frozenset:
    """The storage addresses of every tensor inside ``values`` (an eager call's arguments)."""
    return frozenset(
        t.untyped_storage().data_ptr() for v in values for _, t in iter_tensors(v, "argument")
    )


def build_copy_back(
    captured: Any, function: str, check_values: bool = True, arguments: frozenset = frozenset()
) -> Copier:
    """Compile a function that copies a new result into ``captured``, checking it first.

    ``function`` is the eager function's name, used in error messages. ``arguments`` are
    the storages of its capture-time arguments (:func:`storages_of`): outputs in that
    memory must stay that memory on replay. With ``check_values=False`` Python values
    (ints, strings, ...) that differ from the capture-time ones are accepted: use it when
    such values are only informational and no captured segment depends on them.
    """
    try:
        return _build(captured, "output", function, check_values, arguments, set())
    except StructureError as exc:
        raise CopyBackError(
            function,
            exc.path,
            "a reference cycle",
            "a tree of containers",
            "a container that contains itself",
        ) from None


def _build(
    captured: Any, path: str, function: str, check: bool, arguments: frozenset, active: set
) -> Copier:
    if isinstance(captured, torch.Tensor):
        if captured.untyped_storage().data_ptr() in arguments:
            return _argument_copier(captured, path, function)
        return _tensor_copier(captured, path, function)
    parts = split(captured)
    if parts is None:
        return _value_copier(captured, path, function, check)
    if id(captured) in active:
        raise StructureError(path, "a reference cycle")
    active.add(id(captured))
    children = [
        _build(v, parts.label(path, k), function, check, arguments, active)
        for k, v in zip(parts.keys, parts.values)
    ]
    active.discard(id(captured))
    if parts.kind in ("sequence", "namedtuple"):
        return _sequence_copier(type(captured), children, path, function)
    if parts.kind == "mapping":
        return _mapping_copier(type(captured), parts.keys, children, path, function)
    return _attribute_copier(type(captured), parts, children, path, function)


def _tensor_copier(captured: torch.Tensor, path: str, function: str) -> Copier:
    if torch._debug_has_internal_overlap(captured) == 1:
        raise CopyBackError(
            function,
            path,
            "a tensor whose elements share memory (an expand()-ed or broadcast view)",
            describe(captured),
            "the same at capture",
            "Nothing can be copied into such a tensor on replay: return .contiguous() or "
            ".clone() of it instead.",
        )
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


def _argument_copier(captured: torch.Tensor, path: str, function: str) -> Copier:
    """The output is (a view of) an argument: on replay it must be that very memory again."""
    pointer, shape, stride = captured.data_ptr(), captured.shape, captured.stride()

    def same_memory(new: Any) -> None:
        if new is captured:
            return
        if (
            isinstance(new, torch.Tensor)
            and new.data_ptr() == pointer
            and new.shape == shape
            and new.stride() == stride
        ):
            return
        raise CopyBackError(
            function,
            path,
            "a new tensor where it returned (memory of) its own argument at capture",
            describe(captured),
            describe(new),
            "Segments read that memory as the argument too, so copying into it would overwrite "
            "the argument. Return the argument (updated in place) on every call, or a new tensor "
            "on every call, including at capture (e.g. `x.clone()`); a capture_stub that returns "
            "its argument stands for an in-place function: for one that returns new tensors, let "
            "the stub return new ones too (`torch.empty_like(x)`).",
        )

    return same_memory


def _mismatch(function: str, path: str, captured: Any, new: Any) -> CopyBackError:
    if not isinstance(new, torch.Tensor):
        problem = "a changed structure"
    elif new.shape != captured.shape:
        problem = "a tensor of another shape"
    elif new.dtype != captured.dtype:
        problem = "a tensor of another dtype"
    else:
        problem = "a tensor on another device"
    return CopyBackError(function, path, problem, describe(captured), describe(new))


def _sequence_copier(kind: type, children: list, path: str, function: str) -> Copier:
    n = len(children)

    def copy_sequence(new: Any) -> None:
        if type(new) is not kind or len(new) != n:
            raise CopyBackError(
                function,
                path,
                "a changed structure",
                f"{kind.__name__} of length {n}",
                describe(new),
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
            describe(new),
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


def _attribute_copier(kind: type, parts: Split, children: list, path: str, function: str) -> Copier:
    pairs = tuple(zip(parts.keys, children))

    def copy_attributes(new: Any) -> None:
        if type(new) is not kind:
            raise CopyBackError(
                function, path, "a changed structure", f"a {kind.__name__}", describe(new)
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
                raise CopyBackError(function, path, "a changed structure", "None", describe(new))

        return copy_none

    def copy_value(new: Any) -> None:
        if isinstance(new, torch.Tensor) or new is None:
            raise CopyBackError(
                function, path, "a changed structure", describe(captured), describe(new)
            )
        if check and not _same_value(captured, new):
            raise CopyBackError(
                function, path, "a changed Python value", describe(captured), describe(new)
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
