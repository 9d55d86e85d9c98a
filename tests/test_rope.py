"""PrefillRunner serves transformers' ``dynamic`` and ``longrope`` RoPE up to their original
length (integrations/transformers/rope.py): the logits equal each prompt's own forward, a
longer prompt is refused before anything is staged, the graphs keep the original frequencies
whatever the model runs eagerly, the model is left exactly as it was, and continuous batching
(whose positions grow as it decodes) refuses them."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from breakgraph.integrations.transformers import (  # noqa: E402
    PrefillRunner,
    UnsupportedModelError,
    compat,
)
from breakgraph.integrations.transformers.models import check_model  # noqa: E402

from benchmarks.tiny_models import OTHER_DENSE_FAMILIES, TINY  # noqa: E402
from breakgraph.errors import InputError  # noqa: E402

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("one_cpu_thread")]

LIMIT = 64  # every model's original length here
VOCAB = TINY["vocab_size"]


def _factors(n: int, start: float, step: float) -> list:
    return [start + i * step for i in range(n)]


def build(kind: str):
    """A tiny fp32 model whose RoPE transformers switches past ``LIMIT`` positions; short and
    long frequencies far apart, so a wrong choice shows in the logits."""
    torch.manual_seed(0)
    if kind == "phi3_longrope":  # Phi-4-mini's partial rotary: 12 of 16 dims, 6 factors
        config = transformers.Phi3Config(
            **TINY, pad_token_id=None, original_max_position_embeddings=LIMIT,
            rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                 partial_rotary_factor=0.75, short_factor=_factors(6, 1.0, 0.2),
                                 long_factor=_factors(6, 4.0, 3.0)),
        )  # fmt: skip
    elif kind == "llama_dynamic":
        config = transformers.LlamaConfig(
            **{**TINY, "max_position_embeddings": LIMIT},
            rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0),
        )
    else:  # gemma3_longrope: rope_type and the settings keyed by layer type
        name, extra = OTHER_DENSE_FAMILIES["gemma3_text"]
        rope = dict(extra["rope_parameters"], full_attention=dict(
            rope_type="longrope", rope_theta=1e6, short_factor=_factors(8, 1.0, 0.1),
            long_factor=_factors(8, 8.0, 4.0), original_max_position_embeddings=LIMIT))  # fmt: skip
        config = getattr(transformers, name)(**{**TINY, **extra, "rope_parameters": rope})
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


KINDS = ("phi3_longrope", "llama_dynamic", "gemma3_longrope")


def runner_for(model, **kwargs) -> PrefillRunner:
    # buckets past the limit where the model allows them: a capture fills its bucket with one
    # prompt, which is fine once transformers' update is off
    top = 128 if model.config.max_position_embeddings >= 128 else LIMIT
    kwargs = dict(dict(token_buckets=(16, 32, LIMIT, top), max_prompts=4, backend="emulated",
                       warmup=1, on_miss="eager", tune_buckets=False,
                       single_prompt_graphs=True), **kwargs)  # fmt: skip
    return PrefillRunner(model, **kwargs)


def prompts(lengths, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (n,), generator=generator) for n in lengths]


@torch.no_grad()
def own_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[None]).logits[0, -1]


def check_batches(runner, reference, batches, seed: int = 0) -> None:
    for k, lengths in enumerate(batches):
        batch = prompts(lengths, seed + k)
        out = runner.prefill(batch)
        for i, ids in enumerate(batch):
            torch.testing.assert_close(out.logits[i], own_logits(reference, ids), atol=1e-5,
                                       rtol=1e-5, msg=lambda m: f"{lengths} prompt {i}: {m}")  # noqa: B023


def rotary_state(model) -> list:
    """Every rotary module's ``rope_type`` object and buffer objects, by identity."""
    return [(m.rope_type, dict(m._buffers)) for m in model.modules() if hasattr(m, "rope_type")]


def assert_same_state(before: list, after: list) -> None:
    assert len(before) == len(after)
    for (type_a, buffers_a), (type_b, buffers_b) in zip(before, after):
        assert type_a is type_b and buffers_a.keys() == buffers_b.keys()
        assert all(buffers_a[name] is buffers_b[name] for name in buffers_a)


@pytest.mark.parametrize("kind", KINDS)
def test_prompts_up_to_the_original_length_match_their_own_forward(kind):
    """Packed batches (one prompt exactly at the limit), single prompts, every bucket and the
    eager fallback (a batch past the largest bucket) give each prompt's own logits; the long
    frequencies would give others (the check would see a wrong choice)."""
    model = build(kind)
    runner = runner_for(model)
    try:
        assert runner._rope.limit == LIMIT
        batches = [[LIMIT], [LIMIT, 3, 40], [5, 9], [1], [30, 2, 7, 11], [LIMIT] * 3 + [20]]
        check_batches(runner, model, batches)
        eager = [b for b in batches if sum(b) > runner.buckets[-1]]  # the last one at least
        assert runner.stats.eager_steps == len(eager) >= 1
    finally:
        runner.close()
    if kind != "llama_dynamic":  # longrope: what transformers runs past the limit differs
        ids = prompts([LIMIT + 1], 9)[0]
        with torch.no_grad():
            long_row = model(ids[None]).logits[0, -2]  # position LIMIT - 1, long frequencies
        assert (long_row - own_logits(model, ids[:LIMIT])).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ("phi3_longrope", "llama_dynamic"))
def test_a_prompt_past_the_limit_is_refused_before_anything_is_staged(kind):
    """One token past the limit: ``InputError`` naming the prompt, its length, the limit and
    why, before the staging buffers are written: the previous output keeps its cache, and the
    next good call is exact."""
    model = build(kind)
    runner = runner_for(model, on_miss="raise")
    try:
        good = prompts([12, 30], 1)
        out = runner.prefill(good)
        cache = out.cache(1)
        too_long = [good[0], torch.randint(VOCAB, (LIMIT + 1,))]
        with pytest.raises(InputError, match=rf"PrefillRunner\.prefill: prompt 1 has {LIMIT + 1} "
                           rf"tokens, more than {LIMIT}, .* Nothing was copied\."):  # fmt: skip
            runner.prefill(too_long)
        again = out.cache(1)  # still this output's: no prefill began
        torch.testing.assert_close(again.layers[0].keys, cache.layers[0].keys)
        check_batches(runner, model, [[7, 40], [LIMIT], [3]], seed=5)
    finally:
        runner.close()


@pytest.mark.parametrize("kind", KINDS)
def test_graphs_keep_the_original_frequencies_after_a_long_eager_forward(kind):
    """The model run eagerly on a sequence past the limit: transformers re-registers its
    ``inv_freq`` to other frequencies, or (longrope, 5.23 on) writes them into it in place
    (dynamic: and keeps them at exactly the limit). The
    runner's replays and eager fallback still give a fresh model's logits; inside the runner
    its copy is installed, outside the model holds what transformers left, and after
    ``close()`` every rotary module is exactly as before; the model's own long forward still
    matches a fresh model's."""
    model = build(kind)
    fresh = copy.deepcopy(model)
    before = rotary_state(model)
    values = [{name: t.clone() for name, t in buffers.items()} for _, buffers in before]
    runner = runner_for(model)
    try:
        assert_same_state(before, rotary_state(model))
        check_batches(runner, fresh, [[LIMIT, 9]])
        long_ids = prompts([3 * LIMIT // 2], 3)[0]
        with torch.no_grad():
            model(long_ids[None])
        switched = rotary_state(model)  # other buffers (up to 5.22), or new values in place
        assert any(a[1][n] is not b[1][n] or not torch.equal(v[n], b[1][n])  # (5.23 on)
                   for a, b, v in zip(before, switched, values) for n in a[1])  # fmt: skip
        check_batches(runner, fresh, [[LIMIT, 9], [LIMIT], [LIMIT, LIMIT, LIMIT, 5]], seed=2)
        assert_same_state(switched, rotary_state(model))  # restored to what it held
    finally:
        runner.close()
    assert_same_state(switched, rotary_state(model))
    # below the limit: at exactly it, a dynamic model that grew keeps its grown frequencies
    # (transformers resets them for a shorter sequence only), where the runner's are a fresh one's
    short_ids = prompts([LIMIT - 1], 4)[0]
    torch.testing.assert_close(own_logits(model, short_ids), own_logits(fresh, short_ids))
    if kind != "gemma3_longrope":  # its second long forward fails in transformers 5.17 itself
        with torch.no_grad():  # (UnboundLocalError: long_inv_freq, for a layer-typed longrope)
            torch.testing.assert_close(model(long_ids[None]).logits, fresh(long_ids[None]).logits)


@pytest.mark.parametrize("kind", ("phi3_longrope", "llama_dynamic"))
def test_continuous_batching_refuses_switched_rope(kind):
    """A request's positions grow past the original length as it decodes, where transformers
    switches the frequencies on the host: continuous batching keeps refusing, and says why."""
    model = build(kind)
    with pytest.raises(UnsupportedModelError, match=rf"keeps its frequencies only up to "
                       rf"{LIMIT} positions, and a request's positions grow"):  # fmt: skip
        check_model(model, "enable_continuous_batching")
    if compat.supported("continuous_batching"):
        from breakgraph.integrations.transformers import enable_continuous_batching

        with pytest.raises(UnsupportedModelError, match="a request's positions grow"):
            enable_continuous_batching(model)


def test_a_rotary_layout_the_contract_does_not_know_is_refused(monkeypatch):
    """Contract item 18's probe answers None (a release whose rotary module lacks its original
    frequencies, or whose forward is not wrapped by the known decorator): PrefillRunner refuses
    the model as before, never serves it with frequencies it could not check."""
    model = build("phi3_longrope")
    del model.model.rotary_emb.original_inv_freq
    with pytest.raises(UnsupportedModelError, match="rope_type 'longrope' is not static RoPE"):
        runner_for(model)
    model = build("llama_dynamic")
    monkeypatch.setattr(compat, "_rope_update_code", lambda: None)
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic' is not static RoPE"):
        runner_for(model)
    monkeypatch.undo()
    assert compat.switched_rope(model.model.rotary_emb)[0][1:] == (
        "inv_freq", model.model.rotary_emb.original_inv_freq, LIMIT)
    assert compat.switched_rope(torch.nn.Linear(2, 2)) == []


def test_a_switched_type_no_rotary_module_holds_is_served_whole():
    """Gemma 3 whose layers are all sliding: its config's longrope (full-attention layers) is
    held by no rotary module, so transformers switches nothing: served like static RoPE (no
    limit); continuous batching, which reads the config alone, still refuses it."""
    name, extra = OTHER_DENSE_FAMILIES["gemma3_text"]
    rope = dict(extra["rope_parameters"], full_attention=dict(
        rope_type="longrope", rope_theta=1e6, short_factor=_factors(8, 1.0, 0.1),
        long_factor=_factors(8, 8.0, 4.0), original_max_position_embeddings=16))  # fmt: skip
    config = getattr(transformers, name)(**{**TINY, **extra, "rope_parameters": rope,
                                            "layer_types": ["sliding_attention"] * 2})  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.eval()
    assert model.model.rotary_emb.rope_type == {"sliding_attention": "default"}
    runner = runner_for(model)
    try:
        assert runner._rope.limit is None
        check_batches(runner, model, [[40, 3], [100]])
    finally:
        runner.close()
    with pytest.raises(UnsupportedModelError, match="rope_type 'longrope' is not static RoPE"):
        check_model(model, "enable_continuous_batching")


@pytest.mark.requires_cuda
@pytest.mark.parametrize("kind", ("phi3_longrope", "llama_dynamic"))
def test_cuda_graphs_read_the_runners_copy_of_the_frequencies(kind):
    """On the GPU the captured graphs read the frequencies' memory, not the module's attribute:
    the runner's own copy of the original frequencies, so a long eager forward of the model,
    which re-registers its ``inv_freq`` (and could free what the graphs read), changes nothing
    in what they compute."""
    model = build(kind).cuda()
    fresh = copy.deepcopy(model)
    runner = runner_for(model, backend="cuda")

    def check(lengths, seed):
        batch = prompts(lengths, seed)
        out = runner.prefill(batch)
        for i, ids in enumerate(batch):
            torch.testing.assert_close(out.logits[i], own_logits(fresh, ids.cuda()), atol=1e-4,
                                       rtol=1e-4, msg=lambda m: f"{lengths} {i}: {m}")  # noqa: B023

    try:
        check([LIMIT, 9], 0)
        with torch.no_grad():
            model(prompts([3 * LIMIT // 2], 3)[0].cuda()[None])
        torch.cuda.empty_cache()
        check([LIMIT, 9], 1)
        check([LIMIT, LIMIT, 5], 2)
    finally:
        runner.close()
