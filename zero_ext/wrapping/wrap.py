"""zero_ext.wrap(): validate (zero_ext/wrapping/arguments.py), lay out units and buckets, build the C++
core, hook the model, shard the optimizer."""
from __future__ import annotations

import datetime
import hashlib
import math
import os
import weakref
from typing import Callable, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist

from .config import MixedPrecision
from ..files import install_pretrained_export, local_views, recover_from_peer
from .deferred_init import has_meta_parameters, materialize
from ..groups import (ExpertParallel, Pipeline, Ranks, Replicas, ReplicaSet, TensorParallel, check_experts_supported,
                      check_supported, expert_parallel_of, find_experts, find_tensor_parallel, localize, pipeline_of,
                      retire_if_failed, tensor_parallel_of)
from ..groups import arrival as arrivals
from ..groups import stall_query as whereabouts
from ..optim import WHOLE, exchange_across_replicas, optimizer_sharding, shard_optimizer
from ..runtime import ZeroState, compiled_units, install_forward_hooks, swap_module_class
from ..tools import CoreHandles, attach_state, faults
from .units import Unit, assign_parameters
from .arguments import optimizer_list
from .plan import Checked, agreement_ranks, arrival_bound, check_and_plan
from .core_build import OwnGroups, acquire_own_groups, build_core, core_config, mesh_token
from .fingerprint import (check_pipeline_agree, check_ranks_agree, check_tensor_parallel_agree, pipeline_fields,
                          settle_failures, tensor_parallel_fields)


def _broadcast_buffers(model: torch.nn.Module, handles: CoreHandles) -> None:
    """Every rank starts from rank 0's buffers."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            handles.collectives.mesh_broadcast_from_rank0(buffer, f"wrap(): broadcasting buffer {name} from rank 0")


def wrap(
    model: torch.nn.Module,
    optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
    stage: int = 2,
    process_group: Union[None, dist.ProcessGroup, "torch.distributed.device_mesh.DeviceMesh"] = None,
    mixed_precision: Union[None, str, MixedPrecision] = None,
    offload_optimizer: Optional[str] = None,
    offload_params: Optional[str] = None,
    offload_path: Union[None, str, "os.PathLike[str]"] = None,
    units: Union[None, Set[type], Callable[[torch.nn.Module], bool]] = None,
    bucket_mb: Optional[float] = None,
    timeout: Union[None, float, datetime.timedelta] = None,
    prefetch: int = 1,
    skip_nonfinite: bool = False,
    device: Union[None, str, torch.device] = None,
    param_init_fn: Optional[Callable[[torch.nn.Module], None]] = None,
    reshard_after_forward: Union[None, bool, int, Callable[[torch.nn.Module], Union[bool, int]]] = None,
    max_live_mb: Optional[float] = None,
    persist_kb: Optional[float] = None,
    unfreeze_later: bool = False,
    compress_weights: Optional[str] = None,
    compress_grads: Optional[str] = None,
    pipeline_group: Union[None, dist.ProcessGroup, "torch.distributed.device_mesh.DeviceMesh"] = None,
    expert_process_group: Union[None, dist.ProcessGroup, "torch.distributed.device_mesh.DeviceMesh"] = None,
    replicas: Optional[Replicas] = None,
) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Makes `model` and `optimizer` ZeRO data parallel, in place.

    Train with plain ``loss.backward(); optimizer.step(); optimizer.zero_grad()``.
    Gradients are averaged over the ranks of `process_group` (the world group
    by default; a single process if torch.distributed is not initialized).
    A 2-D DeviceMesh (replicate, shard) shards over each row of the mesh and
    replicates across rows (hybrid sharding, FSDP2's HSDP): gradients are
    reduce-scattered within the row, and only the shard all-reduced across
    rows. Shard within a node, replicate across nodes.
    A model made tensor parallel with torch's parallelize_module (DTensor
    parameters on a 1-D "tp" mesh) takes the data-parallel dimension,
    process_group=mesh["dp"] (or mesh["replicate", "shard"]): each
    parameter's tp-local tensor is sharded over it (docs/multi-node.md).

    Args:
        model: module already on its device; modified in place, same names.
        optimizer: a torch.optim.Optimizer over ``model.parameters()``, or a
            list or tuple of them over disjoint parameters (Muon for the
            hidden matrices, AdamW for the rest). Elementwise optimizers
            (Adam, SGD, ...) are sharded element by element; any other
            (Muon, Adafactor, LAMB, one zero_ext does not know) by whole
            parameter, each stepped on one owner rank; LBFGS only at stage 0.
        stage: 0 replicated (DDP-like), 1 sharded optimizer state,
            2 also sharded gradients, 3 also sharded parameters.
        mixed_precision: None (fp32), "bf16", "fp16" (with dynamic loss
            scaling) or a MixedPrecision; the optimizer steps fp32 masters.
        offload_optimizer: "cpu" keeps fp32 masters, gradient shards and
            optimizer state in host memory (Adam/AdamW step in C++);
            "nvme" keeps them, and the gradient shards, in files under
            offload_path, streamed through the step bucket by bucket.
        offload_params: stage 3: "cpu" keeps the parameter shards in host
            memory between uses: accepted on a CPU model, where they are
            already; not yet available for a model on an accelerator.
            "nvme" keeps them in files under offload_path, read one unit
            ahead of its gather (CPU models in this version).
        offload_path: the directory of "nvme" offload files (created if
            missing; each rank makes its own files there, removed when the
            process ends).
        units: stage 3: submodules gathered as one (a set of module classes
            or a callable module -> bool), each a unit of its own; default:
            each repeated block, consecutive blocks under 4 MiB (or under
            bucket_mb, when smaller) merged into one unit of at least that.
        bucket_mb: gradient bucket size in MiB, the size that amortizes one
            collective (default 25; 4 with offload to files, where it sets
            the memory bound). Stage 3 reduces (and gathers) one bucket per
            unit: a bucket_mb under 4 lowers the size the default units
            policy merges small blocks to.
        timeout: bound in seconds on every collective wait, and on wrap()'s
            wait for every rank to reach it (a rank still in its set-up past
            it is named; default: the process group's timeout).
        prefetch: stage 3: units whose all-gather runs ahead of use.
        skip_nonfinite: skip (on every rank, with a warning) an optimizer
            step whose gradients hold inf/nan on any rank; off by default,
            as in PyTorch. fp16 loss scaling skips such steps regardless.
            ``optimizer.skipped_steps`` counts the skipped steps.
        device: a model whose parameters are on the meta device (built
            under ``zero_ext.empty_init()``) is materialized there, shard
            by shard (default: the current CUDA device, else the CPU).
        param_init_fn: initializes such a model: called as fn(module) on
            each module with meta state, in ``model.named_modules()``
            order (default: the module's own ``reset_parameters()``; a
            transformers model, by default or given its own
            ``_init_weights``: what its normal construction runs,
            reset_parameters() then post_init's _init_weights, replayed
            unit by unit from the same random states).
            ``zero_ext.skip_init``: nothing is initialized (weights come
            from ``zero_ext.load_weights`` next; NaN until then).
        reshard_after_forward: stage 3: True (default) releases each unit
            after its forward and gathers it again for its backward; False
            keeps it gathered from forward to backward (one gather less per
            unit and step, for the memory of the units kept); an int k
            dividing the shard group's size keeps 1/k of each unit after
            forward and gathers it again within subgroups of k consecutive
            ranks (a node); a callable module -> bool | int decides per unit
            (asked about each member). 1 means False, the group size True.
        max_live_mb: stage 3: the most MiB of full parameters gathered at
            once that prefetch may reach (a unit in use is always gathered);
            None: the prefetch count alone bounds it. DeepSpeed's
            stage3_max_live_parameters, in bytes.
        persist_kb: with offload to files ("nvme"): buckets (stage 3: units)
            whose shard is smaller than this many KiB stay in memory, where
            reading them would cost a drive's latency for little memory
            (default 128). DeepSpeed's stage3_param_persistence_threshold.
        unfreeze_later: parameters frozen now (requires_grad=False) that are
            in the optimizer may be made trainable after wrap(): they are
            planned as trainable and frozen again before wrap() returns
            (costing their gradient buffers at stages 0-2 meanwhile;
            optimizer state comes at their first step). Without it, only parameters trainable at wrap()
            may change requires_grad later (fp32 parameters only: zero_ext
            trains fp32 masters).
        compress_weights: stage 3: "int8" all-gathers parameters as
            block-quantized int8 (a scale per 2048 values; ZeRO++'s qwZ):
            forward and backward compute with the dequantized values, the
            fp32 masters, optimizer and checkpoints stay exact. None: off.
        compress_grads: stages 2-3: "int8" or "int4" reduce-scatters
            gradients as block-quantized integers summed in fp32, with error
            feedback (what rounding lost is added to the bucket's next
            reduction; ZeRO++'s qgZ). Over a hybrid mesh, within the shard
            group, and across replicas where a quantized all-gather and sum
            sends fewer bytes (fp32 gradients: up to 7 replicas for int8,
            15 for int4; bf16: 3 and 7). None: off. See
            ``zero_ext.traffic(model)`` for the bytes sent.
        pipeline_group: a pipeline stage (torch.distributed.pipelining):
            the pp dimension (mesh["pp"], a 1-D DeviceMesh or a
            ProcessGroup) across the ranks holding the other stages. Every
            backward then accumulates locally and the step's first read of
            the gradients (step, clip, full_grads) reduces them once, so
            a schedule's microbatches cost one reduction per step; clip
            norms and DCP saves span every stage (docs/multi-node.md).
        expert_process_group: experts on their own mesh dimension: a model
            whose experts are expert parallel (DTensors Shard(0) over
            mesh["ep"], with its own token dispatch) gives the ranks that
            hold the same experts (mesh["dp_mod_ep"]; ep x dp_mod_ep =
            process_group's ranks). The experts are sharded over it, every
            other parameter over process_group; every gradient is averaged
            over the whole data-parallel batch (docs/multi-node.md).
        replicas: zero_ext.Replicas(coordinator="HOST:PORT", replica_id=ID):
            this job is one replica of several (each its own torchrun job,
            sharded over its own ranks), whose gradients are averaged over
            the live replicas before every step; a replica that fails is
            left out and one that starts again takes a live one's state
            (docs/faults.md, "Surviving a lost replica").
    Returns:
        ``(model, optimizer)``, the same objects (a list stays that list).
    Raises:
        TypeError, ValueError: bad input, before any collective whose size
            depends on it; an error of the checks on some ranks only (an
            offload_path, a device) is raised on every rank, naming them.
        RuntimeError: a rank did not reach wrap() within the timeout.
    """
    arguments = {name: value for name, value in locals().items()
                 if name not in ("unfreeze_later", "pipeline_group", "expert_process_group")}
    arguments["pipeline"] = None
    # First: the other ranks hear that this one reached wrap(), so their wait
    # before the first collective is bounded and names the ranks that never
    # come ([Note: arrival at wrap] in groups/arrival.py).
    arrival = arrivals.announce(arrivals.wrap_ranks(model, process_group))
    # An error of the checks is raised on every rank at once, after the ranks
    # exchanged it ([Note: one-rank failures at wrap] in wrapping/fingerprint.py).
    failure: Optional[Exception] = None
    restore: Callable[[], None] = lambda: None
    later: List[torch.nn.Parameter] = []
    try:
        try:
            if not isinstance(unfreeze_later, bool):
                raise TypeError(f"zero_ext.wrap: unfreeze_later must be True or False, got {unfreeze_later!r}")
            optimizers = optimizer_list(optimizer)
            arguments["pipeline"] = pipeline_of(pipeline_group)
            # A tensor-parallel model: its DTensor parameters become local leaves
            # first ([Note: local leaves] in groups/tensor_parallel.py), put back if wrap() fails.
            # Experts on their own mesh dimension become local leaves too (groups/experts.py).
            module = isinstance(model, torch.nn.Module)
            experts = find_experts(model, process_group, expert_process_group) if module else []
            found = find_tensor_parallel(model, process_group, experts) if module else []
            check_supported(found, has_meta_parameters(model) if found else False, optimizers, stage, _elementwise)
            check_experts_supported(experts, bool(found), has_meta_parameters(model) if experts else False,
                                    optimizers, _elementwise, arguments["pipeline"] is not None)
            expert_specs, restore_experts = localize(experts, optimizers)
            specs, restore_tp = localize(found, optimizers)
            restore = lambda: (restore_tp(), restore_experts())  # noqa: E731
            arguments["tensor_parallel"] = tensor_parallel_of(found, specs)
            arguments["experts"] = expert_parallel_of(experts, expert_specs, expert_process_group)
            # Planned as trainable and frozen again right after, the supported way to
            # unfreeze later (see ZeroState.check_parameters_unchanged).
            later = [p for p in _optimized_parameters(optimizers)
                     if not p.requires_grad and p.dtype == torch.float32] if unfreeze_later else []
            for p in later:
                p.requires_grad_(True)
        except Exception as error:  # noqa: BLE001 - raised on every rank by _wrap
            failure = error
        return _wrap(**arguments, arrival=arrival, failure=failure)
    except BaseException:
        restore()
        raise
    finally:
        for p in later:
            p.requires_grad_(False)


def _elementwise(optimizer: torch.optim.Optimizer) -> bool:
    try:
        return optimizer_sharding(optimizer, shards_state=True) != WHOLE
    except TypeError:  # reads across parameters (LBFGS)
        return False


def _optimized_parameters(optimizers: List[torch.optim.Optimizer]) -> List[torch.nn.Parameter]:
    return list({id(p): p for opt in optimizers for g in opt.param_groups for p in g["params"]}.values())


def _wrap(model, optimizer, stage, process_group, mixed_precision, offload_optimizer, offload_params, offload_path,
          units, bucket_mb, timeout, prefetch, skip_nonfinite, device, param_init_fn,
          reshard_after_forward, max_live_mb, persist_kb, compress_weights, compress_grads,
          tensor_parallel: Optional[TensorParallel] = None, pipeline: Optional[Pipeline] = None,
          experts: Optional[ExpertParallel] = None, replicas: Optional[Replicas] = None,
          arrival: Optional[arrivals.Arrival] = None,
          failure: Optional[Exception] = None) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """wrap(), once the parameters unfreeze_later plans as trainable are marked so
    (`failure`: what wrap() raised on the way here, to settle with the other ranks):
    the plan the ranks agree on, the model's groups, the core, and the attachment."""
    checked, exchange = _agreed_plan(model, optimizer, stage, process_group, mixed_precision, offload_optimizer,
                                     offload_params, offload_path, units, bucket_mb, timeout, prefetch,
                                     skip_nonfinite, device, param_init_fn, reshard_after_forward, max_live_mb,
                                     persist_kb, compress_weights, compress_grads, tensor_parallel, pipeline,
                                     experts, replicas, arrival, failure)
    groups = acquire_own_groups(checked, model, experts)
    key_space = mesh_token(checked) if groups.shard else ""
    handles: Optional[CoreHandles] = None
    failure = None
    try:  # what fails on this rank alone is settled before the next collective, as the checks were
        handles = build_core(checked, core_config(checked, groups, model, key_space, tensor_parallel, pipeline,
                                                  experts))
    except Exception as error:  # noqa: BLE001 - raised on every rank below
        failure = error
    if exchange is not None:
        settle_failures(exchange.topology, exchange.across, failure)
    elif failure is not None:
        raise failure
    assert handles is not None
    state = _state(model, checked, groups, handles, tensor_parallel, pipeline, experts)
    _start(model, checked, state, handles, bool(groups.shard))
    _attach(model, checked.optimizers, state, checked.unit_list, checked.export_dtype, set(checked.reshard.kept))
    if replicas is not None:
        _attach_replicas(state, checked, replicas)
    # Set-up is not a step: the host blocks sharding and the first
    # broadcasts used are not kept for it ([Note: reusable host blocks]).
    torch.ops.zero_ext.release_idle_host_blocks()
    return model, optimizer


def _agreed_plan(model, optimizer, stage, process_group, mixed_precision, offload_optimizer, offload_params,
                 offload_path, units, bucket_mb, timeout, prefetch, skip_nonfinite, device, param_init_fn,
                 reshard_after_forward, max_live_mb, persist_kb, compress_weights, compress_grads,
                 tensor_parallel: Optional[TensorParallel], pipeline: Optional[Pipeline],
                 experts: Optional[ExpertParallel], replicas: Optional[Replicas],
                 arrival: Optional[arrivals.Arrival], failure: Optional[Exception]) -> Tuple[Checked, object]:
    """This rank's checks and plan, raised on every rank if any rank's failed,
    then checked to be the same on every rank."""
    checked: Optional[Checked] = None
    if failure is None:
        try:
            checked = check_and_plan(model, optimizer, stage, process_group, mixed_precision, offload_optimizer,
                                     offload_params, offload_path, units, bucket_mb, timeout, prefetch,
                                     skip_nonfinite, device, param_init_fn, reshard_after_forward, max_live_mb,
                                     persist_kb, compress_weights, compress_grads,
                                     experts=experts)
            if pipeline is not None:
                _check_pipeline_options(checked)
            if experts is not None:
                _check_expert_options(checked)
            if replicas is not None:
                _check_replica_options(checked, replicas, pipeline)
            checked.fields.append(_replica_field(replicas))  # the ranks of one replica name the same one
        except Exception as error:  # noqa: BLE001 - raised on every rank below
            failure = error
    exchange = agreement_ranks(process_group, model, tensor_parallel, checked, pipeline)
    if exchange is None:
        if failure is not None:
            raise failure
    else:
        if arrival is not None:
            arrival.wait(*arrival_bound(timeout, exchange.topology))
        settle_failures(exchange.topology, exchange.across, failure)
    assert checked is not None
    _check_ranks_agree(checked, tensor_parallel, pipeline, experts)
    return checked, exchange


def _check_pipeline_options(checked: Checked) -> None:
    """What a pipeline stage cannot do yet: decide alone to skip a step."""
    options = checked.options
    if options.precision.loss_scale is not None or options.skip_nonfinite:
        raise ValueError(
            "zero_ext.wrap: pipeline_group with fp16 loss scaling or skip_nonfinite=True is not supported: each stage "
            "would decide alone whether to skip a step (an overflow seen on one stage only), and the stages would "
            "drift apart. Train the pipeline in bf16 (mixed_precision='bf16') or fp32, without skip_nonfinite.")


def _check_expert_options(checked: Checked) -> None:
    """What the expert group does not combine with in this version."""
    topology = checked.topology
    if topology.replicate_group is not None:
        raise ValueError("zero_ext.wrap: expert_process_group with a 2-D (hybrid) process_group is not supported in "
                         "this version; pass the flattened data-parallel group (mesh._flatten('dp') or the world).")
    if checked.reshard.subgroup_size:
        raise ValueError("zero_ext.wrap: expert_process_group with reshard_after_forward=<int> is not supported in "
                         "this version; pass True or False.")


def _check_replica_options(checked: Checked, replicas: Replicas, pipeline: Optional[Pipeline]) -> None:
    """What replicas need, and what they do not combine with yet."""
    if not isinstance(replicas, Replicas):
        raise TypeError(f"zero_ext.wrap: replicas must be a zero_ext.Replicas, got {type(replicas).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("zero_ext.wrap: replicas needs torch.distributed initialized (each replica is a torchrun job)")
    options = checked.options
    if options.precision.loss_scale is not None or options.skip_nonfinite:
        raise ValueError("zero_ext.wrap: replicas with fp16 loss scaling or skip_nonfinite=True is not supported in "
                         "this version (a replica would skip a step alone); train in bf16 or fp32.")
    if checked.nvme:
        raise ValueError("zero_ext.wrap: replicas with offload to files ('nvme') is not supported in this version; "
                         "offload_optimizer='cpu' works.")
    if pipeline is not None:
        raise ValueError("zero_ext.wrap: replicas with pipeline_group is not supported in this version.")


def _replica_field(replicas: Optional[Replicas]) -> Tuple[str, object, str]:
    """wrap()'s fingerprint field of the replicas option: every rank of a
    job must name the same replica (only rank 0 asks the coordinator)."""
    if replicas is None:
        return ("replicas", None, "no replicas")
    value = (replicas.coordinator, replicas.replica_id, float(replicas.timeout))
    return ("replicas", value, f"replicas=zero_ext.Replicas(coordinator={replicas.coordinator!r}, "
                               f"replica_id={replicas.replica_id!r}, timeout={replicas.timeout:g})")


def _attach_replicas(state: ZeroState, checked: Checked, replicas: Replicas) -> None:
    """The replica set, and the step that averages across it
    ([Note: a step across replicas] in groups/replicas.py). The fingerprint
    the coordinator compares: every field wrap()'s ranks agreed on but how
    many groups this process pooled before (a replica started again has
    fewer) and the replica's own id."""
    fingerprint = {name: f"{shown} [{hashlib.sha256(repr(value).encode()).hexdigest()[:12]}]"
                   for name, value, shown in checked.fields if name not in ("zero_ext groups already held", "replicas")}
    state.replica_set = ReplicaSet(replicas, fingerprint)
    held = weakref.ref(state)
    optimizers = [weakref.ref(o) for o in checked.optimizers]

    def before_step() -> None:
        exchange_across_replicas(held(), [o() for o in optimizers if o() is not None], recover_from_peer)
    state.step_round.before_step = before_step


def _check_ranks_agree(checked: Checked, tensor_parallel: Optional[TensorParallel],
                       pipeline: Optional[Pipeline] = None, experts: Optional[ExpertParallel] = None) -> None:
    described = list(zip(checked.names, checked.ordered))
    if tensor_parallel is None and pipeline is None:
        check_ranks_agree(checked.topology, checked.model_device, checked.fields, described)
        return
    # The dp group's check, then one over dp x tp and one over pp, each
    # carrying the outcome of the checks before it.
    error = None
    try:
        check_ranks_agree(checked.topology, checked.model_device, checked.fields, described)
    except ValueError as raised:
        error = raised
    if tensor_parallel is not None:
        try:
            check_tensor_parallel_agree(tensor_parallel, checked.model_device, tensor_parallel_fields(
                checked.options, checked.topology, tensor_parallel, checked.names, checked.ordered,
                checked.unit_names), error)
        except ValueError as raised:
            error = raised
    if pipeline is not None and pipeline.size > 1:
        tp_size = tensor_parallel.size if tensor_parallel is not None else 1
        # Each parameter's full bytes (a tensor-parallel leaf's whole tensor's), for memory_report.
        full_bytes = [math.prod(spec.shape) * p.element_size() if spec is not None else p.numel() * p.element_size()
                      for p in checked.ordered
                      for spec in [tensor_parallel.spec_of(p) if tensor_parallel is not None else None]]
        check_pipeline_agree(pipeline, checked.model_device,
                             pipeline_fields(checked.options, checked.topology, tp_size, pipeline.size),
                             checked.names, full_bytes, error)
    elif error is not None:
        raise error


def _state(model: torch.nn.Module, checked: Checked, groups: OwnGroups, handles: CoreHandles,
           tensor_parallel: Optional[TensorParallel], pipeline: Optional[Pipeline] = None,
           experts: Optional[ExpertParallel] = None) -> ZeroState:
    """What zero_ext keeps for the model; its groups retire with it if they failed."""
    options, topology, ordered, names = checked.options, checked.topology, checked.ordered, checked.names
    faults.arm_core(handles, topology.mesh_rank if topology.mesh_size > 1 else 0)
    state = ZeroState(
        model_ref=weakref.ref(model), stage=options.stage, handles=handles,
        process_group=groups.shard[0] if groups.shard else None, world_size=topology.shard_size,
        replicate_group=groups.replica, replicas=topology.replicas, shard_rank=topology.shard_rank,
        replica_rank=topology.replica_rank,
        device=ordered[0].device, params=[p for p in ordered if p.requires_grad],
        names=[n for n, p in zip(names, ordered) if p.requires_grad],
        param_ids={id(p) for p in ordered if p.requires_grad}, bucketed=ordered,
        bucketed_names=names, compute_dtype=options.precision.compute_dtype,
        cast_inputs=options.precision.cast_inputs,
        offload=options.offload, offload_path=options.offload_path,
        streams_optimizer=options.offload_optimizer == "nvme",
        frozen_at_wrap={id(p) for p in model.parameters() if not p.requires_grad},
        output_dtype=options.precision.output_dtype,
        tensor_parallel=tensor_parallel,
        pipeline=pipeline,
        experts=experts,
    )
    weakref.finalize(state, retire_if_failed, handles, groups.all())
    return state


def _start(model: torch.nn.Module, checked: Checked, state: ZeroState, handles: CoreHandles,
           distributed: bool) -> None:
    """The model's first collectives: a meta model's values, rank 0's buffers."""
    if distributed and state.device.type == "cpu":  # host waits only, as the stall diagnosis (communicator.h)
        whereabouts.start(model, handles)
    if checked.deferred:
        counts = checked.counts
        groups_of_bucket = checked.unit_of_bucket if state.params_sharded else list(range(len(counts)))
        materialize(checked.deferred, handles, Ranks(state), checked.ordered, counts, groups_of_bucket,
                    lambda: local_views(state), params_sharded=state.params_sharded)
    if distributed:
        _broadcast_buffers(model, handles)


def _attach(model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], state: ZeroState,
            unit_list: List[Unit], export_dtype: Optional[torch.dtype], kept_units: Set[int]) -> None:
    """Hands the model and optimizers over: parameters point to the state,
    the model's class and hooks change, the optimizers step zero_ext's shards."""
    for p in state.bucketed:
        p._zero_ext_owner = weakref.ref(state)  # zero_ext.clip_grad_norm_ and full_params find it
    # A Hugging Face model's save_pretrained writes the fp32 masters and the
    # unwrapped class's name (files/save_weights.py); before the class swap.
    install_pretrained_export(model, export_dtype)
    swap_module_class(model)
    attach_state(model, state)
    # accelerate's prepare() leaves a model so marked alone: DDP on top of
    # zero_ext would reduce every gradient a second time.
    model._is_accelerate_prepared = True
    owner = assign_parameters(model, unit_list)
    root = install_forward_hooks(model, unit_list, owner)
    if root.traceable and state.tensor_parallel is None and state.experts is None:  # DTensors: read as they are
        index_of = {id(p): i for i, p in enumerate(state.bucketed)}
        # The root unit stays gathered from forward to backward, as eagerly.
        kept = {index_of[key] for key, u in owner.items() if (u == 0 or u in kept_units) and key in index_of}
        compiled_units.install(model, root.handle, index_of, state.params_sharded,
                               kept if state.params_sharded else set())
    state.unit_of_module = {id(m): u for u, members in enumerate(unit_list) if u > 0 for m in members}
    for optimizer in optimizers:
        shard_optimizer(optimizer, state, state.bucketed, several=len(optimizers) > 1)
