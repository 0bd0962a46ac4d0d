"""Process groups of zero_ext's own.

Each wrapped model reduces gradients on a group of its own over the same
ranks (and in stage 3 gathers parameters on a second one). Collectives on a
shared group must be issued in the same order on every rank, and a bucket's
reduction starts when its last gradient arrives, a moment that can differ
between ranks relative to another model's collectives or the user's own
(SyncBatchNorm, a loss all-reduce). Separate groups keep each sequence
independent. The groups carry the timeout that bounds every wait.

Groups are pooled and reused once the model that held them is gone on every
rank. They are never destroyed by zero_ext: torch names new groups by how
many exist, so destroying one on some ranks before others would make later
names differ. destroy_process_group() frees them ([Note: groups die with
destroy_process_group]).
Over the world group they are created by every rank together, named by the
group counter all ranks share; over a subgroup only its members take part
([Note: member-only groups leave torch's counter alone]).
"""
from __future__ import annotations

import contextlib
import datetime
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

# [Note: groups die with destroy_process_group]
# A group alive when the interpreter finalizes keeps its gloo worker threads,
# and a worker that lets go of a collective's tensors then takes the GIL and
# aborts the process ([Note: tensors a backend thread lets go of]; the
# user's own last collective, all_gather_object say, is enough). torch frees
# a group at destroy_process_group() only if nothing else holds it, so:
# - zero_ext's pool holds its groups weakly (torch's registry holds them
#   until destroy_process_group(); a wrapped model's core while it lives);
# - torch.distributed.nn.functional is imported here, before the user's
#   init_process_group(): its functions take `group=group.WORLD` as a default
#   argument, evaluated at import, so imported later (torch._dynamo imports
#   it, and the first optimizer made imports torch._dynamo) they would hold
#   the world group forever (torch 2.11-2.15).
try:
    import torch.distributed.nn.functional  # noqa: F401 - imported for its default arguments' sake
except ImportError:  # a torch without distributed support: zero_ext's checks say so where it matters
    pass


# [Note: tensors a backend thread lets go of]
# In torch 2.13 a tensor Python has seen keeps its Python object alive while
# C++ holds it too, and the C++ release that leaves Python's reference the
# last one takes the GIL (intrusive_ptr's decref_pyobject). Threads other
# than the caller's make such releases: a gloo worker drops a work (and its
# tensors) once done with it, which may be after the caller's wait has
# returned; and zero_ext's core, on a header's completion callback (a gloo
# thread), drops the collectives a failure left queued. Once Python is
# finalizing, a thread that takes the GIL is ended by pthread_exit (Python
# 3.11), which cannot unwind through the C++ destructor it is in: the
# process aborts ("terminate called without an active exception", or naming
# gloo's error) after the caller had already raised its error or finished.
# So a collective on tensors Python made is over only once the backend has
# let go of them: handed_to_backend waits for that, the GIL released, before
# the caller goes on (or exits).
RELEASE_TIMEOUT_S = 5.0


def wait_released(held: List[Tuple[torch.Tensor, int]], timeout: float = RELEASE_TIMEOUT_S) -> bool:
    """Waits until each tensor's C++ use count is back to the count paired
    with it; whether it is. Sleeps (releasing the GIL: the releasing thread
    may need it) for at most `timeout` seconds: a collective still queued
    behind a header that never completes keeps its tensors, and is not
    waited out."""
    deadline = time.monotonic() + timeout
    pause = 0.0
    while any(t._use_count() > count for t, count in held):
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(max(pause * 2, 0.0005), 0.01)
    return True


@contextlib.contextmanager
def handed_to_backend(*tensors: torch.Tensor) -> Iterator[None]:
    """Around a collective (zero_ext's core or torch.distributed) on host
    tensors Python made: on the way out, returning or raising, waits until
    no C++ object holds them beyond what held them before ([Note: tensors a
    backend thread lets go of]). Device tensors are left to their backend."""
    held = [(t, t._use_count()) for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and hasattr(t, "_use_count")]
    try:
        yield
    finally:
        wait_released(held)


def group_timeout(group: dist.ProcessGroup) -> Optional[datetime.timedelta]:
    """The timeout `group` was created with, where torch exposes it."""
    for device_type in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device_type)).options._timeout
        except Exception:  # noqa: BLE001 - not every backend or version has it
            continue
    return None


def _held_weakly(group: object) -> Callable[[], object]:
    """`group` while torch (or a model) holds it, then None; a non-member's
    placeholder (not a group, nothing to free) as it is."""
    try:
        return weakref.ref(group)
    except TypeError:
        return lambda: group


@dataclass
class _Entry:
    held: Callable[[], Optional[dist.ProcessGroup]]
    owner: Optional["weakref.ref"] = None
    broken: bool = False  # its model's collectives failed: some may still be pending on it

    @staticmethod
    def of(group: dist.ProcessGroup) -> "_Entry":
        return _Entry(_held_weakly(group))

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """None once destroy_process_group() freed it."""
        return self.held()

    def in_use(self) -> bool:
        return self.broken or (self.owner is not None and self.owner() is not None)


@dataclass
class _Pool:
    entries: Dict[Tuple[str, Optional[float]], List[_Entry]] = field(default_factory=dict)


_pool = _Pool()


def retire_if_failed(handles, groups: List[dist.ProcessGroup]) -> None:
    """Called once a model is gone: if its collectives failed (a peer died, the
    ranks took different paths), collectives may be pending on its groups
    forever, so they are never handed to another model. Every rank of a
    failed model fails (a collective error reaches every rank), so every rank
    keeps them busy alike."""
    try:
        failed = handles.diagnostics.failed()
    except Exception:  # noqa: BLE001 - a core that cannot answer is not trusted either
        failed = True
    if not failed:
        return
    ids = {id(g) for g in groups}
    for entries in _pool.entries.values():
        for entry in entries:
            if id(entry.group) in ids:
                entry.broken = True
    for sets in _subgroup_sets.values():
        for entry, subgroup_groups in sets:
            if any(id(held()) in ids for pair in subgroup_groups for held in pair):
                entry.broken = True


def pooled_groups() -> int:
    """Groups this process holds in the pool, alive: the same on every rank
    that wrapped the same models before (wrap() checks it: the pools' busy
    flags are exchanged in one collective whose size is this count)."""
    live = dist.distributed_c10d._world.pg_map
    return sum(1 for entries in _pool.entries.values() for e in entries if e.group in live)


# [Note: member-only groups leave torch's counter alone]
# A group over a subgroup's ranks is created by its members alone
# (use_local_synchronization=True): the other ranks are not in wrap's
# collective. torch names such a group by a hash of its ranks and a salt; the
# salt is len(_world.pg_names) up to torch 2.14 and, from 2.15, the world's
# group counter, which the creation also advances, on the members only. A
# wrap that creates groups on some rows of a mesh and not others (a refused
# wrap, a model over one row) would then leave the rows' counters apart, and
# the next group made by every rank (init_device_mesh, new_group) would get a
# different name on each row and hang. So zero_ext salts its member-only
# groups with a counter of its own per set of ranks (every member creates the
# groups over its ranks in the same order, as wrap's collectives are the same
# on each) and puts torch's counter back as it found it.
_MEMBER_GROUP_SALT = 1 << 40  # far above any count torch reaches: no name of torch's collides
_member_groups_made: Dict[Tuple[int, ...], int] = {}


def _new_member_group(ranks: List[int], backend: str, **kwargs) -> dist.ProcessGroup:
    """dist.new_group over `ranks`, called by those ranks alone."""
    world = dist.distributed_c10d._world
    made = _member_groups_made.get(tuple(ranks), 0)
    _member_groups_made[tuple(ranks)] = made + 1
    counter = world.group_count
    world.group_count = _MEMBER_GROUP_SALT + made
    try:
        return dist.new_group(ranks=list(ranks), backend=backend, use_local_synchronization=True, **kwargs)
    finally:
        world.group_count = counter


def acquire_groups(base: dist.ProcessGroup, count: int, timeout: Optional[datetime.timedelta],
                   device: torch.device, owner: object, backend: Optional[str] = None) -> List[dist.ProcessGroup]:
    """`count` groups over `base`'s ranks for `owner`; collective over `base`.
    `backend`: the groups' backend (default: `base`'s; the header groups of
    the sequence checks are gloo whatever the data's backend)."""
    timeout = timeout or group_timeout(base)
    backend = backend or dist.get_backend(base)
    key = (f"{backend}:{base.group_name}", timeout.total_seconds() if timeout else None)
    live = dist.distributed_c10d._world.pg_map
    # Groups from before a destroy_process_group() are gone: forget them.
    entries = [e for e in _pool.entries.get(key, []) if e.group in live]
    _pool.entries[key] = entries
    free: List[_Entry] = []
    if entries:
        # Free only where free on every rank, so every rank picks the same ones.
        busy = torch.tensor([float(e.in_use()) for e in entries], dtype=torch.float32, device=device)
        with handed_to_backend(busy):
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=base)
        free = [e for e, b in zip(entries, busy.tolist()) if b == 0.0]
    chosen = free[:count]
    while len(chosen) < count:
        kwargs = {"timeout": timeout} if timeout is not None else {}
        ranks = dist.get_process_group_ranks(base)
        group = (dist.new_group(ranks=ranks, backend=backend, **kwargs) if base is dist.group.WORLD
                 else _new_member_group(ranks, backend, **kwargs))
        entry = _Entry.of(group)
        entries.append(entry)
        chosen.append(entry)
    for entry in chosen:
        entry.owner = weakref.ref(owner)
    return [entry.group for entry in chosen]


def acquire_mesh_groups(shard_base: dist.ProcessGroup, replicate_base: dist.ProcessGroup, count: int,
                        timeout: Optional[datetime.timedelta], device: torch.device, owner: object,
                        backend: Optional[str] = None) -> Tuple[List[dist.ProcessGroup], dist.ProcessGroup]:
    """Hybrid sharding: `count` groups over this rank's row (`shard_base`'s
    ranks) and one over its column (`replicate_base`'s), for `owner`;
    collective over the whole mesh.

    Free or busy is decided over the whole mesh: a row that reused pooled
    groups while another created new ones would count its groups
    differently, and torch names a group by that count, so the next group
    spanning both rows would get two names and hang."""
    timeout = timeout or group_timeout(shard_base)
    seconds = timeout.total_seconds() if timeout else None
    backend = backend or dist.get_backend(shard_base)
    live = dist.distributed_c10d._world.pg_map
    keys = [(f"{backend}:mesh-shard:{shard_base.group_name}:{replicate_base.group_name}", seconds),
            (f"{backend}:mesh-replicate:{shard_base.group_name}:{replicate_base.group_name}", seconds)]
    pools = []
    for key in keys:
        entries = [e for e in _pool.entries.get(key, []) if e.group in live]
        _pool.entries[key] = entries
        pools.append(entries)
    free: List[List[_Entry]] = [[], []]
    flags = [float(e.in_use()) for e in pools[0] + pools[1]]
    if flags:
        # Every rank of the mesh wrapped the same models over it, so the pools
        # have the same length everywhere.
        busy = torch.tensor(flags, dtype=torch.float32, device=device)
        with handed_to_backend(busy):
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=shard_base)
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=replicate_base)
        flags = busy.tolist()
        free[0] = [e for e, b in zip(pools[0], flags[:len(pools[0])]) if b == 0.0]
        free[1] = [e for e, b in zip(pools[1], flags[len(pools[0]):]) if b == 0.0]
    chosen: List[List[_Entry]] = [free[0][:count], free[1][:1]]
    for role, (base, wanted) in enumerate(((shard_base, count), (replicate_base, 1))):
        while len(chosen[role]) < wanted:
            kwargs = {"timeout": timeout} if timeout is not None else {}
            group = _new_member_group(dist.get_process_group_ranks(base), backend, **kwargs)
            entry = _Entry.of(group)
            pools[role].append(entry)
            chosen[role].append(entry)
    for entry in chosen[0] + chosen[1]:
        entry.owner = weakref.ref(owner)
    return [e.group for e in chosen[0]], chosen[1][0].group


# Subgroups of a shard group, by (members, backend): created once per process
# by their members and kept, as the base that acquire_groups pools over.
_subgroup_bases: Dict[Tuple[Tuple[int, ...], str], Callable[[], Optional[dist.ProcessGroup]]] = {}
# Over the world group: every subgroup's (data, header) groups, created by
# every rank in one order, pooled as sets (one set serves one model).
_subgroup_sets: Dict[Tuple, List[Tuple[_Entry, List[Tuple[Callable[[], object], Callable[[], object]]]]]] = {}


def acquire_subgroups(base: dist.ProcessGroup, size: int, shard_rank: int, timeout: Optional[datetime.timedelta],
                      device: torch.device, owner: object) -> List[dist.ProcessGroup]:
    """reshard_after_forward=<size>: a data group and a gloo header group over
    this rank's subgroup of `base` (`size` consecutive members of `base`, by
    group rank), for `owner`. Over the world group every rank creates every
    subgroup's groups, in one order (a plain collective creation, which NCCL
    communicators split from a parent bound to a device need); over a smaller
    group (a mesh row) each subgroup creates its own, as its members alone
    call wrap's collectives there."""
    timeout = timeout or group_timeout(base)
    backend = dist.get_backend(base)
    members = dist.get_process_group_ranks(base)
    subgroups = [tuple(members[first:first + size]) for first in range(0, len(members), size)]
    mine = shard_rank // size
    if base is dist.group.WORLD:
        return _acquire_world_subgroups(subgroups, mine, backend, timeout, device, owner)
    ranks = subgroups[mine]
    key = (ranks, backend)
    sub = _subgroup_bases[key]() if key in _subgroup_bases else None
    if sub not in dist.distributed_c10d._world.pg_map:
        kwargs = {"timeout": timeout} if timeout is not None else {}
        sub = _new_member_group(list(ranks), backend, **kwargs)
        _subgroup_bases[key] = _held_weakly(sub)
    return (acquire_groups(sub, 1, timeout, device, owner)
            + acquire_groups(sub, 1, timeout, device, owner, backend="gloo"))


def _acquire_world_subgroups(subgroups, mine: int, backend: str, timeout, device: torch.device,
                             owner: object) -> List[dist.ProcessGroup]:
    key = (tuple(subgroups), backend, timeout.total_seconds() if timeout else None)
    live = dist.distributed_c10d._world.pg_map
    sets = [(e, groups) for e, groups in _subgroup_sets.get(key, []) if groups[mine][0]() in live]
    _subgroup_sets[key] = sets
    chosen = None
    if sets:  # free only where free on every rank, so every rank picks the same set
        busy = torch.tensor([float(e.in_use()) for e, _ in sets], dtype=torch.float32, device=device)
        with handed_to_backend(busy):
            dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        chosen = next(((e, g) for (e, g), b in zip(sets, busy.tolist()) if b == 0.0), None)
    if chosen is None:
        kwargs = {"timeout": timeout} if timeout is not None else {}
        created = [(dist.new_group(ranks=list(ranks), backend=backend, **kwargs),
                    dist.new_group(ranks=list(ranks), backend="gloo", **kwargs)) for ranks in subgroups]
        chosen = (_Entry.of(created[mine][0]), [(_held_weakly(d), _held_weakly(h)) for d, h in created])
        sets.append(chosen)
    entry, groups = chosen
    entry.owner = weakref.ref(owner)
    return [held() for held in groups[mine]]


def exchange_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a group's (None: the default group's) host-side exchanges put their tensors: NCCL moves CUDA
    tensors only, gloo host ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
