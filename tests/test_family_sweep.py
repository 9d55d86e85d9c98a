"""scripts/family_sweep.py, the sweep that chose the families added in session 47: a supported
family passes it, one breakgraph refuses fails at the stage that refused it, and the list of
supported families is the same after it (the sweep accepts a type for one call only)."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers

from breakgraph.integrations.transformers import models  # noqa: E402

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "family_sweep.py")
_spec = importlib.util.spec_from_file_location("family_sweep", _PATH)
family_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(family_sweep)


def test_a_supported_family_passes_and_a_refused_one_says_why():
    before = models.SUPPORTED_MODEL_TYPES
    assert family_sweep.sweep_one("llama").startswith("llama OK prefill ")
    # every Gemma 2 checkpoint softcaps: breakgraph refuses it ("FAIL prefill
    # UnsupportedModelError"), or transformers itself gives it no sdpa (5.21: "FAIL model")
    assert family_sweep.sweep_one("gemma2").startswith("gemma2 FAIL ")
    assert family_sweep.sweep_one("no_such_type") == "no_such_type FAIL config no config class"
    assert models.SUPPORTED_MODEL_TYPES == before
