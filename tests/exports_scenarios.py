"""Rank side of tests/test_exports.py, run under torchrun on 2 CPU ranks.

    torchrun --nproc-per-node 2 exports_scenarios.py OUT_DIR

- bf16 exports: the same short accelerate run over DDP (autocast, fp32
  parameters) and through zero_ext at stages 0, 2 and 3; every export path
  (unwrap_model(model).save_pretrained with and without
  state_dict=get_state_dict, accelerator.save_model, get_state_dict and
  accelerator.save of it, zero_ext.save_weights) must write zero_ext's fp32 masters, bit for bit,
  with DDP's names, dtypes and config.json; from_pretrained reads float32.
  The same for ZeroExtTrainer's save_model against Trainer over DDP, and a
  peft LoRA model's save_pretrained.
- clip_grad_value_: accelerator.clip_grad_value_ in an accelerate loop at
  stages 0-3 against the same loop over DDP (fp32), with a clip value that
  changes the result.
- accelerator.prepare with objects zero_ext holds: refused with the fix named
  for a pair zero_ext.wrap returned; after zero_ext's prepare, the same
  objects back.
Rank 0 writes OUT_DIR/exports.json: the problems found and the figures."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from hf_integration_scenarios import MICRO, compare_weights, dataset, fresh_model

STEPS = 2
CLIP_VALUE = 0.02


def reset_accelerate() -> None:
    """accelerate's state is a singleton that refuses another mixed precision."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def optimizer_of(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-3)


def loader_of():
    from torch.utils.data import DataLoader

    return DataLoader(dataset(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))


def run_accelerate(accelerator, model, optimizer, loader, steps: int, clip_value=None) -> None:
    batches, done = iter(loader), 0
    while done < steps:
        with accelerator.accumulate(model):
            accelerator.backward(model(**next(batches)).loss)
            if accelerator.sync_gradients and clip_value is not None:
                accelerator.clip_grad_value_(model.parameters(), clip_value)
            optimizer.step()
            optimizer.zero_grad()
        done += int(accelerator.sync_gradients)


def read_dir(path: str):
    """(tensors, config) of a save_pretrained / save_model directory."""
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    config_file = os.path.join(path, "config.json")
    config = None
    if os.path.isfile(config_file):
        with open(config_file) as f:
            config = json.load(f)
            config.pop("transformers_version", None)
    return tensors, config


def config_diff(got: dict, want: dict) -> dict:
    """key: (zero_ext's, DDP's) for each key that differs."""
    return {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}


def check_export(name: str, got: dict, masters: dict, want_keys, problems: list) -> None:
    """`got` holds exactly `want_keys` (DDP's), fp32 as DDP's, each equal to the master bit for bit."""
    if want_keys is not None and sorted(got) != sorted(want_keys):
        problems.append(f"{name}: names {sorted(set(got) ^ set(want_keys))} differ from DDP's export")
    for key, value in got.items():
        if value.dtype != torch.float32:
            problems.append(f"{name}: {key} is {value.dtype}, DDP writes float32")
            return
        if not torch.equal(value, masters[key].to(value.dtype)):
            diff = (value.float() - masters[key].float()).abs().max().item()
            problems.append(f"{name}: {key} differs from zero_ext's fp32 master by {diff:.3e}")
            return


def bf16_exports(out: str, problems: list, figures: dict) -> None:
    from accelerate import Accelerator
    from transformers import GPT2LMHeadModel

    import zero_ext
    from zero_ext.integrations.accelerate import prepare

    rank0 = dist.get_rank() == 0
    reset_accelerate()
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=MICRO, cpu=True)
    model = fresh_model()
    model, optimizer, loader = accelerator.prepare(model, optimizer_of(model), loader_of())
    run_accelerate(accelerator, model, optimizer, loader, STEPS)
    ddp_pretrained, ddp_save_model = os.path.join(out, "ddp-pretrained"), os.path.join(out, "ddp-save-model")
    accelerator.unwrap_model(model).save_pretrained(ddp_pretrained, is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save)
    accelerator.save_model(model, ddp_save_model)
    accelerator.wait_for_everyone()
    ddp = {"pretrained": read_dir(ddp_pretrained), "save_model": read_dir(ddp_save_model)}
    if ddp["pretrained"][1].get("dtype") != "float32":
        problems.append(f"DDP's config says {ddp['pretrained'][1].get('dtype')}: the reference is not fp32")

    for stage in (0, 2, 3):
        reset_accelerate()
        accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=MICRO, cpu=True)
        model = fresh_model()
        model, optimizer = prepare(accelerator, model, optimizer_of(model), stage=stage, bucket_mb=0.01)
        loader = accelerator.prepare(loader_of())
        run_accelerate(accelerator, model, optimizer, loader, STEPS)
        masters = zero_ext.full_state_dict(model)
        if all(torch.equal(v.bfloat16().float(), v) for v in masters.values()):
            problems.append(f"stage {stage}: the masters are all bf16 values; the test cannot tell them apart")
        base = os.path.join(out, f"zero-ext-stage{stage}")
        unwrapped = accelerator.unwrap_model(model)
        # Every rank calls each export (they gather); rank 0 writes.
        unwrapped.save_pretrained(f"{base}-pretrained", is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save)
        unwrapped.save_pretrained(f"{base}-pretrained-sd", is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
        accelerator.save_model(model, f"{base}-save-model")
        state_dict = accelerator.get_state_dict(model)
        # accelerate's save drops tied names (from the dict it is given) as under DDP.
        os.makedirs(f"{base}-accelerator-save", exist_ok=True)
        accelerator.save(accelerator.get_state_dict(model), f"{base}-accelerator-save/model.safetensors",
                         safe_serialization=True)
        zero_ext.save_weights(model, f"{base}-save-weights")
        accelerator.wait_for_everyone()
        name = f"accelerate bf16 stage {stage}"
        check_export(f"{name} get_state_dict", {k: v.cpu() for k, v in state_dict.items()}, masters,
                     list(masters), problems)
        for kind, reference in (("pretrained", "pretrained"), ("pretrained-sd", "pretrained"),
                                ("save-model", "save_model"), ("accelerator-save", "save_model"),
                                ("save-weights", "pretrained")):
            tensors, config = read_dir(f"{base}-{kind}")
            check_export(f"{name} {kind}", tensors, masters, list(ddp[reference][0]), problems)
            if kind.startswith("pretrained") and config != ddp["pretrained"][1]:
                problems.append(f"{name} {kind}: config.json differs from DDP's: "
                                f"{config_diff(config, ddp['pretrained'][1])}")
        if rank0:
            loaded = GPT2LMHeadModel.from_pretrained(f"{base}-pretrained")
            if loaded.dtype != torch.float32:
                problems.append(f"{name}: from_pretrained reads {loaded.dtype}")
            compare_weights(f"{name} from_pretrained", loaded.state_dict(), masters, problems, figures, rtol=0, atol=0)
        figures[f"{name}: max |master - bf16 copy|"] = max(
            (v.float() - v.bfloat16().float()).abs().max().item() for v in masters.values())
        del model, optimizer


def trainer_bf16_exports(out: str, problems: list, figures: dict) -> None:
    from transformers import Trainer, TrainingArguments

    import zero_ext
    from zero_ext.integrations.transformers import ZeroExtTrainer

    def args(path: str):
        return TrainingArguments(output_dir=path, per_device_train_batch_size=2, max_steps=STEPS,
                                 learning_rate=3e-3, bf16=True, use_cpu=True, seed=0, report_to=[],
                                 disable_tqdm=True, save_strategy="no")

    reset_accelerate()
    trainer = Trainer(model=fresh_model(), args=args(os.path.join(out, "trainer-ddp")), train_dataset=dataset())
    trainer.train()
    trainer.save_model()
    reset_accelerate()
    zero = ZeroExtTrainer(model=fresh_model(), args=args(os.path.join(out, "trainer-zero-ext")),
                          train_dataset=dataset(), zero_ext={"stage": 3, "bucket_mb": 0.01})
    zero.train()
    zero.save_model()
    masters = zero_ext.full_state_dict(zero.model)
    dist.barrier()
    want, want_config = read_dir(os.path.join(out, "trainer-ddp"))
    got, config = read_dir(os.path.join(out, "trainer-zero-ext"))
    check_export("ZeroExtTrainer bf16 save_model", got, masters, list(want), problems)
    if config != want_config:
        problems.append(f"ZeroExtTrainer bf16 save_model: config.json differs from Trainer's over DDP: "
                        f"{config_diff(config, want_config)}")


def peft_bf16_export(out: str, problems: list, figures: dict) -> None:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    import zero_ext

    model = get_peft_model(fresh_model(), LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model, optimizer = zero_ext.wrap(model, optimizer, stage=2, mixed_precision="bf16", bucket_mb=0.01)
    batch = torch.stack([row["input_ids"] for row in dataset()[dist.get_rank() * 2:][:2]])
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    masters = zero_ext.full_state_dict(model)
    path = os.path.join(out, "peft-stage2")
    model.save_pretrained(path, is_main_process=dist.get_rank() == 0)
    dist.barrier()
    adapters = load_file(os.path.join(path, "adapter_model.safetensors"))
    # peft writes the adapters under base_model.model.<name> without the adapter's name.
    wanted = {k.replace(".default", ""): v for k, v in masters.items() if "lora_" in k}
    if not adapters:
        problems.append("peft: no adapter weights written")
    check_export("peft LoRA bf16 save_pretrained", adapters, wanted, list(wanted), problems)


# --- clip_grad_value_ ------------------------------------------------------------
def clip_value_run(stage, clip_value):
    from accelerate import Accelerator

    from hf_integration_scenarios import full_weights
    from zero_ext.integrations.accelerate import prepare

    accelerator = Accelerator(gradient_accumulation_steps=MICRO, cpu=True)
    model = fresh_model()
    if stage is None:
        model, optimizer, loader = accelerator.prepare(model, optimizer_of(model), loader_of())
    else:
        model, optimizer = prepare(accelerator, model, optimizer_of(model), stage=stage, bucket_mb=0.01)
        loader = accelerator.prepare(loader_of())
    run_accelerate(accelerator, model, optimizer, loader, STEPS, clip_value)
    return full_weights(model)


def clip_value(out: str, problems: list, figures: dict) -> None:
    reset_accelerate()
    ddp = clip_value_run(None, CLIP_VALUE)
    unclipped = clip_value_run(None, None)
    figures["clip_grad_value_: DDP clipped vs unclipped max |dw|"] = max(
        (ddp[k] - unclipped[k]).abs().max().item() for k in ddp)
    if figures["clip_grad_value_: DDP clipped vs unclipped max |dw|"] < 1e-4:
        problems.append("clip_grad_value_: the clip value never bit")
    for stage in range(4):
        try:
            weights = clip_value_run(stage, CLIP_VALUE)
        except Exception as e:  # noqa: BLE001 - reported, the rest still runs
            problems.append(f"clip_grad_value_ stage {stage}: {type(e).__name__}: {str(e)[:300]}")
            continue
        compare_weights(f"clip_grad_value_ stage {stage}", weights, ddp, problems, figures)


# --- accelerator.prepare with zero_ext's objects ----------------------------------
def accelerator_prepare(out: str, problems: list, figures: dict) -> None:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    import zero_ext
    from zero_ext.integrations.accelerate import prepare

    reset_accelerate()
    # A pair zero_ext.wrap returned: accelerate's optimizer wrapper reads the
    # sharded state at once; the error names what to call instead.
    model = fresh_model()
    model, optimizer = zero_ext.wrap(model, optimizer_of(model), stage=2, bucket_mb=0.01)
    try:
        Accelerator(cpu=True).prepare(model, optimizer)
        problems.append("accelerator.prepare took a stage 2 zero_ext optimizer without error")
    except RuntimeError as e:
        if "zero_ext.integrations.accelerate.prepare" not in str(e):
            problems.append(f"accelerator.prepare of a zero_ext optimizer: the error names no fix: {e}")
    # zero_ext's prepare, then the usual accelerator.prepare of everything,
    # with the objects as the user built them: the same objects come back;
    # save_state -> load_state through that accelerator resumes exactly.
    path = os.path.join(out, "double-prepare-state")
    want = None
    for resume in (False, True):
        reset_accelerate()
        accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=MICRO, cpu=True)
        model = fresh_model()
        optimizer = optimizer_of(model)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)
        given = prepare(accelerator, model, optimizer, scheduler, stage=2, bucket_mb=0.01)
        loader = DataLoader(dataset(), batch_size=2)  # in order: the resumed run skips what was seen
        try:
            again = accelerator.prepare(model, optimizer, loader, scheduler)
        except Exception as e:  # noqa: BLE001
            problems.append(f"accelerator.prepare after zero_ext's prepare: {type(e).__name__}: {str(e)[:300]}")
            return
        for what, a, b in zip(("model", "optimizer", "scheduler"), given, (again[0], again[1], again[3])):
            if a is not b:
                problems.append(f"accelerator.prepare after zero_ext's prepare: another {what} came back "
                                f"({type(b).__name__})")
        if any(a is not b for a, b in zip(given, accelerator.prepare(*given))):
            problems.append("accelerator.prepare of what zero_ext's prepare returned: other objects came back")
        model, optimizer, loader, scheduler = again
        if resume:
            accelerator.load_state(path)
        else:
            run_accelerate(accelerator, model, optimizer, loader, 1)
            accelerator.save_state(path)
        run_accelerate(accelerator, model, optimizer, accelerator.skip_first_batches(loader, MICRO), 1)
        got = zero_ext.full_state_dict(model)
        if want is None:
            want = got
    compare_weights("accelerator.prepare after zero_ext's prepare: save_state at step 1, load_state",
                    got, want, problems, figures, rtol=0, atol=0)
    # A zero_ext model that did not go through zero_ext's prepare is refused by name.
    other = fresh_model()
    other, _ = zero_ext.wrap(other, optimizer_of(other), stage=2, mixed_precision="bf16", bucket_mb=0.01)
    try:
        accelerator.prepare(other)
        problems.append("accelerator.prepare took a zero_ext model zero_ext's prepare never saw")
    except ValueError as e:
        if "zero_ext.integrations.accelerate.prepare" not in str(e):
            problems.append(f"accelerator.prepare of another zero_ext model: the error names no fix: {e}")


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    problems, figures = [], {}
    for check in (bf16_exports, trainer_bf16_exports, peft_bf16_export, clip_value, accelerator_prepare):
        before = len(problems)
        try:
            check(out, problems, figures)
        except Exception as e:  # noqa: BLE001 - one check failing must not hide the others
            import traceback

            problems.append(f"{check.__name__}: {type(e).__name__}: {str(e)[:500]}")
            traceback.print_exc()
        figures[f"{check.__name__}: problems"] = len(problems) - before
        dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(out, "exports.json"), "w") as f:
            json.dump({"problems": problems, "figures": figures}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
