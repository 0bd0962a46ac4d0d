"""CoreConfig: everything the C++ core is built with besides the parameters'
geometry (csrc/core_config.h), as one typed value that wrap() fills and the
core takes whole at construction. Nothing configures the core afterwards."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """The core's spelling of a compute or reduce dtype ("" for none)."""
    if dtype is None:
        return ""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"zero_ext: the core computes and reduces in {sorted(_DTYPE_NAMES.values())}, not {dtype}")
    return _DTYPE_NAMES[dtype]


@dataclasses.dataclass
class CoreConfig:
    """The fields of csrc/core_config.h, with the same names and defaults."""

    # The layout and its groups ("": none).
    stage: int = 2
    shard_group: str = ""
    gather_group: str = ""  # stage 3 gathers on it ("": the shard group)
    replica_group: str = ""  # hybrid sharding: across the copies of this rank's shard
    regather_group: str = ""  # units resharded to a subgroup gather again in it
    expert_group: str = ""  # expert_process_group: the expert buckets are sharded over it
    expert_buckets: List[int] = dataclasses.field(default_factory=list)
    prefetch: int = 1
    compute_dtype: str = ""  # dtype_name(): mixed precision's compute dtype
    reduce_dtype: str = ""  # gradients reduced in it ("": fp32)
    offload: bool = False  # masters and accumulators in host memory
    deferred: bool = False  # the parameters hold no values yet (wrap() materializes them)
    # Loss scaling (fp16) and the non-finite policy.
    loss_scaling: bool = False
    dynamic_loss_scale: bool = False
    initial_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1
    min_scale: float = 1.0
    hysteresis: int = 1
    skip_nonfinite: bool = False
    reduce_at_read: bool = False  # pipeline stages: the step's first read reduces every backward's gradients
    # Quantized collectives: bits (0: off) and elements per scale.
    weight_bits: int = 0
    grad_bits: int = 0
    quant_block: int = 2048
    # Stage 3 units.
    max_live_bytes: int = 0
    unit_names: List[str] = dataclasses.field(default_factory=list)
    unit_advice: List[str] = dataclasses.field(default_factory=list)
    kept_after_forward: List[int] = dataclasses.field(default_factory=list)
    resharded_to_subgroup: List[int] = dataclasses.field(default_factory=list)
    # offload_*="nvme": this rank's file ("": none).
    swap_path: str = ""
    swap_directory: str = ""  # offload_path as given, for messages
    swap_params: bool = False
    swap_optimizer: bool = False
    swap_threads: int = 1
    swap_chunk_bytes: int = 0
    swap_max_writing_bytes: int = 0
    swap_persist_bytes: int = 0
    # Collective checks: the header groups ("": none on that group).
    shard_headers: str = ""
    gather_headers: str = ""
    replica_headers: str = ""
    regather_headers: str = ""
    expert_headers: str = ""
    # Stall diagnosis (stall_seconds 0: off).
    stall_seconds: float = 0.0
    timeout_seconds: float = 1800.0
    key_space: str = ""
    shard_mesh_ranks: List[int] = dataclasses.field(default_factory=list)
    replica_mesh_ranks: List[int] = dataclasses.field(default_factory=list)
    expert_mesh_ranks: List[int] = dataclasses.field(default_factory=list)  # the expert group's, by group rank
    expert_group_of_mesh_rank: List[int] = dataclasses.field(default_factory=list)

    def to_core(self) -> object:
        """The torch.classes.zero_ext.CoreConfig the core's constructor takes."""
        from . import core_loader  # the compiled core, loaded on first use

        core = core_loader.CoreConfig()
        for field in dataclasses.fields(self):
            setattr(core, field.name, getattr(self, field.name))
        return core
