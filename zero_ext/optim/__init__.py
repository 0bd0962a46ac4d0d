"""The optimizer side: the user's optimizer re-pointed at zero_ext's shards,
gradient clipping over sharded gradients, the CPU Adam kernel, and the step
streamed through offload files."""
from __future__ import annotations

from .clip import check_tensor_parallel_grads, clip_grad_norm_, clip_grad_value_
from .replica_step import exchange as exchange_across_replicas
from .replica_step import optimized_tensors
from .optimizer_set import as_one, class_name, qualified_class_names
from .ownership import WHOLE, optimizer_sharding, plan_owners
from .sharded_optimizer import check_step_not_patched, shard_optimizer
from .step_round import StepRound
from .streamed_step import offload_in_memory

__all__ = [
    "StepRound",
    "WHOLE",
    "as_one",
    "check_tensor_parallel_grads",
    "check_step_not_patched",
    "class_name",
    "clip_grad_norm_",
    "clip_grad_value_",
    "exchange_across_replicas",
    "optimizer_sharding",
    "offload_in_memory",
    "optimized_tensors",
    "qualified_class_names",
    "plan_owners",
    "shard_optimizer",
]
