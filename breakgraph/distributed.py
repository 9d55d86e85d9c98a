"""Ranks that replay graphs together: tensor parallelism with collectives inside segments.

With tensor parallelism (TP) every rank holds a shard of the model, and the forward
contains collectives: an all-reduce after each row-parallel layer, an all-gather of the
logits. A collective completes only when every rank of the group has launched it, so
the ranks must run the same sequence of graphs and breaks:

* the same buckets, captured in the same order, with the same segments and breaks;
* on every call, the same bucket or the same eager fallback. If one rank replays while
  another runs eagerly, both wait forever;
* the same inputs. A rank given other prompts computes wrong logits without any error.

A :class:`RankGroup` makes a runner keep these rules. On every call it runs ONE small
all-reduce (``MAX`` over ``3 + world_size`` int64 values) on a gloo group of its own over
the same ranks. The values are:

* the size: every rank pads to the bucket of the largest size, so all ranks replay the
  same graph or all fall back to eager;
* a fingerprint of the inputs and its negation: ``max(f) == -max(-f)`` holds only if every
  rank sent the same ``f``. Otherwise every rank raises :class:`~breakgraph.RankMismatchError`;
* one failure flag per rank: a rank whose call failed says so, and the others raise
  :class:`~breakgraph.RankFailedError` instead of waiting.

During the capture phase the same exchange follows every warm-up and every capture, and
it has a timeout. A rank that fails there makes the others raise within ``timeout``
seconds, and they raise if the ranks recorded different segments or breaks. With NCCL a
rank whose peer failed mid-capture may have collectives waiting on its GPU for ever, so the
process must end after the error (``torchrun`` ends the others when one rank raises).

Why a separate gloo group, as transformers' continuous batching also uses: the values stay
on the host, so agreeing needs no GPU synchronisation. It never mixes with the model's
NCCL collectives, and gloo gives up after a timeout on the host.

Example (one rank; under ``torchrun`` every rank runs the same code)::

    >>> import torch.distributed as dist
    >>> from breakgraph.distributed import RankGroup, fingerprint
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> ranks = RankGroup()
    >>> ranks.agree(40, fingerprint([17, 23]))    # the largest size over all ranks
    40
    >>> ranks.close(); dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any, TypeVar

import torch

from .all_reduce_breaks import all_reduce_as_breaks
from .buckets import validate_real
from .errors import InputError, RankFailedError, RankMismatchError
from .fingerprints import fingerprint, plain_setting

__all__ = [
    "RankGroup",
    "tensor_parallel_group",
    "fingerprint",
    "validate_timeout",
    "all_reduce_as_breaks",
    "CAPTURE_ERROR_MODE",
]

#: ``capture_error_mode`` of every ladder capture (runners, CB managers), single- or
#: multi-rank: other threads of the process keep using CUDA while a ladder captures (NCCL's
#: watchdog threads query events; a server's other threads serve, sync and allocate), and in
#: "global" mode their calls would fail, and fail the capture with them. What the capturing
#: thread may not do is the same in both modes. torch's CUDA graph trees capture the same way.
CAPTURE_ERROR_MODE = "thread_local"

_INT64 = 1 << 63  # sizes and fingerprints of an exchange lie strictly between -_INT64 and it
_LONGEST_TIMEOUT = 1e9  # seconds: gloo's limit is 2**63 microseconds (see validate_timeout)
_PRIMARY, _COLLATERAL = 2, 1  # failure flags: failed by itself, or cut off by another rank
_KEPT_UNTIL_EXIT: list = []  # graphs and buffers of failed NCCL capture steps (capture_step)
_TORCH_DISTRIBUTED_DIR = os.path.join(
    os.path.dirname(os.path.abspath(torch.__file__)), "distributed"
)
T = TypeVar("T")


def tensor_parallel_group(model: torch.nn.Module, who: str = "tensor_parallel_group") -> Any:
    """The process group of a tensor-parallel model (parameters are ``DTensor``), else None.

    transformers' ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))``
    (and ``torch.distributed.tensor.parallel``) shard parameters as DTensors on a 1-D
    device mesh; its process group is the one the model's collectives run on.

    Example::

        >>> import torch
        >>> tensor_parallel_group(torch.nn.Linear(2, 2)) is None
        True

    ``who`` names the caller in errors (``PrefillRunner``): a model that is not a
    ``torch.nn.Module``, or one sharded on a mesh of more than one dimension.
    """
    if not isinstance(model, torch.nn.Module):  # not a bare AttributeError on .parameters
        raise InputError(f"{who}: model must be a torch.nn.Module, got {type(model).__name__}.")
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            mesh = parameter.device_mesh
            if mesh.ndim != 1:
                raise InputError(
                    f"{who}: parameters are sharded on a {mesh.ndim}-D device mesh; only "
                    f"tensor parallelism on a 1-D mesh is supported (shard the model for "
                    f"tensor parallelism alone: no FSDP or data-parallel mesh dimension)."
                )
            return mesh.get_group() if mesh.size() > 1 else None
    return None


def validate_timeout(value: Any, what: str) -> float:
    """``value`` as a float of seconds in (0, ``_LONGEST_TIMEOUT``], else an ``InputError``
    naming ``what``. gloo takes it as a ``timedelta``, then in microseconds in 64 bits: ``inf``
    and ``nan`` raised a raw ``OverflowError``/``ValueError``, 1e13 s gloo's "Invalid timeout".

    Example::

        >>> validate_timeout(float("inf"), "demo: timeout")
        Traceback (most recent call last):
        breakgraph.errors.InputError: demo: timeout must be a number of seconds above 0 and ...
    """
    seconds = validate_real(value, what)
    if not 0 < seconds <= _LONGEST_TIMEOUT:  # False for nan too
        raise InputError(
            f"{what} must be a number of seconds above 0 and at most {_LONGEST_TIMEOUT:g} "
            f"(about 31 years: for no practical limit), got {value!r}."
        )
    return seconds


class RankGroup:
    """The ranks that replay the same graphs and what they agree on (see the module doc).

    Args:
        group: the process group of the model's collectives (default: the world).
        timeout: seconds any exchange waits for the other ranks before raising
            :class:`~breakgraph.RankFailedError`. A capture step waits for the slowest
            rank's step, so leave room for compilation and large buckets.

    Build it on every rank, in the same order as the other process groups: creating it
    creates a gloo group, which is a collective call.
    """

    def __init__(self, group: Any = None, *, timeout: float = 300.0):
        import torch.distributed as dist

        timeout = validate_timeout(timeout, "RankGroup: timeout")
        if not (dist.is_available() and dist.is_initialized()):
            raise InputError(
                "RankGroup: torch.distributed is not initialised; call "
                "dist.init_process_group(...) first (torchrun sets its environment)."
            )
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(self.group)  # global ranks, in group order
        self.rank = dist.get_rank(self.group)  # this process's index in ``ranks``
        self._me = self.ranks[self.rank]  # its global rank, as messages name it
        self.timeout = float(timeout)
        backend = str(dist.get_backend(self.group))
        self.nccl = "nccl" in backend
        self._host_blocking = backend == "gloo"  # a gloo collective blocks the calling thread
        _destroy_dropped_groups()
        try:
            self._control = dist.new_group(
                self.ranks,
                backend="gloo",
                timeout=timedelta(seconds=timeout),
                use_local_synchronization=len(self.ranks) < dist.get_world_size(),
            )
        except dist.DistError as exc:  # a peer that never builds its own (it raised or exited)
            raise RankFailedError(
                f"RankGroup: not every rank of {self.ranks} created its RankGroup within "
                f"{timeout:g} s (rank {self._me} did): another rank raised before creating it "
                f"(see its error, e.g. a runner's argument refused there), exited or is blocked. "
                f"Build it on every rank at the same point; end the processes and restart."
            ) from exc
        # a RankGroup dropped without close() (its runner deleted, a CB model dropped while
        # enabled) hands its gloo group on when collected: else the group, its connections to
        # the other ranks and its threads stayed in torch.distributed's registry for good, one
        # more per runner built and dropped. Not at exit (torch tears its groups down itself).
        self._destroy = weakref.finalize(self, _DROPPED_GROUPS.append, self._control)
        self._destroy.atexit = False
        self._buffer = torch.zeros(3 + len(self.ranks), dtype=torch.int64)
        self._values = self._buffer.numpy()  # filled in place: no allocation per call
        self._broken: str | None = None

    def __repr__(self) -> str:
        state = f", broken: {self._broken}" if self._broken else ""
        return f"RankGroup(rank {self._me} of {self.ranks}, timeout={self.timeout:g} s{state})"

    # -- per call --------------------------------------------------------------------------
    def agree(
        self, size: int, fingerprint: int = 0, what: str = "inputs", fix: str | None = None
    ) -> int:
        """The largest ``size`` over all ranks, after checking that every ``fingerprint`` is equal.

        One all-reduce. Raises :class:`~breakgraph.RankMismatchError` on every rank if the
        fingerprints differ (``what`` names them, ``fix`` says what to do; by default: give
        every rank the same prompts), and :class:`~breakgraph.RankFailedError` if another
        rank reported a failure (:meth:`report_failure`) or did not answer within ``timeout``.
        ``size`` and ``fingerprint`` are ints of int64 (numpy's too); another value raises
        ``InputError`` here and ``RankFailedError`` on the others.
        """
        if not (type(size) is int and type(fingerprint) is int  # 0.1 us: the common case
                and -_INT64 < size < _INT64 and -_INT64 < fingerprint < _INT64):  # fmt: skip
            size, fingerprint = self._checked(size, fingerprint)
        agreed, same, failed = self._exchange(size, fingerprint, 0)
        if failed:
            raise RankFailedError(
                f"RankGroup.agree: rank(s) {failed} failed this call before it ran and told the "
                f"others; nothing ran on any rank. See the error on rank(s) {failed}."
            )
        if not same:
            raise RankMismatchError(
                f"RankGroup.agree: the ranks were given different {what} (rank {self._me} of "
                f"{self.ranks}; their fingerprints differ). With tensor parallelism every rank "
                f"must make the same call with the same inputs: "
                f"{fix or 'give all ranks the same prompts (e.g. broadcast them from rank 0)'}. "
                f"Nothing ran."
            )
        return agreed

    def agree_settings(self, who: str, settings: Mapping[str, Any]) -> None:
        """Check that every rank was built with the same ``settings`` (name -> value), before
        the first collective they shape. Raises :class:`~breakgraph.RankMismatchError` on
        every rank, naming each setting that differs.

        Call it in a runner's constructor, before anything exchanges data whose size or
        number depends on a setting: ranks that disagree there would send buffers of
        different sizes (gloo aborts the process) or wait for a collective that never comes.
        Two all-reduces on the host: the names, then one fingerprint per setting.

        Example (one rank)::

            >>> import torch.distributed as dist
            >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            >>> ranks = RankGroup()
            >>> ranks.agree_settings("MyRunner", {"max_prompts": 16, "warmup": 2})
            >>> ranks.close(); dist.destroy_process_group()
        """
        names = sorted(settings)
        # first the names (a different set would make the second exchange differ in size)
        self.agree(
            len(names),
            fingerprint(names),
            f"{who} settings",
            "build the runner with the same code and options on every rank",
        )
        digests = [fingerprint(plain_setting(settings[name])) for name in names]
        values = torch.tensor(digests + [-d for d in digests], dtype=torch.int64)
        self._all_reduce_max(values)
        n = len(names)
        differ = [name for i, name in enumerate(names) if values[i] != -values[n + i]]
        if differ:
            here = ", ".join(f"{name}={settings[name]!r}" for name in differ)
            raise RankMismatchError(
                f"{who}: the ranks were built with different {', '.join(differ)} (rank "
                f"{self._me} of {self.ranks} has {here}). Under tensor parallelism these "
                f"settings decide which collectives run, so every rank must use the same "
                f"values. Nothing ran."
            )

    def report_failure(self) -> None:
        """Take part in this call's exchange as failed, so the other ranks raise instead of
        waiting. The caller then raises its own error."""
        with contextlib.suppress(RankFailedError):
            self._exchange(0, 0, _PRIMARY)

    def before_eager(self) -> None:
        """Run before an eager forward that communicates. With NCCL it waits for the GPU, so no
        captured collective is still in flight when an eager one starts. That is required
        when ``NCCL_GRAPH_MIXING_SUPPORT=0`` and costs little on a path that is already slow."""
        if self.nccl:
            torch.cuda.synchronize()

    # -- capture phase ---------------------------------------------------------------------
    def capture_step(
        self,
        what: str,
        step: Callable[[], T],
        fingerprint: Callable[[T], int] | None = None,
        keep: Any = None,
    ) -> T:
        """Run one capture-phase step (a warm-up, a capture) on this rank, then check that it
        succeeded on every rank and, with ``fingerprint``, produced the same structure.

        If the step fails here, this rank tells the others and re-raises its own error. If it
        failed elsewhere, this rank raises :class:`~breakgraph.RankFailedError`. Either way the
        group is then broken, because the ranks' collective sequences have diverged: a later
        step (or a step on a closed group) raises ``RankFailedError`` without running. A rank
        blocked inside one of the model's gloo collectives is released within ``timeout / 2``:
        during the step the model group's own timeout is lowered to that and restored
        afterwards. NCCL collectives never block the host during capture, so no rank waits
        without bound.

        With NCCL the device is synchronised before the step and after a successful exchange
        (never before it: a rank whose peer failed would wait on its GPU forever), so no
        captured collective is in flight when the next eager one starts. A capture replays
        each segment as soon as it is captured, so a rank whose peer failed mid-capture has
        collectives spinning on its GPU that no peer will join. Nothing can stop those
        kernels (``ncclCommAbort`` itself hung on 2xH200 with graphs holding NCCL work), and
        any device sync would then wait forever, including the ``cudaFree`` that releasing a
        graph pool may issue. So on any failure with NCCL, ``keep`` (the step's graphs and
        buffers) is kept alive until the process exits: this rank raises at once and the
        process must end, which ``torchrun`` does when a rank raises.
        """
        if self._broken is not None or self._control is None:  # before the step, not after:
            raise self._unusable()  # it ran its collectives, and a failure blamed this rank
        if self.nccl:
            torch.cuda.synchronize()
        try:
            with self._model_collective_timeout(self.timeout / 2):
                result = step()
        except BaseException as exc:  # KeyboardInterrupt too: unreported, a peer blocked in a
            # collective with this rank raised gloo's raw error, its note blaming itself
            level = _COLLATERAL if _raised_by_a_collective(exc) else _PRIMARY
            try:
                _, _, failed = self._exchange(0, 0, level)
            except RankFailedError:
                failed = []
            self._broken = f"{what} failed on rank(s) {failed or [self._me]}"
            self.keep_until_exit(keep)
            if level == _COLLATERAL and failed and self._me not in failed:
                raise RankFailedError(
                    f"RankGroup: {what} failed on rank(s) {failed}, which cut off this rank's "
                    f"collectives ({type(exc).__name__}). End the processes and restart."
                ) from exc
            others = [r for r in failed if r != self._me]
            _add_note(
                exc,
                f"breakgraph: {what} failed on rank {self._me} of {self.ranks}"
                + (f" (and on {others})" if others else "; the other ranks raise RankFailedError")
                + ". The model's process group is no longer usable: end the processes.",
            )
            raise
        try:
            _, same, failed = self._exchange(0, fingerprint(result) if fingerprint else 0, 0)
        except RankFailedError:  # no answer (a peer exited): its collectives may never finish
            self.keep_until_exit(keep)
            raise
        if failed:
            self._broken = f"{what} failed on rank(s) {failed}"
            self.keep_until_exit(keep)
            raise RankFailedError(
                f"RankGroup: {what} failed on rank(s) {failed} (see the error there); rank "
                f"{self._me} stopped instead of waiting for their collectives. The model's "
                f"process group is no longer usable: end the processes and restart."
            )
        if not same:
            self._broken = f"{what} differed across ranks"
            self.keep_until_exit(keep)
            raise RankMismatchError(
                f"RankGroup: {what} produced different segments or breaks on different ranks, "
                f"so their replays would not run the same collectives. Every rank must run the "
                f"same model code with the same options."
            )
        if self.nccl:
            torch.cuda.synchronize()  # every rank launched the step's collectives: they finish
        return result

    def failed_mid_call(self, exc: BaseException, what: str) -> None:
        """Call it where ``exc`` escaped ``what`` (a replay or an eager forward) after the ranks
        agreed to run it, then re-raise: every later call raises ``RankFailedError`` at once.

        This rank may have run fewer of the call's collectives than the others, which then wait
        in the next one (with gloo until the model group's timeout, which closes its
        connections; with NCCL for ever). Left usable, the group paired the next calls, and
        every later call failed inside the model's collectives with raw gloo errors ("Connection
        closed by peer"). A collective that failed here (timed out, lost its peer) means another
        rank failed: this raises ``RankFailedError`` from ``exc``; else ``exc`` gets a note."""
        collateral = _raised_by_a_collective(exc)
        where = "another rank" if collateral else f"rank {self._me}"
        self._broken = f"{what} failed mid-call on {where}"
        advice = "The model's process group is no longer usable: end the processes and restart."
        if collateral:
            raise RankFailedError(
                f"{what}: a collective failed on rank {self._me} of {self.ranks} "
                f"({type(exc).__name__}): another rank failed during this call, after the ranks "
                f"agreed to run it (see the error there). {advice}"
            ) from exc
        _add_note(exc, f"breakgraph: {what} failed on rank {self._me} of {self.ranks} mid-call; "
                       f"the other ranks' collectives wait for it. {advice}")  # fmt: skip

    def check_graph_mixing(
        self, eager_collectives: bool, who: str = "RankGroup.check_graph_mixing"
    ) -> None:
        """Refuse eager collectives between captured ones when NCCL's graph mixing is off.

        ``NCCL_GRAPH_MIXING_SUPPORT=0`` (transformers' continuous batching sets it) is only
        correct if no eager NCCL call is issued while a graph launch with NCCL work is
        outstanding. Breaking at every all-reduce does exactly that. ``who`` names the caller
        and its setting in the error (``PrefillRunner(tp_collectives='eager')``).
        """
        if self.nccl and eager_collectives and os.environ.get("NCCL_GRAPH_MIXING_SUPPORT") == "0":
            raise InputError(
                f"{who}: eager collectives between captured segments need NCCL's graph "
                "mixing support, but NCCL_GRAPH_MIXING_SUPPORT=0. Unset it before "
                "init_process_group, or keep the collectives captured."
            )

    def close(self) -> None:
        """Destroy the gloo group this object created (the model's group is left alone), and
        those of RankGroups collected without close() (the next RankGroup made does too)."""
        alive, self._control = self._destroy.detach(), None  # None once closed or collected
        if alive is not None:
            _destroy_group(alive[2][0])
        _destroy_dropped_groups()

    # -- internals -------------------------------------------------------------------------
    def _checked(self, size: Any, fingerprint: Any) -> tuple[int, int]:
        """``agree``'s arguments as ints, else tell the others and raise. Raised unseen (numpy's
        OverflowError, a TypeError for None), this rank skipped the exchange and the others
        paired their call with its next one: every later call off by one, with wrong results."""
        for name, value in (("size", size), ("fingerprint", fingerprint)):
            integral = hasattr(value, "__index__") and not isinstance(value, bool)
            if not integral or not -_INT64 < int(value) < _INT64:
                self.report_failure()
                raise InputError(
                    f"RankGroup.agree: {name} must be an int of int64 (a fingerprint as "
                    f"breakgraph.distributed.fingerprint(...) makes), got {value!r}; the other "
                    f"ranks raise RankFailedError, and nothing ran."
                )
        return int(size), int(fingerprint)

    def _exchange(self, size: int, digest: int, failed: int) -> tuple[int, bool, list[int]]:
        if self._broken is not None or self._control is None:
            raise self._unusable()
        values = self._values
        values[:] = 0
        values[0], values[1], values[2] = size, digest, -digest
        values[3 + self.rank] = failed
        self._all_reduce_max(self._buffer)
        flags = values[3:]
        worst = flags.max()
        failed_ranks = [r for r, flag in zip(self.ranks, flags) if worst and flag == worst]
        return int(values[0]), bool(values[1] == -values[2]), failed_ranks

    def _unusable(self) -> RankFailedError:
        """The error of a group that a failure broke, or that was closed."""
        if self._broken is not None:
            return RankFailedError(
                f"RankGroup: {self._broken} earlier; the ranks' collective sequences have "
                f"diverged, so this group cannot be used any more. End the processes and restart."
            )
        return RankFailedError("RankGroup: closed by close(); build a new RankGroup.")

    def _all_reduce_max(self, buffer: torch.Tensor) -> None:
        """``buffer`` (int64, on the host) becomes its element-wise maximum over the ranks."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d  # never all_reduce_as_breaks' wrapper

        start = time.monotonic()  # ~50 ns against the all-reduce's ~15 us (gloo, one rank)
        try:
            distributed_c10d.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self._control)
        except Exception as exc:  # gloo's timeout, or a rank that closed its group or exited
            seconds = time.monotonic() - start
            if seconds < 0.9 * self.timeout:  # not a timeout: the collective lost a peer
                said = str(exc).split(". ")[0].splitlines()[0][:200] if str(exc) else repr(exc)
                self._broken = (
                    f"the exchange with the other ranks failed after {seconds:.1f} s, before "
                    f"the {self.timeout:g} s timeout ({said})"
                )
                why = ("another rank closed its RankGroup (close(), or its runner's after a "
                       "failure: see that rank's error) or its process exited")  # fmt: skip
            else:
                self._broken = f"no answer from every rank within {self.timeout:g} s"
                why = "another rank failed, exited or is blocked"
            raise RankFailedError(
                f"RankGroup: {self._broken} (rank {self._me} of {self.ranks}): {why}. End the "
                f"processes and restart."
            ) from exc

    @property
    def keeps_memory(self) -> bool:
        """True once a step failed with NCCL: graphs must not be freed (see capture_step)."""
        return self.nccl and self._broken is not None

    def keep_until_exit(self, keep: Any) -> None:
        """With NCCL, never free what a failed capture step touched (see capture_step).
        A snapshot: the owner may clear its own containers later."""
        if self.nccl and keep is not None:
            _KEPT_UNTIL_EXIT.append(_snapshot(keep))

    @contextlib.contextmanager
    def _model_collective_timeout(self, seconds: float) -> Iterator[None]:
        """Bound how long the model's gloo collectives block the host (scoped, restored)."""
        try:
            previous = self.group._get_backend(torch.device("cpu")).options._timeout
        except Exception:  # not gloo, or a torch without these accessors: leave it alone
            previous = None
        if not self._host_blocking or previous is None:
            yield
            return
        self.group.set_timeout(timedelta(seconds=seconds))
        try:
            yield
        finally:
            self.group.set_timeout(previous)


#: gloo groups of RankGroups collected without close(), destroyed by the next RankGroup made or
#: closed: a collection runs on any thread at any allocation, maybe inside torch.distributed's
#: code editing the registry that destroying a group edits
_DROPPED_GROUPS: list = []


def _destroy_dropped_groups() -> None:
    while _DROPPED_GROUPS:
        _destroy_group(_DROPPED_GROUPS.pop())


def _destroy_group(control: Any) -> None:
    """Destroy a RankGroup's own gloo group."""
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(ValueError, RuntimeError):  # already destroyed with WORLD
            dist.destroy_process_group(control)


def release_graphs(graphs: Iterable[Any], ranks: RankGroup | None) -> None:
    """Reset ``graphs`` (a runner's ``close()``), unless ``ranks`` saw a failed NCCL capture
    step: then keep them until the process exits (see :meth:`RankGroup.capture_step`)."""
    if ranks is not None and ranks.keeps_memory:
        _KEPT_UNTIL_EXIT.append(tuple(graphs))
        return
    refused = None  # every graph it can: one refused (replaying on another thread) stops none
    for graph in graphs:
        try:
            graph.reset()
        except Exception as exc:
            refused = refused or exc
    if refused is not None:
        raise refused


def _snapshot(keep: Any) -> Any:
    """``keep`` with its dicts and lists copied (their values, not the containers, are kept)."""
    if isinstance(keep, dict):
        return tuple(keep.values())
    if isinstance(keep, (list, tuple)):
        return tuple(_snapshot(item) for item in keep)
    return keep


def _raised_by_a_collective(exc: BaseException) -> bool:
    """Whether ``exc`` came out of torch.distributed (a collective timed out or lost its peer),
    i.e. this rank was cut off by another rank's failure rather than failing by itself.
    gloo raises a plain RuntimeError, so the innermost frame decides."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and _TORCH_DISTRIBUTED_DIR in os.path.abspath(
        tb.tb_frame.f_code.co_filename
    )


def _add_note(exc: BaseException, text: str) -> None:
    """PEP 678's note, which tracebacks print from Python 3.11. On 3.10 the note goes into
    ``__notes__`` as 3.11 keeps it (for code that reads it) and is also warned, since 3.10's
    traceback does not print it."""
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(text)
        return
    exc.__notes__ = [*getattr(exc, "__notes__", []), text]
    warnings.warn(text, RuntimeWarning, stacklevel=3)
