"""Validation of wrap()'s arguments, in one place, before any communication.
The C++ core trusts what passes here (it keeps internal asserts only)."""
from __future__ import annotations

import datetime
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist

from .config import DynamicLossScale, MixedPrecision
from .deferred_init import has_meta_parameters
from .reshard import check_policy as check_reshard_policy
from ..optim import WHOLE, check_step_not_patched, optimizer_sharding
from ..runtime import ZeroExtModule
from ..tools import offload_file


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_timeout(timeout: Union[None, float, int, datetime.timedelta]) -> Optional[datetime.timedelta]:
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
    output_dtype: Optional[torch.dtype] = None  # floating forward outputs cast to it


# Elements per scale of compress_weights / compress_grads: at 2048 the fp32
# scale adds 0.2% to an int8 payload, and the error is within 20% of a
# 256-element block's (docs/benchmarks.md, "Fewer bytes on the wire").
QUANTIZATION_BLOCK = 2048


@dataclass(frozen=True)
class Options:
    """wrap()'s options, checked and normalized."""

    stage: int
    precision: Precision
    offload: bool
    units: Union[None, Set[type], Callable[[torch.nn.Module], bool], list]
    bucket_bytes: int
    timeout: Optional[datetime.timedelta]
    prefetch: int
    skip_nonfinite: bool
    whole_params: bool = False  # the optimizer steps whole parameters (optim/ownership.py)
    offload_params: Optional[str] = None  # stage 3: None, "cpu" (a CPU model's shards are host memory already) or "nvme"
    offload_path: Optional[str] = None  # the checked directory of "nvme" offload files
    offload_optimizer: Optional[str] = None  # None, "cpu" or "nvme" (offload above is "cpu")
    max_live_bytes: int = 0  # stage 3: prefetch stays under it ([Note: live budget]); 0: no bound
    persist_bytes: int = 0  # "nvme": buckets smaller stay in memory ([Note: persistent small buckets])
    reshard_after_forward: Any = True  # stage 3: wrapping/reshard.py
    compress_weights: Optional[str] = None  # stage 3: "int8" gathers ([Note: quantized collectives])
    compress_grads: Optional[str] = None  # stages 2-3: "int8" or "int4" reductions, with error feedback

    def compression_bits(self) -> Tuple[int, int]:
        """(weight bits, gradient bits) for the core; 0: off."""
        bits = {None: 0, "int8": 8, "int4": 4}
        return bits[self.compress_weights], bits[self.compress_grads]


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
    output_dtype = mixed_precision.output_dtype
    if output_dtype is not None and output_dtype not in _FLOATS:
        raise ValueError(f"zero_ext.wrap: MixedPrecision.output_dtype must be None or one of "
                         f"{sorted(_FLOATS.values())}, got {output_dtype!r}")
    compute = None if param_dtype == torch.float32 else param_dtype
    return Precision(compute, reduce_dtype, loss_scale,
                     cast_inputs=compute is not None and mixed_precision.cast_forward_inputs,
                     output_dtype=output_dtype)


def optimizer_list(optimizer: Any) -> List[torch.optim.Optimizer]:
    """wrap()'s optimizer argument as a list: one optimizer, or a list or
    tuple of them over disjoint parameters (Muon for the hidden matrices and
    AdamW for the rest)."""
    many = isinstance(optimizer, (list, tuple))
    optimizers = list(optimizer) if many else [optimizer]
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"zero_ext.wrap: optimizer must be a torch.optim.Optimizer or a list or tuple of them, got "
                f"{type(opt).__name__}" + (" in the list" if many else ""))
    if not optimizers:
        raise ValueError("zero_ext.wrap: the list of optimizers is empty")
    if len({id(o) for o in optimizers}) != len(optimizers):
        raise ValueError("zero_ext.wrap: the same optimizer appears twice in the list")
    return optimizers


def check_stage(stage: Any, who: str = "zero_ext.wrap") -> None:
    """A stage is the int 0, 1, 2 or 3 (3.0, True and "3" are refused), for
    wrap() and for what passes a stage on to it (the Lightning strategy)."""
    if not isinstance(stage, numbers.Integral) or isinstance(stage, bool):
        raise TypeError(f"{who}: stage must be the int 0, 1, 2 or 3, got {type(stage).__name__} {stage!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"{who}: stage must be 0, 1, 2 or 3, got {stage!r}")


def _check_model_and_optimizer(model, optimizers, stage, mixed_precision, offload_optimizer) -> List[torch.nn.Parameter]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zero_ext.wrap: model must be a torch.nn.Module, got {type(model).__name__}")
    check_stage(stage)
    precision = _precision(mixed_precision)
    if offload_optimizer not in _OFFLOAD_TIERS:
        raise ValueError(f"zero_ext.wrap: offload_optimizer must be None, 'cpu' or 'nvme', got {offload_optimizer!r}")

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
    # A model with meta parameters is materialized on one device by wrap() (zero_ext/wrapping/deferred_init.py).
    deferred = has_meta_parameters(model)
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1 and not deferred:
        raise ValueError(
            f"zero_ext.wrap: the model's tensors are on several devices {sorted(map(str, devices))}; "
            "move the whole model to one device (model.to(device)) before wrap()"
        )
    bad = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32]
    if bad:
        raise ValueError(
            f"zero_ext.wrap: trainable parameters must be float32 (fp32 master weights); "
            f"{bad[:3]} are not. Keep the model in fp32 and use mixed_precision for lower-precision compute."
        )

    model_ids = {id(p) for p in model.parameters()}
    groups = [g for opt in optimizers for g in opt.param_groups]
    foreign = [tuple(p.shape) for g in groups for p in g["params"] if id(p) not in model_ids]
    if foreign:
        raise ValueError(
            f"zero_ext.wrap: the optimizer holds {len(foreign)} tensors that are not parameters of this "
            f"model (shapes {foreign[:3]}); build the optimizer over model.parameters()"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    holder: dict = {}
    for k, opt in enumerate(optimizers):
        for p in {id(p): p for g in opt.param_groups for p in g["params"]}.values():
            if id(p) in holder and holder[id(p)] != k:
                raise ValueError(
                    f"zero_ext.wrap: parameter '{names[id(p)]}' is in two of the optimizers (#{holder[id(p)]} and "
                    f"#{k}); each parameter must be stepped by one optimizer")
            holder[id(p)] = k
    missing = [names[id(p)] for p in trainable if id(p) not in holder]
    if missing:
        raise ValueError(
            f"zero_ext.wrap: trainable parameters {missing[:3]} are not in the optimizer; add them "
            "to it or freeze them (requires_grad_(False)) before wrap()"
        )
    for opt in optimizers:
        if opt.state:
            raise ValueError(
                "zero_ext.wrap: the optimizer already has state (it has stepped); wrap before the "
                "first step. To resume training, load a checkpoint after wrap()"
            )
        optimizer_sharding(opt, shards_state=stage > 0)  # raises for an optimizer no rank can step a part of
        check_step_not_patched(opt)
    return trainable, precision


_OFFLOAD_TIERS = (None, "cpu", "nvme")
DEFAULT_BUCKET_MB = 25.0
# With offload_*="nvme": resident memory is a few buckets (docs/
# mixed-precision-and-offload.md, "Offload files"); 4 MiB keeps the 40 x
# Linear(1024, 1024) check at 0.25 of its state with the disk still busy.
NVME_BUCKET_MB = 4.0
# A read from the drive costs its latency (~90 us here) plus bytes over its
# bandwidth (~1.2 GB/s): under 128 KiB the latency is most of it
# (docs/mixed-precision-and-offload.md), so smaller buckets stay in memory.
NVME_PERSIST_KB = 128.0


def _check_offload(stage: int, offload_optimizer, offload_params, offload_path) -> Optional[str]:
    """offload_params and offload_path against the stage and each other;
    the offload directory (created) when "nvme" asks for one."""
    if offload_params not in _OFFLOAD_TIERS:
        raise ValueError(f"zero_ext.wrap: offload_params must be None, 'cpu' or 'nvme', got {offload_params!r}")
    if offload_params is not None and stage != 3:
        raise ValueError(
            f"zero_ext.wrap: offload_params={offload_params!r} needs stage=3: stages 0-2 keep every parameter "
            "whole on its device between uses; pass stage=3 to keep only a shard, and offload that")
    nvme = "nvme" in (offload_optimizer, offload_params)
    if offload_path is not None and not nvme:
        raise ValueError(
            "zero_ext.wrap: offload_path is where 'nvme' offload keeps its files, but neither offload_optimizer "
            "nor offload_params is 'nvme'; pass offload_optimizer='nvme' and/or offload_params='nvme', or drop "
            "offload_path")
    if not nvme:
        return None
    if offload_path is None:
        raise ValueError("zero_ext.wrap: 'nvme' offload needs offload_path=DIR, a directory on a local drive "
                         "(an NVMe drive for speed; each rank makes its own files there)")
    if offload_optimizer == "nvme" and stage == 0:
        raise ValueError(
            "zero_ext.wrap: offload_optimizer='nvme' needs stage 1, 2 or 3: it streams this rank's shard of the "
            "optimizer state through the offload file, and stage 0 shards nothing. Pass stage=1 (or higher)")
    return offload_file.check_offload_path(offload_path)


def _budget_bytes(value, name: str, unit: int, needs: Optional[str]) -> int:
    """max_live_mb / persist_kb: None (0) or a finite number >= 0, in bytes."""
    if value is None:
        return 0
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"zero_ext.wrap: {name} must be None or a finite number >= 0, got {value!r}")
    if needs:
        raise ValueError(f"zero_ext.wrap: {name} {needs}")
    return int(value * unit)


def check_wrap_arguments(model, optimizers, stage, mixed_precision, offload_optimizer, units, bucket_mb, timeout,
                         prefetch, skip_nonfinite, reshard_after_forward=None, offload_params=None,
                         offload_path=None, max_live_mb=None, persist_kb=None, compress_weights=None,
                         compress_grads=None) -> Tuple[List[torch.nn.Parameter], Options]:
    """The trainable parameters and the normalized options; raises TypeError
    or ValueError on bad input. `optimizers`: optimizer_list()'s."""
    trainable, precision = _check_model_and_optimizer(model, optimizers, stage, mixed_precision, offload_optimizer)
    stage = int(stage)  # a numpy integer, say
    offload_dir = _check_offload(stage, offload_optimizer, offload_params, offload_path)
    if units is not None and stage != 3:
        raise ValueError("zero_ext.wrap: units only applies to stage 3")
    if bucket_mb is None:
        # Offload to files keeps about two buckets of each kind in memory
        # ([Note: swapped buffers]): smaller buckets bound it tighter.
        bucket_mb = NVME_BUCKET_MB if offload_dir is not None else DEFAULT_BUCKET_MB
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
    if not isinstance(skip_nonfinite, bool):
        raise TypeError(f"zero_ext.wrap: skip_nonfinite must be True or False, got {skip_nonfinite!r}")
    if reshard_after_forward is None:
        reshard_after_forward = True
    else:
        check_reshard_policy(reshard_after_forward)
        if stage != 3 and reshard_after_forward is not False and reshard_after_forward != 1:
            raise ValueError(
                f"zero_ext.wrap: reshard_after_forward={reshard_after_forward!r} needs stage=3: stages 0-2 keep "
                "parameters whole (FSDP2's reshard_after_forward=False is stage 2); pass stage=3 to release "
                "parameters between uses")
    max_live = _budget_bytes(max_live_mb, "max_live_mb", 2**20,
                             "bounds stage 3's gathered parameters: pass stage=3" if stage != 3 else None)
    persist = _budget_bytes(persist_kb, "persist_kb", 2**10,
                            "keeps small buckets out of the offload files: it needs offload_optimizer='nvme' or "
                            "offload_params='nvme'" if offload_dir is None else None)
    if persist_kb is None and offload_dir is not None:
        persist = int(NVME_PERSIST_KB * 2**10)
    _check_compression(stage, precision, compress_weights, compress_grads)
    options = Options(stage=stage, precision=precision, offload=offload_optimizer == "cpu", units=units,
                      bucket_bytes=int(bucket_mb * 2**20), timeout=parse_timeout(timeout), prefetch=int(prefetch),
                      skip_nonfinite=skip_nonfinite, reshard_after_forward=reshard_after_forward,
                      offload_params=offload_params, offload_path=offload_dir, offload_optimizer=offload_optimizer,
                      max_live_bytes=max_live, persist_bytes=persist, compress_weights=compress_weights,
                      compress_grads=compress_grads,
                      whole_params=any(optimizer_sharding(opt, shards_state=stage > 0) == WHOLE for opt in optimizers))
    return trainable, options


def _check_compression(stage: int, precision: Precision, compress_weights: Any, compress_grads: Any) -> None:
    """compress_weights: None or "int8", stage 3; compress_grads: None, "int8"
    or "int4", stages 2-3, gradients reduced in fp32 or bf16."""
    for name, value, allowed in (("compress_weights", compress_weights, (None, "int8")),
                                 ("compress_grads", compress_grads, (None, "int8", "int4"))):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"zero_ext.wrap: {name} must be one of {allowed}, got {type(value).__name__} {value!r}")
        if value not in allowed:
            raise ValueError(f"zero_ext.wrap: {name} must be one of {allowed}, got {value!r}")
    if compress_weights is not None and stage != 3:
        raise ValueError(
            f"zero_ext.wrap: compress_weights={compress_weights!r} quantizes stage 3's parameter all-gathers, but "
            f"stage {stage} gathers no parameters in training; pass stage=3, or drop compress_weights")
    if compress_grads is not None and stage not in (2, 3):
        raise ValueError(
            f"zero_ext.wrap: compress_grads={compress_grads!r} quantizes the gradient reduce-scatter of stages 2 "
            f"and 3; stage {stage} all-reduces whole gradients: pass stage=2 or 3, or drop compress_grads")
    if compress_grads is not None and precision.reduce_dtype == torch.float16:
        raise ValueError(
            f"zero_ext.wrap: compress_grads={compress_grads!r} with reduce_dtype=torch.float16: fp16 reductions "
            "carry the loss scale, which error feedback would carry over into the next step's scale; reduce in "
            "fp32 (MixedPrecision(reduce_dtype=torch.float32), the default) or bf16")


def check_backend(group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    if group is not None and dist.get_backend(group) == "nccl" and device.type == "cpu":
        raise ValueError(
            "zero_ext.wrap: the process group uses NCCL, which reduces GPU tensors only, but the model "
            "is on the CPU; move it to this rank's GPU first (model.to(f'cuda:{local_rank}')), then "
            "call wrap() (or use a gloo group for CPU training)"
        )


def check_launch(process_group: Any) -> None:
    """A launcher (torchrun, accelerate launch) started this process as one
    of several ranks but torch.distributed was never initialized: wrap()'s
    single-process fallback (for notebooks) would train each rank alone on
    its own data, silently. Refused before anything is set up."""
    if process_group is not None or (dist.is_available() and dist.is_initialized()):
        return
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return  # not a launcher's value
    if world > 1:
        raise RuntimeError(
            f"zero_ext.wrap: this process was launched as one of WORLD_SIZE={world} ranks "
            f"(RANK={os.environ.get('RANK', '?')}), but torch.distributed is not initialized, so every rank "
            "would train alone on its own data. Call torch.distributed.init_process_group() (backend 'nccl' "
            "for CUDA, 'gloo' for CPU) on every rank before zero_ext.wrap(); to train one process alone, "
            "launch it without torchrun")
