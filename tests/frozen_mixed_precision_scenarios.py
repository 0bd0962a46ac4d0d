"""Frozen (requires_grad=False) floating-point parameters under mixed
precision, stages 0-3: they compute in the compute dtype like the trainable
ones (FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16), keep their fp32 values,
and are never reduced, stepped or gathered after a step.

Each scenario runs wrapped by zero_ext on N ranks and as a single-process
reference over the global batch with the arithmetic zero_ext uses
(parity_scenarios.MasterWeightReference: every weight, frozen ones included,
cast to the compute dtype for the forward; fp32 masters stepped), and the two
lists of checkpoints are compared as in tests/test_parity.py.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_ext
import parity_scenarios as ps
from parity_scenarios import BF16, FP16, FP16_SCALE, HIDDEN, IN, OUT, Context, MasterWeightReference, batch, device_mesh

BUCKET_MB = 0.0005  # ~500 bytes: several buckets, frozen and trainable, even for these tiny models
STAGES = (0, 1, 2, 3)
VOCAB, SEQ = 16, 6
# The bf16 run's loss against the fp32 SGD run's, step by step: a few percent.
CURVE, CURVE_RTOL = "[curve] ", 3e-2
TOLERANCES = {CURVE: (CURVE_RTOL, 0.0)}  # beside parity_scenarios.compare's
HAS_PEFT = importlib.util.find_spec("peft") is not None and importlib.util.find_spec("transformers") is not None


# --- models -------------------------------------------------------------------

class LoRALinear(nn.Module):
    """A frozen base nn.Linear plus a trainable low-rank update (x A^T) B^T."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.3)  # nonzero: A gets gradients from step 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoRANet(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = LoRALinear(IN, HIDDEN)
        self.out = LoRALinear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


class FrozenNormAndEmbedding(nn.Module):
    """A frozen nn.Embedding and a frozen nn.LayerNorm between trainable Linears."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        with torch.no_grad():  # not 1 and 0: the norm's affine values matter
            self.norm.weight.copy_(1.0 + 0.3 * torch.randn(HIDDEN))
            self.norm.bias.copy_(0.3 * torch.randn(HIDDEN))
        self.embed.requires_grad_(False)
        self.norm.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.mix(self.embed(tokens)))))


def peft_gpt2(seed: int = 0) -> nn.Module:
    """peft's LoRA on attention of a tiny GPT-2 (tied frozen embeddings, frozen LayerNorms)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    return get_peft_model(GPT2LMHeadModel(config), lora)


# --- losses over the global batch (the reference plays every rank) --------------

def mlp_loss(ctx: Context, model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    total = 0.0
    for r, w in ctx.participants():
        x, y = batch(step, r, ctx.world)
        # zero_ext gets the fp32 batch and casts it (cast_forward_inputs); the
        # reference, which has no such cast, gets it cast already.
        x = x.to(dtype) if ctx.reference else x
        total = total + w * F.mse_loss(model(x).float(), y)
    return total


def tokens_of(step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randint(0, VOCAB, (world * 2, SEQ), generator=g)[rank * 2:(rank + 1) * 2]


def token_loss(ctx: Context, model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    total = 0.0
    for r, w in ctx.participants():
        tokens = tokens_of(step, r, ctx.world)
        logits = model(tokens[:, :-1]).float()
        total = total + w * F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return total


def lm_loss(ctx: Context, model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    total = 0.0
    for r, w in ctx.participants():
        tokens = tokens_of(step, r, ctx.world)
        total = total + w * model(input_ids=tokens, labels=tokens).loss.float()
    return total


# --- what only the zero_ext run can check ----------------------------------------

def watch_frozen_dtypes(model: nn.Module) -> Dict[str, set]:
    """The dtypes each module's own frozen floating parameters have when its
    forward runs (a forward pre-hook, registered after zero_ext's)."""
    seen: Dict[str, set] = {}
    for name, module in model.named_modules():
        frozen = [p for p in module.parameters(recurse=False) if not p.requires_grad and p.is_floating_point()]
        if frozen:
            def record(mod, args, name=name, frozen=frozen):
                seen.setdefault(name, set()).update(p.dtype for p in frozen)
            module.register_forward_pre_hook(record)
    return seen


def frozen_buckets_idle(ctx: Context, model: nn.Module, opt, gathers_in_step: int, offload: bool) -> List[bool]:
    """After zero_grad(): frozen buckets hold no gradient memory (stages 0-1
    keep the trainable buckets' staging whole, offload its host
    accumulators), the step all-gathered trainable buckets only (stages
    1-2), and memory_report counts each parameter once."""
    state = model._zero_ext
    stats = state.handles.diagnostics.stats()
    layout = state.handles.reduction.bucket_layout()  # (first, count, padded) per bucket
    buckets = [(layout[k], layout[k + 1], layout[k + 2]) for k in range(0, len(layout), 3)]
    trainable = [padded for first, count, padded in buckets
                 if any(p.requires_grad for p in state.bucketed[first:first + count])]
    staging = sum(trainable) * 4 if ctx.stage < 2 else 0  # reduced in fp32
    accum = sum(trainable) * 4 // (1 if ctx.stage == 0 else ctx.shard_size) if offload else 0
    expected_gathers = len(trainable) if ctx.stage in (1, 2) else 0
    report = zero_ext.memory_report(model, opt)
    compute_bytes = sum(padded for _, _, padded in buckets) * state.compute_dtype.itemsize
    params_once = report["params"] == stats["param_bytes"] and (ctx.stage == 3 or stats["param_bytes"] == compute_bytes)
    bucketed = {id(p) for p in state.bucketed}
    every_frozen_bucketed = all(id(p) in bucketed for p in model.parameters())
    return [stats["grad_bytes"] == staging + accum, gathers_in_step == expected_gathers, params_once,
            every_frozen_bucketed]


IDLE_CHECKS = ["frozen buckets hold no gradient staging", "the step all-gathered trainable buckets only",
               "memory_report counts each parameter once", "every frozen parameter is bucketed"]


# --- the training loop --------------------------------------------------------------

def _precision(dtype: torch.dtype) -> zero_ext.MixedPrecision:
    if dtype == torch.float16:  # a fixed start, so no step is skipped and the reference can scale alike
        return zero_ext.MixedPrecision(dtype, loss_scale=zero_ext.DynamicLossScale(initial_scale=FP16_SCALE))
    return zero_ext.MixedPrecision(dtype)


def _frozen_training(ctx: Context, build, loss_of, dtype: torch.dtype, steps: int, make_optimizer=ps.conditioned_adamw,
                     optimize_frozen_too: bool = False, offload: bool = False) -> None:
    """`steps` steps of the model `build` gives at `dtype`; records
    gradients, fp32 masters and the exact properties of frozen weights."""
    label = {torch.bfloat16: BF16, torch.float16: FP16}[dtype]
    scale = FP16_SCALE if dtype == torch.float16 else 1.0
    model = build()
    names = [n for n, _ in model.named_parameters()]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen, "a scenario of this file has frozen parameters"
    if ctx.reference:
        opt = MasterWeightReference(model, make_optimizer, dtype, loss_scale=scale)
    else:
        # The usual LoRA optimizer holds the trainable parameters only; one
        # scenario passes them all, frozen ones included, as torch allows.
        params = model.parameters() if optimize_frozen_too else [p for p in model.parameters() if p.requires_grad]
        model, opt = zero_ext.wrap(model, make_optimizer(params), stage=ctx.stage, mixed_precision=_precision(dtype),
                                   bucket_mb=BUCKET_MB, offload_optimizer="cpu" if offload else None,
                                   **ctx.group_kwargs())
        seen = watch_frozen_dtypes(model)
    for step in range(steps):
        loss = loss_of(ctx, model, step, dtype)
        (loss * scale if ctx.reference else loss).backward()
        if ctx.reference:
            grads = {n: None if p.grad is None else p.grad.float() / scale for n, p in model.named_parameters()}
            ctx.checkpoints.append((f"{label}step {step}: grads", grads))
        else:
            ctx.record_grads(f"{label}step {step}", model)
        gathers = 0 if ctx.reference else model._zero_ext.handles.diagnostics.stats()["all_gathers"]
        opt.step()
        opt.zero_grad()
        labels = [f"step {step}: {c}" for c in [f"frozen weights computed in {dtype}",
                                                 "frozen masters are the loaded fp32 values, bit for bit",
                                                 f"parameters are the masters rounded to {dtype}"] + IDLE_CHECKS]
        if ctx.reference:
            masters = dict(zip(names, [m.clone() for m in opt.masters]))
            ctx.checkpoints.append((f"{label}step {step}: masters", masters))
            ctx.record_checks(labels)
            continue
        gathers = model._zero_ext.handles.diagnostics.stats()["all_gathers"] - gathers
        full = zero_ext.full_state_dict(model)
        ctx.checkpoints.append((f"{label}step {step}: masters", {n: full[n] for n in names}))
        compute = model.state_dict()  # stage 3 gathers it
        ctx.record_checks(
            labels,
            [bool(seen) and all(dtypes == {dtype} for dtypes in seen.values()),
             all(full[n].dtype == torch.float32 and torch.equal(full[n], v) for n, v in frozen.items()),
             all(compute[n].dtype == dtype and torch.equal(compute[n].cpu(), full[n].to(dtype)) for n in names)]
            + frozen_buckets_idle(ctx, model, opt, gathers, offload))


# --- scenarios ------------------------------------------------------------------------

def lora_bf16(ctx: Context) -> None:
    """Hand-written LoRA in bf16: the frozen base Linear meets bf16 inputs."""
    _frozen_training(ctx, LoRANet, mlp_loss, torch.bfloat16, steps=3)


def lora_bf16_offload(ctx: Context) -> None:
    """The same with the optimizer offloaded (fp32 masters, frozen ones too, in host memory; C++ AdamW)."""
    _frozen_training(ctx, LoRANet, mlp_loss, torch.bfloat16, steps=3, offload=True)


def lora_fp16(ctx: Context) -> None:
    """The same in fp16, with loss scaling; the optimizer also holds the frozen weights."""
    _frozen_training(ctx, LoRANet, mlp_loss, torch.float16, steps=3, optimize_frozen_too=True)


def frozen_layernorm_and_embedding_bf16(ctx: Context) -> None:
    """A frozen Embedding and a frozen LayerNorm compute in bf16 while the Linears train."""
    _frozen_training(ctx, FrozenNormAndEmbedding, token_loss, torch.bfloat16, steps=3)


def peft_lora_gpt2_bf16(ctx: Context) -> None:
    """peft's LoRA on a tiny transformers GPT-2 in bf16 (tied frozen embeddings)."""
    _frozen_training(ctx, peft_gpt2, lm_loss, torch.bfloat16, steps=2)


def bf16_sgd_follows_fp32_sgd(ctx: Context) -> None:
    """The bf16 LoRA run trained with SGD equals, within bf16 tolerance, the
    same model trained in fp32 with SGD: the reference here is plain fp32."""
    steps = 6
    model = LoRANet()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2)
    if not ctx.reference:
        model, opt = zero_ext.wrap(model, opt, stage=ctx.stage, mixed_precision="bf16", bucket_mb=BUCKET_MB,
                                   **ctx.group_kwargs())
    for step in range(steps):
        loss = mlp_loss(ctx, model, step, torch.float32 if ctx.reference else torch.bfloat16)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if not ctx.reference and ctx.world > 1:
            dist.all_reduce(value)  # the global batch's mean loss, as the reference computes it
            value /= ctx.world
        ctx.checkpoints.append((f"{CURVE}step {step}: loss", {"value": value.reshape(())}))
    params = dict(model.named_parameters()) if ctx.reference else zero_ext.full_state_dict(model)
    ctx.checkpoints.append((f"{BF16}after {steps} steps: trainable parameters",
                            {n: params[n].detach().clone() for n in trainable}))


def frozen_weights_save_and_load_bf16(ctx: Context) -> None:
    """save/load, load at another stage without mixed precision (frozen
    weights outside the buckets there), load_full_state_dict, and
    save_weights/load_weights: the frozen weights come back as the fp32
    values loaded, bit for bit, and training resumes bit-identically."""
    labels = ["load resumes bit-identically", "frozen weights saved as their fp32 values",
              "loaded at stage 2 in fp32: the same values", "load_full_state_dict round trip",
              "save_weights / load_weights round trip"]
    if ctx.reference:
        ctx.record_checks(labels)
        return
    root = [tempfile.mkdtemp(prefix="zero_ext_frozen_") if ctx.rank == 0 else None]
    dist.broadcast_object_list(root)
    path, weights = os.path.join(root[0], "ckpt"), os.path.join(root[0], "weights.safetensors")

    def make(seed: int, precision: Optional[str] = "bf16", stage: int = ctx.stage):
        model = LoRANet(seed)
        opt = ps.conditioned_adamw([p for p in model.parameters() if p.requires_grad])
        return zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision, bucket_mb=BUCKET_MB)

    def train(model, opt, steps) -> None:
        for step in steps:
            mlp_loss(ctx, model, step, torch.bfloat16).backward()
            opt.step()
            opt.zero_grad()

    model, opt = make(0)
    frozen = {n: p.detach().clone() for n, p in LoRANet(0).named_parameters() if not p.requires_grad}
    train(model, opt, range(2))
    zero_ext.save(path, model, opt)
    zero_ext.save_weights(model, weights)
    saved = zero_ext.full_state_dict(model)
    train(model, opt, range(2, 4))
    want = zero_ext.full_state_dict(model)

    other, other_opt = make(5)  # other values everywhere, frozen ones too: all must come from the file
    zero_ext.load(path, other, other_opt)
    train(other, other_opt, range(2, 4))
    resumed = zero_ext.full_state_dict(other)

    plain, plain_opt = make(6, precision=None, stage=2)
    zero_ext.load(path, plain, plain_opt)
    plain_full = zero_ext.full_state_dict(plain)

    copied, _ = make(7)
    zero_ext.load_full_state_dict(copied, want)
    copied_full = zero_ext.full_state_dict(copied)

    from_weights, _ = make(8)
    zero_ext.load_weights(from_weights, weights)
    weights_full = zero_ext.full_state_dict(from_weights)
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(root[0], ignore_errors=True)

    def same(a, b) -> bool:
        return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    ctx.record_checks(labels, [
        same(resumed, want),
        all(torch.equal(saved[n], v) for n, v in frozen.items()),
        all(torch.equal(plain_full[n], saved[n]) for n in saved),
        same(copied_full, want),
        same(weights_full, saved),
    ])


def _frozen_sequential() -> nn.Sequential:
    """Standard modules only, so empty_init's materialization runs their reset_parameters()."""
    model = nn.Sequential(nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN),
                          nn.Linear(HIDDEN, VOCAB))
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    return model


def frozen_weights_deferred_init_bf16(ctx: Context) -> None:
    """Built under zero_ext.empty_init(), frozen Embedding and LayerNorm
    included, the model materializes with the values normal construction
    gives (fp32 masters, bit for bit) and computes them in bf16."""
    labels = ["materialized as constructed, frozen weights too", "frozen weights computed in bf16"]
    if ctx.reference:
        ctx.record_checks(labels)
        return
    torch.manual_seed(0)
    want = {k: v.clone() for k, v in _frozen_sequential().state_dict().items()}
    torch.manual_seed(0)
    with zero_ext.empty_init():
        model = _frozen_sequential()
    opt = ps.conditioned_adamw([p for p in model.parameters() if p.requires_grad])
    torch.manual_seed(0)  # the initializers draw what construction drew
    model, opt = zero_ext.wrap(model, opt, stage=ctx.stage, mixed_precision="bf16", bucket_mb=BUCKET_MB)
    full = zero_ext.full_state_dict(model)
    seen = watch_frozen_dtypes(model)
    token_loss(ctx, model, 0, torch.bfloat16).backward()
    opt.step()
    ctx.record_checks(labels, [set(full) == set(want) and all(torch.equal(full[k], v) for k, v in want.items()),
                               bool(seen) and all(d == {torch.bfloat16} for d in seen.values())])


SCENARIOS: Dict[str, Callable[[Context], None]] = {
    f.__name__: f for f in [lora_bf16, lora_bf16_offload, lora_fp16, frozen_layernorm_and_embedding_bf16, bf16_sgd_follows_fp32_sgd,
                            frozen_weights_save_and_load_bf16, frozen_weights_deferred_init_bf16]
    + ([peft_lora_gpt2_bf16] if HAS_PEFT else [])
}


_REFERENCES: Dict[tuple, list] = {}


def run_one(rank: int, world: int, item: str) -> Optional[str]:
    """On each rank, one "scenario/stageN" (or "scenario/stageN/mesh2x2":
    hybrid sharding): None, or the first mismatch against the single-process
    reference (computed once per scenario)."""
    name, rest = item.rsplit("/stage", 1)
    stage, _, mesh = rest.partition("/mesh")
    if (name, world) not in _REFERENCES:
        ref_ctx = Context(stage=0, rank=rank, world=world, reference=True)
        SCENARIOS[name](ref_ctx)
        _REFERENCES[(name, world)] = ref_ctx.checkpoints
    ctx = Context(stage=int(stage), rank=rank, world=world, reference=False,
                  mesh=device_mesh(*(int(v) for v in mesh.split("x"))) if mesh else None)
    SCENARIOS[name](ctx)
    return ps.compare(_REFERENCES[(name, world)], ctx.checkpoints, TOLERANCES)


# Hybrid sharding at world size 4: frozen buckets sharded within a row.
HYBRID = ["lora_bf16"]


def all_items(world: int) -> List[str]:
    items = [f"{name}/stage{stage}" for name in SCENARIOS for stage in STAGES]
    return items + ([f"{name}/stage{stage}/mesh2x2" for name in HYBRID for stage in STAGES] if world == 4 else [])
