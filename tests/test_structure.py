"""The code's shape (docs/design.md, module map): one concept per module, so no module of the
library grows past 600 lines, and modules import in layers, so no import cycle, not even
through an import inside a function; the map names every module and what each imports."""

from __future__ import annotations

import ast
import os
import re

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
    with open(path, encoding="utf-8") as f:
        return _imports_tree(module, path, ast.parse(f.read()), known)


def _imports_tree(module: str, path: str, tree: ast.AST, known: set) -> set:
    """The library modules the import statements of ``tree`` (``module``'s, from ``path``)
    import."""
    is_package = path.endswith("__init__.py")
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



def _map_rows() -> dict[str, str]:
    """docs/design.md's module map, in its order: module name -> its "imports from breakgraph"
    cell."""
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as f:
        section = f.read().split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        path = re.match(r"`([^`]+)`", cells[0]).group(1)[: -len(".py")]
        package = "breakgraph"
        if path.startswith("integrations/transformers/"):
            package = "breakgraph.integrations.transformers"
            path = path[len("integrations/transformers/") :]
        parts = [p for p in path.split("/") if p != "__init__"]
        rows[".".join([package, *parts])] = cells[-1]
    return rows


def _named(cell: str, modules: set) -> tuple[set, set]:
    """The modules a map cell names, at load time and *lazily* (the part from "lazily" on):
    `x` is breakgraph's own module x, else the integration's (the integration's `errors`
    where both have one); `breakgraph` is the package itself."""
    integration = "breakgraph.integrations.transformers"
    parts = [set(), set()]
    for part, text in zip(parts, cell.split("lazily", 1)):
        for theirs, name in re.findall(r"(the integration's )?`([^`]+)`", text):
            if name != "breakgraph":
                mine = not theirs and f"breakgraph.{name}" in modules
                name = f"breakgraph.{name}" if mine else f"{integration}.{name}"
            part.add(name)
    return parts[0], parts[1]


def _imports_by_time(module: str, path: str, modules: set) -> tuple[set, set]:
    """The library modules ``module`` imports when it loads, and inside functions only: as
    :func:`_imports`, without the packages above it, with ``breakgraph`` itself where the file
    imports the package (``import breakgraph``, or a name of it that is not a module)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    at_load, in_functions = set(), set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found = _imports_of(child, module, path, modules)
                (in_functions if inner else at_load).update(found)
            visit(child, inner)

    visit(tree, False)
    return at_load, in_functions - at_load


def _imports_of(node: ast.AST, module: str, path: str, modules: set) -> set:
    """What one import statement of ``module`` imports (see :func:`_imports_by_time`)."""
    tree = ast.Module(body=[node], type_ignores=[])
    with_package = isinstance(node, ast.Import) and any(a.name == "breakgraph" for a in node.names)
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "breakgraph":
        with_package = any(f"breakgraph.{a.name}" not in modules for a in node.names)
    found = _imports_tree(module, path, tree, modules)
    found = {d for d in found if not module.startswith(d + ".")}
    if with_package and module != "breakgraph":
        found.add("breakgraph")
    return found


def test_the_module_map_names_every_module_and_what_it_imports():
    modules = _modules()
    known = set(modules)
    rows = _map_rows()
    assert sorted(known - set(rows)) == [], "modules missing from docs/design.md's module map"
    assert sorted(set(rows) - known) == [], "docs/design.md's module map names no such module"
    wrong = {}
    for module, path in modules.items():
        imported = _imports_by_time(module, path, known)
        named = _named(rows[module], known)
        for when, real, said in zip(("at load", "lazily"), imported, named):
            if real != said:
                wrong[f"{module} ({when})"] = {"not in the map": sorted(real - said),
                                               "not imported": sorted(said - real)}  # fmt: skip
    assert not wrong, f"docs/design.md's module map, column 'imports from breakgraph': {wrong}"


def test_the_module_map_goes_bottom_up():
    """Each module's imports at load time are rows before it in the map: the map reads as
    layers, and a newcomer reads it from the top."""
    known = set(_modules())
    rows = _map_rows()
    order = list(rows)
    later = {}
    for i, module in enumerate(order):
        at_load, _ = _named(rows[module], known)
        if below := sorted(at_load & set(order[i + 1 :])):
            later[module] = below
    assert not later, f"docs/design.md's module map: imported at load by a row above them: {later}"
