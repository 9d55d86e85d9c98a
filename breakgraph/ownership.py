"""Which outputs of an eager call the graph owns: measured once, at capture.

Copy-back (:mod:`breakgraph.copyback`) writes a break's replay result into the tensors the
break returned at capture, and so may write only into memory that nothing but the graph
reads. Two kinds of memory are not the graph's:

* the storages of the call's **arguments** (:func:`storages_of`): an in-place function
  returns its argument, and segments read that memory as the argument too;
* the storages of outputs that something else **holds** (:func:`call_and_classify`): a
  dict of adapters, a global or module buffer, a cache, a list the function appends to.

Copy-back then requires such an output to be the very same memory on every replay. Both
answers are sets of storage addresses (:func:`storage_key`), computed right after the
capture-time call; nothing here runs on replay.

Example::

    >>> import torch
    >>> from breakgraph.ownership import call_and_classify, storage_key, storages_of
    >>> x, cache = torch.ones(2), {}
    >>> def remember(x):
    ...     cache["last"] = x * 2
    ...     return cache["last"], x + 1
    >>> (kept, fresh), held = call_and_classify(remember, (x,), {})
    >>> storage_key(kept) in held, storage_key(fresh) in held, storage_key(x) in storages_of(x)
    (True, False, True)
"""

from __future__ import annotations

import collections
import itertools
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from .errors import CaptureError
from .structure import StructureError, reachable_tensors, sparse_parts, split

__all__ = ["call_and_classify", "refuse_one_shot_iterators", "storages_of", "storage_key"]

#: iterators that the capture pass drains for good: a generator, ``map``, ``zip``, ``iter()``
#: of a container... (not files, ``itertools.count`` or other iterators meant to be read live)
ONE_SHOT_ITERATORS = (
    types.GeneratorType, map, filter, zip, enumerate, reversed, itertools.chain,
    itertools.islice, *{type(iter(c)) for c in ([], (), range(0), "", b"", set(), {})},
    type(iter({}.values())), type(iter({}.items())), type(reversed([])),
)  # fmt: skip


def refuse_one_shot_iterators(name: str, args: tuple, kwargs: dict) -> None:
    """Raise :class:`~breakgraph.CaptureError` for an argument of eager function ``name`` that is
    a one-shot iterator (:data:`ONE_SHOT_ITERATORS`). Replays call the function with its
    capture-time arguments, the very objects: the capture pass consumes such an iterator, and
    every replay then gets it exhausted. ``total(h for h in hs)`` replayed ``total`` of nothing,
    a silently different result (or a :class:`~breakgraph.CopyBackError` naming no cause).
    Checked at capture only, on the arguments as given (not inside containers)."""
    for where, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, ONE_SHOT_ITERATORS):
            what = f"argument {where}" if isinstance(where, int) else f"argument {where!r}"
            raise CaptureError(
                f"eager function {name!r}: {what} is a one-shot iterator "
                f"({type(value).__name__}). Replays call {name!r} with its capture-time "
                f"arguments, and the capture pass consumes the iterator, so every replay would "
                f"get it exhausted. Pass a list or tuple (list(...)), or build the iterator "
                f"inside the function."
            )


def storages_of(*values: Any) -> frozenset:
    """The storage addresses of every tensor inside ``values`` (an eager call's arguments).
    A sparse tensor, which has no storage of its own, counts by its indices and values: an
    eager function may take one (it is passed as it is on every replay) and return a view of
    its values, which is then its argument's memory."""
    return frozenset(
        storage_key(part) for t in reachable_tensors(values) for part in (sparse_parts(t) or (t,))
    )


def storage_key(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage: what the sets of this module hold."""
    return tensor.untyped_storage().data_ptr()


def call_and_classify(function: Callable, args: tuple, kwargs: dict) -> tuple[Any, frozenset]:
    """Call an eager function at capture; return its output and the storages it does not own.

    Copy-back may write only into memory that nothing but the graph will read. A storage
    of the output is *held elsewhere* when anything outside the returned structure holds
    it: a dict of adapters, a global buffer, a module attribute, the arguments, a list the
    function appends its result to, a cache holding the returned container. Counted right
    after the call, before any other code can take a view: the holders of each storage,
    tensor and container, minus those inside the output (the output's own views and their
    bases included). Anything unaccounted for makes the storage held elsewhere.

    Autograd counts like any other holder: a tensor it saved for backward (the output of
    ``sigmoid`` under grad mode, say) is held elsewhere, so a function that returns new
    tensors must run under ``torch.no_grad()`` or ``torch.inference_mode()`` (as the
    runners capture), or its first replay raises :class:`~breakgraph.CopyBackError`.
    Memory reached through a second storage object (``torch.from_numpy``, DLPack,
    ``breakgraph.memory.borrowed``) cannot be seen.

    Example::

        >>> import torch
        >>> from breakgraph.ownership import call_and_classify
        >>> weights = torch.ones(2)
        >>> output, held = call_and_classify(lambda x: (x * 2, weights), (torch.ones(2),), {})
        >>> [t.untyped_storage().data_ptr() in held for t in output]
        [False, True]
    """
    output = function(*args, **kwargs)
    try:
        held = _held_elsewhere(output)
    except StructureError:  # a reference cycle: build_copy_back names it
        held = frozenset()
    except NotImplementedError:  # a sparse output has no storage: build_copy_back refuses it
        if not any(sparse_parts(t) for t in reachable_tensors(output)):
            raise
        held = frozenset()
    return output, held


def _held_elsewhere(output: Any) -> frozenset:
    census = _Census(output)
    # measured first, while only census.nodes holds the nodes (and the two callers' names
    # hold the root), against two probe tensors held the same way: one alone, one that a
    # view holds from C++ (torch versions differ in what that adds to Python's count)
    references = [sys.getrefcount(node) for node in census.nodes]
    census.inner[id(output)] += _ARGUMENT_REFERENCES  # call_and_classify's `output`, passed here
    nodes, (held_probe, probe) = census.nodes[:-2], census.nodes[-2:]
    baseline, base_uses, base_storage = references[-1], _uses(probe), _holders(probe)
    kept_alive = references[-2] - baseline  # what a C++ holder adds to the Python count
    del held_probe, probe
    outside = set()  # ids of nodes that something outside the output holds
    tensors = collections.Counter()  # storage -> tensor nodes over it
    for node, count in zip(nodes, references):
        extra = count - baseline - census.inner[id(node)]
        if isinstance(node, torch.Tensor):
            uses = _uses(node) - base_uses  # C++ holders: views' bases, autograd, ...
            if uses > 0 or census.viewers[id(node)]:
                extra -= kept_alive
            if uses > census.viewers[id(node)]:
                outside.add(id(node))
            tensors[storage_key(node)] += 1
        if extra > 0:
            outside.add(id(node))
    held = set()
    for node in nodes:
        if not isinstance(node, torch.Tensor):
            continue
        key = storage_key(node)
        if key in held:
            continue
        impls, python = _holders(node)
        if (
            id(node) in outside
            or not census.above.get(id(node), set()).isdisjoint(outside)
            # tensors over it outside the output (a chain of views replayed by functions, as
            # conj().imag, keeps tensors no census sees: such an output counts as held)
            or impls - base_storage[0] > tensors[key] - 1
            or python > base_storage[1]  # a Python storage object held elsewhere
        ):
            held.add(key)
    return frozenset(held)


def _references_inside(value: Any) -> int:
    return sys.getrefcount(value) - 1  # less getrefcount's own argument


def _argument_references() -> int:
    """The references to a caller's local passed as an argument, counted inside the callee:
    the local and the parameter (2) on Python 3.11 and later; on 3.10 the caller's stack
    holds the argument during the call too (3). Measured, as the census measures the rest."""
    value = object()
    return _references_inside(value)


_ARGUMENT_REFERENCES = _argument_references()


def _uses(tensor: torch.Tensor) -> int:
    """How many hold the tensor itself (its Python object and C++: views, autograd); 0 on
    torch versions without ``Tensor._use_count`` (the storage count still sees views)."""
    use_count = getattr(tensor, "_use_count", None)
    return use_count() if use_count is not None else 0


def _holders(tensor: torch.Tensor) -> tuple[int, int]:
    """The holders of ``tensor``'s storage (tensors and storage objects) and the Python
    references to its storage object, compared against a probe measured the same way."""
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


def _holds_of(view: torch.Tensor, base: torch.Tensor) -> int:
    """How many times ``view`` holds ``base`` from C++: once for a strided view, more for a view
    torch replays by a function (``.real``, ``view_as_real``, ``conj()``). Measured by making
    the same view of a meta probe shaped like ``base`` (torch's own replay of the view,
    ``Tensor._view_func``); 1 where that cannot be made."""
    try:
        with torch.inference_mode(False):  # views of inference tensors hold no base
            probe = torch.empty_like(base, device="meta")
            before = _uses(probe)
            replica = view._view_func(probe)  # noqa: F841 (held while counting)
            return max(_uses(probe) - before, 1)
    except Exception:  # no _view_func on this torch, or a view meta tensors cannot make
        return 1


class _Census:
    """Every container and tensor of an output once (then the bases of its views, then two
    probe tensors), the references between them, and the containers above each tensor."""

    def __init__(self, output: Any):
        self.nodes: list = []
        self.seen: set = set()
        self.inner = collections.Counter()  # id -> references from containers in the output
        self.above: dict = {}  # tensor id -> ids of the containers above it
        self.viewers = collections.Counter()  # tensor id -> holds of it by views in the output
        self._visit(output, ())
        for index in range(len(self.nodes)):
            node = self.nodes[index]
            base = node._base if isinstance(node, torch.Tensor) else None
            # a view holds its base; a sparse base (the values of a CSR tensor) is left out: it
            # has no storage to count, and the tensor it holds over the view's storage (which
            # no census sees) already makes that storage held elsewhere
            if base is not None and not sparse_parts(base):
                self.viewers[id(base)] += _holds_of(node, base)
                self._add(base)
        with torch.inference_mode(False):  # views of inference tensors hold no base
            held_probe = torch.empty(2, device="cpu")
            self._probe_view = held_probe[:1]  # holds held_probe from C++
        self.nodes += [held_probe, torch.empty(1, device="cpu")]

    def _add(self, node: Any) -> bool:
        if id(node) in self.seen:
            return False
        self.seen.add(id(node))
        self.nodes.append(node)
        return True

    def _visit(self, value: Any, above: tuple) -> None:
        if isinstance(value, torch.Tensor):
            self._add(value)
            self.above.setdefault(id(value), set()).update(above)
            return
        parts = split(value)
        if parts is None:
            return
        if id(value) in above:
            raise StructureError("output", "a reference cycle")
        if self._add(value):
            references = list(parts.values)
            if parts.kind == "mapping" and hasattr(value, "__dict__"):
                references += vars(value).values()  # ModelOutput: keys are attributes too
            for item in references:
                self.inner[id(item)] += 1
        for item in parts.values:
            self._visit(item, above + (id(value),))
