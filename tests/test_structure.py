"""The code's shape (docs/design.md, module map): one concept per module, so no module of the
library grows past 600 lines, and modules import in layers, so no import cycle, not even
through an import inside a function."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {  # folder -> the package it is imported as
    "breakgraph": "breakgraph",
    os.path.join("integrations", "transformers"): "breakgraph.integrations.transformers",
}
MAX_LINES = 600


def _modules() -> dict[str, str]:
    """Module name -> path, for every module of the library."""
    found = {}
    for folder, package in PACKAGES.items():
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                parts = os.path.relpath(path, os.path.join(ROOT, folder))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join([package, *parts])] = path
    return found


def _imports(module: str, path: str, known: set) -> set:
    """The library modules ``module`` imports, anywhere in the file."""
    is_package = path.endswith("__init__.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in names if name in known and name != module}


def test_no_module_over_600_lines():
    long = {}
    for module, path in _modules().items():
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            long[module] = lines
    assert not long, f"split these by concept (docs/design.md): {long}"


def test_no_import_cycle():
    modules = _modules()
    # a module runs inside its packages, which are imported before it: `from . import x`
    # and `import breakgraph` reach siblings through a package, they do not loop through it
    graph = {
        m: {d for d in _imports(m, p, set(modules)) if not m.startswith(d + ".")}
        for m, p in modules.items()
    }
    done, active, cycles = set(), [], []

    def visit(module: str) -> None:
        if module in active:
            cycles.append(active[active.index(module) :] + [module])
            return
        if module in done:
            return
        active.append(module)
        for dep in sorted(graph.get(module, ())):
            visit(dep)
        active.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
