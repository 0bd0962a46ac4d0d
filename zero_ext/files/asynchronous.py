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
reports and the outcome through the job's store (Exchange), never over the
model's group, which training keeps using. The save is published when
every rank's thread is done; `wait()` returns then or raises the failure on
every rank. The next save on the same model waits for the last (and raises
its error).

[Note: an asynchronous save at exit] The writer thread is a daemon, and
an exit handler waits for the saves in flight: a process that ends (its
script done, or an uncaught error) finishes its save first, while a peer
that died cannot hold it. A rank waiting in the exchange for a peer
watches that peer's heartbeat (a counter in the store its save bumps every
BEAT_S): silent for SILENCE_S, the peer is gone, the save fails with that
said, and the process exits within seconds of its own error instead of at
the timeout. A process killed leaves the staging directory unpublished and
the previous checkpoint in place. The store is called quietly (the core's
QuietStore): a store whose host (rank 0) died raises zero_ext's error, not
c10d's warning with a C++ stack trace.
"""
from __future__ import annotations

import atexit
import base64
import datetime
import os
import pickle
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..tools import faults

_ALIGN = 64
_EXCHANGE_TIMEOUT = datetime.timedelta(minutes=30)  # where the model's group has no timeout to borrow
BEAT_S = 0.25  # a rank's save shows it is alive this often
SILENCE_S = 5.0  # a peer whose heartbeat stood still this long is gone ([Note: an asynchronous save at exit])
_POLL_S = 0.05
_IN_FLIGHT: "List[AsyncSave]" = []
_IN_FLIGHT_LOCK = threading.Lock()


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
        self._exchange = exchange
        self._thread = threading.Thread(target=self._run, name=f"zero_ext-async-save-{job.rank}", daemon=True)
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[:] = [s for s in _IN_FLIGHT if not s.done()] + [self]
        exchange.start_heartbeat()
        self._thread.start()
        state.async_save = self

    def _run(self) -> None:
        job, exchange = self._job, self._exchange
        try:
            _yield_to_training()
            self._error = _write_and_agree(job, exchange)
        finally:
            exchange.stop_heartbeat()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until the save is published; raises its error (on every rank)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._job.action} is still running after {timeout} s")
        if self._error is not None:
            raise self._error

    def finish_at_exit(self) -> None:
        """At interpreter exit: waits for the thread, which ends by itself
        (published, failed, or a peer found gone), within the exchange's
        timeout at most."""
        self._thread.join(self._exchange.timeout.total_seconds() + SILENCE_S)


def _write_and_agree(job: Job, exchange: Exchange) -> Optional[RuntimeError]:
    """This rank's files, then the exchange of reports and outcome; the error
    every rank raises from wait(), or None once published."""
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
        return RuntimeError(message) if message is not None else None
    except PeerGone as e:  # the others must not wait for it either
        if exchange.rank == 0:
            job.abandon()  # the gone rank writes no more; nothing is published
            try:
                exchange.outcome(f"{job.action} failed: {e}. Nothing was published; the previous checkpoint, "
                                 "if any, is untouched")
            except Exception:  # noqa: BLE001 - the others find rank 0 gone or silent by themselves
                pass
        return RuntimeError(f"{job.action} failed: {e}. Nothing was published; the previous checkpoint, if any, "
                            "is untouched")
    except BaseException as e:  # noqa: BLE001 - the store is gone (rank 0 died) or the exchange failed
        return RuntimeError(f"{job.action}: the ranks could not agree on the outcome ({e}); the previous "
                            "checkpoint, if any, is untouched unless rank 0 published this one")


@atexit.register
def _finish_saves_in_flight() -> None:
    """[Note: an asynchronous save at exit]: the daemon writer threads end
    before the interpreter finalizes, never inside a store call."""
    with _IN_FLIGHT_LOCK:
        saves = list(_IN_FLIGHT)
    for save in saves:
        save.finish_at_exit()


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


class PeerGone(RuntimeError):
    """A rank the exchange waits for showed no sign of life for SILENCE_S."""


class Exchange:
    """How the writer threads of one save agree, without a collective: through
    the job's store (the world group's, called quietly: QuietStore), under keys
    of this save's token. Each rank posts its report; save rank 0 waits for
    all of them, publishes (or not) and posts the outcome; the others wait for
    it. While its save runs, each rank bumps a heartbeat counter; a rank
    waiting for a peer whose counter stood still for SILENCE_S gives up on it
    (PeerGone). No process group is made or used: the model's group stays
    training's, two saves in flight never pair their messages, and no rank
    creates a group another does not (torch derives later groups' names from
    how many each rank has made)."""

    def __init__(self, ranks, token: str, timeout: Optional[datetime.timedelta]):
        self.rank, self.world = ranks.rank, ranks.world
        self.store = None
        if ranks.distributed:
            from ..tools import core_loader
            self.store = core_loader.QuietStore(dist.group.WORLD.group_name)
        self.prefix = f"zero_ext/async_save/{token}/"
        # A peer that lives but never posts: wait as long as the model's collectives would.
        self.timeout = timeout or _EXCHANGE_TIMEOUT
        self._beating = threading.Event()
        self._heart: Optional[threading.Thread] = None

    def start_heartbeat(self) -> None:
        if self.store is None:
            return
        key, store, beating = f"{self.prefix}alive{self.rank}", self.store, self._beating
        beating.set()

        def beat() -> None:
            while beating.is_set():
                try:
                    store.add(key, 1)
                except Exception:  # noqa: BLE001 - the store is gone: the exchange finds out too
                    return
                time.sleep(BEAT_S)

        self._heart = threading.Thread(target=beat, name=f"zero_ext-async-save-heartbeat-{self.rank}", daemon=True)
        self._heart.start()

    def stop_heartbeat(self) -> None:
        self._beating.clear()
        if self._heart is not None:
            self._heart.join(timeout=5.0)  # one store call at most

    def reports(self, mine: Any) -> Optional[List[Any]]:
        """Posts this rank's report; save rank 0 gets every rank's (others None)."""
        if self.store is None:
            return [mine]
        self.store.set(f"{self.prefix}report{self.rank}", _encode(mine))
        if self.rank != 0:
            return None
        keys = {r: f"{self.prefix}report{r}" for r in range(self.world)}
        self._wait_for(keys)
        out = [_decode(self.store.get(keys[r])) for r in range(self.world)]  # written by this job's ranks only
        for key in keys.values():
            self.store.delete_key(key)  # a long training saves many times: the store keeps no old reports
        return out

    def outcome(self, decided: Any) -> Any:
        """Save rank 0's outcome, on every rank."""
        if self.store is None:
            return decided
        key = f"{self.prefix}outcome"
        if self.rank == 0:
            self.store.set(key, _encode(decided))
            return decided
        self._wait_for({0: key})
        return _decode(self.store.get(key))

    def _wait_for(self, keys: "dict[int, str]") -> None:
        """Until every rank's key is posted; raises PeerGone for a rank whose
        heartbeat stood still for SILENCE_S, TimeoutError past the timeout."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        beats: "dict[int, Tuple[int, float]]" = {}
        while True:
            missing = [r for r, key in keys.items() if not self.store.check([key])]
            if not missing:
                return
            now = time.monotonic()
            for r in missing:
                count = self.store.add(f"{self.prefix}alive{r}", 0)
                last = beats.get(r)
                if last is None or last[0] != count:
                    beats[r] = (count, now)
                elif now - last[1] > SILENCE_S:
                    raise PeerGone(f"rank {r} stopped answering (no sign of life from its save for {SILENCE_S:g} s: "
                                   "its process died, or hangs)")
            if now > deadline:
                raise TimeoutError(f"ranks {missing} did not finish their part within {self.timeout}")
            time.sleep(_POLL_S)


def _encode(value: Any) -> str:
    return base64.b64encode(pickle.dumps(value)).decode("ascii")


def _decode(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))


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
