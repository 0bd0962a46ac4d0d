"""zero_ext in an `accelerate` training loop.

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=not torch.cuda.is_available())
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
These hooks are one AccelerateAdapter per Accelerator, installed by the
first prepare(). On CPU ranks the Accelerator must be made with cpu=True:
without it accelerate still builds the torchrun group but reports one
process, and prepare() refuses it (every rank would see every batch).
`accelerator.prepare` alone cannot take a zero_ext optimizer in stages 1-3:
its AcceleratedOptimizer reads the sharded state_dict(), which zero_ext
refuses with an error naming this module.
"""
from __future__ import annotations

import functools
import os
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

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
    check_process_count(accelerator, where)
    options = check_wrap_options(wrap_options, where)
    options = library_mixed_precision(str(accelerator.mixed_precision), options, where)
    adapter = AccelerateAdapter.of(accelerator)
    model, optimizer = wrap_once(model, optimizer, options)
    model._is_accelerate_prepared = True
    if all(m is not model for m, _ in adapter.models):
        adapter.models.append((model, optimizer))

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


def check_process_count(accelerator: Any, where: str) -> None:
    """The ranks accelerate counts must be the process group's. Launched by
    torchrun on a machine without GPUs, an Accelerator made without
    cpu=True still initializes the group (of every rank) but says
    num_processes 1 and process_index 0: its dataloaders would give every
    rank every batch and every rank would act as the main process (writing
    the outputs). Each rank sees the same two numbers, so each raises."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    counted = int(accelerator.num_processes)
    if counted != world:
        raise ValueError(
            f"{where}: accelerate reports num_processes {counted} but torch.distributed has {world} ranks, so every "
            "rank would train on every batch and act as the main process. On CPU ranks (no GPU) make the "
            "Accelerator with Accelerator(cpu=True) (under torchrun, or accelerate launch --cpu); on GPUs, launch "
            "one process per GPU with torchrun or accelerate launch")


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


_NOT_GIVEN = ("accelerator.prepare: this {what} is wrapped by zero_ext but was not given to "
              "zero_ext.integrations.accelerate.prepare(accelerator, model, optimizer, ...); pass the model and "
              "its optimizer there (accelerate's own handling would read sharded state and skip zero_ext's "
              "clipping and checkpoints)")


class AccelerateAdapter:
    """zero_ext inside one Accelerator: the zero_ext models it holds, and the
    accelerator methods that must act on them (PATCHED, set on the
    accelerator as this object's methods; the originals are kept for
    everything else) plus its save_state/load_state hooks. Installed once,
    by the first prepare(); find it with AccelerateAdapter.of(accelerator).

    zero_ext casts parameters and scales fp16 losses itself, so accelerate's
    GradScaler (it would scale gradients nothing unscales) and autocast (it
    would recast them) are switched off."""

    PATCHED = ("clip_grad_norm_", "clip_grad_value_", "get_state_dict", "prepare_model", "prepare_optimizer",
               "prepare_scheduler")

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.models: List[Tuple[torch.nn.Module, torch.optim.Optimizer]] = []  # in prepare() order
        self._original = {name: getattr(accelerator, name) for name in self.PATCHED}

    @classmethod
    def of(cls, accelerator: Any) -> "AccelerateAdapter":
        """The accelerator's adapter, installed on the first call."""
        adapter = vars(accelerator).get("_zero_ext_adapter")
        if adapter is None:
            adapter = cls(accelerator)
            adapter._install()
        return adapter

    def _install(self) -> None:
        accelerator = self.accelerator
        accelerator.scaler = None
        accelerator.native_amp = False
        for name in self.PATCHED:
            setattr(accelerator, name, getattr(self, name))
        accelerator.register_save_state_pre_hook(self.save_hook)
        accelerator.register_load_state_pre_hook(self.load_hook)
        accelerator._zero_ext_adapter = self

    # --- clipping: torch's, which accelerate calls, sees only this rank's shards or none
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """zero_ext.clip_grad_norm_: the global norm over every rank's shards
        (installed by zero_ext.integrations.accelerate.prepare)."""
        return zero_ext_clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """zero_ext.clip_grad_value_: clamps the gradient each rank holds
        (clamping is elementwise; in stages 2-3 torch's would meet the
        param.grad stand-ins). Installed by zero_ext.integrations.accelerate.prepare."""
        zero_ext_clip_grad_value_(parameters, clip_value)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The model's state_dict, with zero_ext's fp32 masters under mixed
        precision (accelerate's gives model.state_dict(): the compute-dtype
        copies); save_model and save_state read it through here. Collective
        for a zero_ext model under mixed precision or at stage 3 (installed
        by zero_ext.integrations.accelerate.prepare)."""
        if is_wrapped(model):
            return export_state_dict(model)
        return self._original["get_state_dict"](model, unwrap)

    # --- accelerator.prepare(model, optimizer, ...) after prepare(accelerator, ...)
    # gives back what prepare() made. The model stays out of
    # accelerator._models: save_state/load_state would write it again and
    # load it through safetensors' load_model, which refuses parameters that
    # are views of zero_ext's flat buffers; the zero_ext checkpoint holds it.
    # The optimizer gets its wrapper (a new AcceleratedOptimizer would read
    # the sharded state_dict and fail), the scheduler its wrapper.
    def prepare_model(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        """accelerate's prepare_model; a zero_ext model is returned as is,
        unregistered (installed by zero_ext.integrations.accelerate.prepare)."""
        if is_wrapped(model):
            if all(m is not model for m, _ in self.models):
                raise ValueError(_NOT_GIVEN.format(what="model"))
            return model
        return self._original["prepare_model"](model, *args, **kwargs)

    def prepare_optimizer(self, optimizer: Any, device_placement: Any = None) -> Any:
        """accelerate's prepare_optimizer; a zero_ext optimizer gets the
        wrapper zero_ext.integrations.accelerate.prepare made."""
        if is_wrapped(optimizer):
            for accelerated in self.accelerator._optimizers:
                if getattr(accelerated, "optimizer", None) is optimizer:
                    return accelerated
            raise ValueError(_NOT_GIVEN.format(what="optimizer"))
        return self._original["prepare_optimizer"](optimizer, device_placement)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """accelerate's prepare_scheduler; a scheduler already prepared is
        returned as is (installed by zero_ext.integrations.accelerate.prepare)."""
        for stepped in self.accelerator._schedulers:
            if getattr(stepped, "scheduler", None) is scheduler:
                return stepped
        return self._original["prepare_scheduler"](scheduler)

    # --- save_state/load_state: the models and optimizers as zero_ext checkpoints
    def save_hook(self, models: Any, weights: Any, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)  # every rank may arrive before the main process made it
        for i, (model, optimizer) in enumerate(self.models):
            zero_ext_save(os.path.join(output_dir, checkpoint_dir_name(i)), model, optimizer)

    def load_hook(self, models: Any, input_dir: str) -> None:
        for i, (model, optimizer) in enumerate(self.models):
            path = os.path.join(input_dir, checkpoint_dir_name(i))
            if not os.path.isdir(path):
                raise FileNotFoundError(f"accelerator.load_state: {input_dir} has no zero_ext checkpoint "
                                        f"{checkpoint_dir_name(i)}/ for the zero_ext model #{i}; it was not saved "
                                        "by accelerator.save_state after zero_ext.integrations.accelerate.prepare")
            zero_ext_load(path, model, optimizer)
