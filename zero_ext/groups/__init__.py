"""Process groups: zero_ext's own groups and their pooling, what a
process_group argument resolves to (flat or a replica x shard mesh), the
stall query a waiting rank sends its peers, and wrap()'s wait for every rank
to reach it (arrival)."""
from __future__ import annotations

from . import arrival, stall_query
from .mesh import Topology, resolve_topology
from .process_groups import (acquire_groups, acquire_mesh_groups, acquire_subgroups, exchange_device, group_timeout,
                             handed_to_backend, pooled_groups, retire_if_failed)
from .coordinator_server import request as coordinator_request, serve as serve_coordinator
from .experts import ExpertParallel, check_experts_supported, expert_parallel_of, find_experts
from .pipeline import Pipeline, pipeline_of
from .replicas import (Quorum, ReplicaMismatch, Replicas, ReplicaSet, agree_in_replica, bytes_of, checksum,
                       group_all_reduce, group_broadcast, group_broadcast_bytes, object_from)
from .ranks import Ranks, refuse_different_paths
from .tensor_parallel import (TensorParallel, TensorParallelSpec, check_supported, data_parallel_ranks,
                              find_tensor_parallel, global_description, is_dtensor, localize, tensor_parallel_of)

__all__ = [
    "Quorum",
    "ReplicaMismatch",
    "Replicas",
    "ReplicaSet",
    "agree_in_replica",
    "bytes_of",
    "checksum",
    "group_all_reduce",
    "group_broadcast",
    "group_broadcast_bytes",
    "object_from",
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
    "exchange_device",
    "check_experts_supported",
    "coordinator_request",
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
    "serve_coordinator",
    "stall_query",
]
