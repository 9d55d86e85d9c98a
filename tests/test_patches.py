"""breakgraph.patches: every replacement is undone exactly, on every path, and a value that other
code put in meanwhile is left in place with a warning (the module's contract, docs/design.md)."""

import contextlib
import types

import pytest

from breakgraph.errors import BreakgraphWarning
from breakgraph.patches import PatchSet, SharedPatches, patch_attribute, patch_item


def test_an_item_is_restored_to_its_previous_value_or_removed():
    registry = {"kept": 1}
    with contextlib.ExitStack() as stack:
        patch_item(stack, registry, "kept", 2)
        patch_item(stack, registry, "new", 3)
        assert registry == {"kept": 2, "new": 3}
    assert registry == {"kept": 1}


def test_an_item_replaced_by_other_code_is_left_with_a_warning():
    registry = {"key": 1}
    with pytest.warns(BreakgraphWarning, match="'key' was replaced by other code"):
        with contextlib.ExitStack() as stack:
            patch_item(stack, registry, "key", 2)
            registry["key"] = 3
    assert registry == {"key": 3}


def test_an_attribute_replaced_by_other_code_is_left_with_a_warning():
    box = types.SimpleNamespace(f=len)
    with pytest.warns(BreakgraphWarning, match=r"\.f was replaced by other code"):
        with PatchSet() as patches:
            patches.attribute(box, "f", abs)
            box.f = min
    assert box.f is min


def test_an_inherited_method_is_deleted_again_not_copied_onto_the_subclass():
    class Base:
        def method(self):
            return "base"

    class Child(Base):
        pass

    with PatchSet() as patches:
        patches.attribute(Child, "method", lambda self: "patched")
        assert Child().method() == "patched"
    assert "method" not in Child.__dict__ and Child().method() == "base"


def test_a_module_buffer_is_restored_in_its_registry():
    """An ``nn.Module`` keeps its buffers in ``_buffers``, not its ``__dict__``, where the
    restore looked: a patched buffer (``setattr`` writes ``_buffers``) was taken for one that
    other code replaced, left patched with a warning. Now restored, and nothing lands in
    ``__dict__`` (an attribute there would shadow nothing and leave the buffer registered)."""
    import warnings

    import torch

    module, kept = torch.nn.Module(), torch.zeros(2)
    module.register_buffer("freq", kept, persistent=False)
    weight = module.weight = torch.nn.Parameter(torch.zeros(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with PatchSet() as patches:
            patches.attribute(module, "freq", torch.ones(2))
            patches.attribute(module, "weight", torch.nn.Parameter(torch.ones(1)))
            assert module.freq.sum() == 2 and module.weight.item() == 1
    assert module._buffers["freq"] is kept and module.weight is weight
    assert "freq" not in vars(module) and "weight" not in vars(module)


def test_a_slots_attribute_is_restored():
    class Slotted:
        __slots__ = ("value",)

    owner = Slotted()
    owner.value = 1
    with contextlib.ExitStack() as stack:
        patch_attribute(stack, owner, "value", 2)
        assert owner.value == 2
    assert owner.value == 1


def test_weak_patches_of_a_collected_owner_restore_nothing_and_others_as_usual():
    class Owner:
        pass

    gone, kept = Owner(), Owner()
    patches = PatchSet()
    patches.attribute(gone, "f", abs, weak=True)
    patches.attribute(kept, "f", abs, weak=True)
    del gone
    patches.restore()
    assert not hasattr(kept, "f")
    patches.restore()  # idempotent


def test_a_weak_patch_holds_a_value_that_cannot_be_weakly_referenced_and_restores_it():
    """``True`` (torch.compile's mark on a model) cannot be weakly referenced: held as it is,
    restored only while still the value set (the same object put back counts as ours)."""

    class Owner:
        pass

    owner, other = Owner(), Owner()
    other.mark = False
    patches = PatchSet()
    patches.attribute(owner, "mark", True, weak=True)
    patches.attribute(other, "mark", 7, weak=True)
    owner.mark = True  # torch.compile sets the same mark again
    patches.restore()
    assert not hasattr(owner, "mark") and other.mark is False


def test_a_shared_install_that_raises_leaves_nothing_installed():
    """The first acquire's install raised after one replacement: that one is undone, nobody
    holds the set, and a later release does not go below zero users."""
    box = types.SimpleNamespace(f=len, g=len)

    def install(patches):
        patches.attribute(box, "f", abs)
        raise RuntimeError("install failed")

    shared = SharedPatches(install)
    with pytest.raises(RuntimeError, match="install failed"):
        shared.acquire()
    assert box.f is len and not shared.installed
    shared.release()  # no user: nothing to do
    shared.release_later()
    ok = SharedPatches(lambda patches: patches.attribute(box, "g", abs))
    ok.acquire()
    ok.release_later()  # a user collected without releasing: counted at the next call
    ok.release()  # an extra release: still only the one user goes
    assert box.g is len and not ok.installed


class _Interrupted:
    """An owner whose next ``setattr`` of ``name`` after :meth:`arm` raises ``KeyboardInterrupt``:
    before the write, or with ``after`` once the value is written (the restore was done)."""

    def __init__(self, name, after=False):
        object.__setattr__(self, "_trap", None)
        object.__setattr__(self, "_when", (name, after))
        object.__setattr__(self, name, len)

    def arm(self):
        object.__setattr__(self, "_trap", self._when)

    def __setattr__(self, name, value):
        trap = self._trap
        if trap is not None and name == trap[0]:
            object.__setattr__(self, "_trap", None)
            if trap[1]:
                object.__setattr__(self, name, value)
            raise KeyboardInterrupt
        object.__setattr__(self, name, value)


@pytest.mark.parametrize("after", [False, True], ids=["before-the-write", "after-the-write"])
def test_an_interrupted_restore_undoes_the_others_and_finishes_on_the_next_call(after):
    """A ``KeyboardInterrupt`` inside one step of a restore (Ctrl-C during ``disable()``): the
    other steps still run, the interrupt is raised, and the next ``restore()`` finishes the
    interrupted step (an ``ExitStack`` had dropped it: that patch stayed for good), without a
    warning where the interrupt came after the value was back."""
    import warnings

    first, last = types.SimpleNamespace(f=len), types.SimpleNamespace(f=len)
    trapped = _Interrupted("f", after=after)
    weak_owner = _Interrupted("f", after=after)
    patches = PatchSet()
    patches.attribute(first, "f", abs)
    patches.attribute(trapped, "f", abs)
    patches.attribute(last, "f", abs)
    patches.attribute(weak_owner, "f", abs, weak=True)
    trapped.arm()
    weak_owner.arm()
    with pytest.raises(KeyboardInterrupt):
        patches.restore()
    assert first.f is len and last.f is len
    assert (trapped.f is len, weak_owner.f is len) == (after, after)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patches.restore()
    assert trapped.f is len and weak_owner.f is len
    patches.restore()  # idempotent


def test_an_interrupted_shared_restore_stays_installed_until_it_finishes():
    """The last release's restore interrupted: the set stays installed (so no acquire installs
    a second one over the half-restored first), the next call finishes it, and a later acquire
    installs afresh."""
    plain, trapped = types.SimpleNamespace(f=len), _Interrupted("f")

    def install(patches):
        patches.attribute(plain, "f", abs)
        patches.attribute(trapped, "f", abs)

    shared = SharedPatches(install)
    shared.acquire()
    trapped.arm()
    with pytest.raises(KeyboardInterrupt):
        shared.release()
    assert shared.installed and plain.f is len and trapped.f is abs
    shared.release()  # no user left: finishes the restore
    assert not shared.installed and trapped.f is len
    shared.acquire()
    assert plain.f is abs and trapped.f is abs
    shared.release()
    assert plain.f is len and trapped.f is len and not shared.installed
