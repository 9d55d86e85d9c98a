"""Every runnable example in breakgraph's docstrings runs (emulated backend, CPU)."""

import doctest
import importlib
import pkgutil

import pytest

import breakgraph

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(breakgraph.__path__, "breakgraph.")
    if not name.startswith("breakgraph.integrations")  # its example is tests/test_transformers.py
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.IGNORE_EXCEPTION_DETAIL)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
