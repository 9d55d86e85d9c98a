"""What each CB manager an enabled model creates gets from its handle, until ``disable()``.

* ``_create_batch_processor`` (contract item 17): the original, then a wait until the buffer
  reset it issued has run (:func:`settle_after_reset`; the wait is the handle's ``_settle``).
* ``pause`` (transformers 5.18 on): the weights checked when it ends (:func:`watch_pause`).
* ``start``, once ``disable()`` destroyed the manager: :func:`retired_start` (raises).

Every wrapper holds its manager weakly: held, every manager made while enabled (one per
``generate_batch``) stayed in memory until ``disable()``.

**The pause.** transformers' ``ContinuousBatchingManager.pause()`` holds a manager's
generation loop so that the calling thread can change the model ("typically to update it in
place"); the loop then goes on with the same cache and requests. breakgraph's graphs read the
weights' memory as it was at capture: weights copied in place (``param.copy_(new)``,
``load_state_dict``) are served, but a parameter replaced during the pause
(``module.weight = Parameter(...)``, ``load_state_dict(..., assign=True)``, ``model.to(...)``)
was never read again, and every step after the pause replayed the old weights, silently. On
leaving a pause, before the loop goes on, the weights are now compared with the capture's
(:class:`PauseWatch`: one read per parameter, once per pause, never per step). Where one
moved, the pause raises ``ReplayError`` naming it, and from then on the model's steps with
graphs raise it too (their requests fail with it) until the weights are back where the
graphs read them; steps of managers without graphs go on, and the pause of such a manager
raises nothing (its steps serve the new weights: :meth:`PauseWatch.note`).

Example (what the handle does for each manager it creates)::

    settle_after_reset(patches, manager, device, settle)
    watch = PauseWatch(handle._check_weights)    # raises ReplayError where a weight moved
    watch_pause(patches, manager, watch.leave if graphs else watch.note)  # eager: no raise
    if watch.moved is not None:                  # per step: one attribute read
        watch.refuse(step_is_eager)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from breakgraph.errors import ReplayError
from breakgraph.memory import weak_method
from breakgraph.patches import PatchSet

from . import compat

__all__ = ["PauseWatch", "retired_start", "settle_after_reset", "watch_pause"]


def settle_after_reset(patches: PatchSet, manager: Any, device: torch.device,
                       settle: Callable[[torch.device], None]) -> None:  # fmt: skip
    """``manager._create_batch_processor`` (contract item 17), for this manager only: the
    original, then ``settle(device)``."""
    create = compat.batch_processor_factory()
    if create is None:
        return
    owner = weakref.ref(manager)

    def _create_batch_processor(*args, **kwargs):
        processor = create(owner(), *args, **kwargs)
        settle(device)
        return processor

    _create_batch_processor.__wrapped__ = create
    patches.attribute(manager, "_create_batch_processor", _create_batch_processor, weak=True)


def retired_start(*args: Any, **kwargs: Any) -> None:
    """``start`` of a manager that ``disable()`` destroyed (its cache was built for
    breakgraph's attention key)."""
    raise ReplayError(
        "this continuous-batching manager was created while breakgraph's continuous batching "
        "was enabled and was destroyed by handle.disable(); create a new manager with "
        "model.init_continuous_batching()."
    )


class PauseWatch:
    """Whether a pause saw the weights moved from where the graphs read them.

    ``check`` (a bound method, held weakly: the handle holds its watch) raises
    :class:`~breakgraph.errors.ReplayError` where a weight moved, and returns where none did;
    ``moved`` is that error, or None."""

    __slots__ = ("check", "moved")

    def __init__(self, check: Callable[[], None]) -> None:
        self.check, self.moved = weak_method(check), None

    def leave(self) -> ReplayError | None:
        """On leaving a pause: the weights checked; the error to raise, or None."""
        try:
            self.check()
        except ReplayError as error:
            self.moved = error
            return error
        self.moved = None
        return None

    def note(self) -> None:
        """On leaving the pause of a manager without graphs (``use_cuda_graph=False``): the
        weights checked as :meth:`leave` does, for the model's steps with graphs (``moved``),
        and nothing raised. That manager's own steps are eager and serve the new weights, as
        its creation checks nothing; its pause raised ``ReplayError`` for a sound change."""
        self.leave()

    def refuse(self, eager: Callable[[], bool]) -> None:
        """A step after a pause that saw a weight moved (the caller read ``moved``): raises,
        unless the step runs eagerly (``eager()``) or the weights are back."""
        if not eager() and self.leave() is not None:
            raise ReplayError(str(self.moved))


def watch_pause(patches: PatchSet, manager: Any, leave: Callable[[], Any]) -> None:
    """``manager.pause`` (where the release has it) for this manager only, until ``patches``
    are restored: the original, and on leaving it, still paused, ``leave()``, whose error is
    raised (not where the block raised: its own error goes on)."""
    original = getattr(type(manager), "pause", None)
    if not callable(original):  # before transformers 5.18: no pause
        return
    owner = weakref.ref(manager)

    @contextlib.contextmanager
    def pause(*args: Any, **kwargs: Any):
        with original(owner(), *args, **kwargs):
            try:
                yield
            finally:
                error = leave()
            if error is not None:
                raise error

    pause.__wrapped__ = original
    patches.attribute(manager, "pause", pause, weak=True)
