"""RoPE that is static up to a length: transformers' ``dynamic`` and ``longrope`` in prefill.

transformers decorates each rotary module's ``forward`` with ``dynamic_rope_update``, which
for these two types computes ``max(position_ids) + 1`` on every call, compares it on the host
(a host sync: a captured segment refuses it) and re-registers the ``inv_freq`` buffer. For
every forward whose longest sequence is at most the *original* length (longrope's
``original_max_position_embeddings``, dynamic's ``original_max_seq_len``), both use their
original frequencies (``original_inv_freq``) and an ``attention_scaling`` fixed at init:
they are static RoPE there. In a PrefillRunner forward the positions restart at 0 for every
prompt, so that longest sequence is the longest prompt.

:class:`StaticRope` holds such a model's RoPE static while a runner captures or runs it
eagerly: each switched module's ``rope_type`` reads ``"default"`` (per layer type where it is
a dict), so the decorator passes by, and its ``inv_freq`` buffers are the original
frequencies, copied once onto the model's device. The graphs read that copy for their whole
life, whatever transformers does later (a long eager forward of the model switches its
buffer to the long frequencies: another tensor up to 5.22; from 5.23 longrope writes them into
the same one in place, with no host sync, but for the whole packed batch at once, where each
prompt alone would have had its own). The runner refuses a longer prompt
(:meth:`StaticRope.too_long`), which transformers would run with other frequencies.
Continuous batching refuses these types: a request's positions grow past the limit as it
decodes. What is read of transformers is item 18 of the contract in :mod:`.compat`.

Example::

    >>> import transformers
    >>> from breakgraph.integrations.transformers.rope import rope_position_limit
    >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
    ...     num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=256,
    ...     rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg)
    >>> rope_position_limit(model), rope_position_limit(torch.nn.Linear(2, 2))
    (256, None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from breakgraph.errors import InputError
from breakgraph.patches import PatchSet

from . import compat

__all__ = ["switched_rope_modules", "rope_position_limit", "StaticRope"]


def switched_rope_modules(model: Any) -> list[tuple[torch.nn.Module, list]] | None:
    """Every rotary module of ``model`` whose frequencies transformers switches per call, with
    what :func:`.compat.switched_rope` found of it (per layer type); None where one of them is
    not laid out as the contract says (then the model is refused, never served wrongly).

    Example::

        >>> switched_rope_modules(torch.nn.Linear(2, 2))
        []
    """
    found = []
    for module in model.modules():
        entries = compat.switched_rope(module)
        if entries is None:
            return None
        if entries:
            found.append((module, entries))
    return found


def rope_position_limit(model: Any) -> int | None:
    """The longest prompt for which ``model``'s dynamic or longrope RoPE keeps its original
    frequencies (the least over its rotary modules and layer types); None for a model without
    such RoPE (or whose layout is unknown: :func:`switched_rope_modules`).

    Example::

        >>> import transformers
        >>> cfg = transformers.Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=512,
        ...     pad_token_id=None, eos_token_id=None, original_max_position_embeddings=64,
        ...     rope_parameters=dict(rope_type="longrope", rope_theta=1e4,
        ...     short_factor=[1.0] * 8, long_factor=[4.0] * 8))
        >>> rope_position_limit(transformers.AutoModelForCausalLM.from_config(cfg))
        64
    """
    return _least_limit(switched_rope_modules(model) or [])


class StaticRope:
    """A model's switched RoPE, held static while :meth:`held` is entered; built once per
    runner (the frequency copies live as long as it, so as the graphs that read them).

    Example::

        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=32,
        ...     rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))
        >>> model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        >>> rope = StaticRope(model, torch.device("cpu"))
        >>> with rope.held():
        ...     model.model.rotary_emb.rope_type
        'default'
        >>> rope.limit, model.model.rotary_emb.rope_type
        (32, 'dynamic')
    """

    def __init__(self, model: Any, device: torch.device) -> None:
        modules = switched_rope_modules(model) or []
        #: the longest prompt served (None: nothing switched, every length is)
        self.limit = _least_limit(modules)
        self.kinds = sorted({t for m, _ in modules for t in _types(m.rope_type)
                             if "dynamic" in t or t == "longrope"})  # fmt: skip
        # (module, its rope_type with every switched type "default", [(buffer, frequencies)])
        self._modules = []
        for module, entries in modules:
            static: Any = "default"
            if isinstance(module.rope_type, dict):
                switched = {layer_type for layer_type, *_ in entries}
                static = {k: "default" if k in switched else t
                          for k, t in module.rope_type.items()}  # fmt: skip
            copies = [(name, original.to(device, copy=True)) for _, name, original, _ in entries]
            self._modules.append((module, static, copies))

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The switched modules static for the block (every capture, warm-up and eager forward
        of the runner), then exactly as they were: the same ``rope_type`` and buffer objects,
        restored through :class:`~breakgraph.patches.PatchSet`."""
        if not self._modules:
            yield
            return
        with PatchSet() as patches:
            for module, static, copies in self._modules:
                patches.attribute(module, "rope_type", static)
                for name, frequencies in copies:
                    patches.attribute(module, name, frequencies)  # a buffer: its _buffers entry
            yield

    def too_long(self, lengths: list[int]) -> InputError:
        """The refusal of a batch with a prompt longer than :attr:`limit` (the first named)."""
        i = next(i for i, n in enumerate(lengths) if n > self.limit)
        return InputError(
            f"PrefillRunner.prefill: prompt {i} has {lengths[i]} tokens, more than {self.limit}, "
            f"the longest for which the model's {'/'.join(self.kinds)} RoPE keeps its original "
            f"frequencies; transformers switches such a prompt, and only it, to other "
            f"frequencies, which the graphs do not hold. Run that prompt through the model "
            f"itself (model(ids[None])). Nothing was copied."
        )


def _least_limit(modules: list) -> int | None:
    return min((entry[3] for _, entries in modules for entry in entries), default=None)


def _types(rope_type: Any) -> list:
    return list(rope_type.values()) if isinstance(rope_type, dict) else [rope_type]
