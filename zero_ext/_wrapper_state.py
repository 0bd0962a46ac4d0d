"""ZeroState: everything zero_ext keeps for one wrapped model (model._zero_ext)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import List, Optional, Set

import torch
import torch.distributed as dist


@dataclass
class ZeroState:
    """Everything zero_ext keeps for one wrapped model (model._zero_ext)."""

    model_ref: "weakref.ref[torch.nn.Module]"  # weak: the model holds this state
    stage: int
    core: object  # torch.classes.zero_ext.ShardedModel: the C++ core
    process_group: Optional[dist.ProcessGroup]  # zero_ext's own reduction group (the shard group)
    world_size: int  # of the shard group
    replicate_group: Optional[dist.ProcessGroup]  # hybrid sharding: across the copies of the shard (None: flat)
    replicas: int  # rows of the mesh (1: flat)
    shard_rank: int
    replica_rank: int
    device: torch.device
    params: List[torch.nn.Parameter]  # trainable, in bucket order
    names: List[str]
    bucketed: List[torch.nn.Parameter]  # what the core indexes (frozen too: stage 3, or mixed precision)
    param_ids: Set[int]
    bucketed_names: List[str]
    compute_dtype: Optional[torch.dtype]  # mixed precision: what parameters compute in
    cast_inputs: bool  # floating forward inputs are cast to compute_dtype
    sharded_optimizer: bool  # the optimizer steps zero_ext's segments (not the parameters)
    offload: bool  # masters, gradient accumulators and optimizer state in host memory

    @property
    def mesh_size(self) -> int:
        """Every rank the model lives on: shard group size times replicas."""
        return self.world_size * self.replicas

    @property
    def mesh_rank(self) -> int:
        return self.replica_rank * self.world_size + self.shard_rank

    def check_parameters_unchanged(self) -> None:
        """Once per step: a parameter replaced by a new object after wrap()
        would train on silently missing gradients."""
        model = self.model_ref()
        current = [p for p in model.parameters() if p.requires_grad]
        if len(current) == len(self.params) and all(id(p) in self.param_ids for p in current):
            return
        names = {id(p): n for n, p in model.named_parameters()}
        new = [names[id(p)] for p in current if id(p) not in self.param_ids]
        gone = [n for p, n in zip(self.params, self.names) if id(p) not in names or not p.requires_grad]
        raise RuntimeError(
            "zero_ext: the model's trainable parameters changed after zero_ext.wrap() "
            f"(new or replaced: {new or 'none'}; no longer trainable or removed: {gone or 'none'}). "
            "Their gradients would not be reduced or stepped. Update parameters in place "
            "(param.data.copy_(...)) or freeze/replace them before calling wrap()."
        )
