"""``PrefillRunner``: graph-speed prefill of unmodified HuggingFace causal LMs.

Prompts of different lengths are packed into one token row (no padding between
prompts) with per-prompt ``position_ids``; the row is padded to a token bucket
whose tail is a dummy sequence. One breakable graph per bucket captures the whole
forward except attention, which runs as an eager break per layer with the exact
boundaries of the live batch (see :mod:`.attention`). Each prompt's last hidden
state is gathered on the device (``logits_to_keep`` with an index tensor), so the
graph produces ``[max_prompts, vocab]`` logits, not ``[tokens, vocab]``.

Example::

    >>> import torch, transformers
    >>> from breakgraph.integrations.transformers import PrefillRunner
    >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    >>> runner = PrefillRunner(model, token_buckets=(16, 32), max_prompts=4, backend="emulated")
    >>> out = runner.prefill([torch.randint(128, (5,)), torch.randint(128, (9,))])
    >>> out.logits.shape
    torch.Size([2, 128])
    >>> runner.close()
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

import breakgraph
from breakgraph.backends import select_backend
from breakgraph.errors import InputError, ReplayError
from breakgraph.runner import BucketedRunner

from . import attention as _attention

__all__ = ["PrefillRunner", "PrefillOutput", "SUPPORTED_MODEL_TYPES", "UnsupportedModelError"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "qwen3_moe", "mixtral")
_STATIC_ROPE_TYPES = (None, "default", "linear", "llama3", "yarn")
_MISSING = object()


class UnsupportedModelError(breakgraph.BreakgraphError, ValueError):
    """The model or configuration cannot be served correctly by the prefill runner."""


class PrefillOutput:
    """The result of :meth:`PrefillRunner.prefill`.

    ``logits`` is ``[num_prompts, vocab]`` (owned: it survives the next prefill);
    ``cache(i)`` is prompt ``i``'s KV cache, valid until the next prefill.
    """

    def __init__(
        self,
        runner: PrefillRunner,
        logits: torch.Tensor,
        bounds: list,
        step: int,
        layers: list | None,
    ):
        self.logits = logits
        self.bounds = bounds
        self._runner, self._step, self._layers = runner, step, layers

    def cache(self, i: int):
        """Prompt ``i``'s keys and values as a ``transformers.DynamicCache`` for ``generate()``.

        Example::

            out = runner.prefill([ids])
            first = out.logits[0].argmax()
            more = model.generate(torch.cat([ids, first[None]])[None],
                                  past_key_values=out.cache(0), max_new_tokens=8)
        """
        from transformers import DynamicCache

        if self._layers is None:
            raise InputError("PrefillOutput.cache: this prefill ran eagerly and kept no KV cache.")
        if self._runner._step != self._step:
            raise InputError(
                "PrefillOutput.cache: the KV cache lives in graph memory and a later prefill has "
                "overwritten it; call cache(i) before the next prefill."
            )
        if not 0 <= i < len(self.bounds):
            raise IndexError(
                f"PrefillOutput.cache: prompt {i} out of range ({len(self.bounds)} prompts)."
            )
        start, end = self.bounds[i]
        cache = DynamicCache(config=self._runner.model.config)
        for layer, key, value in sorted(self._layers, key=lambda entry: entry[0]):
            cache.update(key[:, :, start:end].clone(), value[:, :, start:end].clone(), layer)
        return cache


class PrefillRunner:
    """Prefill batches of variable-length prompts through captured breakable graphs.

    Args:
        model: a transformers causal LM (``SUPPORTED_MODEL_TYPES``) in eval mode.
        token_buckets: total-token sizes to capture; a batch pads to the smallest
            that fits.
        max_prompts: most prompts in one batch.
        backend: ``"cuda"`` or ``"emulated"`` (see :func:`breakgraph.capture`).
        on_miss: ``"raise"`` (default) or ``"eager"`` when a batch has more tokens
            than the largest bucket.
        attention: ``"auto"`` (FlashAttention varlen on CUDA in bf16/fp16, else the
            per-sequence reference), ``"flash"``, ``"reference"``, or ``"captured"``:
            FlashAttention recorded *inside* the graph with upper-bound lengths and no
            breaks at all (a baseline; it relies on the kernel tolerating upper-bound
            ``max_seqlen`` and holds at most ``max_prompts`` sequences).
        pad_token_id: token id written into the bucket tail.
        warmup: eager runs of the forward before each bucket is captured.
        compile: ``torch.compile`` the model's forward (True, or a dict of
            ``torch.compile`` keyword arguments) so segments hold fused kernels;
            attention and MoE experts stay eager breaks (Dynamo breaks its graph
            there too). Compilation happens during the warm-up of each bucket.
        debug: capture in debug mode (see :mod:`breakgraph.debug`): input checks on
            every replay, and ``runner.graph(bucket).report()`` gives each attention
            break's host time per replay. Slow; off by default (``$BREAKGRAPH_DEBUG``).

    The model is left as it was: the attention implementation is switched to
    ``"breakgraph"`` only while capturing or running eagerly through the runner.
    """

    def __init__(
        self,
        model: Any,
        token_buckets: Sequence[int] = (64, 256, 1024),
        max_prompts: int = 16,
        *,
        backend: str | None = None,
        on_miss: str = "raise",
        attention: str = "auto",
        pad_token_id: int = 0,
        warmup: int = 2,
        compile: Any = False,
        debug: bool | None = None,
    ):
        _check_model(model)
        if max_prompts < 1:
            raise InputError(f"PrefillRunner: max_prompts must be >= 1, got {max_prompts}.")
        if attention not in ("auto", "flash", "reference", "captured"):
            raise InputError(
                f"PrefillRunner: attention must be 'auto', 'flash', 'reference' or 'captured', "
                f"got {attention!r}."
            )
        parameter = next(model.parameters())
        self.model = model
        self.device, self.dtype = parameter.device, parameter.dtype
        can_flash = (
            _attention.flash_available(self.dtype, self.device)
            and select_backend(backend).name == "cuda"
        )
        if attention in ("flash", "captured") and not can_flash:
            raise UnsupportedModelError(
                f"PrefillRunner: attention={attention!r} needs the CUDA backend, bf16/fp16 weights "
                f"and torch's FlashAttention varlen kernel; use attention='reference'."
            )
        self.attention = (
            ("flash" if can_flash else "reference") if attention == "auto" else attention
        )
        self.max_prompts = max_prompts
        self.vocab_size = model.config.get_text_config().vocab_size
        if not 0 <= pad_token_id < self.vocab_size:
            raise InputError(
                f"PrefillRunner: pad_token_id={pad_token_id} is outside the vocabulary "
                f"(0..{self.vocab_size - 1})."
            )
        longest = max(token_buckets)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and longest > limit:
            raise UnsupportedModelError(
                f"PrefillRunner: bucket {longest} exceeds max_position_embeddings={limit}."
            )
        self._forward_model = model
        if compile:
            options = compile if isinstance(compile, dict) else {}
            self._forward_model = torch.compile(model, **options)
        self._positions = torch.arange(longest, device=self.device)
        self._last_index = torch.zeros(max_prompts, dtype=torch.long, device=self.device)
        self._cu_seqlens = torch.zeros(max_prompts + 2, dtype=torch.int32, device=self.device)
        # host staging of the per-step metadata: pinned, so the copies are asynchronous and a
        # prefill never waits for the GPU; the event says when the copies have read it
        pin = self.device.type == "cuda"
        self._host_last = torch.zeros(max_prompts, dtype=torch.long, pin_memory=pin)
        self._host_cu = torch.zeros(max_prompts + 2, dtype=torch.int32, pin_memory=pin)
        self._host_last_np, self._host_cu_np = self._host_last.numpy(), self._host_cu.numpy()
        self._staged = torch.cuda.Event() if pin else None
        self._layers: dict = {}  # bucket -> [(layer, key, value)] seen at capture
        self._step = 0
        self._closed = False
        _attention.register()
        example = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._runner = BucketedRunner(
            self._forward,
            token_buckets,
            (example, example),
            dims=1,
            pad_values=(pad_token_id, 0),
            on_miss=on_miss,
            slice_outputs=False,
            warmup=warmup,
            backend=backend,
            capture_context=self._capture_batch,
            debug=debug,
        )

    # -- the captured forward ------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        state = _attention.RunnerState(
            "reference" if self.attention == "reference" else "flash",
            self._cu_seqlens if self.attention == "captured" else None,
        )
        if breakgraph.is_capturing():
            self._layers[input_ids.shape[1]] = state.layers
        with self._attention_installed(state), torch.no_grad():
            return self._forward_model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=self._last_index,
            ).logits

    @contextlib.contextmanager
    def _attention_installed(self, state: _attention.RunnerState) -> Iterator[None]:
        """Switch the model to breakgraph attention and MoE experts to eager breaks, then back.

        Only transformers' ``"eager"`` experts loop (``nonzero`` and a Python loop over
        the active experts) needs a break; ``grouped_mm``/``batched_mm`` are captured.
        """
        original = self.model.config._attn_implementation
        patched = []
        self.model.set_attn_implementation(_attention.ATTENTION_KEY)
        _attention.set_active(state)
        try:
            experts = getattr(self.model.config, "_experts_implementation", None)
            for module in self.model.modules() if experts in (None, "eager") else ():
                if type(module).__name__.endswith("Experts"):
                    # data-dependent loop over active experts (nonzero): an eager break of its own
                    patched.append((module, module.__dict__.get("forward", _MISSING)))
                    module.forward = torch.compiler.disable(
                        breakgraph.eager_on_graph(module.forward)
                    )
            yield
        finally:
            for module, previous in patched:  # an instance-level forward of the user's stays
                if previous is _MISSING:
                    del module.forward
                else:
                    module.forward = previous
            _attention.set_active(None)
            self.model.set_attn_implementation(original)

    def _capture_batch(self, size: int) -> _attention.PackedBatch:
        """During capture of a bucket: one sequence filling it (any batch shape would do)."""
        return self._stage([size], size)

    def _stage(self, lengths: list[int], bucket: int) -> _attention.PackedBatch:
        """Write the step's metadata (last-token indices, ``cu_seqlens``) to the device.

        Both go through pinned host buffers with asynchronous copies: no host sync, so
        the GPU may still be busy with the previous step while this one is prepared.
        """
        bounds, start = [], 0
        for n in lengths:
            bounds.append((start, start + n))
            start += n
        if bucket > start:
            bounds.append((start, bucket))  # the tail: a dummy sequence, so every row is written
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copies have read the staging buffers
        last = self._host_last_np
        last[:] = 0
        last[: len(lengths)] = list(itertools.accumulate(lengths))
        last[: len(lengths)] -= 1
        self._last_index.copy_(self._host_last, non_blocking=True)
        cu_seqlens = None
        if self.attention != "reference":
            # trailing entries repeat the end: zero-length sequences for the captured kernel
            cu = self._host_cu_np
            cu[0] = 0
            cu[1 : len(bounds) + 1] = [end for _, end in bounds]
            cu[len(bounds) + 1 :] = bounds[-1][1]
            self._cu_seqlens.copy_(self._host_cu, non_blocking=True)
            cu_seqlens = self._cu_seqlens[: len(bounds) + 1]
        if self._staged is not None:
            self._staged.record()
        return _attention.PackedBatch(bounds, cu_seqlens, max(end - begin for begin, end in bounds))

    # -- serving ---------------------------------------------------------------------------
    @property
    def buckets(self) -> tuple:
        return self._runner.buckets

    @property
    def stats(self):
        """Counters of the underlying :class:`~breakgraph.runner.BucketedRunner`."""
        return self._runner.stats

    def graph(self, bucket: int) -> breakgraph.BreakableCUDAGraph:
        """The breakable graph of ``bucket``: ``print(runner.graph(64).report())`` shows its
        segments and attention breaks (with host time per break when ``debug=True``)."""
        return self._runner.graph(bucket)

    def prefill(self, prompts: Sequence[torch.Tensor]) -> PrefillOutput:
        """Prefill ``prompts`` (1-D LongTensors) together; see :class:`PrefillOutput`."""
        if self._closed:
            raise ReplayError(
                "PrefillRunner.prefill: the runner is closed; build a new PrefillRunner."
            )
        lengths = self._validate(prompts)
        total = sum(lengths)
        bucket = self._runner.bucket_for(total)
        ids = torch.cat([p.to(self.device, non_blocking=True) for p in prompts]).view(1, total)
        positions = torch.cat(
            [
                self._positions[:n]
                if n <= len(self._positions)
                else torch.arange(n, device=self.device)
                for n in lengths
            ]
        ).view(1, total)
        batch = self._stage(lengths, bucket if bucket is not None else total)
        logits = self._runner(ids, positions, context=batch)
        self._step += 1
        layers = self._layers[bucket] if bucket is not None else None
        return PrefillOutput(
            self,
            logits[0, : len(lengths)].clone(),
            batch.bounds[: len(lengths)],
            self._step,
            layers,
        )

    def _validate(self, prompts: Sequence[torch.Tensor]) -> list[int]:
        if isinstance(prompts, torch.Tensor) or not len(prompts):
            raise InputError("PrefillRunner.prefill: pass a non-empty list of 1-D LongTensors.")
        if len(prompts) > self.max_prompts:
            raise InputError(
                f"PrefillRunner.prefill: {len(prompts)} prompts exceed "
                f"max_prompts={self.max_prompts}; split the batch or build the runner with a "
                f"larger max_prompts."
            )
        lengths = []
        for i, p in enumerate(prompts):
            if (
                not isinstance(p, torch.Tensor)
                or p.dim() != 1
                or p.dtype != torch.long
                or p.numel() == 0
            ):
                raise InputError(
                    f"PrefillRunner.prefill: prompt {i} must be a non-empty 1-D LongTensor of "
                    f"token ids, got {type(p).__name__}"
                    + (
                        f" of shape {tuple(p.shape)} and dtype {p.dtype}"
                        if isinstance(p, torch.Tensor)
                        else ""
                    )
                )
            if p.device.type == "cpu" and (int(p.min()) < 0 or int(p.max()) >= self.vocab_size):
                # on the GPU an out-of-range id is a device-side assert that kills the process;
                # host prompts are checked for free (device prompts would need a sync)
                raise InputError(
                    f"PrefillRunner.prefill: prompt {i} holds token ids outside the vocabulary "
                    f"(0..{self.vocab_size - 1})."
                )
            lengths.append(p.numel())
        return lengths

    def close(self) -> None:
        """Release graphs and buffers; the model is exactly as before."""
        self._closed = True
        self._runner.close()
        self._layers.clear()


def _check_model(model: Any, who: str = "PrefillRunner") -> None:
    """Reject models the graphs cannot serve correctly; ``who`` names the caller in messages."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{who}: model type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    if (
        isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
        or hasattr(getattr(model, "forward", None), "_torchdynamo_orig_callable")
        or getattr(model, "_compiled_call_impl", None) is not None  # nn.Module.compile(), in place
    ):
        raise UnsupportedModelError(
            f"{who}: the model is compiled with torch.compile; pass the uncompiled model "
            "(breakgraph captures it itself)."
        )
    if model.training:
        raise UnsupportedModelError(
            f"{who}: the model is in training mode; call model.eval() first."
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type not in _STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{who}: rope_type {rope_type!r} recomputes its frequencies from the live "
            f"sequence length on the host; only static RoPE "
            f"({', '.join(map(str, _STATIC_ROPE_TYPES[1:]))}) can be captured."
        )
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise UnsupportedModelError(f"{who}: {name} is not supported.")
    if len({p.device for p in model.parameters()}) != 1:
        raise UnsupportedModelError(f"{who}: all parameters must be on one device.")
