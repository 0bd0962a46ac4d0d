"""What wrap() checks and plans on this rank before the ranks agree: the
arguments, the launch, a meta model's plan, the units and buckets, the
optimizer owners, the fingerprint's fields (check_and_plan); which ranks
settle its errors together (agreement_ranks, [Note: one-rank failures at
wrap] in fingerprint.py); and how long it waits for them to arrive
(arrival_bound, [Note: arrival at wrap] in groups/arrival.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .buckets import plan_buckets
from .deferred_init import plan_deferred
from ..groups import (Pipeline, TensorParallel, Topology, data_parallel_ranks, group_timeout, pooled_groups,
                      resolve_topology)
from ..groups import arrival as arrivals
from ..optim import WHOLE, optimizer_sharding, plan_owners
from ..tools import __version__
from .units import Unit, assign_parameters, merge_bytes, resolve_units
from .reshard import plan_reshard
from .arguments import Options, check_backend, check_launch, check_wrap_arguments, optimizer_list, parse_timeout
from .fingerprint import wrap_fields


def _plan_units(model: torch.nn.Module, units: List[Unit]):
    """Stage 3: one bucket per unit and dtype, frozen parameters included.
    Blocks come in reverse registration order (the order backward finishes
    them) and the root last, since its parameters are in use until the end."""
    owner = assign_parameters(model, units)
    by_unit: List[List[torch.nn.Parameter]] = [[] for _ in units]
    for p in model.parameters():
        by_unit[owner[id(p)]].append(p)
    ordered, counts, unit_of_bucket = [], [], []
    for u in list(range(len(units) - 1, 0, -1)) + [0]:
        by_dtype: dict = {}
        for p in by_unit[u]:
            by_dtype.setdefault(p.dtype, []).append(p)
        for params in by_dtype.values():
            ordered.extend(params)
            counts.append(len(params))
            unit_of_bucket.append(u)
    return ordered, counts, unit_of_bucket


def _frozen_to_compute_in_low_precision(model: torch.nn.Module, options: Options) -> List[torch.nn.Parameter]:
    """Stages 0-2 under mixed precision: the frozen fp32 parameters. They
    compute in the compute dtype like the trainable ones (as FSDP2's
    MixedPrecisionPolicy and DeepSpeed's bf16 do: a frozen LoRA base weight
    meets the cast inputs), so they are bucketed too, for the core to cast and
    keep their fp32 values as masters; in buckets of their own, which are
    never reduced, stepped or gathered after a step. In fp32 they stay outside."""
    if options.precision.compute_dtype is None:
        return []
    return [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32]


def _split_by_optimizer(ordered: List[torch.nn.Parameter], counts: List[int],
                        optimizers: List[torch.optim.Optimizer], unit_of_bucket: List[int]):
    """Each bucket cut into runs of one optimizer's parameters (frozen ones go
    with the run they follow): a step refreshes only its optimizer's buckets."""
    if len(optimizers) < 2:
        return ordered, counts, unit_of_bucket
    which = {id(p): k for k, opt in enumerate(optimizers) for g in opt.param_groups for p in g["params"]}
    out, out_counts, out_units, first = [], [], [], 0
    for b, count in enumerate(counts):
        members = ordered[first:first + count]
        first += count
        runs: Dict[int, List[torch.nn.Parameter]] = {}
        last = None
        for p in members:
            k = which.get(id(p), last if last is not None else -1)
            runs.setdefault(k, []).append(p)
            last = k
        for run in runs.values():
            out += run
            out_counts.append(len(run))
            if unit_of_bucket:
                out_units.append(unit_of_bucket[b])
    return out, out_counts, out_units


def _split_experts(ordered: List[torch.nn.Parameter], counts: List[int], unit_of_bucket: List[int],
                   expert_ids: set) -> Tuple[List[torch.nn.Parameter], List[int], List[int], List[int]]:
    """Each bucket cut in two, its other parameters then its experts
    ([Note: expert buckets] in csrc/layout.h: an expert bucket is sharded
    over the expert group); also the indices of the expert buckets."""
    if not expert_ids:
        return ordered, counts, unit_of_bucket, []
    out, out_counts, out_units, expert_buckets, first = [], [], [], [], 0
    for b, count in enumerate(counts):
        members = ordered[first:first + count]
        first += count
        for is_expert in (False, True):
            run = [p for p in members if (id(p) in expert_ids) == is_expert]
            if not run:
                continue
            if is_expert:
                expert_buckets.append(len(out_counts))
            out += run
            out_counts.append(len(run))
            if unit_of_bucket:
                out_units.append(unit_of_bucket[b])
    return out, out_counts, out_units, expert_buckets


def _plan(model: torch.nn.Module, trainable: List[torch.nn.Parameter], options: Options,
          optimizers: List[torch.optim.Optimizer]):
    """Units (stage 3) and buckets: the parameters in bucket order, each
    bucket's parameter count and (stage 3) unit."""
    if options.stage != 3:
        ordered, counts = plan_buckets(trainable, options.bucket_bytes)
        ordered, counts, _ = _split_by_optimizer(ordered, counts, optimizers, [])
        # After the trainable buckets: with nothing to wait for, a frozen
        # bucket is retired as soon as the launch order reaches it.
        frozen, frozen_counts = plan_buckets(_frozen_to_compute_in_low_precision(model, options),
                                             options.bucket_bytes, first_bucket_bytes=options.bucket_bytes)
        return [], ordered + frozen, counts + frozen_counts, []
    # The default policy merges consecutive tiny blocks until a unit holds
    # 4 MiB (bucket_mb when smaller): enough to amortize a collective, small
    # enough to keep stage 3's working buffers small (zero_ext/wrapping/units.py).
    unit_list = resolve_units(model, options.units, min_bytes=merge_bytes(options.bucket_bytes))
    ordered, counts, unit_of_bucket = _plan_units(model, unit_list)
    ordered, counts, unit_of_bucket = _split_by_optimizer(ordered, counts, optimizers, unit_of_bucket)
    return unit_list, ordered, counts, unit_of_bucket


def _unit_names(model: torch.nn.Module, unit_list: List[Unit]) -> List[str]:
    """Each unit's module path (merged units: first and last member), root ''."""
    path = {id(m): n for n, m in model.named_modules()}
    names = []
    for members in unit_list:
        first = path.get(id(members[0]), "?")
        names.append(first if len(members) == 1 else f"{first} .. {path.get(id(members[-1]), '?')}")
    return names


@dataclass
class Checked:
    """What wrap()'s checks and plans found on this rank, before the ranks agree."""
    options: Options
    optimizers: List[torch.optim.Optimizer]
    trainable: List[torch.nn.Parameter]
    export_dtype: Optional[torch.dtype]
    deferred: object
    model_device: torch.device
    nvme: bool
    topology: Topology
    unit_list: List[Unit]
    ordered: List[torch.nn.Parameter]
    counts: List[int]
    unit_of_bucket: List[int]
    owners: List[int]
    expert_buckets: List[int]  # indices of the buckets sharded over the expert group
    names: List[str]
    unit_names: List[str]
    reshard: object
    fields: List[Tuple[str, object, str]]


def check_and_plan(model, optimizer, stage, process_group, mixed_precision, offload_optimizer, offload_params,
                   offload_path, units, bucket_mb, timeout, prefetch, skip_nonfinite, device, param_init_fn,
                   reshard_after_forward, max_live_mb, persist_kb, compress_weights, compress_grads,
                   experts=None) -> Checked:
    """Everything wrap() checks and plans before its first collective; raises
    on bad input, here or on this rank only (a path, a device)."""
    optimizers = optimizer_list(optimizer)
    trainable, options = check_wrap_arguments(model, optimizers, stage, mixed_precision, offload_optimizer,
                                              units, bucket_mb, timeout, prefetch, skip_nonfinite,
                                              reshard_after_forward, offload_params, offload_path,
                                              max_live_mb, persist_kb, compress_weights, compress_grads)
    check_launch(process_group)
    # What transformers' model.dtype says before mixed precision casts the
    # parameters: the dtype exports declare (as the unwrapped model's would).
    export_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    deferred = plan_deferred(model, device, param_init_fn)
    model_device = deferred.device if deferred else trainable[0].device
    if options.offload_params == "cpu" and model_device.type != "cpu":
        raise NotImplementedError(
            f"zero_ext.wrap: offload_params='cpu' for a model on {model_device.type} is not available in this "
            "version yet (on a CPU model it is accepted: the shards are in host memory already); "
            "offload_optimizer='cpu' moves the fp32 masters and optimizer state off the device meanwhile")
    nvme = "nvme" in (options.offload_optimizer, options.offload_params)
    if nvme and model_device.type != "cpu":
        raise NotImplementedError(
            f"zero_ext.wrap: 'nvme' offload for a model on {model_device.type} is not available in this version "
            "(it runs on CPU models); offload_optimizer='cpu' moves the fp32 masters and optimizer state off the "
            "device meanwhile")
    topology = resolve_topology(process_group, model_device)
    if nvme and topology.replicate_group is not None:
        raise NotImplementedError(
            "zero_ext.wrap: 'nvme' offload with hybrid sharding (a 2-D process_group) is not available in this "
            "version; pass a flat process group, or offload_optimizer='cpu'")
    for group in (topology.shard_group, topology.replicate_group):
        check_backend(group, model_device)
    unit_list, ordered, counts, unit_of_bucket = _plan(model, trainable, options, optimizers)
    ordered, counts, unit_of_bucket, expert_buckets = _split_experts(ordered, counts, unit_of_bucket,
                                                                     set(experts.specs) if experts else set())
    owners: List[int] = []
    if options.whole_params:  # the parameters of optimizers that are not elementwise: stepped whole by one rank
        whole = {id(p) for opt in optimizers if optimizer_sharding(opt, shards_state=options.stage > 0) == WHOLE
                 for g in opt.param_groups for p in g["params"]}
        ordered, owners = plan_owners(ordered, counts, topology.shard_size, whole)
    names_by_id = {id(p): n for n, p in model.named_parameters()}
    names = [names_by_id[id(p)] for p in ordered]
    unit_names = _unit_names(model, unit_list)
    reshard = plan_reshard(options.reshard_after_forward, unit_list, unit_names, topology.shard_size)
    fields = wrap_fields(
        options, topology, ordered, names, counts, unit_names, unit_of_bucket, list(model.named_buffers()),
        deferred is not None, pooled_groups(), f"zero_ext {__version__}, torch {torch.__version__}",
        owners or [-1] * len(ordered), reshard, device=model_device)
    fields.append(("expert_process_group",
                   (experts.size, experts.expert_size, expert_buckets) if experts else None,
                   f"experts split over ep {experts.size}, sharded over an expert group of {experts.expert_size} "
                   f"({len(expert_buckets)} bucket{'s' if len(expert_buckets) != 1 else ''})" if experts
                   else "no expert_process_group"))
    return Checked(options, optimizers, trainable, export_dtype, deferred, model_device, nvme, topology, unit_list,
                    ordered, counts, unit_of_bucket, owners, expert_buckets, names, unit_names, reshard, fields)


@dataclass
class AgreementRanks:
    """The ranks of wrap()'s agreement: the data-parallel mesh and, for a
    tensor-parallel model, the tp group across it, for a pipeline stage, the
    pp group across both."""
    topology: Topology
    tp_group: Optional[dist.ProcessGroup]
    pp_group: Optional[dist.ProcessGroup] = None

    @property
    def across(self) -> List[Optional[dist.ProcessGroup]]:
        """The groups a failure travels across after the mesh, in order."""
        return [self.tp_group, self.pp_group]


def agreement_ranks(process_group, model, tensor_parallel: Optional[TensorParallel],
              checked: Optional[Checked], pipeline: Optional[Pipeline] = None) -> Optional[AgreementRanks]:
    """Who this rank agrees with; None where nobody waits for it (one
    process, a group of one) or it cannot take part (torch.distributed not
    initialized, a process_group it is not in): it then raises alone. A rank
    whose checks failed finds its groups as the others do, from the same
    arguments, without the checks that failed."""
    if checked is not None:
        topology = checked.topology
    else:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        try:
            topology = resolve_topology(process_group, None)
        except Exception:  # noqa: BLE001 - its own error is raised here alone, as on every rank alike
            return None
    if topology.shard_group is None:
        return None
    if tensor_parallel is not None:
        tp_group = tensor_parallel.group
    else:  # found as find_tensor_parallel finds it, if it failed before
        mesh = (arrivals.first_tensor_parallel_mesh(model, data_parallel_ranks(process_group))
                if checked is None else None)
        tp_group = mesh.get_group(0) if mesh is not None else None
    pp_group = pipeline.group if pipeline is not None and pipeline.size > 1 else None
    if topology.mesh_size < 2 and tp_group is None and pp_group is None:
        return None
    return AgreementRanks(topology, tp_group, pp_group)


def arrival_bound(timeout, topology: Topology) -> Tuple[float, str]:
    """How long wrap() waits for the other ranks to reach it, and whence."""
    try:
        limit = parse_timeout(timeout)
    except (TypeError, ValueError):  # raised by the checks, on every rank
        limit = None
    if limit is not None:
        return limit.total_seconds(), f"the wrap's timeout={limit.total_seconds():g} s"
    limit = group_timeout(topology.shard_group)
    if limit is not None:
        return limit.total_seconds(), f"the process group's timeout, {limit.total_seconds():g} s"
    return DEFAULT_ARRIVAL_S, f"{DEFAULT_ARRIVAL_S:g} s, no timeout being known"


# Where neither wrap's timeout nor the process group's is known: torch's default.
DEFAULT_ARRIVAL_S = 1800.0
