"""Rank side of tests/test_hf_integrations.py, run under torchrun on CPU ranks.

    torchrun --nproc-per-node 2 hf_integration_scenarios.py compare OUT_DIR
    torchrun --nproc-per-node 1 hf_integration_scenarios.py resume-at-world-1 OUT_DIR
    torchrun --nproc-per-node 2 hf_integration_scenarios.py accelerate-without-cpu OUT_DIR

`compare` trains a tiny GPT-2 with Hugging Face Trainer over DDP and with
ZeroExtTrainer at stages 0-3 (accumulation 2, clipping that bites, AdamW with
weight decay groups, a linear schedule), resumes stage 3 from a mid-run
checkpoint, loads the saved weights with from_pretrained; then the same with
an accelerate loop (accumulate, clip_grad_norm_, save_state/load_state).
`resume-at-world-1` resumes the 2-rank stage 3 checkpoint on one rank with
the same global batch. `accelerate-without-cpu` makes an Accelerator without
cpu=True on CPU ranks (accelerate builds the 2-rank group yet reports one
process) and expects zero_ext's prepare to refuse it on every rank. Rank 0 writes OUT_DIR/<mode>.json: the problems found
(empty when every comparison held) and the figures compared."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

STEPS, MICRO, SEQ, SAMPLES = 6, 2, 16, 48
RTOL, ATOL = 1e-5, 1e-6


def config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


def fresh_model():
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(config())


def dataset():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (SAMPLES, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def full_weights(model) -> dict:
    import zero_ext

    if getattr(model, "_zero_ext", None) is not None:
        return zero_ext.full_state_dict(model)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def compare_weights(name: str, got: dict, want: dict, problems: list, figures: dict,
                    rtol: float = RTOL, atol: float = ATOL) -> None:
    worst = 0.0
    for key, value in want.items():
        diff = (got[key].float() - value.float()).abs().max().item()
        worst = max(worst, diff)
        if not torch.allclose(got[key].float(), value.float(), rtol=rtol, atol=atol):
            problems.append(f"{name}: {key} differs by {diff:.3e}")
            return
    figures[f"{name}: max |dw|"] = worst


def compare_series(name: str, got: list, want: list, problems: list, figures: dict, rtol: float = 1e-5) -> None:
    if len(got) != len(want):
        problems.append(f"{name}: {len(got)} values against {len(want)}: {got} vs {want}")
        return
    worst = max((abs(a - b) for a, b in zip(got, want)), default=0.0)
    figures[f"{name}: max |d|"] = worst
    if any(abs(a - b) > rtol * max(abs(b), 1e-6) for a, b in zip(got, want)):
        problems.append(f"{name}: {got} vs {want}")


# --- Trainer -------------------------------------------------------------------
def trainer_args(out: str, batch: int = 2, save_steps: int = 0):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=MICRO, max_steps=STEPS,
        learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5,
        logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, dataloader_drop_last=True)


def train_with_trainer(out: str, stage=None, batch: int = 2, save_steps: int = 0, resume=None):
    from transformers import Trainer

    from zero_ext.integrations.transformers import ZeroExtTrainer

    model = fresh_model()
    args = trainer_args(out, batch, save_steps)
    if stage is None:
        trainer = Trainer(model=model, args=args, train_dataset=dataset())
    else:
        trainer = ZeroExtTrainer(model=model, args=args, train_dataset=dataset(),
                                 zero_ext={"stage": stage, "bucket_mb": 0.01})
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    norms = [float(h["grad_norm"]) for h in history if "grad_norm" in h]
    return trainer, losses, norms, full_weights(trainer.model)


def compare_trainers(out: str, problems: list, figures: dict) -> None:
    from transformers import GPT2LMHeadModel

    import zero_ext

    _, ddp_losses, ddp_norms, ddp_weights = train_with_trainer(os.path.join(out, "ddp"))
    figures["trainer ddp losses"] = ddp_losses
    if not all(n > 0.5 for n in ddp_norms[1:]):
        problems.append(f"clipping never bit: grad norms {ddp_norms}")
    for stage in range(4):
        run_dir = os.path.join(out, f"trainer-stage{stage}")
        trainer, losses, norms, weights = train_with_trainer(run_dir, stage, save_steps=3 if stage == 3 else 0)
        name = f"trainer stage {stage}"
        compare_series(f"{name} losses", losses, ddp_losses, problems, figures)
        compare_series(f"{name} grad norms", norms, ddp_norms, problems, figures)
        compare_weights(name, weights, ddp_weights, problems, figures)
        if trainer.accelerator.unwrap_model(trainer.model) is not trainer.model:
            problems.append(f"{name}: accelerate wrapped the model")
    # Save -> resume equals the uninterrupted run (bit for bit: same ranks, same order).
    uninterrupted = weights
    _, losses, _, resumed = train_with_trainer(os.path.join(out, "trainer-resumed"), 3,
                                               resume=os.path.join(out, "trainer-stage3", "checkpoint-3"))
    compare_weights("trainer stage 3 resumed at step 3", resumed, uninterrupted, problems, figures, rtol=0, atol=0)
    # Trainer's log history carries the checkpoint's first 3 steps.
    compare_series("trainer stage 3 resumed losses", losses[3:], ddp_losses[3:], problems, figures)
    # The checkpoint's weights are what from_pretrained reads.
    checkpoint = os.path.join(out, "trainer-stage3", "checkpoint-6")
    if dist.get_rank() == 0:
        loaded = {k: v for k, v in GPT2LMHeadModel.from_pretrained(checkpoint).state_dict().items()}
        compare_weights("from_pretrained of checkpoint-6", loaded, uninterrupted, problems, figures, rtol=0, atol=0)
    del zero_ext


# --- accelerate ------------------------------------------------------------------
def train_with_accelerate(stage=None, steps: int = 4, save_at=None, load_from=None):
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    from zero_ext.integrations.accelerate import prepare

    accelerator = Accelerator(gradient_accumulation_steps=MICRO, cpu=True)
    model = fresh_model()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 1, steps * 4)
    loader = DataLoader(dataset(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    if stage is None:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        model, optimizer, scheduler = prepare(accelerator, model, optimizer, scheduler, stage=stage, bucket_mb=0.01)
        loader = accelerator.prepare(loader)
    losses, norms, done = [], [], 0
    batches = iter(loader)
    if load_from is not None:
        accelerator.load_state(load_from)
        batches = iter(accelerator.skip_first_batches(loader, MICRO * save_at))
        done = save_at
    while done < steps:
        batch = next(batches)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            losses.append(loss.item())
            done += 1
            if done == save_at and load_from is None:
                accelerator.save_state(save_dir_of(accelerator))
    return accelerator, losses, norms, full_weights(model)


SAVE_DIR = {}


def save_dir_of(accelerator) -> str:
    return SAVE_DIR["path"]


def compare_accelerate(out: str, problems: list, figures: dict) -> None:
    from accelerate import Accelerator

    import zero_ext

    # accelerator.prepare on a model zero_ext already wrapped leaves it alone (no DDP).
    model = fresh_model()
    model, _ = zero_ext.wrap(model, torch.optim.AdamW(model.parameters()), stage=2)
    if Accelerator(cpu=True).prepare(model) is not model:
        problems.append("accelerator.prepare wrapped a zero_ext model again")
    _, ddp_losses, ddp_norms, ddp_weights = train_with_accelerate()
    if not all(n > 0.5 for n in ddp_norms[1:]):
        problems.append(f"accelerate: clipping never bit: grad norms {ddp_norms}")
    for stage in range(4):
        name = f"accelerate stage {stage}"
        SAVE_DIR["path"] = os.path.join(out, f"accelerate-stage{stage}")
        accelerator, losses, norms, weights = train_with_accelerate(stage, save_at=2 if stage == 2 else None)
        compare_series(f"{name} losses", losses, ddp_losses, problems, figures)
        compare_series(f"{name} clip norms", norms, ddp_norms, problems, figures)
        compare_weights(name, weights, ddp_weights, problems, figures)
        if accelerator.scaler is not None or accelerator.native_amp:
            problems.append(f"{name}: accelerate kept its own mixed precision")
        if stage == 2:
            uninterrupted = weights
    # save_state at stage 2, load_state into a stage 3 model: the rest of the run is the same.
    state_dir = os.path.join(out, "accelerate-stage2")
    if not os.path.isdir(os.path.join(state_dir, "zero_ext")):
        problems.append(f"accelerate: save_state wrote no zero_ext checkpoint: {os.listdir(state_dir)}")
    _, losses, _, resumed = train_with_accelerate(3, save_at=2, load_from=state_dir)
    compare_weights("accelerate saved at stage 2, resumed at stage 3", resumed, uninterrupted, problems, figures)
    compare_series("accelerate resumed losses", losses, ddp_losses[2:], problems, figures)


def check_best_model_from_weights_only(out: str, problems: list, figures: dict) -> None:
    """load_best_model_at_end with save_only_model=True: the checkpoints hold
    only save_weights' safetensors, which the trained model loads back."""
    from transformers import GPT2LMHeadModel, TrainingArguments

    from zero_ext.integrations.transformers import ZeroExtTrainer

    run_dir = os.path.join(out, "trainer-best")
    args = TrainingArguments(
        output_dir=run_dir, per_device_train_batch_size=4, max_steps=4, learning_rate=3e-3, use_cpu=True, seed=0,
        report_to=[], disable_tqdm=True, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        save_only_model=True, load_best_model_at_end=True, metric_for_best_model="loss",
        greater_is_better=True)  # the higher eval loss, checkpoint-2's: loading it really changes the model
    trainer = ZeroExtTrainer(model=fresh_model(), args=args, train_dataset=dataset(), eval_dataset=dataset()[:8],
                             zero_ext={"stage": 3, "bucket_mb": 0.01})
    trainer.train()
    best = trainer.state.best_model_checkpoint
    if best is None or not best.endswith("checkpoint-2") or os.path.isdir(os.path.join(best, "zero_ext")):
        problems.append(f"best model: expected a weights-only best checkpoint, got {best}")
        return
    loaded = GPT2LMHeadModel.from_pretrained(best).state_dict()
    compare_weights(f"model after load_best_model_at_end ({os.path.basename(best)})", full_weights(trainer.model),
                    loaded, problems, figures, rtol=0, atol=0)


def accelerate_without_cpu(out: str) -> None:
    """The launch the docs used to show: torchrun on CPU ranks, Accelerator()
    without cpu=True and no process group of the script's own. accelerate
    then builds the 2-rank group but reports num_processes 1, so every rank
    would train on every batch and act as the main process. zero_ext's
    prepare must refuse it on every rank, naming Accelerator(cpu=True), before
    wrapping anything."""
    from accelerate import Accelerator

    from zero_ext.integrations.accelerate import prepare

    problems: list = []
    accelerator = Accelerator(gradient_accumulation_steps=MICRO)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != 2 or accelerator.num_processes != 1:  # the premise, as accelerate 1.x behaves
        problems.append(f"not the issue's setup: {world} ranks, accelerate reports {accelerator.num_processes}")
    model = fresh_model()
    try:
        prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=3e-3), stage=2, bucket_mb=0.01)
        message = "prepare took it without error"
    except ValueError as error:
        message = str(error)
    if getattr(model, "_zero_ext", None) is not None:
        message += " (and wrapped the model)"
    messages = [None] * world
    dist.all_gather_object(messages, message)
    for rank, text in enumerate(messages):
        if not ("Accelerator(cpu=True)" in text and "num_processes 1" in text and "2 ranks" in text
                and "wrapped" not in text):
            problems.append(f"rank {rank}: {text}")
    if dist.get_rank() == 0:
        with open(os.path.join(out, "accelerate-without-cpu.json"), "w") as f:
            json.dump({"problems": problems, "figures": {"messages": messages}}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "accelerate-without-cpu":  # accelerate makes the process group itself
        accelerate_without_cpu(out)
        return
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    problems, figures = [], {}
    if mode == "compare":
        compare_trainers(out, problems, figures)
        compare_accelerate(out, problems, figures)
    elif mode == "resume-at-world-1":
        # One rank with twice the per-device batch: the same global batch as 2x2.
        _, _, _, resumed = train_with_trainer(os.path.join(out, "trainer-resumed-world1"), 3, batch=4,
                                                   resume=os.path.join(out, "trainer-stage3", "checkpoint-3"))
        reference = torch.load(os.path.join(out, "stage3-final.pt"), weights_only=True)
        compare_weights("trainer saved at world 2, resumed at world 1", resumed, reference, problems, figures,
                        rtol=1e-4, atol=1e-5)
        check_best_model_from_weights_only(out, problems, figures)
    else:
        raise SystemExit(f"unknown mode {mode}")
    if mode == "compare" and dist.get_rank() == 0:
        torch.save(train_reference_weights(out), os.path.join(out, "stage3-final.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump({"problems": problems, "figures": figures}, f, indent=1)
    dist.destroy_process_group()


def train_reference_weights(out: str) -> dict:
    from transformers import GPT2LMHeadModel

    # The uninterrupted 2-rank stage 3 run's last checkpoint, for the world-1 resume.
    model = GPT2LMHeadModel.from_pretrained(os.path.join(out, "trainer-stage3", "checkpoint-6"))
    return {k: v.clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    main()
