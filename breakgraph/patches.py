"""Scoped patches: replace an attribute or a registry entry for a defined scope, restore it exactly.

Every process-wide or host-library replacement breakgraph makes goes through this module
(the complete list is the patch table in ``docs/design.md``):

* for the length of a capture (``streams.py`` hooks ``torch.cuda.Event.record``/``wait``;
  the emulated backend answers ``torch.cuda.is_current_stream_capturing``), registered on
  the capture session's ``contextlib.ExitStack`` with :func:`patch_attribute`;
* for the life of an integration handle (an instance attribute of one model, a method of a
  host-library class shared by every handle), held by a :class:`PatchSet`, or by a
  :class:`SharedPatches` that installs its set with the first user and removes it with
  the last.

Restoring is exact: an attribute that the owner did not hold itself (an inherited method, a
method looked up on the class) is deleted again rather than copied onto the owner, and an
attribute is restored only if it still holds breakgraph's value. If other code replaced it
meanwhile, theirs stays and a :class:`~breakgraph.BreakgraphWarning` says so. A restore that
raises (an interrupt in the middle of it, a ``KeyboardInterrupt`` during ``disable()``) does not
stop the others, and what it left is restored by the next call: a :class:`PatchSet` keeps the
failed step, a :class:`SharedPatches` keeps its set installed until the restore completes.

Example::

    >>> import contextlib, types
    >>> from breakgraph.patches import patch_attribute
    >>> box = types.SimpleNamespace(f=len)
    >>> with contextlib.ExitStack() as stack:
    ...     patch_attribute(stack, box, "f", abs)
    ...     box.f(-2)
    2
    >>> box.f is len
    True
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any

from .errors import BreakgraphWarning

__all__ = ["patch_attribute", "patch_item", "PatchSet", "SharedPatches"]

_ABSENT = object()


def patch_attribute(stack: contextlib.ExitStack, owner: Any, name: str, value: Any) -> None:
    """``owner.name = value`` until ``stack`` closes; then the original, if still ours.

    If ``owner`` did not hold ``name`` itself (an instance whose method comes from its
    class, a subclass inheriting it), the attribute is deleted on restore, so the owner
    ends exactly as it was.
    """
    own = _own_value(owner, name)
    setattr(owner, name, value)
    stack.callback(_restore_attribute, owner, name, value, own)


def patch_item(stack: contextlib.ExitStack, mapping: MutableMapping, key: Any, value: Any) -> None:
    """``mapping[key] = value`` until ``stack`` closes; then the original entry (or none).

    Example::

        >>> import contextlib
        >>> registry = {"a": 1}
        >>> with contextlib.ExitStack() as stack:
        ...     patch_item(stack, registry, "b", 2)
        ...     sorted(registry)
        ['a', 'b']
        >>> registry
        {'a': 1}
    """
    previous = mapping.get(key, _ABSENT)
    mapping[key] = value

    def restore() -> None:
        now = mapping.get(key, _ABSENT)
        if now is previous:  # restored already (a retry after an interrupt)
            return
        if now is not value:
            _warn_replaced(mapping, repr(key))
            return
        if previous is _ABSENT:
            del mapping[key]
        else:
            mapping[key] = previous

    stack.callback(restore)


class PatchSet:
    """Replacements with one scope, undone in reverse order by :meth:`restore` (or on exit).

    Example::

        >>> import types
        >>> from breakgraph.patches import PatchSet
        >>> box = types.SimpleNamespace(f=len)
        >>> with PatchSet() as patches:
        ...     patches.attribute(box, "f", abs)
        ...     box.f(-2)
        2
        >>> box.f is len
        True
    """

    def __init__(self) -> None:
        self._stack = _UndoSteps()
        # owner -> [(name, weak reference to the value, the owner's own value)]: weak patches
        self._weak: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def attribute(self, owner: Any, name: str, value: Any, *, weak: bool = False) -> None:
        """``owner.name = value`` until :meth:`restore` (see :func:`patch_attribute`).

        ``weak``: the set keeps neither ``owner`` nor ``value`` alive, for objects made while
        it lives (a manager per call of a long-lived handle): held strongly, each stayed in
        memory until :meth:`restore`. A collected owner has nothing left to restore; one still
        alive is restored as any other (after them). ``owner`` must be weak-referenceable; a
        ``value`` that cannot be (``True``, a number, a string) is held as it is.
        """
        if not weak:
            patch_attribute(self._stack, owner, name, value)
            return
        try:
            held = weakref.ref(value)
        except TypeError:  # a plain value keeps nothing else alive
            held = functools.partial(_same, value)
        own = _own_value(owner, name)
        setattr(owner, name, value)
        self._weak.setdefault(owner, []).append((name, held, own))

    def item(self, mapping: MutableMapping, key: Any, value: Any) -> None:
        """``mapping[key] = value`` until :meth:`restore` (see :func:`patch_item`)."""
        patch_item(self._stack, mapping, key, value)

    def restore(self) -> None:
        """Undo every replacement, last first (idempotent). A step that raises stays for the
        next call, after the others ran; the first error is raised."""
        failed = self._stack.run()
        for owner, entries in list(self._weak.items()):
            kept = []
            for name, value, own in reversed(entries):
                try:
                    _restore_attribute(owner, name, value(), own)
                except BaseException as error:  # noqa: BLE001 (raised below, after the rest)
                    kept.insert(0, (name, value, own))
                    failed = failed or error
            if kept:
                self._weak[owner] = kept
            else:
                del self._weak[owner]
        if failed is not None:
            raise failed

    def __enter__(self) -> PatchSet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def _same(value: Any) -> Any:
    """A strong stand-in for ``weakref.ref(value)()``."""
    return value


class SharedPatches:
    """A :class:`PatchSet` installed while at least one user holds it (reference counted).

    ``install(patches)`` makes the replacements on a fresh set when the first user calls
    :meth:`acquire`; the last :meth:`release` restores them. For replacements of a host
    library that every enabled model needs once (a class method shared by all of them).

    Example::

        >>> import types
        >>> from breakgraph.patches import SharedPatches
        >>> box = types.SimpleNamespace(f=len)
        >>> shared = SharedPatches(lambda patches: patches.attribute(box, "f", abs))
        >>> shared.acquire(); shared.acquire(); shared.release()
        >>> box.f is abs
        True
        >>> shared.release(); box.f is len
        True
    """

    def __init__(self, install: Callable[[PatchSet], None]) -> None:
        self._install = install
        self._lock = threading.Lock()
        self._users = 0
        self._patches: PatchSet | None = None
        self._late: list = []  # one entry per release_later() not yet counted

    @property
    def installed(self) -> bool:
        return self._patches is not None

    def acquire(self) -> None:
        with self._lock:
            self._count_late()
            if self._patches is None:
                patches = PatchSet()
                try:
                    self._install(patches)
                except BaseException:
                    patches.restore()
                    raise
                self._patches = patches
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._count_late()
            if self._users == 0:
                return
            self._users -= 1
            self._restore_if_unused()

    def release_later(self) -> None:
        """A release for a finalizer (a user collected without releasing): counted at the next
        :meth:`acquire` or :meth:`release`. Never restored from inside the collector, which may
        run on a thread that holds the lock, or between the two halves of an acquire."""
        self._late.append(None)  # atomic: no lock taken here

    def _count_late(self) -> None:
        while self._late:
            self._late.pop()
            self._users = max(self._users - 1, 0)
        self._restore_if_unused()

    def _restore_if_unused(self) -> None:
        if self._users == 0 and self._patches is not None:
            self._patches.restore()  # if it raises, the set stays for the next call to finish
            self._patches = None


class _UndoSteps:
    """The undo steps of a :class:`PatchSet`, with ``ExitStack``'s ``callback``: a step that
    raises is kept for the next :meth:`run` (an ``ExitStack`` drops it, and the patch stayed)."""

    def __init__(self) -> None:
        self._steps: list = []

    def callback(self, undo: Callable, *args: Any) -> None:
        self._steps.append((undo, args))

    def run(self) -> BaseException | None:
        """Run every step, last first; keep the ones that raised; return the first error."""
        failed, kept = None, []
        while self._steps:
            undo, args = self._steps.pop()
            try:
                undo(*args)
            except BaseException as error:  # noqa: BLE001 (returned, raised by the caller)
                kept.append((undo, args))
                failed = failed or error
        self._steps[:0] = reversed(kept)
        return failed


def _restore_attribute(owner: Any, name: str, value: Any, own: Any) -> None:
    """Put ``own`` back as ``owner.name`` (delete it where absent) if it still holds ``value``."""
    now = _own_value(owner, name)
    if now is own:  # restored already (a retry after an interrupt)
        return
    if now is not value:
        _warn_replaced(owner, name)
        return
    if own is _ABSENT:
        delattr(owner, name)
    else:
        setattr(owner, name, own)


def _own_value(owner: Any, name: str) -> Any:
    """What ``owner`` holds itself under ``name`` (not what it inherits), else ``_ABSENT``."""
    namespace = getattr(owner, "__dict__", None)
    if namespace is None:  # __slots__ objects: no inherited lookup to tell apart
        return getattr(owner, name, _ABSENT)
    if name not in namespace:  # an nn.Module holds its buffers, parameters and submodules apart
        for registry in ("_buffers", "_parameters", "_modules"):  # (setattr writes them there)
            held = namespace.get(registry)
            if isinstance(held, dict) and name in held:
                return held[name]
    return namespace.get(name, _ABSENT)


def _warn_replaced(owner: Any, name: str) -> None:
    where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None)
    where = where or type(owner).__name__
    warnings.warn(
        f"breakgraph: {where}.{name} was replaced by other code while breakgraph had patched "
        f"it; leaving the new value in place (breakgraph's patch is gone).",
        BreakgraphWarning,
        stacklevel=3,
    )
