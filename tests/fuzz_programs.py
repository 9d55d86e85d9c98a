"""Random straight-line programs for breakgraph's differential fuzzer (``tests/test_fuzz.py``).

A program is a deterministic function of its seed: a few input tensors, a body of
segment code (elementwise ops, reductions, views, in-place ops on inputs, views and
fresh tensors, in-place metadata ops, ``out=`` ops, matmuls, ``break_graph()``) and
calls to generated ``@breakgraph.eager_on_graph`` functions of many kinds (new
tensors, their argument, views of it, nested containers, in-place mutation, host work
with ``.item()`` and boolean masks, ``replay_context()``, ``capture_stub``s, long-lived
tensors, outputs that share memory; and, from :meth:`_Generator.rich_break`, trees of
leaves two containers deep: bf16/fp16/fp64/int/bool and zero-size tensors, non-contiguous
views of new tensors, the break's second argument, a tensor a segment computed, the same
values with other strides on replay, parameters, Python values next to tensors), two
breaks in a row, and parameters (``PARAMS``) that the oracle gives new values in place
between replays. It is emitted as readable Python source and that very source is what
runs, so a failure prints a program that reproduces it.

The oracle (:func:`run_program`): capture the program once, then for several replays
copy FRESH random inputs into the static ones, replay, run the same program eagerly
on copies of the same inputs and compare every output and every input (inputs may be
mutated), and the program's long-lived tensors (``PERSISTENT``: the user's memory, which
a replay must leave as the eager run does, and a failed replay must not write). A
program must match eager on every replay; programs of the families in :data:`MAY_RAISE`
may instead raise the named breakgraph error (the contract the core may choose for
them, from a break of such a family), never return a wrong value.

Only programs whose graph semantics are well defined are generated: no host sync
inside a segment, no randomness, no read of uninitialised memory, no in-place write
that partially overlaps its source, no in-place metadata change of a tensor a break
holds, no write through a ``reshape`` (view or copy depends on strides), and no write
after a break whose output aliases its argument on one side of capture/replay only.
Programs that must fail (:func:`generate_raising`) are checked separately: a break
that changes its output structure, a shape (also from or to zero rows, or deep inside
nested containers), a dtype (bf16, bool, int64) or a Python value on replay must raise
``CopyBackError`` naming it,
a host sync inside a segment must raise ``HostSyncError`` at capture.

Command line (prints the program, runs it, optionally shrinks a failure)::

    python tests/fuzz_programs.py --seed 17                      # emulated backend
    python tests/fuzz_programs.py --seed 17 --focus inplace_metadata_op --shrink
    python tests/fuzz_programs.py --seed 17 --ci --focus capture_stub --shrink  # as in the suite
    python tests/fuzz_programs.py --seed 17 --backend cuda
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import linecache
import math
import random
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

if __name__ == "__main__":  # run as a script: test the checkout's breakgraph, not an installed one
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

import torch

import breakgraph

# -- feature families ------------------------------------------------------------------------------
FAMILIES: dict[str, str] = {
    "elementwise": "unary and binary elementwise ops, with broadcasting",
    "reduction": "sum/mean/amax/logsumexp/vector_norm over a dim, softmax, cumsum",
    "matmul": "a @ b and torch.matmul (2-D and 3-D operands)",
    "matmul_vector": "a @ b with a 1-D operand (aten.matmul squeezes its result in place)",
    "view": "slicing, select, narrow, t/transpose/permute, diagonal, (un)squeeze, view, "
    "reshape, expand",
    "reshape_copy": "reshape/flatten/contiguous of a non-contiguous tensor (a copy behind a "
    "view-like op)",
    "dtype_conversion": "x.double()...float(), x.to(dtype) round trips",
    "inference_mode_composite_copy": "reshape_copy or dtype_conversion under inference_mode "
    "(the emulator sees aten.reshape/contiguous/to, whose schema says 'view')",
    "inplace_input": "in-place ops on an input",
    "inplace_view": "in-place ops and slice assignment through a view",
    "inplace_fresh": "in-place ops on a tensor computed in the program",
    "inplace_break_output": "in-place ops on a tensor an eager break returned",
    "inplace_metadata_op": "unsqueeze_, squeeze_, t_, transpose_, as_strided_ on a tensor "
    "created in a segment",
    "out_op": "out= ops into new_empty buffers and into existing tensors",
    "break_graph": "breakgraph.break_graph()",
    "break_new": "an eager break returning new tensors",
    "break_returns_argument": "an eager break returning its argument (the zero-copy pattern)",
    "break_returns_view_of_argument": "an eager break returning a view of its argument",
    "break_container": "an eager break returning a tuple/list/dict/namedtuple/dataclass/object",
    "break_python_value": "a stable Python value (int, str, None) in a break's output",
    "break_mutates_argument": "an eager break mutating its argument in place",
    "break_host_item": "an eager break with .item()-driven host work and control flow",
    "break_host_mask": "an eager break with boolean masks and data-dependent counts",
    "break_context": "an eager break reading breakgraph.replay_context() (differs per replay)",
    "break_kwargs": "tensor keyword arguments and frozen Python arguments of a break",
    "break_reused": "the same eager function called at two sites (two breaks)",
    "nested_break": "an eager function calling another one (one break)",
    "capture_stub": "capture_stub returning zeros of the real function's structure",
    "capture_stub_returns_argument": "capture_stub and function both returning the argument "
    "(or a view of it): an in-place function, e.g. an in-place collective",
    "capture_stub_identity": "capture_stub returning its argument, the function a new tensor "
    "(issue 11 item 1)",
    "break_returns_argument_then_new": "a break returning its argument at capture and a new "
    "tensor on replay (issue 11 item 1)",
    "break_returns_new_then_argument": "a break returning a new tensor at capture and its "
    "argument on replay",
    "break_returns_expanded_view": "a break returning an expanded (stride-0) view of a new "
    "tensor (issue 11 item 10)",
    "break_returns_slots_object": "a break returning an object with __slots__, "
    "check_values=False (issue 11 item 6)",
    "break_returns_cycle": "a break returning an object that refers to itself (issue 11 item 11)",
    "break_check_values_false": "check_values=False with an informational Python value that "
    "changes per replay",
    "break_returns_persistent": "a break returning a long-lived tensor (an adapter it reads, a "
    "global buffer it writes into), or a view of it: the same one on every call",
    "break_returns_persistent_by_context": "a break returning the long-lived tensor that "
    "replay_context() chooses (multi-adapter; issue 22 item 1)",
    "break_returns_aliased_outputs": "a break returning outputs that share memory, (y, y) or "
    "(y, y[1:]), on every call",
    "break_aliased_then_independent": "a break returning outputs that share memory at capture "
    "and independent ones on replay (issue 22 item 2)",
    "break_independent_then_aliased": "a break returning independent outputs at capture and "
    "outputs that share memory on replay",
    "caught_break_exception": "a break raising an exception that the program catches inside "
    "the capture (issue 11 item 9)",
    "break_raises_in_inference_mode": "a break that raises (or is refused) at capture inside a "
    "torch.inference_mode() block entered inside the capture",
    "user_error_during_capture": "(raising programs) a break raising the user's own "
    "RuntimeError mentioning 'capturing' (issue 11 item 12)",
    "inference_mode_outside": "captured and run eagerly inside torch.inference_mode(), "
    "replayed outside it",
    "inference_mode_inside": "torch.inference_mode() entered inside the capture block",
    "break_mutates_inference_tensor": "a break mutating an inference tensor in place, replayed "
    "outside inference_mode (issue 11 item 14)",
    "replay_under_autocast": "replays run inside torch.autocast (a graph must ignore it)",
    # break outputs of the second generation (rich_break): any mix of these leaves, nested
    "break_nested_structure": "a break returning containers inside containers (tuples, lists, "
    "dicts, namedtuples, dataclasses, objects two levels deep)",
    "break_returns_other_dtype": "a break returning bf16/fp16/fp64/int64/int32/bool tensors",
    "break_returns_zero_size": "a break returning zero-size tensors (new, views of new ones, "
    "views of its argument, one kind at capture and another on replay)",
    "break_returns_view_of_new": "a break returning a non-contiguous view of a tensor it made "
    "(t(), slices, [..., ::2], diagonal())",
    "break_returns_second_argument": "a break returning its second argument, or a view of it",
    "break_returns_captured": "a break returning a tensor a segment computed, reached through a "
    "dict/list/object the segment built and passed in",
    "break_changes_strides": "a break returning the same values with other strides at capture "
    "and on replay (transposed or gapped storage)",
    "break_mixed_python_values": "floats, bools, NaN, torch.Size, dtypes and tuples next to "
    "tensors in a break's output",
    "break_bool_argument": "a bool tensor made in a segment passed to a break",
    "consecutive_breaks": "two breaks in a row, the second on the first's output, with no "
    "captured op (or only break_graph()) between them",
    "params_mutated": "module-level parameters (nn.Parameter) read in segments and breaks, given "
    "new values in place between replays by the oracle",
}

#: Families whose programs may raise the named error instead of matching eager (at capture or
#: on replay): the contracts issue 11 leaves to the core. A wrong value is never accepted.
MAY_RAISE: dict[str, type[BaseException]] = {
    "capture_stub_identity": breakgraph.CopyBackError,
    "break_returns_argument_then_new": breakgraph.CopyBackError,
    "break_returns_expanded_view": breakgraph.BreakgraphError,
    "break_returns_slots_object": breakgraph.CopyBackError,
    "break_returns_cycle": breakgraph.BreakgraphError,
    "caught_break_exception": breakgraph.CaptureError,
    "break_returns_persistent_by_context": breakgraph.CopyBackError,
    "break_aliased_then_independent": breakgraph.CopyBackError,
}

#: Ways a break can change its output on replay; each must raise CopyBackError naming it.
BAD_BREAKS = (
    "tuple_length",
    "dict_keys",
    "shape",
    "dtype",
    "tensor_to_none",
    "none_to_tensor",
    "python_value",
    "sequence_type",
    "dataclass_type",
    "missing_attribute",
    "dtype_bf16",
    "bool_to_float",
    "int_to_float",
    "zero_size_to_rows",
    "nested_shape",
    "nested_value",
)
#: Host syncs inside a segment; each must raise HostSyncError at capture.
HOST_SYNCS = (
    "float({v}.sum())",
    "{v}.sum().item()",
    "{v}[{v} > 0].sum()",
    "torch.nonzero({v})",
    "bool({v}.amax() > 0)",
    "{v}.masked_select({v} > 0)",
)

#: Families whose breaks may raise during the capture pass.
RAISE_AT_CAPTURE = {
    "caught_break_exception",
    "user_error_during_capture",
    "break_returns_expanded_view",
    "break_returns_cycle",
    "break_returns_slots_object",
}
#: Families that combine others: focusing on one boosts its parts.
FOCUS_ON = {
    "break_raises_in_inference_mode": {"inference_mode_inside", "caught_break_exception"},
    "break_mutates_inference_tensor": {
        "break_mutates_argument",
        "inference_mode_outside",
        "inference_mode_inside",
    },
    "inference_mode_composite_copy": {
        "inference_mode_outside",
        "inference_mode_inside",
        "view",
        "dtype_conversion",
    },
}
USER_ERROR = "my_op is not supported while capturing; call it during capture only via a stub"
MODES = ("no_grad", "inference_mode_outside", "inference_mode_inside")
CAPTURE_CONTEXT = {"phase": "capture", "scale": 1.0}


def replay_context_for(seed: int, replay: int) -> dict:
    """The ``replay_context()`` of one replay: a per-replay host value breaks may read."""
    return {"phase": "replay", "scale": round(0.5 + ((seed * 7919 + replay * 104729) % 97) / 64, 4)}


# -- programs --------------------------------------------------------------------------------------
@dataclass
class Stmt:
    """One statement of the body: its source lines, the families it exercises and the
    module-level definitions (eager functions, stubs, classes) it needs."""

    lines: list[str]
    families: frozenset[str] = frozenset()
    needs: tuple[str, ...] = ()


@dataclass
class Program:
    """A generated program; :meth:`source` is what runs."""

    seed: int
    inputs: list[tuple[int, ...]]
    body: list[Stmt]
    outputs: list[str]
    definitions: dict[str, tuple[list[str], tuple[str, ...]]]  # name -> (lines, needs)
    mode: str = "no_grad"
    replay_autocast: bool = False
    expect: tuple[type[BaseException], str | None] | None = None  # raising programs only
    label: str = ""  # how it was generated (for the reproduce line)

    @property
    def families(self) -> frozenset[str]:
        found = set().union(*(s.families for s in self.body)) if self.body else set()
        if self.mode != "no_grad":
            found.add(self.mode)
        else:  # tags that describe a statement under inference_mode (the shrinker may drop it)
            found -= {"break_mutates_inference_tensor", "inference_mode_composite_copy"}
        if self.mode == "inference_mode_inside" and found & RAISE_AT_CAPTURE:
            found.add("break_raises_in_inference_mode")
        if self.replay_autocast:
            found.add("replay_under_autocast")
        return frozenset(found)

    def _needed_definitions(self) -> list[str]:
        wanted: set[str] = set()
        stack = [n for s in self.body for n in s.needs]
        while stack:
            name = stack.pop()
            if name not in wanted:
                wanted.add(name)
                stack.extend(self.definitions[name][1])
        return [n for n in self.definitions if n in wanted]

    def source(self) -> str:
        names = [f"x{i}" for i in range(len(self.inputs))]
        lines = [
            f"# breakgraph fuzz program: seed={self.seed} mode={self.mode} "
            f"replay_autocast={self.replay_autocast}",
            f"# families: {', '.join(sorted(self.families))}",
            "import collections",
            "import dataclasses",
            "import types",
            "",
            "import torch",
            "",
            "import breakgraph",
            "",
        ]
        for name in self._needed_definitions():
            lines += self.definitions[name][0] + [""]
        lines.append(f"INPUT_SHAPES = {self.inputs!r}  # inputs: torch.randn(shape) each")
        lines.append(f"MODE = {self.mode!r}")
        lines.append("")
        lines.append(f"def program({', '.join(names)}):")
        indent = "    "
        if self.mode == "inference_mode_inside":
            lines.append("    with torch.inference_mode():")
            indent = "        "
        for stmt in self.body:
            lines += [indent + line for line in stmt.lines]
        lines.append(indent + f"return ({''.join(o + ', ' for o in self.outputs)})")
        return "\n".join(lines) + "\n"

    def compile(self) -> Callable:
        """Execute the source and return its ``program`` function (tracebacks show its lines)."""
        text = self.source()
        filename = f"<fuzz program seed={self.seed}{' ' + self.label if self.label else ''}>"
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        module = types.ModuleType(f"breakgraph_fuzz_{self.seed}")
        sys.modules[module.__name__] = module  # dataclasses look their module up while defined
        try:
            exec(compile(text, filename, "exec"), module.__dict__)
        finally:
            del sys.modules[module.__name__]
        return module.program

    def replace(self, **changes) -> Program:
        return dataclasses.replace(self, **changes)


# -- the generator ---------------------------------------------------------------------------------
@dataclass
class _Var:
    """What the generator knows about a tensor variable."""

    name: str
    shape: tuple[int, ...]
    root: str  # storage identity: views share their base's root
    contiguous: bool  # known contiguous (conservative: False when unsure)
    origin: str  # "input" | "op" (owns fresh storage) | "view" | "break"
    writable: bool = True  # False for reshape (view or copy) and expand results
    pinned: bool = False  # held by a break: its metadata must not change afterwards
    inference: bool = False  # an inference tensor (created in a segment under inference mode)
    special: bool = False  # not float32 or zero-size: an output, never an operand of statements


@dataclass
class _Leaf:
    """One leaf of a break's output: ``expr`` in the function, ``stub`` in its capture stub."""

    kind: str  # "new" | "arg" | "view" | "expanded" | "py"
    expr: str
    shape: tuple[int, ...] | None = None
    stub: str | None = None
    view_writable: bool = True
    view_contiguous: bool = False


@dataclass
class _BreakDef:
    name: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...] | None
    has_scale: bool
    structure: str  # "single" | "tuple" | "list" | "dict" | "namedtuple" | "dataclass" | "object"
    leaves: list[_Leaf]
    mutates: bool
    families: frozenset[str]
    needs: tuple[str, ...]
    reusable: bool
    a_contiguous: bool = False  # its body views its argument as contiguous (``a.view(...)``)


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    out = []
    for x, y in zip(reversed((1,) * (len(b) - len(a)) + a), reversed((1,) * (len(a) - len(b)) + b)):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y) if 1 in (x, y) else x)
    return tuple(reversed(out))


UNARY = (
    "torch.tanh({a})",
    "torch.sigmoid({a})",
    "torch.sin({a})",
    "torch.cos({a})",
    "{a}.abs()",
    "torch.relu({a})",
    "-{a}",
    "{a}.clamp(-1.5, 1.5)",
    "{a} * 0.5",
    "{a} + 1.0",
    "torch.log1p({a}.abs())",
    "torch.sqrt({a}.abs() + 1.0)",
    "torch.exp(-{a}.abs())",
    "{a}.clone()",
)
BINARY = (
    "{a} + {b}",
    "{a} - {b}",
    "{a} * {b}",
    "torch.maximum({a}, {b})",
    "torch.minimum({a}, {b})",
    "torch.where({a} > {b}, {a}, {b})",
    "{a} / ({b}.abs() + 1.0)",
    "torch.lerp({a}, {b}, 0.25)",
    "torch.atan2({a}, {b})",
)
INPLACE_UNARY = (
    "{d}.mul_(0.5)",
    "{d}.add_(1.0)",
    "{d}.clamp_(-1.0, 1.0)",
    "{d}.tanh_()",
    "{d}.sigmoid_()",
    "{d}.abs_()",
    "{d}.neg_()",
    "{d}.fill_(0.25)",
    "{d}.masked_fill_({d} > 0.5, 0.0)",
)
INPLACE_BINARY = (
    "{d}.add_({s})",
    "{d}.mul_({s})",
    "{d}.sub_({s}, alpha=0.5)",
    "{d}.copy_({s})",
    "{d}.lerp_({s}, 0.5)",
    "{d}.addcmul_({s}, {s}, value=0.1)",
    "{d}.masked_fill_({s} > 0, -1.0)",
)
NEW_IN_BREAK = (
    "torch.tanh(a) * 0.5",
    "a * 2.0 - 1.0",
    "torch.sin(a) + 0.5",
    "a.clone()",
    "a.abs() + 0.25",
)


ALIASED_KINDS = (
    "break_returns_aliased_outputs",
    "break_aliased_then_independent",
    "break_independent_then_aliased",
)
#: The long-lived tensors of a program (module level): adapters and global buffers by key.
PERSISTENT_HELPER = [
    "PERSISTENT = {}  # long-lived tensors by key: adapters, global buffers",
    "",
    "",
    "def persistent(key, like):",
    '    """The long-lived tensor ``key``, shaped like ``like``: made once, then the same one."""',
    "    if key not in PERSISTENT:",
    "        with torch.inference_mode(False):  # a normal tensor, whatever mode calls first",
    "            generator = torch.Generator().manual_seed(key)",
    "            made = torch.randn(like.shape, generator=generator)",
    "            PERSISTENT[key] = made.to(like.device, like.dtype)",
    "    return PERSISTENT[key]",
]


#: The program's parameters (module level): the oracle writes new values into them in place
#: before every replay, as an optimizer step or a weight reload would.
PARAMS_HELPER = [
    "PARAMS = {}  # parameters by key: new values are copied into them between replays",
    "",
    "",
    "def param(key, shape, like):",
    '    """Parameter ``key``: made once (outside any inference mode), then the same one."""',
    "    if key not in PARAMS:",
    "        with torch.inference_mode(False):",
    "            generator = torch.Generator().manual_seed(key)",
    "            made = torch.randn(shape, generator=generator).to(like.device, like.dtype)",
    "            PARAMS[key] = torch.nn.Parameter(made)",
    "    return PARAMS[key]",
]
RESTRIDED_HELPER = [
    "def _restrided(y):",
    '    """``y``\'s values in a tensor of other strides: transposed storage, or every other',
    '    element of a buffer twice as long (same shape, dtype and device)."""',
    "    if y.dim() >= 2:",
    "        out = y.new_empty(tuple(reversed(y.shape))).permute(*reversed(range(y.dim())))",
    "    else:",
    "        out = y.new_empty(y.shape[:-1] + (2 * y.shape[-1],))[..., ::2]",
    "    return out.copy_(y)",
]
#: Leaves of other dtypes a rich break makes from a float tensor ``{y}`` (expr, same shape).
OTHER_DTYPES = (
    "{y}.to(torch.bfloat16)",
    "{y}.half()",
    "{y}.double() * 2.0",
    "{y} > 0",
    "({y} * 4.0).round().long()",
    "({y} * 4.0).to(torch.int32)",
)
#: Python values next to tensors in a rich break's output (``a`` is its argument).
PY_VALUES = (
    "3",
    "2.5",
    "True",
    "None",
    '"tag"',
    'float("nan")',
    "a.shape",
    "a.dtype",
    "(1, (2, 3))",
    "a.dim()",
)
#: Containers of rich break outputs.
CONTAINERS = ("tuple", "list", "dict", "namedtuple", "dataclass", "object")
#: The rich break families and the leaf kind each one guarantees.
RICH_KINDS = {
    "break_nested_structure": "new",
    "break_returns_other_dtype": "other_dtype",
    "break_returns_zero_size": "zero_size",
    "break_returns_view_of_new": "view_of_new",
    "break_returns_second_argument": "second_arg",
    "break_returns_captured": "captured",
    "break_changes_strides": "restrided",
    "break_mixed_python_values": "python",
    "break_bool_argument": "masked",
}
LEAF_FAMILY = {kind: family for family, kind in RICH_KINDS.items()} | {
    "new": "break_new",
    "param": "params_mutated",
}


def _returned(structure: str, exprs: list[str]) -> str:
    """The return expression of ``exprs`` in a single/tuple/list/dict structure."""
    if structure == "single":
        return exprs[0]
    if structure == "tuple":
        return "(" + "".join(e + ", " for e in exprs) + ")"
    if structure == "list":
        return "[" + ", ".join(exprs) + "]"
    return "{" + ", ".join(f'"k{i}": {e}' for i, e in enumerate(exprs)) + "}"


class _Generator:
    def __init__(
        self,
        seed: int,
        exclude: Iterable[str] = (),
        focus: str | None = None,
        bad: str | None = None,
        sync: str | None = None,
    ):
        self.seed = seed
        self.rng = random.Random(seed)
        self.exclude = set(exclude)
        self.focus = focus
        self.bad, self.sync = bad, sync
        self.vars: dict[str, _Var] = {}
        self.readonly_roots: set[str] = set()
        self.definitions: dict[str, tuple[list[str], tuple[str, ...]]] = {}
        self.breaks: list[_BreakDef] = []
        self.counter = 0
        self.mode = "no_grad"
        self.prefer_last = False
        # a break output's strides differ between capture and eager runs (and so may those of
        # what is computed from it): as_strided_, which reads the layout, would differ too, and
        # reshape/flatten/contiguous would be a view in one run and a copy in the other
        self.layout_varies = False

    # -- helpers ---------------------------------------------------------------------------------
    def allowed(self, family: str) -> bool:
        return family not in self.exclude

    def boost(self, family: str) -> float:
        return 6.0 if family in FOCUS_ON.get(self.focus, {self.focus}) else 1.0

    def new_name(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def pick(self, candidates: list[_Var]) -> _Var | None:
        if not candidates:
            return None
        if self.prefer_last:  # the second of two consecutive breaks: the first's output
            return candidates[-1]
        # recent variables are likelier: programs become chains, not fans
        weights = [1.0 + i for i in range(len(candidates))]
        return self.rng.choices(candidates, weights)[0]

    def tensors(self, **where) -> list[_Var]:
        out = []
        for v in self.vars.values():
            if v.special:
                continue
            if where.get("min_dim") is not None and len(v.shape) < where["min_dim"]:
                continue
            if where.get("writable") and not (v.writable and v.root not in self.readonly_roots):
                continue
            out.append(v)
        return out

    def add(self, var: _Var) -> _Var:
        var.inference = var.inference or (self.mode != "no_grad" and var.origin == "op")
        self.vars[var.name] = var
        return var

    def fresh(self, prefix: str, shape: tuple, contiguous: bool) -> _Var:
        name = self.new_name(prefix)
        return self.add(_Var(name, tuple(shape), name, contiguous, "op"))

    def view_of(
        self, base: _Var, shape: tuple, contiguous: bool, writable: bool = True, prefix: str = "v"
    ) -> _Var:
        name = self.new_name(prefix)
        var = _Var(name, tuple(shape), base.root, contiguous, "view", base.writable and writable)
        var.inference = base.inference
        return self.add(var)

    # -- program ---------------------------------------------------------------------------------
    def program(self) -> Program:
        rng = self.rng
        modes = [m for m in MODES if m == "no_grad" or self.allowed(m)]
        weights = [6.0 if m == "no_grad" else self.boost(m) for m in modes]
        self.mode = rng.choices(modes, weights)[0]
        if self.mode == "inference_mode_inside" and not self.allowed(
            "break_raises_in_inference_mode"
        ):
            self.exclude |= RAISE_AT_CAPTURE
        autocast = self.allowed("replay_under_autocast") and (
            rng.random() < (0.5 if self.focus == "replay_under_autocast" else 0.08)
        )
        dims = [rng.randint(2, 5) for _ in range(3)]
        forms = [
            (dims[0], dims[1]),
            (dims[1], dims[2]),
            (dims[1],),
            (dims[2],),
            (dims[0], dims[2]),
            (2, dims[0], dims[1]),
        ]
        inputs = [rng.choice(forms) for _ in range(rng.randint(2, 4))]
        for i, shape in enumerate(inputs):
            self.vars[f"x{i}"] = _Var(f"x{i}", shape, f"x{i}", True, "input")
        body: list[Stmt] = []
        steps = rng.randint(4, 16)
        special_at = rng.randrange(steps)
        for step in range(steps):
            if step == special_at and self.bad == "user_error":
                stmt = self.user_error()
            elif step == special_at and self.bad is not None:
                stmt = self.bad_break()
            elif step == special_at and self.sync is not None:
                stmt = self.host_sync()
            else:
                stmt = self.statement()
            if stmt is not None:
                body.extend(stmt if isinstance(stmt, list) else [stmt])
        outputs = self.choose_outputs()
        return Program(
            self.seed,
            inputs,
            body,
            outputs,
            self.definitions,
            self.mode,
            autocast,
        )

    def choose_outputs(self) -> list[str]:
        made = [v.name for v in self.vars.values() if v.origin != "input"]
        if not made:
            return ["x0"]
        extra = self.rng.sample(made[:-1], min(len(made) - 1, self.rng.randint(0, 3)))
        return sorted(set(extra + [made[-1]]), key=made.index)

    def statement(self) -> Stmt | list[Stmt] | None:
        kinds = {
            "elementwise": 3.0,
            "reduction": 1.0,
            "matmul": 1.0,
            "view": 2.0,
            "inplace": 2.0,
            "inplace_metadata_op": 0.7,
            "out_op": 0.7,
            "break_graph": 0.3,
            "break": 2.0,
            "consecutive_breaks": 0.4,
            "params_mutated": 0.4,
        }
        for _ in range(20):
            names = [k for k in kinds if k in ("inplace", "break") or self.allowed(k)]
            weights = [kinds[k] * self.boost(k) for k in names]
            if self.focus is not None and self.focus not in kinds:
                weights = [
                    w * (2.5 if k in ("break", "inplace") else 1.0) for k, w in zip(names, weights)
                ]
            kind = self.rng.choices(names, weights)[0]
            stmt = getattr(self, "stmt_" + kind)()
            if stmt is not None:
                return stmt
        return None

    # -- segment statements ----------------------------------------------------------------------
    def stmt_elementwise(self) -> Stmt | None:
        rng = self.rng
        a = self.pick(self.tensors())
        roll = rng.random()
        if roll < 0.08 and self.allowed("dtype_conversion"):
            if self.mode != "no_grad" and not self.allowed("inference_mode_composite_copy"):
                return None
            out = self.fresh("v", a.shape, a.contiguous)
            expr = rng.choice(
                ("{a}.double().sin().float()", "{a}.to(torch.float64).exp().to({a}.dtype)")
            )
            families = {"elementwise", "dtype_conversion"}
            if self.mode != "no_grad":
                families.add("inference_mode_composite_copy")
            return Stmt([f"{out.name} = {expr.format(a=a.name)}"], frozenset(families))
        if roll < 0.4:
            out = self.fresh("v", a.shape, a.contiguous)
            return Stmt(
                [f"{out.name} = {rng.choice(UNARY).format(a=a.name)}"], frozenset({"elementwise"})
            )
        partners = [v for v in self.tensors() if _broadcast(a.shape, v.shape) is not None]
        b = self.pick(partners)
        shape = _broadcast(a.shape, b.shape)
        out = self.fresh("v", shape, a.contiguous and b.contiguous)
        expr = rng.choice(BINARY).format(a=a.name, b=b.name)
        return Stmt([f"{out.name} = {expr}"], frozenset({"elementwise"}))

    def stmt_reduction(self) -> Stmt | None:
        rng = self.rng
        a = self.pick(self.tensors(min_dim=1))
        if a is None:
            return None
        d = rng.randrange(len(a.shape))
        if rng.random() < 0.35:
            expr = rng.choice(
                (
                    "torch.softmax({a}, dim={d})",
                    "{a}.cumsum({d})",
                    "torch.log_softmax({a}, dim={d})",
                )
            )
            shape = a.shape
        else:
            keep = len(a.shape) == 1 or rng.random() < 0.4
            expr = rng.choice(
                (
                    "{a}.sum({d}, keepdim={k})",
                    "{a}.mean({d}, keepdim={k})",
                    "{a}.amax({d}, keepdim={k})",
                    "{a}.logsumexp({d}, keepdim={k})",
                    "torch.linalg.vector_norm({a}, dim={d}, keepdim={k})",
                )
            )
            shape = a.shape[:d] + ((1,) if keep else ()) + a.shape[d + 1 :]
            expr = expr.replace("{k}", str(keep))
        out = self.fresh("v", shape, a.contiguous)
        return Stmt([f"{out.name} = {expr.format(a=a.name, d=d)}"], frozenset({"reduction"}))

    def matmul_pairs(self) -> list[tuple[_Var, _Var]]:
        pairs = []
        for a in self.tensors(min_dim=1):
            if len(a.shape) > 3:
                continue
            for b in self.tensors(min_dim=1):
                if len(b.shape) <= 2 and a.shape[-1] == b.shape[0]:
                    pairs.append((a, b))
        return pairs

    def stmt_matmul(self) -> Stmt | None:
        rng = self.rng
        pairs = self.matmul_pairs()
        if not self.allowed("matmul_vector"):
            pairs = [(a, b) for a, b in pairs if len(a.shape) > 1 and len(b.shape) > 1]
        family = "matmul"
        if pairs and rng.random() < 0.8:
            a, b = rng.choice(pairs)
            if len(a.shape) == 1 or len(b.shape) == 1:
                family = "matmul_vector"
            k = a.shape[-1]
            shape = a.shape[:-1] + b.shape[1:]
            spell = rng.choice(("({a} @ {b})", "torch.matmul({a}, {b})"))
            expr = f"{spell.format(a=a.name, b=b.name)} * {round(1 / math.sqrt(k), 4)}"
        else:  # a @ a^T always fits
            a = self.pick(self.tensors(min_dim=2))
            if a is None:
                return None
            k = a.shape[-1]
            shape = a.shape[:-1] + (a.shape[-2],)
            expr = f"({a.name} @ {a.name}.transpose(-1, -2)) * {round(1 / math.sqrt(k), 4)}"
        if not shape:
            return None  # 1-D @ 1-D: keep 0-d tensors out of matmul chains
        out = self.fresh("m", shape, True)
        return Stmt([f"{out.name} = {expr}"], frozenset({"matmul", family}))

    def view_options(self, a: _Var, in_break: bool = False) -> list[tuple[str, tuple, bool, bool]]:
        """(expression with {a}, shape, contiguous, writable) for views of ``a``."""
        rng, s, n = self.rng, a.shape, len(a.shape)
        options = []
        if n >= 1 and s[0] >= 2:
            i = rng.randrange(s[0] - 1)
            j = rng.randint(i + 1, s[0])
            options.append((f"{{a}}[{i}:{j}]", (j - i,) + s[1:], a.contiguous, True))
            length = rng.randint(1, s[0] - 1)
            options.append((f"{{a}}.narrow(0, 1, {length})", (length,) + s[1:], a.contiguous, True))
        if n >= 2:
            options.append((f"{{a}}[{rng.randrange(s[0])}]", s[1:], a.contiguous, True))
            if s[-1] >= 2:
                j = rng.randint(1, s[-1] - 1)
                options.append((f"{{a}}[..., {j}:]", s[:-1] + (s[-1] - j,), False, True))
            i, j = rng.sample(range(n), 2)
            t = list(s)
            t[i], t[j] = t[j], t[i]
            options.append((f"{{a}}.transpose({i}, {j})", tuple(t), False, True))
        if n == 2:
            options.append(("{a}.t()", (s[1], s[0]), False, True))
            options.append(("{a}.diagonal()", (min(s),), False, True))
        if n == 3:
            p = rng.sample(range(3), 3)
            options.append(
                (f"{{a}}.permute({', '.join(map(str, p))})", tuple(s[i] for i in p), False, True)
            )
        if n <= 3:
            d = rng.randint(0, n)
            options.append((f"{{a}}.unsqueeze({d})", s[:d] + (1,) + s[d:], a.contiguous, True))
        ones = [i for i, size in enumerate(s) if size == 1]
        if ones:
            d = rng.choice(ones)
            options.append((f"{{a}}.squeeze({d})", s[:d] + s[d + 1 :], a.contiguous, True))
        numel = math.prod(s)
        if n >= 1:
            divisors = [q for q in range(2, numel) if numel % q == 0]
            target = (numel,)
            if divisors and rng.random() < 0.6:
                q = rng.choice(divisors)
                target = (q, numel // q)
            spelled = ", ".join(map(str, target))
            if a.contiguous:
                options.append((f"{{a}}.view({spelled})", target, True, True))
            elif not in_break and not self.layout_varies:  # a view or a copy, depending
                # on strides (never written; so is its source, once strides vary per run)
                options.append((f"{{a}}.reshape({spelled})", target, False, False))
        if (
            not a.contiguous
            and not in_break
            and not self.layout_varies
            and self.allowed("reshape_copy")
        ):
            options.append(("{a}.contiguous()", s, True, False))  # a copy, or ``a`` itself
            if n >= 1:
                options.append(("{a}.flatten()", (numel,), False, False))
        if n <= 2:
            options.append((f"{{a}}.expand(2, {', '.join(map(str, s))})", (2,) + s, False, False))
        return options

    def stmt_view(self) -> Stmt | None:
        a = self.pick(self.tensors())
        options = self.view_options(a)
        if not options:
            return None
        expr, shape, contiguous, writable = self.rng.choice(options)
        families = {"view"}
        if not a.contiguous and any(
            op in expr for op in (".reshape(", ".contiguous(", ".flatten(")
        ):
            families.add("reshape_copy")  # may copy: a fresh tensor behind a view-like op
            if self.mode != "no_grad":
                families.add("inference_mode_composite_copy")
            if not self.allowed("inference_mode_composite_copy") and self.mode != "no_grad":
                return None
        out = self.view_of(a, shape, contiguous, writable)
        if not writable and ".expand(" not in expr:
            # contiguous(), flatten() (and reshape()) may return ``a`` itself: a metadata op on
            # either name would change the other, so neither gets one
            a.pinned = out.pinned = True
        return Stmt([f"{out.name} = {expr.format(a=a.name)}"], frozenset(families))

    def inplace_family(self, d: _Var) -> str:
        if d.origin == "input":
            return "inplace_input"
        if d.origin == "view":
            return "inplace_view"
        if d.origin == "break":
            return "inplace_break_output"
        return "inplace_fresh"

    def sources_for(self, d: _Var, shape: tuple) -> list[_Var]:
        """Tensors that may be read by an in-place write of ``d`` (no partial overlap)."""
        return [
            v
            for v in self.tensors()
            if _broadcast(shape, v.shape) == shape and (v.root != d.root or v.name == d.name)
        ]

    def stmt_inplace(self) -> Stmt | None:
        rng = self.rng
        targets = [v for v in self.tensors(writable=True) if self.allowed(self.inplace_family(v))]
        d = self.pick(targets)
        if d is None:
            return None
        family = self.inplace_family(d)
        roll = rng.random()
        if roll < 0.2 and d.shape and d.shape[0] >= 2 and self.allowed("inplace_view"):
            i = rng.randrange(d.shape[0] - 1)
            j = rng.randint(i + 1, d.shape[0])
            part = (j - i,) + d.shape[1:]
            sources = [v for v in self.sources_for(d, part) if v.root != d.root]
            if sources and rng.random() < 0.6:
                line = f"{d.name}[{i}:{j}] = {self.pick(sources).name}"
            else:
                line = f"{d.name}[{i}:{j}] *= 2.0"
            return Stmt([line], frozenset({"inplace_view"}))
        if roll < 0.55:
            line = rng.choice(INPLACE_UNARY).format(d=d.name)
            return Stmt([line], frozenset({family}))
        s = self.pick(self.sources_for(d, d.shape))
        line = rng.choice(INPLACE_BINARY).format(d=d.name, s=s.name)
        return Stmt([line], frozenset({family}))

    def stmt_inplace_metadata_op(self) -> Stmt | None:
        rng = self.rng
        candidates = [v for v in self.vars.values() if v.origin in ("op", "view") and not v.pinned]
        v = self.pick(candidates)
        if v is None:
            return None
        s, n = v.shape, len(v.shape)
        options = []
        if n <= 3:
            d = rng.randint(0, n)
            options.append((f"{v.name}.unsqueeze_({d})", s[:d] + (1,) + s[d:], v.contiguous))
        ones = [i for i, size in enumerate(s) if size == 1]
        if ones:
            d = rng.choice(ones)
            options.append((f"{v.name}.squeeze_({d})", s[:d] + s[d + 1 :], v.contiguous))
        if n == 2:
            options.append((f"{v.name}.t_()", (s[1], s[0]), False))
        if n >= 2:
            i, j = rng.sample(range(n), 2)
            t = list(s)
            t[i], t[j] = t[j], t[i]
            options.append((f"{v.name}.transpose_({i}, {j})", tuple(t), False))
        if v.origin == "op" and v.root == v.name and n >= 1 and not self.layout_varies:
            numel = math.prod(s)
            options.append((f"{v.name}.as_strided_(({numel},), (1,))", (numel,), True))
            if n == 2:
                options.append(
                    (f"{v.name}.as_strided_(({s[1]}, {s[0]}), (1, {s[1]}))", (s[1], s[0]), False)
                )
        if not options:
            return None
        line, shape, contiguous = rng.choice(options)
        v.shape, v.contiguous = tuple(shape), contiguous
        return Stmt([line], frozenset({"inplace_metadata_op"}))

    def stmt_out_op(self) -> Stmt | None:
        rng = self.rng
        a = self.pick(self.tensors())
        if rng.random() < 0.6:  # into a fresh buffer: allocation and write are one statement
            choice = rng.random()
            pairs = self.matmul_pairs()
            pairs = [(a, b) for a, b in pairs if len(a.shape) == 2 and len(b.shape) == 2]
            if choice < 0.3 and pairs:  # (torch.matmul's out= resizes 1-D and 3-D cases)
                a, b = rng.choice(pairs)
                shape = a.shape[:-1] + b.shape[1:]
                if not shape:
                    return None
                call = f"torch.matmul({a.name}, {b.name}, out={{t}})"
            elif choice < 0.5 and a.shape:
                d = rng.randrange(len(a.shape))
                shape = a.shape[:d] + a.shape[d + 1 :]
                call = f"torch.sum({a.name}, {d}, out={{t}})"
            else:
                partners = [v for v in self.tensors() if _broadcast(a.shape, v.shape) is not None]
                b = self.pick(partners)
                shape = _broadcast(a.shape, b.shape)
                fn = rng.choice(("torch.add", "torch.mul", "torch.maximum"))
                call = f"{fn}({a.name}, {b.name}, out={{t}})"
            t = self.fresh("t", shape, True)
            lines = [f"{t.name} = x0.new_empty({tuple(shape)!r})", call.format(t=t.name)]
            return Stmt(lines, frozenset({"out_op"}))
        # into an existing tensor of exactly the result's shape that overlaps no operand
        b = self.pick([v for v in self.tensors() if _broadcast(a.shape, v.shape) is not None])
        shape = _broadcast(a.shape, b.shape)
        targets = [
            v
            for v in self.tensors(writable=True)
            if v.shape == shape and v.root not in (a.root, b.root)
        ]
        d = self.pick(targets)
        if d is None:
            return None
        if rng.random() < 0.4 and a.shape == shape:
            line = f"torch.tanh({a.name}, out={d.name})"
        else:
            fn = rng.choice(("torch.add", "torch.sub", "torch.mul"))
            line = f"{fn}({a.name}, {b.name}, out={d.name})"
        return Stmt([line], frozenset({"out_op", self.inplace_family(d)}))

    def stmt_break_graph(self) -> Stmt:
        return Stmt(["breakgraph.break_graph()"], frozenset({"break_graph"}))

    # -- eager breaks ----------------------------------------------------------------------------
    def break_kinds(self) -> dict[str, float]:
        kinds = {
            "break_new": 2.0,
            "break_returns_argument": 1.0,
            "break_returns_view_of_argument": 0.6,
            "break_container": 1.5,
            "break_mutates_argument": 1.0,
            "capture_stub_identity": 0.5,
            "break_returns_argument_then_new": 0.5,
            "break_returns_new_then_argument": 0.5,
            "break_returns_expanded_view": 0.3,
            "caught_break_exception": 0.2,
            "break_returns_persistent": 0.3,
            "break_returns_persistent_by_context": 0.3,
            "break_returns_aliased_outputs": 0.25,
            "break_aliased_then_independent": 0.2,
            "break_independent_then_aliased": 0.2,
        }
        kinds.update({family: 0.3 for family in RICH_KINDS})
        return {k: w * self.boost(k) for k, w in kinds.items() if self.allowed(k)}

    def stmt_break(self) -> list[Stmt] | None:
        rng = self.rng
        reusable = [b for b in self.breaks if b.reusable]
        if (
            reusable
            and self.allowed("break_reused")
            and rng.random() < 0.2 * self.boost("break_reused")
        ):
            stmts = self.reuse_break(rng.choice(reusable))
            if stmts is not None:
                return stmts
        kinds = self.break_kinds()
        if not kinds:
            return None
        kind = rng.choices(list(kinds), list(kinds.values()))[0]
        return self.new_break(kind)

    def pick_args(self, need_writable: bool) -> tuple[_Var | None, _Var | None]:
        rng = self.rng
        candidates = self.tensors(writable=True) if need_writable else self.tensors()
        if need_writable and self.allowed("break_mutates_inference_tensor") is False:
            candidates = [v for v in candidates if not self.mutates_inference(v)]
        a = self.pick(candidates)
        if a is None:
            return None, None
        b = None
        if rng.random() < 0.4:
            partners = [
                v
                for v in self.tensors()
                if _broadcast(a.shape, v.shape) == a.shape
                and (v.root != a.root or not need_writable)
            ]
            b = self.pick(partners)
        return a, b

    def mutates_inference(self, a: _Var) -> bool:
        return self.mode != "no_grad" and a.origin != "input"

    def new_expr(
        self, a_shape: tuple, has_b: bool, prelude: list[str], families: set[str], needs: list[str]
    ) -> str:
        """An expression of a new tensor of ``a``'s shape, possibly after host work."""
        rng = self.rng
        options = ["plain"]
        weights = [2.0]
        for fam, w in (
            ("break_host_item", 1.0),
            ("break_host_mask", 1.0),
            ("break_context", 0.8),
            ("nested_break", 0.4),
            ("params_mutated", 0.3),
        ):
            if self.allowed(fam):
                options.append(fam)
                weights.append(w * self.boost(fam))
        if has_b:
            options.append("with_b")
            weights.append(1.0)
        kind = rng.choices(options, weights)[0]
        if kind != "plain" and kind != "with_b":
            families.add(kind)
        n = self.new_name("")  # unique host names: two leaves never share a tensor
        if kind == "break_host_item":
            if rng.random() < 0.5:
                prelude.append(f"s{n} = float(a.abs().amax())  # a host value: fine in a break")
                return f"a / (1.0 + s{n})"
            prelude += [
                "if a.sum().item() > 0:  # data-dependent control flow",
                f"    u{n} = a * 2.0",
                "else:",
                f"    u{n} = a - 1.0",
            ]
            return f"u{n}"
        if kind == "break_host_mask":
            choice = rng.randrange(3)
            if choice == 0:
                prelude += [
                    f"u{n} = a.clone()",
                    f"u{n}[u{n} > 0.5] = 0.5  # boolean-mask assignment",
                ]
                return f"u{n}"
            if choice == 1:
                prelude.append(f"c{n} = int((a > 0).sum())  # a data-dependent count")
                return f"a * (c{n} / {max(1, math.prod(a_shape))})"
            prelude.append(f"p{n} = a[a > 0].sum()  # boolean-mask indexing")
            return f"a * torch.tanh(p{n})"
        if kind == "break_context":
            prelude.append(f'k{n} = breakgraph.replay_context()["scale"]  # per-replay host state')
            return f"a * k{n}"
        if kind == "nested_break":
            inner = f"inner{n}"
            self.definitions[inner] = (
                ["@breakgraph.eager_on_graph", f"def {inner}(a):", "    return a * 0.5 + 0.25"],
                (),
            )
            needs.append(inner)
            return f"{inner}(a) - 0.5"
        if kind == "params_mutated":
            self.definitions["param"] = (PARAMS_HELPER, ())
            needs.append("param")
            return f"a * param({self.new_name('')}, {tuple(a_shape)!r}, a)"
        if kind == "with_b":
            return rng.choice(("a + b", "a * b", "torch.maximum(a, b)", "torch.tanh(a) - b"))
        return rng.choice(NEW_IN_BREAK)

    def new_break(self, kind: str) -> list[Stmt] | None:
        rng = self.rng
        if kind == "caught_break_exception":
            return self.caught_break()
        if kind in ("break_returns_persistent", "break_returns_persistent_by_context"):
            return self.persistent_break(kind)
        if kind in ALIASED_KINDS:
            return self.aliased_break(kind)
        if kind in RICH_KINDS:
            return self.rich_break(kind)
        mutates = kind == "break_mutates_argument"
        a, b = self.pick_args(need_writable=mutates)
        if a is None:
            return None
        if kind == "break_returns_view_of_argument" and not (a.writable and a.shape):
            return None
        if kind == "break_returns_expanded_view" and not (a.shape and a.shape[0] >= 2):
            return None
        name = self.new_name("brk")
        families = {kind}
        needs: list[str] = []
        prelude: list[str] = []
        has_scale = self.allowed("break_kwargs") and rng.random() < 0.25
        params = (
            ["a"] + (["b=None"] if b is not None else []) + (["scale=1.0"] if has_scale else [])
        )
        if has_scale or (b is not None and rng.random() < 0.5):
            families.add("break_kwargs")
        structure = "single"
        leaves: list[_Leaf] = []
        stub_kind = None
        body: list[str] = []

        def new_leaf() -> _Leaf:
            expr = self.new_expr(a.shape, b is not None, prelude, families, needs)
            if has_scale:
                expr = f"({expr}) * scale"
            return _Leaf("new", expr, a.shape, stub=f"torch.zeros_like({expr})")

        if kind in ("break_new", "break_container", "break_mutates_argument"):
            if mutates:
                families.add("break_mutates_argument")
                if self.mutates_inference(a):
                    families.add("break_mutates_inference_tensor")
                op = rng.choice(("a.mul_(0.5)", "a.clamp_(-1.0, 1.0)", "a.add_(1.0)", "a.tanh_()"))
                body.append(f"{op}  # mutates its argument")
                if b is not None and b.root != a.root and rng.random() < 0.5:
                    body.append("a.add_(b)")
            if kind == "break_container" or (mutates and rng.random() < 0.3):
                structures = ["tuple", "list", "dict", "namedtuple", "dataclass", "object"]
                structures += [
                    f
                    for f in ("break_returns_slots_object", "break_returns_cycle")
                    if self.allowed(f)
                ]
                structure = rng.choice(structures)
                families.add("break_container")
                if structure.startswith("break_"):
                    families.add(structure)
                    structure = {"break_returns_slots_object": "slots"}.get(structure, "cycle")
                count = rng.randint(2, 3)
                for _ in range(count):
                    roll = rng.random()
                    if roll < 0.5 or not self.allowed("break_returns_argument"):
                        leaves.append(new_leaf())
                        families.add("break_new")
                    elif roll < 0.7:
                        leaves.append(_Leaf("arg", "a", a.shape, stub="a"))
                        families.add("break_returns_argument")
                    elif (
                        roll < 0.8
                        and a.writable
                        and a.shape
                        and self.allowed("break_returns_view_of_argument")
                    ):
                        expr, shape, contig, writable = rng.choice(
                            self.view_options(a, in_break=True)
                        )
                        expr = expr.format(a="a")
                        leaves.append(
                            _Leaf(
                                "view",
                                expr,
                                shape,
                                stub=expr,
                                view_writable=writable,
                                view_contiguous=contig,
                            )
                        )
                        families.add("break_returns_view_of_argument")
                    elif self.allowed("break_python_value"):
                        value = rng.choice(("a.shape[0]" if a.shape else "1", '"tag"', "None", "3"))
                        if self.allowed("break_check_values_false") and rng.random() < 0.3:
                            value = 'breakgraph.replay_context()["scale"]'  # changes per replay
                            families.add("break_check_values_false")
                        leaves.append(_Leaf("py", value, stub=value))
                        families.add("break_python_value")
                    else:
                        leaves.append(new_leaf())
                        families.add("break_new")
            elif mutates and rng.random() < 0.5:
                structure = rng.choice(("none", "single"))
                if structure == "single":
                    leaves.append(_Leaf("arg", "a", a.shape, stub="a"))
                    families.add("break_returns_argument")
            else:
                leaves.append(new_leaf())
                families.add("break_new")
            if (
                self.allowed("capture_stub")
                and structure != "none"
                and rng.random() < 0.25 * self.boost("capture_stub")
            ):
                stub_kind = "zeros"
                families.add("capture_stub")
                if any(leaf.kind in ("arg", "view") for leaf in leaves):
                    families.add("capture_stub_returns_argument")
                    if not self.allowed("capture_stub_returns_argument"):
                        stub_kind = None
                        families -= {"capture_stub", "capture_stub_returns_argument"}
        elif kind == "break_returns_argument":
            if rng.random() < 0.5:
                self.new_expr(a.shape, b is not None, prelude, families, needs)  # host work only
            leaves.append(_Leaf("arg", "a", a.shape, stub="a"))
        elif kind == "break_returns_view_of_argument":
            expr, shape, contig, writable = rng.choice(self.view_options(a, in_break=True))
            expr = expr.format(a="a")
            leaves.append(
                _Leaf(
                    "view", expr, shape, stub=expr, view_writable=writable, view_contiguous=contig
                )
            )
        elif kind == "break_returns_expanded_view":  # stride 0 over memory of its own
            expr = "a.mean(0, keepdim=True).expand_as(a)"
            leaves.append(_Leaf("expanded", expr, a.shape, stub=expr, view_writable=False))
        elif kind == "capture_stub_identity":
            leaf = new_leaf()
            leaf.stub, leaf.kind = "a", "alias_switch"  # aliases its argument at capture only
            leaves.append(leaf)
            stub_kind = "identity"
        elif kind in ("break_returns_argument_then_new", "break_returns_new_then_argument"):
            expr = self.new_expr(a.shape, b is not None, prelude, families, needs)
            first, second = ("a", expr) if kind.endswith("then_new") else (expr, "a")
            body += [
                'if breakgraph.replay_context()["phase"] == "capture":',
                f"    return {first}",
            ]
            leaves.append(_Leaf("alias_switch", second, a.shape))
        else:
            raise AssertionError(kind)

        # the function definition (and stub, classes)
        cls = None
        if structure in ("namedtuple", "dataclass", "object", "slots", "cycle"):
            prefix = {"namedtuple": "Nt", "dataclass": "Dc", "slots": "Sl"}.get(structure, "Obj")
            cls = self.new_name(prefix)
            fields_ = [f"f{i}" for i in range(len(leaves))]
            if structure == "namedtuple":
                lines = [f"{cls} = collections.namedtuple({cls!r}, {fields_!r})"]
            elif structure == "dataclass":
                lines = ["@dataclasses.dataclass", f"class {cls}:"] + [
                    f"    {f}: object" for f in fields_
                ]
            elif structure == "slots":
                lines = [
                    f"class {cls}:",
                    f"    __slots__ = {tuple(fields_)!r}",
                    "",
                    "    def __init__(self, **fields):",
                    "        for name, value in fields.items():",
                    "            setattr(self, name, value)",
                ]
            else:
                lines = [
                    f"class {cls}:",
                    "    def __init__(self, **fields):",
                    "        self.__dict__.update(fields)",
                ]
            self.definitions[cls] = (lines, ())
            needs.append(cls)

        def returned(exprs: list[str]) -> str:
            if structure == "none":
                return "None"
            if structure == "single":
                return exprs[0]
            if structure == "tuple":
                return "(" + "".join(e + ", " for e in exprs) + ")"
            if structure == "list":
                return "[" + ", ".join(exprs) + "]"
            if structure == "dict":
                return "{" + ", ".join(f'"k{i}": {e}' for i, e in enumerate(exprs)) + "}"
            if structure == "namedtuple":
                return f"{cls}(" + ", ".join(exprs) + ")"
            built = f"{cls}(" + ", ".join(f"f{i}={e}" for i, e in enumerate(exprs)) + ")"
            return f"_with_cycle({built})" if structure == "cycle" else built

        if structure == "cycle":  # out.me = out
            self.definitions["_with_cycle"] = (
                [
                    "def _with_cycle(out):",
                    "    out.me = out  # a reference cycle",
                    "    return out",
                ],
                (),
            )
            needs.append("_with_cycle")
        options = []
        if stub_kind is not None:
            stub = f"{name}_stub"
            if stub_kind == "identity":
                stub_lines = [f"def {stub}({', '.join(params)}):", "    return a  # identity stub"]
            else:
                stub_lines = [f"def {stub}({', '.join(params)}):"]
                stub_lines += ["    " + line for line in prelude]
                stub_lines.append("    return " + returned([leaf.stub for leaf in leaves]))
            self.definitions[stub] = (stub_lines, ())
            needs.append(stub)
            options.append(f"capture_stub={stub}")
        if structure == "slots" or "break_check_values_false" in families:
            options.append("check_values=False")
        decorator = "@breakgraph.eager_on_graph" + (f"({', '.join(options)})" if options else "")
        if kind in ("break_returns_argument_then_new", "break_returns_new_then_argument"):
            function_body = prelude + body + ["return " + leaves[0].expr]
        else:
            function_body = prelude + body + ["return " + returned([leaf.expr for leaf in leaves])]
        self.definitions[name] = (
            [decorator, f"def {name}({', '.join(params)}):"]
            + ["    " + line for line in function_body],
            tuple(needs),
        )
        definition = _BreakDef(
            name,
            a.shape,
            b.shape if b is not None else None,
            has_scale,
            structure,
            leaves,
            mutates,
            frozenset(families),
            (name,),
            reusable=kind
            in ("break_new", "break_container", "break_mutates_argument", "break_returns_argument"),
            a_contiguous=a.contiguous,
        )
        self.breaks.append(definition)
        return self.call_break(definition, a, b, frozenset(families))

    def persistent_break(self, kind: str) -> list[Stmt] | None:
        """A break returning a long-lived tensor: an adapter it only reads, or a global buffer
        it writes into, or a view of either; maybe next to a new tensor. The same one on every
        call, or (``..._by_context``) the one ``replay_context()`` picks: a replay that picks
        another than the capture may raise CopyBackError, and must then have written nothing
        into any long-lived tensor (the oracle checks ``PERSISTENT``)."""
        rng = self.rng
        a = self.pick(self.tensors())
        if a is None:
            return None
        name = self.new_name("brk")
        families, needs, prelude, body = {kind}, ["persistent"], [], []
        self.definitions["persistent"] = (PERSISTENT_HELPER, ())
        key = 2 * self.counter  # unique: the context adds 0 or 1
        chosen = str(key)
        if kind == "break_returns_persistent_by_context":
            chosen = f'{key} + int(breakgraph.replay_context()["scale"] * 4) % 2'
        if rng.random() < 0.5:  # a global buffer, written by the function
            expr = self.new_expr(a.shape, False, prelude, families, needs)
            body += [f"buf = persistent({chosen}, a)", f"buf.copy_({expr})  # a global buffer"]
            target = "buf"
        else:  # an adapter, only read
            target = f"persistent({chosen}, a)"
        leaf = _Leaf("persistent", target, a.shape)
        like = _Var("w", a.shape, "w", True, "op")  # persistent tensors are contiguous
        options = [o for o in self.view_options(like, in_break=True) if ".expand(" not in o[0]]
        if options and rng.random() < 0.4:
            expr, shape, _, _ = rng.choice(options)
            leaf = _Leaf("persistent", expr.format(a=target), shape)
        leaves = [leaf]
        structure = "single"
        if rng.random() < 0.4:
            structure = rng.choice(("tuple", "dict"))
            fresh = self.new_expr(a.shape, False, prelude, families, needs)
            leaves.insert(rng.randrange(2), _Leaf("new", fresh, a.shape))
        returned = _returned(structure, [leaf.expr for leaf in leaves])
        self.definitions[name] = (
            ["@breakgraph.eager_on_graph", f"def {name}(a):"]
            + ["    " + line for line in prelude + body + [f"return {returned}"]],
            tuple(needs),
        )
        definition = _BreakDef(
            name, a.shape, None, False, structure, leaves, False, frozenset(families), (name,),
            reusable=False,
        )  # fmt: skip
        return self.call_break(definition, a, None, frozenset(families))

    def aliased_break(self, kind: str) -> list[Stmt] | None:
        """A break returning two outputs over one new tensor ``y``: ``(y, y)``, ``(y, view)``,
        ``(view, y)`` or ``(view, view)``; on every call, at capture only (may raise
        CopyBackError, never a wrong value) or on replay only. The independent form gives the
        second output other values, so a copy into shared memory cannot pass unnoticed."""
        rng = self.rng
        a = self.pick(self.tensors(min_dim=1))
        if a is None:
            return None
        name = self.new_name("brk")
        families, needs, prelude = {kind}, [], []
        prelude.append(f"y = {self.new_expr(a.shape, False, prelude, families, needs)}")
        y = _Var("y", a.shape, "y", False, "op")
        views = [o for o in self.view_options(y, in_break=True) if ".expand(" not in o[0]]
        view, view_shape, _, _ = rng.choice(views)
        forms = [("{a}", a.shape), (view, view_shape)]
        (first, first_shape), (second, second_shape) = rng.choice(forms), rng.choice(forms)
        structure = rng.choice(("tuple", "list", "dict"))
        aliased = _returned(structure, [first.format(a="y"), second.format(a="y")])
        independent = _returned(
            structure, [first.format(a="y"), second.format(a="(y * 2.0 + 1.0)")]
        )
        if kind == "break_returns_aliased_outputs":
            body = [f"return {aliased}  # outputs that share memory"]
        else:
            at_capture, on_replay = (aliased, independent)
            if kind == "break_independent_then_aliased":
                at_capture, on_replay = independent, aliased
            body = [
                'if breakgraph.replay_context()["phase"] == "capture":',
                f"    return {at_capture}",
                f"return {on_replay}",
            ]
        self.definitions[name] = (
            ["@breakgraph.eager_on_graph", f"def {name}(a):"]
            + ["    " + line for line in prelude + body],
            tuple(needs),
        )
        leaves = [
            _Leaf("aliased", first.format(a="y"), first_shape),
            _Leaf("aliased", second.format(a="y"), second_shape),
        ]
        definition = _BreakDef(
            name, a.shape, None, False, structure, leaves, False, frozenset(families), (name,),
            reusable=False,
        )  # fmt: skip
        return self.call_break(definition, a, None, frozenset(families))

    def stmt_params_mutated(self) -> Stmt | None:
        """A segment reading a parameter: elementwise, or as the right operand of a matmul."""
        rng = self.rng
        a = self.pick(self.tensors(min_dim=1))
        if a is None:
            return None
        self.definitions["param"] = (PARAMS_HELPER, ())
        key = self.new_name("")
        if rng.random() < 0.5 and len(a.shape) <= 3:
            m = rng.randint(2, 5)
            out = self.fresh("m", a.shape[:-1] + (m,), True)
            line = f"{out.name} = {a.name} @ param({key}, {(a.shape[-1], m)!r}, {a.name})"
        else:
            out = self.fresh("v", a.shape, a.contiguous)
            line = f"{out.name} = {a.name} * param({key}, {tuple(a.shape)!r}, {a.name})"
        return Stmt([line], frozenset({"params_mutated"}), ("param",))

    def stmt_consecutive_breaks(self) -> list[Stmt] | None:
        """Two breaks in a row, the second on the first's (last) output; perhaps an empty
        segment (``break_graph()``) between them."""
        first = self.stmt_break()
        if first is None:
            return None
        between = []
        if self.allowed("break_graph") and self.rng.random() < 0.3:
            between = [self.stmt_break_graph()]
        self.prefer_last = True
        try:
            second = self.stmt_break()
        finally:
            self.prefer_last = False
        if second is None:
            return first
        tag = frozenset({"consecutive_breaks"})
        return first + between + [dataclasses.replace(s, families=s.families | tag) for s in second]

    def rich_break(self, kind: str) -> list[Stmt] | None:
        """A break returning a random tree of leaves (:data:`RICH_KINDS`): new tensors, tensors
        of other dtypes, zero-size ones, views of new ones, its second argument, a tensor a
        segment computed (through a container argument), values with other strides on replay,
        parameters, Python values; in containers up to two levels deep. Always one leaf of
        ``kind``'s own sort; every such program is correct, so it must match eager."""
        rng = self.rng
        a, b = self.pick_args(need_writable=False)
        if a is None:
            return None
        if kind == "break_returns_second_argument" and b is None:
            b = self.pick([v for v in self.tensors() if v.name != a.name])
            if b is None:
                return None
        name = self.new_name("brk")
        families, needs, prelude = {kind}, [name], []
        before: list[Stmt] = []
        params, call_args = ["a"], [a.name]
        if b is not None:
            params.append("b=None")
            call_args.append(f"b={b.name}")
            b.pinned = True
        box = None
        if kind == "break_returns_captured" or (
            self.allowed("break_returns_captured") and rng.random() < 0.1
        ):
            source = self.pick(self.tensors())
            box_name = self.new_name("box")
            form, access = rng.choice(
                (
                    ('{{"t": {c}}}', '["t"]'),
                    ("[{c}]", "[0]"),
                    ("types.SimpleNamespace(t={c})", ".t"),
                )
            )
            before.append(Stmt([f"{box_name} = {form.format(c=source.name)}"], frozenset()))
            params.append("box=None")
            call_args.append(f"box={box_name}")
            source.pinned = True
            box = (source, access)
        mask = None
        if kind == "break_bool_argument" or (
            self.allowed("break_bool_argument") and rng.random() < 0.1
        ):
            source = self.pick([v for v in self.tensors() if v.shape == a.shape]) or a
            mask = self.new_name("mask")
            before.append(Stmt([f"{mask} = {source.name} > 0.25"], frozenset()))
            params.append("mask=None")
            call_args.append(f"mask={mask}")
            source.pinned = True
        # the leaves: kind's own first, then a few others
        sorts = ["new", "other_dtype", "view_of_new", "python", "restrided", "param"]
        sorts += ["zero_size"] if a.shape else []
        sorts += ["second_arg"] if b is not None else []
        sorts += ["captured"] if box is not None else []
        sorts += ["masked"] if mask is not None else []
        sorts = [k for k in sorts if self.allowed(LEAF_FAMILY[k])]
        first = RICH_KINDS[kind]
        if first == "zero_size" and not a.shape:
            return None
        count = rng.randint(2, 5) if kind == "break_nested_structure" else rng.randint(1, 4)
        chosen = [first] + [rng.choice(sorts) for _ in range(count - 1)] if sorts else [first]
        rng.shuffle(chosen)
        leaves = [
            self.rich_leaf(sort, a, b, box, mask, prelude, families, needs) for sort in chosen
        ]
        leaves = [leaf for leaf in leaves if leaf is not None]
        if not leaves:
            return None
        depth = 2 if kind == "break_nested_structure" else rng.choice((0, 1, 1, 2))
        expr, paths = self.nest(leaves, depth, needs)
        self.definitions[name] = (
            ["@breakgraph.eager_on_graph", f"def {name}({', '.join(params)}):"]
            + ["    " + line for line in prelude + [f"return {expr}"]],
            tuple(n for n in needs if n != name),
        )
        result = self.new_name("r")
        stmts = before + [Stmt([f"{result} = {name}({', '.join(call_args)})"], frozenset(families),
                               tuple(needs))]  # fmt: skip
        a.pinned = True
        for i, (path, leaf) in enumerate(paths):
            if leaf["sort"] == "python":
                continue
            var_name = f"{result}_{i}" if path else result
            if path:
                stmts.append(Stmt([f"{var_name} = {result}{path}"], frozenset()))
            stmts += self.rich_leaf_var(var_name, leaf)
        return stmts

    def rich_leaf(self, sort, a, b, box, mask, prelude, families, needs) -> dict | None:
        """One leaf: its expression in the function (after ``prelude``) and what the program
        may do with it (``shape``, ``root``, ``special``, ``writable``, ``readonly``)."""
        rng = self.rng
        families.add(LEAF_FAMILY[sort])

        def new() -> str:
            n = self.new_name("y")
            prelude.append(f"{n} = {self.new_expr(a.shape, False, prelude, families, needs)}")
            return n

        leaf = {"sort": sort, "shape": a.shape, "root": None, "special": False, "writable": True,
                "readonly": False}  # fmt: skip
        if sort in ("new", "masked"):
            leaf["expr"] = new() if sort == "new" else "torch.where(mask, a, -a)"
        elif sort == "other_dtype":
            leaf["expr"] = rng.choice(OTHER_DTYPES).format(y=new())
            leaf["special"] = True
        elif sort == "zero_size":
            dim = rng.choice((0, -1))
            empty = "(0,) + tuple(a.shape[1:])" if dim == 0 else "tuple(a.shape[:-1]) + (0,)"
            cut = "[:0]" if dim == 0 else "[..., :0]"
            forms = [f"a.new_zeros({empty})", f"({new()}){cut}", f"a{cut}"]
            capture, replay = rng.choice(forms), rng.choice(forms)
            leaf["expr"] = (
                capture
                if capture == replay
                else f'({capture} if breakgraph.replay_context()["phase"] == "capture" '
                f"else {replay})"
            )
            shape = list(a.shape)
            shape[dim] = 0
            leaf.update(shape=tuple(shape), special=True, dim=dim, argument_shape=a.shape)
        elif sort == "view_of_new":
            y = new()
            like = _Var(y, a.shape, y, a.contiguous, "op")  # new_expr keeps a's strides
            options = [o for o in self.view_options(like, in_break=True) if ".expand(" not in o[0]]
            if a.shape and a.shape[-1] >= 2:
                last = -(-a.shape[-1] // 2)
                options.append(("{a}[..., ::2]", a.shape[:-1] + (last,), False, True))
            if not options:
                leaf["expr"] = y
            else:
                expr, shape, _, writable = rng.choice(options)
                leaf.update(expr=expr.format(a=y), shape=shape, writable=writable)
        elif sort in ("second_arg", "captured"):
            source, spelled = (b, "b") if sort == "second_arg" else (box[0], "box" + box[1])
            options = [
                o for o in self.view_options(source, in_break=True) if ".expand(" not in o[0]
            ]
            leaf.update(expr=spelled, shape=source.shape, root=source.root,
                        writable=source.writable)  # fmt: skip
            if options and rng.random() < 0.4:
                expr, shape, _, writable = rng.choice(options)
                leaf.update(expr=expr.format(a=spelled), shape=shape,
                            writable=source.writable and writable)  # fmt: skip
        elif sort == "restrided":
            if not a.shape:
                return None
            self.definitions["_restrided"] = (RESTRIDED_HELPER, ())
            self.layout_varies = True
            needs.append("_restrided")
            y = new()
            first, second = rng.choice(((y, f"_restrided({y})"), (f"_restrided({y})", y)))
            leaf["expr"] = (
                f'({first} if breakgraph.replay_context()["phase"] == "capture" else {second})'
            )
        elif sort == "param":
            self.definitions["param"] = (PARAMS_HELPER, ())
            needs.append("param")
            leaf.update(expr=f"param({self.new_name('')}, {tuple(a.shape)!r}, a)", readonly=True)
        elif sort == "python":
            leaf["expr"] = rng.choice(PY_VALUES)
        else:
            raise AssertionError(sort)
        return leaf

    def nest(self, leaves: list, depth: int, needs: list) -> tuple[str, list]:
        """The expression of ``leaves`` in containers ``depth`` levels deep, and the access path
        of each leaf (``[0]["k1"].f0``)."""
        rng = self.rng
        if depth == 0 or (len(leaves) == 1 and rng.random() < 0.5):
            if len(leaves) == 1:
                return leaves[0]["expr"], [("", leaves[0])]
            depth = 1
        groups = [[leaf] for leaf in leaves]
        if depth >= 2 and len(leaves) >= 2:  # some neighbours share an inner container
            groups = []
            for leaf in leaves:
                if groups and rng.random() < 0.5:
                    groups[-1].append(leaf)
                else:
                    groups.append([leaf])
        parts = []
        for group in groups:
            if depth >= 2 and (len(group) > 1 or rng.random() < 0.3):
                parts.append(self.nest(group, depth - 1, needs))
            else:
                parts.append((group[0]["expr"], [("", group[0])]))
                parts += [(leaf["expr"], [("", leaf)]) for leaf in group[1:]]
        container = rng.choice(CONTAINERS)
        fields = [f"f{i}" for i in range(len(parts))]
        cls = None
        if container in ("namedtuple", "dataclass", "object"):
            cls = self.new_name({"namedtuple": "Nt", "dataclass": "Dc"}.get(container, "Obj"))
            if container == "namedtuple":
                lines = [f"{cls} = collections.namedtuple({cls!r}, {fields!r})"]
            elif container == "dataclass":
                lines = ["@dataclasses.dataclass", f"class {cls}:"]
                lines += [f"    {f}: object" for f in fields]
            else:
                lines = [f"class {cls}:", "    def __init__(self, **fields):",
                         "        self.__dict__.update(fields)"]  # fmt: skip
            self.definitions[cls] = (lines, ())
            needs.append(cls)
        exprs = [expr for expr, _ in parts]
        if container == "tuple":
            expr = "(" + "".join(e + ", " for e in exprs) + ")"
        elif container == "list":
            expr = "[" + ", ".join(exprs) + "]"
        elif container == "dict":
            expr = "{" + ", ".join(f'"k{i}": {e}' for i, e in enumerate(exprs)) + "}"
        elif container == "namedtuple":
            expr = f"{cls}(" + ", ".join(exprs) + ")"
        else:
            expr = f"{cls}(" + ", ".join(f"f{i}={e}" for i, e in enumerate(exprs)) + ")"
        paths = []
        for i, (_, inner) in enumerate(parts):
            access = {"tuple": f"[{i}]", "list": f"[{i}]", "dict": f'["k{i}"]'}.get(
                container, f".f{i}"
            )
            paths += [(access + path, leaf) for path, leaf in inner]
        return expr, paths

    def rich_leaf_var(self, name: str, leaf: dict) -> list[Stmt]:
        """Register a rich leaf as a variable; a special one (another dtype, zero-size) is only
        an output, and a float32 tensor of the argument's shape is made from it."""
        root = leaf["root"] or name
        var = _Var(name, tuple(leaf["shape"]), root, False, "break", leaf["writable"])
        var.pinned, var.inference, var.special = True, self.mode != "no_grad", leaf["special"]
        self.vars[name] = var
        if leaf["readonly"]:
            self.readonly_roots.add(root)
        if not leaf["special"]:
            return []
        out = self.new_name("v")
        if "dim" in leaf:  # zero-size: concatenated with a tensor of the argument's shape
            like = self.pick([v for v in self.tensors() if v.shape == self._grown(leaf)])
            if like is None:
                return []
            line = f"{out} = torch.cat([{name}.float(), {like.name}], {leaf['dim']})"
            self.add(_Var(out, like.shape, out, True, "op"))
        else:
            line = f"{out} = {name}.float() * 0.5"  # keeps the leaf's strides
            self.add(_Var(out, var.shape, out, False, "op"))
        return [Stmt([line], frozenset())]

    @staticmethod
    def _grown(leaf: dict) -> tuple:
        """The shape a zero-size leaf was cut from (the argument's)."""
        return tuple(leaf["argument_shape"])

    def caught_break(self) -> list[Stmt] | None:
        """A break that raises, caught by the program: eager takes the ``except`` branch."""
        a = self.pick(self.tensors())
        name = self.new_name("refuse")
        self.definitions[name] = (
            ["@breakgraph.eager_on_graph", f"def {name}(a):", '    raise ValueError("not today")'],
            (),
        )
        out = self.fresh("v", a.shape, a.contiguous)
        lines = [
            "try:",
            f"    {out.name} = {name}({a.name})",
            "except ValueError:",
            f"    {out.name} = {a.name} * 2.0",
        ]
        return [Stmt(lines, frozenset({"caught_break_exception"}), (name,))]

    def reuse_break(self, definition: _BreakDef) -> list[Stmt] | None:
        candidates = self.tensors(writable=True) if definition.mutates else self.tensors()
        if definition.mutates and not self.allowed("break_mutates_inference_tensor"):
            candidates = [v for v in candidates if not self.mutates_inference(v)]
        if any(leaf.kind == "view" for leaf in definition.leaves):
            # its views of ``a`` were picked for the first call's argument: writable, and
            # ``a.view(...)`` or a view called contiguous only if that one was contiguous
            contiguous = definition.a_contiguous
            candidates = [v for v in candidates if v.writable and (v.contiguous or not contiguous)]
        a = self.pick([v for v in candidates if v.shape == definition.a_shape])
        if a is None:
            return None
        b = None
        if definition.b_shape is not None:
            b = self.pick(
                [
                    v
                    for v in self.tensors()
                    if v.shape == definition.b_shape
                    and (v.root != a.root or not definition.mutates)
                ]
            )
            if b is None:
                return None
        families = set(definition.families) | {"break_reused"}
        if definition.mutates and self.mutates_inference(a):
            families.add("break_mutates_inference_tensor")
            if not self.allowed("break_mutates_inference_tensor"):
                return None
        return self.call_break(definition, a, b, frozenset(families))

    def call_break(
        self, definition: _BreakDef, a: _Var, b: _Var | None, families: frozenset
    ) -> list[Stmt]:
        rng = self.rng
        args = [a.name]
        if b is not None:
            args.append(f"b={b.name}" if rng.random() < 0.5 else b.name)
        if definition.has_scale:
            args.append(f"scale={rng.choice((0.5, 0.25, 2.0))}")
        call = f"{definition.name}({', '.join(args)})"
        a.pinned = True
        if b is not None:
            b.pinned = True
        leaves = definition.leaves
        stmts: list[Stmt] = []
        if definition.structure == "none":
            return [Stmt([call], families, definition.needs)]
        result = self.new_name("r")
        if definition.structure == "single":
            self.leaf_var(result, leaves[0], a)
            stmts.append(Stmt([f"{result} = {call}"], families, definition.needs))
        else:
            stmts.append(Stmt([f"{result} = {call}"], families, definition.needs))
            for i, leaf in enumerate(leaves):
                if leaf.kind == "py":
                    continue
                access = {
                    "tuple": f"[{i}]",
                    "list": f"[{i}]",
                    "namedtuple": f".f{i}" if rng.random() < 0.5 else f"[{i}]",
                    "dict": f'["k{i}"]',
                    "dataclass": f".f{i}",
                    "object": f".f{i}",
                    "slots": f".f{i}",
                    "cycle": f".f{i}",
                }[definition.structure]
                var = self.leaf_var(f"{result}_{i}", leaf, a)
                stmts.append(Stmt([f"{var.name} = {result}{access}"], frozenset()))
        return stmts

    def leaf_var(self, name: str, leaf: _Leaf, a: _Var) -> _Var:
        if leaf.kind == "new":
            var = _Var(name, leaf.shape, name, False, "break")
        elif leaf.kind == "arg":
            var = _Var(name, a.shape, a.root, a.contiguous, "break", a.writable)
        elif leaf.kind == "view":
            var = _Var(name, leaf.shape, a.root, False, "break", a.writable and leaf.view_writable)
        elif leaf.kind == "expanded":
            var = _Var(name, leaf.shape, name, False, "break", False)
        elif leaf.kind in ("persistent", "aliased"):
            # long-lived memory (the user's), or memory shared with another output (perhaps on
            # one side of capture/replay only): read-only from here
            var = _Var(name, leaf.shape, name, False, "break", False)
            self.readonly_roots.add(name)
        elif leaf.kind == "alias_switch":
            # aliases its argument on one side of capture/replay only: writes after it would be
            # defined differently by eager and by any graph, so both stay read-only from here
            var = _Var(name, leaf.shape, name, False, "break")
            self.readonly_roots.update({name, a.root})
        else:
            raise AssertionError(leaf.kind)
        var.pinned = True
        var.inference = self.mode != "no_grad"
        self.vars[name] = var
        return var

    # -- programs that must raise ----------------------------------------------------------------
    def bad_break(self) -> list[Stmt] | None:
        """A break whose output changes on replay (``self.bad``): CopyBackError must name it."""
        a = self.pick(self.tensors(min_dim=1))
        if a is None:
            return None
        name = self.new_name("bad")
        # kind -> (returned at capture, returned on replay, how the program reads the output)
        capture, replay, use = {
            "tuple_length": ("(a * 2.0, a + 1.0)", "(a * 2.0, a + 1.0, a)", "{r}[0]"),
            "dict_keys": ('{"x": a * 2.0, "y": a}', '{"x": a * 2.0, "z": a}', '{r}["x"]'),
            "shape": ("a * 2.0", "torch.cat([a, a])", "{r}"),
            "dtype": ("a * 2.0", "(a * 2.0).double()", "{r}"),
            "tensor_to_none": ("(a * 2.0, a + 1.0)", "(a * 2.0, None)", "{r}[1]"),
            "none_to_tensor": ("(a * 2.0, None)", "(a * 2.0, a + 1.0)", "{r}[0]"),
            "python_value": ("(a * 2.0, 1)", "(a * 2.0, 2)", "{r}[0]"),
            "sequence_type": ("(a * 2.0, a + 1.0)", "[a * 2.0, a + 1.0]", "{r}[0]"),
            "dataclass_type": ("Pair(a * 2.0, a)", "OtherPair(a * 2.0, a)", "{r}.p"),
            "missing_attribute": ("Loose(p=a * 2.0, q=a)", "Loose(p=a * 2.0)", "{r}.q"),
            "dtype_bf16": ("a * 2.0", "(a * 2.0).to(torch.bfloat16)", "{r}"),
            "bool_to_float": ("a > 0", "(a > 0).float()", "{r}.float()"),
            "int_to_float": ("(a * 4.0).round().long()", "(a * 4.0).round()", "{r}.float()"),
            "zero_size_to_rows": ("a[:0] * 2.0", "a[:1] * 2.0", "torch.cat([{r}, {a}])"),
            "nested_shape": (
                '(a, {"k": [a * 2.0, 1]})',
                '(a, {"k": [torch.cat([a, a]), 1]})',
                '{r}[1]["k"][0]',
            ),
            "nested_value": ('{"k": (a * 2.0, 2.5)}', '{"k": (a * 2.0, 3.5)}', '{r}["k"][0]'),
        }[self.bad]
        classes = {
            "Pair": ["@dataclasses.dataclass", "class Pair:", "    p: object", "    q: object"],
            "OtherPair": [
                "@dataclasses.dataclass",
                "class OtherPair:",
                "    p: object",
                "    q: object",
            ],
            "Loose": [
                "class Loose:",
                "    def __init__(self, **fields):",
                "        self.__dict__.update(fields)",
            ],
        }
        used = tuple(c for c in classes if c + "(" in capture + replay)
        for c in used:
            self.definitions[c] = (classes[c], ())
        self.definitions[name] = (
            [
                "@breakgraph.eager_on_graph",
                f"def {name}(a):",
                f'    if breakgraph.replay_context()["phase"] == "capture":  # {self.bad}',
                f"        return {capture}",
                f"    return {replay}",
            ],
            used,
        )
        a.pinned = True
        result = self.new_name("r")
        out = self.fresh("v", a.shape, False)
        return [
            Stmt([f"{result} = {name}({a.name})"], frozenset({"bad_break"}), (name,)),
            Stmt([f"{out.name} = {use.format(r=result, a=a.name)} + 1.0"], frozenset()),
        ]

    def user_error(self) -> Stmt | None:
        """A break raising the user's own RuntimeError whose text mentions capturing."""
        if self.mode == "inference_mode_inside" and not self.allowed(
            "break_raises_in_inference_mode"
        ):
            return None
        a = self.pick(self.tensors())
        name = self.new_name("strict")
        self.definitions[name] = (
            [
                "@breakgraph.eager_on_graph",
                f"def {name}(a):",
                f'    raise RuntimeError("{USER_ERROR}")',
            ],
            (),
        )
        return Stmt([f"{name}({a.name})"], frozenset({"user_error_during_capture"}), (name,))

    def host_sync(self) -> Stmt | None:
        v = self.pick(self.tensors(min_dim=1))
        if v is None:
            return None
        name = self.new_name("h")
        return Stmt(
            [f"{name} = {self.sync.format(v=v.name)}  # a host sync"], frozenset({"host_sync"})
        )


def generate(seed: int, exclude: Iterable[str] = (), focus: str | None = None) -> Program:
    """The program of ``seed`` without the families in ``exclude``.

    With ``focus``, that family is drawn much more often and the program is redrawn
    (deterministically) until it contains it.
    """
    exclude = frozenset(exclude)
    for attempt in range(200):
        program = _Generator(seed * 1000 + attempt if attempt else seed, exclude, focus).program()
        if focus is None or focus in program.families:
            label = " ".join(
                part
                for part, used in ((f"focus={focus}", focus), (f"attempt={attempt}", attempt))
                if used
            )
            return program.replace(seed=seed, label=label)
    raise AssertionError(f"generate: no program with family {focus!r} for seed {seed}")


def generate_raising(seed: int, exclude: Iterable[str] = ()) -> Program:
    """A well-formed program plus one statement that must make breakgraph raise.

    ``seed % 4`` picks the kind: 0 and 2, a break that changes its output on replay
    (:data:`BAD_BREAKS`: ``CopyBackError`` naming it, on the first replay); 1, a host
    sync inside a segment (``HostSyncError`` at capture, nothing left behind); 3, a
    break raising the user's own ``RuntimeError`` mentioning "capturing" at capture
    (family ``user_error_during_capture``: it must reach the caller unchanged, not
    as a ``HostSyncError``). Families in ``exclude`` are left out (kind 3 then falls
    back to kind 0).
    """
    # nothing else in the program may raise: only the planted statement
    exclude = frozenset(exclude) | set(MAY_RAISE) | RAISE_AT_CAPTURE - {"user_error_during_capture"}
    kind = seed % 4
    if kind == 3 and "user_error_during_capture" in exclude:
        kind = 0
    rng = random.Random(seed)
    for attempt in range(50):
        sub_seed = seed * 1000 + attempt
        if kind in (0, 2):
            bad = BAD_BREAKS[(seed // 2) % len(BAD_BREAKS)]
            gen = _Generator(sub_seed, exclude, bad=bad)
            program = gen.program()
            names = [n for n in gen.definitions if n.startswith("bad")]
            expect = (breakgraph.CopyBackError, names[0] if names else None)
            label = f"raising {bad}"
            tag = "bad_break"
        elif kind == 1:
            sync = HOST_SYNCS[rng.randrange(len(HOST_SYNCS))]
            program = _Generator(sub_seed, exclude, sync=sync).program()
            expect, label, tag = (breakgraph.HostSyncError, None), "raising sync", "host_sync"
        else:
            program = _Generator(sub_seed, exclude, bad="user_error").program()
            expect, label = (RuntimeError, None), "raising user error"
            tag = "user_error_during_capture"
        if any(tag in s.families for s in program.body):
            return program.replace(seed=seed, expect=expect, label=label)
    raise AssertionError(f"generate_raising: nothing generated for seed {seed}")


# -- the oracle ------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What running a program gave: ``kind`` is "ok", "allowed-error", "invalid" (the eager
    program itself raised: a generator bug), "mismatch" or "error:<ExceptionType>"."""

    kind: str
    detail: str = ""
    error: BaseException | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.kind in ("ok", "allowed-error")


def _eager_mode(mode: str):
    return torch.inference_mode() if mode == "inference_mode_outside" else torch.no_grad()


def _draw(shapes: list, generator: torch.Generator, device: str, dtype: torch.dtype) -> list:
    return [torch.randn(s, generator=generator, dtype=dtype).to(device) for s in shapes]


def _tolerances(backend: str, dtype: torch.dtype) -> dict:
    if dtype == torch.float64:
        return {"atol": 1e-10, "rtol": 1e-10}
    # CPU replays run the very same kernels: near-exact. cuBLAS may pick another algorithm
    # inside a graph than eagerly (alignment), so allow a little rounding on CUDA.
    return {"atol": 1e-5, "rtol": 1e-5} if backend == "emulated" else {"atol": 1e-4, "rtol": 1e-4}


def _allowed_errors(program: Program) -> tuple[type[BaseException], ...]:
    return tuple(MAY_RAISE[f] for f in program.families if f in MAY_RAISE)


def _is_allowed(program: Program, error: BaseException) -> bool:
    """An error of a :data:`MAY_RAISE` family; one that names its eager function (as
    CopyBackError does) must name a break of such a family, so that another break's false
    alarm cannot hide behind it."""
    allowed = _allowed_errors(program)
    if not (allowed and isinstance(error, allowed)):
        return False
    function = getattr(error, "function", None)
    if function is None:
        return True
    families = set().union(*(s.families for s in program.body if function in s.needs))
    return any(isinstance(error, MAY_RAISE[f]) for f in families if f in MAY_RAISE)


def run_program(
    program: Program,
    backend: str = "emulated",
    replays: int = 3,
    dtype: torch.dtype = torch.float32,
) -> Outcome:
    """Capture ``program`` once, replay it on fresh inputs and compare with eager runs.

    Also a failure: anything the capture leaves behind in the process (repaired, so one
    program's leftovers cannot fail the next ones).
    """
    return _left_behind(_run_program(program, backend, replays, dtype))


def _run_program(program: Program, backend: str, replays: int, dtype: torch.dtype) -> Outcome:
    device = "cuda" if backend == "cuda" else "cpu"
    try:
        fn = program.compile()
    except Exception as exc:  # noqa: BLE001
        return Outcome("invalid", f"the source does not compile: {exc!r}", exc)
    generator = torch.Generator().manual_seed(program.seed)
    static = _draw(program.inputs, generator, device, dtype)
    tol = _tolerances(backend, dtype)
    # warm-up (and validity check): the program run eagerly, as at capture and as on replay
    try:
        for context in (CAPTURE_CONTEXT, replay_context_for(program.seed, 0)):
            with _eager_mode(program.mode), breakgraph.context_scope(context):
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # e.g. an out= tensor resized: a generator bug
                    fn(*[s.clone() for s in static])
    except Exception as exc:  # noqa: BLE001
        return Outcome("invalid", f"the program fails when run eagerly: {exc!r}", exc)
    persistent = fn.__globals__.get("PERSISTENT", {})  # the program's long-lived tensors
    graph = breakgraph.BreakableCUDAGraph()
    stage = "capture"
    try:
        with _eager_mode(program.mode):
            with breakgraph.capture(graph, backend=backend, context=CAPTURE_CONTEXT):
                outputs = fn(*static)
        for replay in range(replays):
            stage = f"replay {replay}"
            fresh = _draw(program.inputs, generator, device, dtype)
            for s, f in zip(static, fresh):
                s.copy_(f)
            with torch.no_grad():  # the parameters get new values in place, as after a step
                for p in fn.__globals__.get("PARAMS", {}).values():
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
            context = replay_context_for(program.seed, replay)
            autocast = (
                torch.autocast(device_type=device, dtype=torch.bfloat16)
                if program.replay_autocast
                else contextlib.nullcontext()
            )
            before = _snapshot(persistent)
            failure = None
            try:
                with autocast:
                    graph.replay(context=context)
            except Exception as exc:  # noqa: BLE001 (judged after the eager run, below)
                failure = exc
            # before the eager run, which may write the same long-lived tensors; under no_grad:
            # a view made under no_grad of a parameter given new values is unreadable with grad
            with torch.no_grad():
                got = [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs]
            after_replay = _snapshot(persistent)
            for key, value in before.items():  # eager runs from where the replay started
                persistent[key].copy_(value)
            expected_inputs = [f.clone() for f in fresh]
            with _eager_mode(program.mode), breakgraph.context_scope(context):
                expected = fn(*expected_inputs)
            problem = _user_memory_problem(before, after_replay, persistent, failure, tol)
            if problem is not None:
                return Outcome("mismatch", f"{stage}: {problem}", failure)
            if failure is not None:
                raise failure
            pairs = [
                (f"output[{i}] ({n})", g, e)
                for i, (n, g, e) in enumerate(zip(program.outputs, got, expected))
            ]
            pairs += [
                (f"input x{i}", s, e) for i, (s, e) in enumerate(zip(static, expected_inputs))
            ]
            for what, got, want in pairs:
                try:  # values only: an eager output may carry autograd history (a parameter's
                    # view, changed in place: grad_fn=<Invalid>), which assert_close refuses
                    torch.testing.assert_close(got, want.detach(), equal_nan=True, **tol)
                except AssertionError as exc:
                    return Outcome("mismatch", f"{stage}: {what} differs from eager: {exc}")
    except Exception as exc:  # noqa: BLE001
        if _is_allowed(program, exc):
            outcome = Outcome("allowed-error", f"{stage}: {type(exc).__name__}: {exc}", exc)
        else:
            detail = f"{stage}: {type(exc).__name__}: {exc}"
            outcome = Outcome(f"error:{type(exc).__name__}", detail, exc)
    else:
        outcome = Outcome("ok")
    finally:
        graph.reset()
    return outcome


def _snapshot(persistent: dict) -> dict:
    return {key: value.clone() for key, value in persistent.items()}


def _user_memory_problem(
    before: dict, after_replay: dict, after_eager: dict, failure: BaseException | None, tol: dict
) -> str | None:
    """Long-lived tensors (the user's memory) after a replay must hold what the eager run
    leaves in them; after a failed replay (stopped part-way), what they held before or that."""

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        try:
            torch.testing.assert_close(a, b, equal_nan=True, **tol)
        except AssertionError:
            return False
        return True

    for key, value in after_replay.items():
        if close(value, after_eager[key]):
            continue
        if failure is not None and key in before and close(value, before[key]):
            continue
        how = f"a failed replay ({type(failure).__name__})" if failure is not None else "the replay"
        return (
            f"{how} wrote into the long-lived tensor PERSISTENT[{key}] (user memory): it holds "
            f"neither its earlier values nor what the eager run leaves in it"
        )
    return None


def _left_behind(outcome: Outcome) -> Outcome:
    """A capture, failed or not, must leave the process as it found it; repair and report."""
    problems = []
    python_keys = (torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot)
    if not torch.utils._python_dispatch._get_current_dispatch_mode_stack() and any(
        torch._C._dispatch_tls_is_dispatch_key_included(key) for key in python_keys
    ):
        problems.append("the Python dispatch key is left enabled with no mode on the stack")
        for key in python_keys:  # repair, or every later torch call hits an internal assert
            torch._C._dispatch_tls_set_dispatch_key_included(key, False)
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        problems.append("inference_mode or no_grad is left on")
    if any(map(torch.is_autocast_enabled, ("cpu", "cuda"))) or breakgraph.is_capturing():
        problems.append("autocast or a capture is left on")
    if not problems:
        return outcome
    return Outcome(
        "error:LeftStateBehind", f"{'; '.join(problems)} (after: {outcome.kind} {outcome.detail})"
    )


def run_raising(program: Program, backend: str = "emulated") -> Outcome:
    """A program of :func:`generate_raising` must raise its named error, never return values,
    and leave nothing behind."""
    return _left_behind(_run_raising(program, backend))


def _run_raising(program: Program, backend: str) -> Outcome:
    error, function = program.expect
    device = "cuda" if backend == "cuda" else "cpu"
    fn = program.compile()
    generator = torch.Generator().manual_seed(program.seed)
    static = _draw(program.inputs, generator, device, torch.float32)
    # one eager run first, as a warm-up, so that the parameters (PARAMS) exist before the
    # capture: made inside it, their random draw would be refused (and frozen)
    with contextlib.suppress(Exception), _eager_mode(program.mode):
        with breakgraph.context_scope(CAPTURE_CONTEXT):
            fn(*[s.clone() for s in static])
    graph = breakgraph.BreakableCUDAGraph()
    try:
        with _eager_mode(program.mode):
            with breakgraph.capture(graph, backend=backend, context=CAPTURE_CONTEXT):
                fn(*static)
        for s, f in zip(static, _draw(program.inputs, generator, device, torch.float32)):
            s.copy_(f)
        graph.replay(context=replay_context_for(program.seed, 0))
    except error as exc:
        if error is RuntimeError and (type(exc) is not RuntimeError or str(exc) != USER_ERROR):
            return Outcome(
                "mismatch", f"the user's RuntimeError came back as {type(exc).__name__}: {exc}", exc
            )
        if function is not None and getattr(exc, "function", None) != function:
            return Outcome(
                "mismatch",
                f"{type(exc).__name__} names {exc.function!r}, not {function!r}: {exc}",
                exc,
            )
        if error is breakgraph.HostSyncError and graph.num_segments:
            return Outcome("mismatch", "HostSyncError left a half-built graph behind", exc)
        outcome = Outcome("ok")
    except Exception as exc:  # noqa: BLE001
        outcome = Outcome(
            f"error:{type(exc).__name__}", f"expected {error.__name__}, got {exc!r}", exc
        )
    else:
        outcome = Outcome(
            "mismatch", f"expected {error.__name__}, but capture and replay returned values"
        )
    finally:
        graph.reset()
    return outcome


# -- shrinking and reporting -----------------------------------------------------------------------
def shrink(program: Program, failing: Callable[[Program], bool], budget: int = 400) -> Program:
    """Greedily drop statements (with everything that reads what they define), outputs,
    unused inputs and program-level modes while ``failing`` holds.

    Deletions never add a write or a metadata change, so a shrunk program stays well
    defined (``failing`` should reject programs whose eager run raises).
    """
    changed = True
    while changed and budget > 0:
        changed = False
        candidates: list[Program] = []
        if program.replay_autocast:
            candidates.append(program.replace(replay_autocast=False))
        if program.mode != "no_grad":
            candidates.append(program.replace(mode="no_grad"))
        for i in reversed(range(len(program.body))):
            candidates.append(_without_statement(program, i))
            candidates.append(program.replace(body=program.body[:i] + program.body[i + 1 :]))
        if len(program.outputs) > 1:
            for i in range(len(program.outputs)):
                candidates.append(
                    program.replace(outputs=program.outputs[:i] + program.outputs[i + 1 :])
                )
        if len(program.inputs) > 1 and not _uses(program, f"x{len(program.inputs) - 1}"):
            candidates.append(program.replace(inputs=program.inputs[:-1]))
        for candidate in candidates:
            budget -= 1
            if budget <= 0:
                break
            if failing(candidate):
                program, changed = candidate, True
                break
    return program


_ASSIGNED = re.compile(r"^\s*([A-Za-z_]\w*) = ")
_NAME = re.compile(r"[A-Za-z_]\w*")


def _uses(program: Program, name: str) -> bool:
    text = (
        " ".join(line for s in program.body for line in s.lines) + " " + " ".join(program.outputs)
    )
    return name in _NAME.findall(text)


def _without_statement(program: Program, index: int) -> Program:
    """``program`` without statement ``index`` and every later one reading what it defined."""
    body = program.body
    removed = {m.group(1) for line in body[index].lines if (m := _ASSIGNED.match(line))}
    kept = body[:index]
    for stmt in body[index + 1 :]:
        if removed & set(_NAME.findall(" ".join(stmt.lines))):
            removed |= {m.group(1) for line in stmt.lines if (m := _ASSIGNED.match(line))}
        else:
            kept.append(stmt)
    outputs = [o for o in program.outputs if o not in removed] or ["x0"]
    return program.replace(body=kept, outputs=outputs)


def same_failure(kind: str, backend: str = "emulated") -> Callable[[Program], bool]:
    def failing(candidate: Program) -> bool:
        return run_program(candidate, backend).kind == kind

    return failing


def describe_failure(
    program: Program,
    outcome: Outcome,
    backend: str,
    exclude: Iterable[str] = (),
    shrunk: Program | None = None,
) -> str:
    """The assertion message: what failed, the seed, the program and how to reproduce it."""
    exclude_arg = f" --exclude {','.join(sorted(exclude))}" if exclude else ""
    focus = [p.split("=", 1)[1] for p in program.label.split() if p.startswith("focus=")]
    focus_arg = f" --focus {focus[0]}" if focus else ""
    lines = [
        f"fuzz program seed={program.seed} on backend {backend!r}: {outcome.kind}",
        f"  {outcome.detail.splitlines()[0] if outcome.detail else ''}",
        *["  " + line for line in outcome.detail.splitlines()[1:8]],
        f"families: {', '.join(sorted(program.families))}",
        f"reproduce: python tests/fuzz_programs.py --seed {program.seed} --backend {backend}"
        f"{exclude_arg}{focus_arg} --shrink",
        "---- program ----",
        program.source(),
    ]
    if shrunk is not None and shrunk is not program:
        lines += ["---- shrunk (same failure) ----", shrunk.source()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--backend", default="emulated", choices=("emulated", "cuda"))
    parser.add_argument("--exclude", default="", help="comma-separated families to leave out")
    parser.add_argument("--focus", default=None, help="a family every program must contain")
    parser.add_argument(
        "--ci",
        action="store_true",
        help="also exclude the KNOWN_BROKEN families of tests/test_fuzz.py, as the suite does "
        "(all but --focus and what it needs)",
    )
    parser.add_argument("--raising", action="store_true", help="the generate_raising program")
    parser.add_argument("--shrink", action="store_true", help="shrink a failing program")
    args = parser.parse_args(argv)
    exclude = {f for f in args.exclude.split(",") if f}
    if args.ci:
        from test_fuzz import NEEDS, gated

        exclude |= gated(args.backend) - {args.focus} - NEEDS.get(args.focus, set())
    if args.raising:
        program = generate_raising(args.seed, exclude)
        print(program.source())
        outcome = run_raising(program, args.backend)
        print(outcome.kind, outcome.detail)
        return 0 if outcome.ok else 1
    program = generate(args.seed, exclude, args.focus)
    outcome = run_program(program, args.backend)
    if outcome.ok:
        print(program.source())
        print(f"ok ({outcome.kind})")
        return 0
    shrunk = shrink(program, same_failure(outcome.kind, args.backend)) if args.shrink else None
    print(describe_failure(program, outcome, args.backend, exclude, shrunk))
    return 1


if __name__ == "__main__":
    sys.exit(main())
