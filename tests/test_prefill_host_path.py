"""The per-call host path of ``PrefillRunner.prefill`` (issue 23 item 1).

Every call runs it before the device has anything to do, so it must stay small: the views it
writes through are made once, at construction (no tensor view, no ``.numpy()`` of the step
buffers per call), the step reaches the device by the graph's own first node, and what it
writes is exactly what the graphs and the attention breaks read.
``benchmarks/prefill_host_path.py`` measures it.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

transformers = pytest.importorskip("transformers")

from breakgraph.integrations.transformers import PrefillRunner  # noqa: E402
from breakgraph.integrations.transformers.prefill_buffers import StepBuffers  # noqa: E402

from benchmarks.tiny_models import tiny_config  # noqa: E402
from breakgraph.errors import InputError  # noqa: E402

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("one_cpu_thread")]

VOCAB = 128


@pytest.fixture
def runner(backend):
    device, dtype = ("cuda", torch.bfloat16) if backend == "cuda" else ("cpu", torch.float32)
    torch.manual_seed(0)
    config = tiny_config("LlamaConfig", vocab_size=VOCAB, max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=dtype, attn_implementation="sdpa"
    )
    runner = PrefillRunner(
        model.to(device).eval(), token_buckets=(16, 48), max_prompts=4, backend=backend, warmup=1
    )
    yield runner
    runner.close()


class _Calls(TorchFunctionMode):
    """Every torch function and tensor method called, up to the graph replay."""

    def __init__(self):
        super().__init__()
        self.calls, self.launched = [], False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.launched:
            self.calls.append(func)
        return func(*args, **(kwargs or {}))

    def count(self, func) -> int:
        return sum(f is func for f in self.calls)


def _watch(runner, prompts: list) -> _Calls:
    """The torch calls ``runner.prefill(prompts)`` makes before its graph replay (of the packed
    graph, or of the single-prompt graph on CUDA)."""
    watch = _Calls()
    ladders = [r for r in (runner._runner, runner._single) if r is not None]

    def launcher(replay):
        def launch(*args, **kwargs):
            watch.launched = True
            return replay(*args, **kwargs)

        return launch

    for ladder in ladders:
        ladder.replay = launcher(ladder.replay)
    try:
        with watch:
            runner.prefill(prompts)
    finally:
        for ladder in ladders:
            del ladder.replay
    assert watch.launched, "no graph was replayed"
    return watch


@pytest.mark.parametrize("where", ["host", "device"])
def test_a_call_issues_no_copy_and_makes_no_tensor_view_before_its_launch(runner, backend, where):
    """The step reaches the device by the graph's own first node: before the launch a call
    only writes the pinned host buffer (numpy), and device prompts are copied into it."""
    if where == "device" and backend != "cuda":
        pytest.skip("prompts on the device: CUDA only")
    prompts = [
        torch.randint(VOCAB, (n,), device="cpu" if where == "host" else "cuda") for n in (5, 9)
    ]
    for batch in ([prompts[0]], prompts):
        runner.prefill(batch)  # the bucket decision is cached from the second call on
        watch = _watch(runner, batch)
        if where == "host":  # a memory copy per host prompt: no tensor copy, numpy or view
            assert watch.count(torch.Tensor.copy_) == 0, watch.calls
            assert watch.count(torch.Tensor.numpy) == 0, watch.calls
            # one per prompt, and the weights' address (PrefillRunner refuses a moved model)
            assert watch.count(torch.Tensor.data_ptr) == len(batch) + 1, watch.calls
            assert watch.count(torch.Tensor.__getitem__) == 0, watch.calls
        else:  # one device-to-host copy (into a view of the host buffer) per prompt; the
            # first prompt's view is made once per length (the runner made it above)
            assert watch.count(torch.Tensor.copy_) == len(batch), watch.calls
            assert watch.count(torch.Tensor.numpy) == 0, watch.calls
            assert watch.count(torch.Tensor.__getitem__) == len(batch) - 1, watch.calls


@pytest.mark.parametrize("where", ["host", "device"])
def test_calls_issued_back_to_back_give_each_its_own_answer(runner, backend, where):
    """Calls made without reading the previous logits (owned and graph-memory ones): each
    call's graph copies the host buffer when it runs, so the next call must not restage it
    before; the logits equal those of calls made one at a time, on fresh random prompts."""
    if where == "device" and backend != "cuda":
        pytest.skip("prompts on the device: CUDA only")
    device = "cpu" if where == "host" else "cuda"
    batches = [
        [torch.randint(VOCAB, (n,), device=device) for n in lengths]
        for lengths in ([40], [3, 9], [16], [1], [7, 7, 7], [33], [2])
    ]
    alone = []
    for batch in batches:
        alone.append(runner.prefill(batch).logits.cpu())
    owned = [runner.prefill(batch).logits for batch in batches]  # no read in between
    for batch, want, got in zip(batches, alone, owned):
        torch.testing.assert_close(got.cpu(), want, msg=str([len(p) for p in batch]))
    for batch, want in zip(batches, alone):  # graph memory: read before the next call only
        got = runner.prefill(batch, owned=False).logits.cpu()
        torch.testing.assert_close(got, want)


def test_strided_offset_and_negated_prompts_are_staged_by_value(runner):
    """Host prompts are copied as raw memory when contiguous: a view at an offset must copy
    from its own start, and a strided or negated view (torch's lazy negation bit) must go
    through numpy, which reads values, not memory."""
    torch.manual_seed(1)
    ids = torch.randint(VOCAB, (14,))
    backing = torch.randint(VOCAB, (40,))
    backing[7:21] = ids
    strided = torch.randint(VOCAB, (28,))
    strided[::2] = ids
    variants = {
        "offset": backing[7:21],
        "strided": strided[::2],
        "negated": torch._neg_view(-ids),
    }
    first = torch.randint(VOCAB, (3,))
    want, want_second = runner.prefill([ids]).logits, runner.prefill([first, ids]).logits[1]
    for name, prompt in variants.items():
        assert torch.equal(prompt, ids), name
        torch.testing.assert_close(runner.prefill([prompt]).logits, want, msg=name)
        got = runner.prefill([first, prompt]).logits[1]  # the same, second in a batch
        torch.testing.assert_close(got, want_second, msg=name)


@pytest.mark.parametrize("bad", [[-1], [VOCAB], [2**62], [-(2**63)]])
def test_host_prompts_outside_the_vocabulary_are_refused(runner, bad):
    """Negative ids (a huge unsigned value in the one-pass check) and ids >= vocab, alone or in
    a batch; nothing is replayed and the runner keeps working."""
    good = torch.randint(VOCAB, (6,))
    wrong = torch.tensor([3, *bad, 4])
    for batch in ([wrong], [good, wrong], [wrong, good]):
        with pytest.raises(InputError, match=r"outside the vocabulary \(0\.\.127\)"):
            runner.prefill(batch)
    assert sum(runner.stats.calls.values()) == 0
    assert runner.prefill([good.to(runner.device)]).logits.shape == (1, VOCAB)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])  # both sides of the short check's limit
@pytest.mark.parametrize("bad", [-1, VOCAB, 2**63 - 1, -(2**63)])
def test_the_staged_vocabulary_check_refuses_any_bad_id_at_any_length(n, bad):
    steps = StepBuffers(256, 4, torch.device("cpu"), 0)
    for where in sorted({0, n // 2, n - 1}):
        ids = torch.randint(VOCAB, (n,))
        assert steps.write_ids([ids], [n], VOCAB)  # good ids pass
        ids[where] = bad
        with pytest.raises(InputError, match="outside the vocabulary"):
            steps.write_ids([ids], [n], VOCAB)
        split = [ids[: n // 2], ids[n // 2 :]] if n > 1 else [ids]
        with pytest.raises(InputError, match="outside the vocabulary"):
            steps.write_ids(split, [len(p) for p in split], VOCAB)
    edge = torch.full((n,), VOCAB - 1)
    assert steps.write_ids([edge], [n], VOCAB)  # the largest id is in the vocabulary


def _reference(lengths: list, bucket: int, pad: int, max_prompts: int, ids: list) -> dict:
    """What one committed step must hold, written the slow, obvious way."""
    positions, bounds, start = [], [], 0
    for n in lengths:
        positions += list(range(n))
        bounds.append((start, start + n))
        start += n
    total = start
    if bucket > total:
        bounds.append((total, bucket))
    ends = [end for _, end in bounds]
    return {
        "ids": ids + [pad] * (bucket - total),
        "positions": positions + list(range(total, bucket)),  # the tail keeps 0, 1, 2, ...
        "last": [end - 1 for end in ends[: len(lengths)]] + [0] * (max_prompts - len(lengths)),
        "cu": [0, *ends] + [bucket] * (max_prompts + 1 - len(ends)),
        "bounds": bounds,
    }


@pytest.mark.parametrize("p", [5, 12])  # 12: batches past the few-prompt path
def test_committed_steps_match_the_reference(p):
    """Random batches (one prompt, several, max_prompts, none: the capture's), each after
    larger ones (stale values must not survive), staged on the host, then uploaded."""
    t, pad = 64, 7
    steps = StepBuffers(t, p, torch.device("cpu"), pad)
    rng = random.Random(p)
    cases = [[], [64], [1], [3, 4], [1] * p, [60 - p, *[1] * (p - 1)], [2], [33], [5] * p, [1]]
    cases += [[rng.randint(1, 5) for _ in range(rng.randint(1, p))] for _ in range(60)]
    for lengths in cases:
        prompts = [torch.randint(VOCAB, (n,)) for n in lengths]
        total = sum(lengths)
        bucket = rng.choice([b for b in (total, 16, 48, 64) if b >= max(total, 1)])
        assert steps.write_ids(prompts, lengths, VOCAB)
        bounds = steps.commit(prompts, lengths, bucket)
        ids = list(itertools.chain.from_iterable(q.tolist() for q in prompts))
        want = _reference(lengths, bucket, pad, p, ids)
        assert bounds == want["bounds"], lengths
        steps.upload()  # what the graph's first node does
        steps.launched()
        for buffer in (steps.host, steps.device_buffer):  # staged, then copied
            assert buffer[:bucket].tolist() == want["ids"], lengths
            assert buffer[t : t + bucket].tolist() == want["positions"], lengths
            assert buffer[2 * t : 2 * t + p].tolist() == want["last"], lengths
            cu = buffer[2 * t + p :].view(torch.int32)[: p + 2]
            assert cu.tolist() == want["cu"], lengths
        k = len(bounds) + 1
        assert steps.cu_views[k].tolist() == want["cu"][:k]
        assert steps.cu_views[k].data_ptr() == steps.cu_seqlens.data_ptr()


def test_the_breakdown_script_runs_on_the_cpu(tmp_path):
    """``benchmarks/prefill_host_path.py`` end to end on the CPU (emulated, replay stubbed), so
    the GPU run cannot rot between runs; its table reads two trees' results side by side."""
    from benchmarks import prefill_host_path as script

    (result,) = script.main(["--iters", "20", "--split", "2", "--out", str(tmp_path)])
    (row,) = result["families"][0]["rows"]
    host = row["host_us"]
    assert set(script.HOST_KEYS) <= set(host), sorted(host)
    assert 0 < host["entry -> launch"] < host["return"]
    assert row["bucket"] == 32 and "host_us, 2 prompts" in row
    assert row["graph"] == "single-prompt"  # as on CUDA: one prompt replays that graph
    old = {**result, "tag": "old"}
    lines = script.table([old, result]).splitlines()
    assert lines[0].split()[-2:] == ["old", "this"]
    assert (tmp_path / "host-path.json").exists()
    argv = ["--device", "cuda", "--compare", ".baseline", "--out", "o", "--compare=x"]
    argv.append("--old-first")
    assert script._child_argv(argv, "/abs/o") == ["--device", "cuda", "--out", "/abs/o"]


def test_the_line_by_line_copy_of_the_path_stages_what_prefill_stages(runner, backend):
    """``benchmarks/prefill_host_lines.py`` repeats ``prefill``'s one-prompt path statement by
    statement: a traced call must leave the staging buffer as ``prefill`` leaves it and give
    its logits, with the ids written either way, so the lines it times are the path's."""
    from benchmarks import prefill_host_lines as lines

    def staged(bucket: int) -> list:  # what the bucket's graph reads of the staging buffer
        view = runner._steps.view
        return [view.ids[:bucket].tolist(), view.positions[:bucket].tolist(),
                view.last.tolist(), view.cu.tolist()]  # fmt: skip

    torch.manual_seed(3)
    for n in (5, 16, 30):
        prompt = torch.randint(VOCAB, (n,))
        bucket = runner._runner.bucket_for(n)
        runner.prefill([torch.randint(VOCAB, (n + 7,))])  # something else staged before
        want_logits = runner.prefill([prompt]).logits
        want = staged(bucket)
        for way in ("memmove", "numpy"):
            runner.prefill([torch.randint(VOCAB, (3,)), torch.randint(VOCAB, (n + 3,))])
            spans, logits = lines.one_prompt_lines(runner, prompt, ids_by=way)
            assert len(spans) == len(lines.LINES) and min(spans) >= 0
            assert staged(bucket) == want, (n, way)
            torch.testing.assert_close(logits, want_logits)
    result = lines.main(["--calls", "4"])
    row = result["families"]["tiny-llama"]["ids by memmove"]
    assert set(lines.LINES) < set(row) and row["entry -> launch"] > 0
