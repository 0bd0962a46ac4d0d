"""Process groups: zero_ext's own groups and their pooling, what a
process_group argument resolves to (flat or a replica x shard mesh), the
stall query a waiting rank sends its peers, and wrap()'s wait for every rank
to reach it (arrival)."""
from __future__ import annotations

from . import arrival, stall_query
from .mesh import Topology, resolve_topology
from .process_groups import (acquire_groups, acquire_mesh_groups, acquire_subgroups, group_timeout,
                             handed_to_backend, pooled_groups, retire_if_failed)
from .experts import ExpertParallel, check_experts_supported, expert_parallel_of, find_experts
from .pipeline import Pipeline, pipeline_of
from .ranks import Ranks, refuse_different_paths
from .tensor_parallel import (TensorParallel, TensorParallelSpec, check_supported, data_parallel_ranks,
                              find_tensor_parallel, global_description, is_dtensor, localize, tensor_parallel_of)

__all__ = [
    "ExpertParallel",
    "Pipeline",
    "Ranks",
    "arrival",
    "TensorParallel",
    "TensorParallelSpec",
    "Topology",
    "acquire_groups",
    "acquire_mesh_groups",
    "acquire_subgroups",
    "check_experts_supported",
    "check_supported",
    "data_parallel_ranks",
    "expert_parallel_of",
    "find_experts",
    "find_tensor_parallel",
    "global_description",
    "is_dtensor",
    "localize",
    "pipeline_of",
    "tensor_parallel_of",
    "group_timeout",
    "handed_to_backend",
    "pooled_groups",
    "refuse_different_paths",
    "resolve_topology",
    "retire_if_failed",
    "stall_query",
]
