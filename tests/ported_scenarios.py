"""Behaviours that DeepSpeed's ZeRO "user backward" tests
(tests/unit/v1/zero/test_zero_user_backward.py) and PyTorch FSDP2's
fully_shard tests (test/distributed/_composable/fsdp/test_fully_shard_*.py)
check, written from scratch against zero_ext's API.

Each scenario is a function of a parity Context (tests/parity_scenarios.py):
it runs once wrapped by zero_ext on N gloo ranks and once as the
single-process reference that plays every rank over the global batch, and
records checkpoints (gradients after a backward, parameters after a step,
values, checks) that must match at fp32 tolerances (parity_scenarios.compare).
Where the original test compares against DDP, the reference here is plain
PyTorch on one process over the global batch, which is what DDP computes.

Only behaviours that zero_ext's SPEC promises are ported; see
tests/test_ported.py for the ones left out and why.

The scenarios live in ported_deepspeed_scenarios.py,
ported_fsdp_scenarios.py and ported_spec_scenarios.py, on the helpers and
models of ported_models.py; this module is their registry (SCENARIOS, in
the order the groups run them) and the entry point each rank runs (run_one).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import parity_scenarios as ps
from parity_scenarios import Context
from ported_deepspeed_scenarios import (
    ds_checkpointed_backward_nonreentrant, ds_checkpointed_backward_reentrant, ds_frozen_norm_checkpointed_bf16,
    ds_frozen_norm_checkpointed_nonreentrant, ds_frozen_norm_checkpointed_reentrant,
    ds_frozen_norm_module_dict_blocks_checkpointed, ds_frozen_two_output_block_checkpointed,
    ds_grad_accumulation_scaled_and_unscaled, ds_lora_style_frozen_base_checkpointed, ds_loss_backward_matches_ddp,
    ds_module_list_branches, ds_multiple_models_combined_loss, ds_non_scalar_backward, ds_separate_loss_function,
    ds_two_losses_one_forward_zero_grad_between)
from ported_fsdp_scenarios import (
    fsdp_bf16_grad_accumulation_no_sync, fsdp_biases_only_trainable_checkpointed,
    fsdp_chunked_head_loss_grad_accumulation, fsdp_chunked_head_loss_standalone_head,
    fsdp_double_partial_forward_then_backward, fsdp_forwards_first_then_backwards,
    fsdp_frozen_linears_across_units_with_no_grad_step, fsdp_grad_accumulation_with_and_without_sync,
    fsdp_multi_forward_mixed_requires_grad, fsdp_multi_forward_module, fsdp_multi_grad_hook_and_tensor_hooks,
    fsdp_non_root_forward_backward, fsdp_nontensor_activations_dict, fsdp_nontensor_activations_list,
    fsdp_nontensor_activations_namedtuple, fsdp_nontensor_activations_tuple, fsdp_optimizer_step_hooks,
    fsdp_reset_after_an_exception_on_every_rank, fsdp_root_without_forward_inputs, fsdp_tied_embedding_uneven_vocab,
    fsdp_train_parity_with_shared_params_checkpointed, fsdp_two_forwards_one_backward_checkpointed,
    fsdp_unused_forward_module, fsdp_unused_forward_output)
from ported_spec_scenarios import autograd_grad_penalty_then_backward, moe_skipped_experts_accumulation_two_forwards


SCENARIOS: Dict[str, Callable[[Context], None]] = {
    f.__name__: f
    for f in [
        ds_loss_backward_matches_ddp,
        ds_non_scalar_backward,
        ds_grad_accumulation_scaled_and_unscaled,
        ds_multiple_models_combined_loss,
        ds_separate_loss_function,
        ds_two_losses_one_forward_zero_grad_between,
        ds_module_list_branches,
        ds_checkpointed_backward_reentrant,
        ds_checkpointed_backward_nonreentrant,
        ds_frozen_norm_checkpointed_reentrant,
        ds_frozen_norm_checkpointed_nonreentrant,
        ds_frozen_norm_module_dict_blocks_checkpointed,
        ds_lora_style_frozen_base_checkpointed,
        ds_frozen_two_output_block_checkpointed,
        ds_frozen_norm_checkpointed_bf16,
        fsdp_unused_forward_output,
        fsdp_unused_forward_module,
        fsdp_nontensor_activations_list,
        fsdp_nontensor_activations_namedtuple,
        fsdp_nontensor_activations_tuple,
        fsdp_nontensor_activations_dict,
        fsdp_multi_grad_hook_and_tensor_hooks,
        fsdp_multi_forward_module,
        fsdp_two_forwards_one_backward_checkpointed,
        fsdp_double_partial_forward_then_backward,
        fsdp_chunked_head_loss_standalone_head,
        fsdp_chunked_head_loss_grad_accumulation,
        fsdp_non_root_forward_backward,
        fsdp_root_without_forward_inputs,
        fsdp_optimizer_step_hooks,
        fsdp_tied_embedding_uneven_vocab,
        fsdp_train_parity_with_shared_params_checkpointed,
        fsdp_grad_accumulation_with_and_without_sync,
        fsdp_forwards_first_then_backwards,
        fsdp_bf16_grad_accumulation_no_sync,
        fsdp_biases_only_trainable_checkpointed,
        fsdp_frozen_linears_across_units_with_no_grad_step,
        fsdp_multi_forward_mixed_requires_grad,
        fsdp_reset_after_an_exception_on_every_rank,
        moe_skipped_experts_accumulation_two_forwards,
        autograd_grad_penalty_then_backward,
    ]
}
STAGES = (0, 1, 2, 3)


def stages_of(name: str):
    return getattr(SCENARIOS[name], "stages", STAGES)


def items() -> List[str]:
    return [f"{name}/stage{stage}" for name in SCENARIOS for stage in stages_of(name)]


_REFERENCES: Dict = {}


def run_one(rank: int, world: int, item: str) -> Optional[str]:
    """Entry point on each rank for one "name/stageN": None, or the first
    mismatch against the single-process reference (computed once per scenario)."""
    name, stage = item.rsplit("/stage", 1)
    if (name, world) not in _REFERENCES:
        ref_ctx = Context(stage=0, rank=rank, world=world, reference=True)
        SCENARIOS[name](ref_ctx)
        _REFERENCES[(name, world)] = ref_ctx.checkpoints
    ctx = Context(stage=int(stage), rank=rank, world=world, reference=False)
    SCENARIOS[name](ctx)
    return ps.compare(_REFERENCES[(name, world)], ctx.checkpoints)
