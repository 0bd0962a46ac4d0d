"""The step across replicas ([Note: a step across replicas] in
groups/replicas.py): before a model's optimizers update, its gradients are
averaged over the live replicas, a replica behind having first taken a live
one's state (`recover`: files/peer_state.py's, which wrap() hands over)."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from ..groups import Quorum, ReplicaMismatch, agree_in_replica, group_all_reduce
from ..tools import faults

MAX_ATTEMPTS = 20  # quorums one step may take before its last error is raised
OK, FAILED, MISMATCH = 0, 1, 2  # a rank's outcome of one attempt; the replica takes the worst


def optimized_tensors(optimizers) -> List[torch.Tensor]:
    """What the optimizers step (this rank's segments, or the parameters at
    stage 0), once each, in the same order on every replica."""
    seen, out = set(), []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def exchange(state, optimizers, recover) -> None:
    """Collective over this replica and, through the quorum, over the live
    replicas' same shard rank: gradients averaged over the contributors,
    those behind brought to a live member's state first."""
    replicas = state.replica_set
    params = optimized_tensors(optimizers)
    mine = _contribution(params)  # built once: an attempt that failed after writing back starts from it again
    last: Optional[BaseException] = None
    for _ in range(MAX_ATTEMPTS):
        quorum = replicas.quorum()  # raises alike on every rank of this replica (a refusal)
        outcome = OK
        try:
            group = replicas.group(quorum)
            if quorum.recovering:
                recover(state, optimizers, replicas, quorum, group)
            faults.exit_if_armed("replica_average", dist.get_rank(), quorum.step)
            _average(params, quorum, group, mine if replicas.options.replica_id in quorum.contributors else None)
        except ReplicaMismatch as error:
            outcome, last = MISMATCH, error
        except Exception as error:  # noqa: BLE001 - a peer replica failed: a new quorum, on every rank of ours
            outcome, last = FAILED, error
        outcome = agree_in_replica(outcome)
        if outcome == OK:
            replicas.record(quorum)
            return
        replicas.failed = True
        if outcome == MISMATCH:
            raise last if isinstance(last, ReplicaMismatch) else ReplicaMismatch(
                "zero_ext: after a replica joined, another rank of this replica found the replicas' states differ "
                "(checksums exchanged): a replica's training diverged. Restart the replicas from a checkpoint.")
    raise RuntimeError(f"zero_ext: replica {replicas.options.replica_id!r} could not complete a step with the other "
                       f"replicas in {MAX_ATTEMPTS} quorums; the last failure: {last}") from last


def _contribution(params: List[torch.Tensor]) -> torch.Tensor:
    """This rank's gradients as one fp32 buffer: a flag per tensor (it has
    a gradient), then each gradient flattened (zeros where it has none)."""
    numels = [p.numel() for p in params]
    flat = torch.zeros(len(params) + sum(numels), dtype=torch.float32)
    at = len(params)
    for k, (p, n) in enumerate(zip(params, numels)):
        if p.grad is not None:
            flat[k] = 1.0
            flat[at:at + n].copy_(p.grad.detach().reshape(-1))
        at += n
    return flat


def _average(params: List[torch.Tensor], quorum: Quorum, group, mine: Optional[torch.Tensor]) -> None:
    """Sum over the members of their contributions (`mine`; zeros for a
    member that is not a contributor), divided by the contributors, written
    into the gradients; a gradient one replica has and another lacks (a
    parameter unused there) counts as zeros where lacking."""
    numels = [p.numel() for p in params]
    flat = mine.clone() if mine is not None else torch.zeros(len(params) + sum(numels), dtype=torch.float32)
    group_all_reduce(group, flat)
    flat[len(params):].div_(len(quorum.contributors))
    at = len(params)
    for k, (p, n) in enumerate(zip(params, numels)):
        if flat[k] > 0:
            summed = flat[at:at + n].view(p.shape)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(summed)
        elif p.grad is not None:
            p.grad = None  # no contributor had one (this replica is catching up)
        at += n
