"""The page's prose: fragments of ``performance.md.in``, filled with numbers from the JSON.

A fragment starts at a line ``<!-- fragment NAME -->``; ``${name}`` placeholders are
filled strictly: a missing value and an unused one are both errors, so prose and code
cannot drift apart silently.
"""

from __future__ import annotations

import functools
import os
import re
import string
from collections.abc import Iterable

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "performance.md.in")
_HEADER = re.compile(r"^<!-- fragment ([\w.]+) -->\n", re.M)


@functools.cache
def fragments(path: str = TEMPLATE) -> dict[str, str]:
    """``{name: text}`` of every fragment in the template (the leading comment excluded)."""
    with open(path, encoding="utf-8") as f:
        parts = _HEADER.split(f.read())
    return {name: text.strip("\n") for name, text in zip(parts[1::2], parts[2::2])}


def fill(name: str, **values: object) -> str:
    """Fragment ``name`` with its placeholders replaced by ``values``.

    Example::

        >>> fill("why.bucket", bucket=64, tokens=32, padding="50%")
        'Bucket 64 for 32 tokens: 50% padding (the one-graph variant was not measured).'
    """
    template = string.Template(fragments()[name])
    wanted = {
        m.group("named") or m.group("braced") for m in template.pattern.finditer(template.template)
    }
    wanted.discard(None)
    unused = set(values) - wanted
    if unused:
        raise KeyError(f"fragment {name!r} has no placeholder for {sorted(unused)}")
    return template.substitute({k: str(v) for k, v in values.items()})


def num(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}"


def span(values: Iterable[float], digits: int = 2) -> str:
    """``"low–high"`` of the values, or the one value when both print the same."""
    values = list(values)
    low, high = num(min(values), digits), num(max(values), digits)
    return low if low == high else f"{low}–{high}"


def pct(fraction: float, digits: int = 0) -> str:
    return f"{100 * fraction:.{digits}f}%"


def table(header: list[str], rows: Iterable[list[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def bullets(items: Iterable[str]) -> str:
    return "\n".join(items)
