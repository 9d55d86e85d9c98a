"""The docs stay true to the code: every signature docs/api.md shows (the fenced ones and the
methods listed under a class), and the fenced ones of the runner and prefill pages, have the
parameters, kinds and defaults of the real callable, and every name the API page's module
table lists is importable from that module."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re

import pytest

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")
API_MD = os.path.join(DOCS, "api.md")
#: the pages whose fenced blocks show signatures of the public API (API_MD's bullets too)
PAGES = ("api.md", "runner.md", "integration-transformers.md")
MODULES = (
    "breakgraph",
    "breakgraph.runner",
    "breakgraph.ladder",
    "breakgraph.buckets",
    "breakgraph.distributed",
    "breakgraph.testing",
    "breakgraph.memory",
    "breakgraph.integrations.transformers",  # needs transformers: skipped without it
)
KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}
NO_DEFAULT = "(none)"


def _public_names() -> dict:
    names = {}
    for module in MODULES:
        try:
            loaded = importlib.import_module(module)
        except ImportError:
            continue
        for name in dir(loaded):
            names.setdefault(name, getattr(loaded, name))
    return names


def _documented(params: str) -> list[tuple]:
    """The parameters of ``name(params)`` as written in the docs: (name, kind, default)."""
    args = ast.parse(f"def f({params}): pass").body[0].args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [(a.arg, "positional", d) for a, d in zip(positional, defaults)]
    out += [(args.vararg.arg, "*args", None)] if args.vararg else []
    out += [(a.arg, "keyword-only", d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    out += [(args.kwarg.arg, "**kwargs", None)] if args.kwarg else []
    return [(n, k, NO_DEFAULT if d is None else ast.literal_eval(d)) for n, k, d in out]


def _real(obj) -> list[tuple]:
    return [
        (p.name, KINDS[p.kind], NO_DEFAULT if p.default is inspect.Parameter.empty else p.default)
        for p in inspect.signature(obj).parameters.values()
        if p.name != "self"
    ]


def _signatures(page: str) -> list[tuple[str, str, str, object]]:
    """(where, name, params, owner class or None) for every signature ``page`` shows: the
    fenced blocks without a language, ``* `method(...)` `` bullets under a class's heading,
    and a ``* `Class(...)` `` bullet with the ``  * `method(...)` `` bullets nested in it."""
    public = _public_names()
    found, fence, block, owner, member_of = [], None, [], None, None
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            if fence is None:
                fence, block = line[3:].strip(), []
            else:
                if fence == "":
                    joined = " ".join(part.strip() for part in block)
                    for name, params in re.findall(r"(\w+)\(([^()]*)\)", joined):
                        found.append((f"{page}:{number}", name, params, None))
                fence = None
            continue
        if fence is not None:
            block.append(line)
            continue
        heading = re.match(r"^#+ `(?:[\w.]+\.)?(\w+)`", line)
        if heading:
            candidate = public.get(heading.group(1))
            owner = candidate if inspect.isclass(candidate) else None
        bullet = re.match(r"^\* `(\w+)\(([^`]*)\)(?: ->[^`]*)?`", line)
        if bullet and owner is not None:
            found.append((f"{page}:{number}", bullet.group(1), bullet.group(2), owner))
        if heading or line.startswith("* "):  # a class bullet's members end at the next bullet
            candidate = public.get(bullet.group(1)) if bullet and owner is None else None
            member_of = candidate if inspect.isclass(candidate) else None
            if member_of is not None:
                found.append((f"{page}:{number}", bullet.group(1), bullet.group(2), None))
        nested = re.match(r"^\s+\* `(\w+)\(([^`]*)\)(?: ->[^`]*)?`", line)
        if nested and member_of is not None:
            found.append((f"{page}:{number}", nested.group(1), nested.group(2), member_of))
    return found


def test_every_signature_shown_is_the_codes():
    public = _public_names()
    forms: dict[tuple, list] = {}  # a block may show one callable several ways (a decorator)
    for where, name, params, owner in (s for page in PAGES for s in _signatures(page)):
        obj = getattr(owner, name, None) if owner is not None else public.get(name)
        if obj is None or not callable(obj) or inspect.isclass(obj) and issubclass(obj, Exception):
            continue  # a type named in a block (Action.REPLAY), not a signature
        key = (where, owner.__name__ if owner else "", name)
        forms.setdefault(key, []).append((_documented(params), _real(obj)))
    assert len(forms) >= 35, f"the pages' signatures were not found: {sorted(forms)}"
    wrong = {
        key: [doc for doc, _ in shown] + [("code", shown[0][1])]
        for key, shown in forms.items()
        if not any(doc == real for doc, real in shown)
    }
    assert not wrong, f"the docs disagree with the code: {wrong}"


def test_the_module_table_names_what_each_module_exports():
    with open(API_MD, encoding="utf-8") as f:
        table = f.read().split("```", 2)[1]
    entries = re.findall(r"^(breakgraph[\w.]*)\s*\n?\s*((?:.+\n)+?)(?=^breakgraph|\Z)", table, re.M)
    assert len(entries) >= 7
    for module, names in entries:
        if module.endswith("transformers"):
            pytest.importorskip("transformers")
        loaded = importlib.import_module(module)
        entries = re.sub(r"\([^)]*\)", "", names).replace("\n", " ").split(",")
        listed = [re.sub(r"^and\s+", "", e.strip()) for e in entries]
        listed = [n for n in listed if re.fullmatch(r"[A-Za-z_]\w*", n)]  # not prose, not ...
        missing = [n for n in listed if not hasattr(loaded, n)]
        assert not missing, f"{module} does not have {missing}"


@pytest.mark.parametrize("module", ["breakgraph", "breakgraph.integrations.transformers"])
def test_every_exported_name_is_documented_with_a_runnable_example(module):
    """Every name of the two public packages' ``__all__`` is named on the API page, and every
    class and function among them has a doctest (run by tests/test_doctests.py) in its own
    docstring or, where the module's docstring shows it, one there that uses the name."""
    import doctest

    if module.endswith("transformers"):
        pytest.importorskip("transformers")
    loaded = importlib.import_module(module)
    with open(API_MD, encoding="utf-8") as f:
        page = f.read()
    parser = doctest.DocTestParser()
    undocumented, no_example = [], []
    for name in loaded.__all__:
        obj = getattr(loaded, name)
        if not re.search(rf"`(?:[\w.]+\.)?{name}\b", page):
            undocumented.append(name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # a constant (a key, a tuple of model types): the page names it
        if parser.get_examples(inspect.getdoc(obj) or ""):
            continue
        examples = parser.get_examples(importlib.import_module(obj.__module__).__doc__ or "")
        if not any(name in example.source + example.want for example in examples):
            no_example.append(name)
    assert not undocumented, f"docs/api.md does not name {undocumented} of {module}"
    assert not no_example, f"no runnable example in the docstrings of {no_example}"
