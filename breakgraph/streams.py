"""Side streams during capture: track forks from the capture stream, join them at segment ends.

Work forked from the capture stream onto a side stream (``side.wait_stream(cur)``
or an event recorded on the capture stream and waited on by ``side``) becomes part
of the capture. CUDA refuses to end a capture while such a stream is not joined
back (``cudaErrorStreamCaptureUnjoined``), and a break ends a capture in the middle
of user code that may join only later. So while a segment is being captured,
breakgraph hooks ``torch.cuda.Event.record`` and ``torch.cuda.Event.wait`` (which
``Stream.wait_stream``, ``Stream.wait_event`` and ``Stream.record_event`` all go
through) to learn which streams are part of the capture. At every segment end it
joins them into the capture stream; streams the user had not joined yet are forked
again at the start of the next segment, so the user's code keeps its meaning.

A wait that cannot be expressed in the graph (the capture stream waiting on work
that is not part of the capture) raises :class:`~breakgraph.StreamError`; it is
never dropped silently. The hooks are installed only while capturing and removed
on every exit path (they live on the capture session's ``ExitStack``, see
:mod:`breakgraph.patches`).

Why patch instead of torch's trace callbacks (``torch.cuda._gpu_trace``'s
``register_callback_for_event_record``/``..._wait``)? Those callbacks are called for
every event, but torch calls them inside a ``try``/``except`` that logs and swallows
exceptions, so a :class:`~breakgraph.StreamError` could not be raised at the offending
``wait``: the wait would run, the capture would fail later (or replay would race)
and the user would get a log line instead of an error at their line.

Example (inside a capture, nothing else to do)::

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())   # fork: tracked
    with torch.cuda.stream(side):
        y = x * 2
    eager_fn(x)          # segment ends here: breakgraph joins `side` first
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from .errors import StreamError
from .patches import patch_attribute
from .syncs import mark_capture_failed

__all__ = ["StreamTracker"]


class StreamTracker:
    """Knows which streams take part in the capture of the current segment."""

    def __init__(self, capture_stream: torch.cuda.Stream):
        self.capture_stream = capture_stream
        self.active = False  # True only while a segment is being captured
        self._lock = threading.Lock()
        self._members: dict[Any, bool] = {}  # stream -> still forked (not joined by the user)
        self._recorded_on: dict[int, tuple] = {}  # id(event) -> (event, stream)
        self._refork: list = []
        self._original_record = None
        self._original_wait = None

    # -- installation -----------------------------------------------------------------
    def install(self, stack: contextlib.ExitStack) -> None:
        """Hook ``Event.record``/``Event.wait`` until ``stack`` closes (the capture session)."""
        event_cls = torch.cuda.Event
        self._original_record, self._original_wait = event_cls.record, event_cls.wait
        tracker = self

        def record(event, stream=None):
            if stream is None:
                stream = torch.cuda.current_stream()
            tracker._on_record(event, stream)
            return tracker._original_record(event, stream)

        def wait(event, stream=None):
            if stream is None:
                stream = torch.cuda.current_stream()
            tracker._on_wait(event, stream)
            return tracker._original_wait(event, stream)

        patch_attribute(stack, event_cls, "record", record)
        patch_attribute(stack, event_cls, "wait", wait)
        stack.callback(self._forget)

    def _forget(self) -> None:
        self.active = False
        self._recorded_on.clear()
        self._members.clear()

    # -- hooks ------------------------------------------------------------------------
    def _part_of_capture(self, stream) -> bool:
        return stream == self.capture_stream or stream in self._members

    def _on_record(self, event, stream) -> None:
        if self.active:
            with self._lock:
                self._recorded_on[id(event)] = (event, stream)

    def _on_wait(self, event, stream) -> None:
        if not self.active:
            return
        with self._lock:
            entry = self._recorded_on.get(id(event))
            source = entry[1] if entry is not None else None
            source_captured = source is not None and self._part_of_capture(source)
            if self._part_of_capture(stream):
                if not source_captured:
                    where = "outside this capture" if source is None else f"on {source}"
                    # the wait does not run: caught inside the block, the capture fails anyway
                    raise mark_capture_failed(StreamError(
                        f"{stream} (part of the breakgraph capture) waits on an event recorded "
                        f"{where}. That dependency cannot be recorded in a CUDA graph and would "
                        f"not hold on replay. Record the event on the capture stream (or on a "
                        f"stream forked from it) inside the captured region, or wait before "
                        f"capture starts."
                    ))
                if stream != self.capture_stream:
                    self._members[stream] = True  # forked (again, after the user joined it)
                elif source != self.capture_stream:
                    self._members[source] = False  # joined by the user
            elif source_captured:
                self._members[stream] = True  # forked from the capture

    # -- segment boundaries -------------------------------------------------------------
    def join_all(self) -> list:
        """Join every stream that took part in this segment into the capture stream.

        Returns the streams the user had left unjoined (debug mode names them).
        """
        with self._lock:
            members = list(self._members.items())
            self._refork = [s for s, still_forked in members if still_forked]
            self.active = False
        for stream, _ in members:
            event = torch.cuda.Event()
            self._original_record(event, stream)
            self._original_wait(event, self.capture_stream)
        self._members.clear()
        self._recorded_on.clear()
        return list(self._refork)

    def begin_segment(self) -> None:
        """Start tracking a new segment, forking again the streams the user had left open."""
        self.active = True
        for stream in self._refork:
            event = torch.cuda.Event()
            self._original_record(event, self.capture_stream)
            self._original_wait(event, stream)
            self._members[stream] = True
        self._refork = []
