"""The rank side of tests/test_lightning.py: a small Lightning module trained
by DDPStrategy and by ZeroExtStrategy, with the same seed, data, AdamW, a
per-step LR scheduler, gradient accumulation and gradient clipping.

    python -m torch.distributed.run --nproc-per-node 2 tests/lightning_scenarios.py train OUT_DIR
    python -m torch.distributed.run --nproc-per-node 1 tests/lightning_scenarios.py resume_one_rank OUT_DIR

`train` (2 ranks) fits DDP (clipping by norm, by value, not at all) and
ZeroExtStrategy at stages 0-3 (and stage 3 clipping by value), saves mid-run
and resumes (stages 2 and 3), fits fp16 against the same loop written by hand
with zero_ext, trains with manual optimization, validates the best
ModelCheckpoint and checks the strategy's errors. `resume_one_rank` resumes
the 2-rank stage 3 checkpoint on one rank at stage 2, over the same global
batches. Rank 0 writes OUT_DIR/<command>.pt, read back by the test with
torch.load(weights_only=True).
"""
import contextlib
import os
import sys
import warnings

import torch
import torch.nn.functional as F

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger

import zero_ext
from zero_ext.integrations.lightning import ZeroExtStrategy

SAMPLES = 96          # per epoch: 12 micro-batches per rank, 6 optimizer steps
GLOBAL_MICRO_BATCH = 8
ACCUMULATE = 2
EPOCHS = 3
CLIP = 0.05           # well below the gradient norm: every step clips
CLIP_VALUE = 0.01     # gradient_clip_algorithm="value": clips many elements
SAVE_AT_STEP = 9      # mid-run and mid-epoch (epochs end at steps 6, 12, 18)
BUCKET_MB = 0.001     # ~1 KiB: several buckets in stages 0-2, a unit per block in stage 3
VAL_BATCHES = 2


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Regressor(L.LightningModule):
    """An MLP of residual blocks, with a parameter of the module's own (stage 3
    gathers it in the module's forward) besides its submodules'."""

    def __init__(self, optimizers: int = 1) -> None:
        super().__init__()
        self.automatic_optimization = optimizers == 1  # Lightning's rule for several optimizers
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(Block(16) for _ in range(3))
        self.head = torch.nn.Linear(16, 1)
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.optimizer_count = optimizers
        self.micro_batch_losses = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).float() * self.scale

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.micro_batch_losses.append(loss.detach().item())
        self.log("train_loss", loss, on_step=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer_count == 2:
            return [torch.optim.AdamW(self.embed.parameters()), torch.optim.AdamW(self.head.parameters())]
        return _optimizer_and_scheduler(self)


class ManualRegressor(Regressor):
    """Manual optimization, with the automatic loop's arithmetic: the
    accumulation, clipping and scheduling the Trainer does in the other runs."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.micro_batch_losses.append(loss.detach().item())
        last = (batch_idx + 1) % ACCUMULATE == 0
        with contextlib.nullcontext() if last else self.trainer.strategy.block_backward_sync():
            self.manual_backward(loss / ACCUMULATE)
        if last:
            self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()


class MuonAdamWRegressor(Regressor):
    """Two optimizers, as Lightning steps them (manual optimization): Muon on
    the blocks' matrices, AdamW on the rest; each steps, then zeroes."""

    def __init__(self) -> None:
        super().__init__(optimizers=2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.micro_batch_losses.append(loss.detach().item())
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        matrices = [block.linear.weight for block in self.blocks]
        ids = {id(p) for p in matrices}
        return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01),
                torch.optim.AdamW([p for p in self.parameters() if id(p) not in ids], lr=0.02)]


def _optimizer_and_scheduler(module):
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RankBatches:
    """This rank's micro-batches of an epoch, in a fixed order: global
    micro-batch i holds samples 8i..8i+7, of which rank r of w takes every
    w-th (DistributedSampler's split), so any world size sees the same
    global batches. Resumable mid-epoch: Lightning saves state_dict() in its
    checkpoints and restores it on resume. (With a length, Lightning fetches
    no batch ahead: every batch yielded has been trained on at a checkpoint.)"""

    def __init__(self, rank: int, world: int, count=None) -> None:
        generator = torch.Generator().manual_seed(1234)
        x = torch.randn(SAMPLES, 8, generator=generator)
        y = (x[:, :1] * 2.0 - x[:, 1:2]).tanh() + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
        order = torch.arange(SAMPLES).view(-1, GLOBAL_MICRO_BATCH)[:, rank::world]
        self.batches = [(x[idx], y[idx]) for idx in order][:count]
        self.resume_at = 0
        self.yielded = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        start, self.resume_at = self.resume_at, 0
        for position in range(start, len(self.batches)):
            self.yielded = position + 1
            yield self.batches[position]

    def state_dict(self):
        return {"next": self.yielded}

    def load_state_dict(self, state) -> None:
        self.resume_at = state["next"]


class LossRecorder(Logger):
    """What Lightning logs (on rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged = []

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        if "train_loss" in metrics:
            self.logged.append(float(metrics["train_loss"]))


class SaveAtStep(Callback):
    """trainer.save_checkpoint(path) once, after the optimizer step that
    reaches global step `step`. Every rank calls it: it is collective."""

    def __init__(self, path: str, step: int) -> None:
        self.path, self.step, self.done = path, step, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.done and trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            self.done = True


def _rank_world():
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _trainer(strategy, out_dir: str, name: str, clip=CLIP, callbacks=(), val=False, logger=False,
             accumulate=ACCUMULATE, clip_algorithm="norm"):
    _, world = _rank_world()
    return L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_epochs=EPOCHS,
        accumulate_grad_batches=accumulate, gradient_clip_val=clip, gradient_clip_algorithm=clip_algorithm,
        logger=logger, log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), callbacks=list(callbacks),
        num_sanity_val_steps=0, limit_val_batches=VAL_BATCHES if val else 0,
        default_root_dir=os.path.join(out_dir, name), use_distributed_sampler=False)


def _fit(strategy, out_dir: str, name: str, clip=CLIP, callbacks=(), ckpt_path=None, val=False, manual=False,
         clip_algorithm="norm"):
    torch.manual_seed(0)  # the same initial weights in every run
    module = ManualRegressor() if manual else Regressor()
    recorder = LossRecorder()
    rank, world = _rank_world()
    trainer = _trainer(strategy, out_dir, name, None if manual else clip, callbacks, val, logger=recorder,
                       accumulate=1 if manual else ACCUMULATE, clip_algorithm=clip_algorithm)
    trainer.fit(module, train_dataloaders=RankBatches(rank, world),
                val_dataloaders=RankBatches(rank, world, VAL_BATCHES) if val else None, ckpt_path=ckpt_path)
    result = {"logged": recorder.logged, "micro_batch_losses": module.micro_batch_losses,
              "global_step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"]}
    if isinstance(trainer.strategy, ZeroExtStrategy):
        result["weights"] = zero_ext.full_state_dict(module)
        # Backward passes whose gradients were reduced: one per optimizer step
        # when the accumulating ones ran under no_sync().
        result["synced_backwards"] = module._zero_ext.handles.diagnostics.stats()["synced_epilogues"]
    else:
        result["weights"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return trainer, module, result


def _hand_written_loop(stage: int, mixed_precision: str):
    """The run Lightning makes, written out with zero_ext alone."""
    torch.manual_seed(0)
    module = Regressor()
    configured = _optimizer_and_scheduler(module)
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    zero_ext.wrap(module, optimizer, stage=stage, bucket_mb=BUCKET_MB, mixed_precision=mixed_precision)
    batches = RankBatches(*_rank_world())
    for _ in range(EPOCHS):
        for index, (x, y) in enumerate(batches):
            last = (index + 1) % ACCUMULATE == 0
            with contextlib.nullcontext() if last else module.no_sync():
                (F.mse_loss(module(x), y) / ACCUMULATE).backward()
            if last:
                optimizer.clip_grad_norm_(CLIP)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return zero_ext.full_state_dict(module)


def _error_of(action) -> str:
    try:
        action()
    except (ValueError, RuntimeError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _strategy_checks(out_dir: str) -> dict:
    rank, world = _rank_world()
    by_name = L.Trainer(accelerator="cpu", devices=world, strategy="zero_ext", logger=False)
    return {
        "registered": f"{type(by_name.strategy).__name__} stage {by_name.strategy.stage}",
        "bf16_mixed": _error_of(lambda: L.Trainer(accelerator="cpu", devices=world, strategy=ZeroExtStrategy(),
                                                  precision="bf16-mixed", logger=False)),
    }


def train(out_dir: str) -> dict:
    rank, world = _rank_world()
    results = {"checks": _strategy_checks(out_dir)}
    _, _, results["ddp"] = _fit("ddp", out_dir, "ddp")
    _, _, results["ddp_unclipped"] = _fit("ddp", out_dir, "ddp_unclipped", clip=None)
    _, _, results["ddp_value_clipped"] = _fit("ddp", out_dir, "ddp_value", clip=CLIP_VALUE, clip_algorithm="value")
    _, _, results["stage3_value_clipped"] = _fit(ZeroExtStrategy(stage=3, bucket_mb=BUCKET_MB), out_dir,
                                                 "stage3_value", clip=CLIP_VALUE, clip_algorithm="value")
    for stage in (0, 1, 2, 3):
        mid_run = os.path.join(out_dir, f"stage{stage}", f"step{SAVE_AT_STEP}.ckpt")
        callbacks = [SaveAtStep(mid_run, SAVE_AT_STEP)] if stage >= 2 else []
        if stage == 3:
            best = ModelCheckpoint(dirpath=os.path.join(out_dir, "best"), monitor="val_loss", save_top_k=1)
            callbacks.append(best)
        trainer, module, results[f"stage{stage}"] = _fit(
            ZeroExtStrategy(stage=stage, bucket_mb=BUCKET_MB), out_dir, f"stage{stage}", callbacks=callbacks,
            val=stage == 3)
        if stage >= 2:
            _, _, results[f"stage{stage}_resumed"] = _fit(
                ZeroExtStrategy(stage=stage, bucket_mb=BUCKET_MB), out_dir, f"stage{stage}_resumed",
                ckpt_path=mid_run)
    # The best ModelCheckpoint, validated by the trained (wrapped) module and by a fresh one.
    val_batches = RankBatches(rank, world, VAL_BATCHES)
    results["best"] = {
        "score": float(best.best_model_score),
        "epochs_saved": sorted(os.listdir(os.path.join(out_dir, "best"))),
        "wrapped": trainer.validate(module, val_batches, ckpt_path="best", verbose=False)[0]["val_loss"],
        "fresh": _trainer(ZeroExtStrategy(stage=3), out_dir, "fresh", val=True).validate(
            Regressor(), val_batches, ckpt_path=best.best_model_path, verbose=False)[0]["val_loss"],
    }
    for name, strategy in (("muon_adamw_ddp", "ddp"), ("muon_adamw_stage0", ZeroExtStrategy(stage=0, bucket_mb=BUCKET_MB)),
                           ("muon_adamw_stage2", ZeroExtStrategy(stage=2, bucket_mb=BUCKET_MB)),
                           ("muon_adamw_stage3", ZeroExtStrategy(stage=3, bucket_mb=BUCKET_MB))):
        torch.manual_seed(0)
        module = MuonAdamWRegressor()
        trainer = _trainer(strategy, out_dir, name, clip=None, accumulate=1)
        trainer.fit(module, train_dataloaders=RankBatches(rank, world))
        weights = (zero_ext.full_state_dict(module) if isinstance(trainer.strategy, ZeroExtStrategy) else
                   {k: v.detach().clone() for k, v in module.state_dict().items()})
        results[name] = {"weights": weights, "micro_batch_losses": module.micro_batch_losses}
    _, _, results["manual_stage3"] = _fit(ZeroExtStrategy(stage=3, bucket_mb=BUCKET_MB), out_dir, "manual",
                                          manual=True)
    _, _, results["fp16"] = _fit(ZeroExtStrategy(stage=2, bucket_mb=BUCKET_MB, mixed_precision="fp16"), out_dir,
                                 "fp16")
    results["fp16_hand_written"] = {"weights": _hand_written_loop(2, "fp16")}
    return results


def resume_one_rank(out_dir: str) -> dict:
    checkpoint = os.path.join(out_dir, "stage3", f"step{SAVE_AT_STEP}.ckpt")
    _, _, result = _fit(ZeroExtStrategy(stage=2), out_dir, "one_rank", ckpt_path=checkpoint)
    return {"resumed": result}


if __name__ == "__main__":
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    command, out = sys.argv[1], sys.argv[2]
    results = {"train": train, "resume_one_rank": resume_one_rank}[command](out)
    if _rank_world()[0] == 0:
        torch.save(results, os.path.join(out, f"{command}.pt"))
