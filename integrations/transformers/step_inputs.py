"""A CB step's static inputs: what the step runner's graphs read, and each step's copy into it
(and :class:`StepOrder`, which orders the steps of managers on different CUDA streams).

The query-token graphs read ``[2, B]`` ids and positions per bucket ``B``, the logits graphs a
``[L]`` row index per bucket ``L`` (:mod:`.cb_step`). Every step copies its values in before
a replay, on the hot path, so the staging costs as few device operations as it can:

* transformers keeps a step's ids and positions as two rows of one bulk tensor; where they are
  (:func:`rows_of_one`), one copy stages both;
* a buffer's tail (past the step's ``n`` columns) must hold defined values (zeros) for the
  padded rows; it is zeroed only where an earlier step wrote past ``n``, so steps of steady or
  growing size pay nothing for it;
* the buffers' columns a step copies into are views made once per size (:func:`view`, also
  used by :class:`.decode_graph.DecodeBuffers`), not sliced again on every step.

Example (a bulk tensor as transformers lays it out: ids, then positions)::

    >>> inputs = StepInputs(torch.device("cpu"))
    >>> inputs.allocate([4, 8])
    >>> bulk = torch.arange(20).view(2, 10)
    >>> inputs.stage(8, bulk[0, :3][None], bulk[1, :3][None], 3).tolist()
    [[0, 1, 2, 0, 0, 0, 0, 0], [10, 11, 12, 0, 0, 0, 0, 0]]
    >>> inputs.stage_rows(4, torch.tensor([2, 0]), 2, 3).tolist()
    [2, 0, 0, 0]
    >>> inputs.stage_rows(4, torch.tensor([-1, 1]), 2, 3).tolist()   # -1: the step's last token
    [2, 1, 0, 0]
"""

from __future__ import annotations

import torch

from breakgraph.errors import InputError

__all__ = ["StepInputs", "StepOrder", "logits_rows", "rows_of_one", "view"]

#: most views a cache of :func:`view` keeps (then it starts again): each a few hundred bytes
VIEWS_KEPT = 1024


def view(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` the first time: a step's views of static buffers
    (``buffer[:, :n]``) are the same few every step, and making one costs the host a
    dispatch (microseconds on the hot path). Bounded by :data:`VIEWS_KEPT`. Views only: a
    tensor of its own memory, freed when the cache starts again, could be handed out anew while
    a step on another stream still reads it.

    >>> views, buffer = {}, torch.arange(6)
    >>> first = view(views, 3, lambda: buffer[:3])
    >>> view(views, 3, lambda: buffer[:0]) is first, first.tolist()
    (True, [0, 1, 2])
    """
    found = cache.get(key)
    if found is None:
        if len(cache) >= VIEWS_KEPT:
            cache.clear()
        found = cache[key] = make()
    return found


def logits_rows(keep, tokens: int, who: str) -> int:
    """The logits rows of a CB step of ``tokens`` query tokens: one per index of transformers'
    ``logits_to_keep`` tensor ``keep``, else one per token.

    Refuses a step with no query token (``InputError``). transformers schedules one for a lone
    request whose prompt is empty, or with children and one prompt token left
    (docs/continuous-batching.md, *Known problems*); stock continuous batching fails it in the
    model. Replayed, its logits row ``-1`` failed ``index_select`` with a raw error (on CUDA a
    device-side assert), and :meth:`StepInputs.stage_rows` wraps rows by the step's tokens.

    >>> logits_rows(torch.tensor([4, 9]), 10, "f"), logits_rows(None, 10, "f")
    (2, 10)
    """
    if tokens == 0:
        raise InputError(
            f"{who}: a continuous-batching step with no query token reached the model: "
            f"transformers scheduled only requests with nothing to compute (an empty prompt, or "
            f"a request with children and one prompt token left). Stock continuous batching "
            f"fails such a step too; give every prompt at least one token."
        )
    return keep.numel() if isinstance(keep, torch.Tensor) else tokens


class StepInputs:
    """The static ids-and-positions buffers of every query bucket (:attr:`tokens`), row
    indices of every logits bucket (:attr:`rows`) and the hidden states between the two
    ladders (:attr:`hidden`), allocated once (:meth:`allocate`). Not thread-safe: the step
    runner stages under its lock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tokens: dict[int, torch.Tensor] = {}  # query bucket -> [2, B] ids and positions
        self.rows: dict[int, torch.Tensor] = {}  # logits bucket -> [L] row index
        self.hidden: torch.Tensor | None = None  # [1, largest bucket, hidden size]
        #: (buffer address, bucket) -> the columns of that buffer a step may have left non-zero
        self._written: dict[tuple[int, int], int] = {}
        self._views: dict[tuple, torch.Tensor] = {}  # (kind, bucket, n) -> the buffer's columns

    def allocate(self, sizes, hidden_size: int = 0, dtype: torch.dtype = torch.float32) -> None:
        """Zeroed buffers for every bucket of ``sizes`` (the same sizes serve both ladders), and
        the ``hidden_size``-wide hidden states of the largest in ``dtype``."""
        self._views.clear()  # of any buffers before these
        with torch.inference_mode(False):
            shape = (1, max(sizes), hidden_size)
            self.hidden = torch.zeros(shape, dtype=dtype, device=self.device)
            for size in sizes:
                self.tokens[size] = torch.zeros(2, size, dtype=torch.long, device=self.device)
                self.rows[size] = torch.zeros(size, dtype=torch.long, device=self.device)

    def stage(self, bucket: int, ids: torch.Tensor, positions: torch.Tensor, n: int):
        """Copy the step's ``ids`` and ``positions`` (``[1, n]`` each) into ``bucket``'s buffer,
        zeros after them; returns the buffer."""
        tokens = self.tokens[bucket]
        self._zero_tail(tokens, bucket, n)  # first: a copy that fails leaves no stale tail
        both = rows_of_one(ids, positions)
        if both is not None:  # transformers' bulk tensor: one copy stages both
            view(self._views, ("tokens", bucket, n), lambda: tokens[:, :n]).copy_(both)
        else:
            tokens[0, :n].copy_(ids[0])
            tokens[1, :n].copy_(positions[0])
        return tokens

    def stage_rows(self, bucket: int, keep, rows: int, tokens: int) -> torch.Tensor:
        """The logits rows to keep (a tensor of ``rows`` indices, or None: the first ``rows``)
        of a step of ``tokens`` query tokens (at least one) into ``bucket``'s row index, zeros
        after them; returns the index.

        A negative row counts from the step's last token, as the model's own
        ``hidden_states[:, logits_to_keep]`` reads it: transformers keeps row ``-1`` for a
        request with an empty prompt that comes first in its step. Copied as it was, that row
        failed ``index_select`` (every request of the manager failed; on CUDA a device-side
        assert), where stock continuous batching served the step. The wrap is the staging
        operation itself (one operation, as the copy was)."""
        index = self.rows[bucket]
        self._zero_tail(index, bucket, rows)
        if isinstance(keep, torch.Tensor):
            rows_view = view(self._views, ("rows", bucket, rows), lambda: index[:rows])
            torch.remainder(keep, tokens, out=rows_view)
        else:
            torch.arange(rows, out=index[:rows])
        return index

    def clear(self, ranks=None) -> None:
        """Release every buffer (the runner's ``close``, a failed capture), unless ``ranks`` keep
        memory: after a capture step failed with NCCL, the graphs that read these buffers are
        kept until the process exits (``RankGroup.capture_step``), and so are they, also when
        a later :meth:`allocate` replaces them here."""
        if ranks is not None and ranks.keeps_memory:
            ranks.keep_until_exit((self.hidden, self.tokens, self.rows))
            return
        self.hidden = None
        self.tokens.clear()
        self.rows.clear()
        self._written.clear()
        self._views.clear()

    def _zero_tail(self, buffer: torch.Tensor, bucket: int, n: int) -> None:
        """Zero ``buffer``'s columns from ``n`` on (its last dimension) where an earlier step
        wrote them: one device operation for a step that shrank, none otherwise."""
        key = (buffer.data_ptr(), bucket)
        written = self._written.get(key, bucket)  # unknown: all of it
        if written > n:
            buffer[..., n:written].zero_()
        self._written[key] = n


def rows_of_one(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """``first`` and ``second`` (``[1, n]`` each) as one ``[2, n]`` view where they are rows of
    one tensor, ``second`` after ``first`` (transformers keeps a step's ids and positions as two
    rows of one bulk tensor), so that one copy stages both; None where they are not.

    >>> bulk = torch.arange(12).view(3, 4)
    >>> rows_of_one(bulk[0, :3].unsqueeze(0), bulk[2, :3].unsqueeze(0)).tolist()
    [[0, 1, 2], [8, 9, 10]]
    >>> rows_of_one(torch.zeros(1, 3), torch.zeros(1, 3)) is None
    True
    >>> rows = torch.arange(8).numpy()   # two storages at one address, the first too short
    >>> rows_of_one(torch.from_numpy(rows[:3])[None], torch.from_numpy(rows)[None, 4:7]) is None
    True
    """
    n = first.shape[-1]
    if (first.dtype != second.dtype or second.shape[-1] != n or first.stride(-1) != 1
            or second.stride(-1) != 1 or first.device != second.device):  # fmt: skip
        return None
    apart = second.storage_offset() - first.storage_offset()
    storage = first.untyped_storage()
    if (apart < n or storage.data_ptr() != second.untyped_storage().data_ptr()
            or storage.nbytes() < (first.storage_offset() + apart + n) * first.element_size()):
        return None  # not one storage (two may start at one address), or not two whole rows
    return first.as_strided((2, n), (apart, 1))


class StepOrder:
    """Orders the steps of managers that issue them on different CUDA streams: a step first
    waits for the stream of the step before it, where that is another stream. One stream lookup
    per step (an event waited on and recorded every step cost two more calls on the hot path);
    steps on one stream are ordered by the stream itself."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: torch.cuda.Stream | None = None  # the stream of the step before

    def follow(self) -> None:
        """Order the step about to be issued on the current stream after the one before."""
        stream = torch.cuda.current_stream()
        if self.last is not None and stream != self.last:
            stream.wait_stream(self.last)  # everything issued there so far: the step before too
        self.last = stream
