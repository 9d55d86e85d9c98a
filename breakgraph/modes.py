"""The modes an eager break replays under: its capture's grad mode and autocast, not the caller's.

A captured segment replays the kernels it recorded, whatever modes the caller has. An eager break
runs Python again on every replay, so the modes active then decide what it computes. Its
capture-time result fixed the dtypes and the autograd state that later segments read, so each
break replays under the modes it was captured under:

* **grad mode**: a break captured under ``no_grad`` replays under it (a break captured under
  ``inference_mode`` replays under that, see :meth:`graph._Capture._run_eagerly`); one
  captured with grad on runs in the caller's mode (its copy-back is never recorded);
* **autocast**: a break captured without autocast replays without it, and one captured under
  ``torch.autocast`` replays under the same autocast. Before, a graph captured in fp32 and
  replayed inside ``torch.autocast("cuda", torch.bfloat16)`` (an inference server's usual
  wrapper) had its breaks return bf16, and the replay raised ``CopyBackError`` for a dtype the
  function never chose; a break that cast its result back (``.float()``) silently computed in
  bf16 where the capture computed in fp32.

The common graph, every break captured with grad off and autocast off, pays one check of each
per replay (:meth:`graph.BreakableCUDAGraph.replay`); one whose breaks share an autocast enters
it once per replay, where the caller's differs; other graphs wrap their breaks one by one.
(That one check is whether any autocast is on: a caller with every autocast off but a dtype set
other than the default, ``torch.set_autocast_dtype``, leaves its dtype to such a graph's breaks.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

__all__ = ["any_autocast", "autocast_as", "autocast_now", "break_modes", "pin_modes"]

#: the devices whose autocast a break's modes record (breakgraph runs on CUDA and, emulated, CPU)
AUTOCAST_DEVICES = ("cuda", "cpu")

#: torch's default autocast dtype of each device: the one a break captured without autocast saw
#: (unless the process changed it), which ``torch.autocast(device)`` without a dtype takes
DEFAULT_DTYPES = {"cuda": torch.float16, "cpu": torch.bfloat16}

#: one C call (about 0.1 us): is any device's autocast on?
any_autocast = torch._C._is_any_autocast_enabled


def break_modes(function: Callable | None) -> tuple[str, tuple | None]:
    """A break's modes as its capture-time call ran: its grad mode (``"no_grad"``, ``"grad"``, or
    ``""`` where it is moot: an empty break, or one under ``inference_mode``, which replays
    under that) and its autocast (:func:`autocast_now`)."""
    moot = function is None or torch.is_inference_mode_enabled()
    grad = "" if moot else "grad" if torch.is_grad_enabled() else "no_grad"
    return grad, (autocast_now() if function is not None else None)


def autocast_now() -> tuple | None:
    """The autocast state now, as :func:`autocast_as` takes it: None when every device of
    :data:`AUTOCAST_DEVICES` has autocast off with its default dtype (the common case), else
    ``((device, enabled, dtype), ...)`` over them. The dtype counts also where autocast is off:
    a break that enters ``torch.autocast(device)`` without a dtype takes it (a model that turns
    autocast off with ``torch.autocast(enabled=False)`` inside an fp16 autocast keeps fp16)."""
    states = tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                   for device in AUTOCAST_DEVICES)  # fmt: skip
    if any(enabled or dtype != DEFAULT_DTYPES[device] for device, enabled, dtype in states):
        return states
    return None


#: :func:`autocast_now` when it returns None: every device off, with its default dtype
AUTOCAST_OFF = tuple((device, False, DEFAULT_DTYPES[device]) for device in AUTOCAST_DEVICES)


def autocast_as(captured: tuple | None) -> contextlib.ExitStack:
    """A context with autocast as ``captured`` (:func:`autocast_now`; None: off) on
    :data:`AUTOCAST_DEVICES`, each device's dtype included. ``torch.autocast(enabled=False)``,
    not ``torch._C._DisableAutocast``: that one hides autocast from the dispatcher, so an
    autocast that the break itself enters would not apply. The dtype is set also where autocast
    is off: with ``enabled=False`` alone ``torch.get_autocast_dtype`` kept the caller's, so a
    break entering ``torch.autocast("cpu")`` without a dtype computed in the caller's fp16, not
    its capture's bf16 (silently, where it cast its result back)."""
    cache = False if any_autocast() else None  # see below
    changes = [(device, enabled, dtype) for device, enabled, dtype in captured or AUTOCAST_OFF
               if (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
               != (enabled, dtype)]  # fmt: skip
    if not changes:  # the caller's autocast is the break's: nothing to enter, nothing allocated
        return _NOTHING
    stack = contextlib.ExitStack()
    for device, enabled, dtype in changes:
        stack.enter_context(
            torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache)
        )
    return stack


#: what :func:`autocast_as` returns where it changes nothing (an empty stack: reusable)
_NOTHING = contextlib.ExitStack()


# Why a pinned autocast inside the caller's does not cache weight casts (``cache_enabled=False``,
# which an autocast the break enters itself inherits): autocast caches the cast of a weight (a
# leaf that requires grad: an ``nn.Parameter``, also under no_grad) by tensor, not by dtype,
# until the outermost autocast exits. A break replayed in bf16 inside the caller's fp16 autocast
# left its bf16 weights to the caller's next fp16 matmul, or took the caller's fp16 ones (also
# in an fp16 autocast of its own, under the caller's bf16), and one of them raised ``expected m1
# and m2 to have the same dtype``. Without the caller's autocast, the break's is the outermost:
# its cache goes when it exits.


def pin_modes(breaks: Sequence[Any], modes: Sequence[tuple]) -> tuple[list, bool, Any]:
    """``breaks`` (``graph.Break``) with their replays pinned to their capture-time ``modes``
    (:func:`break_modes`), and what the whole replay applies instead of wrappers:
    ``without_grad`` (every break that cares was captured under no_grad: the replay turns
    grad off, one check) and ``autocast``, the autocast every break was captured under where
    they share one (None: off, the replay turns the caller's off, one check; a state: the
    replay enters it where the caller's differs), else False. Other breaks are wrapped one by
    one. (A shared state, not one wrapper per break: a graph captured inside
    ``torch.autocast(enabled=False)`` within a bf16 autocast, such as a runner built under the
    caller's, paid about 9 us per break and replay.)"""
    grads = [grad for grad, _ in modes]
    without_grad = "no_grad" in grads and "grad" not in grads
    casts = [cast for (_, cast), brk in zip(modes, breaks) if brk.replay is not None]
    shared = bool(casts) and all(cast == casts[0] for cast in casts)
    pinned = []
    for brk, (grad, cast) in zip(breaks, modes):
        step = brk.replay
        if step is not None and grad == "no_grad" and not without_grad:
            step = _under_no_grad(step)
        if step is not None and not shared:
            step = _under_autocast(step, cast)
        pinned.append(brk if step is brk.replay else replace(brk, replay=step))
    return pinned, without_grad, (casts[0] if shared else False)


def _under_no_grad(replay: Callable[[], None]) -> Callable[[], None]:
    """``replay`` under ``torch.no_grad()`` (a break captured under it, in a graph that also
    has breaks captured with grad)."""

    def step() -> None:
        with torch.no_grad():
            replay()

    return step


def _under_autocast(replay: Callable[[], None], captured: tuple | None) -> Callable[[], None]:
    """``replay`` under its capture's autocast (a graph some of whose breaks were captured
    under ``torch.autocast``)."""

    def step() -> None:
        with autocast_as(captured):
            replay()

    return step
