"""Copy-back: write an eager function's fresh results into its capture-time outputs.

Captured segments after an eager break read the tensors that the break returned
*at capture time* (their addresses are frozen in the graph). On replay the break
returns new tensors, so their values must be copied into those capture-time
tensors. ``Tensor.copy_`` silently broadcasts and casts, which turns a shape bug
into wrong numbers; this module refuses instead.

Copy-back writes only into memory the graph owns. Three ways a copy could silently
corrupt, all refused:

* **The output is memory that something else holds.** The function's own argument (the
  zero-copy pattern of in-place functions), a long-lived tensor (``ADAPTERS[name]``, a
  global buffer, a module buffer, a cache): segments read that memory as the graph's
  output, but its other holders read it too, so copying a new result into it would
  overwrite their values (adapter "a" would become adapter "b"). Such an output must be
  the same memory on every replay, never a different tensor.
  :func:`~breakgraph.ownership.call_and_classify` finds these outputs right after the
  capture-time call (see :mod:`breakgraph.ownership`).
* **Outputs that overlap each other** (share a byte: ``(y, y)``, ``(y, y[:2])``,
  ``(y, y.view(torch.int32))``) must overlap the same way on every replay; two independent
  tensors copied into one memory would leave the last copy in both. Outputs that only
  interleave (``y[0::2]``, ``y[1::2]``, or fields of two dtypes in one packed buffer) share
  nothing and are copied each on its own.
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

import collections
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .errors import CopyBackError
from .ownership import call_and_classify, storage_key, storages_of
from .structure import Split, StructureError, describe, iter_tensors, sparse_parts, split

# call_and_classify and storages_of live in breakgraph.ownership; re-exported here
__all__ = ["build_copy_back", "call_and_classify", "storages_of"]

Copier = Callable[[Any], None]


# ---------------------------------------------------------------------------------------
# Outputs that overlap each other (once, at capture)
# ---------------------------------------------------------------------------------------

# pieces (elements, for one dtype); larger tensors whose spans meet count as overlapping
_EXACT_OVERLAP_LIMIT = 1 << 20


def _overlap_groups(captured: Any, not_owned: frozenset, function: str) -> list:
    """Lists of ``(path, tensor)`` of owned outputs whose memory overlaps, first seen first.
    The first walk over the outputs: a sparse one is refused here."""
    by_storage = collections.defaultdict(list)
    for path, tensor in iter_tensors(captured, "output"):
        if sparse_parts(tensor):
            raise CopyBackError(
                function,
                path,
                f"a sparse tensor ({tensor.layout})",
                describe(tensor),
                "the same at capture",
                "Copy-back writes each replay's result into the memory of the capture-time "
                "output, which a sparse tensor does not keep (copy_ replaces its indices and "
                "values, and their number may change), so later segments would read stale "
                "memory. Return it densified (.to_dense()), or keep the sparse operation "
                "inside the eager function and return its dense result.",
            )
        if tensor.numel() and storage_key(tensor) not in not_owned:
            by_storage[storage_key(tensor)].append((path, tensor))
    groups = []
    for members in by_storage.values():
        if len(members) > 1:
            groups += _overlapping(members)
    return groups


def _overlapping(members: list) -> list:
    """The groups (of two or more) that ``members`` form, joined by pairwise overlap."""
    parent = list(range(len(members)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i in range(len(members)):
        for j in range(i):
            if _overlap(members[i][1], members[j][1]):
                parent[root(i)] = root(j)
    components = collections.defaultdict(list)
    for i, member in enumerate(members):
        components[root(i)].append(member)
    return [c for c in components.values() if len(c) > 1]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that ``t`` may touch."""
    size = t.element_size()
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * size, (last + 1) * size


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors over one storage share a byte (conservative when large).

    Sharing a byte is what makes two outputs one memory for copy-back: a copy into one then
    changes the other. Outputs of different dtypes can interleave without sharing one (a
    float32 and an int16 pair in each 8-byte record of one buffer): each can be copied alone,
    as for outputs of one dtype whose spans interleave (``y[0::2]``, ``y[1::2]``). Compared in
    units of the greatest common divisor of the two element sizes, at which every element of
    both begins: one unit per element for one dtype, a few for two."""
    (a_start, a_end), (b_start, b_end) = _span(a), _span(b)
    if a_end <= b_start or b_end <= a_start:
        return False
    unit = math.gcd(a.element_size(), b.element_size())
    length = max(a_end, b_end) // unit
    if (
        (a.numel() * a.element_size() + b.numel() * b.element_size()) // unit
        > _EXACT_OVERLAP_LIMIT
        or length > 16 * _EXACT_OVERLAP_LIMIT
    ):
        return True
    marks = torch.zeros(length, dtype=torch.bool, device="cpu")
    marks[_units(a, unit)] = True
    return bool(marks[_units(b, unit)].any())


def _units(t: torch.Tensor, unit: int) -> torch.Tensor:
    """The indices of the ``unit``-byte pieces of its storage that ``t``'s elements cover."""
    per = t.element_size() // unit
    index = torch.arange(_span(t)[1] // t.element_size(), device="cpu")
    elements = index.as_strided(t.shape, t.stride(), t.storage_offset())
    if per == 1:  # one dtype: the elements themselves (a view, nothing copied)
        return elements
    return (elements.unsqueeze(-1) * per + torch.arange(per, device="cpu")).flatten()


# ---------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------


def build_copy_back(
    captured: Any,
    function: str,
    check_values: bool = True,
    arguments: frozenset = frozenset(),
    held: frozenset = frozenset(),
) -> Copier:
    """Compile a function that copies a new result into ``captured``, checking it first.

    ``function`` is the eager function's name, used in error messages. ``arguments`` are
    the storages of its capture-time arguments (:func:`~breakgraph.ownership.storages_of`)
    and ``held`` those of its outputs that something else holds
    (:func:`~breakgraph.ownership.call_and_classify`): outputs in that
    memory must stay that very memory on replay. Owned outputs that overlap each other
    must overlap the same way on replay. With ``check_values=False`` Python values (ints,
    strings, ...) that differ from the capture-time ones are accepted: use it when such
    values are only informational and no captured segment depends on them.
    """
    try:
        members = {}  # path -> (slots of its group, index in the group)
        finishers = []
        for group in _overlap_groups(captured, arguments | held, function):
            slots = [None] * len(group)
            members.update({path: (slots, i) for i, (path, _) in enumerate(group)})
            finishers.append(_overlap_finisher(group, slots, function))
        plan = _Plan(function, check_values, arguments, held, members)
        tree = plan.build(captured, "output", set())
    except StructureError as exc:
        raise CopyBackError(
            function,
            exc.path,
            "a reference cycle",
            "a tree of containers",
            "a container that contains itself",
        ) from None
    if not finishers:  # the common case: nothing but the tree runs on replay
        return tree
    all_slots = list({id(slots): slots for slots, _ in members.values()}.values())

    def copy_with_overlaps(new: Any) -> None:
        try:
            tree(new)  # checks every slot, copies the outputs that overlap nothing
            for finish in finishers:  # checks the overlapping ones, then copies them
                finish()
        finally:
            for slots in all_slots:  # hold no replay result past the replay
                slots[:] = [None] * len(slots)

    return copy_with_overlaps


class _Plan:
    """What the tree needs while it is built: the error context and the memory rules."""

    def __init__(self, function, check, arguments, held, members):
        self.function, self.check = function, check
        self.arguments, self.held, self.members = arguments, held, members

    def build(self, captured: Any, path: str, active: set) -> Copier:
        function = self.function
        if isinstance(captured, torch.Tensor):
            key = storage_key(captured)
            # a zero-size output is no memory at all: segments read nothing from it, so any
            # empty tensor of its shape may replace it (a view of the argument at capture, a
            # new one on replay); only shape, dtype and device are checked
            if key in self.arguments and captured.numel():
                return _same_memory_copier(captured, path, function, _ARGUMENT)
            if key in self.held and captured.numel():
                return _same_memory_copier(captured, path, function, _HELD)
            if path in self.members:
                slots, index = self.members[path]
                return _member_copier(captured, path, function, slots, index)
            return _tensor_copier(captured, path, function)
        parts = split(captured)
        if parts is None:
            return _value_copier(captured, path, function, self.check)
        if id(captured) in active:
            raise StructureError(path, "a reference cycle")
        active.add(id(captured))
        children = [
            self.build(v, parts.label(path, k), active) for k, v in zip(parts.keys, parts.values)
        ]
        active.discard(id(captured))
        if parts.kind in ("sequence", "namedtuple"):
            return _sequence_copier(type(captured), children, path, function)
        if parts.kind == "mapping":
            return _mapping_copier(type(captured), parts.keys, children, path, function)
        return _attribute_copier(type(captured), parts, children, path, function)


def _writer(captured: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    """``captured.copy_``, made so that autograd never records it.

    A recorded copy would grow the captured output's history by a copy node and the new
    result's graph on every replay, without bound. It is recorded when the output requires grad
    (captured with grad on, from a parameter), or when a replay's result requires grad while
    grad mode is on, even if the output did not at capture (a parameter set to require grad
    after the capture). Breaks captured under ``no_grad`` replay under it (``graph.finish``), so
    an output that does not require grad, made with grad mode off (the runners' case), keeps
    the plain ``copy_``. Otherwise the copy goes into a detached alias of the output from a
    detached result: nothing autograd tracks takes part (the version counter, which autograd
    checks, is shared and still counts the write). Decided here, at capture: a replay pays at
    most one ``requires_grad`` test. An output made under inference mode is written in it (it
    is only writable there)."""
    if captured.is_inference():

        def copy_(new: torch.Tensor, _copy=captured.copy_) -> None:
            with torch.inference_mode():
                _copy(new)

        return copy_
    if not captured.requires_grad and not torch.is_grad_enabled():
        return captured.copy_

    untracked = captured.detach()

    def copy_untracked(new: torch.Tensor, _copy=untracked.copy_) -> None:
        _copy(new.detach() if new.requires_grad else new)

    return copy_untracked


def _refuse_internal_overlap(captured: torch.Tensor, path: str, function: str) -> None:
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


def _tensor_copier(captured: torch.Tensor, path: str, function: str) -> Copier:
    _refuse_internal_overlap(captured, path, function)
    shape, dtype, device = captured.shape, captured.dtype, captured.device
    copy_ = _writer(captured)

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


def _member_copier(
    captured: torch.Tensor, path: str, function: str, slots: list, index: int
) -> Copier:
    """An output that overlaps another: checked here, copied once its group is checked."""
    _refuse_internal_overlap(captured, path, function)
    shape, dtype, device = captured.shape, captured.dtype, captured.device

    def hold(new: Any) -> None:
        if new is not captured and (
            not isinstance(new, torch.Tensor)
            or new.shape != shape
            or new.dtype != dtype
            or new.device != device
        ):
            raise _mismatch(function, path, captured, new)
        slots[index] = new

    return hold


def _storage_start(t: torch.Tensor) -> int:
    return t.data_ptr() - t.storage_offset() * t.element_size()


def _overlap_finisher(group: list, slots: list, function: str) -> Callable[[], None]:
    """Checks that a group of overlapping outputs overlaps as at capture, then copies it."""
    (first_path, first), rest = group[0], group[1:]
    first_stride = first.stride()
    layouts = [  # (path, captured, byte offset from the first, stride, same layout as first)
        (
            path,
            t,
            t.data_ptr() - first.data_ptr(),
            t.stride(),
            t.data_ptr() == first.data_ptr() and t.stride() == first_stride,
        )
        for path, t in rest
    ]
    writers = [_writer(t) for _, t in group]
    captured = [t for _, t in group]

    def finish() -> None:
        new_first = slots[0]
        start = _storage_start(new_first)
        for i, (path, t, offset, stride, same) in enumerate(layouts, 1):
            new = slots[i]
            if same and new is new_first:  # (y, y) again
                continue
            if not (
                new.data_ptr() - new_first.data_ptr() == offset
                and new.stride() == stride
                and new_first.stride() == first_stride
                and _storage_start(new) == start
            ):
                raise CopyBackError(
                    function,
                    path,
                    f"a tensor that does not share memory with {first_path} as at capture",
                    f"{describe(t)} sharing memory with {first_path}",
                    describe(new),
                    f"Segments read {first_path} and {path} from one memory, so one copy "
                    f"cannot give them different values. Return outputs that share memory "
                    f"the same way on every call, or independent tensors on every call, "
                    f"including at capture (e.g. `(y, y.clone())` instead of `(y, y)`).",
                )
        for write, target, new in zip(writers, captured, slots):
            if new is not target:
                write(new)  # the shared elements receive the same values from each

    return finish


_ARGUMENT = (
    "a new tensor where it returned (memory of) its own argument at capture",
    "Segments read that memory as the argument too, so copying into it would overwrite "
    "the argument. Return the argument (updated in place) on every call, or a new tensor "
    "on every call, including at capture (e.g. `x.clone()`); a capture_stub that returns "
    "its argument stands for an in-place function: for one that returns new tensors, let "
    "the stub return new ones too (`torch.empty_like(x)`).",
)
_HELD = (
    "a different tensor where, at capture, it returned memory it does not own",
    "Something outside its result also holds that memory (a dict of adapters, a global or "
    "module buffer, a cache, the function itself), so copying the new result into it would "
    "overwrite it for them: breakgraph copies only into memory the graph owns. Return a new "
    "tensor on every call, including at capture (e.g. `weights[name].clone()`), or the very "
    "same tensor on every call. To choose among long-lived tensors per replay (adapters, "
    "buffers), use the chosen one inside the eager function and return the result, or copy "
    "it into one static buffer that the function returns every time.",
)
_AUTOGRAD = (
    " This output requires grad, and autograd may hold it for backward: capture inference "
    "code under torch.no_grad() or torch.inference_mode()."
)


def _same_memory_copier(captured: torch.Tensor, path: str, function: str, why: tuple) -> Copier:
    """The output is memory that something else holds: on replay it must be that memory.
    Anything else that is not even a tensor of its shape and dtype (None, a container, a part
    of it) is refused as a changed structure, shape or dtype, like any output's."""
    pointer, shape, stride, dtype = (
        captured.data_ptr(),
        captured.shape,
        captured.stride(),
        captured.dtype,
    )
    problem, fix = why
    if captured.requires_grad and why is _HELD:
        fix += _AUTOGRAD

    def same_memory(new: Any) -> None:
        if new is captured:
            return
        if (
            isinstance(new, torch.Tensor)
            and new.data_ptr() == pointer
            and new.shape == shape
            and new.stride() == stride
            and new.dtype == dtype
        ):
            return
        if (  # None, a container, another shape...: named as such, not as "a new tensor"
            not isinstance(new, torch.Tensor)
            or new.shape != shape
            or new.dtype != dtype
            or new.device != captured.device
        ):
            raise _mismatch(function, path, captured, new)
        raise CopyBackError(function, path, problem, describe(captured), describe(new), fix)

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
        shapes = getattr(a, "shape", None), getattr(b, "shape", None)
        if None not in shapes and shapes[0] != shapes[1]:
            return False
        equal = a == b
        if not isinstance(equal, bool) and hasattr(equal, "all"):  # arrays: element by element
            return bool((equal | ((a != a) & (b != b))).all())  # NaN equals NaN
        if bool(equal):
            return True
    except Exception:  # comparisons that produce no truth value
        return False
    return isinstance(a, float) and isinstance(b, float) and a != a and b != b  # NaN == NaN
