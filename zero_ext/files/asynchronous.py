"""The writing half of a save, now or in the background, for either format.

A save is three steps: inputs checked on every rank (the caller, before a
Job exists); every rank writes its files into the staging directory
(`Job.write`, no collectives); rank 0 checks what all wrote and publishes
the directory in one atomic step (`Job.publish`). `run_now` ends each step
on every rank through Ranks.settle, as every collective of zero_ext does.

`run_async` returns an AsyncSave at once. The state was staged by the
caller (a copy of what this rank writes into reusable host buffers,
`Stager`: pinned where tensors live on a GPU, so the copy is a DMA); a
thread per rank writes the files, then the ranks exchange their reports
and the outcome over a gloo group of their own (created once per set of
ranks), never over the model's group, which training keeps using. The
save is published when every rank's thread is done; `wait()` returns then
or raises the failure on every rank. The thread is not a daemon: a process
exiting with a save in flight finishes it first; a process killed leaves
the staging directory unpublished and the previous checkpoint in place.
The next save on the same model waits for the last (and raises its error).
"""
from __future__ import annotations

import datetime
import os
import threading
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..tools import faults

_ALIGN = 64
_EXCHANGE_TIMEOUT = datetime.timedelta(minutes=30)


class Job:
    """One save's writing half on this rank."""

    def __init__(self, rank: int, write: Callable[[], Any],
                 publish: Callable[[List[Any]], Tuple[Optional[BaseException], str]],
                 abandon: Callable[[], None], action: str, note: str):
        self.rank = rank
        self.write = write  # this rank's files into the staging directory; returns its report
        self.publish = publish  # rank 0, all reports in hand: (error, what became of the directories)
        self.abandon = abandon  # rank 0: remove the staging directory (every rank has stopped writing)
        self.action = action
        self.note = note  # what a write failure leaves behind


def run_now(job: Job, ranks) -> None:
    error, report = None, None
    try:
        report = job.write()
    except Exception as e:  # noqa: BLE001 - raised on every rank by settle
        error = e
    faults.exit_if_armed("after_shards", ranks.rank)
    reports = ranks.settle(error, report, action=job.action, note=job.note,
                           on_failure=job.abandon if ranks.rank == 0 else None)
    error, note = (job.publish(reports) if ranks.rank == 0 else (None, ""))
    ranks.settle(error, action=job.action.replace("writing", "publishing"), note=note)


class AsyncSave:
    """A save in flight: `wait()` blocks until it is published (or raises
    why not, on every rank); `done()` says whether it has finished."""

    def __init__(self, job: Job, ranks, group, state):
        self._job = job
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(ranks.world, group),
                                        name=f"zero_ext-async-save-{job.rank}", daemon=False)
        self._thread.start()
        state.async_save = self

    def _run(self, world: int, group) -> None:
        job = self._job
        _yield_to_training()
        report, failure = None, None
        try:
            report = job.write()
            faults.exit_if_armed("async_after_write", job.rank)
        except BaseException as e:  # noqa: BLE001 - reported to every rank below
            failure = (type(e).__name__, str(e), job.note)
        try:
            outcomes = _gather((failure, report), job.rank, world, group)
            failed = [(r, f) for r, (f, _) in enumerate(outcomes) if f is not None]
            if failed:
                if job.rank == 0:
                    job.abandon()
                rank, (kind, message, note) = failed[0]
                self._error = RuntimeError(f"{job.action} failed on rank {rank}: {kind}: {message}. {note}".rstrip())
                return
            outcome = None
            if job.rank == 0:
                error, note = job.publish([r for _, r in outcomes])
                outcome = None if error is None else f"{type(error).__name__}: {error}. {note}".rstrip()
            outcome = _from_rank0(outcome, group)
            if outcome is not None:
                self._error = RuntimeError(f"{job.action.replace('writing', 'publishing')} failed on rank 0: {outcome}")
        except BaseException as e:  # noqa: BLE001 - a peer died or the exchange failed
            self._error = RuntimeError(f"{job.action}: the ranks could not agree on the outcome ({e}); the previous "
                                       "checkpoint, if any, is untouched unless rank 0 published this one")

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until the save is published; raises its error (on every rank)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._job.action} is still running after {timeout} s")
        if self._error is not None:
            raise self._error


def _yield_to_training() -> None:
    """The writer thread runs at the lowest CPU priority (Linux: a thread's
    own nice value): where training keeps every core busy, the write takes
    the time training leaves (waits in collectives, data loading) instead of
    slowing its steps; with a core to spare it changes nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: an ordinary thread
        pass


def wait_for_previous(state) -> None:
    """Before a save (or load) of this model: the last async save finished
    (its error, if any, raised here, on every rank alike)."""
    previous, state.async_save = getattr(state, "async_save", None), None
    if previous is not None:
        previous.wait()


def _gather(obj: Any, rank: int, world: int, exchange: Optional[ExchangeGroup]) -> List[Any]:
    """Every rank's `obj`, by the save's rank."""
    if exchange is None:
        return [obj]
    out: List[Any] = [None] * world
    dist.all_gather_object(out, (rank, obj), group=exchange.group)
    by_rank = dict(out)
    return [by_rank[r] for r in range(world)]


def _from_rank0(obj: Any, exchange: Optional[ExchangeGroup]) -> Any:
    if exchange is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=exchange.members[0], group=exchange.group)
    return box[0]


class ExchangeGroup:
    """A gloo group over one model's save ranks for its writer threads: its
    own (two models' saves in flight at once never share one, where gloo
    would pair one's collective with the other's), created on the model's
    first asynchronous save (collective on its ranks). `members[r]` is the
    global rank of the save's rank r (Ranks' numbering, which is not the
    group's own order under tensor parallelism)."""

    def __init__(self, ranks):
        self.members = list(ranks.gather(dist.get_rank()))
        self.group = dist.new_group(ranks=sorted(self.members), backend="gloo", timeout=_EXCHANGE_TIMEOUT,
                                    use_local_synchronization=True)


def exchange_group(ranks, state) -> Optional[ExchangeGroup]:
    """The model's exchange group (made at its first asynchronous save); None alone."""
    if not ranks.distributed:
        return None
    if state.save_exchange is None:
        state.save_exchange = ExchangeGroup(ranks)
    return state.save_exchange


class Stager:
    """Reusable host buffers that hold a snapshot of what a rank saves:
    grown when a save needs more, pinned when the state is on a GPU."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None

    def stage(self, tensors: List[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        total, offsets = 0, {}
        for t in tensors:
            if id(t) not in offsets:
                offsets[id(t)] = total
                total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        pin = any(t.is_cuda for t in tensors) and torch.cuda.is_available()
        if self.buffer is None or self.buffer.numel() < total or (pin and not self.buffer.is_pinned()):
            self.buffer = None
            self.buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        copies = {}
        for t in tensors:
            if id(t) in copies:
                continue
            at, n = offsets[id(t)], t.numel() * t.element_size()
            # A storage of exactly its own bytes (a slice of the buffer's): torch.save
            # (DCP's items) writes a tensor's whole storage, so a view would write the buffer.
            copy = (torch.empty(0, dtype=t.dtype).set_(self.buffer.untyped_storage()[at:at + n], 0, t.shape)
                    if n else torch.empty(t.shape, dtype=t.dtype))
            copy.copy_(t, non_blocking=pin)
            copies[id(t)] = copy
        if pin:
            torch.cuda.synchronize()
        return lambda t: copies[id(t)]


def stager_of(state) -> Stager:
    found = getattr(state, "save_stager", None)
    if found is None:
        found = state.save_stager = Stager()
    return found
