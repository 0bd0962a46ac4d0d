"""What wrap()'s process_group resolves to: the group a model shards over and,
for hybrid sharding, the group across the copies of each shard.

A 2-D DeviceMesh has dims (replicate, shard), FSDP2's convention: rank (r, s)
holds shard s of row r, rows replicate each other ([Note: hybrid sharding] in
csrc/mesh.h). The mesh rank r * S + s names a rank the same way everywhere
(checkpoint files, agreement rows, "rank 0"); it needs every row and column
of the mesh numbered in increasing global rank, so that a group's own ranks
(torch numbers a group's members in global-rank order) are the mesh
coordinates. init_device_mesh builds such meshes; others are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ..tools import torch_compat


@dataclass(frozen=True)
class Topology:
    shard_group: Optional[dist.ProcessGroup]  # the user's group the model shards over (None: one process)
    replicate_group: Optional[dist.ProcessGroup]  # across the copies of each shard (None: flat)
    shard_size: int  # S
    replicas: int  # R
    shard_rank: int  # s
    replica_rank: int  # r

    @property
    def mesh_size(self) -> int:
        return self.shard_size * self.replicas

    @property
    def mesh_rank(self) -> int:
        return self.replica_rank * self.shard_size + self.shard_rank

    def shard_mesh_ranks(self) -> List[int]:
        """Mesh rank of each member of this rank's shard group, by group rank."""
        return [self.replica_rank * self.shard_size + s for s in range(self.shard_size)]

    def replica_mesh_ranks(self) -> List[int]:
        return [r * self.shard_size + self.shard_rank for r in range(self.replicas)]


def _flat(group: Optional[dist.ProcessGroup]) -> Topology:
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return Topology(None, None, 1, 1, 0, 0)  # notebooks: a single process, no communication
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            "zero_ext.wrap: this rank is not a member of the process_group passed; "
            "call wrap() only on ranks of that group, or pass a group that contains this rank."
        )
    return Topology(group, None, dist.get_world_size(group), 1, rank, 0)


def _check_regular(grid: torch.Tensor) -> None:
    rows_increase = bool((grid[:, 1:] > grid[:, :-1]).all()) if grid.shape[1] > 1 else True
    cols_increase = bool((grid[1:, :] > grid[:-1, :]).all()) if grid.shape[0] > 1 else True
    if not (rows_increase and cols_increase):
        raise ValueError(
            f"zero_ext.wrap: the DeviceMesh's ranks {grid.tolist()} do not increase along every row and column. "
            "zero_ext numbers a rank by its place in the mesh and needs that to match the order torch gives "
            "each group's members; build the mesh with init_device_mesh(device_type, (replicas, shard_size), "
            "mesh_dim_names=('replicate', 'shard')), which lays ranks out in order.")


def resolve_topology(process_group, device: Optional[torch.device]) -> Topology:
    """The Topology of wrap()'s process_group: None (the world), a
    ProcessGroup, or a 1-D or 2-D (replicate, shard) DeviceMesh. Raises
    ValueError on every rank alike (every rank sees the whole mesh), before
    any communication. `device` None: the mesh's device type is not checked
    against the model's (a rank whose checks failed, before it tells the
    others)."""
    if not torch_compat.is_device_mesh(process_group):
        return _flat(process_group)
    mesh = process_group
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"zero_ext.wrap: a DeviceMesh passed as process_group must be 1-D (shard) or 2-D (replicate, shard), "
            f"got {mesh.ndim}-D {names or ''}; pass the data-parallel sub-mesh, e.g. mesh['replicate', 'shard'].")
    if device is not None and mesh.device_type != device.type:
        raise ValueError(
            f"zero_ext.wrap: the DeviceMesh is a {mesh.device_type!r} mesh but the model is on {device.type!r}; "
            f"build the mesh for the model's device (init_device_mesh({device.type!r}, ...)).")
    if mesh.get_coordinate() is None:
        raise ValueError("zero_ext.wrap: this rank is not in the DeviceMesh passed; call wrap() only on its ranks.")
    if mesh.ndim == 1:
        return _flat(mesh.get_group(0))
    if names and ("shard" in names[0] or "replicate" in names[1]):
        raise ValueError(
            f"zero_ext.wrap: the 2-D DeviceMesh's dims are named {names}: zero_ext takes (replicate, shard), the "
            "replicated dim first, as FSDP2 does. Build it with the replicate dim first.")
    grid = mesh.mesh
    _check_regular(grid)
    replicas, shard_size = int(grid.shape[0]), int(grid.shape[1])
    if replicas == 1:
        return _flat(mesh.get_group(1))
    replica_rank, shard_rank = (int(c) for c in mesh.get_coordinate())
    shard_group, replicate_group = mesh.get_group(1), mesh.get_group(0)
    assert dist.get_rank(shard_group) == shard_rank and dist.get_rank(replicate_group) == replica_rank, \
        "zero_ext internal: the mesh's groups number their members unlike its coordinates"
    return Topology(shard_group, replicate_group, shard_size, replicas, shard_rank, replica_rank)
