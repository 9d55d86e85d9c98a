"""Continuous batching: the scoped changes to transformers, and the registry of enabled models.

transformers 5.17 has no extension point for the graph type of continuous-batching
steps: ``ContinuousBatchProcessor`` builds its runner from the module name
``ModelRunner`` (whose ``compute_batch`` hard-codes ``torch.cuda.CUDAGraph``), and
whether graphs are used is decided from the attention key. So, while at least one
model is enabled (and no longer), three attributes are replaced by versions that
behave exactly like the originals for every model that is not enabled:

* ``continuous_api.ModelRunner``: a factory returning
  :class:`~.cb_runner.BreakgraphModelRunner` for enabled models;
* ``continuous_api.resolve_continuous_batching_config``: reads the caller's
  ``use_cuda_graph`` before transformers resolves it, and turns transformers' own
  whole-step graphs off;
* ``PagedAttentionMemoryHandler.get_available_memory``: on a CPU host where
  transformers measures no free memory (no ``psutil``), the host's free memory.

Plus two registry keys: ``AttentionInterface["paged|breakgraph"]`` and
``ExpertsInterface[EXPERTS_KEY]`` (see ``experts.py``). Everything is restored, by identity, when
the last enabled model is disabled.
"""

from __future__ import annotations

import copy
import inspect
import os
import threading
from typing import Any

from .cb_attention import (
    CB_ATTENTION_KEY,
    paged_breakgraph_attention,
)
from .experts import EXPERTS_KEY, breakgraph_experts
from .prefill import UnsupportedModelError

lock = threading.RLock()  # held by enable/disable
_enabled: dict[int, Any] = {}  # id(text config) -> ContinuousBatchingHandle
_patches: _TransformersPatches | None = None


def handle_for(config) -> Any:
    """The enabled handle of the model whose (text) config this is, or None."""
    handle = _enabled.get(id(config))
    return handle if handle is not None and handle.config is config else None


def register(handle) -> None:
    """Record an enabled handle; the first one installs the patches."""
    global _patches
    if not _enabled:
        patches = _TransformersPatches()
        patches.install()
        _patches = patches
    _enabled[id(handle.config)] = handle


def unregister(handle) -> None:
    """Forget a handle; the last one removes the patches."""
    global _patches
    if _enabled.get(id(handle.config)) is handle:
        del _enabled[id(handle.config)]
    if not _enabled and _patches is not None:
        _patches.remove()
        _patches = None


def check_transformers(who: str) -> None:
    """Detect the 5.17 continuous-batching internals this integration hooks into."""
    import transformers

    version = transformers.__version__
    problem = None
    try:
        from transformers.generation.continuous_batching import cache, continuous_api
        from transformers.generation.continuous_batching import model_runner as runner_module

        update = inspect.signature(cache.PagedAttentionCache.update).parameters
        if "read_index" not in update or "write_index" not in update:
            problem = "PagedAttentionCache.update no longer takes read_index/write_index"
        elif not isinstance(continuous_api.__dict__.get("ModelRunner"), type) and _patches is None:
            problem = "continuous_api.ModelRunner is not a class"
        elif not hasattr(continuous_api, "resolve_continuous_batching_config"):
            problem = "continuous_api.resolve_continuous_batching_config is missing"
        elif not hasattr(cache.PagedAttentionMemoryHandler, "get_available_memory"):
            problem = "PagedAttentionMemoryHandler.get_available_memory is missing"
        elif not hasattr(runner_module.ModelRunner, "_forward_process_and_sample"):
            problem = "ModelRunner._forward_process_and_sample is missing"
    except ImportError as exc:
        problem = f"continuous batching cannot be imported ({exc})"
    if problem is not None:
        raise UnsupportedModelError(
            f"{who}: transformers {version} is not supported: its continuous-batching "
            f"internals differ from 5.17 ({problem}). Install transformers==5.17.0, or use "
            f"PrefillRunner or transformers' own continuous batching."
        )


class _TransformersPatches:
    """The scoped changes to transformers, installed while at least one handle is enabled."""

    def __init__(self) -> None:
        from transformers import AttentionInterface
        from transformers.generation.continuous_batching import cache, continuous_api
        from transformers.integrations.moe import ExpertsInterface

        self.original_runner = continuous_api.ModelRunner
        self.original_resolve = continuous_api.resolve_continuous_batching_config
        original_memory = cache.PagedAttentionMemoryHandler.__dict__["get_available_memory"]

        def get_available_memory(handler) -> int:
            """transformers' measure, or the host's free memory where it measures none (CPU)."""
            available = original_memory(handler)
            handle = handle_for(handler.config)
            if handle is None or available > 0 or handle.device.type != "cpu":
                return available
            return int(_host_free_memory() * handler.cb_config.max_memory_percent)

        self.attributes = [
            (continuous_api, "ModelRunner", self.model_runner),
            (continuous_api, "resolve_continuous_batching_config", self.resolve),
            (cache.PagedAttentionMemoryHandler, "get_available_memory", get_available_memory),
        ]
        self.registries = [
            (AttentionInterface._global_mapping, CB_ATTENTION_KEY, paged_breakgraph_attention),
            (ExpertsInterface._global_mapping, EXPERTS_KEY, breakgraph_experts),
        ]
        self.saved: list = []

    def install(self) -> None:
        for owner, name, replacement in self.attributes:
            self.saved.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, replacement)
        for mapping, key, function in self.registries:
            self.saved.append((mapping, key, mapping.get(key, _MISSING)))
            mapping[key] = function

    def remove(self) -> None:
        while self.saved:
            owner, name, previous = self.saved.pop()
            if isinstance(owner, dict):
                if previous is _MISSING:
                    owner.pop(name, None)
                else:
                    owner[name] = previous
            else:
                setattr(owner, name, previous)

    # the replacements: each behaves exactly like the original for models not enabled
    def model_runner(self, **kwargs):
        handle = handle_for(kwargs["cache"].config)
        if handle is None:
            return self.original_runner(**kwargs)
        return handle._new_runner(**kwargs)

    def resolve(self, config, cb_config, workload_hints, has_logit_processors):
        handle = handle_for(config)
        if handle is None:
            return self.original_resolve(
                config=config,
                cb_config=cb_config,
                workload_hints=workload_hints,
                has_logit_processors=has_logit_processors,
            )
        use_graphs = handle._use_graphs(cb_config)
        adjusted = copy.copy(cb_config)
        adjusted.use_cuda_graph = False  # transformers' own whole-step graphs: never here
        if adjusted.use_async_batching is None:
            adjusted.use_async_batching = handle._async_by_default(use_graphs)
        resolved = self.original_resolve(
            config=config,
            cb_config=adjusted,
            workload_hints=workload_hints,
            has_logit_processors=has_logit_processors,
        )
        handle._remember(resolved, use_graphs)
        return resolved


_MISSING = object()


def _host_free_memory() -> int:
    """Free host memory in bytes without psutil (Linux: available pages; else all pages)."""
    pages = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in os.sysconf_names else None
    if not pages or pages < 0:
        pages = os.sysconf("SC_PHYS_PAGES")
    return int(pages) * int(os.sysconf("SC_PAGE_SIZE"))
