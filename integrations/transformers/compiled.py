"""``PrefillRunner(compile=...)``: the model's forward under ``torch.compile``, compiled once.

The runner calls the compiled forward in the warm-up of every bucket, largest first. Left to
torch's default (``dynamic=None``), Dynamo compiles the first bucket at static shapes, then,
seeing a second size, compiles every frame again with a dynamic token dimension ("automatic
dynamic"): on an H200 (mistral-7b-4l, 4096-token bucket) 10.4 s for the first bucket and
7.9 s more for the second. So, unless the caller chose ``dynamic`` in its ``torch.compile``
options, the forward is compiled with ``dynamic=True``: one compile of each Dynamo frame, at
the first (largest) bucket, with symbolic sizes that every later bucket reuses. (Every bucket
but the largest ran those same dynamic kernels before: the second compile was dynamic.)
Marking only the token dimension of the ids and positions (``torch._dynamo.mark_dynamic``)
is not enough: the attention breaks split the forward into many frames (each decoder layer,
each resume after a break) whose inputs are fresh, unmarked tensors, and each of those
compiled twice all the same (a 2-layer Llama over 3 buckets: 14 graphs with the mark, 7 with
``dynamic=True``; parameters stay static either way).

Three Dynamo behaviours would each undo that, so calls go through :meth:`CompiledForward.__call__`:

* duck shaping gives input dimensions of equal size one symbol. At the largest bucket the
  token count equals other sizes by construction (the positions' offset in the step buffer,
  the attention output buffer's base, often the hidden size: 4096), so the compile would
  guard ``tokens == 4096`` and compile again at the next bucket. Calls turn duck shaping off
  (``torch.fx.experimental._config.use_duck_shape``, while the call compiles);
* the emulated backend records a segment under a ``TorchDispatchMode``, where Dynamo cannot
  run compiled code: it marks every frame it meets "skip", for good, so no later bucket's
  warm-up would compile. Captures on the emulated backend call the forward under
  ``torch.compiler.set_stance("force_eager")`` instead (compiled code runs eagerly inside
  emulated segments either way);
* Dynamo guards on autocast's cast cache being on, and a capture turns it off (a cast cached
  there would be freed while the graph reads it: ``breakgraph.graph``, pytorch#71631). A
  frame compiled in a warm-up, with the cache on, then compiled again inside the first CUDA
  capture: each compile twice, and the new kernels' first launch inside the capture, where
  Inductor's autotuning of a reduction with several configurations synchronises and CUDA
  refuses it (Gemma-3-1B's RMSNorm over 1152 channels, an H100: the manager could not be
  created). Every call runs with the cache off, as the capture does: one compile per frame,
  used by warm-ups, captures and eager fallbacks alike.

Example::

    >>> import torch
    >>> from breakgraph.integrations.transformers.compiled import CompiledForward
    >>> forward = CompiledForward(torch.nn.Linear(4, 4), {"backend": "eager"}, "emulated")
    >>> forward.options["dynamic"], forward.fn is not None
    (True, True)
    >>> CompiledForward(torch.nn.Linear(4, 4), {"dynamic": False}, "cuda").options
    {'dynamic': False}
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

import breakgraph
from breakgraph.errors import InputError
from breakgraph.patches import PatchSet

__all__ = ["CompiledForward", "check_compile_option"]


# torch.compile's modes that turn on Inductor's CUDA graphs (CUDA graph trees)
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile_option(compile: Any, who: str) -> None:
    """Refuse a ``compile=`` that is neither a bool nor a dict of ``torch.compile`` keyword
    arguments (a truthy string would otherwise compile with the defaults), a dict with other
    keys, ``fullgraph=True`` (the breaks are Dynamo graph breaks), and a mode or option that
    turns on Inductor's own CUDA graphs (captured inside breakgraph's). An empty dict compiles
    with torch's defaults, as ``True`` does.

    Example::

        >>> check_compile_option("yes", "demo")
        Traceback (most recent call last):
        breakgraph.errors.InputError: demo: compile must be True, False or a dict of ...
    """
    if not isinstance(compile, (bool, dict)):
        raise InputError(
            f"{who}: compile must be True, False or a dict of torch.compile keyword arguments, "
            f"got {compile!r}."
        )
    if isinstance(compile, dict):  # refused here, not by torch.compile's TypeError later
        known = [n for n, p in inspect.signature(torch.compile).parameters.items()
                 if p.kind is p.KEYWORD_ONLY]  # fmt: skip
        unknown = [k for k in compile if k not in known]
        if unknown:
            raise InputError(
                f"{who}: compile has keys that are not torch.compile keyword arguments: "
                f"{', '.join(map(repr, unknown))}; use some of {', '.join(known)}."
            )
        cudagraphs = compile.get("mode") in _CUDAGRAPH_MODES or (
            isinstance(compile.get("options"), dict)
            and compile["options"].get("triton.cudagraphs")
        )
        if cudagraphs:  # Inductor would begin a capture of its own inside breakgraph's
            raise InputError(
                f"{who}: compile={compile!r} makes Inductor capture CUDA graphs of its own, "
                f"inside breakgraph's captures; breakgraph's graphs already take the launches "
                f"away: use mode 'default' or 'max-autotune-no-cudagraphs' (or options "
                f"without 'triton.cudagraphs')."
            )
        if compile.get("fullgraph"):
            raise InputError(
                f"{who}: compile={{'fullgraph': True}} cannot work: attention (and the MoE "
                f"experts' eager loop) runs as an eager break, a Dynamo graph break; leave "
                f"fullgraph out."
            )


class CompiledForward:
    """``torch.compile(model, **options)`` with the token dimension dynamic from the first
    compile (unless ``options`` has ``dynamic``), called (keyword arguments only, as the
    runner does) without duck shaping, and eagerly inside emulated captures. ``compile`` is
    ``True`` or a dict of ``torch.compile`` keyword arguments; ``backend`` the breakgraph
    backend name (``"cuda"``, ``"emulated"``). Not on a replay path: the runner calls it in
    warm-ups, captures and eager fallbacks only."""

    def __init__(self, model: Any, compile: Any, backend: str):
        options = dict(compile) if isinstance(compile, dict) else {}
        options.setdefault("dynamic", True)
        self.options = options
        # torch.compile marks the module it wraps (``_is_torch_compile``, set through the
        # wrapper onto the model): ours until close(), so that the model ends as it was
        self._patches = PatchSet()
        if isinstance(model, torch.nn.Module):
            self._patches.attribute(model, "_is_torch_compile", True)
        self.fn = torch.compile(model, **options)
        self.emulated = backend != "cuda"

    def close(self) -> None:
        """Take torch.compile's mark off the model (idempotent); the compiled code stays
        cached in torch, as any compile's does."""
        self._patches.restore()

    def __call__(self, **kwargs: Any) -> Any:
        if self.emulated and breakgraph.is_capturing():
            scope = torch.compiler.set_stance("force_eager")
        else:
            scope = _no_duck_shaping()
        with scope, _autocast_cache_off():
            return self.fn(**kwargs)


def _no_duck_shaping() -> contextlib.AbstractContextManager:
    """Dynamo's shape environment without duck shaping, for a call that may compile (torch's
    own scoped config patch; a torch without the switch compiles with duck shaping)."""
    try:
        from torch.fx.experimental import _config as config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config, "use_duck_shape"):
        return contextlib.nullcontext()
    return config.patch(use_duck_shape=False)


@contextlib.contextmanager
def _autocast_cache_off():
    """Autocast's cast cache off for a call, as inside a capture (Dynamo guards on it: the
    module docstring), restored after it."""
    cached = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cached)
