"""zero_ext.wrap(): validate, lay out buckets, hook the model, shard the optimizer."""
from __future__ import annotations

import datetime
import math
import numbers
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist

from ._api import DynamicLossScale, MixedPrecision
from ._bucket_plan import plan_buckets
from ._C_loader import ShardedModel
from ._testing import apply_test_fault
from ._groups import acquire_groups, group_timeout
from ._module import ZeroExtModule, install_forward_hooks, swap_module_class
from ._optimizer import check_elementwise, check_step_not_patched, shard_optimizer
from ._units import Unit, assign_parameters, resolve_units


# c10::ScalarType codes of the dtypes mixed precision computes in.


@dataclass
class ZeroState:
    """Everything zero_ext keeps for one wrapped model (model._zero_ext)."""

    model_ref: "weakref.ref[torch.nn.Module]"  # weak: the model holds this state
    stage: int
    buckets: object  # torch.classes.zero_ext.ShardedModel: the C++ core
    process_group: Optional[dist.ProcessGroup]  # zero_ext's own reduction group
    world_size: int
    device: torch.device
    params: List[torch.nn.Parameter]  # trainable, in bucket order
    names: List[str]
    bucketed: List[torch.nn.Parameter]  # what the core indexes (stage 3: frozen too)
    param_ids: Set[int]
    bucketed_names: List[str]
    compute_dtype: Optional[torch.dtype]  # mixed precision: what parameters compute in
    cast_inputs: bool  # floating forward inputs are cast to compute_dtype
    sharded_optimizer: bool  # the optimizer steps zero_ext's segments (not the parameters)
    offload: bool  # masters, gradient accumulators and optimizer state in host memory

    def check_parameters_unchanged(self) -> None:
        """Once per step: a parameter replaced by a new object after wrap()
        would train on silently missing gradients."""
        model = self.model_ref()
        current = [p for p in model.parameters() if p.requires_grad]
        if len(current) == len(self.params) and all(id(p) in self.param_ids for p in current):
            return
        names = {id(p): n for n, p in model.named_parameters()}
        new = [names[id(p)] for p in current if id(p) not in self.param_ids]
        gone = [n for p, n in zip(self.params, self.names) if id(p) not in names or not p.requires_grad]
        raise RuntimeError(
            "zero_ext: the model's trainable parameters changed after zero_ext.wrap() "
            f"(new or replaced: {new or 'none'}; no longer trainable or removed: {gone or 'none'}). "
            "Their gradients would not be reduced or stepped. Update parameters in place "
            "(param.data.copy_(...)) or freeze/replace them before calling wrap()."
        )


_stall_generation: Dict[str, int] = {}


def _resolve_group(process_group: Optional[dist.ProcessGroup]) -> Tuple[Optional[dist.ProcessGroup], int]:
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1  # notebooks: a single process, no communication
        process_group = dist.group.WORLD
    if dist.get_rank(process_group) < 0:
        raise ValueError(
            "zero_ext.wrap: this rank is not a member of the process_group passed; "
            "call wrap() only on ranks of that group, or pass a group that contains this rank."
        )
    world = dist.get_world_size(process_group)
    return process_group, world


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _timeout(timeout: Union[None, float, int, datetime.timedelta]) -> Optional[datetime.timedelta]:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif _is_real(timeout):
        seconds = float(timeout)
    else:
        raise TypeError(f"zero_ext.wrap: timeout must be seconds (a number) or a datetime.timedelta, "
                        f"got {type(timeout).__name__} {timeout!r}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"zero_ext.wrap: timeout must be a finite positive duration (it bounds every "
                         f"collective wait), got {timeout!r}; pass None for the process group's own")
    return datetime.timedelta(seconds=seconds)


@dataclass(frozen=True)
class Precision:
    """What wrap() resolved mixed_precision to."""

    compute_dtype: Optional[torch.dtype]  # None: parameters compute in fp32
    reduce_dtype: torch.dtype
    loss_scale: Union[None, float, DynamicLossScale]  # fp16 only
    cast_inputs: bool = False  # floating forward inputs cast to compute_dtype


_FLOATS = {torch.float32: "torch.float32", torch.bfloat16: "torch.bfloat16", torch.float16: "torch.float16"}


def _precision(mixed_precision: Union[None, str, MixedPrecision]) -> Precision:
    if mixed_precision is None:
        return Precision(None, torch.float32, None)
    if isinstance(mixed_precision, str):
        if mixed_precision not in ("bf16", "fp16"):
            raise ValueError(
                f"zero_ext.wrap: mixed_precision must be None, 'bf16', 'fp16' or "
                f"zero_ext.MixedPrecision(...), got {mixed_precision!r}"
            )
        mixed_precision = MixedPrecision(torch.bfloat16 if mixed_precision == "bf16" else torch.float16)
    elif not isinstance(mixed_precision, MixedPrecision):
        raise ValueError(
            f"zero_ext.wrap: mixed_precision must be None, 'bf16', 'fp16' or "
            f"zero_ext.MixedPrecision(...), got {mixed_precision!r}"
        )
    param_dtype = mixed_precision.param_dtype
    reduce_dtype = mixed_precision.reduce_dtype or torch.float32
    for what, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype not in _FLOATS:
            raise ValueError(
                f"zero_ext.wrap: MixedPrecision.{what} must be one of {sorted(_FLOATS.values())}, got {dtype!r}"
            )
    loss_scale = mixed_precision.loss_scale
    if param_dtype != torch.float16:
        if loss_scale is not None:
            raise ValueError(
                "zero_ext.wrap: loss_scale applies to float16 compute only (bf16 and fp32 have "
                "fp32's exponent range); drop it"
            )
    else:
        if loss_scale is None:
            loss_scale = DynamicLossScale()
        ok = isinstance(loss_scale, DynamicLossScale) or (
            isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and loss_scale > 0)
        if not ok:
            raise ValueError(
                f"zero_ext.wrap: loss_scale must be None (dynamic), a zero_ext.DynamicLossScale or a "
                f"positive number (static; 1.0 turns scaling off), got {loss_scale!r}"
            )
        if isinstance(loss_scale, DynamicLossScale):
            d = loss_scale
            if not (d.initial_scale > 0 and d.growth_factor >= 1 and 0 < d.backoff_factor < 1
                    and d.growth_interval >= 1 and d.min_scale > 0 and d.hysteresis >= 1):
                raise ValueError(
                    f"zero_ext.wrap: DynamicLossScale needs initial_scale > 0, growth_factor >= 1, "
                    f"0 < backoff_factor < 1, growth_interval >= 1, min_scale > 0 and hysteresis >= 1; "
                    f"got {d}")
        elif float(loss_scale) == 1.0:
            loss_scale = None
    if not isinstance(mixed_precision.cast_forward_inputs, bool):
        raise TypeError(f"zero_ext.wrap: MixedPrecision.cast_forward_inputs must be True or False, "
                        f"got {mixed_precision.cast_forward_inputs!r}")
    compute = None if param_dtype == torch.float32 else param_dtype
    return Precision(compute, reduce_dtype, loss_scale,
                     cast_inputs=compute is not None and mixed_precision.cast_forward_inputs)


def _validate(model, optimizer, stage, mixed_precision, offload_optimizer) -> List[torch.nn.Parameter]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zero_ext.wrap: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"zero_ext.wrap: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if not isinstance(stage, numbers.Integral) or isinstance(stage, bool):  # 3.0, True, "3": refused
        raise TypeError(f"zero_ext.wrap: stage must be the int 0, 1, 2 or 3, got {type(stage).__name__} {stage!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_ext.wrap: stage must be 0, 1, 2 or 3, got {stage!r}")
    precision = _precision(mixed_precision)
    if offload_optimizer is not None and offload_optimizer != "cpu":
        raise ValueError(f"zero_ext.wrap: offload_optimizer must be None or 'cpu', got {offload_optimizer!r}")

    for module in model.modules():
        if isinstance(module, ZeroExtModule):
            where = "the model itself" if module is model else "one of its submodules"
            raise ValueError(
                f"zero_ext.wrap: {where} is already wrapped by zero_ext; wrap each model "
                "once, at the top level"
            )
    for p in model.parameters():
        if getattr(p, "_zero_ext_owner", None) is not None:
            raise ValueError(
                "zero_ext.wrap: this module's parameters belong to a model already wrapped by "
                "zero_ext (is it a submodule of one?); wrap each model once, at the top level"
            )

    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(
            "zero_ext.wrap: the model has no trainable parameters (every requires_grad is False); "
            "there is nothing to shard or train"
        )
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1:
        raise ValueError(
            f"zero_ext.wrap: the model's tensors are on several devices {sorted(map(str, devices))}; "
            "move the whole model to one device (model.to(device)) before wrap()"
        )
    if devices == {torch.device("meta")}:
        raise ValueError(
            "zero_ext.wrap: the model's parameters are on the meta device (not materialized); "
            "materialize them first (model.to_empty(device=...) and initialize them, or load "
            "weights) and then call wrap()"
        )
    bad = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32]
    if bad:
        raise ValueError(
            f"zero_ext.wrap: trainable parameters must be float32 (fp32 master weights); "
            f"{bad[:3]} are not. Keep the model in fp32 and use mixed_precision for lower-precision compute."
        )

    model_ids = {id(p) for p in model.parameters()}
    foreign = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if id(p) not in model_ids]
    if foreign:
        raise ValueError(
            f"zero_ext.wrap: the optimizer holds {len(foreign)} tensors that are not parameters of this "
            f"model (shapes {foreign[:3]}); build the optimizer over model.parameters()"
        )
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [names[id(p)] for p in trainable if id(p) not in in_optimizer]
    if missing:
        raise ValueError(
            f"zero_ext.wrap: trainable parameters {missing[:3]} are not in the optimizer; add them "
            "to it or freeze them (requires_grad_(False)) before wrap()"
        )
    if optimizer.state:
        raise ValueError(
            "zero_ext.wrap: the optimizer already has state (it has stepped); wrap before the "
            "first step. To resume training, load a checkpoint after wrap()"
        )
    check_elementwise(optimizer, stage)
    check_step_not_patched(optimizer)
    return trainable, precision


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


def wrap(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: int = 2,
    process_group: Optional[dist.ProcessGroup] = None,
    mixed_precision: Union[None, str, MixedPrecision] = None,
    offload_optimizer: Optional[str] = None,
    units: Union[None, Set[type], Callable[[torch.nn.Module], bool]] = None,
    bucket_mb: float = 25.0,
    timeout: Union[None, float, datetime.timedelta] = None,
    prefetch: int = 1,
    skip_nonfinite: bool = False,
) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Makes `model` and `optimizer` ZeRO data parallel, in place.

    Train with plain ``loss.backward(); optimizer.step(); optimizer.zero_grad()``.
    Gradients are averaged over the ranks of `process_group` (the world group
    by default; a single process if torch.distributed is not initialized).

    Args:
        model: module already on its device; modified in place, same names.
        optimizer: a torch.optim.Optimizer over ``model.parameters()``.
        stage: 0 replicated (DDP-like), 1 sharded optimizer state,
            2 also sharded gradients, 3 also sharded parameters.
        mixed_precision: None (fp32), "bf16", "fp16" (with dynamic loss
            scaling) or a MixedPrecision; the optimizer steps fp32 masters.
        offload_optimizer: "cpu" keeps fp32 masters, gradient shards and
            optimizer state in host memory (Adam/AdamW step in C++).
        units: stage 3: submodules gathered as one (a set of module classes
            or a callable module -> bool), each a unit of its own; default:
            each repeated block, consecutive blocks smaller than bucket_mb
            merged into one unit of at least bucket_mb.
        bucket_mb: gradient bucket size in MiB, the size that amortizes one
            collective. Stage 3 reduces (and gathers) one bucket per unit,
            so the default units policy merges small blocks up to it.
        timeout: bound in seconds on every collective wait.
        prefetch: stage 3: units whose all-gather runs ahead of use.
        skip_nonfinite: skip (on every rank, with a warning) an optimizer
            step whose gradients hold inf/nan on any rank; off by default,
            as in PyTorch. fp16 loss scaling skips such steps regardless.
            ``optimizer.skipped_steps`` counts the skipped steps.
    Returns:
        ``(model, optimizer)``, the same objects.
    Raises:
        TypeError, ValueError: bad input, before any communication.
    """
    trainable, precision = _validate(model, optimizer, stage, mixed_precision, offload_optimizer)
    stage = int(stage)  # a numpy integer, say
    if units is not None and stage != 3:
        raise ValueError("zero_ext.wrap: units only applies to stage 3")
    if not _is_real(bucket_mb):
        raise TypeError(f"zero_ext.wrap: bucket_mb must be a number of MiB, got {type(bucket_mb).__name__} "
                        f"{bucket_mb!r}")
    if not (math.isfinite(bucket_mb) and 0 < bucket_mb <= 2 ** 20):
        raise ValueError(f"zero_ext.wrap: bucket_mb must be finite and in (0, 1048576] MiB (25 is the "
                         f"default), got {bucket_mb!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, numbers.Integral):
        raise TypeError(f"zero_ext.wrap: prefetch must be an int (units gathered ahead), got "
                        f"{type(prefetch).__name__} {prefetch!r}")
    if prefetch < 0:
        raise ValueError(f"zero_ext.wrap: prefetch must be >= 0, got {prefetch!r}")
    prefetch = int(prefetch)
    if not isinstance(skip_nonfinite, bool):
        raise TypeError(f"zero_ext.wrap: skip_nonfinite must be True or False, got {skip_nonfinite!r}")
    group, world = _resolve_group(process_group)
    timeout_td = _timeout(timeout)
    device = trainable[0].device
    if group is not None and dist.get_backend(group) == "nccl" and device.type == "cpu":
        raise ValueError(
            "zero_ext.wrap: the process group uses NCCL, which reduces GPU tensors only, but the model "
            "is on the CPU; move it to this rank's GPU first (model.to(f'cuda:{local_rank}')), then "
            "call wrap() (or use a gloo group for CPU training)"
        )

    group_of = {id(p): g for g, group_ in enumerate(optimizer.param_groups) for p in group_["params"]}
    unit_list: List[Unit] = []
    if stage == 3:
        # The default policy merges consecutive small blocks until a unit
        # holds bucket_mb: one all-gather and one reduce-scatter per unit,
        # each as big as a stage 0-2 bucket (see _units.py for the choice).
        unit_list = resolve_units(model, units, min_bytes=int(bucket_mb * 2**20))
        ordered, counts, unit_of_bucket = _plan_units(model, unit_list)
    else:
        ordered, counts = plan_buckets(trainable, int(bucket_mb * 2**20))
        unit_of_bucket = []
    names_by_id = {id(p): n for n, p in model.named_parameters()}
    names = [names_by_id[id(p)] for p in ordered]
    flags = [int(p.requires_grad) for p in ordered]
    # Groups of zero_ext's own (see _groups.py), owned by this model; stage 3
    # gathers parameters on a second one (see csrc/units.h).
    own_groups = []
    if group is not None and world > 1:
        own_groups = acquire_groups(group, 2 if stage == 3 else 1, timeout_td, ordered[0].device, model)
    names_of = [g.group_name for g in own_groups]
    reduce_name = names_of[0] if names_of else ""
    gather_name = names_of[1] if len(names_of) > 1 else ""
    compute_dtype = precision.compute_dtype
    offload = offload_optimizer == "cpu"
    buckets = ShardedModel(ordered, names, flags, counts, unit_of_bucket, stage, reduce_name,
                           gather_name, prefetch, compute_dtype, precision.reduce_dtype, offload)
    apply_test_fault(buckets, dist.get_rank(group) if group is not None and world > 1 else 0)
    scale = precision.loss_scale
    if isinstance(scale, DynamicLossScale):
        buckets.enable_loss_scaling(float(scale.initial_scale), float(scale.growth_factor),
                                    float(scale.backoff_factor), int(scale.growth_interval),
                                    float(scale.min_scale), int(scale.hysteresis), True)
    elif scale is not None:
        buckets.enable_loss_scaling(float(scale), 2.0, 0.5, 1, 1.0, 1, False)
    buckets.set_skip_nonfinite(skip_nonfinite)
    if reduce_name:
        # A wait stalled this long compares notes with the other ranks (see
        # communicator.h): a quarter of the timeout, between 1 s and 30 s.
        limit = timeout_td or group_timeout(group)
        seconds = limit.total_seconds() if limit is not None else 1800.0
        # Per use of the (pooled) group, so a later model never reads an
        # earlier one's posts; pools are chosen alike on every rank.
        _stall_generation[reduce_name] = _stall_generation.get(reduce_name, 0) + 1
        key_space = f"{reduce_name}/{_stall_generation[reduce_name]}"
        buckets.enable_stall_diagnosis(min(max(seconds / 4, 1.0), 30.0), key_space)
    if group is not None and world > 1:
        with torch.no_grad():
            for name, buffer in model.named_buffers():  # every rank starts from rank 0's state
                buckets.group_broadcast_from_rank0(buffer, f"wrap(): broadcasting buffer {name} from rank 0")

    state = ZeroState(
        model_ref=weakref.ref(model), stage=stage, buckets=buckets,
        process_group=own_groups[0] if own_groups else None, world_size=world,
        device=ordered[0].device, params=[p for p in ordered if p.requires_grad],
        names=[n for n, p in zip(names, ordered) if p.requires_grad],
        param_ids={id(p) for p in ordered if p.requires_grad}, bucketed=ordered,
        bucketed_names=names, compute_dtype=compute_dtype, cast_inputs=precision.cast_inputs,
        sharded_optimizer=stage >= 1 or buckets.has_masters(), offload=offload,
    )
    for p in ordered:
        p._zero_ext_owner = weakref.ref(state)  # zero_ext.clip_grad_norm_ and full_params find it
    swap_module_class(model)
    model._zero_ext = state
    install_forward_hooks(model, unit_list)
    shard_optimizer(optimizer, state, ordered, group_of)
    return model, optimizer
