"""The HuggingFace transformers integration: ``PrefillRunner`` against the eager model.

Every behavioural test runs on both backends (``backend`` fixture, see conftest):

* ``emulated``: CPU, fp32 weights, the per-sequence reference attention. Expect
  near-exact agreement with the eager model (``atol=rtol=1e-4`` on logits) and
  equal greedy tokens.
* ``cuda``: bf16 weights, so the runner uses FlashAttention (varlen) while the
  reference is the model's own SDPA attention. Tolerance (``assert_logits_close``):
  ``max|diff| <= max(0.01, 0.05 * max|ref|)`` on a prompt's last-token logits
  (random-init logits are ~0.5 in size; an H200 run showed errors <= 0.002), and
  the argmax must agree wherever the reference's top-2 margin exceeds
  ``ARGMAX_MARGIN`` (near-ties may flip in bf16). Tests that compare greedy
  continuations use fp32 on CUDA too (the runner then uses the reference
  attention, still inside CUDA graphs) so that no near-tie can make them flaky.

Models are tiny and randomly initialised from configs (no download): vocab 160,
hidden 64, intermediate 128, 2 layers, 4 query heads, 2 KV heads, head_dim 16.
Runners use buckets ``(16, 48)``, ``max_prompts=4`` and one warm-up run to keep
the file fast on a small CPU.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import breakgraph

transformers = pytest.importorskip("transformers")

from breakgraph.integrations.transformers import (  # noqa: E402
    ATTENTION_KEY,
    PrefillRunner,
    UnsupportedModelError,
    compat,  # noqa: E402
)
from breakgraph.integrations.transformers import attention as bg_attention  # noqa: E402
from breakgraph.integrations.transformers.models import check_model  # noqa: E402

from benchmarks.tiny_models import (  # noqa: E402
    DENSE_FAMILIES,
    MOE_FAMILIES,
    OTHER_DENSE_FAMILIES,
    TINY_SHAPE,
    from_config,
)
from breakgraph.errors import BreakgraphError, CaptureError, InputError, ReplayError  # noqa: E402

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("one_cpu_thread")]

VOCAB = 160
BUCKETS = (16, 48)
MAX_PROMPTS = 4
MAX_LEN = 20  # longest random prompt
ARGMAX_MARGIN = (
    0.05  # bf16 (cuda): argmax compared only where the reference's top-2 gap exceeds this
)

COMMON = dict(TINY_SHAPE, vocab_size=VOCAB, max_position_embeddings=512)

# name -> (config class name, extra config kwargs, number of MoE layers); Mistral's window is
# shorter than the prompts: the runner must apply it like the eager model does
ARCHS = {name: (cls, extra, 0) for name, (cls, extra) in DENSE_FAMILIES.items()}
ARCHS.update({name: (cls, dict(extra, num_experts_per_tok=2), 2)
              for name, (cls, extra) in MOE_FAMILIES.items()})  # fmt: skip
MOE_ARCHS = list(MOE_FAMILIES)
# partial RoPE, clip_qkv, qk-norm, Granite's multipliers, biases, LayerNorm, parallel blocks
ARCHS.update({name: (cls, extra, 0) for name, (cls, extra) in OTHER_DENSE_FAMILIES.items()})


# -- helpers ---------------------------------------------------------------------------------------
def make_config(arch: str, **overrides):
    cls_name, extra, _ = ARCHS[arch]
    return getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})


def build_model(
    arch: str,
    device: str,
    dtype: torch.dtype,
    seed: int = 0,
    experts_implementation: str = "eager",
    **overrides,
):
    """A tiny random-weight causal LM, SDPA attention, eval mode, reproducible weights.

    MoE models use transformers' eager experts loop (data-dependent ``nonzero`` and a
    Python loop: the case that needs an eager break) unless told otherwise.
    """
    config = make_config(arch, **overrides)
    torch.manual_seed(seed)
    extra = {"experts_implementation": experts_implementation} if ARCHS[arch][2] else {}
    model = from_config(config, dtype=dtype, **extra)
    return model.to(device).eval()


def device_dtype(backend: str):
    """emulated: fp32 on CPU; cuda: bf16 on the GPU (FlashAttention inside the runner)."""
    return ("cuda", torch.bfloat16) if backend == "cuda" else ("cpu", torch.float32)


def model_for(arch: str, backend: str, **overrides):
    device, dtype = device_dtype(backend)
    return build_model(arch, device, dtype, **overrides)


def moe_layers(model) -> int:
    """The layers whose experts breakgraph dispatches (AFMoE and EXAONE-MoE keep a dense first
    layer): an eager experts loop is a break in each."""
    return len(list(compat.experts_modules(model)))


def make_runner(model, backend: str, **kwargs) -> PrefillRunner:
    kwargs.setdefault("token_buckets", BUCKETS)
    kwargs.setdefault("max_prompts", MAX_PROMPTS)
    kwargs.setdefault("warmup", 1)
    # no routing by measured time: on these tiny, host-bound models it follows timing noise
    # (bucket 16 sent to 48 on an H200), and these tests count calls per bucket
    kwargs.setdefault("tune_buckets", False)
    return PrefillRunner(model, backend=backend, **kwargs)


def prompt(n: int, device, generator=None) -> torch.Tensor:
    return torch.randint(VOCAB, (n,), generator=generator).to(device)


def prompts_of(lengths, device, generator=None) -> list:
    return [prompt(n, device, generator) for n in lengths]


@torch.no_grad()
def eager_last_logits(model, p: torch.Tensor) -> torch.Tensor:
    """The reference: the unmodified model on this prompt alone."""
    return model(p[None], use_cache=False).logits[0, -1]


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, backend: str, what: str = "") -> None:
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite logits"
    if backend == "emulated":
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"{what}: {m}")
        top2 = ref.topk(2).values
        if top2[0] - top2[1] > 1e-3:
            assert got.argmax() == ref.argmax(), f"{what}: argmax differs"
        return
    tol = cuda_tolerance(ref)
    err = (got - ref).abs().max().item()
    assert err <= tol, f"{what}: max|diff| {err:.4f} > {tol:.4f} (bf16 tolerance)"
    top2 = ref.topk(2).values
    if (top2[0] - top2[1]).item() > ARGMAX_MARGIN:
        assert got.argmax() == ref.argmax(), f"{what}: argmax differs with a clear top-2 margin"


def cuda_tolerance(ref: torch.Tensor) -> float:
    """bf16: 5% of the reference's largest |logit| (floor 0.01). Observed on an H200: <= 0.4%."""
    return max(0.01, 0.05 * ref.float().abs().max().item())


def random_batches(generator: torch.Generator, count: int) -> list:
    """``count`` batches of 1..MAX_PROMPTS prompts of 1..MAX_LEN tokens that fit the largest
    bucket."""
    batches = []
    while len(batches) < count:
        n = int(torch.randint(1, MAX_PROMPTS + 1, (1,), generator=generator))
        lengths = torch.randint(1, MAX_LEN + 1, (n,), generator=generator).tolist()
        if sum(lengths) <= max(BUCKETS):
            batches.append(lengths)
    return batches


def experts_modules(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


def instance_forwards(model) -> list:
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


@pytest.fixture
def closing():
    """Close every runner a test made, even when it fails."""
    runners = []

    def track(runner):
        runners.append(runner)
        return runner

    yield track
    for runner in runners:
        runner.close()


# -- 1. every architecture: many batches through one capture ---------------------------------------
def test_grouped_mm_experts_are_captured_not_broken(backend, closing):
    """transformers' default grouped_mm experts are sync-free: they stay inside the segments."""
    model = model_for("qwen3_moe", backend, experts_implementation="grouped_mm")
    assert model.config._experts_implementation == "grouped_mm"
    device = next(model.parameters()).device
    runner = closing(make_runner(model, backend))
    for bucket in runner.buckets:
        assert runner.graph(bucket).num_breaks == model.config.num_hidden_layers
    generator = torch.Generator().manual_seed(7)
    for lengths in ([5, 11], [30, 2, 9]):
        prompts = prompts_of(lengths, device, generator)
        out = runner.prefill(prompts)
        for i, p in enumerate(prompts):
            assert_logits_close(out.logits[i], eager_last_logits(model, p), backend, f"prompt {i}")


def test_the_grouped_mm_probe_finds_biased_experts_too(monkeypatch):
    """``grouped_mm_captures`` probes the model's first experts module that ExpertsInterface
    dispatches, biased ones included (gpt-oss): it looked only at the modules the padding
    mask's cost model reads, found none in gpt-oss, and answered "captures" unprobed, so fp32
    gpt-oss on a GPU failed its first capture (the CB fuzzer, session 49). On the CPU the
    probe's capture is stood in for: what it calls, and what a failed capture answers."""
    import contextlib

    from breakgraph.integrations.transformers import compat, experts

    model = model_for("gpt_oss", "emulated", experts_implementation="grouped_mm")
    found = list(compat.experts_modules(model))
    assert len(found) == model.config.num_hidden_layers and found[0].has_bias
    assert compat.experts_shape(found[0]) is None  # all the probe looked for before
    assert list(compat.experts_modules(model_for("llama", "emulated"))) == []
    called, inside = [], []

    def grouped(module, hidden, index, weights):
        called.append(module)
        if inside:  # as transformers' fallback does inside a capture on the GPU
            raise breakgraph.HostSyncError("the experts' offsets copied to the host")
        return hidden

    @contextlib.contextmanager
    def capturing(*args, **kwargs):
        inside.append(True)
        yield

    monkeypatch.setattr(compat, "grouped_experts", lambda: grouped)
    monkeypatch.setattr(breakgraph, "BreakableCUDAGraph", lambda: None)
    monkeypatch.setattr(breakgraph, "capture", capturing)
    assert experts._capture_grouped_experts(model, torch.float32) is False
    assert called == [found[0], found[0]]  # the warm-up call, then the captured one


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_grouped_mm_experts_that_cannot_be_captured_run_as_breaks(arch, backend, closing,
                                                                  monkeypatch):  # fmt: skip
    """Where transformers' grouped_mm experts cannot be captured (fp32 or fp16 weights on CUDA,
    an A100: torch and transformers copy the experts' offsets to the host there), the runner
    kept them in its segments and the first capture raised ``HostSyncError`` (found by the CB
    fuzzer on the GPU, fp32; again in session 49 for gpt-oss, whose biased experts the probe
    passed by). ``grouped_mm_captures`` probes it when the runner is built, and the eager loop
    then runs as breaks. On the GPU the model is fp32 and the probe answers itself; on the
    CPU, where there is nothing to probe, it is made to say no."""
    from breakgraph.integrations.transformers import experts

    experts._grouped_captures.clear()  # probed afresh, on this model's first experts module
    model = model_for(arch, backend, experts_implementation="grouped_mm")
    if backend == "cuda":
        model.float()
    else:
        monkeypatch.setattr(experts, "grouped_mm_captures", lambda model: False)
    device = next(model.parameters()).device
    runner = closing(make_runner(model, backend))
    layers = model.config.num_hidden_layers
    breaks = layers + (0 if experts.grouped_mm_captures(model) else moe_layers(model))
    for bucket in runner.buckets:
        assert runner.graph(bucket).num_breaks == breaks
    generator = torch.Generator().manual_seed(8)
    for lengths in ([5, 11], [30, 2, 9]):
        prompts = prompts_of(lengths, device, generator)
        out = runner.prefill(prompts)
        for i, p in enumerate(prompts):
            assert_logits_close(out.logits[i], eager_last_logits(model, p), "emulated", f"{i}")
    assert model.config._experts_implementation == "grouped_mm"  # restored after each forward


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_matches_eager_per_prompt(arch, backend, closing):
    model = model_for(arch, backend)
    device = next(model.parameters()).device
    runner = closing(make_runner(model, backend))

    # topology: one eager break per attention layer, plus one per MoE layer (experts loop)
    layers, sparse = model.config.num_hidden_layers, moe_layers(model)
    assert runner.buckets == BUCKETS
    for bucket in runner.buckets:
        graph = runner.graph(bucket)
        assert graph.num_breaks == layers + sparse, graph
        assert graph.num_segments == graph.num_breaks + 1
        names = graph.break_names
        assert [n for n in names if n.startswith("attention")] == [
            f"attention[layer {i}]" for i in range(layers)
        ]
        assert sum(n == "experts_loop" for n in names) == sparse, names

    generator = torch.Generator().manual_seed(1234)
    # two batches filling each bucket exactly (no tail), then random ones
    batches = [[20, 20, 8], [9, 7]] + random_batches(generator, 6)
    for lengths in batches:
        prompts = prompts_of(lengths, device, generator)
        out = runner.prefill(prompts)
        # a row per head output: Apertus 1.5's head covers fewer tokens than its embedding
        assert out.logits.shape == (len(prompts), model.get_output_embeddings().weight.shape[0])
        assert out.bounds[-1][1] == sum(lengths)
        for i, p in enumerate(prompts):
            assert_logits_close(
                out.logits[i],
                eager_last_logits(model, p),
                backend,
                f"{arch} batch {lengths} prompt {i}",
            )

    assert runner.stats.calls[16] >= 1 and runner.stats.calls[48] >= 1, runner.stats
    assert sum(runner.stats.calls.values()) == len(batches)
    assert not runner.stats.eager_fallbacks


SLIDING = {
    # every layer windowed
    "mistral": dict(),
    # mixed: layer 0 full attention, layer 1 sliding (the window is passed per layer)
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    # mixed: layer 0 sliding, layer 1 full; Qwen2-MoE keeps the window on the module and passes
    # none (breakgraph's attention read no window: every key)
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
}


@pytest.mark.parametrize("arch", list(SLIDING))
def test_sliding_window_is_applied(arch, backend, closing):
    """sliding_window=8: runner == windowed eager model != the same weights without a window."""
    windowed = model_for(arch, backend, **SLIDING[arch])
    assert windowed.config.sliding_window == 8
    unwindowed = model_for(arch, backend, sliding_window=None)
    device = next(windowed.parameters()).device
    runner = closing(make_runner(windowed, backend))
    prompts = prompts_of([20, 3, 12], device)
    out = runner.prefill(prompts)
    for i, p in enumerate(prompts):
        ref = eager_last_logits(windowed, p)
        assert_logits_close(out.logits[i], ref, backend, f"prompt {i} (length {p.numel()})")
        full = eager_last_logits(unwindowed, p)
        if p.numel() <= 8:  # the window does not matter
            assert_logits_close(full, ref, backend, "short prompt")
        else:  # it does, clearly more than the tolerance
            assert (full.float() - ref.float()).abs().max().item() > 2 * cuda_tolerance(ref)


def test_a_window_the_config_does_not_imply_is_refused(backend):
    """A layer whose attention call gets another window than the config's ``layer_types`` imply
    (here a full layer's module given a window, which Qwen2 passes on): the model's own forward
    masks by the config, breakgraph's attention by the window it is passed, so the answer would
    differ silently. Refused at capture, naming the layer, both windows and the config's
    fields; the model keeps its attention setting."""
    model = model_for("qwen2", backend)
    assert model.config.layer_types[1] == "full_attention"
    model.model.layers[1].self_attn.sliding_window = 4
    with pytest.raises(UnsupportedModelError, match=r"layer 1 of this 'qwen2' model attends with "
                       r"sliding window 4, but its config implies None \(layer_types\[1\] = "
                       r"'full_attention', sliding_window = None\)"):
        make_runner(model, backend)
    assert model.config._attn_implementation == "sdpa"
    model.model.layers[1].self_attn.sliding_window = None  # as the config says: served
    make_runner(model, backend).close()


STATIC_ROPE = {
    "linear": dict(factor=2.0),
    "llama3": dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    ),
    "yarn": dict(factor=4.0, original_max_position_embeddings=16),
    # computed once, like default RoPE (transformers' dynamic_rope_update passes it by): it was
    # refused as if it recomputed its frequencies per sequence length
    "proportional": dict(partial_rotary_factor=0.5),
}


@pytest.mark.parametrize("rope_type", list(STATIC_ROPE))
def test_static_rope_types_match_the_eager_model(rope_type, backend, closing):
    rope = dict(STATIC_ROPE[rope_type], rope_type=rope_type, rope_theta=10000.0)
    model = model_for("llama", backend, rope_parameters=rope)
    assert model.model.rotary_emb.rope_type == rope_type
    runner = closing(make_runner(model, backend))
    prompts = prompts_of([20, 1, 16], next(model.parameters()).device)
    out = runner.prefill(prompts)
    for i, p in enumerate(prompts):
        assert_logits_close(out.logits[i], eager_last_logits(model, p), backend, f"prompt {i}")


def test_two_runners_interleaved(backend, closing):
    """Runners of two models (and a second one of the same model) do not disturb each other."""
    llama, moe = model_for("llama", backend), model_for("qwen3_moe", backend)
    device = next(llama.parameters()).device
    runners = [
        (llama, closing(make_runner(llama, backend))),
        (moe, closing(make_runner(moe, backend))),
        (llama, closing(make_runner(llama, backend, token_buckets=(32,)))),
    ]
    for lengths in ([4, 9], [13, 2, 1], [30]):
        for model, runner in runners:
            prompts = prompts_of(lengths, device)
            out = runner.prefill(prompts)
            for i, p in enumerate(prompts):
                assert_logits_close(
                    out.logits[i],
                    eager_last_logits(model, p),
                    backend,
                    f"{model.config.model_type} {lengths} prompt {i}",
                )


# -- 1b. single-prompt graphs: attention recorded, no break --------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "mixtral"])
def test_single_prompt_graphs_match_the_eager_model(arch, backend, closing):
    """One prompt replays its bucket's single-prompt graph, whose attention is recorded over
    the whole row (Mistral's window is shorter than the prompts; Mixtral's eager experts loop
    stays a break): logits and KV cache as the eager model's; a batch of several prompts
    still replays the packed graph; stats count both."""
    device = "cuda" if backend == "cuda" else "cpu"
    model = build_model(arch, device, torch.float32)  # fp32: the KV cache compared tightly
    runner = closing(make_runner(model, backend, single_prompt_graphs=True))
    assert sorted(runner.graphs()) == sorted((b, s) for b in BUCKETS for s in (False, True))
    layers, sparse = model.config.num_hidden_layers, moe_layers(model)
    for bucket in BUCKETS:
        assert runner.graph(bucket, single_prompt=True).num_breaks == sparse
        assert runner.graph(bucket).num_breaks == layers + sparse
        assert runner.graph(bucket, single_prompt=True).pool() == runner.graph(bucket).pool()
    generator = torch.Generator().manual_seed(3)
    lengths = (5, 16, 20, 48, 1)  # tails of 11, 0, 28, 0 and 15 tokens
    for n in lengths:
        p = prompt(n, device, generator)
        out = runner.prefill([p])
        assert_logits_close(out.logits[0], eager_last_logits(model, p), backend, f"{n} tokens")
        with torch.no_grad():
            own = model(p[None], use_cache=True).past_key_values
        for mine, theirs in zip(out.cache(0).layers, own.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(mine.values, theirs.values, atol=1e-4, rtol=1e-4)
    assert runner._single.stats.replays == len(lengths) and runner._runner.stats.replays == 0
    batch = prompts_of([3, 9], device, generator)
    out = runner.prefill(batch)
    for i, p in enumerate(batch):
        assert_logits_close(out.logits[i], eager_last_logits(model, p), backend, f"prompt {i}")
    assert runner._runner.stats.replays == 1
    assert sum(runner.stats.calls.values()) == len(lengths) + 1  # both ladders counted
    assert runner.stats.captures == 2 * len(BUCKETS)


def test_single_prompt_graphs_are_on_by_default_on_cuda_only(backend, closing):
    model = model_for("llama", backend)
    runner = closing(make_runner(model, backend))
    assert (runner._single is not None) == (backend == "cuda")
    if backend != "cuda":
        with pytest.raises(InputError, match="single_prompt_graphs was off"):
            runner.graph(16, single_prompt=True)
        assert sorted(runner.graphs()) == [(b, False) for b in BUCKETS]
    for bad in ("yes", 1, 0):  # 1 and 0 passed as True and False (1 == True)
        with pytest.raises(InputError, match="single_prompt_graphs must be None"):
            make_runner(model, backend, single_prompt_graphs=bad)


# -- 2. greedy continuation from the runner's KV cache ---------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", *OTHER_DENSE_FAMILIES])
def test_generate_continues_from_prefill_cache(arch, backend, closing, monkeypatch):
    # fp32 on both backends: greedy decoding must not depend on bf16 near-ties
    # (on CUDA fp32 the runner uses its reference attention, still inside CUDA graphs).
    device = "cuda" if backend == "cuda" else "cpu"
    model = build_model(arch, device, torch.float32)
    runner = closing(make_runner(model, backend, on_miss="eager"))
    # a batch above the largest bucket: the eager fallback, the same logits, its attention
    # called, not decorated as a break (7 us per layer)
    decorated = []
    original = breakgraph.eager_on_graph
    monkeypatch.setattr(breakgraph, "eager_on_graph", lambda *a, **k: (
        decorated.append(a), original(*a, **k))[1])  # fmt: skip
    over = prompts_of([30, 25], device)
    out = runner.prefill(over)
    assert runner.stats.eager_fallbacks == {"larger than every bucket": 1} and not decorated
    monkeypatch.undo()
    for i, p in enumerate(over):
        assert_logits_close(out.logits[i], eager_last_logits(model, p), backend, f"eager {i}")
    prompts = prompts_of([6, 13, 3], device)
    out = runner.prefill(prompts)
    for i, p in enumerate(prompts):
        cache = out.cache(i)
        # the keys/values are the model's own (post-RoPE, windowed caches trimmed alike)
        with torch.no_grad():
            own = model(p[None], use_cache=True).past_key_values
        assert cache.get_seq_length() == own.get_seq_length() > 0
        assert len(cache.layers) == len(own.layers) == model.config.num_hidden_layers
        for layer, (mine, theirs) in enumerate(zip(cache.layers, own.layers)):
            torch.testing.assert_close(
                mine.keys,
                theirs.keys,
                atol=1e-4,
                rtol=1e-4,
                msg=lambda m: f"prompt {i} layer {layer} keys: {m}",
            )
            torch.testing.assert_close(
                mine.values,
                theirs.values,
                atol=1e-4,
                rtol=1e-4,
                msg=lambda m: f"prompt {i} layer {layer} values: {m}",
            )

        first = out.logits[i].argmax()
        continued = model.generate(
            torch.cat([p, first[None]])[None],
            past_key_values=out.cache(i),
            max_new_tokens=4,
            do_sample=False,
        )
        reference = model.generate(p[None], max_new_tokens=5, do_sample=False)
        assert continued.tolist() == reference.tolist(), f"prompt {i}"


# -- 3. the KV cache lives in graph memory ---------------------------------------------------------
def test_cache_is_invalidated_by_next_prefill(backend, closing):
    model = model_for("llama", backend)
    device = next(model.parameters()).device
    runner = closing(make_runner(model, backend))
    first = runner.prefill(prompts_of([5, 7], device))
    logits = first.logits.clone()
    first.cache(1)  # fine before the next prefill
    with pytest.raises(InputError, match="out of range"):
        first.cache(2)
    with pytest.raises(InputError, match="out of range"):
        first.cache(-1)
    for bad in (0.0, "0", True, torch.tensor([0]), torch.tensor(True), torch.tensor(1 + 0j)):
        with pytest.raises(InputError, match="i must be a prompt's index"):
            first.cache(bad)
    assert first.cache(torch.tensor(1)).get_seq_length() == 7  # a 0-d integer tensor is an index

    second = runner.prefill(prompts_of([4], device))
    with pytest.raises(InputError, match="later prefill"):
        first.cache(0)
    assert second.cache(0).get_seq_length() == 4
    # logits are owned: the next prefill does not touch them
    assert torch.equal(first.logits, logits)


# -- 4. the model is left alone --------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_model_untouched_and_usable(arch, backend):
    model = model_for(arch, backend)
    device = next(model.parameters()).device
    original_impl = model.config._attn_implementation
    assert original_impl == "sdpa"
    p = prompt(9, device)
    baseline = eager_last_logits(model, p)
    baseline_generate = model.generate(p[None], max_new_tokens=3, do_sample=False)
    if ARCHS[arch][2]:
        assert experts_modules(model)
    assert instance_forwards(model) == []

    def assert_untouched():
        assert model.config._attn_implementation == original_impl
        assert instance_forwards(model) == []
        assert bg_attention._running.get() is None
        assert model.config._experts_implementation in (None, "eager", "grouped_mm")
        assert torch.equal(eager_last_logits(model, p), baseline)
        assert torch.equal(
            model.generate(p[None], max_new_tokens=3, do_sample=False), baseline_generate
        )

    runner = make_runner(model, backend)
    try:
        assert_untouched()  # after capture
        other = prompts_of([4, 11], device)
        out = runner.prefill(other)
        assert_untouched()  # after a replay
        # the runner still works after the model ran eagerly in between
        again = runner.prefill(other)
        assert torch.equal(again.logits, out.logits)
        for i, q in enumerate(other):
            assert_logits_close(
                again.logits[i], eager_last_logits(model, q), backend, f"prompt {i}"
            )
    finally:
        runner.close()
    assert_untouched()
    with pytest.raises(ReplayError, match="closed"):
        runner.prefill([p])


def test_attention_outside_runner_raises(backend):
    model = model_for("llama", backend)
    model.set_attn_implementation(ATTENTION_KEY)
    with pytest.raises(CaptureError, match="outside a PrefillRunner"), torch.no_grad():
        model(prompt(3, next(model.parameters()).device)[None], use_cache=False)


# -- 5. errors -------------------------------------------------------------------------------------
def test_input_errors(backend, closing):
    model = model_for("llama", backend)
    device = next(model.parameters()).device
    runner = closing(make_runner(model, backend))
    with pytest.raises(InputError, match="exceed max_prompts=4"):
        runner.prefill(prompts_of([2] * 5, device))
    with pytest.raises(InputError, match="exceed the largest token bucket 48"):
        runner.prefill(prompts_of([20, 20, 9], device))
    with pytest.raises(InputError, match="non-empty list"):
        runner.prefill([])
    with pytest.raises(InputError, match="non-empty list"):
        runner.prefill(prompt(5, device))  # a bare tensor, not a list
    for owned in ("no", 0, None, torch.tensor(True)):  # "no" was truthy: an owned copy
        with pytest.raises(InputError, match="owned must be True or False"):
            runner.prefill([prompt(5, device)], owned=owned)
    bad = {
        "2-D": prompt(6, device)[None],
        "int32": prompt(6, device).int(),
        "float": prompt(6, device).float(),
        "empty": prompt(0, device),
        "list of ints": [1, 2, 3],
    }
    for _what, p in bad.items():
        with pytest.raises(InputError, match="1-D LongTensor"):
            runner.prefill([prompt(3, device), p])
    # what a tokenizer gives, or text: each refusal says what to pass (a tokenizer's output was
    # read as a list of its keys: "prompt 0 must be a ... LongTensor, got str")
    encoding = transformers.BatchEncoding({"input_ids": [[5, 6]], "attention_mask": [[1, 1]]})
    advice = {
        r"encoding\['input_ids'\]": encoding,
        "not text": ["a prompt"],
        r"pass ids\[0\]": [prompt(6, device)[None]],
        r"ids.long\(\)": [prompt(6, device).int()],
        r"torch.tensor\(ids\)": [[5, 6]],
        r"\[torch.tensor\(ids\)\]": [5, 6],
        r"list\(ids\)": torch.stack([prompt(6, device)] * 2),
    }
    for hint, prompts in advice.items():
        with pytest.raises(InputError, match=hint):
            runner.prefill(prompts)
    with pytest.raises(InputError, match="outside the vocabulary"):
        runner.prefill([torch.tensor([1, VOCAB, 2])])  # host prompts are checked for free
    with pytest.raises(InputError, match="pad_token_id"):
        make_runner(model, backend, pad_token_id=VOCAB)
    # a refused call leaves the runner working; prompts may live on the CPU
    p = prompt(7, device)
    assert_logits_close(
        runner.prefill([p]).logits[0], eager_last_logits(model, p), backend, "after errors"
    )
    assert_logits_close(
        runner.prefill([p.cpu()]).logits[0], eager_last_logits(model, p), backend, "CPU prompt"
    )
    assert not runner.stats.eager_fallbacks


def test_on_miss_eager_runs_and_matches(backend, closing):
    model = model_for("llama", backend)
    device = next(model.parameters()).device
    runner = closing(make_runner(model, backend, on_miss="eager"))
    prompts = prompts_of([20, 20, 19], device)  # 59 tokens > 48
    out = runner.prefill(prompts)
    assert runner.stats.eager_fallbacks == {"larger than every bucket": 1}
    long = prompts_of([60], device)[0]  # one prompt longer than the largest bucket
    torch.testing.assert_close(
        runner.prefill([long]).logits[0].float(),
        eager_last_logits(model, long).float(),
        atol=0.1,
        rtol=0.05,
    )
    assert sum(runner.stats.calls.values()) == 0
    for i, p in enumerate(prompts):
        assert_logits_close(
            out.logits[i], eager_last_logits(model, p), backend, f"eager prompt {i}"
        )
    with pytest.raises(InputError, match="ran eagerly"):
        out.cache(0)
    # and the graphs still serve batches that fit
    small = prompts_of([3, 5], device)
    out = runner.prefill(small)
    assert runner.stats.calls[16] == 1
    for i, p in enumerate(small):
        assert_logits_close(
            out.logits[i], eager_last_logits(model, p), backend, f"graph prompt {i}"
        )
    assert model.config._attn_implementation == "sdpa"


def test_a_huge_max_prompts_is_cheap(closing):
    """PrefillRunner(max_prompts=10**6) took 4.6 s and 600 MB to build (a view of the
    boundaries for every prompt count, host and device buffers of 10**6 entries), and every
    call copied them: for nothing, since a graph's batch holds at most as many prompts as its
    bucket has tokens. With on_miss="raise" the buffers now hold the largest bucket's count;
    with on_miss="eager" they hold max_prompts, but the views only the graphs' counts (an
    eager batch of more prompts than any bucket has tokens slices its own)."""
    model = model_for("llama", "emulated")
    generator = torch.Generator().manual_seed(4)
    runner = closing(make_runner(model, "emulated", max_prompts=10**6))
    assert runner.max_prompts == 10**6 and runner._steps.max_prompts == BUCKETS[-1]
    assert len(runner._steps.cu_views) == BUCKETS[-1] + 3
    prompts = prompts_of([1] * BUCKETS[-1], "cpu", generator)  # the most a graph serves
    out = runner.prefill(prompts)
    for i in (0, BUCKETS[-1] - 1):
        assert_logits_close(out.logits[i], eager_last_logits(model, prompts[i]), "emulated")
    with pytest.raises(InputError, match="exceed the largest token bucket"):
        runner.prefill(prompts_of([1] * (BUCKETS[-1] + 1), "cpu", generator))
    runner.close()
    runner = closing(make_runner(model, "emulated", max_prompts=200, on_miss="eager"))
    assert runner._steps.max_prompts == 200 and len(runner._steps.cu_views) == BUCKETS[-1] + 3
    prompts = prompts_of([1, 2] * 30, "cpu", generator)  # 60 prompts, 90 tokens: eagerly
    out = runner.prefill(prompts)
    assert runner.stats.eager_fallbacks == {"larger than every bucket": 1}
    for i in (0, 47, 48, 59):
        assert_logits_close(out.logits[i], eager_last_logits(model, prompts[i]), "emulated")


def _assert_unsupported(model, match, **kwargs):
    with pytest.raises(UnsupportedModelError, match=match) as info:
        PrefillRunner(
            model,
            token_buckets=BUCKETS,
            max_prompts=MAX_PROMPTS,
            backend="emulated",
            warmup=1,
            **kwargs,
        )
    assert isinstance(info.value, BreakgraphError) and isinstance(info.value, ValueError)


def _tiny(config_cls, attn_implementation="sdpa", **kwargs):
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**kwargs)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation
    ).eval()


def test_unsupported_models():
    # these checks run before anything is captured: CPU and the emulated backend suffice
    gpt2 = _tiny("GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4, n_positions=64)
    _assert_unsupported(gpt2, "model type 'gpt2' is not supported")

    dynamic = _tiny(
        "LlamaConfig",
        **COMMON,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    assert dynamic.config.rope_parameters["rope_type"] == "dynamic"
    # PrefillRunner serves it up to its original length (tests/test_rope.py), not CB
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic' keeps its frequencies"):
        check_model(dynamic, "enable_continuous_batching")
    dynamic.model.rotary_emb.rope_type = "dynamic_v2"  # a switched type breakgraph knows not
    _assert_unsupported(dynamic, "rope_type 'dynamic' is not static RoPE")

    training = _tiny("LlamaConfig", **COMMON).train()
    _assert_unsupported(training, "training mode")
    one_layer = _tiny("LlamaConfig", **COMMON)
    one_layer.model.layers[0].self_attn.train()  # eval() for the model, not for this module
    _assert_unsupported(one_layer, r"training mode \(model.layers.0.self_attn, ")

    with torch.device("meta"):
        on_meta = _tiny("LlamaConfig", **COMMON)
    _assert_unsupported(on_meta, "meta device")

    compiled = torch.compile(_tiny("LlamaConfig", **COMMON))  # an OptimizedModule; never run
    _assert_unsupported(compiled, "torch.compile")

    in_place = _tiny("LlamaConfig", **COMMON)
    in_place.compile()  # nn.Module.compile(): compiled in place, same class
    _assert_unsupported(in_place, "torch.compile")

    too_long = _tiny("LlamaConfig", **{**COMMON, "max_position_embeddings": 32})
    _assert_unsupported(too_long, "max_position_embeddings=32")

    if hasattr(transformers, "Gemma2Config"):  # softcapped attention and logits
        # newer transformers refuse sdpa for Gemma2 (softcapping): build it with eager attention
        gemma2 = _tiny("Gemma2Config", attn_implementation="eager", **COMMON, head_dim=16)
        assert gemma2.config.attn_logit_softcapping is not None
        _assert_unsupported(gemma2, "gemma2")
    # the softcapping check itself, on a type that is otherwise supported
    softcapped = _tiny("GemmaConfig", **COMMON, head_dim=16)
    softcapped.config.attn_logit_softcapping = 50.0
    _assert_unsupported(softcapped, "attn_logit_softcapping")


def test_bidirectional_attention_is_refused():
    """Gemma's ``use_bidirectional_attention=True`` clears ``is_causal`` on its attention
    modules: HF's own SDPA attention then attends to every token, and breakgraph's causal
    attention silently computed other logits (0.003 apart on the tiny Gemma)."""
    model = _tiny("GemmaConfig", **COMMON, head_dim=16, use_bidirectional_attention=True)
    assert model.model.layers[0].self_attn.is_causal is False
    _assert_unsupported(model, r"bidirectional \(is_causal=False on model.layers.0.self_attn")


def test_an_embedding_with_fewer_rows_than_the_vocabulary_prefills_its_ids(closing):
    """A model whose input embedding holds fewer rows than ``config.vocab_size`` (swapped or
    resized without its config) failed ``PrefillRunner(model)`` with torch's raw
    ``IndexError``: capture staged random ids from the whole config vocabulary. The runner's
    vocabulary is now the ids the embedding holds: those prefill as the eager model does, the
    others are refused by name. A wider LM head than the config says is served as is."""
    model = _tiny("LlamaConfig", **COMMON)
    model.model.embed_tokens = torch.nn.Embedding(VOCAB - 28, COMMON["hidden_size"])
    model.lm_head = torch.nn.Linear(COMMON["hidden_size"], VOCAB + 8, bias=False)
    model.eval()
    runner = closing(make_runner(model, "emulated"))
    assert runner.vocab_size == VOCAB - 28
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(VOCAB - 28, (n,), generator=generator) for n in (5, 11)]
    out = runner.prefill(prompts)
    assert out.logits.shape == (2, VOCAB + 8)
    for got, p in zip(out.logits, prompts):
        assert_logits_close(got, eager_last_logits(model, p), "emulated")
    with pytest.raises(InputError, match=rf"outside the vocabulary \(0\.\.{VOCAB - 29}\)"):
        runner.prefill([torch.tensor([1, VOCAB - 28])])


def test_gemma3_refusals_read_its_per_layer_type_settings():
    """Gemma 3 keeps a RoPE setting per layer type (``rope_parameters`` keyed by
    ``sliding_attention``/``full_attention``): a dynamic RoPE on its global layers (recomputed
    per call from the live length, which a graph would freeze) passed the check unrefused
    while it read only a top-level ``rope_type``; continuous batching refuses it (PrefillRunner
    serves it up to its original length: tests/test_rope.py). Its softcapping and
    bidirectional attention are refused like Gemma's and Gemma 2's."""
    rope = make_config("gemma3_text").rope_parameters
    dynamic = dict(rope, full_attention=dict(rope_type="dynamic", factor=2.0, rope_theta=1e6))
    model = build_model("gemma3_text", "cpu", torch.float32, rope_parameters=dynamic)
    assert model.model.rotary_emb.rope_type == {"sliding_attention": "default",
                                                "full_attention": "dynamic"}  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic' keeps its frequencies"):
        check_model(model, "enable_continuous_batching")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        _assert_unsupported(build_model("gemma3_text", "cpu", torch.float32, **{name: 30.0}), name)
    model = build_model("gemma3_text", "cpu", torch.float32, use_bidirectional_attention=True)
    _assert_unsupported(model, r"bidirectional \(is_causal=False on model.layers.0.self_attn")


def test_a_tested_release_supports_every_feature_its_probes_decide():
    """The CB and serve tests skip where the library's probe says a feature is unsupported, so a
    probe that broke on a tested release would pass CI as skips. On a tested release every
    feature must probe supported; serve needs transformers' serving extras, which CI installs."""
    import importlib.util

    if transformers.__version__ not in compat.TESTED_VERSIONS:
        pytest.skip(f"transformers {transformers.__version__} is not a tested release")
    features = [f for f in compat.FEATURES if f != "serve" or importlib.util.find_spec("fastapi")]
    assert {f: compat.problems(f) for f in features} == {f: () for f in features}


def test_the_tested_releases_are_the_declared_range_every_minor_release():
    """``compat.TESTED_VERSIONS`` (what ``.ci/run`` runs) holds one release of every minor
    version of pyproject's declared range, oldest first: a release left out broke unseen."""
    import pathlib
    import re

    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    declared = set(re.findall(r'"transformers(?:\[serving\])?>=5\.(\d+),<5\.(\d+)"', pyproject))
    assert len(declared) == 1, declared  # the transformers and serve extras agree
    low, high = (int(v) for v in declared.pop())
    minors = [int(v.split(".")[1]) for v in compat.TESTED_VERSIONS]
    assert minors == list(range(low, high)), (compat.TESTED_VERSIONS, low, high)


def test_bad_runner_arguments():
    model = _tiny("LlamaConfig", **COMMON)
    for bad in (0, 2.0, True, None):
        with pytest.raises(InputError, match="PrefillRunner: max_prompts must be an int >= 1"):
            PrefillRunner(model, token_buckets=BUCKETS, max_prompts=bad, backend="emulated")
    for bad in (-1, 1.0, None):
        with pytest.raises(InputError, match="PrefillRunner: warmup must be an int >= 0"):
            PrefillRunner(model, token_buckets=BUCKETS, warmup=bad, backend="emulated")
    import numpy as np

    PrefillRunner(model, token_buckets=BUCKETS, pad_token_id=np.int64(3), backend="emulated",
                  warmup=1).close()  # any integer type of the vocabulary  # fmt: skip
    # a Llama config's pad_token_id is None: refused by name, not by a comparison's TypeError
    for bad in (None, True, 3.0, -1, model.config.vocab_size):
        with pytest.raises(InputError, match=r"pad_token_id must be a token id .*got "):
            PrefillRunner(model, token_buckets=BUCKETS, pad_token_id=bad, backend="emulated")
    with pytest.raises(InputError, match="attention must be"):
        PrefillRunner(model, token_buckets=BUCKETS, attention="sdpa", backend="emulated")
    # named as PrefillRunner's (it was the inner BucketedRunner's name) and checked before any
    # capture; the TP timeout and the two flags too, where the model is not tensor-parallel
    # (they were taken silently there)
    with pytest.raises(InputError, match="PrefillRunner: on_miss must be 'raise' or 'eager'"):
        PrefillRunner(model, token_buckets=BUCKETS, on_miss="pad", backend="emulated", warmup=1)
    for bad in ("30", 0, -1.0, None, True, float("inf"), float("nan")):  # inf: a raw error
        with pytest.raises(InputError, match="PrefillRunner: tp_timeout must be"):
            PrefillRunner(model, token_buckets=BUCKETS, tp_timeout=bad, backend="emulated")
    for name in ("progress", "tune_buckets"):
        with pytest.raises(InputError, match=f"PrefillRunner: {name} must be True or False"):
            PrefillRunner(model, token_buckets=BUCKETS, backend="emulated", **{name: "no"})
    for bad in ("16", (2.5,), (True, 16), (0, 16), ()):  # validated as every runner's buckets
        with pytest.raises(InputError, match="PrefillRunner: token_buckets: bucket sizes must"):
            PrefillRunner(model, token_buckets=bad, backend="emulated", warmup=1)
    for bad in ("yes", 1, None):  # as enable_continuous_batching: a bool or torch.compile's dict
        with pytest.raises(InputError, match="PrefillRunner: compile must be True, False or a"):
            PrefillRunner(model, token_buckets=BUCKETS, compile=bad, backend="emulated")
    assert model.config._attn_implementation == "sdpa"


def test_no_gpu_and_no_backend_names_the_runner_to_pass_it_to(monkeypatch):
    """The README's ``PrefillRunner(model, ...)`` on a machine without a GPU said
    ``breakgraph.capture: ... pass backend='emulated' to capture()``: a function the user never
    called. The error names the runner it came from, and where ``backend=`` goes."""
    from breakgraph.errors import BackendError
    from breakgraph.runner import BucketedRunner

    monkeypatch.delenv("BREAKGRAPH_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = _tiny("LlamaConfig", **COMMON)
    with pytest.raises(BackendError, match=r"^PrefillRunner: no CUDA .* backend='emulated' to "
                       r"PrefillRunner \(or set .*BREAKGRAPH_BACKEND=emulated\)"):  # fmt: skip
        PrefillRunner(model, token_buckets=BUCKETS)
    with pytest.raises(BackendError, match=r"^BucketedRunner: .* backend='emulated' to Bucketed"):
        BucketedRunner(lambda x: x * 2, (4,), (torch.ones(1),))
    with pytest.raises(BackendError, match=r"^BucketedRunner: backend 'cuda' was requested"):
        BucketedRunner(lambda x: x * 2, (4,), (torch.ones(1),), backend="cuda")
    with pytest.raises(BackendError, match=r"^breakgraph.capture: .* to capture\(\)"):
        with breakgraph.capture(breakgraph.BreakableCUDAGraph()):
            pass  # pragma: no cover
    assert model.config._attn_implementation == "sdpa"


# -- 6. padding hygiene ----------------------------------------------------------------------------
PAD_ID = 7


def test_small_batch_after_big_batch_same_bucket(backend, closing):
    """Stale rows of an earlier, bigger batch never reach a later batch's logits."""
    model = model_for("llama", backend)
    device = next(model.parameters()).device
    small = prompts_of([3, 5], device)
    cases = {16: small, 48: [prompt(20, device)] + small}  # bucket -> a batch with a tail

    # reference: each batch run first in its bucket, on a fresh runner
    fresh = closing(make_runner(model, backend, pad_token_id=PAD_ID))
    expected = {bucket: fresh.prefill(prompts).logits for bucket, prompts in cases.items()}

    runner = closing(make_runner(model, backend, pad_token_id=PAD_ID))
    runner.prefill(prompts_of([8, 7], device))  # 15 tokens: bucket 16 almost full
    runner.prefill(prompts_of([12, 11, 13, 10], device))  # 46 tokens: bucket 48 almost full
    for bucket, prompts in cases.items():
        lengths = [p.numel() for p in prompts]
        assert runner._runner.bucket_for(sum(lengths)) == bucket
        got = runner.prefill(prompts).logits
        if backend == "emulated":
            assert torch.equal(got, expected[bucket]), (
                f"bucket {bucket}: stale rows changed the logits"
            )
        else:
            torch.testing.assert_close(got, expected[bucket], atol=1e-2, rtol=0)
        for i, p in enumerate(prompts):
            assert_logits_close(
                got[i], eager_last_logits(model, p), backend, f"bucket {bucket} prompt {i}"
            )
        # every static input row beyond the batch was rewritten
        ids, positions = runner._runner.static_inputs(bucket)
        total = sum(lengths)
        assert ids.shape == positions.shape == (1, bucket)
        assert torch.equal(ids[0, :total].cpu(), torch.cat(prompts).cpu())
        assert (ids[0, total:] == PAD_ID).all(), ids
        tail = torch.arange(total, bucket, device=positions.device)  # the resting positions
        assert torch.equal(positions[0, total:], tail), positions
        assert torch.equal(
            positions[0, :total].cpu(), torch.cat([torch.arange(n) for n in lengths])
        )


def test_a_bucket_smaller_than_max_prompts_runs_lm_head_over_one_row_per_token(backend, closing):
    """A bucket of ``b`` tokens holds at most ``b`` prompts, so its graph gathers
    ``min(b, max_prompts)`` last hidden states for ``lm_head``: bucket 4 with max_prompts=16
    ran ``lm_head`` over 16 rows on every call (12 of them a copy of the first token's; with a
    large vocabulary the LM head is a large share of a small bucket's forward)."""
    model = model_for("llama", backend)
    device = next(model.parameters()).device
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    try:
        runner = closing(make_runner(model, backend, token_buckets=(4, 32), max_prompts=16,
                                     single_prompt_graphs=False))  # CUDA's default: True
    finally:
        hook.remove()
    assert sorted(set(rows)) == [4, 16], rows  # bucket 4's forwards: 4 rows; bucket 32's: 16
    for lengths in ([1, 1, 1, 1], [2, 1], [4], [3, 5, 1, 2, 6, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1]):
        prompts = prompts_of(lengths, device)
        out = runner.prefill(prompts)
        assert out.logits.shape == (len(lengths), VOCAB)
        for i, p in enumerate(prompts):
            assert_logits_close(out.logits[i], eager_last_logits(model, p), backend, f"{i}")
    # a single-prompt graph holds one prompt: one row (it ran min(bucket, max_prompts))
    rows.clear()
    hook = model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    try:
        single = closing(make_runner(model, backend, token_buckets=(4, 32), max_prompts=16,
                                     single_prompt_graphs=True))  # fmt: skip
    finally:
        hook.remove()
    assert sorted(set(rows)) == [1, 4, 16], rows  # the packed ladder's as above, then ones
    for n in (3, 20):
        p = prompts_of([n], device)[0]
        out = single.prefill([p])
        assert_logits_close(out.logits[0], eager_last_logits(model, p), backend, "single")
    assert single._single.stats.replays == 2 and single._runner.stats.replays == 0


def test_autocast_around_the_runner_changes_nothing(backend, closing):
    """The graphs compute in the model's dtype: a replay ignores the caller's autocast, so the
    eager parts must too. Under ``torch.autocast`` the attention breaks ran in half precision
    inside fp32 graphs, and the eager fallback returned bf16 logits where the graphs return
    fp32; a runner built under autocast captured half-precision segments."""
    model = model_for("llama", backend)
    device = next(model.parameters()).device
    kind = device.type
    plain = closing(make_runner(model, backend, on_miss="eager"))
    with torch.autocast(kind, dtype=torch.bfloat16):
        built_under = closing(make_runner(model, backend, on_miss="eager"))
    batches = (prompts_of([5, 9], device), prompts_of([30, 25], device))  # graph, eager
    for prompts in batches:
        expected = plain.prefill(prompts).logits
        with torch.autocast(kind, dtype=torch.bfloat16):
            got = plain.prefill(prompts).logits
        assert got.dtype == expected.dtype == model.dtype
        exact = dict(atol=0, rtol=0) if backend == "emulated" else dict(atol=1e-2, rtol=0)
        torch.testing.assert_close(got, expected, **exact)
        torch.testing.assert_close(built_under.prefill(prompts).logits, expected, **exact)


# -- 7. attention kernels by backend ---------------------------------------------------------------
def test_flash_attention_needs_the_cuda_backend(backend):
    """fp32 on the CPU has no FlashAttention, and on a GPU in bf16 the emulated backend still
    refuses it (it reproduces the CUDA graph semantics, not the kernels): refused up front."""
    model = model_for("llama", backend)
    _assert_unsupported(model, "needs the CUDA backend", attention="flash")
    # the one-graph baseline (attention inside the graph) is the benchmarks' own variant
    # (benchmarks/one_graph.py), not an option of the product
    with pytest.raises(InputError, match="attention must be one of 'auto', 'flash', 'reference'"):
        make_runner(model, "emulated", attention="captured")


@pytest.mark.parametrize(
    "prompt, window, kernel",
    [
        (13, None, "sdpa"),  # one prompt, a padding tail of 7 rows
        (20, None, "sdpa"),  # one prompt filling the bucket
        (13, 20, "sdpa"),  # a window as wide as the row never binds
        (13, 8, "varlen"),  # a window that binds: SDPA's is_causal cannot express it
    ],
)
def test_one_prompt_runs_causal_sdpa_over_the_row(prompt, window, kernel, monkeypatch):
    """A batch of one prompt runs HF's own causal SDPA call over the whole bucket row (the
    padding rows follow the prompt, so causality keeps them out of its rows); anything
    else runs the varlen kernel. CPU, fp32: the SDPA path against the exact reference."""
    rows, heads, kv_heads, dim = 20, 4, 2, 16
    generator = torch.Generator().manual_seed(prompt + (window or 0))
    q, k, v = (
        torch.randn(1, h, rows, dim, generator=generator) for h in (heads, kv_heads, kv_heads)
    )
    bounds = [(0, prompt)] + ([(prompt, rows)] if prompt < rows else [])
    exact = bg_attention.reference_attention(
        *(t[0].transpose(0, 1) for t in (q, k, v)), bounds, 0.25, window
    )
    seen = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling, window, out=None, sinks=None):
        seen.append("varlen")
        return out.copy_(exact)

    monkeypatch.setattr(bg_attention, "flash_varlen", fake_varlen)
    out = torch.full((rows, heads, dim), float("nan"))
    call = bg_attention.LayerAttention(0, q, k, v, 0.25, window, "flash", out=out)
    batch = bg_attention.PackedBatch(bounds, None, prompt, one_prompt=True)
    for _ in range(2):  # the head-major views of ``out`` are made once, then reused
        with breakgraph.context_scope(batch):
            got = call()
    assert got is out and seen == ["varlen"] * (2 if kernel == "varlen" else 0)
    torch.testing.assert_close(got[:prompt], exact[:prompt], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()  # the tail rows are written too
    # several prompts in the row: always the varlen kernel
    two = bg_attention.PackedBatch([(0, 5), (5, prompt)], None, prompt - 5, one_prompt=False)
    seen.clear()
    with breakgraph.context_scope(two):
        call()
    assert seen == ["varlen"]


def test_sinks_send_one_prompt_to_the_varlen_kernel(monkeypatch):
    """Attention sinks (gpt-oss) need the kernel's log-sum-exp, which HF's causal SDPA call
    does not return: with sinks a single prompt runs the varlen kernel too, handed the sinks,
    and the reference kernel applies them (against softmax with a sink column, per head)."""
    rows, heads, kv_heads, dim = 12, 4, 2, 16
    generator = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, h, rows, dim, generator=generator) for h in (heads, kv_heads, kv_heads)
    )
    sinks = torch.tensor([-2.0, 0.5, 3.0, -0.25])
    seen = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling, window, out=None, sinks=None):
        seen.append(sinks)
        return out

    monkeypatch.setattr(bg_attention, "flash_varlen", fake_varlen)
    out = torch.empty(rows, heads, dim)
    call = bg_attention.LayerAttention(0, q, k, v, 0.25, None, "flash", out, sinks=sinks)
    with breakgraph.context_scope(bg_attention.PackedBatch([(0, 9), (9, 12)], None, 9, True)):
        call()
    call.whole_row(call.out)
    assert len(seen) == 2 and all(s is sinks for s in seen)
    # the reference: a softmax over each row's scores and the head's sink, the sink dropped
    qs, ks, vs = (t[0].transpose(0, 1) for t in (q, k, v))
    got = bg_attention.reference_attention(qs, ks, vs, [(0, rows)], 0.25, None, sinks=sinks)
    keys = k[0].repeat_interleave(2, 0)
    scores = (q[0] @ keys.transpose(1, 2)) * 0.25
    scores = scores.masked_fill(torch.ones(rows, rows).triu(1).bool(), float("-inf"))
    column = sinks[:, None, None].expand(heads, rows, 1)
    weights = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
    expected = (weights @ v[0].repeat_interleave(2, 0)).transpose(0, 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("in_place", [False, True], ids=["torch<2.12", "in_place"])
def test_flash_varlen_scales_its_rows_by_the_sinks(monkeypatch, in_place):
    """``flash_varlen`` with sinks scales the kernel's output by ``sigmoid(lse - sink)`` from the
    log-sum-exp the kernel returns (``[heads, rows]``), on the first ``rows`` rows only, both
    where the kernel writes in place and where its result is copied: on the CPU, ATen's kernel
    stood in for by the exact reference and its log-sum-exp."""
    rows, live, heads, kv_heads, dim = 10, 7, 4, 2, 8
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(rows, heads, dim, generator=generator)
    k, v = (torch.randn(rows, kv_heads, dim, generator=generator) for _ in range(2))
    sinks = torch.tensor([1.5, -0.5, 0.0, 4.0])
    bounds = [(0, 3), (3, live)]

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, **kw):
        result = bg_attention.reference_attention(q, k, v, bounds, kw["scale"], None)
        keys = k.repeat_interleave(2, 1)
        lse = torch.full((heads, rows), float("nan"))  # rows past the live ones: garbage
        for start, end in bounds:
            scores = torch.einsum("qhd,khd->hqk", q[start:end], keys[start:end]) * kw["scale"]
            causal_mask = torch.ones(end - start, end - start).triu(1).bool()
            lse[:, start:end] = scores.masked_fill(causal_mask, float("-inf")).logsumexp(-1)
        return result, lse

    def into(out, *args, **kw):
        result, lse = kernel(*args, **kw)
        out[:live] = result[:live]
        return lse

    monkeypatch.setattr(bg_attention, "_flash", lambda *a, **kw: (*kernel(*a, **kw), None))
    monkeypatch.setattr(bg_attention, "_flash_into", into)
    monkeypatch.setattr(bg_attention, "FLASH_WRITES_IN_PLACE", in_place)
    cu = torch.tensor([0, 3, live], dtype=torch.int32)
    out = torch.zeros(rows, heads, dim)
    got = bg_attention.flash_varlen(q, k, v, cu, cu, 4, 4, 0.5, None, out, sinks=sinks, rows=live)
    expected = bg_attention.reference_attention(q, k, v, bounds, 0.5, None, sinks=sinks)
    assert got is out
    torch.testing.assert_close(got[:live], expected[:live], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()  # the garbage log-sum-exp past ``rows`` is never read


def test_auto_attention_choice(backend, closing):
    runner = closing(make_runner(model_for("llama", backend), backend))
    assert runner.attention == ("flash" if backend == "cuda" else "reference")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_eager_experts_run_on_the_live_rows_only(arch, backend, closing, monkeypatch):
    """A bucket's padding tail is not routed to the experts: the eager loop of every replay
    gets the prompts' rows only (one prompt, or a packed batch), and the logits still match
    the model on each prompt alone."""
    from breakgraph.integrations.transformers import experts as experts_module

    model = model_for(arch, backend)
    device = next(model.parameters()).device
    runner = closing(make_runner(model, backend))
    rows = []
    original = experts_module._eager_forward

    def counting(module):
        forward = original(module)

        def run(module, hidden, *args, **kwargs):
            rows.append(hidden.shape[0])
            return forward(module, hidden, *args, **kwargs)

        return run

    monkeypatch.setattr(experts_module, "_eager_forward", counting)
    sparse = moe_layers(model)
    for lengths in ([5], [3, 9], [16], [2, 2, 2]):
        prompts = prompts_of(lengths, device)
        bucket = runner._runner.bucket_for(sum(lengths))
        rows.clear()
        out = runner.prefill(prompts)
        assert rows == [sum(lengths)] * sparse, (lengths, bucket, rows)
        for i, p in enumerate(prompts):
            assert_logits_close(out.logits[i], eager_last_logits(model, p), backend, f"{i}")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_grouped_experts_skip_the_padding_rows(arch, backend, closing, monkeypatch):
    """grouped_mm experts inside the graphs route a bucket's padding rows to no expert: on every
    replay (one prompt or a packed batch, fresh lengths in the same graph) the rows given a
    real expert are the prompts' rows, counted by an operation recorded in the graph itself;
    the logits still match the model on each prompt alone. Experts with biases (gpt-oss) keep
    every row: transformers' grouped_mm indexes the biases by expert id (compat.experts_shape)."""
    from breakgraph.integrations.transformers import experts as experts_module

    model = model_for(arch, backend, experts_implementation="grouped_mm")
    device = next(model.parameters()).device
    real = compat.grouped_experts()
    with torch.inference_mode(False):
        routed = torch.zeros((), dtype=torch.long, device=device)  # outside every graph

    def counting(module, hidden, index, weights):
        routed.add_((index < module.num_experts).all(-1).sum())  # a graph node: every replay
        return real(module, hidden, index, weights)

    monkeypatch.setattr(experts_module, "_grouped", counting)
    # these tiny experts are never worth the mask (see test_padding_mask_is_used_where_it_pays)
    monkeypatch.setattr(experts_module, "MASK_COST_FLOP", 0)
    monkeypatch.setattr(experts_module, "COMPUTE_BOUND_ROWS", 0)
    runner = closing(make_runner(model, backend))
    sparse = moe_layers(model)
    generator = torch.Generator().manual_seed(11)
    biased = any(getattr(m, "has_bias", False) is True for m in model.modules())
    for lengths in ([5], [3, 9], [13], [20, 7, 2], [9], [30]):
        prompts = prompts_of(lengths, device, generator)
        bucket = runner._runner.bucket_for(sum(lengths))
        assert bucket > sum(lengths)  # a padding tail
        before = int(routed)
        out = runner.prefill(prompts)
        assert int(routed) - before == sparse * (bucket if biased else sum(lengths)), lengths
        for i, p in enumerate(prompts):
            assert_logits_close(out.logits[i], eager_last_logits(model, p), backend, f"{i}")
    assert model.config._experts_implementation == "grouped_mm"  # switched back


def test_captures_and_tunings_stage_random_ids(monkeypatch, closing):
    """Every capture (and every timed tuning replay: the same context) runs on one prompt of
    random ids filling the bucket, not on the pad id: a MoE router sends equal tokens to the
    same experts, and a bucket timed on that load is routed to a bucket slower on real prompts.
    The ids are the same for every construction (every rank stages the same)."""
    model = model_for("qwen3_moe", "emulated", experts_implementation="grouped_mm")
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(args[0].clone())
    )
    try:
        runner = closing(make_runner(model, "emulated"))
        staged = [runner._capture_batch(size) for size in runner.buckets]  # tune()'s context
    finally:
        hook.remove()
    assert {ids.shape[-1] for ids in seen} == set(BUCKETS)
    for ids in seen:
        assert ids.unique().numel() > ids.numel() // 2, ids  # not one repeated id
    for size, batch in zip(runner.buckets, staged):
        assert batch.bounds == [(0, size)] and batch.one_prompt and batch.live_tokens == size
        ids = runner._steps.view.ids[:size]
        assert len(set(ids.tolist())) > size // 2
    again = closing(make_runner(model, "emulated"))
    assert torch.equal(again._steps.capture_ids, runner._steps.capture_ids)


def test_grouped_experts_without_a_mask_are_grouped_mm(backend, monkeypatch):
    """Outside a prefill (no padding mask) and for experts with biases (an id past the last
    expert would index a bias out of range), the registered function is grouped_mm itself."""
    from breakgraph.integrations.transformers import experts as experts_module

    model = model_for("mixtral", backend, experts_implementation="grouped_mm")
    module = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(3)
    rows = 6
    hidden = torch.randn(rows, model.config.hidden_size, generator=generator).to(device)
    hidden = hidden.to(next(model.parameters()).dtype)
    index = torch.randint(module.num_experts, (rows, 2), generator=generator).to(device)
    weights = torch.rand(rows, 2, generator=generator).to(device, hidden.dtype)
    with torch.no_grad():
        plain = compat.grouped_experts()(module, hidden, index, weights)
        torch.testing.assert_close(
            experts_module.grouped_skipping_padding(module, hidden, index, weights), plain
        )
        monkeypatch.setattr(experts_module, "MASK_COST_FLOP", 0)
        monkeypatch.setattr(experts_module, "COMPUTE_BOUND_ROWS", 0)
        last = torch.tensor([3, 1, 0], device=device)  # the live rows end at row 3
        padding = experts_module.PaddingRows(torch.arange(rows, device=device), last, 1.0)
        with experts_module.padding_rows(padding):
            skipped = experts_module.grouped_skipping_padding(module, hidden, index, weights)
            torch.testing.assert_close(skipped[:4], plain[:4])
            assert not skipped[4:].any()
            seen = []
            monkeypatch.setattr(
                experts_module, "_grouped", lambda m, h, i, w: seen.append(i) or torch.zeros_like(h)
            )
            monkeypatch.setattr(module, "has_bias", True, raising=False)
            experts_module.grouped_skipping_padding(module, hidden, index, weights)
            assert seen[0] is index  # biases are indexed by expert id: no id past the last


@pytest.mark.parametrize(
    "shape, bucket, expected, used",
    [
        ((8, 2, 4096, 14336), 1024, 32, True),  # Mixtral-8x7B widths, 1000 tokens: measured +4 %
        ((8, 2, 1024, 3584), 1024, 32, False),  # Mixtral at hidden 1024: measured -1 %
        ((128, 8, 2048, 768), 1024, 32, False),  # Qwen3-MoE widths: 2.4 GFLOP of padding
        ((8, 2, 4096, 14336), 32, 4, False),  # 8 rows per expert: the weights' reads dominate
        ((8, 2, 1024, 3584), 2048, 64, True),
    ],
)
def test_padding_mask_is_used_where_it_pays(shape, bucket, expected, used):
    """The cost model of the grouped experts' padding mask, on the benchmark's shapes (meta
    tensors: no memory), and never for experts with biases."""
    from types import SimpleNamespace

    from breakgraph.integrations.transformers.experts import worth_skipping

    experts, top_k, hidden, inner = shape
    module = SimpleNamespace(
        num_experts=experts, has_bias=False, has_gate=True,
        gate_up_proj=torch.empty(experts, 2 * inner, hidden, device="meta"),
        down_proj=torch.empty(experts, hidden, inner, device="meta"),
    )  # fmt: skip
    assert worth_skipping(module, bucket, top_k, expected) is used
    module.has_bias = True
    assert not worth_skipping(module, bucket, top_k, expected)


def test_eager_experts_break_outside_a_runner_runs_every_row():
    """Called with no replay context (a caller of its own), the eager experts break is the
    model's own loop on every row, not a ReplayError."""
    from breakgraph.integrations.transformers.experts import _eager_forward, experts_loop

    model = model_for("mixtral", "emulated")
    module = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(5, model.config.hidden_size, generator=generator)
    index = torch.randint(module.num_experts, (5, 2), generator=generator)
    weights = torch.rand(5, 2, generator=generator)
    with torch.no_grad():
        got = experts_loop(module, hidden, index, weights)
        torch.testing.assert_close(got, _eager_forward(module)(module, hidden, index, weights))


def test_one_graph_variant_expects_the_default_ladders_padding():
    """The benchmark's one-graph variant has only the buckets a benchmark uses; its MoE
    experts must still skip padding (or not) as the default runner's same bucket does."""
    from types import SimpleNamespace

    from benchmarks.one_graph import OneGraphPrefillRunner
    from breakgraph.buckets import default_token_buckets

    ladder = default_token_buckets(4096)
    default = SimpleNamespace(_token_buckets=ladder)
    for bucket in ladder:
        expected = PrefillRunner._padding_of(default, bucket)
        assert OneGraphPrefillRunner._padding_of(None, bucket) == expected
    assert PrefillRunner._padding_of(default, 1024) == 31.5  # 961..1024


def test_user_instance_forward_on_experts_survives(backend, closing):
    model = model_for("qwen3_moe", backend)
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    calls = []
    original = experts.forward

    def hooked(*args, **kwargs):  # e.g. an accelerate hook installed as an instance attribute
        calls.append(1)
        return original(*args, **kwargs)

    experts.forward = hooked
    closing(make_runner(model, backend))
    assert experts.__dict__["forward"] is hooked
    assert calls  # the runner went through it while capturing


# -- 8. the host never reads the GPU; a call waits only for the previous call's graph ------------
def test_back_to_back_prefills_keep_their_own_metadata(backend, closing):
    """Step metadata is staged asynchronously: a second prefill, prepared while the GPU has not
    yet run the first one, must not overwrite the first one's lengths before they are read."""
    model = model_for("llama", backend)
    device = next(model.parameters()).device
    runner = closing(make_runner(model, backend))
    first, second = prompts_of([9, 4, 13], device), prompts_of([2, 17], device)
    runner.prefill(first)  # warm
    if backend == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # keep the GPU busy: both steps are queued behind it
    out_first = runner.prefill(first)
    out_second = runner.prefill(second)
    for out, prompts in ((out_first, first), (out_second, second)):
        for i, p in enumerate(prompts):
            assert_logits_close(out.logits[i], eager_last_logits(model, p), backend, f"prompt {i}")


@pytest.mark.requires_cuda
def test_prefill_never_synchronizes(closing):
    """No blocking copy or .item() on the serving path: the host runs ahead of the GPU."""
    model = model_for("llama", "cuda")
    runner = closing(make_runner(model, "cuda"))
    prompts, other = prompts_of([5, 11, 3], "cuda"), prompts_of([30], "cuda")
    runner.prefill(prompts)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = runner.prefill(prompts)
        runner.prefill(other)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, p in enumerate(prompts):
        assert_logits_close(out.logits[i], eager_last_logits(model, p), "cuda", f"prompt {i}")


def test_debug_report_times_each_attention_break(backend, closing):
    model = model_for("llama", backend)
    device = next(model.parameters()).device
    runner = closing(make_runner(model, backend, debug=True))
    prompts = prompts_of([6, 9], device)
    out = runner.prefill(prompts)
    for i, p in enumerate(prompts):
        assert_logits_close(out.logits[i], eager_last_logits(model, p), backend, f"prompt {i}")
    report = runner.graph(16).report()
    layers = model.config.num_hidden_layers
    assert report.break_names == [f"attention[layer {i}]" for i in range(layers)]
    assert all(t is not None and t > 0 for t in report.break_host_us), report
    assert "us/replay" in str(report)


# -- issue 11 regressions --------------------------------------------------------------------------


def test_cache_of_an_earlier_prefill_is_refused_after_a_failed_prefill(backend):
    """Item 4: a prefill that fails mid-replay still invalidates earlier outputs."""
    device, _ = device_dtype(backend)
    model = model_for("llama", backend)
    runner = make_runner(model, backend)
    first = runner.prefill(prompts_of([5, 7], device))
    first.cache(0)  # valid now

    def explode(*args, **kwargs):
        raise RuntimeError("device fell over")

    graph = runner.graph(16)
    original, graph.replay = graph.replay, explode
    try:
        with pytest.raises(RuntimeError, match="fell over"):
            runner.prefill(prompts_of([3, 4], device))
    finally:
        graph.replay = original
    with pytest.raises(InputError, match="later prefill"):
        first.cache(0)


def test_a_prefill_refused_before_it_runs_leaves_earlier_caches_valid(backend):
    """docs/api.md said cache(i) raises after any later prefill, "even a failed one". A prefill
    refused before anything runs (an id outside the vocabulary, too many prompts or tokens, the
    prompts' iterator raising) writes no K/V: earlier outputs stay valid, their cache the same."""
    device, _ = device_dtype(backend)
    runner = make_runner(model_for("llama", backend), backend)
    first = runner.prefill(prompts_of([5, 7], device))
    before = first.cache(1)

    def raising():
        yield prompts_of([3], device)[0]
        raise KeyError("the caller's iterator")

    # the id on the host: ids already on the device are not checked (a sync; documented)
    refused = [[torch.tensor([10**6])], prompts_of([1] * 99, device),
               prompts_of([999], device), raising()]  # fmt: skip
    for prompts in refused:
        with pytest.raises((InputError, KeyError)):
            runner.prefill(prompts)
        after = first.cache(1)
        for layer in range(len(before.layers)):
            assert torch.equal(before.layers[layer].keys, after.layers[layer].keys)


def test_output_after_close_keeps_no_graph_memory(backend):
    device, _ = device_dtype(backend)
    runner = make_runner(model_for("llama", backend), backend)
    out = runner.prefill(prompts_of([5], device))
    import gc
    import weakref

    key = weakref.ref(runner._layers[16, False][0][1])
    runner.close()
    gc.collect()
    assert key() is None  # the output holds no graph memory once the runner is closed
    with pytest.raises(InputError, match="closed"):
        out.cache(0)


def test_an_owned_output_does_not_keep_its_runner_alive(backend):
    """A ``PrefillOutput`` held the runner strongly: keeping outputs (their logits are owned
    copies) kept a runner the caller had dropped, its graphs and its pool's memory, alive.
    An owned output holds it weakly (``cache(i)`` then raises); one whose logits live in graph
    memory (``owned=False``) keeps it, or the logits would be read from released memory."""
    import gc
    import weakref

    device, _ = device_dtype(backend)
    model = model_for("llama", backend)
    runner = make_runner(model, backend)
    p = prompt(5, device)
    out = runner.prefill([p])
    out.cache(0)
    alive = weakref.ref(runner)
    del runner
    gc.collect()
    assert alive() is None
    assert_logits_close(out.logits[0], eager_last_logits(model, p), backend)
    with pytest.raises(InputError, match="closed or deleted"):
        out.cache(0)
    runner = make_runner(model, backend)
    borrowed = runner.prefill([p], owned=False)
    alive = weakref.ref(runner)
    del runner
    gc.collect()
    assert alive() is not None  # its logits live in the graph's memory
    assert_logits_close(borrowed.logits[0], eager_last_logits(model, p), backend)
    borrowed.cache(0)
    del borrowed
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("single_prompt_graphs", [None, True])
def test_a_dropped_runner_and_its_graphs_are_freed_at_del(backend, single_prompt_graphs):
    """The runner's ``BucketedRunner``s held its bound methods (the forward, the capture batch):
    a reference cycle, so ``del runner`` freed nothing, and its graphs kept their pool's memory
    until Python's cyclic collector ran (``torch.cuda.empty_cache()`` gave nothing back). They
    hold them weakly (``breakgraph.memory.weak_method``): reference counting frees the runner
    and every graph at ``del``, with the collector off."""
    import weakref

    from tests.helpers import collector_off

    device, _ = device_dtype(backend)
    runner = make_runner(model_for("llama", backend), backend,
                         single_prompt_graphs=single_prompt_graphs, tune_buckets=True)  # fmt: skip
    out = runner.prefill(prompts_of([5, 7], device))
    runner.prefill([prompt(9, device)])
    graphs = runner.graphs()
    singles = backend == "cuda" if single_prompt_graphs is None else single_prompt_graphs
    assert len(graphs) == len(BUCKETS) * (2 if singles else 1)  # None: on with CUDA
    with collector_off():
        refs = [weakref.ref(runner), *(weakref.ref(g) for g in graphs.values())]
        del runner, graphs
        assert [ref() is None for ref in refs] == [True] * len(refs)
    with pytest.raises(InputError, match="closed or deleted"):
        out.cache(0)


@pytest.mark.parametrize("head", ["LlamaForSequenceClassification", "LlamaModel"])
def test_non_causal_lm_heads_are_rejected(head):
    """Item 7: a supported model_type with another head must not be served as a causal LM."""
    config = make_config("llama")
    model = getattr(transformers, head)(config).eval()
    with pytest.raises(UnsupportedModelError, match="ForCausalLM"):
        PrefillRunner(model, token_buckets=BUCKETS, backend="emulated")


def test_moe_router_logits_config_is_served(backend):
    """Item 13: output_router_logits=True in the config must not break the runner."""
    device, _ = device_dtype(backend)
    model = model_for("qwen3_moe", backend, output_router_logits=True)
    runner = make_runner(model, backend)
    ps = prompts_of([6, 9], device)
    out = runner.prefill(ps)
    for i, p in enumerate(ps):
        assert_logits_close(out.logits[i], eager_last_logits(model, p), backend)


def test_bad_prefill_inputs_raise_input_errors(backend):
    """Item 15: PrefillRunner's own checks, and its own advice."""
    device, _ = device_dtype(backend)
    model = model_for("llama", backend)
    with pytest.raises(InputError, match="token_buckets"):
        PrefillRunner(model, token_buckets=(), backend=backend)
    runner = make_runner(model, backend)
    out = runner.prefill(p for p in prompts_of([4, 5], device))  # any iterable of prompts
    assert out.logits.shape[0] == 2
    with pytest.raises(InputError, match="list of 1-D LongTensors"):
        runner.prefill(None)
    with pytest.raises(InputError) as info:
        runner.prefill(prompts_of([30, 30], device))  # 60 tokens > largest bucket 48
    assert "capture_window" not in str(info.value)
    assert "token_buckets" in str(info.value)


def test_prompts_without_readable_ids_raise_input_errors():
    """A prompt on the meta device (no data) or a sparse one passes the cheap checks (1-D,
    int64, not empty): they were a raw NotImplementedError from the device-to-host copy (after
    the bucket was decided) and numpy's TypeError; the eager path (a batch above every bucket)
    the same. Now InputError naming the prompt, and the runner keeps working."""
    model = model_for("llama", "emulated")
    good = prompt(5, "cpu")
    meta = torch.zeros(5, dtype=torch.long, device="meta")
    sparse = torch.tensor([1, 0, 3]).to_sparse()
    with contextlib.closing(make_runner(model, "emulated", on_miss="eager")) as runner:
        for bad, what in ((meta, "meta device"), (sparse, "layout torch.sparse_coo")):
            for batch in ([good, bad], [prompt(47, "cpu"), bad]):  # in a bucket, above all
                with pytest.raises(InputError, match=f"prompt 1 is a tensor .*{what}.*dense"):
                    runner.prefill(batch)
        out = runner.prefill([good])
        assert_logits_close(out.logits[0], eager_last_logits(model, good), "emulated", "after")
        assert runner.stats.eager_fallbacks == {}


def test_default_ladder_pads_at_most_7_tokens_below_256_and_an_eighth_above():
    from breakgraph.integrations.transformers import default_token_buckets, prefill

    from breakgraph.ladder import default_token_buckets as in_the_core

    # one implementation; the integration's public names re-export it
    assert default_token_buckets is prefill.default_token_buckets is in_the_core
    ladder = default_token_buckets(4096)
    assert ladder[0] == 8 and ladder[-1] == 4096 and list(ladder) == sorted(set(ladder))
    for n in range(1, 4097):
        bucket = next(b for b in ladder if b >= n)
        assert bucket - n <= 7 if n <= 256 else (bucket - n) / n < 0.125, n
    assert default_token_buckets(100)[-1] == 100  # the limit is always the last bucket
    assert default_token_buckets(512, step=16, dense_until=128)[:3] == (16, 32, 48)
    with pytest.raises(InputError, match="default_token_buckets"):
        default_token_buckets(0)
    # a string or None failed with Python's TypeError; a float or a bool made buckets of it
    for bad in ("8", None, 2.5, True):
        with pytest.raises(InputError, match=r"default_token_buckets: max_tokens must be an int"):
            default_token_buckets(bad)
    for name, bad in (("step", 1.5), ("step", True), ("dense_until", "64")):
        with pytest.raises(InputError, match=rf"default_token_buckets: {name} must be an int"):
            default_token_buckets(64, **{name: bad})
    assert default_token_buckets(np.int64(64), step=np.int32(16)) == (16, 32, 48, 64)


@pytest.mark.parametrize("failing", ["graph mixing", "packed graphs"])
def test_a_tensor_parallel_construction_that_fails_closes_its_rank_group(failing, monkeypatch):
    """Under tensor parallelism a PrefillRunner makes a RankGroup (a gloo group of its own);
    a constructor that raised after the settings were agreed (NCCL's graph mixing refused, the
    packed ladder's settings or captures failing on a rank) left that group open, one more
    per attempt. Every failure closes it, as enable_continuous_batching does."""
    from breakgraph import RankMismatchError, distributed

    made = []

    class Group:  # stands in for RankGroup: a runner built on one rank
        keeps_memory = False

        def __init__(self, group, timeout):
            self.closed = False
            made.append(self)

        def agree_settings(self, who, settings):
            if failing == "packed graphs" and who == "BucketedRunner":
                raise RankMismatchError("BucketedRunner: rank 1 was built with other buckets")

        def check_graph_mixing(self, eager_collectives, who=None):
            if failing == "graph mixing":
                raise InputError("NCCL_GRAPH_MIXING_SUPPORT=0")

        def close(self):
            self.closed = True

    monkeypatch.setattr(distributed, "tensor_parallel_group", lambda model, who=None: object())
    monkeypatch.setattr(distributed, "RankGroup", Group)
    with pytest.raises((RankMismatchError, InputError)):
        make_runner(model_for("llama", "emulated"), "emulated")
    assert [group.closed for group in made] == [True]


def test_a_failed_nccl_capture_step_keeps_the_runner_until_exit(monkeypatch):
    """After a capture step failed with NCCL the ladder keeps its graphs and the callables it
    captured with until the process exits (``RankGroup.capture_step``: the failed step's
    collectives may still run, and nothing they read may be freed). Those callables hold the
    runner weakly (a dropped runner is freed at ``del``), so a constructor that fails so keeps
    the runner itself, with its buffers and model."""
    from breakgraph import distributed

    kept, before = [], len(distributed._KEPT_UNTIL_EXIT)

    class Group:  # stands in for RankGroup on NCCL: the first capture fails on this rank
        keeps_memory = False

        def __init__(self, group, timeout):
            pass

        def agree_settings(self, who, settings):
            pass

        def check_graph_mixing(self, eager_collectives, who=None):
            pass

        def capture_step(self, what, step, fingerprint=None, keep=None):
            if what.startswith("capture"):
                self.keeps_memory = True
                raise RuntimeError("NCCL error")
            return step()

        def keep_until_exit(self, keep):
            kept.append(keep)

        def close(self):
            pass

    monkeypatch.setattr(distributed, "tensor_parallel_group", lambda model, who=None: object())
    monkeypatch.setattr(distributed, "RankGroup", Group)
    try:
        with pytest.raises(RuntimeError, match="NCCL error"):
            make_runner(model_for("llama", "emulated"), "emulated")
        assert [type(k) for k in kept] == [PrefillRunner]
    finally:
        del distributed._KEPT_UNTIL_EXIT[before:]


@pytest.mark.parametrize("failing", ["single-prompt graphs", "tuning"])
def test_a_construction_that_fails_late_closes_what_it_captured(failing, monkeypatch):
    """A PrefillRunner whose single-prompt ladder or tuning raises leaves no ladder open
    (their graphs hold pool memory until closed): the error propagates, every BucketedRunner
    it built is closed."""
    from breakgraph.runner import BucketedRunner

    built, real_init = [], BucketedRunner.__init__

    def init(self, *args, **kwargs):
        if failing == "single-prompt graphs" and built:
            raise RuntimeError("boom")
        real_init(self, *args, **kwargs)
        built.append(self)

    def tune(self, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(BucketedRunner, "__init__", init)
    monkeypatch.setattr(BucketedRunner, "tune", tune)
    model = model_for("llama", "emulated")
    with pytest.raises(RuntimeError, match="boom"):
        make_runner(model, "emulated", single_prompt_graphs=True, tune_buckets=True)
    assert built and all(r.ladder.closed for r in built), [r.ladder.closed for r in built]
    assert len(built) == (1 if failing == "single-prompt graphs" else 2)


def _interrupted_at(line: int, functions: tuple, call) -> bool:
    """Run ``call`` with KeyboardInterrupt raised at its ``line``-th line event inside the
    prefill buffers' ``functions``; True if it was raised (the call had that many lines)."""
    import sys

    from breakgraph.integrations.transformers import prefill_buffers

    seen = [0]

    def trace(frame, event, arg):
        code = frame.f_code
        if code.co_filename != prefill_buffers.__file__ or code.co_name not in functions:
            return None
        if event == "line":
            seen[0] += 1
            if seen[0] == line:
                raise KeyboardInterrupt
        return trace

    sys.settrace(trace)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def test_a_prefill_interrupted_while_staging_leaves_no_stale_positions_or_indices():
    """``StepBuffers`` marked what a step changed (positions moved from their resting state,
    last-token indices set) only after writing it: a KeyboardInterrupt between the two left
    moved positions that the next one-prompt call took for resting ones (other logits,
    silently, on every later call), or a last-token index past a smaller bucket (a raw
    IndexError on every later call). Marked before the writes now; interrupted at each line of
    the staging, the next prefills match the eager model."""
    model = model_for("llama", "emulated")
    generator = torch.Generator().manual_seed(3)
    after = [prompts_of(lengths, "cpu", generator) for lengths in ([12], [5, 9])]
    refs = [[eager_last_logits(model, p) for p in batch] for batch in after]
    functions = ("commit", "commit_boundaries", "_clear_stale_last")
    with contextlib.closing(make_runner(model, "emulated", on_miss="eager")) as runner:
        for lengths in ([3, 30, 6], [20, 20, 20]):  # in bucket 48, above every bucket
            batch = prompts_of(lengths, "cpu", generator)
            line = 1
            while _interrupted_at(line, functions, lambda: runner.prefill(batch)):
                for prompts, ref in zip(after, refs):
                    out = runner.prefill(prompts)
                    for i, expected in enumerate(ref):
                        assert_logits_close(out.logits[i], expected, "emulated", f"line {line}")
                line += 1
            assert line > 5, line


def test_a_moved_model_is_refused_and_weights_changed_in_place_are_seen():
    """A graph reads the memory its weights had at capture: after ``model.double()``, or a
    ``float()`` back (new memory again), or a parameter replaced, every prefill ran the old
    weights, silently (on CUDA, memory given back). Now ReplayError naming the move and the
    fix; weights copied in place are what the graphs read, in replays and eager fallbacks."""
    model = model_for("llama", "emulated")
    ps = prompts_of([5, 9], "cpu")
    longer = prompts_of([20, 20, 20], "cpu")  # above every bucket: the eager fallback
    with contextlib.closing(make_runner(model, "emulated", on_miss="eager")) as runner:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1.1)
        for batch in (ps, longer):
            out = runner.prefill(batch)
            for i, p in enumerate(batch):
                assert_logits_close(out.logits[i], eager_last_logits(model, p), "emulated")
        embed = model.get_input_embeddings()
        moves = [model.double, model.float,
                 lambda: setattr(embed, "weight", torch.nn.Parameter(embed.weight.clone()))]
        for move in moves:
            move()
            for batch in (ps, longer):
                with pytest.raises(ReplayError, match="PrefillRunner.prefill: the model's weights "
                                   "are no longer where its graphs read them.*Build a new runner"):
                    runner.prefill(batch)
    with contextlib.closing(make_runner(model, "emulated")) as runner:  # the model as it is now
        out = runner.prefill(ps)
        for i, p in enumerate(ps):
            assert_logits_close(out.logits[i], eager_last_logits(model, p), "emulated")


def run_named_threads(call, calls, attention) -> None:
    """``call(*args)`` on a thread named ``args[0]`` for each ``args`` in ``calls``, all at
    once, with breakgraph's reference attention replaced by ``attention`` meanwhile."""
    import threading

    original = bg_attention.reference_attention
    bg_attention.reference_attention = attention
    try:
        threads = [threading.Thread(target=call, args=args, name=args[0]) for args in calls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        bg_attention.reference_attention = original


def test_two_threads_prefilling_on_one_runner_take_turns():
    """Two threads calling ``prefill`` on one runner at once shared its staging buffers and
    K/V: a thread's graph read the other's positions and boundaries halfway through its replay
    (wrong logits, silently, or a raw IndexError). Calls take turns now (a lock, as continuous
    batching's steps): thread A is held inside its first attention break while B calls."""
    import threading

    model = model_for("llama", "emulated")
    a_prompts, b_prompts = prompts_of([5, 9], "cpu"), prompts_of([3, 4, 6], "cpu")
    inside, b_done, results = threading.Event(), threading.Event(), {}
    original = bg_attention.reference_attention

    def attention(*args, **kwargs):
        if threading.current_thread().name == "A" and not inside.is_set():
            inside.set()
            b_done.wait(timeout=0.3)  # without turns, B's whole prefill runs here
        return original(*args, **kwargs)

    def call(name, prompts):
        if name == "B":
            inside.wait(timeout=10)
        results[name] = runner.prefill(prompts)
        if name == "B":
            b_done.set()

    with contextlib.closing(make_runner(model, "emulated")) as runner:
        run_named_threads(call, (("A", a_prompts), ("B", b_prompts)), attention)
        for name, prompts in (("A", a_prompts), ("B", b_prompts)):
            for i, p in enumerate(prompts):
                assert_logits_close(results[name].logits[i], eager_last_logits(model, p),
                                    "emulated", f"thread {name}, prompt {i}")  # fmt: skip
        with pytest.raises(InputError, match="later prefill"):
            results["A" if results["A"]._step < results["B"]._step else "B"].cache(0)


@pytest.mark.parametrize("shared", ["one model", "two models of one config"])
def test_two_runners_eager_fallbacks_on_two_threads_take_turns_on_the_model(shared):
    """The attention implementation is a setting of the model's config: two runners of one model
    running eager fallbacks on two threads, A entering first and leaving first, let A switch the
    model back to SDPA in the middle of B's forward (B's packed prompts then attended to each
    other: other logits, silently) and B restore "breakgraph" for good (the model's own calls
    raised from then on). The runners' switches take turns per model now, and per config: two
    models built from one config object (``from_config(cfg)`` twice) share it, and their runners
    did the same to each other with a lock per model."""
    import threading

    model = model_for("llama", "emulated")
    other = model if shared == "one model" else type(model)(model.config).eval()
    assert other.config is model.config
    a_prompts, b_prompts = prompts_of([20, 20, 15], "cpu"), prompts_of([18, 22, 9], "cpu")
    a_inside, b_inside, a_done = (threading.Event() for _ in range(3))
    results = {}
    original = bg_attention.reference_attention

    def attention(*args, **kwargs):
        if threading.current_thread().name == "A" and not a_inside.is_set():
            a_inside.set()
            b_inside.wait(timeout=0.3)  # without turns, B enters its forward here
        elif threading.current_thread().name == "B" and not b_inside.is_set():
            b_inside.set()
            a_done.wait(timeout=0.3)  # ... and A leaves its forward here
        return original(*args, **kwargs)

    def call(name, runner, prompts):
        if name == "B":
            a_inside.wait(timeout=10)
        results[name] = runner.prefill(prompts)  # above every bucket: an eager forward
        if name == "A":
            a_done.set()

    runners = [make_runner(m, "emulated", on_miss="eager") for m in (model, other)]
    try:
        run_named_threads(call, (("A", runners[0], a_prompts), ("B", runners[1], b_prompts)),
                          attention)  # fmt: skip
    finally:
        for runner in runners:
            runner.close()
    assert model.config._attn_implementation == "sdpa"
    for name, m, prompts in (("A", model, a_prompts), ("B", other, b_prompts)):
        for i, p in enumerate(prompts):
            assert_logits_close(results[name].logits[i], eager_last_logits(m, p),
                                "emulated", f"thread {name}, prompt {i}")  # fmt: skip


def test_graph_refusals_name_the_prefill_runner():
    """``PrefillRunner.graph`` after ``close()`` or for a bucket it has not raised the inner
    ladder's errors, naming ``BucketedRunner.graph`` (a class the caller never built); its
    ``single_prompt`` is refused unless True or False, as the constructor's flags are."""
    runner = make_runner(model_for("llama", "emulated"), "emulated")
    with pytest.raises(InputError, match=r"PrefillRunner.graph: no bucket 99; buckets: \(16, 48\)"):
        runner.graph(99)
    with pytest.raises(InputError, match=r"PrefillRunner.graph: no bucket tensor\(16\)"):
        runner.graph(torch.tensor(16))  # compared equal to 16, then named BucketedRunner.graph
    assert runner.graph(np.int64(16)) is runner.graph(16)
    for bad in ("yes", None, 0, 1):  # taken for their truth value, None and 0 served silently
        with pytest.raises(InputError, match="PrefillRunner.graph: single_prompt must be True "):
            runner.graph(16, single_prompt=bad)
    runner.close()
    for single in (False, True):
        with pytest.raises(ReplayError, match="PrefillRunner.graph: the runner is closed"):
            runner.graph(16, single_prompt=single)
