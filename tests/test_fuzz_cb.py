"""Differential fuzzing of continuous batching (``enable_continuous_batching``).

Each seed draws a scenario: a family, prompts of 1-80 tokens (lengths at the block size, the
query buckets and ``max_batch_tokens``, and one past them, are favoured; some share prefixes or
repeat), a paged cache small enough that the scheduler must wait or evict, query buckets,
decode graphs on or off, transformers' block-table decode path (``max_blocks_per_request``),
prefix sharing, the scheduler, logprobs, eos tokens that stop some requests early, forked
requests (``num_return_sequences``), and a way of serving: several ``generate_batch`` calls on
one enabled model (each with its own cache; a persistent manager), a manager fed while it runs
(requests streamed, cancelled mid-stream, the manager stopped and started again), two managers
at once (one maybe without graphs), or enable / disable / enable again with other options.
Every finished request's greedy tokens must equal ``model.generate()``'s on its prompt alone,
its logprobs the log-softmax of ``generate()``'s logits (fp32, emulated backend), every step
must replay a graph unless its manager turned graphs off, and ``disable()`` must leave the
model and transformers as they were.

The default suite runs a few fixed seeds; ``BREAKGRAPH_FUZZ_CB_SEEDS=N`` runs N others instead
(``BREAKGRAPH_FUZZ_CB_START``, default 1000, picks the first; ``BREAKGRAPH_FUZZ_CB_OPTIONS``
adds JSON keyword arguments to every ``enable_continuous_batching``, e.g. ``{"debug": true}``).
``python -m tests.test_fuzz_cb START COUNT`` prints each scenario and its verdict (on the GPU with
``BREAKGRAPH_FUZZ_CB_DEVICE=cuda``; ``START`` may be a comma-separated list of seeds instead). A
test marked ``requires_cuda`` serves the same seeds on the GPU: real captures, the Triton decode
kernel, fp32 against ``generate()`` there. Triage of a failure: ``BREAKGRAPH_FUZZ_CB_STOCK=graphs``
serves the scenarios on transformers' own CB as drawn, ``=async`` on its asynchronous steps
without its graphs (the mode breakgraph configures).

Config variants: the prefill fuzzer's random configs of every supported family
(``tests.test_fuzz_prefill.draw_config``), served by continuous batching: refused with
``UnsupportedModelError`` where breakgraph cannot serve them, else tokens and logprobs equal
``generate()``'s (half of ``BREAKGRAPH_FUZZ_CONFIGS``, default 4).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

from breakgraph.integrations.transformers import (  # noqa: E402
    UnsupportedModelError,
    enable_continuous_batching,
)
from breakgraph.integrations.transformers import continuous_batching as cb  # noqa: E402

from benchmarks.tiny_models import missing_config  # noqa: E402
from tests.test_continuous_batching import (  # noqa: E402
    ARCHS,
    CASES,
    _no_full_collections_in_transformers_cleanup,  # noqa: F401 (an autouse fixture)
    _nothing_left_enabled,  # noqa: F401 (an autouse fixture)
    build_model,
    cb_config,
    generation_config,
    needs_cb,
    transformers_state,
)
from tests.test_fuzz_prefill import CONFIGS, SEED, build_variant, expected_refusal  # noqa: E402

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("one_cpu_thread")]

MAX_NEW = 20
#: where ``main`` and ``BREAKGRAPH_FUZZ_CB_SEEDS`` serve: ``cpu`` (the emulated backend) or
#: ``cuda`` (real CUDA graphs and the Triton decode kernel, fp32, against generate() there)
DEVICE = os.environ.get("BREAKGRAPH_FUZZ_CB_DEVICE", "cpu")
STOCK = os.environ.get("BREAKGRAPH_FUZZ_CB_STOCK")  # triage: None, "graphs" or "async"
#: a logprob's distance from generate()'s: on the GPU cuBLAS picks other kernels (other
#: reduction orders) for a step's many rows than for generate()'s one
LOGPROB_ATOL = {"cpu": 2e-5, "cuda": 1e-4}
_ALL = [f for f in list(ARCHS) + [f"{arch}-{experts}" for arch, experts in CASES if experts]
        if missing_config(f.split("-")[0]) is None]  # those this transformers has  # fmt: skip
#: the families added in sessions 48 to 50, after the fixed seeds below were found: drawn after
#: the others, so that such a seed (``FIXED_DRAWS``) draws from the families before them and keeps
#: its scenario (session 50's dense ones had moved seed 3036 from glm to olmoe-eager)
_ADDED_LATER = ("glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe", "granitemoe", "granitemoeshared",
                "flex_olmo", "gpt_oss", "minimax_m2", "afmoe", "exaone_moe", "solar_open",
                "cohere2_moe", "hy_v3", "mellum", "kolibri1", "sarvam_moe", "ministral3", "jais2",
                "hyperclovax", "exaone", "internlm3", "iquestcoder", "apertus1p5_text",
                "laguna")  # fmt: skip
_BEFORE_48 = [f for f in _ALL if f.split("-")[0] not in _ADDED_LATER]
FAMILIES = _BEFORE_48 + [f for f in _ALL if f not in _BEFORE_48]
_models: dict = {}
_references: dict = {}


def model_of(family: str, device: str = "cpu"):
    if (family, device) not in _models:
        arch, _, experts = family.partition("-")
        _models[family, device] = build_model(arch, experts or None, device=device)
    return _models[family, device]


@torch.no_grad()
def reference(family: str, prompt: tuple, device: str = "cpu") -> tuple[list[int], list[float]]:
    """Greedy tokens of ``generate()`` on the prompt alone (no eos, ``MAX_NEW`` of them) and the
    log-softmax of each chosen token, on ``device``; truncated per request by :func:`expected`."""
    key = (family, device, prompt)
    if key not in _references:
        model = model_of(family, device)
        ids = torch.tensor([prompt], device=device)
        gen = generation_config(max_new_tokens=MAX_NEW, output_logits=True,
                                return_dict_in_generate=True)  # fmt: skip
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, tokens)]  # fmt: skip
        _references[key] = (tokens, logprobs)
    return _references[key]


def expected(family, prompt, max_new, eos, device="cpu"):
    tokens, logprobs = reference(family, tuple(prompt), device)
    tokens, logprobs = tokens[:max_new], logprobs[:max_new]
    stops = [eos] if isinstance(eos, int) else eos or []
    ends = [i for i, t in enumerate(tokens) if t in stops]
    if ends:
        tokens, logprobs = tokens[: ends[0] + 1], logprobs[: ends[0] + 1]
    return tokens, logprobs


def draw(seed: int, device: str = DEVICE) -> dict:
    """A scenario: plain data, printed when a seed fails; served on ``device`` (not drawn; on
    CUDA without what fails in transformers' asynchronous steps alone)."""
    rng = random.Random(seed)
    family = rng.choice(FAMILIES[: FIXED_DRAWS.get(seed, len(FAMILIES))])
    block_size = rng.choice([4, 8, 16, 32])
    max_batch_tokens = rng.choice([4, 8, 12, 16, 24, 32, 48, 64, 96])
    buckets = rng.choice([None, "ladder", "one", "random"])
    if buckets == "ladder":
        buckets = sorted({max(1, max_batch_tokens // 4), max(1, max_batch_tokens // 2),
                          max_batch_tokens})  # fmt: skip
    elif buckets == "one":
        buckets = [max_batch_tokens]
    elif buckets == "random":
        picked = rng.sample(range(1, max_batch_tokens + 1), min(3, max_batch_tokens))
        buckets = sorted(set(picked) | {max_batch_tokens})
    special = [block_size, block_size + 1, max_batch_tokens, max_batch_tokens + 1,
               *(buckets or []), *(b + 1 for b in buckets or [])]  # fmt: skip
    special = [n for n in special if 1 <= n <= 80]

    def prompts(count):
        lengths = [rng.choice(special) if rng.random() < 0.4 else rng.randint(1, 80)
                   for _ in range(count)]  # fmt: skip
        made = [[rng.randrange(120) for _ in range(n)] for n in lengths]
        if rng.random() < 0.3:  # shared prefixes (whole blocks and not) and duplicates
            base = made[0]
            for i in range(1, count):
                cut = rng.choice([len(base), block_size, 2 * block_size, rng.randint(1, 80)])
                made[i] = base[: min(cut, len(base))] + made[i][: rng.choice([0, 1, 5, 30])]
                made[i] = made[i] or base
        return made

    mode = rng.choice(["batch", "batch", "manager", "reenable", "two"])
    calls = [prompts(rng.randint(1, 12))
             for _ in range(rng.randint(1, 3) if mode in ("batch", "reenable") else 2)]
    longest = max(len(p) for c in calls for p in c) + MAX_NEW
    per_request = -(-longest // block_size)
    num_blocks = per_request + rng.choice([0, 1, 2, 4, 16, 64])
    scenario = dict(
        seed=seed, device=device, family=family, mode=mode, calls=calls, block_size=block_size,
        num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, buckets=buckets,
        decode_graphs=rng.random() < 0.7, logprobs=rng.random() < 0.5,
        max_new=rng.randint(1, MAX_NEW), eos=rng.random() < 0.4, eos_pick=rng.random(),
        scheduler=rng.choice(["fifo", "fifo", "prefill_first"]),
        max_blocks_per_request=rng.choice([None, None, 0, 1, 2, 3, 8]),
        copies=rng.choice([1, 1, 1, 2, 3]),  # num_return_sequences (greedy: equal copies)
        max_requests=rng.choice([None, None, None, 1, 2, 5]),  # max_requests_per_batch
        second_graphs=rng.random() < 0.7,  # the second manager of mode "two"
        two_eos=rng.random() < 0.3,
        restart=rng.random() < 0.3,  # "manager": stopped and started again midway
        persistent=rng.random() < 0.2,  # generate_batch(persistent_manager=True)
        # enable again with other options ("reenable": one entry per call)
        options=[dict(decode_graphs=rng.random() < 0.7, buckets=rng.choice([None, buckets]))
                 for _ in range(3)],
        sharing=rng.random() < 0.5, graphs=rng.random() < 0.9,
        cancel=rng.random() < 0.5, stagger=rng.random() < 0.5,
        per_request_max_new=[rng.randint(1, MAX_NEW) for _ in range(12)],
        # later calls and the second manager: their own cache and step sizes (no larger)
        later=[dict(block_size=rng.choice([4, 8, 16, 32]), extra_blocks=rng.choice([0, 2, 64]),
                    max_batch_tokens=rng.randint(1, max_batch_tokens))
               if rng.random() < 0.5 else {} for _ in range(3)],
    )  # fmt: skip
    if scenario["copies"] > 1 and mode in ("batch", "reenable"):
        # transformers schedules a waiting request with children and one token left (a one-token
        # prompt, or all but one token found cached) with no token, and a step holding only
        # that fails in stock CB too (5.17: "cannot reshape tensor of 0 elements"): not drawn
        scenario["sharing"] = False
        for prompts in calls:
            prompts[:] = [p if len(p) > 1 else p + [7] for p in prompts]
    if device == "cuda" and scenario["cancel"] and mode in ("manager", "two"):
        # asynchronous steps (the default on CUDA) with prefix sharing: transformers' update of
        # step N reads the block table of a request cancelled while it prepared step N+1
        # (KeyError, transformers alone too, 5.17 to 5.24; docs/continuous-batching.md): not drawn
        scenario["sharing"] = False
    return scenario


def pick_eos(s: dict) -> int | None:
    """A token that some request of the first call generates (so it stops early), or None."""
    if not s["eos"]:
        return None
    seen = [t for p in s["calls"][0]
            for t in reference(s["family"], tuple(p), s["device"])[0][: s["max_new"]]]  # fmt: skip
    if not seen:
        return None
    eos = seen[int(s["eos_pick"] * len(seen))]
    return [eos, seen[-1]] if s["two_eos"] else eos


#: transformers' scheduler fails a request it cannot fit in a tight cache (stock CB too: a
#: cache of sliding and full layers needs blocks for both groups), which is not a wrong answer
GIVES_UP = "No requests can be scheduled and no requests can be offloaded."
GAVE_UP: list = []  # the seeds where it did (the fuzzer's printout says so)


def check(s, prompt, out, max_new, eos, where) -> None:
    if out.error == GIVES_UP:
        GAVE_UP.append(s["seed"])
        return
    tokens, logprobs = expected(s["family"], prompt, max_new, eos, s["device"])
    assert out.error is None, f"{where}: error {out.error}"
    assert out.generated_tokens == tokens, (
        f"{where}: tokens {out.generated_tokens} != generate() {tokens} (prompt len {len(prompt)})")
    if s["logprobs"] and not (s["copies"] > 1 and s["mode"] in ("batch", "reenable")):
        got = torch.tensor(out.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(logprobs, dtype=torch.float64),
                                   atol=LOGPROB_ATOL[s["device"]], rtol=0,
                                   msg=lambda m: f"{where}: logprobs {m}")  # fmt: skip


def configs(s, eos, call=0):
    copies = s["copies"] if s["mode"] in ("batch", "reenable") else 1
    # several sequences per prompt need sampling: top_k=1 samples the greedy token (the
    # logprobs are then of the filtered logits: not compared)
    sampled = dict(do_sample=True, top_k=1) if copies > 1 else {}
    gen = generation_config(max_new_tokens=s["max_new"], eos_token_id=eos,
                            num_return_sequences=copies, **sampled)
    block_size, num_blocks = s["block_size"], s["num_blocks"]
    max_batch_tokens = s["max_batch_tokens"]
    if call and s["later"][call - 1]:
        later = s["later"][call - 1]
        block_size, max_batch_tokens = later["block_size"], later["max_batch_tokens"]
        longest = max(len(p) for c in s["calls"] for p in c) + MAX_NEW
        num_blocks = -(-longest // block_size) + later["extra_blocks"]
    cbc = cb_config(
        block_size=block_size, num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens, return_logprobs=s["logprobs"],
        scheduler_type=s["scheduler"], allow_block_sharing=s["sharing"],
        max_blocks_per_request=s["max_blocks_per_request"],
        max_requests_per_batch=s["max_requests"],
        use_cuda_graph=None if (s["second_graphs"] if call and s["mode"] == "two"
                                else s["graphs"]) else False,
    )  # fmt: skip
    if s.get("stock") == "async":  # transformers alone, asynchronous without its graphs
        cbc.use_cuda_graph, cbc.use_async_batching = False, True
    return gen, cbc


class _Stock:
    """Stands in for the handle where a scenario runs on transformers' own CB (triage)."""

    stats = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def enable(model, s, call=0):
    if s.get("stock"):
        return _Stock()
    options = s["options"][call - 1] if call else dict(buckets=s["buckets"],
                                                       decode_graphs=s["decode_graphs"])
    extra = json.loads(os.environ.get("BREAKGRAPH_FUZZ_CB_OPTIONS", "{}"))  # e.g. debug, compile
    backend = "cuda" if s["device"] == "cuda" else "emulated"
    return enable_continuous_batching(model, backend=backend, query_buckets=options["buckets"],
                                      decode_graphs=options["decode_graphs"], **extra)  # fmt: skip


def serve_batches(model, s, eos, calls, first=0):
    for i, prompts in enumerate(calls, first):
        gen, cbc = configs(s, eos, i)
        outs = model.generate_batch(prompts, generation_config=gen, progress_bar=False,
                                    continuous_batching_config=cbc,
                                    persistent_manager=s["persistent"])  # fmt: skip
        # every prompt once (5.17: generate_batch returns no forked copies, stock too), or once
        # per sequence (5.18 on return the children too, ``req_0__child#0``)
        got = Counter(tuple(o.prompt_ids) for o in outs.values())
        once = Counter(tuple(p) for p in prompts)
        copies = configs(s, eos, i)[0].num_return_sequences
        assert got in (once, Counter({p: n * copies for p, n in once.items()})), f"call {i}"
        for rid, out in outs.items():
            check(s, out.prompt_ids, out, s["max_new"], eos, f"call {i} request {rid}")


class Fed:
    """One manager's requests, added while it runs (some cancelled), and their results."""

    def __init__(self, model, s, eos, call, rng):
        self.s, self.eos, self.rng, self.prompts = s, eos, rng, s["calls"][call]
        gen, cbc = configs(s, eos, call)
        self.manager = model.init_continuous_batching(generation_config=gen,
                                                      continuous_batching_config=cbc)  # fmt: skip
        self.ids, self.maxes, self.cancelled, self.done = {}, {}, set(), {}

    def add(self, j):
        s, manager = self.s, self.manager
        max_new = s["per_request_max_new"][j]
        if self.gave_up():
            return
        rid = manager.add_request(self.prompts[j], max_new_tokens=max_new, streaming=s["cancel"])
        assert rid is not None or self.gave_up(), "request dropped"
        if rid is None:
            return
        self.ids[rid], self.maxes[rid] = j, max_new
        if s["stagger"] and self.rng.random() < 0.5:
            time.sleep(self.rng.choice([0.0, 0.005, 0.02]))
        if s["cancel"] and self.rng.random() < 0.3:
            manager.cancel_request(rid)
            self.cancelled.add(rid)

    def gave_up(self) -> bool:
        """transformers' loop ended on :data:`GIVES_UP` (stock CB too, in a tight cache)."""
        fatal = self.manager.background_thread_status.fatal_error
        if fatal is not None and str(fatal) == GIVES_UP:
            GAVE_UP.append(self.s["seed"])
            return True
        return False

    def finished(self) -> bool:
        return set(self.ids) - self.cancelled <= set(self.done) or self.gave_up()

    def poll(self, deadline):
        out = self.manager.get_result(timeout=0.2)
        assert time.monotonic() < deadline, f"hang: {len(self.done)} of {len(self.ids)} finished"
        if out is None:
            assert self.manager.is_running(), "the manager stopped early"
        elif out.is_finished():
            self.done[out.request_id] = out
        elif out.request_id not in self.cancelled:  # streamed: a prefix of the expected tokens
            want = self.want(out.request_id)
            got = out.generated_tokens
            assert got == want[: len(got)], f"request {self.ids[out.request_id]} streamed {got}"

    def want(self, rid):
        return expected(self.s["family"], self.prompts[self.ids[rid]], self.maxes[rid],
                        self.eos, self.s["device"])[0]  # fmt: skip

    def check(self, name):
        for rid, out in self.done.items():
            j = self.ids[rid]
            if rid in self.cancelled:  # finished before the cancel landed, or cut short
                want = self.want(rid)
                assert out.error is None or "cancel" in str(out.error).lower(), out.error
                assert out.generated_tokens == want[: len(out.generated_tokens)], (
                    f"{name}: cancelled request {j}: {out.generated_tokens} not a prefix of {want}")
                continue
            check(self.s, self.prompts[j], out, self.maxes[rid], self.eos, f"{name} request {j}")

    def close(self):
        self.manager.stop(block=True, timeout=60)
        self.manager.destroy()


def wait_for(feds, deadline):
    while not all(fed.finished() for fed in feds):
        for fed in feds:
            if not fed.finished():
                fed.poll(deadline)


@torch.no_grad()
def serve_managers(model, s, eos, count):
    rng = random.Random(s["seed"] + 1)
    feds = []
    try:
        for call in range(count):
            feds.append(Fed(model, s, eos, call, rng))
        for fed in feds:
            fed.manager.start()
        order = [(i, j) for i, fed in enumerate(feds) for j in range(len(fed.prompts))]
        rng.shuffle(order)
        order.sort(key=lambda ij: ij[1])  # each manager's own requests in order
        for step, (i, j) in enumerate(order):
            if s["restart"] and step == len(order) // 2 and len(feds) == 1:
                wait_for(feds, deadline=time.monotonic() + 120)  # idle, then stopped
                feds[0].manager.stop(block=True, timeout=60)
                feds[0].manager.start()  # the same manager again: a new batch processor
            feds[i].add(j)
        wait_for(feds, deadline=time.monotonic() + 120)
        for i, fed in enumerate(feds):
            fed.check(f"manager {i}")
    finally:
        for fed in feds:
            fed.close()


def run_scenario(s: dict) -> dict:
    model = model_of(s["family"], s["device"])
    for prompt in (p for c in s["calls"] for p in c):  # generate() refuses while enabled
        reference(s["family"], tuple(prompt), s["device"])
    eos = pick_eos(s)
    before = transformers_state(model)
    if s["mode"] in ("manager", "two"):
        with enable(model, s) as handle:
            serve_managers(model, s, eos, 1 if s["mode"] == "manager" else 2)
    elif s["mode"] == "reenable":
        for i, prompts in enumerate(s["calls"]):
            with enable(model, s, i) as handle:
                serve_batches(model, s, eos, [prompts], i)
    else:
        with enable(model, s) as handle:
            serve_batches(model, s, eos, s["calls"])
    assert not cb._shared.installed
    after = transformers_state(model)
    # breakgraph's experts keys stay registered for good (documented)
    changed = {k: (before[k], after[k]) for k in before if k != "experts" and before[k] != after[k]}
    # (stock CB keeps what it set on the model: its batch processor, compiled forwards)
    assert not changed or s.get("stock"), f"disable() left something behind: {changed}"
    if handle.stats is not None:  # every step replayed a graph unless its manager said no
        reasons = set(handle.stats.eager_fallbacks) - {"graphs off (use_cuda_graph=False)"}
        assert not reasons, f"eager steps: {handle.stats.eager_fallbacks}"
        decode = handle.decode_graphs
        assert decode is None or decode.off is None, f"decode graphs off: {decode.off}"
    return dict(eos=eos, stats=handle.stats)


# 14004: NaN logits of a decode graph (stale read rows never written; fixed in paged_decode);
# 3036: on a GPU, a forking manager's asynchronous step with no query token (now synchronous)
SEEDS = [0, 1, 2, 3, 14004, 3036]
#: seed -> how many families there were when it was found (it draws from those)
FIXED_DRAWS = {14004: len(_BEFORE_48), 3036: len(_BEFORE_48)}
if os.environ.get("BREAKGRAPH_FUZZ_CB_SEEDS"):
    START = int(os.environ.get("BREAKGRAPH_FUZZ_CB_START", "1000"))
    SEEDS = list(range(START, START + int(os.environ["BREAKGRAPH_FUZZ_CB_SEEDS"])))


@needs_cb
@pytest.mark.parametrize("seed", range(SEED, SEED + CONFIGS // 2))
def test_config_variants_equal_generate_or_are_refused(seed):
    """A random config of one family (``test_fuzz_prefill.draw_config``): refused with
    ``UnsupportedModelError`` exactly where breakgraph cannot serve it, else every request's
    greedy tokens and logprobs equal ``generate()``'s on its prompt alone."""
    model = build_variant(seed)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    refusal = expected_refusal(model.config, "enable_continuous_batching")
    enable = lambda: enable_continuous_batching(  # noqa: E731
        model, backend="emulated", query_buckets=(8, 16, 24), decode_graphs=rng.random() < 0.7
    )
    if refusal is not None:
        with pytest.raises(UnsupportedModelError, match=refusal):
            enable()
        return
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
               for _ in range(rng.randint(2, 5))]  # fmt: skip
    gen = generation_config(max_new_tokens=8, pad_token_id=vocab - 1)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                                 output_logits=True, return_dict_in_generate=True)  # fmt: skip
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                        for step, t in zip(out.logits, tokens)]  # fmt: skip
            expected.append((tokens, logprobs))
    cbc = cb_config(block_size=rng.choice([4, 8, 16, 32]), num_blocks=128, return_logprobs=True,
                    max_batch_tokens=rng.choice([8, 16, 24]),
                    max_blocks_per_request=rng.choice([None, 0, 2, 8]))  # fmt: skip
    with enable():
        outs = model.generate_batch(prompts, generation_config=gen, progress_bar=False,
                                    continuous_batching_config=cbc)  # fmt: skip
    assert len(outs) == len(prompts)
    for out in outs.values():
        tokens, logprobs = expected[prompts.index(list(out.prompt_ids))]
        where = f"seed {seed}: prompt of {len(out.prompt_ids)} tokens"
        assert out.error is None and out.generated_tokens == tokens, (where, out.error)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64),
                                   torch.tensor(logprobs, dtype=torch.float64), atol=2e-5,
                                   rtol=0, msg=lambda m: f"{where}: logprobs {m}")  # fmt: skip


@needs_cb
@pytest.mark.parametrize("seed", SEEDS)
def test_cb_scenario_equals_generate(seed):
    run_scenario(draw(seed, "cpu"))


@needs_cb
@pytest.mark.requires_cuda
@pytest.mark.parametrize("seed", SEEDS)
def test_cb_scenario_equals_generate_cuda(seed):
    """The same scenarios on the GPU: real captures and replays, the Triton decode kernel,
    transformers' CUDA streams, in fp32 against ``generate()`` on the GPU."""
    run_scenario(draw(seed, "cuda"))


def main(seeds) -> int:
    torch.set_num_threads(1)
    failures = 0
    for seed in seeds:
        s = draw(seed)
        if STOCK:
            s["stock"] = STOCK
        brief = {k: v for k, v in s.items() if k not in ("calls", "per_request_max_new")}
        brief["lengths"] = [[len(p) for p in c] for c in s["calls"]]
        begin = time.monotonic()
        try:
            run_scenario(s)
            verdict = "ok" if seed not in GAVE_UP else "ok (transformers gave up on some)"
        except Exception as error:  # noqa: BLE001 (a fuzzer reports every failure)
            failures += 1
            verdict = f"FAIL {type(error).__name__}: {str(error)[:600]}"
            for handle in [r() for r in list(cb._enabled.values())]:
                if handle is not None:
                    try:
                        handle.disable()
                    except Exception as again:  # noqa: BLE001
                        verdict += f" | disable: {again}"
        print(f"seed {seed} {time.monotonic() - begin:.1f}s {verdict} {brief}", flush=True)
    return failures


if __name__ == "__main__":
    first = [int(seed) for seed in sys.argv[1].split(",")]
    seeds = range(first[0], first[0] + int(sys.argv[2])) if len(sys.argv) > 2 else first
    sys.exit(min(main(seeds), 1))
