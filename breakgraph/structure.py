"""One walker for the Python structures that hold tensors.

Copy-back (an eager function's output), the runner (trimming and owning outputs) and
``breakgraph.testing`` (comparing replay with eager) all look inside the same
structures, so they share this module and support exactly the same set:

* leaves: tensors and plain Python values (``None``, numbers, strings, dtypes, enum
  members, classes, ...);
* tuples, lists and namedtuples;
* mappings (``dict``, ``OrderedDict``, transformers' ``ModelOutput``);
* dataclasses, and plain objects with a ``__dict__`` and/or ``__slots__``.

Anything else is a leaf compared by value. A container that contains itself (a
reference cycle) raises :class:`StructureError`, except in :func:`reachable_tensors`,
which only looks for the tensors an eager function's arguments reach (an argument may hold
a logger or a parent pointer).

Example::

    >>> import torch
    >>> from breakgraph.structure import map_tensors
    >>> map_tensors(lambda t: t * 2, {"a": (torch.ones(1), "note")})
    {'a': (tensor([2.]), 'note')}
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

from .errors import BreakgraphError

__all__ = [
    "Split",
    "split",
    "map_tensors",
    "iter_tensors",
    "reachable_tensors",
    "is_leaf_value",
    "describe",
    "sparse_parts",
    "storage_address",
]

_LEAF_TYPES = (
    bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum, type,
)  # fmt: skip


_PLAIN_SEQUENCES = (list, tuple)


class StructureError(BreakgraphError, ValueError):
    """A structure breakgraph cannot walk (a reference cycle); ``path`` says where."""

    def __init__(self, path: str, problem: str):
        self.path = path
        super().__init__(f"{problem} at {path}")


class Split(NamedTuple):
    """A container taken apart: ``kind``, its ``keys`` and ``values``, and how to label a key.

    ``kind`` is one of ``"sequence"``, ``"namedtuple"``, ``"mapping"``, ``"attributes"``
    (dataclasses and plain objects).
    """

    kind: str
    keys: tuple
    values: tuple

    def label(self, path: str, key: Any) -> str:
        """The path of child ``key``: ``out[1]``, ``out['k']`` or ``out.name``."""
        if self.kind == "sequence":
            return f"{path}[{key}]"
        if self.kind == "mapping":
            return f"{path}[{key!r}]"
        return f"{path}.{key}"


def is_leaf_value(value: Any) -> bool:
    """Plain Python values: compared by equality, never looked into."""
    return value is None or isinstance(value, _LEAF_TYPES)


def split(value: Any) -> Split | None:
    """Take a container apart, or return None for a leaf (tensor, Python value, other)."""
    if isinstance(value, torch.Tensor) or is_leaf_value(value):
        return None
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return Split("namedtuple", tuple(value._fields), tuple(value))
    if isinstance(value, (tuple, list)):
        return Split("sequence", tuple(range(len(value))), tuple(value))
    if isinstance(value, Mapping):  # before dataclasses: ModelOutput is both
        keys = tuple(value.keys())
        return Split("mapping", keys, tuple(value[k] for k in keys))
    names = _attribute_names(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # the fields in their order, then what else the object holds (set in __post_init__)
        fields = tuple(f.name for f in dataclasses.fields(value) if hasattr(value, f.name))
        names = fields + tuple(n for n in names or () if n not in fields)
    if names is None:
        return None
    return Split("attributes", names, tuple(getattr(value, n) for n in names))


def _attribute_names(value: Any) -> tuple | None:
    """Instance attributes: ``__dict__`` entries, then every set ``__slots__`` entry."""
    slots = _slot_names(type(value))
    if not hasattr(value, "__dict__") and not slots:
        return None
    names = list(vars(value)) if hasattr(value, "__dict__") else []
    names += [s for s in slots if s not in names and hasattr(value, s)]
    return tuple(names)


@functools.cache
def _slot_names(cls: type) -> tuple:
    """Every slot's attribute name; a private one (``__h``) as Python stores it (``_Cls__h``)."""
    names = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        slots = (slots,) if isinstance(slots, str) else slots
        owner = klass.__name__.lstrip("_")
        names += [
            f"_{owner}{s}" if s.startswith("__") and not s.endswith("__") and owner else s
            for s in slots
            if s not in ("__dict__", "__weakref__")
        ]
    return tuple(names)


def rebuild(value: Any, parts: Split, values: list) -> Any:
    """A new container like ``value`` holding ``values`` in place of ``parts.values``."""
    if parts.kind == "namedtuple":
        return type(value)(*values)
    if parts.kind == "sequence":
        new = type(value)(values)
        if type(value) not in _PLAIN_SEQUENCES and hasattr(value, "__dict__"):
            new.__dict__.update(vars(value))  # a subclass's own attributes: dropped before
        return new
    new = copy.copy(value)
    if parts.kind == "mapping":
        for key, item in zip(parts.keys, values):
            new[key] = item
    else:
        for name, item in zip(parts.keys, values):
            object.__setattr__(new, name, item)
    return new


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any, path: str = "output") -> Any:
    """``value`` with every tensor replaced by ``fn(tensor)``; containers are rebuilt."""
    return _map(fn, value, path, set())


def _map(fn: Callable, value: Any, path: str, active: set) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    parts = split(value)
    if parts is None:
        return value
    with _entered(value, path, active):
        values = [
            _map(fn, v, parts.label(path, k), active) for k, v in zip(parts.keys, parts.values)
        ]
    try:
        return rebuild(value, parts, values)
    except Exception as exc:  # a constructor that takes more than the items, a read-only mapping
        raise StructureError(
            path,
            f"a {type(value).__name__} cannot be rebuilt to hold the new tensors "
            f"({type(exc).__name__}: {exc}); return a plain tuple, list, dict or dataclass "
            f"instead (a runner rebuilds nothing with slice_outputs=False and owned=False), found",
        ) from exc


def iter_tensors(value: Any, path: str = "output") -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``(path, tensor)`` inside ``value``, depth first."""
    yield from _iter(value, path, set())


def _iter(value: Any, path: str, active: set) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    parts = split(value)
    if parts is None:
        return
    with _entered(value, path, active):
        for key, item in zip(parts.keys, parts.values):
            yield from _iter(item, parts.label(path, key), active)


def reachable_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor ``value`` reaches, each container visited once: a container seen before (a
    reference cycle, a back-reference, a shared child) is skipped, not an error. For the
    arguments of an eager function, which may hold anything.

    Example::

        >>> import torch
        >>> from breakgraph.structure import reachable_tensors
        >>> node = {"weight": torch.ones(1)}
        >>> node["parent"] = node  # a back-reference: iter_tensors would raise
        >>> [t.tolist() for t in reachable_tensors([node, node])]
        [[1.0]]
    """
    seen, stack = set(), [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if id(item) not in seen:
                seen.add(id(item))
                yield item
            continue
        parts = split(item)
        if parts is None or id(item) in seen:
            continue
        seen.add(id(item))
        stack.extend(reversed(parts.values))


class _entered:
    """Marks a container as being walked; entering it again is a reference cycle."""

    __slots__ = ("key", "active")

    def __init__(self, value: Any, path: str, active: set):
        self.key, self.active = id(value), active
        if self.key in active:
            raise StructureError(path, "a reference cycle (a container that contains itself)")
        active.add(self.key)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        self.active.discard(self.key)


def sparse_parts(tensor: torch.Tensor) -> tuple:
    """The dense tensors that hold a sparse tensor's memory (indices and values); ``()`` for
    any other tensor. A sparse tensor has no storage of its own, so whatever judges memory
    (which storages an eager call's arguments hold, debug mode's watch) judges these.

    Example::

        >>> import torch
        >>> [tuple(p.shape) for p in sparse_parts(torch.eye(3).to_sparse())]
        [(2, 3), (3,)]
    """
    layout = tensor.layout
    if layout is torch.strided:  # nearly every tensor
        return ()
    if layout is torch.sparse_coo:
        return tensor._indices(), tensor._values()
    if layout is torch.sparse_csr or layout is torch.sparse_bsr:
        return tensor.crow_indices(), tensor.col_indices(), tensor.values()
    if layout is torch.sparse_csc or layout is torch.sparse_bsc:
        return tensor.ccol_indices(), tensor.row_indices(), tensor.values()
    return ()


def storage_address(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage, what the judges of memory key on (debug mode's
    watch, the emulated backend's recording); 0 for a tensor without one: a sparse tensor
    (judge its :func:`sparse_parts`) or a wrapper subclass (its inner tensor is seen), such as
    a functional collective's ``AsyncCollectiveTensor``.

    Example::

        >>> import torch
        >>> x = torch.zeros(4)
        >>> storage_address(x[1:]) == storage_address(x), storage_address(x.to_sparse())
        (True, 0)
    """
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:  # NotImplementedError (a sparse tensor) is one too
        return 0


def describe(value: Any) -> str:
    """A short description for error messages: shape/dtype/device of tensors, else a repr."""
    if isinstance(value, torch.Tensor):
        layout = "" if value.layout is torch.strided else f", layout={value.layout}"
        return (
            f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device}"
            f"{layout})"
        )
    parts = split(value)
    if parts is not None and parts.kind == "mapping":
        return f"{type(value).__name__} with keys {list(parts.keys)}"
    if parts is not None and parts.kind in ("sequence", "namedtuple"):
        return f"{type(value).__name__} of length {len(parts.keys)}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"
