"""Training scenarios run twice: wrapped by zero_ext on N ranks, and as a
single-process reference over the global batch.

A scenario is written once against a Context. The reference context plays
every rank at once: each forward computes the sum over ranks r of
(1/N) * loss_r, so its gradients are exactly what averaging N ranks' gradients
must give, rank-dependent branches included. A scenario returns a list of
named checkpoints (gradients after a backward, parameters after a step,
returned norms); the two lists must match.

The scenarios live in modules by concern (parity_backward_scenarios.py,
parity_accumulation_scenarios.py, parity_offload_scenarios.py,
parity_frozen_scenarios.py, parity_optimizer_scenarios.py,
parity_units_scenarios.py, parity_memory_scenarios.py,
parity_collective_scenarios.py, parity_mixed_scenarios.py), on the models
and Context of parity_models.py, compared by parity_compare.py. This module
is their registry (SCENARIOS, in the order the groups run them) and the
entry point each rank runs (run_one); the other scenario suites import
the shared names from here.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from parity_accumulation_scenarios import (
    ddp_require_backward_grad_sync, four_backward_per_step, gradient_divide_factor, no_sync_accumulation,
    replica_all_reduce_deferred_in_accumulation, replica_all_reduce_deferred_until_read, varying_backward_per_step)
from parity_backward_scenarios import (
    autograd_backward_list, autograd_grad_is_side_effect_free, checkpoint_nonreentrant_param_used_twice,
    checkpoint_reentrant_param_used_twice, graph_from_before_the_step_raises, late_gradients_accumulate_over_backwards,
    loss_inside_model_adamw, nonscalar_backward, nonscalar_backward_retained_twice, retain_graph_two_losses,
    retain_graph_zero_grad_between, scalar_loss_outside_model, step_with_closure, three_models_one_loss,
    two_models_rank_dependent_branch)
from parity_collective_scenarios import (
    issue_order_same_on_every_rank, one_rank_group_reduces_locally, ranks_reach_wrap_seconds_apart,
    straggler_rank_bounds_reductions_in_flight, user_collective_in_backward_with_rank_dependent_layer)
from parity_frozen_scenarios import (
    branch_on_rank0_only, frozen_after_wrap_offloaded, frozen_after_wrap_saved_and_loaded,
    frozen_and_unfrozen_after_wrap, frozen_at_wrap_unfrozen_later, frozen_buckets_skip_their_reduction,
    frozen_parameters, unused_parameters)
from parity_memory_scenarios import (
    reusable_host_blocks, state_bytes_match_the_stage, units_gathered_during_forward_and_backward, units_gathered_with_frozen_biases,
    units_gathered_with_nonreentrant_checkpoints, units_gathered_with_reentrant_checkpoints)
from parity_mixed_scenarios import (
    MIXED_PRECISION_SCENARIOS, fp16_hands_scaling_to_a_grad_scaler, fp16_model_applied_to_its_own_output,
    fp16_output_on_another_outputs_path, fp16_overflow_skips_the_step_on_every_rank,
    grad_scaler_sees_overflow_on_every_rank, output_dtype_cast)
from parity_offload_scenarios import (
    nvme_accumulation_no_sync_clip_adamw, nvme_checkpoints_across_offload_settings, nvme_retain_graph_momentum_sgd,
    offload_adam_param_groups_amsgrad_scheduler, offload_four_backward_per_step_adamw, offload_no_sync_accumulation,
    offload_replica_all_reduce_deferred_in_accumulation, offload_state_bytes, offload_varying_backward_per_step_sgd)
from parity_optimizer_scenarios import (
    clip_grad_norm, full_params_read_ema_and_writeback, full_state_dict_round_trip, param_groups_and_scheduler,
    parameter_listed_twice_in_a_group, zero_ext_clip_grad_norm_over_model_parameters,
    zero_ext_clip_grad_norm_over_the_optimizer_tensors, zero_grad_keeping_zeros)
from parity_units_scenarios import (
    block_called_twice_per_forward, block_skipped_on_some_steps, checkpoint_each_block_nonreentrant,
    checkpoint_each_block_reentrant, dataclass_inputs_with_frozen_weights, dataclass_outputs,
    deferred_init_then_training, frozen_block, grouped_and_container_units, parallel_lists_lora,
    parallel_lists_lora_listed_units, registered_forward_methods, tied_embedding_default_units,
    tied_weights_in_a_group_unit)

# Shared names the other scenario suites (units, real models, ported, frozen
# mixed precision, whole-parameter optimizers, checkpoints, ...) import from here.
from parity_compare import (  # noqa: F401
    ATOL, BF16, BF16_ROUNDED, FP16, LOW_PRECISION_LABEL, RTOL, TOLERANCES, UNIT_ROUNDOFF, ReducedSum, compare,
    summation_bound, tolerance_of, within)
from parity_mixed_reference import MasterWeightReference, ReferenceReduction, reduced_in  # noqa: F401
from parity_mixed_scenarios import FP16_SCALE  # noqa: F401
from parity_models import (  # noqa: F401
    BATCH, BUCKET_MB, DIM, HIDDEN, IN, OUT, SEQ, VOCAB, Block, Blocks, Context, LossNet, Net, adamw, batch,
    conditioned_adamw, mlp_loss, net_units, sgd, step_and_record, token_loss)
from parity_units_scenarios import InitBlock, InitBlocks, WithFeatureMethods, _blocks  # noqa: F401


# The Blocks scenarios that suites of other stage 3 settings (merged units,
# units kept gathered after forward) run again.
STAGE3_BLOCKS_SCENARIOS = [
    tied_embedding_default_units,
    block_called_twice_per_forward,
    block_skipped_on_some_steps,
    frozen_block,
    checkpoint_each_block_reentrant,
    checkpoint_each_block_nonreentrant,
    dataclass_outputs,
    dataclass_inputs_with_frozen_weights,
    zero_grad_keeping_zeros,
    full_params_read_ema_and_writeback,
    nonscalar_backward_retained_twice,
]


SCENARIOS: Dict[str, Callable[[Context], None]] = {
    f.__name__: f
    for f in [
        scalar_loss_outside_model,
        loss_inside_model_adamw,
        nonscalar_backward,
        autograd_backward_list,
        three_models_one_loss,
        retain_graph_two_losses,
        retain_graph_zero_grad_between,
        nonscalar_backward_retained_twice,
        four_backward_per_step,
        varying_backward_per_step,
        no_sync_accumulation,
        ddp_require_backward_grad_sync,
        replica_all_reduce_deferred_in_accumulation,
        replica_all_reduce_deferred_until_read,
        offload_replica_all_reduce_deferred_in_accumulation,
        step_with_closure,
        nvme_accumulation_no_sync_clip_adamw,
        nvme_retain_graph_momentum_sgd,
        nvme_checkpoints_across_offload_settings,
        unused_parameters,
        branch_on_rank0_only,
        frozen_parameters,
        param_groups_and_scheduler,
        clip_grad_norm,
        autograd_grad_is_side_effect_free,
        checkpoint_reentrant_param_used_twice,
        checkpoint_nonreentrant_param_used_twice,
        late_gradients_accumulate_over_backwards,
        full_state_dict_round_trip,
        state_bytes_match_the_stage,
        tied_embedding_default_units,
        deferred_init_then_training,
        block_called_twice_per_forward,
        block_skipped_on_some_steps,
        frozen_block,
        checkpoint_each_block_reentrant,
        checkpoint_each_block_nonreentrant,
        units_gathered_during_forward_and_backward,
        reusable_host_blocks,
        units_gathered_with_frozen_biases,
        units_gathered_with_reentrant_checkpoints,
        dataclass_outputs,
        units_gathered_with_nonreentrant_checkpoints,
        dataclass_inputs_with_frozen_weights,
        user_collective_in_backward_with_rank_dependent_layer,
        straggler_rank_bounds_reductions_in_flight,
        ranks_reach_wrap_seconds_apart,
        one_rank_group_reduces_locally,
        issue_order_same_on_every_rank,
        *MIXED_PRECISION_SCENARIOS,
        fp16_output_on_another_outputs_path,
        fp16_model_applied_to_its_own_output,
        offload_four_backward_per_step_adamw,
        offload_varying_backward_per_step_sgd,
        offload_no_sync_accumulation,
        offload_adam_param_groups_amsgrad_scheduler,
        offload_state_bytes,
        fp16_overflow_skips_the_step_on_every_rank,
        grad_scaler_sees_overflow_on_every_rank,
        fp16_hands_scaling_to_a_grad_scaler,
        two_models_rank_dependent_branch,
        zero_grad_keeping_zeros,
        zero_ext_clip_grad_norm_over_model_parameters,
        zero_ext_clip_grad_norm_over_the_optimizer_tensors,
        parameter_listed_twice_in_a_group,
        graph_from_before_the_step_raises,
        full_params_read_ema_and_writeback,
        registered_forward_methods,
        parallel_lists_lora,
        parallel_lists_lora_listed_units,
        frozen_and_unfrozen_after_wrap,
        frozen_after_wrap_offloaded,
        frozen_after_wrap_saved_and_loaded,
        grouped_and_container_units,
        tied_weights_in_a_group_unit,
        gradient_divide_factor,
        frozen_at_wrap_unfrozen_later,
        output_dtype_cast,
        frozen_buckets_skip_their_reduction,
    ]
}
STAGES = (0, 1, 2, 3)


def stages_of(name: str):
    return getattr(SCENARIOS[name], "stages", STAGES)


_REFERENCES: Dict[Tuple[str, int], list] = {}


_MESHES: Dict[Tuple[int, int], object] = {}


def device_mesh(replicas: int, shard_size: int):
    """The (replicate, shard) CPU mesh over every rank, made once per process."""
    if (replicas, shard_size) not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh
        _MESHES[(replicas, shard_size)] = init_device_mesh(
            "cpu", (replicas, shard_size), mesh_dim_names=("replicate", "shard"))
    return _MESHES[(replicas, shard_size)]


def run_one(rank: int, world: int, item: str) -> Optional[str]:
    """Entry point on each rank for one "scenario/stageN" (or
    "scenario/stageN/meshRxS", hybrid sharding over an R x S mesh): None, or
    the first mismatch against the single-process reference (computed once
    per scenario)."""
    if item.startswith("compression:"):  # quantized collectives (compression_scenarios.py), worlds 2 and 4
        import compression_scenarios
        return compression_scenarios.run_one(item, device_mesh)
    if item.startswith("experts:"):  # experts on their own mesh dimension (expert_scenarios.py), world 4
        import expert_scenarios
        return expert_scenarios.run_one(item)
    if item.startswith("pipeline:"):  # pipeline stages (pipeline_scenarios.py), in the world-4 group
        import pipeline_scenarios
        return pipeline_scenarios.run_one(item)
    if "/tp" in item:  # tensor parallel (tensor_parallel_scenarios.py), in the world-4 group
        import tensor_parallel_scenarios
        return tensor_parallel_scenarios.run_one(item, compare)
    name, rest = item.rsplit("/stage", 1)
    stage, _, mesh_name = rest.partition("/mesh")
    mesh = None
    if mesh_name:
        replicas, shard_size = (int(v) for v in mesh_name.split("x"))
        assert replicas * shard_size == world, f"{item} needs world size {replicas * shard_size}"
        mesh = device_mesh(replicas, shard_size)
    if (name, world) not in _REFERENCES:
        ref_ctx = Context(stage=0, rank=rank, world=world, reference=True)
        SCENARIOS[name](ref_ctx)
        _REFERENCES[(name, world)] = ref_ctx.checkpoints
    ctx = Context(stage=int(stage), rank=rank, world=world, reference=False, mesh=mesh)
    SCENARIOS[name](ctx)
    return compare(_REFERENCES[(name, world)], ctx.checkpoints)


def all_items(names: Optional[List[str]] = None, mesh: str = "") -> List[str]:
    """Items of the named scenarios (all by default); `mesh`: "RxS" runs them hybrid."""
    suffix = f"/mesh{mesh}" if mesh else ""
    return [f"{name}/stage{stage}{suffix}" for name in SCENARIOS if not names or name in names
            if not (mesh and getattr(SCENARIOS[name], "flat_only", False)) for stage in stages_of(name)]
