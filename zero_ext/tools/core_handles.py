"""The C++ core seen from Python by concern.

One wrapped model is one `torch.classes.zero_ext.ShardedModel` (csrc/README.md),
built whole from a `CoreConfig` (tools/core_config.py) and offering no methods
of its own: each concern is a bound class of its own over it
(csrc/core_views.h), and Python holds the handles here, one per view, so a
room names what it needs (a unit's gather, a bucket's reduction, the
optimizer's shards, a checkpoint's ranges, diagnostics, the model's group
collectives) and nothing else:

| handle             | for                                                        |
|--------------------|------------------------------------------------------------|
| `Units`            | stage 3 units: forward entry and exit, gather, release, prefetch, pins |
| `Reduction`        | gradient buckets: sync, accumulation, zero_grad, full gradients, the layout |
| `OptimizerShards`  | what the optimizer steps: segments, masters, the step gate and loss scale |
| `CheckpointRanges` | which ranges of which tensors this rank holds; loading into them |
| `Diagnostics`      | counters (`CoreStats`), failure, stall diagnosis, collective checks, faults |
| `GroupCollectives` | the collectives of a user's call, on the model's own groups |
| `OffloadFiles`     | offload_*="nvme": the rank's offload file, buckets brought in and parked |

A handle binds its view's methods as attributes (no Python call in between:
hooks call them per unit per step); the few that return a layout or the
counters convert them into `GradLayout` and `CoreStats`.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch

Tensor = torch.Tensor


class GradLayout(enum.Enum):
    """Where a backward's gradients live (csrc/layout.h, [Note: gradient layouts])."""

    DDP_IN_PLACE = "ddp_in_place"              # stage 0: full buckets reduced in place, `.grad` views them
    REPLICATED = "replicated"                  # stage 0 with fp32 masters or a low-precision reduce
    SHARDED_PERSISTENT = "sharded_persistent"  # stage 1: full staging kept to the step
    SHARDED_TRANSIENT = "sharded_transient"    # stages 2-3: staging per reduction, into the shard

    @property
    def grads_sharded(self) -> bool:
        """Each rank holds the reduced gradient of its shard only."""
        return self in (GradLayout.SHARDED_PERSISTENT, GradLayout.SHARDED_TRANSIENT)


@dataclasses.dataclass(frozen=True)
class CoreStats:
    """The core's counters at one moment (ShardedModel::stats). Every field is
    an int: a count, or bytes where the name says so. Built strictly: a
    counter the core adds or drops fails here, not in a reader far away."""

    epilogues: int
    synced_epilogues: int
    late_rounds: int
    agreement_reads: int
    blocking_headers: int
    ahead_headers: int
    last_graph_task: int
    last_keep_graph: int
    collectives: int
    replica_collectives: int
    mesh_rank: int
    mesh_size: int
    all_gathers: int
    param_gathers: int
    buckets: int
    host_bytes: int
    host_landing_buffers: int
    nonfinite_backwards: int
    skipped_steps: int
    step_index: int
    param_bytes: int
    regathers: int
    master_bytes: int
    materializing_bytes: int
    grad_bytes: int
    peak_staging_bytes: int
    max_in_flight_bytes: int
    bound_lifts: int
    frozen_skips: int
    units: int
    units_kept_after_forward: int
    units_holding_parts: int
    gathered_units: int
    peak_gathered_units_forward: int
    peak_gathered_units_backward: int
    # The process's reusable host blocks ([Note: reusable host blocks] in csrc/reusable_blocks.h),
    # shared by every wrapped model: bytes in use and kept idle, blocks mapped and reuses since it started.
    host_blocks_in_use_bytes: int
    host_blocks_idle_bytes: int
    host_blocks_mapped: int
    host_blocks_reused: int
    extra: Dict[str, int] = dataclasses.field(default_factory=dict)  # any other counter, by name

    @classmethod
    def from_core(cls, counters: Dict[str, int]) -> "CoreStats":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        missing = names - set(counters)
        if missing:
            raise RuntimeError(f"zero_ext: the core reports no {sorted(missing)}: the Python package and the "
                               "compiled core are from different builds; rebuild (bash scripts/setup.sh)")
        known = {k: int(v) for k, v in counters.items() if k in names}
        return cls(**known, extra={k: int(v) for k, v in counters.items() if k not in names})

    def __getitem__(self, name: str) -> int:
        """stats["units"] reads like the dict it replaces."""
        if name in self.extra:
            return self.extra[name]
        return getattr(self, name)

    def get(self, name: str, default: Optional[int] = None) -> Optional[int]:
        """stats.get("units", 0), as on the dict it replaces."""
        try:
            return self[name]
        except AttributeError:
            return default


class _Handle:
    """Binds the methods named in BOUND of the core's view VIEW
    (torch.classes.zero_ext.<VIEW>) as attributes of the handle."""

    VIEW: ClassVar[str] = ""
    BOUND: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, model: Any) -> None:
        from . import core_loader  # the compiled core, loaded on first use

        self._view = core_loader.CORE_VIEWS[self.VIEW](model)
        for name in self.BOUND:
            setattr(self, name, getattr(self._view, name))


class Units(_Handle):
    """Stage 3 units (csrc/units.h): the model's forward entry and exit, a
    unit's gather before and release after each use, the boundaries that
    report a use over, prefetch, and the pins of full_params."""

    begin_forward: Callable[[], None]
    end_forward: Callable[[List[Tensor]], None]
    pre_forward: Callable[[int], None]
    enter_unit: Callable[[int, List[Tensor]], List[Tensor]]
    track_unit_inputs: Callable[[int, List[Tensor]], List[Tensor]]
    post_forward: Callable[[int, List[Tensor]], None]
    hook_regather: Callable[[List[Tensor], int], None]
    scale_outputs: Callable[[List[Tensor]], List[Tensor]]
    add_pending_use: Callable[[int], int]
    post_backward_use: Callable[[int], None]
    note_untracked_use: Callable[[int], None]
    gather_all: Callable[[], None]
    gather_units_of: Callable[[List[int]], None]  # parameter indices
    unpin_units_of: Callable[[List[int]], None]
    release_all: Callable[[], None]
    keep_gathered_after_forward: Callable[[List[int]], None]
    reshard_to_subgroup: Callable[[List[int]], None]
    set_prefetch: Callable[[int, bool, List[int]], None]  # unit, forward, the units to prefetch
    unshard: Callable[[bool], None]
    wait_unshard: Callable[[], None]
    write_back_shards: Callable[[], None]
    params_sharded: Callable[[], bool]
    forward_raised: Callable[[str], None]  # the model's forward raised (its message): the rank may have parted

    model: Callable[[], Any]  # the ShardedModel, for the registered ops (torch.ops.zero_ext.*) that take it
    handle: Callable[[], int]  # the model's int, for the ops a compiled graph calls (runtime/compiled_forward.py)

    VIEW = "Units"
    BOUND = ("begin_forward", "end_forward", "forward_raised", "pre_forward", "enter_unit", "track_unit_inputs",
             "post_forward", "hook_regather", "scale_outputs", "add_pending_use", "post_backward_use",
             "note_untracked_use", "gather_all", "gather_units_of", "unpin_units_of", "release_all", "set_prefetch",
             "unshard", "wait_unshard", "write_back_shards", "params_sharded", "model", "handle")


class Reduction(_Handle):
    """Gradient buckets (csrc/grad_reducer.h): whether a backward reduces,
    accumulation and its end at zero_grad, the full averaged gradients, and
    the layout of the buckets."""

    set_sync: Callable[[bool], None]
    sync: Callable[[], bool]
    set_replica_sync: Callable[[bool], None]
    replica_sync: Callable[[], bool]
    set_gradient_divide_factor: Callable[[float], None]
    zero_grad: Callable[[bool], None]
    full_grads: Callable[[], List[Tensor]]
    has_grad: Callable[[], List[bool]]
    bucket_layout: Callable[[], List[int]]  # (first param, count, padded numel) per bucket
    replicated: Callable[[], bool]
    set_max_in_flight_bytes: Callable[[int], None]

    VIEW = "Reduction"
    BOUND = ("set_sync", "sync", "set_replica_sync", "replica_sync", "set_gradient_divide_factor", "zero_grad",
             "full_grads", "has_grad", "bucket_layout", "replicated", "set_max_in_flight_bytes")

    def grad_layout(self) -> GradLayout:
        return GradLayout(self._view.grad_layout())


class OptimizerShards(_Handle):
    """What the optimizer steps (csrc/param_store.h, step_gate.h): the
    segments of this rank's shards and their compute copies, the fp32
    masters, the step decision and the fp16 loss scale."""

    segments: Callable[[], List[Tensor]]
    segment_param_indices: Callable[[], List[int]]
    segment_compute_copies: Callable[[], List[Tensor]]
    note_compute_copy_written: Callable[[], None]
    begin_step: Callable[[], int]
    found_nonfinite: Callable[[], bool]  # some rank's gradients since the last zero_grad held inf/nan
    note_nonfinite_elsewhere: Callable[[], None]  # another tp rank's did: decide this step as theirs
    check_before_step: Callable[[], None]
    after_step: Callable[[List[int]], None]  # the parameters stepped
    settle: Callable[[], None]
    disable_loss_scaling: Callable[[], None]
    loss_scale: Callable[[], float]
    loss_scaling: Callable[[], bool]
    whole_params: Callable[[], bool]
    has_masters: Callable[[], bool]
    full_masters: Callable[[], List[Tensor]]
    load_masters: Callable[[List[Tensor]], None]

    VIEW = "OptimizerShards"
    BOUND = ("segments", "segment_param_indices", "segment_compute_copies", "note_compute_copy_written",
             "begin_step", "found_nonfinite", "note_nonfinite_elsewhere", "check_before_step", "after_step",
             "settle", "disable_loss_scaling", "loss_scale", "loss_scaling", "whole_params", "has_masters",
             "full_masters", "load_masters")


class CheckpointRanges(_Handle):
    """Which ranges of which tensors this rank holds (csrc/layout.h), for a
    checkpoint's plan, and loading into them: values, the loss scaler, a
    meta model's materialization."""

    local_pieces: Callable[[], List[int]]
    owned_ranges: Callable[[int], List[int]]  # (param, start, end) triples of a rank
    local_value_shards: Callable[[], List[Tensor]]
    segment_param_starts: Callable[[], List[int]]
    full_masters_of: Callable[[List[int]], List[Tensor]]  # buckets
    refresh_params_from_shards: Callable[[], None]
    loss_scaler_state: Callable[[], List[float]]
    restore_loss_scaler: Callable[[float, int, int], None]  # scale, clean steps, skipped steps
    begin_materialize: Callable[[List[int]], None]  # buckets
    end_materialize: Callable[[List[int]], None]

    VIEW = "CheckpointRanges"
    BOUND = ("local_pieces", "owned_ranges", "local_value_shards", "segment_param_starts", "full_masters_of",
             "refresh_params_from_shards", "loss_scaler_state", "restore_loss_scaler", "begin_materialize",
             "end_materialize")


class Diagnostics(_Handle):
    """What the core knows about itself: its counters, whether its groups
    failed, the stall diagnosis and collective checks it runs, and the
    test-only faults it can inject."""

    failed: Callable[[], bool]
    stall_queries: Callable[[], int]
    post_whereabouts: Callable[[int, bool, str], None]  # query, blocked, where
    set_test_fault: Callable[[str, int], None]  # point, step
    log_issues: Callable[[bool], None]
    take_issue_log: Callable[[], List[str]]
    traffic: Callable[[], List[int]]  # bytes sent by kind ([Note: traffic]; runtime/traffic.py)
    residual_bytes: Callable[[], int]  # compress_grads' error-feedback residuals

    VIEW = "Diagnostics"
    BOUND = ("failed", "stall_queries", "post_whereabouts", "set_test_fault", "log_issues", "take_issue_log",
             "traffic", "residual_bytes")

    def stats(self) -> CoreStats:
        return CoreStats.from_core(dict(self._view.stats()))


class GroupCollectives(_Handle):
    """A user's call's collectives (a save, a load, a clip norm) on the
    model's own groups, through the core's communicator: a failure marks the
    group failed and a stalled wait is diagnosed, as in training."""

    # (tensor, max, what) / (tensor, what) / (out, in, what): `what` names the call in errors
    group_all_reduce: Callable[[Tensor, bool, str], None]
    group_broadcast_from_rank0: Callable[[Tensor, str], None]
    group_all_gather: Callable[[Tensor, Tensor, str], None]
    mesh_all_reduce: Callable[[Tensor, bool, str], None]
    mesh_broadcast_from_rank0: Callable[[Tensor, str], None]
    mesh_all_gather: Callable[[Tensor, Tensor, str], None]

    VIEW = "GroupCollectives"
    BOUND = ("group_all_reduce", "group_broadcast_from_rank0", "group_all_gather", "mesh_all_reduce",
             "mesh_broadcast_from_rank0", "mesh_all_gather")


class OffloadFiles(_Handle):
    """offload_*="nvme" (csrc/swap_space.h, [Note: swapped buffers]): the
    rank's offload file, and bringing buckets' values and gradients into
    memory for the optimizer's step and parking them again."""

    swapped: Callable[[], bool]
    swap_in: Callable[[List[int]], None]  # buckets
    swap_prefetch: Callable[[List[int]], None]
    swap_out: Callable[[List[int], bool, bool], None]  # buckets, stepped, gradients changed
    swap_in_grads: Callable[[List[int]], None]  # buckets: their gradients alone
    swap_out_grads: Callable[[List[int], bool], None]  # buckets, changed
    swap_reset_peak: Callable[[], None]
    swap_drain: Callable[[], None]  # every write in flight done
    swap_fail_writes_after: Callable[[int], None]  # test-only

    VIEW = "OffloadFiles"
    BOUND = ("swapped", "swap_in", "swap_prefetch", "swap_out", "swap_in_grads", "swap_out_grads",
             "swap_reset_peak", "swap_drain", "swap_fail_writes_after")

    def stats(self) -> Dict[str, int]:
        """file_bytes, bytes_written, bytes_read, resident_bytes,
        peak_resident_bytes, io_buffer_bytes, slots ({} without a file)."""
        return dict(self._view.swap_stats())


@dataclasses.dataclass(frozen=True)
class CoreHandles:
    """Every handle of one core."""

    units: Units
    reduction: Reduction
    optimizer: OptimizerShards
    checkpoint: CheckpointRanges
    diagnostics: Diagnostics
    collectives: GroupCollectives
    offload: OffloadFiles

    @classmethod
    def of(cls, model: Any) -> "CoreHandles":
        """The handles of one torch.classes.zero_ext.ShardedModel; they keep it alive."""
        return cls(Units(model), Reduction(model), OptimizerShards(model), CheckpointRanges(model),
                   Diagnostics(model), GroupCollectives(model), OffloadFiles(model))
