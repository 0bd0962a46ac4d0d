"""Experts on their own mesh dimension: a model whose experts the user made
expert-parallel (DTensor Shard(0) over mesh["ep"], with its own token
dispatch), wrapped with wrap(..., process_group=mesh["dp"],
expert_process_group=mesh["dp_mod_ep"]).

[Note: expert parallelism]
torchtitan's layout: the data-parallel ranks (dp) form a grid dp_mod_ep x
ep. Along ep each rank holds other experts (an all-to-all sends each token
to its expert's rank), along dp_mod_ep the ranks hold the same experts. So
the experts' gradients sum over dp_mod_ep only (each already holds, through
the dispatch, the tokens of its whole ep group), divided by the whole dp
size as every other gradient is; the other parameters are sharded over dp.
zero_ext takes each expert DTensor's local tensor as a local leaf, as it
takes a tensor-parallel one ([Note: local leaves] in tensor_parallel.py),
and hands the core the expert buckets and the expert group ([Note: expert
buckets] in csrc/layout.h). What sums over the mesh (the gradient mask, the
global norm) needs nothing more: each piece of an expert is held by exactly
one dp rank. What needs the whole expert (full_state_dict, checkpoints,
convert) puts the ep parts together along dim 0, as it does a tp split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .tensor_parallel import (TensorParallelSpec, _Found, data_parallel_ranks, refuse_for_local_leaves,
                              walk_dtensors)


def expert_group_of(expert_process_group) -> Optional[dist.ProcessGroup]:
    """The process group of wrap()'s expert_process_group (a 1-D DeviceMesh or a ProcessGroup)."""
    if expert_process_group is None:
        return None
    if hasattr(expert_process_group, "get_group") and hasattr(expert_process_group, "mesh"):
        if expert_process_group.ndim != 1:
            raise ValueError(f"zero_ext.wrap: expert_process_group must be a 1-D DeviceMesh (mesh['dp_mod_ep']), "
                             f"got a {expert_process_group.ndim}-D one")
        return expert_process_group.get_group(0)
    if isinstance(expert_process_group, dist.ProcessGroup):
        return expert_process_group
    raise TypeError("zero_ext.wrap: expert_process_group must be a 1-D DeviceMesh (mesh['dp_mod_ep']) or a "
                    f"ProcessGroup, got {type(expert_process_group).__name__}")


def mesh_inside(mesh, dp_ranks: Sequence[int]) -> bool:
    """Whether a 1-D DTensor mesh runs inside the data-parallel ranks (an ep
    mesh), rather than across them (a tp mesh)."""
    ranks = set(int(r) for r in dist.get_process_group_ranks(mesh.get_group(0)))
    return len(ranks) > 1 and ranks <= set(dp_ranks)


def find_experts(model: torch.nn.Module, process_group, expert_process_group) -> List[_Found]:
    """The model's expert parameters: DTensors Shard(0) on one 1-D mesh (ep)
    inside the data-parallel ranks, which with the expert group spans them
    (ep x dp_mod_ep = dp). Raises ValueError before anything changes."""
    expert_group = expert_group_of(expert_process_group)
    if expert_group is None or not (dist.is_available() and dist.is_initialized()):
        if expert_group is not None:
            raise ValueError("zero_ext.wrap: expert_process_group needs torch.distributed initialized")
        return []
    dp_ranks = sorted(data_parallel_ranks(process_group))
    expert_ranks = sorted(int(r) for r in dist.get_process_group_ranks(expert_group))
    me = dist.get_rank()
    if not set(expert_ranks) <= set(dp_ranks) or me not in expert_ranks:
        raise ValueError(
            f"zero_ext.wrap: expert_process_group spans ranks {expert_ranks[:16]}, which are not a subgroup of "
            f"process_group's ranks {dp_ranks[:16]} through this rank; pass mesh['dp_mod_ep'] of the mesh whose "
            "flattened data-parallel dimension is process_group.")

    def spec_of(p, where: str) -> TensorParallelSpec:
        placement = p.placements[0]
        if not (placement.is_shard() and placement.dim == 0):
            raise ValueError(
                f"zero_ext.wrap: expert parameter '{where}' has the placement {placement} on its expert-parallel "
                "mesh; zero_ext takes experts split along dim 0 (Shard(0): each ep rank holds whole experts).")
        return TensorParallelSpec(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride()))

    found = walk_dtensors(model, lambda p: p.device_mesh.ndim == 1 and mesh_inside(p.device_mesh, dp_ranks),
                          spec_of, "one expert-parallel")
    if not found:
        raise ValueError(
            "zero_ext.wrap: expert_process_group was given, but the model has no expert-parallel parameters: "
            "DTensors Shard(0) on a 1-D mesh (mesh['ep']) inside process_group's ranks. Distribute the experts "
            "over mesh['ep'] before wrap(), or leave expert_process_group out.")
    ep_ranks = sorted(int(r) for r in dist.get_process_group_ranks(found[0].spec.mesh.get_group(0)))
    if set(ep_ranks) & set(expert_ranks) != {me} or len(ep_ranks) * len(expert_ranks) != len(dp_ranks):
        raise ValueError(
            f"zero_ext.wrap: the experts are split over ranks {ep_ranks} (their mesh, ep) and expert_process_group "
            f"spans ranks {expert_ranks}; together they must span process_group's {len(dp_ranks)} ranks, meeting "
            "only at this rank: ep x dp_mod_ep = dp, e.g. mesh = init_device_mesh(device, (dp // ep, ep), "
            "mesh_dim_names=('dp_mod_ep', 'ep')) with process_group=mesh._flatten('dp') (or the world) and "
            "expert_process_group=mesh['dp_mod_ep'].")
    return found


@dataclass
class ExpertParallel:
    """A wrapped model's expert dimension: the ep mesh its experts are split
    over (and each expert leaf's spec, by id), and the expert group the
    core shards their buckets over."""
    mesh: object  # the 1-D ep DeviceMesh
    group: dist.ProcessGroup  # over ep
    size: int
    rank: int
    specs: Dict[int, TensorParallelSpec]  # id(local leaf) -> spec
    expert_group: dist.ProcessGroup  # dp_mod_ep
    expert_size: int
    expert_rank: int

    def spec_of(self, tensor: torch.Tensor) -> Optional[TensorParallelSpec]:
        return self.specs.get(id(tensor))

    def full(self, local: torch.Tensor, spec: TensorParallelSpec) -> torch.Tensor:
        """Collective over ep: the whole expert tensor from every ep rank's part."""
        sizes = spec.local_sizes()
        padded_shape = list(local.shape)
        padded_shape[0] = max(sizes)
        device = local.device
        if self.mesh.device_type == "cuda" and device.type != "cuda":  # NCCL moves the current device's tensors
            device = torch.device("cuda", torch.cuda.current_device())
        padded = torch.zeros(padded_shape, dtype=local.dtype, device=device)
        padded.narrow(0, 0, local.shape[0]).copy_(local)
        pieces = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(pieces, padded, group=self.group)
        return torch.cat([piece.narrow(0, 0, n) for piece, n in zip(pieces, sizes)], dim=0).to(local.device)

    def all_reduce(self, tensor: torch.Tensor, maximum: bool) -> None:
        """In place, over ep (a host tensor moved where the backend needs it)."""
        on = tensor
        if self.mesh.device_type == "cuda" and tensor.device.type != "cuda":
            on = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM, group=self.group)
        if on is not tensor:
            tensor.copy_(on)

    def local_of(self, full: torch.Tensor, spec: TensorParallelSpec) -> torch.Tensor:
        """This rank's experts of a whole expert tensor (a view)."""
        sizes = spec.local_sizes()
        return full.narrow(0, sum(sizes[:self.rank]), sizes[self.rank])

    def member_ranks(self) -> List[int]:
        """The expert group's global ranks, by group rank."""
        return [int(r) for r in dist.get_process_group_ranks(self.expert_group)]


def expert_parallel_of(found: List[_Found], specs: Dict[int, TensorParallelSpec],
                       expert_process_group) -> Optional[ExpertParallel]:
    if not found:
        return None
    mesh = found[0].spec.mesh
    group = mesh.get_group(0)
    expert_group = expert_group_of(expert_process_group)
    return ExpertParallel(mesh, group, dist.get_world_size(group), dist.get_rank(group), specs,
                          expert_group, dist.get_world_size(expert_group), dist.get_rank(expert_group))


def check_experts_supported(found: List[_Found], tensor_parallel: bool, deferred: bool,
                            optimizers: Sequence[torch.optim.Optimizer], elementwise, pipeline: bool) -> None:
    """What this version does not combine with experts on their own mesh
    dimension, refused before anything changes (alike on every rank)."""
    if not found:
        return
    if tensor_parallel:
        raise ValueError("zero_ext.wrap: expert_process_group with tensor-parallel parameters (a tp mesh) is not "
                         "supported in this version; wrap experts over ep x dp_mod_ep without tp.")
    if pipeline:
        raise ValueError("zero_ext.wrap: expert_process_group with pipeline_group is not supported in this version.")
    refuse_for_local_leaves(found, deferred, optimizers, elementwise, "expert-parallel experts",
                            "distribute the experts over mesh['ep']")
