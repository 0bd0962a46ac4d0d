"""wrap()'s bounded wait for every rank to reach it, before its first
collective (see [Note: arrival at wrap]).

    arrival = announce(wrap_ranks(model, process_group))  # first thing in wrap()
    ...                                                  # wrap()'s own checks
    arrival.wait(bound_s, "timeout=30 s")                # before the first collective
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .tensor_parallel import data_parallel_ranks, is_dtensor

# [Note: arrival at wrap]
# wrap()'s first collective (the agreement, wrapping/fingerprint.py) would
# wait for a rank that has not called wrap() yet as long as the process
# group's timeout (30 minutes for gloo by default) and then name nothing: a
# rank still inside the model's set-up (a tensor-parallel plan that differs
# between ranks deadlocks torch's parallelize_module; a checkpoint load that
# hangs) or stopped looks like any slow collective. So each rank announces,
# first thing in wrap(), through the job's store (the world group's: the
# rendezvous store) that it reached zero_ext.wrap, and before the first
# collective waits until every rank of the wrap has, at most the wrap's
# timeout (default: the process group's) counted from its own arrival; past
# it, it raises naming the ranks that never came.
# - Keys: the set of global ranks the wrap spans (the data-parallel group or
#   mesh; for a tensor-parallel model, that times the tp mesh) and how many
#   wraps this process made over that set before. Every rank of a set calls
#   wrap() over it equally often (the contract of a collective), so the count
#   names the same wrap on every rank without communication. Each rank sets a
#   key of its own, then adds one to the wrap's counter; the add that
#   completes the count sets the "all here" key, which the others poll (one
#   store round trip each, at intervals doubling from 1 ms to 50 ms, then up
#   to a twentieth of the time waited so far, 1 s at most: a wrap waits at
#   most the ranks' own spread plus 5% of it, or 50 ms; nothing blocks
#   inside the store, so no c10d timeout warning is logged and Ctrl-C works).
# - A rank whose bound passes adds POISON to the counter. What its add
#   returns says whether every rank arrived after all (it goes on: the last
#   one set "all here") or not: it raises naming the ranks whose keys are
#   missing, and (the first to poison) posts that error as the "all here"
#   key's value, which the ranks still polling raise at once. A rank that
#   arrives after the poison reads it in its own add and raises too, with the
#   posted error, instead of entering a collective nobody joins. An add comes
#   before the poison (the poisoning rank counts it) or after (it sees the
#   poison), never both, so "every rank goes on" and "every rank raises" never
#   mix.
# - A store that stops answering (the process hosting it, rank 0 with
#   tcp:// or env://, died) raises zero_ext's error saying so, at once. The
#   calls go through the core's QuietStore (csrc/diagnosis_store.h), so a
#   lost store logs no c10d warning with a C++ stack trace.
# - A rank that died before wrap() never arrives: it is named at the bound
#   ("..., or stopped"), where the first collective used to fail at once
#   with gloo's "Connection closed by peer" (NCCL's waited for its
#   watchdog). Launchers (torchrun, srun, mp.spawn) usually end the others
#   when one rank dies; pass timeout= to bound it otherwise.
# Limits: a rank that cannot tell which ranks it wraps over without
# communication (a process_group it is not in, a tensor-parallel mesh torch
# gives no root mesh for) skips the wait, as before. Ranks that disagree on
# the set (one passes another process_group, or made its model tensor
# parallel alone) wait under different keys and end at the bound; their
# counts for those sets then differ, so a later wrap over them in the same
# processes ends so too.
POISON = 1 << 40
POLL_FIRST_S = 0.001
POLL_MAX_S = 0.05
_STOPPED = "stopped:"
# Wraps this process made over each set of global ranks: the next wrap's key.
_wraps_over: Dict[Tuple[int, ...], int] = {}


def first_tensor_parallel_mesh(model: object, dp_ranks: Optional[Sequence[int]] = None):
    """The mesh of the model's first DTensor parameter (find_tensor_parallel's
    order), None for a model that is not tensor parallel. A mesh inside
    `dp_ranks` is an expert-parallel one (groups/experts.py), not tp."""
    if not isinstance(model, torch.nn.Module):
        return None
    inside = set(int(r) for r in dp_ranks) if dp_ranks is not None else None
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None and is_dtensor(p):
                if p.device_mesh.ndim != 1:
                    return None
                ranks = set(int(r) for r in dist.get_process_group_ranks(p.device_mesh.get_group(0)))
                if inside is not None and len(ranks) > 1 and ranks <= inside:
                    continue
                return p.device_mesh
    return None


def _root_mesh(mesh):
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources  # older torch
    return _mesh_resources.get_root_mesh(mesh)


def _grid(dp: List[int], tp_mesh) -> Optional[List[int]]:
    """Every rank of the dp x tp grid through this rank: the data-parallel
    ranks and the tp ranks are lines (or planes) through it along disjoint
    dims of the mesh both come from, so rank (c_d + c_t - c_me) runs over it."""
    root = _root_mesh(tp_mesh)
    if root is None:
        return None
    grid = root.mesh
    coords = {int(grid[tuple(c)]): torch.tensor(c) for c in torch.ones_like(grid).nonzero().tolist()}
    tp = [int(r) for r in dist.get_process_group_ranks(tp_mesh.get_group(0))]
    me = coords.get(dist.get_rank())
    if me is None or any(r not in coords for r in dp + tp):
        return None
    ranks = set()
    for d in dp:
        for t in tp:
            c = coords[d] + coords[t] - me
            if bool((c < 0).any()) or bool((c >= torch.tensor(grid.shape)).any()):
                return None
            ranks.add(int(grid[tuple(c.tolist())]))
    return sorted(ranks)


def wrap_ranks(model: object, process_group: object) -> Optional[List[int]]:
    """The global ranks a wrap() of `model` over `process_group` spans, told
    without communication; None where that cannot be told (torch.distributed
    not initialized, a process_group this rank is not in or that is not one,
    a tensor-parallel mesh without a root mesh): then nothing is awaited."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        dp = sorted(int(r) for r in data_parallel_ranks(process_group))
        mesh = first_tensor_parallel_mesh(model, dp)
        ranks = dp if mesh is None else _grid(dp, mesh)
    except Exception:  # noqa: BLE001 - wrap()'s own checks name what is wrong with the arguments
        return None
    if ranks is None or dist.get_rank() not in ranks:
        return None
    return ranks


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class _StoreStopped(Exception):
    """A store call failed: the store (or its host) is gone."""


class _Store:
    """The job's store, called quietly where the core offers it (QuietStore,
    csrc/diagnosis_store.h: no c10d warning with a C++ stack trace once the
    host is gone); every failure raises _StoreStopped."""

    def __init__(self):
        from ..tools import core_loader
        quiet = getattr(core_loader, "QuietStore", None)
        try:
            self.store = quiet(dist.group.WORLD.group_name)
        except Exception:  # noqa: BLE001 - a core without it: torch's own calls, which log when the store is lost
            self.store = dist.distributed_c10d._get_default_store()

    def _call(self, name: str, *args):
        try:
            return getattr(self.store, name)(*args)
        except Exception as error:  # noqa: BLE001 - raised as zero_ext's error by Arrival.wait
            raise _StoreStopped(error) from error

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> str:
        value = self._call("get", key)
        return value if isinstance(value, str) else bytes(value).decode(errors="replace")

    def check(self, key: str) -> bool:
        return bool(self._call("check", [key]))

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", key, value))


def _store_stopped(error: BaseException) -> RuntimeError:
    return RuntimeError(
        f"zero_ext.wrap: waiting for every rank to reach zero_ext.wrap, the rendezvous store (torch.distributed's "
        f"default store) stopped answering ({type(error).__name__}: {error}); the process hosting it (rank 0 "
        "with tcp:// or env://, or torchrun's agent) has likely stopped")


@dataclass
class Arrival:
    """This rank's announced arrival at one wrap()."""

    base: str
    ranks: List[int]
    me: int
    store: Optional[_Store] = None
    at: float = field(default_factory=time.monotonic)
    count: int = 0  # what this rank's add returned
    error: Optional[BaseException] = None  # the store failed at the announcement

    def _key(self, what: str) -> str:
        return f"{self.base}/{what}"

    def wait(self, bound_s: float, bound_text: str) -> None:
        """Returns once every rank arrived; raises RuntimeError naming the
        ranks that did not within `bound_s` of this rank's arrival, or when
        another rank gave up waiting first, or this rank came after that
        (`bound_text`: where the bound comes from, for the message)."""
        try:
            if self.error is not None:
                raise _StoreStopped(self.error) from self.error
            self._wait(bound_s, bound_text)
        except _StoreStopped as stopped:
            cause = stopped.args[0]
            raise _store_stopped(cause) from cause

    def _wait(self, bound_s: float, bound_text: str) -> None:
        if self.count >= POISON:
            self._raise_late()
        if self.count >= len(self.ranks):  # the last to come (more: keys a store kept from an earlier job)
            return
        everyone = self._key("all")
        deadline = self.at + bound_s
        pause = POLL_FIRST_S
        while not self.store.check(everyone):
            left = deadline - time.monotonic()
            if left <= 0:
                self._give_up(bound_s, bound_text)
                return  # every rank arrived at the last moment
            time.sleep(min(pause, left))
            # Longer waits poll less often: one store call a second per rank at most.
            pause = min(pause * 2, max(POLL_MAX_S, min((time.monotonic() - self.at) / 20, 1.0)))
        posted = self.store.get(everyone)
        if posted.startswith(_STOPPED):
            raise RuntimeError(posted[len(_STOPPED):])

    def _missing(self) -> List[int]:
        return [r for r in self.ranks if not self.store.check(self._key(f"rank{r}"))]

    def _give_up(self, bound_s: float, bound_text: str) -> None:
        value = self.store.add(self._key("count"), POISON)
        arrived, poisons = value % POISON, value // POISON
        if poisons == 1 and arrived == len(self.ranks):
            return  # the last rank came before the poison, and set "all here"
        missing = self._missing()
        if missing:
            message = (
                f"zero_ext.wrap: {_ranks_text(missing)} {'have' if len(missing) > 1 else 'has'} not reached "
                f"zero_ext.wrap within {bound_s:g} s ({bound_text}) of rank {self.me} reaching it: "
                f"{'they are' if len(missing) > 1 else 'it is'} still inside the model's set-up (e.g. "
                "parallelize_module, a checkpoint load), or stopped, or calling zero_ext.wrap over other ranks "
                "(another process_group, a model made tensor parallel on some ranks only). Every rank of the "
                "process group must call zero_ext.wrap(); if the set-up takes longer on some ranks, pass a larger "
                "timeout= (it bounds this wait too).")
        else:  # they came after another rank had stopped waiting
            message = (f"zero_ext.wrap: every rank reached zero_ext.wrap, but some only after another rank had "
                       f"waited {bound_s:g} s ({bound_text}) for them and stopped")
        if poisons == 1:  # the first to stop: the ranks still polling, or arriving later, raise this
            self.store.set(self._key("all"), _STOPPED + message)
        raise RuntimeError(message)

    def _raise_late(self) -> None:
        everyone = self._key("all")
        end = time.monotonic() + 10.0  # the poisoning rank posts right after its add
        while not self.store.check(everyone) and time.monotonic() < end:
            time.sleep(0.01)
        posted = self.store.get(everyone) if self.store.check(everyone) else ""
        theirs = posted[len(_STOPPED):] if posted.startswith(_STOPPED) else "(their error was not posted)"
        raise RuntimeError(
            f"zero_ext.wrap: this rank (rank {self.me}) reached zero_ext.wrap after the ranks waiting there had "
            f"stopped waiting for it, so it stops too. Their error: {theirs}")


def announce(ranks: Optional[List[int]]) -> Optional[Arrival]:
    """Tells the other `ranks` (global ranks, this one among them) that this
    rank reached wrap(); None when there is no one to wait for. Never
    raises: a store failure is raised by Arrival.wait()."""
    if ranks is None or len(ranks) < 2:
        return None
    key = tuple(ranks)
    made = _wraps_over.get(key, 0)
    _wraps_over[key] = made + 1
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).hexdigest()
    me = dist.get_rank()
    arrival = Arrival(base=f"zero_ext/wrap-arrival/{digest}/{made}", ranks=list(ranks), me=me)
    try:
        arrival.store = _Store()
        arrival.store.set(arrival._key(f"rank{me}"), "1")
        arrival.count = arrival.store.add(arrival._key("count"), 1)
        if arrival.count == len(ranks):
            arrival.store.set(arrival._key("all"), "ok")
    except _StoreStopped as stopped:  # raised at the wait, by wrap()
        arrival.error = stopped.args[0]
    except Exception as error:  # noqa: BLE001 - the store could not be found: raised at the wait
        arrival.error = error
    return arrival
