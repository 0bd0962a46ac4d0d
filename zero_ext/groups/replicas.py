"""Replicas that survive each other's failures (SPEC.md, "Surviving a lost
replica"): each replica is one torchrun job, wrapped as usual, plus
wrap(..., replicas=zero_ext.Replicas(coordinator="HOST:PORT", replica_id=ID));
before every optimizer step the replicas average their gradients through
zero_ext, over whichever replicas are alive.

[Note: a step across replicas]
Before a step's update (StepRound, once for all of the model's optimizers),
each rank of a replica:
  1. learns the quorum (rank 0 asks the coordinator, [Note: quorums] in
     groups/coordinator_server.py, and tells its replica's ranks);
  2. if some members are behind (a replica started again, or one that
     missed a commit), takes part in sending them the state of the source
     member: shard rank i from shard rank i over the quorum's group (the
     parameters' shards or masters, the optimizer state, its step, the
     buffers, the Replicas' user state), then every member's state is
     checked identical (checksums exchanged);
  3. sums the gradients the optimizer steps (this rank's shards, kept aside
     first) over the members' shard rank i, those behind adding zeros, and
     divides by the contributors;
  4. agrees with its own replica's ranks that every rank got here: if any
     failed (a peer replica died in the middle), the gradients are put back
     and the step starts again at 1 with a new quorum.
Each replica's rank i meets the others' rank i in a gloo group of its own
per quorum (through the coordinator's store, under the quorum's id), so no
group a dead replica was part of is ever used again. A replica whose commit
the others missed is simply ahead: the next quorum brings the others to its
state (2), so no live replica applies a step twice or skips one.
"""
from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .coordinator_server import HEARTBEAT_S, request
from .process_groups import exchange_device

KEPT_STEPS = 100  # steps whose contributors replica_status lists


@dataclass
class Replicas:
    """wrap(..., replicas=Replicas(...)): this job is replica `replica_id` of
    those the coordinator at `coordinator` ("HOST:PORT") keeps in step.
    `timeout`: seconds a cross-replica collective or the coordinator may
    take before the replica goes on without the peer (or stops, for the
    coordinator). `state`: an object with state_dict()/load_state_dict()
    (an LR scheduler, a data loader's position) sent to a replica that
    joins, with the model's."""
    coordinator: str
    replica_id: str
    timeout: float = 30.0
    state: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.coordinator, str) or ":" not in self.coordinator:
            raise ValueError(f"zero_ext.Replicas: coordinator is 'HOST:PORT', got {self.coordinator!r}")
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"zero_ext.Replicas: coordinator is 'HOST:PORT', got {self.coordinator!r}")
        self.replica_id = str(self.replica_id)
        if not self.replica_id:
            raise ValueError("zero_ext.Replicas: replica_id must not be empty")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"zero_ext.Replicas: timeout is a number of seconds > 0, got {self.timeout!r}")


class _Heartbeat:
    """Rank 0's beat to the coordinator, from a thread of its own: a replica
    that stops (killed, stopped) stops beating, and the others go on."""

    def __init__(self, address: str, replica_id: str, incarnation: str) -> None:
        self.body = {"op": "heartbeat", "replica": replica_id, "incarnation": incarnation}
        self.address = address
        self.thread = threading.Thread(target=self._run, name="zero_ext-replica-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:  # a daemon thread: it ends with the process
            time.sleep(HEARTBEAT_S)
            try:
                request(self.address, self.body, timeout=HEARTBEAT_S * 4)
            except (OSError, ValueError):
                pass  # the coordinator away for a while: the quorum request says so when it matters


@dataclass
class Quorum:
    id: str
    group: str  # the cross-replica group's id ([Note: quorums])
    store_port: int  # the coordinator's store, where the group meets
    members: List[str]
    step: int
    contributors: List[str]
    recovering: List[str]
    source: str


class ReplicaSet:
    """A wrapped model's replicas: the quorum each step, the groups to the
    other replicas' same shard rank, the step record."""

    def __init__(self, options: Replicas, fingerprint: Dict[str, str]) -> None:
        self.options = options
        self.fingerprint = fingerprint
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.incarnation = uuid.uuid4().hex[:12] if self.rank == 0 else ""
        self.step = 0
        self.joined = False  # in a quorum whose step committed: it has trained with the others
        self.failed = False  # its last attempt failed: the next quorum makes a new group
        self.live: List[str] = []
        self.contributed: Dict[int, List[str]] = {}
        self._groups: Dict[str, Any] = {}
        self._store = None
        self._store_incarnation = ""
        self.heartbeat = _Heartbeat(options.coordinator, options.replica_id, self.incarnation) if self.rank == 0 \
            else None

    # --- 1. the quorum ------------------------------------------------------
    def quorum(self) -> Quorum:
        """Collective over this replica: rank 0 asks, every rank learns."""
        a = self._ask() if self.rank == 0 else None
        if self.world > 1:
            a = _broadcast_json(a)
        if not a.get("ok"):
            raise RuntimeError(f"zero_ext: replica {self.options.replica_id!r}: {a.get('error')}")
        return Quorum(a["quorum"], a["group"], a["store_port"], a["members"], a["step"], a["contributors"],
                      a["recovering"], a["source"])

    def _ask(self) -> dict:
        body = {"op": "quorum", "replica": self.options.replica_id, "incarnation": self.incarnation,
                "step": self.step, "fingerprint": self.fingerprint, "timeout": 600.0, "fresh": not self.joined,
                "failed": self.failed}
        deadline = time.monotonic() + self.options.timeout
        while True:
            try:
                return request(self.options.coordinator, body, timeout=610.0)
            except (OSError, ValueError) as error:
                if time.monotonic() > deadline:
                    return {"ok": False, "error": (
                        f"the coordinator at {self.options.coordinator} did not answer for {self.options.timeout:g} s "
                        f"({type(error).__name__}: {error}); start it again (python -m zero_ext.coordinator) or "
                        "restart the replicas")}
                time.sleep(0.2)

    def group(self, quorum: Quorum):
        """This shard rank's gloo group across the quorum's members (made once per group id)."""
        if quorum.group in self._groups:
            return self._groups[quorum.group]
        incarnation = quorum.group.rsplit("-g", 1)[0]
        if self._store is None or self._store_incarnation != incarnation:  # a coordinator started again: its new store
            host = self.options.coordinator.rpartition(":")[0]
            self._store = dist.TCPStore(host, quorum.store_port, is_master=False,
                                        timeout=datetime.timedelta(seconds=self.options.timeout))
            self._store_incarnation = incarnation
        prefix = f"zero_ext/{quorum.group}/shard{self.rank}"
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._store), quorum.members.index(
            self.options.replica_id), len(quorum.members), datetime.timedelta(seconds=self.options.timeout))
        self._groups = {quorum.group: group}  # an earlier group is never used again
        return group

    def status(self) -> dict:
        return {"step": self.step, "live": list(self.live), "contributed": dict(self.contributed)}

    def record(self, quorum: Quorum) -> None:
        self.contributed[quorum.step] = list(quorum.contributors)
        for old in [s for s in self.contributed if s <= quorum.step - KEPT_STEPS]:
            del self.contributed[old]
        self.live = list(quorum.members)
        self.step = quorum.step + 1
        self.joined = True
        self.failed = False


def agree_in_replica(outcome: int) -> int:
    """Collective over this replica's ranks: the worst outcome of any rank
    (0: its part went through)."""
    if dist.get_world_size() == 1:
        return outcome
    flag = torch.tensor([outcome], dtype=torch.int32, device=exchange_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _broadcast_json(value: Any) -> Any:
    """Collective over this replica: rank 0's JSON value (the coordinator's
    answer) on every rank, as UTF-8 bytes: nothing unpickled."""
    device = exchange_device()
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    out = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if data:
        out.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(out, src=0)
    return json.loads(bytes(out.cpu().numpy()).decode())


def group_all_reduce(group, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    """In place over a quorum's group, waited for (raises if a peer failed)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    group.allreduce([tensor], opts).wait()


def group_broadcast(group, tensor: torch.Tensor, root: int) -> None:
    """From the member at `root` of a quorum's group, in place, waited for."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()


def group_broadcast_bytes(group, data, root: int, me: int) -> torch.Tensor:
    """`data` (uint8, given at `root` only) on every member: its length, then it."""
    length = torch.tensor([data.numel() if me == root else 0], dtype=torch.int64)
    group_broadcast(group, length, root)
    out = data if me == root else torch.empty(int(length.item()), dtype=torch.uint8)
    group_broadcast(group, out, root)
    return out


class ReplicaMismatch(RuntimeError):
    """The members' states differ after a join: never trained on silently."""


def checksum(tensors: List[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                      if t.numel() else b"")
    return digest.hexdigest()


def bytes_of(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def object_from(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
