"""A replica catching up takes a live replica's state over the network
(step 2 of [Note: a step across replicas] in groups/replicas.py): shard rank
i from shard rank i, no checkpoint read; then every member's state is
checked identical."""
from __future__ import annotations

import json
from typing import List

import torch
import torch.distributed as dist

from ..groups import (Quorum, ReplicaMismatch, bytes_of, checksum, group_all_reduce, group_broadcast,
                      group_broadcast_bytes, object_from)
from ..optim import optimized_tensors
from ..tools import faults
from .plan import local_views, persistent_buffers


def _state_tensors(state, model, optimizers) -> List[torch.Tensor]:
    """What a replica holds of the model and its optimizers, in one order:
    this rank's values (shards or masters, or whole parameters at stage 0),
    the parameters outside zero_ext's buckets, the persistent buffers, then
    each optimizer's state tensors (by key, in _structure's order)."""
    tensors = [view for _, _, view in local_views(state)]
    bucketed = {id(p) for p in state.bucketed}
    tensors += [p.detach() for p in model.parameters() if id(p) not in bucketed]
    tensors += list(persistent_buffers(model).values())
    for opt in optimizers:
        for p in optimized_tensors([opt]):
            tensors += [v for _, v in sorted(opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
    return tensors


def _structure(optimizers) -> dict:
    """The optimizers' state layout and hyperparameters, as JSON."""
    out = {"groups": [], "state": []}
    for opt in optimizers:
        out["groups"].append([{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                              for g in opt.param_groups])
        per = []
        for p in optimized_tensors([opt]):
            entry = {}
            for key, value in sorted(opt.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    entry[key] = {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
                                  "cpu": value.device.type == "cpu"}
                else:
                    entry[key] = {"value": value}
            per.append(entry)
        out["state"].append(per)
    return out


def _install_structure(optimizers, structure: dict) -> None:
    """A replica catching up: the source's optimizer layout (tensors to be
    filled next), hyperparameters and plain values."""
    for opt, groups, per in zip(optimizers, structure["groups"], structure["state"]):
        for mine, theirs in zip(opt.param_groups, groups):
            for k, v in theirs.items():
                mine[k] = tuple(v) if isinstance(mine.get(k), tuple) else v
        opt.state.clear()
        for p, entry in zip(optimized_tensors([opt]), per):
            if not entry:
                continue
            made = {}
            for key, spec in entry.items():
                if "value" in spec:
                    made[key] = spec["value"]
                else:
                    made[key] = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]),
                                            device="cpu" if spec["cpu"] else p.device)
            opt.state[p] = made


def _damage(tensors: List[torch.Tensor]) -> None:
    """Test-only (tools/faults.py): one received value changed, as a transfer or
    an install gone wrong would leave it, for the checksums to find."""
    held = next(t for t in tensors if t.numel() and t.is_floating_point())
    held.view(-1)[0] += 1.0


def recover_from_peer(state, optimizers, replicas, quorum: Quorum, group) -> None:
    """Collective over the quorum: the members behind take the source's
    state (shard rank i from shard rank i); then every member's checksum
    must be the same."""
    model = state.model_ref()
    me = quorum.members.index(replicas.options.replica_id)
    root = quorum.members.index(quorum.source)
    behind = replicas.options.replica_id in quorum.recovering
    text = bytes_of(json.dumps(_structure(optimizers))) if me == root else None
    structure = json.loads(object_from(group_broadcast_bytes(group, text, root, me)))
    if behind:
        faults.exit_if_armed("replica_recover", dist.get_rank())
        _install_structure(optimizers, structure)
    tensors = _state_tensors(state, model, optimizers)
    for t in tensors:  # into its own tensors where it catches up; elsewhere sent, or received and dropped
        target = t.contiguous() if behind or me == root else torch.empty_like(t, memory_format=torch.contiguous_format)
        group_broadcast(group, target, root)
        if behind and target.data_ptr() != t.data_ptr():
            t.copy_(target)
    user = replicas.options.state
    data = bytes_of(user.state_dict() if user is not None else None) if me == root else None
    received = group_broadcast_bytes(group, data, root, me)
    if behind:
        if user is not None:
            user.load_state_dict(object_from(received))
        replicas.step = quorum.step
        state.handles.checkpoint.refresh_params_from_shards()  # collective over this replica: all of it is behind
    if behind and faults.armed("replica_damaged", dist.get_rank()):
        _damage(tensors)
    digest = torch.tensor(list(bytes.fromhex(checksum(tensors))), dtype=torch.int32)
    top, low = digest.clone(), digest.clone()
    group_all_reduce(group, top, dist.ReduceOp.MAX)
    group_all_reduce(group, low, dist.ReduceOp.MIN)
    if not torch.equal(top, low):
        raise ReplicaMismatch(
            f"zero_ext: after replica(s) {quorum.recovering} took {quorum.source!r}'s state, the replicas' states "
            "differ (checksums exchanged): a replica's training diverged. Restart the replicas from a checkpoint.")
