"""wrap()'s middle steps, once the ranks agree on the plan: the model's own
process groups, the core's configuration (one typed CoreConfig), and the
core built from it, which nothing configures afterwards."""
from __future__ import annotations

import dataclasses
import datetime
import os
import uuid
from typing import List, Optional

import torch
import torch.distributed as dist

from .config import DynamicLossScale
from .deferred_init import move_to_device
from .plan import Checked
from .unit_advice import unit_advice
from ..groups import (ExpertParallel, Pipeline, TensorParallel, acquire_groups, acquire_mesh_groups, acquire_subgroups,
                      exchange_device, group_timeout)
from ..tools import CoreConfig, CoreHandles, core_loader, dtype_name, offload_file
from .arguments import QUANTIZATION_BLOCK


@dataclasses.dataclass(frozen=True)
class OwnGroups:
    """Process groups of zero_ext's own (groups/process_groups.py), owned by
    the model: the shard group and, at stage 3, a second one to gather on
    (csrc/units.h); across replicas (hybrid); a subgroup to gather again in
    (reshard_after_forward=<int>); and gloo groups over the same ranks for
    the collective checks' headers ([Note: collectives that prove what they
    are] in csrc/collective_sequence.h), each empty or None where not used.
    Even at world size 1 under torch.distributed the model gets groups of
    its own; their collectives over one rank are local copies there."""

    shard: List[dist.ProcessGroup]
    replica: Optional[dist.ProcessGroup]
    regather: List[dist.ProcessGroup]  # the subgroup, then its headers' group
    headers: List[dist.ProcessGroup]
    replica_headers: Optional[dist.ProcessGroup]
    expert: List[dist.ProcessGroup] = dataclasses.field(default_factory=list)  # the expert group, then its headers'

    def all(self) -> List[dist.ProcessGroup]:
        """Every group, for retiring them with the model."""
        return (self.shard + ([self.replica] if self.replica is not None else []) + self.headers
                + ([self.replica_headers] if self.replica_headers is not None else []) + self.regather + self.expert)


def acquire_own_groups(checked: Checked, model: torch.nn.Module, experts: Optional[ExpertParallel] = None) -> OwnGroups:
    """Collective over the model's ranks (every rank reaches it once the checks agree)."""
    options, topology = checked.options, checked.topology
    count = 2 if options.stage == 3 else 1
    base, device = topology.shard_group, checked.model_device
    shard: List[dist.ProcessGroup] = []
    replica = None
    if topology.replicate_group is not None:
        shard, replica = acquire_mesh_groups(base, topology.replicate_group, count, options.timeout, device, model)
    elif base is not None:
        shard = acquire_groups(base, count, options.timeout, device, model)
    regather = acquire_subgroups(base, checked.reshard.subgroup_size, topology.shard_rank, options.timeout, device,
                                 model) if checked.reshard.subgroup_size else []
    headers: List[dist.ProcessGroup] = []
    replica_headers = None
    # ZERO_EXT_COLLECTIVE_CHECKS=0 is for measuring what the checks cost
    # (benchmarks/step_time.py's -unchecked systems); never for training.
    if shard and topology.mesh_size > 1 and os.environ.get("ZERO_EXT_COLLECTIVE_CHECKS", "1") != "0":
        if topology.replicate_group is not None:
            headers, replica_headers = acquire_mesh_groups(base, topology.replicate_group, count, options.timeout,
                                                           device, model, backend="gloo")
        else:
            headers = acquire_groups(base, count, options.timeout, device, model, backend="gloo")
    expert: List[dist.ProcessGroup] = []
    if experts is not None:  # [Note: expert buckets] in csrc/layout.h; collective over the expert group
        expert = acquire_groups(experts.expert_group, 1, options.timeout, device, model)
        if headers:
            expert += acquire_groups(experts.expert_group, 1, options.timeout, device, model, backend="gloo")
    return OwnGroups(shard, replica, regather, headers, replica_headers, expert)


def mesh_token(checked: Checked) -> str:
    """New for every wrap() and the same on every rank of the mesh (mesh rank
    0's), so a later model, or a restarted job whose store outlived the last
    one (torchrun's agent store does), never reads an earlier one's posts.
    Collective: over the shard group, then across replicas."""
    topology = checked.topology
    token = uuid.uuid4().hex.encode()
    if topology.shard_group is None:
        return token.decode()
    device = exchange_device(topology.shard_group)
    value = torch.frombuffer(bytearray(token), dtype=torch.uint8).to(device)
    for group in (topology.shard_group, topology.replicate_group):
        if group is not None:  # each row takes its first rank's, then every row row 0's
            dist.broadcast(value, dist.get_global_rank(group, 0), group=group)
    return bytes(value.cpu().tolist()).decode()


def _precision_fields(checked: Checked) -> dict:
    precision = checked.options.precision
    fields = dict(compute_dtype=dtype_name(precision.compute_dtype), reduce_dtype=dtype_name(precision.reduce_dtype),
                  skip_nonfinite=checked.options.skip_nonfinite)
    scale = precision.loss_scale
    if isinstance(scale, DynamicLossScale):
        fields.update(loss_scaling=True, dynamic_loss_scale=True, initial_scale=float(scale.initial_scale),
                      growth_factor=float(scale.growth_factor), backoff_factor=float(scale.backoff_factor),
                      growth_interval=int(scale.growth_interval), min_scale=float(scale.min_scale),
                      hysteresis=int(scale.hysteresis))
    elif scale is not None:  # a static scale: overflowing steps still skipped
        fields.update(loss_scaling=True, initial_scale=float(scale))
    return fields


def _unit_fields(checked: Checked, model: torch.nn.Module, pipeline: Optional[Pipeline]) -> dict:
    if not checked.unit_names:
        return {}
    # A pipeline stage with reshard_after_forward=False keeps the root unit
    # too for the whole step (units.h, hold_kept_until_step): the stage is
    # gathered once per step, not once per microbatch.
    root = [0] if pipeline is not None and checked.options.reshard_after_forward is False else []
    advice = []
    if checked.topology.mesh_size > 1:  # for the errors that find ranks at different units
        advice = unit_advice(model, checked.unit_list, default_policy=checked.options.units is None)
    return dict(unit_names=checked.unit_names, unit_advice=advice,
                kept_after_forward=root + list(checked.reshard.kept),
                resharded_to_subgroup=list(checked.reshard.to_subgroup))


def _swap_fields(checked: Checked) -> dict:
    """This rank's offload file under offload_path, its space reserved."""
    options = checked.options
    if not checked.nvme:
        return {}
    return dict(swap_path=offload_file.file_path(options.offload_path, checked.topology.mesh_rank),
                swap_directory=str(options.offload_path), swap_params=options.offload_params == "nvme",
                swap_optimizer=options.offload_optimizer == "nvme", swap_threads=offload_file.IO_THREADS,
                swap_chunk_bytes=offload_file.CHUNK_BYTES, swap_max_writing_bytes=offload_file.WRITE_BEHIND_BYTES,
                swap_persist_bytes=options.persist_bytes)


def _diagnosis_fields(checked: Checked, groups: OwnGroups, key_space: str,
                      tensor_parallel: Optional[TensorParallel]) -> dict:
    """The collective checks' header groups, and the stall diagnosis: a wait
    stalled a quarter of the timeout (between 1 s and 5 s) compares notes
    with the other ranks (see csrc/communicator.h)."""
    fields: dict = {}
    if groups.headers:
        fields.update(shard_headers=groups.headers[0].group_name,
                      gather_headers=groups.headers[1].group_name if len(groups.headers) > 1 else "",
                      replica_headers=groups.replica_headers.group_name if groups.replica_headers is not None else "",
                      regather_headers=groups.regather[1].group_name if groups.regather else "")
    if groups.shard:
        topology = checked.topology
        limit: Optional[datetime.timedelta] = checked.options.timeout or group_timeout(topology.shard_group)
        seconds = limit.total_seconds() if limit is not None else 1800.0
        if tensor_parallel is not None:  # each data-parallel group of a tensor-parallel model posts apart
            key_space += f"-tp{tensor_parallel.rank}"
        fields.update(stall_seconds=min(max(seconds / 4, 1.0), 5.0), timeout_seconds=seconds, key_space=key_space,
                      shard_mesh_ranks=topology.shard_mesh_ranks(), replica_mesh_ranks=topology.replica_mesh_ranks())
    return fields


def _expert_fields(checked: Checked, groups: OwnGroups, experts: Optional[ExpertParallel]) -> dict:
    """The expert buckets and their group; where each mesh rank's expert
    group is, for the stall diagnosis (collective over the mesh)."""
    if experts is None:
        return {}
    shard_group = checked.topology.shard_group
    fields: dict = dict(expert_group=groups.expert[0].group_name, expert_buckets=list(checked.expert_buckets),
                        expert_headers=groups.expert[1].group_name if len(groups.expert) > 1 else "")
    if shard_group is not None:
        members = [dist.get_group_rank(shard_group, g) for g in experts.member_ranks()]
        first = torch.tensor([min(members)], dtype=torch.int64, device=exchange_device(shard_group))
        every = [torch.empty_like(first) for _ in range(dist.get_world_size(shard_group))]
        dist.all_gather(every, first, group=shard_group)
        fields.update(expert_mesh_ranks=members, expert_group_of_mesh_rank=[int(t.item()) for t in every])
    return fields


def core_config(checked: Checked, groups: OwnGroups, model: torch.nn.Module, key_space: str,
                tensor_parallel: Optional[TensorParallel], pipeline: Optional[Pipeline] = None,
                experts: Optional[ExpertParallel] = None) -> CoreConfig:
    """Everything the core is built with besides the parameters' geometry."""
    options = checked.options
    weight_bits, grad_bits = options.compression_bits()
    return CoreConfig(
        stage=options.stage,
        shard_group=groups.shard[0].group_name if groups.shard else "",
        gather_group=groups.shard[1].group_name if len(groups.shard) > 1 else "",
        replica_group=groups.replica.group_name if groups.replica is not None else "",
        regather_group=groups.regather[0].group_name if groups.regather else "",
        prefetch=options.prefetch, offload=options.offload, deferred=checked.deferred is not None,
        max_live_bytes=options.max_live_bytes,
        weight_bits=weight_bits, grad_bits=grad_bits, quant_block=QUANTIZATION_BLOCK,
        reduce_at_read=pipeline is not None,  # [Note: reductions at read] in csrc/backward_round.h
        **_precision_fields(checked), **_unit_fields(checked, model, pipeline), **_swap_fields(checked),
        **_diagnosis_fields(checked, groups, key_space, tensor_parallel), **_expert_fields(checked, groups, experts))


def build_core(checked: Checked, config: CoreConfig) -> CoreHandles:
    """The C++ core (torch.classes.zero_ext.ShardedModel), by concern. What
    can fail here fails on this rank alone (memory for the shards, the
    offload file's space): the caller settles it with the other ranks."""
    if checked.deferred:
        move_to_device(checked.deferred, checked.ordered, checked.names)
    model = core_loader.ShardedModel(checked.ordered, checked.names, [int(p.requires_grad) for p in checked.ordered],
                                     checked.counts, checked.unit_of_bucket, checked.owners, config.to_core())
    return CoreHandles.of(model)
