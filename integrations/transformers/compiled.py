"""``PrefillRunner(compile=...)``: the model's forward under ``torch.compile``, compiled once.

What is compiled: each decoder layer and the decoder's other modules (final norm, rotary
embedding, token embedding), one by one ("regional" compilation, :func:`compile_regions`), not
the model's forward whole. Why: a whole-model compile traces the model's outer frames (the
causal LM's forward, the decoder's, transformers' output-capturing wrappers) down to the first
attention break, restarts, and gives up on them after compiling nothing; those frames were about
two thirds of Dynamo's time (a tiny Llama on a CPU: 17 frames in 5.2 s whole, 6 in 1.6 s by
region; on an H100 with cold caches, llama-1b's Dynamo time went from 8.0 to 4.0 s and the
compiled runner's construction from 24.7 to 19.4 s, ``docs/performance.md``). The layers
share one compiled graph per kind of layer whatever the depth, as before. What runs eagerly
instead (the decoder's loop, its masks and position bookkeeping, the LM head) is captured in
breakgraph's graphs like everything else, so it costs launches at capture only.
The compiled calls are active only inside a :class:`CompiledForward` call (a ``ContextVar``): a
plain call of the model meanwhile, or another runner's, runs the modules as they are. A model
whose decoder has no ``layers`` list is compiled whole.

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
import contextvars
import inspect
import threading
import types
import weakref
from typing import Any

import torch

import breakgraph
from breakgraph.errors import InputError
from breakgraph.patches import PatchSet, SharedPatches

__all__ = ["CompiledForward", "check_compile_option", "compile_regions"]


# torch.compile's modes that turn on Inductor's CUDA graphs (CUDA graph trees)
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile_option(compile: Any, who: str) -> None:
    """Refuse a ``compile=`` that is neither a bool nor a dict of ``torch.compile`` keyword
    arguments (a truthy string would otherwise compile with the defaults), a dict with other
    keys, ``fullgraph=True`` (the breaks are Dynamo graph breaks), a mode, option or backend
    that turns on CUDA graphs of torch's own (captured inside breakgraph's), and values that
    ``torch.compile`` itself refuses (an unknown mode, backend or Inductor option; ``mode``
    together with ``options``), here rather than at the first warm-up. An empty dict compiles
    with torch's defaults, as ``True`` does.

    Example::

        >>> check_compile_option("yes", "demo")
        Traceback (most recent call last):
        breakgraph.errors.InputError: demo: compile must be True, False or a dict of ...
        >>> check_compile_option({"backend": "no_such_backend"}, "demo")
        Traceback (most recent call last):
        breakgraph.errors.InputError: demo: compile={'backend': 'no_such_backend'} is refused by ...
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
        cudagraphs = (
            compile.get("mode") in _CUDAGRAPH_MODES
            or compile.get("backend") == "cudagraphs"  # Dynamo's CUDA graph trees, no Inductor
            or (isinstance(compile.get("options"), dict)
                and compile["options"].get("triton.cudagraphs"))
        )  # fmt: skip
        if cudagraphs:  # torch would begin a capture of its own inside breakgraph's
            raise InputError(
                f"{who}: compile={compile!r} makes torch capture CUDA graphs of its own, "
                f"inside breakgraph's captures; breakgraph's graphs already take the launches "
                f"away: use mode 'default' or 'max-autotune-no-cudagraphs' (or options "
                f"without 'triton.cudagraphs', a backend other than 'cudagraphs')."
            )
        if compile.get("fullgraph"):
            raise InputError(
                f"{who}: compile={{'fullgraph': True}} cannot work: attention (and the MoE "
                f"experts' eager loop) runs as an eager break, a Dynamo graph break; leave "
                f"fullgraph out."
            )
        try:  # torch.compile checks its mode, options and backend when called, compiling nothing
            torch.compile(_check_call, **compile)
        except Exception as exc:
            reason = (str(exc).splitlines() or [""])[0]  # an unknown option lists every one
            reason = reason if len(reason) <= 200 else reason[:200] + " ..."
            raise InputError(
                f"{who}: compile={compile!r} is refused by torch.compile ({type(exc).__name__}: "
                f"{reason}); pass a mode, backend and options that torch.compile accepts."
            ) from exc


def _check_call() -> None:
    """What :func:`check_compile_option` hands ``torch.compile`` (never called)."""


class CompiledForward:
    """``torch.compile`` of a model's regions (:func:`compile_regions`; the model whole where
    it has none) with ``options``, the token dimension dynamic from the first compile (unless
    ``options`` has ``dynamic``), called (keyword arguments only, as the runner does) without
    duck shaping, and eagerly inside emulated captures. ``compile`` is ``True`` or a dict of
    ``torch.compile`` keyword arguments; ``backend`` the breakgraph backend name (``"cuda"``,
    ``"emulated"``). Not on a replay path: the runner calls it in warm-ups, captures and eager
    fallbacks only."""

    def __init__(self, model: Any, compile: Any, backend: str):
        options = dict(compile) if isinstance(compile, dict) else {}
        options.setdefault("dynamic", True)
        self.options = options
        self.emulated = backend != "cuda"
        regions = compile_regions(model)
        if regions is None:
            # torch.compile marks the module it wraps (``_is_torch_compile``, set through the
            # wrapper onto the model): taken off by the last CompiledForward of the model to
            # close, so that the model ends as it was (marked first: torch.compile sets it)
            self._shared = _opened([_shared_patches(model, _mark)])
            try:
                self.fn = torch.compile(model, **options)
            except BaseException:
                self.close()
                raise
            self.compiled_calls: dict[tuple, Any] = {}
        else:
            # one compiled function per kind and shapes of module (:func:`_region_key`)
            self.compiled_calls = {
                key: torch.compile(_call_of(*key), **options)
                for key in dict.fromkeys(_region_key(module) for module in regions)
            }
            self._shared = _opened([_shared_patches(module, _dispatch) for module in regions])
            self.fn = model
        # dropped unclosed: its shares are counted off at each one's next acquire or release
        self._release = weakref.finalize(self, _release_later, self._shared)

    def close(self) -> None:
        """Take torch.compile's mark, or the regions' compiled calls, off the model once no
        other :class:`CompiledForward` of it is open (idempotent, also after an interrupted
        close); the compiled code stays cached in torch, as any compile's does."""
        shared, self._shared = self._shared, []
        if shared:
            if hasattr(self, "_release"):  # not when torch.compile raised in __init__
                self._release.detach()
            _released(shared)

    def __call__(self, **kwargs: Any) -> Any:
        if self.emulated and breakgraph.is_capturing():
            scope = torch.compiler.set_stance("force_eager")
        else:
            scope = _no_duck_shaping()
        active = _ACTIVE.set(self.compiled_calls)
        try:
            with scope, _autocast_cache_off():
                return self.fn(**kwargs)
        finally:
            _ACTIVE.reset(active)


def compile_regions(model: Any) -> list[torch.nn.Module] | None:
    """The modules ``compile=True`` compiles one by one: every decoder layer, then the
    decoder's other modules (its final norm, rotary embedding, token embedding), found through
    transformers' ``get_decoder()`` and the decoder's ``layers``; None where there is no such
    list (or this torch's ``nn.Module`` calls no ``_compiled_call_impl``): compiled whole.

    Example::

        >>> import transformers
        >>> from breakgraph.integrations.transformers.compiled import compile_regions
        >>> config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32,
        ...     intermediate_size=64, num_attention_heads=4, vocab_size=64)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> [type(m).__name__.removeprefix("Llama") for m in compile_regions(model)]
        ['DecoderLayer', 'DecoderLayer', 'RMSNorm', 'RotaryEmbedding', 'Embedding']
    """
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers) or not _REGIONS_WORK:
        return None
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
    others = [module for module in decoder.children()
              if module is not layers and not isinstance(module, containers)]  # fmt: skip
    return [*layers, *sorted(others, key=lambda m: isinstance(m, torch.nn.Embedding))]


#: the compiled calls of the :class:`CompiledForward` call in progress (None: outside one)
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("breakgraph_compiled", default=None)


def _call_module(module, *args, **kwargs):
    """What is compiled for one kind of region: the module's call, hooks and all."""
    return module._call_impl(*args, **kwargs)


def _region_key(module: torch.nn.Module) -> tuple[type, tuple]:
    """What a region's compiled function is shared by: its kind, and its parameters' and
    buffers' names, shapes, dtypes and devices (Dynamo guards on them: a region of another
    shape compiles a graph of its own)."""
    tensors = (*module.named_parameters(), *module.named_buffers())
    return type(module), tuple((n, tuple(t.shape), t.dtype, t.device.type) for n, t in tensors)


def _call_of(kind: type, shapes: tuple) -> types.FunctionType:
    """:func:`_call_module` on a code object of its own for ``kind`` at ``shapes``
    (:func:`_region_key`), the same one for every model and runner of that kind and shape.
    Dynamo keys its cache and its recompile limit (8 graphs) on code objects: one per runner
    would compile a second model of the family all over again, and one per kind would spend
    the limit on as many models of other widths, then run the next ones uncompiled."""
    calls = _calls.setdefault(kind, {})
    call = calls.get(shapes)
    if call is None:
        code = _call_module.__code__.replace(co_name=f"compiled_{kind.__name__}")
        call = calls.setdefault(shapes, types.FunctionType(code, _call_module.__globals__))
    return call


_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # kind -> {shapes: its call}


class _RegionCall:
    """A region's ``_compiled_call_impl`` (what ``nn.Module.__call__`` runs when set): inside a
    :class:`CompiledForward` call the compiled call for the module's kind, else the module's
    own call. Holds the module weakly (the module holds this)."""

    __slots__ = ("module", "key", "__weakref__")

    def __init__(self, module: torch.nn.Module):
        self.module = weakref.ref(module)
        self.key = _region_key(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        calls = None if torch.compiler.is_compiling() else _ACTIVE.get()
        compiled = calls.get(self.key) if calls else None
        if compiled is None:  # a plain call of the model, or inside another compile's trace
            return module._call_impl(*args, **kwargs)
        return compiled(module, *args, **kwargs)


#: per module (a region, or a model compiled whole): what a CompiledForward of it installs
#: there, shared by every one open (two sets of their own, closed in the order they were
#: opened, would each restore what the other had put there)
_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_installed_lock = threading.Lock()


def _dispatch(module: torch.nn.Module, patches: PatchSet) -> None:
    """A region's dispatch (:class:`_RegionCall`): its compiled call inside a CompiledForward
    call."""
    patches.attribute(module, "_compiled_call_impl", _RegionCall(module), weak=True)


def _mark(model: Any, patches: PatchSet) -> None:
    """torch.compile's mark on a model compiled whole."""
    if isinstance(model, torch.nn.Module):
        patches.attribute(model, "_is_torch_compile", True, weak=True)


def _shared_patches(module: Any, install: Any) -> SharedPatches:
    """``install(module, patches)`` on ``module``, shared by every CompiledForward of it: the
    first to open installs it, the last to close restores it. Per module, so a module
    replaced between two opens (a resized embedding) gets its own."""
    ref = weakref.ref(module)  # the table outlives no module: weakly

    def install_on(patches: PatchSet) -> None:
        if (target := ref()) is not None:
            install(target, patches)

    with _installed_lock:
        shared = _installed.get(module)
        if shared is None:
            shared = _installed[module] = SharedPatches(install_on)
        return shared


def _opened(shared: list[SharedPatches]) -> list[SharedPatches]:
    """Acquire every one of ``shared``, or, if one raises, none."""
    for i, one in enumerate(shared):
        try:
            one.acquire()
        except BaseException:
            _released(shared[:i])
            raise
    return shared


def _released(shared: list[SharedPatches]) -> None:
    """Release every one of ``shared``, the first error raised after all were released."""
    error = None
    for one in shared:
        try:
            one.release()
        except BaseException as exc:  # its restore stays pending: it finishes at its next call
            error = error or exc
    if error is not None:
        raise error


def _release_later(shared: list[SharedPatches]) -> None:
    """A dropped CompiledForward's shares, counted off at each one's next acquire or release."""
    for one in shared:
        one.release_later()


def _regions_work() -> bool:
    """Probe of the two torch names the regions rely on: ``nn.Module.__call__`` runs an
    instance's ``_compiled_call_impl`` (torch's own hook for ``Module.compile``), and
    ``_call_impl`` is the module's call with its hooks (what ``_call_module`` compiles)."""
    probe = torch.nn.Identity()
    if getattr(probe, "_compiled_call_impl", ...) is not None or not callable(
        getattr(probe, "_call_impl", None)
    ):
        return False
    probe._compiled_call_impl = lambda x: "compiled"
    return probe(0) == "compiled"


_REGIONS_WORK = _regions_work()


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
