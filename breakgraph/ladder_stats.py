"""The counters of a :class:`~breakgraph.ladder.GraphLadder`: per bucket and in total.

Kept apart from the ladder itself: they are plain data (what was captured, replayed, padded,
how long captures took), read by runners' ``stats``, the benchmarks and ``str(stats)``'s
table, while the ladder is the capture and replay logic.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BucketStats", "LadderStats", "combined"]


@dataclass
class BucketStats:
    """One bucket's counters."""

    captures: int = 0
    replays: int = 0
    padded: int = 0  # padding elements (bucket - size), summed over replays
    capture_s: float = 0.0  # its capture, plus the warm-up before it when there was one
    graph_memory_bytes: int = 0  # growth of the ladder's pool during its capture (CUDA)
    breaks: int = 0  # eager breaks in its graph
    replay_ms: float | None = None  # measured by GraphLadder.tune()


@dataclass
class LadderStats:
    """The counters of a :class:`GraphLadder` (``BucketedRunner.stats`` is one too, as
    ``RunnerStats``); ``str(stats)`` prints a table.

    ``buckets`` maps each bucket captured since the ladder was built to its
    :class:`BucketStats` (a bucket released by ``discard()`` keeps its counters, and they go
    on if it is captured again); ``calls``,
    ``padded_elements``, ``capture_seconds``, ``graph_memory_bytes`` and ``replay_ms`` are
    read-only ``{bucket: value}`` views of them.

    Example::

        >>> from breakgraph.ladder_stats import BucketStats, LadderStats
        >>> stats = LadderStats({64: BucketStats(captures=1, replays=9, padded=20, capture_s=0.25)})
        >>> stats.eager_fallbacks["larger than every bucket"] = 2
        >>> (stats.captures, stats.replays, stats.eager_steps, dict(stats.calls))
        (1, 9, 2, {64: 9})
        >>> print(stats)
        bucket  captures  replays  padded  capture s  graph MiB  breaks
            64         1        9      20      0.250        0.0       0
         total         1        9      20      0.250        0.0
        eager fallbacks: larger than every bucket: 2
    """

    buckets: dict[int, BucketStats] = field(default_factory=dict)
    eager_fallbacks: dict[str, int] = field(default_factory=dict)  # by reason
    warmup_seconds: float = 0.0  # summed over every capture() call
    routed: dict[int, int] = field(default_factory=dict)  # bucket -> faster larger bucket

    def _buckets(self) -> list[tuple[int, BucketStats]]:
        """The buckets now, as a list: another thread may read the stats while the owner
        captures a bucket (the continuous-batching decode graphs capture while serving), and a
        loop over the dict itself would then raise ("dictionary changed size")."""
        return list(self.buckets.items())

    @property
    def captures(self) -> int:
        return sum(b.captures for _, b in self._buckets())

    @property
    def replays(self) -> int:
        return sum(b.replays for _, b in self._buckets())

    @property
    def eager_steps(self) -> int:
        return sum(self.eager_fallbacks.values())

    @property
    def capture_s(self) -> float:
        return sum(b.capture_s for _, b in self._buckets())

    def _view(self, name: str) -> Mapping[int, Any]:
        return types.MappingProxyType({k: getattr(b, name) for k, b in self._buckets()})

    @property
    def calls(self) -> Mapping[int, int]:
        """Replays per bucket."""
        return self._view("replays")

    @property
    def padded_elements(self) -> Mapping[int, int]:
        """Padding elements (positions along the bucketed dimension) per bucket."""
        return self._view("padded")

    @property
    def capture_seconds(self) -> Mapping[int, float]:
        return self._view("capture_s")

    @property
    def graph_memory_bytes(self) -> Mapping[int, int]:
        return self._view("graph_memory_bytes")

    @property
    def replay_ms(self) -> Mapping[int, float]:
        """Measured replay times of the buckets :meth:`GraphLadder.tune` timed."""
        return types.MappingProxyType(
            {k: b.replay_ms for k, b in self._buckets() if b.replay_ms is not None}
        )

    def __str__(self) -> str:
        buckets = sorted(self._buckets())
        rows = [("bucket", "captures", "replays", "padded", "capture s", "graph MiB", "breaks")]
        for size, b in buckets:
            mib = f"{b.graph_memory_bytes / 2**20:.1f}"
            rows.append(
                (size, b.captures, b.replays, b.padded, f"{b.capture_s:.3f}", mib, b.breaks)
            )
        memory = sum(b.graph_memory_bytes for _, b in buckets) / 2**20
        padded = sum(b.padded for _, b in buckets)
        captures, replays = sum(b.captures for _, b in buckets), sum(b.replays for _, b in buckets)
        capture_s = sum(b.capture_s for _, b in buckets)
        total = (captures, replays, padded, f"{capture_s:.3f}", f"{memory:.1f}", "")
        rows.append(("total", *total))
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(str(v).rjust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
        fallbacks = ", ".join(f"{k}: {v}" for k, v in sorted(self.eager_fallbacks.items()))
        lines.append(f"eager fallbacks: {fallbacks or 'none'}")
        return "\n".join(lines)


def combined(first: LadderStats, *others: LadderStats) -> LadderStats:
    """Several ladders over the same buckets as one: counts, padding, capture time and memory
    summed per bucket; breaks, tuned times and routes are ``first``'s (the ladder that decides).
    ``PrefillRunner.stats`` is its packed ladder combined with its single-prompt one.

    Example::

        >>> from breakgraph.ladder_stats import BucketStats, LadderStats, combined
        >>> a = LadderStats({64: BucketStats(captures=1, replays=2, breaks=4)})
        >>> b = LadderStats({64: BucketStats(captures=1, replays=5)})
        >>> both = combined(a, b)
        >>> (both.captures, dict(both.calls), both.buckets[64].breaks)
        (2, {64: 7}, 4)
    """
    buckets = {size: BucketStats(**vars(b)) for size, b in first._buckets()}
    out = LadderStats(
        buckets, dict(first.eager_fallbacks), first.warmup_seconds, dict(first.routed)
    )
    for other in others:
        for size, b in other._buckets():
            mine = buckets.setdefault(size, BucketStats())
            mine.captures += b.captures
            mine.replays += b.replays
            mine.padded += b.padded
            mine.capture_s += b.capture_s
            mine.graph_memory_bytes += b.graph_memory_bytes
        for reason, count in list(other.eager_fallbacks.items()):
            out.eager_fallbacks[reason] = out.eager_fallbacks.get(reason, 0) + count
        out.warmup_seconds += other.warmup_seconds
    return out
