"""Every list of supported model families in the docs (and in enable_continuous_batching's
docstring) is ``SUPPORTED_MODEL_TYPES``, and every count of "the families added later" is the
number of ``OTHER_DENSE_FAMILIES``. Read from the sources (no transformers import): fast."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
           "fourteen fifteen sixteen seventeen eighteen nineteen").split()
WORDS = {word: n for n, word in enumerate(NUMBERS)}
for tens, name in ((20, "twenty"), (30, "thirty"), (40, "forty")):
    WORDS.update({f"{name}-{word}": tens + n for n, word in enumerate(NUMBERS[1:10], 1)})
    WORDS[name] = tens


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def _assigned(source: str, name: str) -> tuple:
    """The tuple assigned to ``name`` at the top of a module, or the keys of its dict."""
    for node in ast.parse(source).body:
        targets = [getattr(t, "id", None) for t in getattr(node, "targets", ())]
        if targets == [name]:
            if isinstance(node.value, ast.Dict):
                return tuple(ast.literal_eval(key) for key in node.value.keys)
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found")


SUPPORTED = _assigned(_read("integrations", "transformers", "models.py"), "SUPPORTED_MODEL_TYPES")
ADDED = _assigned(_read("benchmarks", "tiny_models.py"), "OTHER_DENSE_FAMILIES")
#: "The last ten run unmodified", "the ten families added later"
COUNT = r"(?:[Tt]he last|the) ([\w-]+)\s+(?:run unmodified|families added later)"


def test_the_supported_tuple_shown_is_the_codes():
    page = _read("docs", "integration-transformers.md")
    shown = re.search(r"`SUPPORTED_MODEL_TYPES = (\([^`]*\))`", page)
    assert shown and ast.literal_eval(shown.group(1)) == SUPPORTED


def test_every_family_list_names_the_supported_families():
    page = _read("docs", "continuous-batching.md")
    cb = re.search(r"\*\*Model families:\*\*(.*?)\(\[which", page, re.S)
    docstring = re.search(r"a supported family \(dense: (.*?)\) in eval mode", _read(
        "integrations", "transformers", "continuous_batching.py"), re.S)  # fmt: skip
    assert cb and docstring
    for where, text in (("continuous-batching.md", cb.group(1)), ("docstring", docstring.group(1))):
        named = re.findall(r"\b[a-z][a-z0-9_]*[a-z0-9]\b", text.replace("MoE", ""))
        names = [n for n in named if n not in ("dense", "moe")]
        assert sorted(names) == sorted(SUPPORTED), where


def test_counts_of_the_added_families_are_right():
    assert SUPPORTED[-len(ADDED) :] == ADDED  # "the last N" of the tuple are the added ones
    page = _read("docs", "integration-transformers.md")
    counts = re.findall(COUNT, page)
    assert len(counts) >= 2, counts
    assert {WORDS.get(word) for word in counts} == {len(ADDED)}, counts


def test_the_readme_counts_the_supported_families():
    shown = re.search(r"\(`SUPPORTED_MODEL_TYPES`, (\d+)\)", _read("README.md"))
    assert shown and int(shown.group(1)) == len(SUPPORTED)
