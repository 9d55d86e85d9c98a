"""Every runnable example in breakgraph's docstrings runs (emulated backend, CPU)."""

import doctest
import importlib
import pkgutil

import pytest

import breakgraph

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(breakgraph.__path__, "breakgraph.")
    # the serve launcher starts a server when imported as a script; its test is separate
    if not name.endswith(".__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name.startswith("breakgraph.integrations.transformers"):
        pytest.importorskip("transformers")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.IGNORE_EXCEPTION_DETAIL)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
