"""The writing half of a save, now or in the background, for either format.

A save is three steps: inputs checked on every rank (the caller, before a
Job exists); every rank writes its files into the staging directory
(`Job.write`, no collectives); rank 0 checks what all wrote and publishes
the directory in one atomic step (`Job.publish`). `run_now` ends each step
on every rank through Ranks.settle, as every collective of zero_ext does.

An asynchronous save is an AsyncSave, returned at once. The state was
staged by the caller (a copy of what this rank writes into reusable host
buffers, `Stager`: pinned where tensors live on a GPU, so the copy is a
DMA); a thread per rank writes the files, then the ranks exchange their
reports and the outcome through the rendezvous store (Exchange), never
over the model's group, which training keeps using. The save is
published when every rank's thread is done; `wait()` returns then
or raises the failure on every rank. The thread is not a daemon: a process
exiting with a save in flight finishes it first; a process killed leaves
the staging directory unpublished and the previous checkpoint in place.
The next save on the same model waits for the last (and raises its error).
"""
from __future__ import annotations

import datetime
import os
import pickle
import threading
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..tools import faults

_ALIGN = 64
_EXCHANGE_TIMEOUT = datetime.timedelta(minutes=30)  # where the model's group has no timeout to borrow


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

    def __init__(self, job: Job, exchange: Exchange, state):
        self._job = job
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(exchange,),
                                        name=f"zero_ext-async-save-{job.rank}", daemon=False)
        self._thread.start()
        state.async_save = self

    def _run(self, exchange: Exchange) -> None:
        job = self._job
        _yield_to_training()
        report, failure = None, None
        try:
            report = job.write()
            faults.exit_if_armed("async_after_write", job.rank)
        except BaseException as e:  # noqa: BLE001 - reported to every rank below
            failure = (type(e).__name__, str(e), job.note)
        try:
            outcomes = exchange.reports((failure, report))
            message = None
            if outcomes is not None:  # save rank 0: every rank's report in hand
                failed = [(r, f) for r, (f, _) in enumerate(outcomes) if f is not None]
                if failed:
                    job.abandon()
                    rank, (kind, text, note) = failed[0]
                    message = f"{job.action} failed on rank {rank}: {kind}: {text}. {note}".rstrip()
                else:
                    error, note = job.publish([r for _, r in outcomes])
                    if error is not None:
                        message = (f"{job.action.replace('writing', 'publishing')} failed on rank 0: "
                                   f"{type(error).__name__}: {error}. {note}".rstrip())
            message = exchange.outcome(message)
            if message is not None:
                self._error = RuntimeError(message)
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


class Exchange:
    """How the writer threads of one save agree, without a collective: through
    the job's rendezvous store (torch.distributed's default store, which every
    rank shares), under keys of this save's token. Each rank posts its report;
    save rank 0 waits for all of them, publishes (or not) and posts the
    outcome; the others wait for it. No process group is made or used: the
    model's group stays training's, two saves in flight never pair their
    messages, and no rank creates a group another does not (torch derives
    later groups' names from how many each rank has made)."""

    def __init__(self, ranks, token: str, timeout: Optional[datetime.timedelta]):
        self.rank, self.world = ranks.rank, ranks.world
        self.store = dist.distributed_c10d._get_default_store() if ranks.distributed else None
        self.prefix = f"zero_ext/async_save/{token}/"
        # A peer that died never posts: wait as long as the model's collectives would.
        self.timeout = timeout or _EXCHANGE_TIMEOUT

    def reports(self, mine: Any) -> Optional[List[Any]]:
        """Posts this rank's report; save rank 0 gets every rank's (others None)."""
        if self.store is None:
            return [mine]
        self.store.set(f"{self.prefix}report{self.rank}", pickle.dumps(mine))
        if self.rank != 0:
            return None
        keys = [f"{self.prefix}report{r}" for r in range(self.world)]
        self.store.wait(keys, self.timeout)
        out = [pickle.loads(self.store.get(k)) for k in keys]  # written by this job's ranks only
        for k in keys:
            _forget(self.store, k)
        return out

    def outcome(self, decided: Any) -> Any:
        """Save rank 0's outcome, on every rank."""
        if self.store is None:
            return decided
        key = f"{self.prefix}outcome"
        if self.rank == 0:
            self.store.set(key, pickle.dumps(decided))
            return decided
        self.store.wait([key], self.timeout)
        return pickle.loads(self.store.get(key))


def _forget(store, key: str) -> None:
    try:
        store.delete_key(key)
    except Exception:  # noqa: BLE001 - a store without deletion keeps a few bytes
        pass


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
