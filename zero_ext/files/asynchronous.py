"""The writing half of a save, now or in the background, for either format.

A save is three steps: inputs checked on every rank (the caller, before a
Job exists); every rank writes its files into the staging directory
(`Job.write`, no collectives); rank 0 checks what all wrote and publishes
the directory in one atomic step (`Job.publish`). `run_now` ends each step
on every rank through Ranks.settle, as every collective of zero_ext does.

An asynchronous save is an AsyncSave, returned at once, once the ranks
have agreed and what this rank writes is listed (`Snapshot`). A thread per
rank first copies the large tensors of that list into reusable host
buffers (`Stager`: pinned where tensors live on a GPU, so the copy is a
DMA) and sets the save's `snapshot_taken` event, which whatever writes
those tensors waits for (tools/snapshot_gate.py, [Note: the snapshot of an
asynchronous save]); only then does it lower its priority and write the
files; then the ranks exchange their reports and the outcome through the
job's store (Exchange), never over the model's group, which training keeps
using. The save is published when every rank's thread is done; `wait()`
returns then or raises the failure on every rank. The next save on the same
model waits for the last (and raises its error).

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
from typing import Any, Callable, Dict, List, Optional, Tuple

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
                 abandon: Callable[[], None], action: str, note: str,
                 take: Optional[Callable[[], None]] = None):
        self.rank = rank
        self.take = take  # asynchronous: the snapshot's deferred copy (Snapshot.take), before write
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
    why not, on every rank); `done()` says whether it has finished;
    `wait_for_snapshot()` until its snapshot is taken (after which the
    state may change freely)."""

    def __init__(self, job: Job, exchange: Exchange, state):
        self._job = job
        self._error: Optional[BaseException] = None
        self._exchange = exchange
        # Set once the writer thread has copied what the save defers (or
        # failed to): [Note: the snapshot of an asynchronous save].
        self.snapshot_taken = threading.Event()
        if job.take is None:  # nothing deferred (offload to files: copied at the call)
            self.snapshot_taken.set()
        self.snapshot_s = 0.0  # how long the deferred copy took, in the writer thread
        self.snapshot_wait_s = 0.0  # how long zero_ext's calls (a step, ...) waited for it: stall
        self._thread = threading.Thread(target=self._run, name=f"zero_ext-async-save-{job.rank}", daemon=True)
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[:] = [s for s in _IN_FLIGHT if not s.done()] + [self]
        exchange.start_heartbeat()
        state.async_save = self
        self._thread.start()

    def _run(self) -> None:
        job, exchange = self._job, self._exchange
        try:
            failure = None
            try:  # the snapshot first, at the thread's ordinary priority: a step may be waiting for it
                if job.take is not None:
                    faults.pause_if_armed("async_slow_snapshot", job.rank)
                    start = time.perf_counter()
                    job.take()
                    self.snapshot_s = time.perf_counter() - start
            except BaseException as e:  # noqa: BLE001 - reported to every rank by the exchange
                failure = (type(e).__name__, str(e), job.note)
            finally:
                self.snapshot_taken.set()
            _yield_to_training()
            self._error = _write_and_agree(job, exchange, failure)
        finally:
            self.snapshot_taken.set()
            exchange.stop_heartbeat()

    def wait_for_snapshot(self) -> None:
        """Blocks until this save's snapshot is taken (never raises its
        error: that is wait()'s)."""
        if self.snapshot_taken.is_set():
            return
        start = time.perf_counter()
        while not self.snapshot_taken.wait(_POLL_S) and self._thread.is_alive():
            pass
        self.snapshot_wait_s += time.perf_counter() - start

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


def _write_and_agree(job: Job, exchange: Exchange, failure: Optional[tuple] = None) -> Optional[RuntimeError]:
    """This rank's files (unless its snapshot already failed: `failure`),
    then the exchange of reports and outcome; the error every rank raises
    from wait(), or None once published."""
    report = None
    try:
        if failure is None:
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
    """Once its snapshot is taken, the writer thread runs at the lowest CPU
    priority (Linux: a thread's own nice value): where training keeps every
    core busy, the write takes the time training leaves (waits in
    collectives, data loading) instead of slowing its steps; with a core to
    spare it changes nothing. The snapshot before it runs at the process's
    own priority: the next step waits for it, so it is training's work
    (an unprivileged thread can lower its priority, never raise it back,
    hence this order)."""
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
    grown when a save needs more, pinned when the state is on a GPU. One
    save of a model uses them at a time (the next save waits for the last)."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None

    def snapshot(self, entries: List[Tuple[torch.Tensor, str, bool]],
                 watched: List[Tuple[torch.Tensor, str]], defer: bool) -> "Snapshot":
        """What a save writes, (tensor, what it is, deferrable); `watched`:
        tensors whose in-place change would change a deferred one (the
        parameters, where they share its storage). `defer` False: every
        tensor is copied now (offload to files)."""
        return Snapshot(self, entries, watched, defer)

    def copy_into_buffer(self, tensors: List[torch.Tensor], events: "Dict[Any, Any]") -> "Dict[int, torch.Tensor]":
        """{id: copy} of each tensor, in the buffer (grown, or pinned, if it
        must be). `events`: per CUDA device, an event recorded where the
        tensors were last written (the save's call): the copy waits for it
        on a stream of its own and is complete when this returns."""
        total, offsets = 0, {}
        for t in tensors:
            if id(t) not in offsets:
                offsets[id(t)] = total
                total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        pin = any(t.is_cuda for t in tensors) and torch.cuda.is_available()
        if self.buffer is None or self.buffer.numel() < total or (pin and not self.buffer.is_pinned()):
            self.buffer = None
            self.buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        streams = {}
        if pin:
            for device, event in events.items():
                stream = streams[device] = torch.cuda.Stream(device)
                stream.wait_event(event)
        copies: "Dict[int, torch.Tensor]" = {}
        unordered = False  # a copy on the calling thread's current stream
        for t in tensors:
            if id(t) in copies:
                continue
            at, n = offsets[id(t)], t.numel() * t.element_size()
            # A storage of exactly its own bytes (a slice of the buffer's): torch.save
            # (DCP's items) writes a tensor's whole storage, so a view would write the buffer.
            copy = (torch.empty(0, dtype=t.dtype).set_(self.buffer.untyped_storage()[at:at + n], 0, t.shape)
                    if n else torch.empty(t.shape, dtype=t.dtype))
            stream = streams.get(t.device) if t.is_cuda else None
            if stream is not None:
                t.record_stream(stream)
                with torch.cuda.stream(stream):
                    copy.copy_(t, non_blocking=True)
            else:
                copy.copy_(t, non_blocking=pin)
                unordered = unordered or t.is_cuda
            copies[id(t)] = copy
        for stream in streams.values():
            stream.synchronize()  # these copies only, not the work training queued since
        if unordered:
            torch.cuda.synchronize()
        return copies


def _small_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a tensor taken at the call: its own storage, contiguous."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())


class Snapshot:
    """What one asynchronous save writes on this rank, as copies: the small
    tensors and those a forward may change (buffers) copied at the call,
    the large ones (parameter shards, masters, optimizer state) by `take()`
    in the writer thread before it writes a file ([Note: the snapshot of an
    asynchronous save]). `copy(t)` is the copy of `t` (after take())."""

    def __init__(self, stager: Stager, entries: List[Tuple[torch.Tensor, str, bool]],
                 watched: List[Tuple[torch.Tensor, str]], defer: bool):
        self._stager = stager
        self._copies: "Dict[int, torch.Tensor]" = {}
        self._deferred: List[Tuple[torch.Tensor, str, int]] = []
        now: List[torch.Tensor] = []
        seen = set()
        for t, what, deferrable in entries:
            if id(t) in seen:
                continue
            seen.add(id(t))
            if defer and deferrable:
                self._deferred.append((t, what, t._version))
            else:
                now.append(t)
        self._events: "Dict[Any, Any]" = {}
        if defer:
            self._copies.update((id(t), _small_copy(t)) for t in now)
            self._watched = [(t, what, t._version) for t, what in watched] if self._deferred else []
            if torch.cuda.is_available():  # where the deferred tensors were last written: the copy waits for it
                for device in {t.device for t, _, _ in self._deferred if t.is_cuda}:
                    self._events[device] = torch.cuda.current_stream(device).record_event()
        else:
            self._copies.update(stager.copy_into_buffer(now, {}))
            self._watched = []

    @property
    def deferred(self) -> int:
        """How many tensors take() copies."""
        return len(self._deferred)

    def take(self) -> None:
        """Copies the deferred tensors (writer thread); raises where one of
        them, or a watched tensor, changed in place since the call."""
        if not self._deferred:
            return
        try:
            self._copies.update(self._stager.copy_into_buffer([t for t, _, _ in self._deferred], self._events))
            changed = list(dict.fromkeys(what for t, what, version in self._deferred + self._watched
                                         if t._version != version))
        finally:  # the live tensors are not held past the copy (the handle lives until the next save)
            self._deferred, self._watched, self._events = [], [], {}
        if changed:
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            raise RuntimeError(
                f"{shown} changed in place after this asynchronous save was called and before its snapshot was "
                "taken, so the checkpoint would not hold the state at the call; the save was abandoned. Change "
                "parameters or optimizer state after the next optimizer.step() (it waits for the snapshot), after "
                "handle.wait_for_snapshot() or handle.wait(), or inside zero_ext.full_params(model, "
                "writeback=True), which waits too")

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        return self._copies[id(t)]


def may_defer(state) -> bool:
    """Whether a save may copy its large tensors after its call: not where
    they live in offload files (offload_*="nvme"), in memory only for the
    duration of the save's call ([Note: the snapshot of an asynchronous save])."""
    return not state.handles.offload.swapped()


def watched_parameters(model, state) -> List[Tuple[torch.Tensor, str]]:
    """The parameters whose in-place change changes what a save writes
    without touching the version of the shard views it holds (stages 0-2
    without fp32 masters: the parameters are views of the flat buffer the
    shards are cut from). With masters the save writes the masters, which a
    parameter's change leaves alone; at stage 3 parameters hold no values
    between uses."""
    if state.handles.optimizer.has_masters() or state.params_sharded:
        return []
    return [(p, f"parameter '{n}'") for n, p in model.named_parameters()]


def stager_of(state) -> Stager:
    found = getattr(state, "save_stager", None)
    if found is None:
        found = state.save_stager = Stager()
    return found
