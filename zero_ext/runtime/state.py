"""ZeroState: everything zero_ext keeps for one wrapped model (model._zero_ext),
and how a model or one of its modules finds it."""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import torch
import torch.distributed as dist

from ..groups import TensorParallel
from ..optim import StepRound
from ..tools import CoreHandles


@dataclass
class ZeroState:
    """Everything zero_ext keeps for one wrapped model (model._zero_ext)."""

    model_ref: "weakref.ref[torch.nn.Module]"  # weak: the model holds this state
    stage: int
    handles: CoreHandles  # the C++ core by concern (tools/core_handles.py), the only way to it
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
    offload: bool  # masters, gradient accumulators and optimizer state in host memory
    offload_path: Optional[str] = None  # offload_*="nvme": the directory of this rank's offload files
    streams_optimizer: bool = False  # offload_optimizer="nvme": the step streams state through a file
    streamed: list = field(default_factory=list)  # its optimizers' StreamedSteps (optim/streamed_step.py)
    bucket_of_segment: Dict[int, int] = field(default_factory=dict)  # id(segment) -> bucket, filled once when streamed
    step_round: Optional[StepRound] = None  # the step of the model's optimizers (set at construction)
    frozen_at_wrap: Set[int] = field(default_factory=set)  # ids of parameters frozen then
    output_dtype: Optional[torch.dtype] = None  # MixedPrecision.output_dtype: the forward's outputs cast to it
    unit_of_module: Dict[int, int] = field(default_factory=dict)  # stage 3: id(member module) -> unit index
    # A tensor-parallel model: the tp group and each local leaf's spec
    # (groups/tensor_parallel.py, [Note: local leaves]); None otherwise.
    tensor_parallel: Optional[TensorParallel] = None
    # Experts on their own mesh dimension (wrap(expert_process_group=)): the
    # ep mesh, the expert group and each expert leaf's spec
    # (groups/experts.py, [Note: expert parallelism]); None otherwise.
    experts: Optional[object] = None
    # A pipeline stage (wrap(pipeline_group=)): the pp group across the
    # stages (groups/pipeline.py); None otherwise.
    pipeline: Optional[Pipeline] = None
    # wrap(replicas=): the replicas this job trains with (groups/replicas.py,
    # [Note: a step across replicas]); None otherwise.
    replica_set: Optional[object] = None
    # zero_ext.save(..., async_save=True): the save in flight (files/asynchronous.py,
    # waited for by the next save or load) and the host buffers its snapshot reuses.
    async_save: Optional[object] = None
    save_stager: Optional[object] = None

    def __post_init__(self) -> None:
        self.step_round = StepRound(self.handles, self.tensor_parallel)

    # The modes, as the core's layout decided them at wrap() (csrc/layout.h):
    # read here, and nowhere else compared with stage numbers.
    @functools.cached_property
    def params_sharded(self) -> bool:
        """Stage 3: parameters hold no memory between uses (gathered per unit)."""
        return bool(self.handles.units.params_sharded())

    @functools.cached_property
    def replicated(self) -> bool:
        """Stage 0 with fp32 masters or a low-precision reduce: every rank
        holds the whole gradient and steps the whole model on zero_ext's copies."""
        return bool(self.handles.reduction.replicated())

    @functools.cached_property
    def grads_sharded(self) -> bool:
        """Stages 1-3: each rank holds the reduced gradient of its shard only,
        so its optimizer state is that of its shard."""
        return self.handles.reduction.grad_layout().grads_sharded

    @functools.cached_property
    def whole_params(self) -> bool:
        """Stages 1-3 with an optimizer that is not elementwise: each
        parameter has one owner rank, whose shard holds it whole
        (optim/ownership.py)."""
        return bool(self.handles.optimizer.whole_params())

    @functools.cached_property
    def sharded_optimizer(self) -> bool:
        """The optimizer steps zero_ext's segments (a shard, or the replicated
        copies), not the model's parameters."""
        return self.grads_sharded or bool(self.handles.optimizer.has_masters())

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
        if all(id(p) in self.param_ids for p in current):
            # Trainable at wrap and frozen since (requires_grad_(False)):
            # such a parameter gets no gradient, as one unused on every rank,
            # and the optimizer skips it as torch's would (grad None).
            return
        names = {id(p): n for n, p in model.named_parameters()}
        new = [names[id(p)] for p in current if id(p) not in self.param_ids]
        gone = [n for p, n in zip(self.params, self.names) if id(p) not in names]
        if not gone and all(id(p) in self.frozen_at_wrap for p in current if id(p) not in self.param_ids):
            raise RuntimeError(
                f"zero_ext: {new} were frozen (requires_grad=False) at zero_ext.wrap() and are trainable now. "
                "zero_ext reduces and steps only what was planned as trainable at wrap(); a parameter trainable "
                "then may be frozen and unfrozen freely. For progressive unfreezing, pass "
                "zero_ext.wrap(..., unfreeze_later=True) with these parameters in the optimizer (they are planned as "
                "trainable and frozen again), or wrap with them trainable and freeze them right after wrap().")
        raise RuntimeError(
            "zero_ext: the model's trainable parameters changed after zero_ext.wrap() "
            f"(new or replaced: {new or 'none'}; no longer trainable or removed: {gone or 'none'}). "
            "Their gradients would not be reduced or stepped. Update parameters in place "
            "(param.data.copy_(...)) or freeze/replace them before calling wrap()."
        )
