"""``PrefillOutput``: what :meth:`.prefill.PrefillRunner.prefill` returns.

An output refers to its runner for ``cache(i)``, whose keys and values live in the runner's
graph memory. It holds the runner *weakly* when its logits are an owned copy: outputs are
often kept long after the runner (their logits are the point), and a strong reference kept
a runner the caller had dropped, with its graphs and their pool's memory, alive for as long
as any of its outputs. Logits in graph memory (``prefill(..., owned=False)``) are views that
do not own that memory (on CUDA borrowed aliases, :mod:`breakgraph.memory`): such an output
keeps its runner alive, or they would be read from memory given back.
"""

from __future__ import annotations

import numbers
import weakref
from typing import Any

import torch

from breakgraph.errors import InputError

__all__ = ["PrefillOutput"]


class PrefillOutput:
    """The result of :meth:`.prefill.PrefillRunner.prefill` (``runner``).

    ``logits`` is ``[num_prompts, vocab]``: owned (it survives the next prefill) unless
    the prefill was called with ``owned=False``. ``cache(i)`` is prompt ``i``'s KV cache,
    valid until the next prefill (it lives in graph memory) and while the runner lives.

    Example::

        >>> import torch, transformers
        >>> from breakgraph.integrations.transformers import PrefillRunner
        >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        >>> runner = PrefillRunner(model, token_buckets=(16,), max_prompts=2, backend="emulated")
        >>> out = runner.prefill([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
        >>> type(out).__name__, out.logits.shape, out.bounds, out.cache(1).get_seq_length()
        ('PrefillOutput', torch.Size([2, 128]), [(0, 3), (3, 5)], 2)
        >>> runner.prefill([torch.tensor([6])]) and out.cache(1)  # read it before the next one
        Traceback (most recent call last):
        breakgraph.errors.InputError: ...
        >>> runner.close()
    """

    def __init__(self, runner: Any, logits: torch.Tensor, bounds: list, step: int,
                 graph: tuple | None, owned: bool = True):  # fmt: skip
        self.logits = logits
        self.bounds = bounds
        # graph: the key of the graph's KV views in runner._layers, None if it ran eagerly (a
        # key, not the views: closing the runner must free their graph memory)
        self._runner, self._step, self._graph = weakref.ref(runner), step, graph
        self._keeps = None if owned else runner  # logits in its graph memory: see the module

    def cache(self, i: int):
        """Prompt ``i``'s keys and values as a ``transformers.DynamicCache`` for ``generate()``.

        Example::

            out = runner.prefill([ids])
            first = out.logits[0].argmax()
            more = model.generate(torch.cat([ids, first[None]])[None],
                                  past_key_values=out.cache(0), max_new_tokens=8)
        """
        runner = self._runner()
        if runner is None:
            raise self._gone()
        with runner._lock:  # a prefill on another thread would overwrite the K/V it reads
            return self._cache(runner, i)

    def _cache(self, runner: Any, i: int):
        from transformers import DynamicCache

        if runner._closed:
            raise self._gone()
        if self._graph is None:
            raise InputError("PrefillOutput.cache: this prefill ran eagerly and kept no KV cache.")
        if runner._step != self._step:
            raise InputError(
                "PrefillOutput.cache: the KV cache lives in graph memory and a later prefill has "
                "overwritten it (or was started and failed); call cache(i) before the next prefill."
            )
        if isinstance(i, bool) or not isinstance(i, numbers.Integral | torch.Tensor) or (
            isinstance(i, torch.Tensor)
            and (i.dim() or i.is_floating_point() or i.is_complex() or i.dtype is torch.bool)
        ):  # a bool tensor as True is refused: it indexed prompt 1, a complex one raised
            raise InputError(f"PrefillOutput.cache: i must be a prompt's index, an int; got {i!r}.")
        if not 0 <= i < len(self.bounds):
            raise InputError(
                f"PrefillOutput.cache: prompt {i} out of range ({len(self.bounds)} prompts)."
            )
        start, end = self.bounds[i]
        cache = DynamicCache(config=runner.model.config)
        for layer, key, value in sorted(runner._layers[self._graph], key=lambda e: e[0]):
            cache.update(key[:, :, start:end].clone(), value[:, :, start:end].clone(), layer)
        return cache

    @staticmethod
    def _gone() -> InputError:
        return InputError(
            "PrefillOutput.cache: the runner was closed or deleted; its graph memory is "
            "gone. Call cache(i) while the runner lives, before the next prefill."
        )
