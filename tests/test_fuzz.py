"""The differential fuzzer: random programs, captured once, replayed on fresh inputs, vs eager.

``tests/fuzz_programs.py`` generates straight-line programs (elementwise ops, reductions,
views, in-place ops on inputs/views/fresh tensors, in-place metadata ops, ``out=``,
matmuls, ``break_graph()`` and eager breaks of many kinds) from a seed. Each program is
captured once and replayed several times on FRESH random inputs copied into the static
ones; every output and every (possibly mutated) input must match an eager run of the
same program on the same inputs. A failure prints the seed, the program's source, a
shrunk program with the same failure and the command that reproduces it.

Scale: ``BREAKGRAPH_FUZZ_PROGRAMS`` (default 300, emulated backend, a few seconds) and
``BREAKGRAPH_FUZZ_CUDA_PROGRAMS`` (default 2000, the GPU check), from seed
``BREAKGRAPH_FUZZ_START`` (default 0: fresh seeds for a long campaign). Seeds run in chunks of
``CHUNK`` so a failing test id names its seed range and its message the seed.
"""

from __future__ import annotations

import contextlib
import gc
import linecache
import os
import random

import pytest
import torch

import breakgraph
from breakgraph.runner import BucketedRunner

try:  # tests/ as a package (tests.helpers) or as a directory on sys.path
    from tests import fuzz_programs as fp
except ImportError:  # pragma: no cover
    import fuzz_programs as fp

#: Feature families that make programs fail today, with the issue-11 item each one is. They
#: stay in the generator but are left out of the fuzz runs; ``test_known_broken_still_broken``
#: asserts that each still fails on some seed (strict, like ``xfail(strict=True)``): when a fix
#: lands that test fails, and the family must be removed from here so the fuzzer covers it.
#: Value: (issue item, backends on which it fails). A minimal program of a family:
#: ``python tests/fuzz_programs.py --seed 0 --focus FAMILY --shrink``.
KNOWN_BROKEN: dict[str, tuple[str, tuple[str, ...]]] = {
    # every family the fuzzer found broken is fixed (issue 11 items 1, 5, 6, 9-12, 14 and the
    # fuzzer's own N1-N4); a new one goes here with its item and backends until it is fixed
}
#: Families that can only be generated with others: un-gated while checking they still fail.
NEEDS = {"break_raises_in_inference_mode": {"inference_mode_inside", "caught_break_exception"}}
#: The failure a family must still show (default: any failure).
SYMPTOM = {"break_raises_in_inference_mode": "error:LeftStateBehind"}

PROGRAMS = int(os.environ.get("BREAKGRAPH_FUZZ_PROGRAMS", "300"))
CUDA_PROGRAMS = int(os.environ.get("BREAKGRAPH_FUZZ_CUDA_PROGRAMS", "2000"))
START = int(os.environ.get("BREAKGRAPH_FUZZ_START", "0"))  # the first seed of each run
RAISING = max(20, PROGRAMS // 5)
CUDA_RAISING = max(20, CUDA_PROGRAMS // 10)
CHUNK = 50
STILL_BROKEN_SEEDS = 40  # a known-broken family must fail on one of these (focused) seeds, and
# still be in the program shrunk from that failure (so another family's bug does not count)


def gated(backend: str) -> frozenset[str]:
    """The families left out of the fuzz runs on ``backend``."""
    return frozenset(f for f, (_, backends) in KNOWN_BROKEN.items() if backend in backends)


def chunks(total: int) -> list:
    end = START + total
    return [
        pytest.param(
            range(start, min(start + CHUNK, end)),
            id=f"seeds{start}-{min(start + CHUNK, end) - 1}",
        )
        for start in range(START, end, CHUNK)
    ]


@pytest.fixture(scope="module", autouse=True)
def _fast_captures():
    """One thread, and a frozen heap for the collector's automatic full collections.

    Thousands of small programs allocate enough objects to trigger full collections, and with
    transformers imported one costs ~0.1 s (0.5 s on the H200's host), 30x a whole fuzz
    program; freezing the objects alive now (torch, transformers, earlier tests) leaves only
    the programs' own objects to walk. Lazy imports happen in a first run, before the freeze.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fp.run_program(fp.generate(0, gated("emulated")))
    gc.freeze()
    yield
    gc.unfreeze()
    torch.set_num_threads(threads)


def check_seeds(seeds: range, backend: str) -> None:
    """Run every seed; on failure report the first one (shrunk) and list the others."""
    exclude = gated(backend)
    failures = []
    for seed in seeds:
        program = fp.generate(seed, exclude)
        outcome = fp.run_program(program, backend)
        if not outcome.ok:
            failures.append((program, outcome))
    if failures:
        program, outcome = failures[0]
        invalid = "GENERATOR BUG (the program fails eagerly): " if outcome.kind == "invalid" else ""
        shrunk = fp.shrink(program, fp.same_failure(outcome.kind, backend))
        others = ", ".join(str(p.seed) for p, _ in failures[1:]) or "none"
        pytest.fail(
            f"{invalid}{len(failures)} of {len(seeds)} programs differ from eager "
            f"(other failing seeds: {others})\n"
            + fp.describe_failure(program, outcome, backend, exclude, shrunk),
            pytrace=False,
        )


# -- programs match eager --------------------------------------------------------------------------
@pytest.mark.parametrize("seeds", chunks(PROGRAMS))
def test_programs_match_eager(seeds):
    check_seeds(seeds, "emulated")


@pytest.mark.requires_cuda
@pytest.mark.parametrize("seeds", chunks(CUDA_PROGRAMS))
def test_programs_match_eager_cuda(seeds):
    check_seeds(seeds, "cuda")


# -- programs that must raise the named error ------------------------------------------------------
def check_raising(seeds: range, backend: str) -> None:
    for seed in seeds:
        program = fp.generate_raising(seed, gated(backend))
        outcome = fp.run_raising(program, backend)
        if not outcome.ok:
            pytest.fail(fp.describe_failure(program, outcome, backend), pytrace=False)


@pytest.mark.parametrize("seeds", chunks(RAISING))
def test_changed_outputs_and_host_syncs_raise_named_errors(seeds):
    """A break changing its output on replay raises CopyBackError naming it; a host sync in a
    segment raises HostSyncError at capture and leaves nothing behind. Never a value."""
    check_raising(seeds, "emulated")


@pytest.mark.requires_cuda
@pytest.mark.parametrize("seeds", chunks(CUDA_RAISING))
def test_changed_outputs_and_host_syncs_raise_named_errors_cuda(seeds):
    check_raising(seeds, "cuda")


# -- the known-broken families still fail ----------------------------------------------------------
def still_fails(family: str, backend: str) -> bool:
    exclude = gated(backend) - {family} - NEEDS.get(family, set())
    for seed in range(STILL_BROKEN_SEEDS):
        if family == "user_error_during_capture":
            program = fp.generate_raising(4 * seed + 3, exclude)
            if not fp.run_raising(program, backend).ok:
                return True
            continue
        program = fp.generate(seed, exclude, family)
        outcome = fp.run_program(program, backend)
        if outcome.ok or SYMPTOM.get(family, outcome.kind) != outcome.kind:
            continue
        # attribute the failure: the shrunk program that still fails must still use the family
        shrunk = fp.shrink(program, fp.same_failure(outcome.kind, backend), budget=200)
        if family in shrunk.families:
            return True
    return False


def known_broken(backend: str) -> list:
    marks = [pytest.mark.requires_cuda] if backend == "cuda" else []
    return [
        pytest.param(family, backend, id=f"{backend}-{family}", marks=marks)
        for family, (_, backends) in KNOWN_BROKEN.items()
        if backend in backends
    ]


@pytest.mark.parametrize("family, backend", known_broken("emulated") + known_broken("cuda"))
def test_known_broken_still_broken(family, backend):
    """Strict xfail: each gated family must still fail, or it must leave KNOWN_BROKEN."""
    item = KNOWN_BROKEN[family][0]
    assert still_fails(family, backend), (
        f"family {family!r} ({item}) no longer fails on {backend} (focused seeds "
        f"0..{STILL_BROKEN_SEEDS - 1}): its fix has landed. Remove it from KNOWN_BROKEN in "
        f"tests/test_fuzz.py (or from its backends) so the fuzzer covers it again."
    )


# -- the generator and the oracle themselves -------------------------------------------------------
def test_programs_are_a_function_of_their_seed():
    for seed in (0, 1, 17):
        assert fp.generate(seed).source() == fp.generate(seed).source()
    assert fp.generate(1).source() != fp.generate(2).source()


def test_a_reused_break_gets_an_argument_its_views_fit():
    """A break whose body views its argument (``a.view(5, 4)``, picked for the first call's
    contiguous argument) called again on a non-contiguous or expanded tensor made a program
    that fails eagerly (seed 54755: the second call got ``mean(0).expand_as(a)``)."""
    for seed in (54755,):
        assert fp.run_program(fp.generate(seed)).kind != "invalid", seed


def test_every_family_is_generated():
    """Every family in FAMILIES appears in some program (gated ones in focused programs)."""
    seen = set()
    for seed in range(PROGRAMS):
        seen |= fp.generate(seed, gated("emulated")).families
    for family in set(fp.FAMILIES) - seen - {"user_error_during_capture"}:
        assert family in fp.generate(0, focus=family).families, family
    assert "user_error_during_capture" in fp.generate_raising(3).families


def test_a_failure_names_the_seed_and_prints_the_program():
    program = fp.generate(5)
    message = fp.describe_failure(
        program,
        fp.Outcome("mismatch", "replay 0: output[0] differs"),
        "emulated",
        {"inplace_metadata_op"},
    )
    assert "seed=5" in message and "--seed 5" in message
    assert "--exclude inplace_metadata_op" in message
    assert program.source() in message
    assert "def program(" in message


def test_shrink_keeps_the_failure_and_drops_the_rest():
    program = next(
        p for p in map(fp.generate, range(50)) if len(p.body) >= 8 and "matmul" in p.families
    )
    shrunk = fp.shrink(program, lambda p: "matmul" in p.families)
    assert "matmul" in shrunk.families
    assert len(shrunk.body) < len(program.body) and len(shrunk.body) <= 3


def test_the_oracle_catches_wrong_replays():
    """A frozen host value in a segment (the documented pitfall) is reported as a mismatch, a
    host sync as HostSyncError: the oracle does not pass what it should not."""
    program = fp.generate(0, gated("emulated") | frozenset(fp.MAY_RAISE))
    frozen = program.replace(
        body=program.body + [fp.Stmt(['frozen = x0 * breakgraph.replay_context()["scale"]'])],
        outputs=["frozen"],
    )
    assert fp.run_program(frozen).kind == "mismatch"
    synced = program.replace(
        body=program.body + [fp.Stmt(["synced = x0 * float(x0.sum())"])], outputs=["synced"]
    )
    assert fp.run_program(synced).kind == "error:HostSyncError"


@pytest.mark.parametrize(
    "family, disable",
    [
        ("break_returns_persistent_by_context", "call_and_classify"),
        ("break_aliased_then_independent", "_overlap_groups"),
    ],
)
def test_the_oracle_catches_writes_into_user_memory_and_shared_outputs(
    family, disable, monkeypatch
):
    """With issue 22's checks switched off (copy-back as before: into any returned tensor, one
    leaf at a time), focused programs of these families fail: a replay that picks another
    adapter writes into the one captured (only the PERSISTENT check sees it: the outputs still
    match), and outputs shared at capture get the last copy. The families are not idle."""
    import breakgraph.copyback
    import breakgraph.graph

    if disable == "call_and_classify":
        monkeypatch.setattr(
            breakgraph.graph,
            "call_and_classify",
            lambda function, args, kwargs: (function(*args, **kwargs), frozenset()),
        )
    else:
        monkeypatch.setattr(breakgraph.copyback, "_overlap_groups", lambda *args: [])
    for seed in range(STILL_BROKEN_SEEDS):
        outcome = fp.run_program(fp.generate(seed, gated("emulated"), family))
        if outcome.kind == "mismatch":
            break
    else:
        pytest.fail(f"no {family} program failed with {disable} disabled")
    if family == "break_returns_persistent_by_context":
        assert "wrote into the long-lived tensor" in outcome.detail


# -- modes: eager breaks replay under their capture's grad mode and autocast -----------------------
MODES_PROGRAMS = int(os.environ.get("BREAKGRAPH_FUZZ_MODES_PROGRAMS", "300"))
#: bodies of generated breaks (``a``: the argument, ``W``: a module weight, ``RAISE``: a flag the
#: oracle sets for one replay); each computes something that depends on the modes it runs under
MODE_BREAKS = {
    "plain": ["return torch.sin(a @ W.to(a.dtype)) + 1"],
    "enters_autocast": [
        'with torch.autocast("cpu", dtype=torch.bfloat16):',
        "    y = a @ W.to(a.dtype)",
        "return y * 2",
    ],
    "enters_autocast_fp16": [
        'with torch.autocast("cpu", dtype=torch.float16):',
        "    return torch.sin(a @ W.to(a.dtype))",
    ],
    "enters_default_autocast": [  # the dtype autocast has now: torch's default, or the capture's
        'with torch.autocast("cpu"):',
        "    return torch.sin(a.float() @ W).float()",
    ],
    "disables_autocast": [
        'with torch.autocast("cpu", enabled=False):',
        "    return torch.sin(a.float() @ W)",
    ],
    "casts_float": ["return torch.sin(a @ W.to(a.dtype)).float() + 1"],
    "casts_bf16": ["return a.to(torch.bfloat16) * 2"],
    "reads_modes": [
        'flags = 2 * torch.is_autocast_enabled("cpu")',
        "flags += INFERENCE * torch.is_inference_mode_enabled()",
        'flags += 8 * (torch.get_autocast_dtype("cpu") == torch.float16)',
        'flags += 16 * torch.is_autocast_enabled("cuda") + GRAD * torch.is_grad_enabled()',
        "return a * 2 + float(flags)",
    ],
    "may_raise": ["if RAISE[0]:", '    raise ValueError("boom")', "return a.sin() + 1"],
}
MODE_SEGMENT_OPS = (
    "h = torch.sin(h @ W.to(h.dtype))",
    "h = h + x",
    "h = torch.softmax(h, -1) * 3",
    "h = h.cos() * 0.5",
    "breakgraph.break_graph()",
)
CAPTURE_GRAD = ("grad", "no_grad", "inference_mode")
CAPTURE_AUTOCAST = (None, torch.bfloat16, torch.float16)
REPLAY_AUTOCAST = (None, ("cpu", torch.bfloat16), ("cpu", torch.float16), ("cuda", torch.float16))


def _grad_mode(mode: str):
    if mode == "inference_mode":
        return torch.inference_mode()
    return torch.enable_grad() if mode == "grad" else torch.no_grad()


@contextlib.contextmanager
def _autocast_on(spec):
    """Autocast on ``spec`` = (device, dtype), or none. CUDA's through the thread state (this
    machine has no GPU, where ``torch.autocast("cuda")`` disables itself): a device the capture
    did not use, on, as an inference server's wrapper leaves it."""
    if spec is None:
        yield
    elif spec[0] == "cpu":
        with torch.autocast("cpu", dtype=spec[1]):
            yield
    else:
        torch.set_autocast_enabled("cuda", True)
        torch.autocast_increment_nesting()
        try:
            yield
        finally:
            torch.set_autocast_enabled("cuda", False)
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()


def _modes_now() -> tuple:
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
    )


#: what a program may wrap one break call in (inside the capture): its break's modes differ
#: from the other breaks' (each break is then pinned alone)
MODE_WRAPPERS = (
    None,
    None,
    'torch.autocast("cpu", dtype=torch.bfloat16)',
    'torch.autocast("cpu", enabled=False)',
    "torch.no_grad()",
    "torch.enable_grad()",
)


def generate_modes_program(seed: int, runner: bool = False) -> tuple[str, dict]:
    """A program's source (a function of ``seed``) and the modes it is captured/replayed under.
    ``runner``: for a ``BucketedRunner``, whose eager fallback runs in the caller's grad mode
    (documented): its breaks read only the autocast."""
    rng = random.Random(seed)
    grad = rng.choice(CAPTURE_GRAD)
    autocast = rng.choice(CAPTURE_AUTOCAST)
    lines = [
        f"# modes program seed={seed}: capture grad={grad} autocast={autocast}",
        "import torch, breakgraph",
        "RAISE = [False]",
    ]
    body = ["def program(x):", "    h = x"]
    kinds = list(MODE_BREAKS)
    for index in range(rng.randint(1, 5)):
        for _ in range(rng.randint(0, 2)):
            body.append("    " + rng.choice(MODE_SEGMENT_OPS))
        kind = rng.choice(kinds)
        wrapper = rng.choice(MODE_WRAPPERS)
        pinned = grad
        if grad != "inference_mode" and wrapper in ("torch.no_grad()", "torch.enable_grad()"):
            pinned = "no_grad" if wrapper == "torch.no_grad()" else "grad"
        # a break captured with grad on runs in the caller's grad mode (also inference_mode,
        # documented): only the pinned modes are compared
        # and one captured under enable_grad inside inference_mode replays under inference_mode
        # with grad off (autograd records nothing there either way): its grad mode is moot
        weights = (0, 0) if pinned == "grad" or runner else (32, 4)
        if pinned == "no_grad":  # replayed inside the caller's inference_mode it stays inside
            weights = (weights[0], 0)  # it (documented in concepts.md): only grad is pinned
        if grad == "inference_mode" and wrapper == "torch.enable_grad()" and not runner:
            weights = (0, 4)
        lines += ["@breakgraph.eager_on_graph", f"def b{index}(a):  # {kind}"]
        lines += [f"    GRAD, INFERENCE = {weights}"] * (kind == "reads_modes")
        lines += ["    " + line for line in MODE_BREAKS[kind]]
        if wrapper is None:
            body.append(f"    h = b{index}(h)")
        else:
            body += [f"    with {wrapper}:", f"        h = b{index}(h)"]
    body.append("    " + rng.choice(MODE_SEGMENT_OPS[:4]))
    body.append("    return h, h.float().sum(-1)")
    replays = [(rng.choice(CAPTURE_GRAD), rng.choice(REPLAY_AUTOCAST)) for _ in range(3)]
    return "\n".join(lines + body) + "\n", {"grad": grad, "autocast": autocast, "replays": replays}


def run_modes_program(seed: int) -> str | None:
    """Capture, replay under other modes on fresh inputs, compare with eager under the
    capture's modes; the caller's modes must be exactly restored (also when a break raises).
    Returns a failure's description, or None."""
    source, modes = generate_modes_program(seed)
    namespace: dict = {}
    filename = f"<modes program {seed}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    generator = torch.Generator().manual_seed(seed)
    weight = namespace["W"] = torch.randn(4, 4, generator=generator) * 0.5
    if seed % 2:  # a module's weight: autocast caches its casts (by tensor, not by dtype)
        weight = namespace["W"] = torch.nn.Parameter(weight)
    program = namespace["program"]
    cast = modes["autocast"]

    def capture_modes():
        stack = contextlib.ExitStack()
        stack.enter_context(_grad_mode(modes["grad"]))
        stack.enter_context(_autocast_on(("cpu", cast) if cast else None))
        return stack

    static = torch.randn(3, 4, generator=generator)
    # no Parameter where the program enters autocasts itself: torch's cache of weight casts,
    # keyed by tensor, not dtype, then mixes dtypes in eager code as well (two such breaks
    # within one caller's autocast region, or the caller's own use of the weight)
    plain = 'torch.autocast("cpu", dtype' not in source and 'torch.autocast("cpu")' not in source
    if not plain:
        weight = namespace["W"] = weight.detach()
    graph = breakgraph.BreakableCUDAGraph()
    with capture_modes(), breakgraph.capture(graph, backend="emulated"):
        outputs = program(static)
    raising = "may_raise" in source
    plan = list(modes["replays"]) + ([(modes["replays"][0][0], REPLAY_AUTOCAST[1])] * raising)
    for replay, (grad, autocast) in enumerate(plan):
        fresh = torch.randn(3, 4, generator=generator)
        static.copy_(fresh)
        namespace["RAISE"][0] = raise_now = raising and replay == len(plan) - 1
        where = f"replay {replay} under grad={grad} autocast={autocast}"
        with _grad_mode(grad), _autocast_on(autocast):
            before = _modes_now()
            mine = fresh @ weight  # the caller's own use of the weight, before and after
            try:
                graph.replay()
            except ValueError:
                if not raise_now:
                    raise
            else:
                if raise_now:
                    return f"{where}: the break's ValueError did not propagate"
            after = _modes_now()
            if (fresh @ weight).dtype != mine.dtype:
                return f"{where}: the caller's matmul changed dtype across the replay"
        if before != after:
            return f"{where}: the caller's modes {before} became {after}"
        if raise_now:
            continue
        got = [o.clone() for o in outputs]
        with capture_modes():
            expected = program(fresh.clone())
        for i, (g, e) in enumerate(zip(got, expected)):
            if g.dtype != e.dtype:
                return f"{where}: output {i} is {g.dtype}, eager (capture's modes) {e.dtype}"
            try:
                torch.testing.assert_close(g, e)
            except AssertionError as exc:
                return f"{where}: output {i} differs: {str(exc).splitlines()[:3]}"
    return None


def run_modes_runner(seed: int) -> str | None:
    """A ``BucketedRunner`` of a generated program, built under an autocast (or none), a bucket
    added under another one, called at bucket sizes, between them and above every bucket (the
    eager fallback) under the caller's modes: every output has the dtypes and values of the
    program run eagerly under no_grad and the runner's autocast."""
    source, _ = generate_modes_program(seed, runner=True)
    rng = random.Random(-seed)
    namespace: dict = {}
    exec(compile(source, f"<modes runner program {seed}>", "exec"), namespace)
    generator = torch.Generator().manual_seed(seed)
    namespace["W"] = torch.randn(4, 4, generator=generator) * 0.5
    program = namespace["program"]
    built = rng.choice(REPLAY_AUTOCAST[:3])
    with _autocast_on(built):
        runner = BucketedRunner(program, (4, 8), (torch.randn(1, 4),), backend="emulated")
    try:
        with runner.capture_window(), _autocast_on(rng.choice(REPLAY_AUTOCAST)):
            runner.add_buckets([16])
        for rows in (3, 8, 12, 30):
            grad, autocast = rng.choice(CAPTURE_GRAD), rng.choice(REPLAY_AUTOCAST)
            x = torch.randn(rows, 4, generator=generator)
            with _grad_mode(grad), _autocast_on(autocast):
                before = _modes_now()
                got = runner(x, owned=True)
                if _modes_now() != before:
                    return f"{rows} rows under {grad} {autocast}: the caller's modes changed"
            with torch.no_grad(), _autocast_on(built):
                expected = program(x.clone())
            for i, (g, e) in enumerate(zip(got, expected)):
                if g.dtype != e.dtype:
                    return f"runner built under {built}, {rows} rows under {autocast}: output {i} "\
                        f"is {g.dtype}, eager {e.dtype}"
                try:
                    torch.testing.assert_close(g, e)
                except AssertionError as exc:
                    return f"runner built under {built}, {rows} rows under {autocast}: output "\
                        f"{i} differs: {str(exc).splitlines()[:3]}"
    finally:
        runner.close()
    return None


def test_breaks_replay_under_their_capture_modes():
    """Generated programs (breaks that read the modes, enter or disable autocast, cast) captured
    under grad / no_grad / inference_mode and optionally ``torch.autocast("cpu")``, replayed
    under other grad modes and autocasts (also CUDA's, which the capture never used): each
    replay equals an eager run under the CAPTURE's modes, and leaves the caller's modes as they
    were, also when a break raises. A sixth of them also run through a ``BucketedRunner`` built
    under an autocast, with a bucket added under another (:func:`run_modes_runner`).
    ``BREAKGRAPH_FUZZ_MODES_PROGRAMS`` programs (default 300) from ``BREAKGRAPH_FUZZ_START``."""
    failures = []
    for seed in range(START, START + MODES_PROGRAMS):
        try:
            problem = run_modes_program(seed)
            if problem is None and seed % 6 == 0:  # a sixth also through a BucketedRunner
                problem = run_modes_runner(seed)
        except Exception as exc:  # noqa: BLE001 (reported with its seed and program)
            problem = f"raised {exc!r}"
        if problem is not None:
            failures.append((seed, problem))
    if failures:
        seed, problem = failures[0]
        pytest.fail(
            f"{len(failures)} of {MODES_PROGRAMS} mode programs failed (seeds "
            f"{[s for s, _ in failures][:20]}); seed {seed}: {problem}\n"
            + generate_modes_program(seed)[0],
            pytrace=False,
        )
