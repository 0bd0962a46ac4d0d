"""zero_ext in an `accelerate` training loop.

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, scheduler = zero_ext.integrations.accelerate.prepare(
        accelerator, model, optimizer, scheduler, stage=3)
    dataloader = accelerator.prepare(dataloader)
    for batch in dataloader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(batch)))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the true global norm
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state(path)   # model and optimizer through zero_ext.save
    accelerator.load_state(path)   # ... and zero_ext.load, at any world size

accelerate has no plugin registry for a sharding system (its DistributedType
is a closed enum), so zero_ext takes the objects out of accelerate's hands:
  - the model is marked prepared, so accelerate never wraps it in DDP;
    `accumulate()` then reaches `model.no_sync()` itself;
  - the optimizer is wrapped in accelerate's AcceleratedOptimizer (which skips
    step/zero_grad on micro-steps that do not sync) and reports zero_ext's own
    skipped steps; accelerate's GradScaler and autocast are switched off,
    since zero_ext casts and scales itself (the accelerator's mixed_precision
    becomes zero_ext's);
  - `accelerator.clip_grad_norm_` clips with `zero_ext.clip_grad_norm_` and
    `clip_grad_value_` clamps each rank's shard (torch's own, which
    accelerate calls, sees only this rank's shards or none);
  - `accelerator.get_state_dict` (and so `save_model`) gives the fp32 masters
    under mixed precision, as DDP's fp32 parameters would;
  - save_state/load_state write and read the model and optimizer as a
    zero_ext checkpoint in `zero_ext/` (`zero_ext_1/`, ... for more models)
    inside the state directory; accelerate keeps the rest (schedulers,
    dataloaders, RNG). Every rank calls them, as accelerate asks anyway;
  - a later `accelerator.prepare(...)` of these objects gives back what
    prepare() returned (the model stays out of accelerate's model list).
`accelerator.prepare` alone cannot take a zero_ext optimizer in stages 1-3:
its AcceleratedOptimizer reads the sharded state_dict(), which zero_ext
refuses with an error naming this module.
"""
from __future__ import annotations

import functools
import os
import types
from typing import Any, List, Optional, Tuple

import torch

from ..files import export_state_dict
from ..files import load as zero_ext_load
from ..files import save as zero_ext_save
from ..optim import clip_grad_norm_ as zero_ext_clip_grad_norm_
from ..optim import clip_grad_value_ as zero_ext_clip_grad_value_
from ._common import check_wrap_options, is_wrapped, library_mixed_precision, wrap_once

_REFUSED = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


def checkpoint_dir_name(index: int) -> str:
    return "zero_ext" if index == 0 else f"zero_ext_{index}"


def prepare(accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scheduler: Optional[Any] = None, **wrap_options: Any) -> Tuple[Any, ...]:
    """Wraps `model` and `optimizer` with zero_ext (``wrap_options`` are
    zero_ext.wrap's) and hands them to `accelerator` without letting it
    wrap them again. Collective: every rank calls it. Returns ``(model,
    optimizer)``, or ``(model, optimizer, scheduler)`` when a scheduler of
    that optimizer is given (stepped as accelerate steps its own). Prepare
    dataloaders with ``accelerator.prepare`` as usual."""
    from accelerate.scheduler import AcceleratedScheduler

    where = "zero_ext.integrations.accelerate.prepare"
    if isinstance(optimizer, (list, tuple)):
        raise ValueError(
            f"{where}: takes one optimizer; several (Muon + AdamW) are not wired into accelerate's wrappers yet. "
            "Call zero_ext.wrap(model, [muon, adamw]) yourself and step the list in your loop (zero_ext.save/load "
            "take the list), or use one optimizer here.")
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind in _REFUSED:
        raise ValueError(f"{where}: the Accelerator is set up for {kind}, another sharding system; "
                         "launch without its plugin/config (plain multi-process) and let zero_ext shard")
    options = check_wrap_options(wrap_options, where)
    options = library_mixed_precision(str(accelerator.mixed_precision), options, where)
    if getattr(accelerator, "_zero_ext_models", None) is None:
        _take_over(accelerator)
    model, optimizer = wrap_once(model, optimizer, options)
    model._is_accelerate_prepared = True
    if all(m is not model for m, _ in accelerator._zero_ext_models):
        accelerator._zero_ext_models.append((model, optimizer))

    accelerated = next((o for o in accelerator._optimizers if getattr(o, "optimizer", None) is optimizer), None)
    if accelerated is None:
        accelerated = _accelerated_optimizer_class()(optimizer, device_placement=False, scaler=None)
        accelerated._is_accelerate_prepared = True
        accelerator._optimizers.append(accelerated)
    if scheduler is None:
        return model, accelerated
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise ValueError(f"{where}: the scheduler steps another optimizer than the one given")
    stepped = next((s for s in accelerator._schedulers if getattr(s, "scheduler", None) is scheduler), None)
    if stepped is None:
        stepped = AcceleratedScheduler(scheduler, [accelerated], split_batches=accelerator.split_batches,
                                       step_with_optimizer=accelerator.step_scheduler_with_optimizer)
        stepped._is_accelerate_prepared = True
        accelerator._schedulers.append(stepped)  # saved and loaded by save_state/load_state as accelerate's own
    return model, accelerated, stepped


@functools.lru_cache(maxsize=None)
def _accelerated_optimizer_class() -> type:
    """accelerate's optimizer wrapper (it skips step/zero_grad on micro-steps
    that do not sync), reporting zero_ext's own skipped steps."""
    from accelerate.optimizer import AcceleratedOptimizer

    class ZeroExtAcceleratedOptimizer(AcceleratedOptimizer):
        @property
        def step_was_skipped(self) -> bool:  # fp16 overflow or skip_nonfinite, the same on every rank
            return bool(getattr(self.optimizer, "step_was_skipped", False))

        # Registered with the accelerator (so optimizer_step_was_skipped and
        # prepare(scheduler) see it), save_state/load_state call these; the
        # state itself travels in the zero_ext/ checkpoint the hooks write.
        def state_dict(self) -> dict:
            return {"zero_ext": "this optimizer's state is in the zero_ext checkpoint of the state directory"}

        def load_state_dict(self, state_dict: dict) -> None:
            pass  # restored by zero_ext.load in the load_state hook, before this is called

    return ZeroExtAcceleratedOptimizer


def _take_over(accelerator: Any) -> None:
    """Once per Accelerator: zero_ext's checkpoint hooks, clipping, exports,
    precision, and prepare() of objects zero_ext already holds."""
    accelerator._zero_ext_models: List[Tuple[torch.nn.Module, torch.optim.Optimizer]] = []
    # zero_ext casts parameters and scales fp16 losses itself: accelerate's
    # scaler would scale gradients nothing unscales, its autocast recast them.
    accelerator.scaler = None
    accelerator.native_amp = False

    def install(function: Any, doc: str) -> None:
        function.__doc__ = f"{doc} (installed by zero_ext.integrations.accelerate.prepare)"
        setattr(accelerator, function.__name__, types.MethodType(function, accelerator))

    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        return zero_ext_clip_grad_norm_(parameters, max_norm, norm_type)

    install(clip_grad_norm_, "zero_ext.clip_grad_norm_: the global norm over every rank's shards")

    # accelerate's calls torch's, which in stages 2-3 meets the param.grad
    # stand-ins; clamping is elementwise, so each rank clamps its shard.
    def clip_grad_value_(self: Any, parameters: Any, clip_value: float) -> None:
        zero_ext_clip_grad_value_(parameters, clip_value)

    install(clip_grad_value_, "zero_ext.clip_grad_value_: clamps the gradient each rank holds")

    # accelerate's returns model.state_dict(): under mixed precision the
    # compute-dtype copies. save_model and save_state read it through here.
    original_get_state_dict = accelerator.get_state_dict

    def get_state_dict(self: Any, model: torch.nn.Module, unwrap: bool = True) -> dict:
        if is_wrapped(model):
            return export_state_dict(model)
        return original_get_state_dict(model, unwrap)

    install(get_state_dict, "The model's state_dict, with zero_ext's fp32 masters under mixed precision; "
            "collective for a zero_ext model under mixed precision or at stage 3")

    # accelerator.prepare(model, optimizer, ...) after prepare(accelerator,
    # ...) gives back what prepare() made. The model stays out of
    # accelerator._models: save_state/load_state would write it again and
    # load it through safetensors' load_model, which refuses parameters that
    # are views of zero_ext's flat buffers; the zero_ext checkpoint holds it.
    # The optimizer gets its wrapper (a new AcceleratedOptimizer would read
    # the sharded state_dict and fail), the scheduler its wrapper.
    original_prepare_model = accelerator.prepare_model
    original_prepare_optimizer = accelerator.prepare_optimizer
    original_prepare_scheduler = accelerator.prepare_scheduler
    not_given = ("accelerator.prepare: this {what} is wrapped by zero_ext but was not given to "
                 "zero_ext.integrations.accelerate.prepare(accelerator, model, optimizer, ...); pass the model and "
                 "its optimizer there (accelerate's own handling would read sharded state and skip zero_ext's "
                 "clipping and checkpoints)")

    def prepare_model(self: Any, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if is_wrapped(model):
            if all(m is not model for m, _ in self._zero_ext_models):
                raise ValueError(not_given.format(what="model"))
            return model
        return original_prepare_model(model, *args, **kwargs)

    def prepare_optimizer(self: Any, optimizer: Any, device_placement: Any = None) -> Any:
        if is_wrapped(optimizer):
            for accelerated in self._optimizers:
                if getattr(accelerated, "optimizer", None) is optimizer:
                    return accelerated
            raise ValueError(not_given.format(what="optimizer"))
        return original_prepare_optimizer(optimizer, device_placement)

    def prepare_scheduler(self: Any, scheduler: Any) -> Any:
        for stepped in self._schedulers:
            if getattr(stepped, "scheduler", None) is scheduler:
                return stepped
        return original_prepare_scheduler(scheduler)

    install(prepare_model, "accelerate's prepare_model; a zero_ext model is returned as is, unregistered")
    install(prepare_optimizer, "accelerate's prepare_optimizer; a zero_ext optimizer gets the wrapper "
            "zero_ext.integrations.accelerate.prepare made")
    install(prepare_scheduler, "accelerate's prepare_scheduler; a scheduler already prepared is returned as is")

    def save_hook(models: Any, weights: Any, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)  # every rank may arrive before the main process made it
        for i, (model, optimizer) in enumerate(accelerator._zero_ext_models):
            zero_ext_save(os.path.join(output_dir, checkpoint_dir_name(i)), model, optimizer)

    def load_hook(models: Any, input_dir: str) -> None:
        for i, (model, optimizer) in enumerate(accelerator._zero_ext_models):
            path = os.path.join(input_dir, checkpoint_dir_name(i))
            if not os.path.isdir(path):
                raise FileNotFoundError(f"accelerator.load_state: {input_dir} has no zero_ext checkpoint "
                                        f"{checkpoint_dir_name(i)}/ for the zero_ext model #{i}; it was not saved "
                                        "by accelerator.save_state after zero_ext.integrations.accelerate.prepare")
            zero_ext_load(path, model, optimizer)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
