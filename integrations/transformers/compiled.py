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
        self._patches = PatchSet()
        self._regions: SharedPatches | None = None
        regions = compile_regions(model)
        if regions is None:
            # torch.compile marks the module it wraps (``_is_torch_compile``, set through the
            # wrapper onto the model): ours until close(), so that the model ends as it was
            if isinstance(model, torch.nn.Module):
                self._patches.attribute(model, "_is_torch_compile", True)
            self.fn = torch.compile(model, **options)
            self.compiled_calls: dict[type, Any] = {}
            return
        # one compiled function per kind of module (Dynamo's recompile limit counts per code
        # object: a layer, a norm and an embedding sharing one would spend it together)
        self.compiled_calls = {
            kind: torch.compile(_call_of(kind), **options)
            for kind in dict.fromkeys(type(module) for module in regions)
        }
        self._regions = _installed_regions(regions)
        self._regions.acquire()
        # dropped unclosed: its share is counted off at the model's next acquire or release
        self._release = weakref.finalize(self, self._regions.release_later)
        self.fn = model

    def close(self) -> None:
        """Take torch.compile's mark, or the regions' compiled calls, off the model
        (idempotent); the compiled code stays cached in torch, as any compile's does."""
        self._patches.restore()
        if self._regions is not None:
            self._release.detach()
            self._regions.release()
            self._regions = None

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


def _call_of(kind: type) -> types.FunctionType:
    """:func:`_call_module` on a code object of its own for ``kind``, the same one for every
    model and runner (Dynamo keys its cache and its recompile limit on code objects: a code
    object per runner would compile a second model of the family all over again)."""
    call = _calls.get(kind)
    if call is None:
        code = _call_module.__code__.replace(co_name=f"compiled_{kind.__name__}")
        call = _calls.setdefault(kind, types.FunctionType(code, _call_module.__globals__))
    return call


_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # kind -> its call


class _RegionCall:
    """A region's ``_compiled_call_impl`` (what ``nn.Module.__call__`` runs when set): inside a
    :class:`CompiledForward` call the compiled call for the module's kind, else the module's
    own call. Holds the module weakly (the module holds this)."""

    __slots__ = ("module", "kind", "__weakref__")

    def __init__(self, module: torch.nn.Module):
        self.module = weakref.ref(module)
        self.kind = type(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        calls = None if torch.compiler.is_compiling() else _ACTIVE.get()
        compiled = calls.get(self.kind) if calls else None
        if compiled is None:  # a plain call of the model, or inside another compile's trace
            return module._call_impl(*args, **kwargs)
        return compiled(module, *args, **kwargs)


#: per model, keyed by its first layer (a prefill runner passes the causal LM, continuous
#: batching the decoder): its regions' dispatch, installed while a CompiledForward of it is open
_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_installed_lock = threading.Lock()


def _installed_regions(regions: list) -> SharedPatches:
    """The regions' dispatch, shared by every :class:`CompiledForward` of their model: the
    first to open installs it, the last to close removes it (two sets of their own, closed in
    the order they were opened, would each restore what the other had put there)."""

    # weakly: the table below keys on the first region and outlives the model
    refs = [weakref.ref(module) for module in regions]

    def install(patches: PatchSet) -> None:
        for ref in refs:
            if (module := ref()) is not None:
                patches.attribute(module, "_compiled_call_impl", _RegionCall(module), weak=True)

    with _installed_lock:
        shared = _installed.get(regions[0])
        if shared is None:
            shared = _installed[regions[0]] = SharedPatches(install)
        return shared


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
