"""HuggingFace transformers integration: graph-speed prefill and continuous batching of
unmodified causal LMs.

See ``docs/integration-transformers.md``.

Example::

    from breakgraph.integrations.transformers import PrefillRunner
    runner = PrefillRunner(model, token_buckets=(64, 256, 1024), max_prompts=16)
    out = runner.prefill([ids_a, ids_b])
    out.logits          # [2, vocab]
"""

from .attention import ATTENTION_KEY, LayerAttention, PackedBatch, breakgraph_attention
from .continuous_batching import (
    CB_ATTENTION_KEY,
    ContinuousBatchingHandle,
    ContinuousBatchingStats,
    enable_continuous_batching,
)
from .experts import EXPERTS_KEY
from .models import SUPPORTED_MODEL_TYPES, UnsupportedModelError, default_token_buckets
from .prefill import PrefillOutput, PrefillRunner

__all__ = [
    "default_token_buckets",
    "EXPERTS_KEY",
    "PrefillRunner",
    "enable_continuous_batching",
    "ContinuousBatchingHandle",
    "ContinuousBatchingStats",
    "CB_ATTENTION_KEY",
    "PrefillOutput",
    "UnsupportedModelError",
    "SUPPORTED_MODEL_TYPES",
    "ATTENTION_KEY",
    "breakgraph_attention",
    "LayerAttention",
    "PackedBatch",
]
