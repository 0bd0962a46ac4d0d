"""A Hugging Face Trainer that trains through zero_ext.

    from zero_ext.integrations.transformers import ZeroExtTrainer
    trainer = ZeroExtTrainer(model=model, args=TrainingArguments(...),
                             train_dataset=ds, zero_ext={"stage": 3})
    trainer.train()                                   # under torchrun
    trainer.train(resume_from_checkpoint=True)        # at any world size

What it changes in Trainer, and why:
  - create_optimizer wraps the model and the optimizer Trainer built (or was
    given) with zero_ext and marks both prepared, so accelerate never wraps
    the model in DDP. Trainer's accumulation already calls model.no_sync().
  - TrainingArguments' bf16/fp16 become zero_ext's mixed precision; the
    Accelerator is made without its own (its autocast and GradScaler would
    act on what zero_ext already casts and scales).
  - Clipping and the logged grad_norm use zero_ext.clip_grad_norm_: torch's,
    which Trainer calls, sees only this rank's shards in stages 1-3.
  - Saving runs on every rank: the weights as safetensors through
    zero_ext.save_weights (from_pretrained reads them; under mixed precision
    the fp32 masters, and config.json says float32, as under DDP), and in checkpoints
    the model and optimizer as a zero_ext checkpoint in `zero_ext/`, which
    resume loads with zero_ext.load at any world size or stage. Trainer
    saves on rank 0 only, which would wait forever in a stage 3 gather.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from ..files import checkpoint_exists, describe_pretrained_config, load_weights, save_weights
from ..files import load as zero_ext_load
from ..files import save as zero_ext_save
from ..optim import clip_grad_norm_ as zero_ext_clip_grad_norm_
from ._common import check_wrap_options, is_wrapped, library_mixed_precision, wrap_once

CHECKPOINT_DIR = "zero_ext"  # inside each checkpoint-N directory


class ZeroExtTrainer(Trainer):
    """transformers.Trainer with zero_ext as its data parallelism.

    Args:
        zero_ext: zero_ext.wrap's options (``stage``, ``offload_optimizer``,
            ``units``, ``bucket_mb``, ...); ``mixed_precision`` defaults to
            what TrainingArguments' ``bf16``/``fp16`` say.
        Everything else: as transformers.Trainer.
    """

    def __init__(self, *args: Any, zero_ext: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        self._zero_ext_options = check_wrap_options(zero_ext or {}, "ZeroExtTrainer")
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("ZeroExtTrainer: TrainingArguments ask for DeepSpeed or FSDP as well; zero_ext is the "
                             "sharding here, so drop `deepspeed=`/`fsdp=` from the arguments")
        requested = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else None
        self._zero_ext_options = library_mixed_precision(requested, self._zero_ext_options, "ZeroExtTrainer")

    # --- wrapping ---------------------------------------------------------
    def _build_accelerator_args(self, **kwargs: Any) -> Dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"  # zero_ext's own, see the module's docstring
        return args

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        # Collective: every rank builds its optimizer here, in the same order.
        self.model, self.optimizer = wrap_once(self.model, optimizer, self._zero_ext_options)
        self.model._is_accelerate_prepared = True
        self.optimizer._is_accelerate_prepared = True
        return self.optimizer

    # --- clipping ---------------------------------------------------------
    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return zero_ext_clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            grad_norm = zero_ext_clip_grad_norm_(model.parameters(), float("inf"))
        return grad_norm

    # --- saving -----------------------------------------------------------
    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        if not is_wrapped(self.model):
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # Every rank: save_weights gathers one unit at a time, rank 0 writes.
        save_weights(self.model, output_dir)
        if not self.args.should_save:
            return
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            # dtype and class as the unwrapped model's save_pretrained writes
            # them (float32 under mixed precision: the weights are the masters).
            describe_pretrained_config(self.model, config)
            config.save_pretrained(output_dir)
        generation = getattr(self.model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not is_wrapped(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        zero_ext_save(os.path.join(output_dir, CHECKPOINT_DIR), self.model, self.optimizer)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # --- resuming ---------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[torch.nn.Module] = None) -> None:
        # Trainer loads the weights here, before the optimizer exists; a
        # zero_ext checkpoint restores them (fp32 masters) with the optimizer.
        if checkpoint_exists(os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)):
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, CHECKPOINT_DIR)
        if not checkpoint_exists(path):
            raise FileNotFoundError(
                f"ZeroExtTrainer: {checkpoint} has no zero_ext checkpoint ({CHECKPOINT_DIR}/), so the optimizer "
                "state cannot be resumed; it was saved by another Trainer or with save_only_model=True. To start "
                "from its weights only, load them into the model and train without resume_from_checkpoint")
        zero_ext_load(path, self.model, self.optimizer)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, map_location="cpu", weights_only=True))

    def _load_best_model(self) -> None:
        if not is_wrapped(self.model):
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        if best and checkpoint_exists(os.path.join(best, CHECKPOINT_DIR)):
            zero_ext_load(os.path.join(best, CHECKPOINT_DIR), self.model, self.optimizer)
            return
        # save_only_model=True: only the weights save_weights wrote (every rank reads its ranges).
        weights = None
        if best:
            for name in (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME):
                if os.path.isfile(os.path.join(best, name)):
                    weights = best if name == SAFE_WEIGHTS_INDEX_NAME else os.path.join(best, name)
                    break
        if weights is None:
            raise FileNotFoundError(f"ZeroExtTrainer: the best checkpoint {best} has neither a zero_ext checkpoint "
                                    "nor safetensors weights to load")
        load_weights(self.model, weights)
