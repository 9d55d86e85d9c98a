"""Bucket sizes, and the one decision per call: which captured bucket a size goes to.

Pure functions, no graphs and no state, shared by every runner: the decision
(:func:`choose_bucket`, returning a :class:`Decision` whose ``action`` is an
:class:`Action`), tuned routes to faster buckets (:func:`faster_buckets`), and the bucket
lists: :func:`validate_buckets` (what every runner accepts) and the default ladders
(:func:`default_token_buckets`, dense, for prefill; :func:`geometric_buckets`, coarse, for
continuous batching). :class:`~breakgraph.ladder.GraphLadder` owns the graphs and applies
the decision; ``breakgraph.ladder`` and ``breakgraph.runner`` re-export these names.

Example::

    >>> from breakgraph.buckets import choose_bucket, default_token_buckets
    >>> buckets = default_token_buckets(64)
    >>> buckets, choose_bucket(buckets, 13).bucket
    ((8, 16, 24, 32, 40, 48, 56, 64), 16)
"""

from __future__ import annotations

import bisect
import enum
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InputError

__all__ = [
    "Action",
    "Decision",
    "choose_bucket",
    "faster_buckets",
    "tuned_times",
    "expected_padding",
    "validate_buckets",
    "default_token_buckets",
    "geometric_buckets",
]


# -- the decision -------------------------------------------------------------------------------


class Action(str, enum.Enum):
    """What a call does. A ``str``: ``decision.action == "replay"`` holds for ``Action.REPLAY``."""

    REPLAY = "replay"  # replay the graph of ``Decision.bucket``
    CAPTURE = "capture"  # capture a bucket of ``Decision.bucket`` first (a capture window)
    EAGER = "eager"  # run without a graph; ``Decision.reason`` says why
    RAISE = "raise"  # refuse (``on_miss="raise"``)

    def __repr__(self) -> str:
        return f"Action.{self.name}"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class Decision:
    """What a call of some size does: ``action`` (an :class:`Action`), the ``bucket`` it
    replays or captures, and for ``EAGER`` and ``RAISE`` the ``reason``."""

    action: Action
    bucket: int | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.action, Action):  # Decision("replay", 4) still works
            try:
                object.__setattr__(self, "action", Action(self.action))
            except ValueError:
                raise InputError(
                    f"Decision: action must be one of {[a.value for a in Action]}, got "
                    f"{self.action!r}."
                ) from None


def choose_bucket(
    buckets: Sequence[int],
    size: int,
    *,
    max_padding_fraction: float | None = None,
    can_capture: bool = False,
    on_miss: str = "eager",
    faster: Mapping[int, int] | None = None,
) -> Decision:
    """The one bucket decision: the smallest captured bucket that holds ``size``.

    ``buckets`` are ascending. A size above every bucket is captured (``can_capture``:
    a capture window is open), run eagerly or refused (``on_miss``); a bucket whose tail
    would exceed ``max_padding_fraction`` of it runs eagerly. ``faster`` maps a bucket to
    a larger one that was measured faster (:meth:`GraphLadder.tune
    <breakgraph.ladder.GraphLadder.tune>`): the call goes
    there. With several ranks, pass the size agreed across them, so every rank takes the
    same path.

    Example::

        >>> from breakgraph.buckets import choose_bucket
        >>> choose_bucket((4, 16), 5)
        Decision(action=Action.REPLAY, bucket=16, reason='')
        >>> choose_bucket((4, 16), 20).action == "eager"
        True
    """
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        if on_miss not in ("eager", "raise"):  # "Raise" would run eagerly, silently; checked
            # only here, where it decides (a ladder checked it once, and a step pays nothing)
            raise InputError(f"choose_bucket: on_miss must be 'eager' or 'raise', got {on_miss!r}.")
        if can_capture:
            return Decision(Action.CAPTURE, size)
        if on_miss == "raise":
            return Decision(Action.RAISE, None, "larger than every bucket")
        return Decision(Action.EAGER, None, "larger than every bucket")
    bucket = buckets[index]
    if max_padding_fraction is not None and bucket - size > max_padding_fraction * bucket:
        return Decision(Action.EAGER, None, "too much padding")
    return Decision(Action.REPLAY, faster.get(bucket, bucket) if faster else bucket)


def faster_buckets(times: Mapping[int, float], margin: float = 0.02) -> dict[int, int]:
    """Where each bucket's calls go instead: the smallest larger bucket that beats it by more
    than ``margin`` and is itself within ``margin`` of the fastest larger bucket.

    Example::

        >>> from breakgraph.buckets import faster_buckets
        >>> faster_buckets({192: 3.7, 200: 3.8, 208: 4.0, 224: 3.9, 256: 3.88})
        {208: 224}
    """
    sizes = sorted(times)
    faster = {}
    for i, size in enumerate(sizes):
        larger = sizes[i + 1 :]
        if not larger:
            break
        best = min(times[b] for b in larger)
        for b in larger:  # ascending: the least padding first
            if times[b] < times[size] * (1 - margin) and times[b] <= best * (1 + margin):
                faster[size] = b
                break
    return faster


def tuned_times(
    sizes: Sequence[int], time_one: Callable[[int], float], margin: float = 0.02
) -> dict[int, float]:
    """Milliseconds per replay of every bucket for :func:`faster_buckets`: one timing each
    (``time_one(size)``), then a second one of every bucket a route would rest on (the bucket
    and the one it would go to), keeping the lower of the two.

    A route moves every call of a bucket to a larger one, so it should not rest on a single
    sample: noise only ever slows a replay down, and one slow sample of a bucket sends its
    calls to a bucket that is really slower (more padding). A lower second time can make a new
    route (a smaller bucket to the one just retimed): its buckets are timed twice too, until
    every route rests on two timings of each of its buckets. The second timings cost replays of
    the routed buckets only.

    Example::

        >>> from breakgraph.buckets import tuned_times, faster_buckets
        >>> samples = {1024: [9.1, 8.5], 1152: [8.7, 8.7]}   # 1024's first replay was slow
        >>> times = tuned_times([1024, 1152], lambda s: samples[s].pop(0))
        >>> times, faster_buckets(times)
        ({1024: 8.5, 1152: 8.7}, {})
    """
    times = {size: time_one(size) for size in sizes}
    twice: set[int] = set()
    while True:
        routes = faster_buckets(times, margin)
        involved = {size for route in routes.items() for size in route} - twice
        if not involved:
            return times
        for size in sorted(involved):
            times[size] = min(times[size], time_one(size))
            twice.add(size)


def expected_padding(buckets: Sequence[int], bucket: int) -> float:
    """How many padding rows a call replaying ``bucket`` has on average, with calls of every
    size spread evenly: half the gap to the next smaller bucket of ``buckets``.

    Example::

        >>> from breakgraph.buckets import expected_padding
        >>> expected_padding((960, 1024), 1024), expected_padding((960, 1024), 960)
        (31.5, 479.5)
    """
    below = max((size for size in buckets if size < bucket), default=0)
    return (bucket - below - 1) / 2


# -- bucket lists -------------------------------------------------------------------------------


def validate_buckets(buckets: Any, where: str, allow_empty: bool = False) -> list[int]:
    """Bucket sizes checked once for every runner: positive ints (bools, floats and strings
    refused), returned sorted and unique. ``where`` names the caller in the ``InputError``.

    Example::

        >>> from breakgraph.buckets import validate_buckets
        >>> validate_buckets((64, 8, 8), "demo")
        [8, 64]
        >>> validate_buckets("16", "demo")
        Traceback (most recent call last):
        breakgraph.errors.InputError: demo: bucket sizes must be positive ints, got ['1', '6'] (bad: ['1', '6']).
    """  # noqa: E501
    try:
        sizes = list(buckets)
    except TypeError:
        raise InputError(
            f"{where}: buckets must be a sequence of sizes, got {buckets!r}."
        ) from None
    bad = [b for b in sizes if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0]
    if bad or (not sizes and not allow_empty):
        raise InputError(
            f"{where}: bucket sizes must be positive ints, got {sizes!r}"
            + (f" (bad: {bad!r})." if bad else ".")
        )
    return sorted({int(b) for b in sizes})


def validate_count(value: Any, least: int, what: str) -> int:
    """``value`` if it is an int of at least ``least`` (bools, floats and None refused), else
    an ``InputError`` naming ``what`` (the caller and the argument).

    Example::

        >>> from breakgraph.buckets import validate_count
        >>> validate_count(2, 0, "demo: warmup")
        2
        >>> validate_count(-1, 0, "demo: warmup")
        Traceback (most recent call last):
        breakgraph.errors.InputError: demo: warmup must be an int >= 0, got -1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise InputError(f"{what} must be an int >= {least}, got {value!r}.")
    return int(value)


def validate_flag(value: Any, what: str) -> bool:
    """``value`` if it is True or False, else an ``InputError`` naming ``what`` (the caller and
    the argument): a flag taken for its truth value would accept ``"no"`` as on, ``None`` and
    ``0`` as off, without a word.

    Example::

        >>> from breakgraph.buckets import validate_flag
        >>> validate_flag(True, "demo: debug")
        True
        >>> validate_flag("yes", "demo: debug")
        Traceback (most recent call last):
        breakgraph.errors.InputError: demo: debug must be True or False, got 'yes'.
    """
    if value is not True and value is not False:
        raise InputError(f"{what} must be True or False, got {value!r}.")
    return value


def validate_callable(value: Any, what: str, optional: bool = True) -> Any:
    """``value`` if it is callable (or None, when ``optional``), else an ``InputError`` naming
    ``what``: a wrong argument fails where it is given, not at the first call that uses it.

    Example::

        >>> from breakgraph.buckets import validate_callable
        >>> validate_callable("max", "demo: agree_size")
        Traceback (most recent call last):
        breakgraph.errors.InputError: demo: agree_size must be callable or None, got 'max'.
    """
    if (value is None and optional) or callable(value):
        return value
    expected = "callable or None" if optional else "callable"
    raise InputError(f"{what} must be {expected}, got {value!r}.")


def validate_real(value: Any, what: str, least: float | None = None) -> float:
    """``value`` as a float if it is a real number (bools and strings refused) and, with
    ``least``, at least ``least`` (NaN refused), else an ``InputError`` naming ``what``.

    Example::

        >>> from breakgraph.buckets import validate_real
        >>> validate_real("0.5", "demo: margin")
        Traceback (most recent call last):
        breakgraph.errors.InputError: demo: margin must be a real number, got '0.5'.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"{what} must be a real number, got {value!r}.")
    if least is not None and not value >= least:  # NaN too: every comparison with it is False
        raise InputError(f"{what} must be a real number >= {least}, got {value!r}.")
    return float(value)


def default_token_buckets(
    max_tokens: int = 4096, step: int = 8, dense_until: int = 256
) -> tuple[int, ...]:
    """The default ladder: multiples of ``step`` up to ``dense_until``, then 8 buckets per doubling.

    Padding waste is at most ``step - 1`` tokens up to ``dense_until`` (7 tokens below 256
    by default, like vLLM's capture sizes) and under 12.5 % above it (each bucket is at
    most 9/8 of the one before). The last bucket is ``max_tokens``. Why this dense: on an
    H200 a Llama-1B prefill of 200 tokens took 3.80 ms as an exact-length graph, 3.93 ms in
    breakgraph's bucket 200 and 4.11 ms in bucket 208 (some GEMM shapes are slower than
    larger ones; ``PrefillRunner(tune_buckets=True)`` routes around those), and each extra
    bucket costs well under 0.1 s of capture and almost no memory (one shared pool).

    Example::

        >>> from breakgraph.buckets import default_token_buckets
        >>> default_token_buckets(512)[:4], default_token_buckets(512)[-3:]
        ((8, 16, 24, 32), (448, 480, 512))
        >>> len(default_token_buckets(4096))
        64
    """
    # each by name: a string or None failed with Python's TypeError, a float or bool made
    # buckets of it (2.5: (2.5,); step=1.5: 1.5, 3.0, ...), which every runner then refused
    max_tokens = validate_count(max_tokens, 1, "default_token_buckets: max_tokens")
    step = validate_count(step, 1, "default_token_buckets: step")
    dense_until = validate_count(dense_until, 1, "default_token_buckets: dense_until")
    sizes, size = [], step
    while size < max_tokens:
        sizes.append(size)
        # past dense_until: 1/8 of the octave [2^k, 2^(k+1)) the size is in
        size += step if size < dense_until else max(step, _octave(size) // 8)
    sizes.append(max_tokens)
    return tuple(sizes)


def _octave(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def geometric_buckets(first: int, factor: int, last: int) -> tuple[int, ...]:
    """``first``, ``first * factor``, ... below ``last``, then ``last`` (always the last bucket).

    The continuous-batching default (32, 128, 512, ...): coarse on purpose when padding is
    cheap, as for a step whose attention breaks run at the exact lengths.

    Example::

        >>> from breakgraph.buckets import geometric_buckets
        >>> geometric_buckets(32, 4, 2048), geometric_buckets(32, 4, 1000), geometric_buckets(32, 4, 16)
        ((32, 128, 512, 2048), (32, 128, 512, 1000), (16,))
    """  # noqa: E501
    for name, value in (("first", first), ("factor", factor), ("last", last)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise InputError(f"geometric_buckets: {name} must be a positive int, got {value!r}.")
    if factor < 2:
        raise InputError(f"geometric_buckets: factor must be at least 2, got {factor}.")
    sizes, size = [], int(first)
    while size < last:
        sizes.append(size)
        size *= factor
    return (*sizes, int(last))
