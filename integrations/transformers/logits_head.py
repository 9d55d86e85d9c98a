"""What a causal LM does to its logits after ``lm_head``, which continuous batching does itself.

A continuous-batching step runs the model's decoder and its ``lm_head`` in two graphs (the
head over the sampled rows only), not the causal LM's ``forward``, so whatever that forward
does to the logits after the head, the step must do too: :func:`logits_after_head` reads it from
the config, and :func:`checked_logits_after_head` checks, once per model, that the causal LM's
own logits for three tokens are what the step would compute. A family that transforms its logits
another way (a scale under another name, a cap) is refused, not served with other logits:
HyperCLOVAX multiplies by the ``logits_scaling`` that Granite divides by, and its logprobs were
0.4 off (tokens equal) until this module knew it.

Example::

    >>> import torch, transformers
    >>> config = transformers.GraniteConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, logits_scaling=4.0)
    >>> model = transformers.AutoModelForCausalLM.from_config(config).eval()
    >>> [(op.__name__, value) for op, value in checked_logits_after_head(model, "f")]
    [('div', 4.0)]
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import UnsupportedModelError

#: the causal LMs that multiply their logits by ``logits_scaling``, the knob Granite divides by
_MULTIPLY_BY_LOGITS_SCALING = ("hyperclovax",)


def logits_after_head(config: Any) -> list:
    """What the causal LM does to the logits after ``lm_head``, read from its config, as
    ``(operation, value)`` pairs in order: Granite divides by ``logits_scaling`` (HyperCLOVAX
    multiplies by it), Cohere multiplies by ``logit_scale``. (Logit softcapping is refused by
    ``models.check_model``.)

    Example::

        >>> from transformers import CohereConfig
        >>> after = logits_after_head(CohereConfig(logit_scale=0.25))
        >>> [(op.__name__, value) for op, value in after]
        [('mul', 0.25)]
    """
    scaling = torch.mul if config.model_type in _MULTIPLY_BY_LOGITS_SCALING else torch.div
    ops = (("logits_scaling", scaling), ("logit_scale", torch.mul))
    return [(op, getattr(config, name)) for name, op in ops
            if getattr(config, name, None) is not None]  # fmt: skip


def checked_logits_after_head(model: Any, who: str) -> list:
    """:func:`logits_after_head` of ``model``, once its causal LM's logits for three tokens (its
    ``forward``) are checked against its decoder's last hidden states through ``lm_head`` and
    those operations; ``UnsupportedModelError`` naming ``who`` where they differ. Two forwards
    of three tokens (ids 1-3, not a padding id 0 whose embedding may be zero), on every rank of a
    tensor-parallel model alike (each calls this)."""
    after = logits_after_head(model.config)
    head = model.get_output_embeddings()
    ids = torch.arange(1, 4, device=head.weight.device)[None] % model.config.vocab_size
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        ours = head(hidden)
        for op, value in after:
            ours = op(ours, value)
        theirs = model(input_ids=ids, use_cache=False).logits.to(ours.dtype)
    scale = theirs.abs().max().item()
    worst = (ours - theirs).abs().max().item()
    if not worst <= 1e-2 * scale + 1e-5:  # a missing scale is off by its factor; NaN fails too
        applied = ", ".join(f"{op.__name__} {value}" for op, value in after) or "nothing"
        raise UnsupportedModelError(
            f"{who}: {type(model).__name__}'s logits are not its lm_head's after what breakgraph "
            f"applies to them ({applied}): {worst:.3g} apart for three tokens (largest logit "
            f"{scale:.3g}). Its forward transforms the logits in a way continuous batching does "
            f"not know; serve it with transformers' own continuous batching."
        )
    return after
