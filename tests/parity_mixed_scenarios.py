"""Parity scenarios of mixed precision: bf16 and fp16 compute with fp32
masters (reduced in fp32 or in the compute dtype, offloaded, the replicas'
all-reduce deferred), fp16 loss scaling and overflow on one rank, a
torch.amp.GradScaler, and MixedPrecision's output_dtype."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

import zero_ext
from parity_compare import BF16_ROUNDED, LOW_PRECISION_LABEL
from parity_mixed_reference import MasterWeightReference, ReferenceReduction, reduced_in
from parity_models import (
    BATCH, BUCKET_MB, Blocks, Context, IN, Net, SEQ, VOCAB, adamw, batch, conditioned_adamw, mlp_loss, sgd,
    stage1_keeps_full_staging, step_and_record)
from parity_offload_scenarios import nvme_options
from parity_units_scenarios import ParallelLists


FP16_SCALE = 2.0 ** 10  # no overflow in these models: parity runs see no skipped step


def _mixed_training(ctx: Context, model: nn.Module, make_optimizer, loss_of_step, steps: int,
                    backwards: int, mixed_precision, offload: bool = False, defer_replicas: bool = False,
                    units=None) -> None:
    precision = mixed_precision if isinstance(mixed_precision, zero_ext.MixedPrecision) else \
        zero_ext.MixedPrecision({"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision])
    dtype = precision.param_dtype
    label = LOW_PRECISION_LABEL[dtype]
    scale = FP16_SCALE if dtype == torch.float16 else 1.0
    if dtype == torch.float16:
        precision = dataclasses.replace(precision, loss_scale=zero_ext.DynamicLossScale(initial_scale=FP16_SCALE))
    names = [n for n, _ in model.named_parameters()]
    if ctx.reference:
        ref = MasterWeightReference(model, make_optimizer, dtype, loss_scale=scale)
        opt = ref
        reduction = ReferenceReduction(model, dtype, precision.reduce_dtype or torch.float32, scale)
    else:
        model, opt = zero_ext.wrap(model, make_optimizer(model.parameters()), stage=ctx.stage,
                                   mixed_precision=precision, bucket_mb=BUCKET_MB, **ctx.group_kwargs(),
                                   units=units, **(nvme_options(ctx) if offload == "nvme" else
                                                   {"offload_optimizer": "cpu" if offload else None}))
    for step in range(steps):
        for micro in range(backwards):
            if defer_replicas:  # all but the last backward keep the sum across replicas back
                ctx.set_requires_all_reduce(model, micro == backwards - 1)
            loss = loss_of_step(model, step, micro)
            if ctx.reference:
                reduction.watch(loss)
            (loss * scale if ctx.reference else loss).backward()
            if ctx.reference:
                reduction.backward_done()
            if defer_replicas and micro < backwards - 1:
                continue  # reading gradients would send the deferred sum across replicas now
            if ctx.reference:
                ctx.checkpoints.append((f"{label}step {step} backward {micro}: grads", reduction.recorded()))
            else:
                ctx.record_grads(f"{label}step {step} backward {micro}", model)
            if micro == 0 and not defer_replicas and ctx.world > 1:
                reduce_dtype = precision.reduce_dtype or torch.float32
                ctx.record_check(f"step {step} backward 0: the ranks' gradients summed in {reduce_dtype}",
                                 ctx.reference or reduced_in(ctx.checkpoints[-1][1], reduce_dtype, dtype))
        if ctx.reference:
            ref.step(reduction.step_grads())
        else:
            opt.step()
        opt.zero_grad()
        if ctx.reference:
            reduction.clear()
            ctx.checkpoints.append((f"{label}step {step}: masters", dict(zip(names, [m.clone() for m in ref.masters]))))
        else:
            full = zero_ext.full_state_dict(model)
            ctx.checkpoints.append((f"{label}step {step}: masters", {n: full[n] for n in names}))
        # Exact properties: masters keep fp32 precision, and the parameters
        # the model computes with are exactly the masters rounded to the dtype.
        if ctx.reference:
            ok_precision = ok_copy = ok_scale = True
        else:
            compute = {n: p for n, p in model.state_dict().items()}
            ok_precision = any(not torch.equal(full[n], full[n].to(dtype).float()) for n in names)
            ok_copy = all(compute[n].dtype == dtype and torch.equal(compute[n].cpu(), full[n].to(dtype))
                          for n in names)
            ok_scale = model._zero_ext.handles.optimizer.loss_scale() == scale  # no step was skipped
        ctx.record_check(f"step {step}: masters hold fp32 values", ok_precision)
        ctx.record_check(f"step {step}: parameters are the masters rounded to the compute dtype", ok_copy)
        ctx.record_check(f"step {step}: loss scale unchanged", ok_scale)
        ctx.record_check(f"step {step}: bytes held after zero_grad()",
                         ctx.reference or _mixed_bytes_after_zero_grad(ctx, model, precision, offload))


def _mixed_bytes_after_zero_grad(ctx: Context, model: nn.Module, precision, offload) -> bool:
    """Between steps a rank holds what FSDP2 holds at most: no gradient
    shard memory (stages 0-1 keep their full buckets, as DDP does; offload
    keeps its pinned host accumulator), and in stage 3 no parameter
    memory in the compute dtype beside the fp32 master (a gather casts the
    master; offload keeps the compute-dtype shard on the device). Frozen
    buckets (mixed precision bucket frozen weights apart) stage nothing."""
    state = model._zero_ext
    core = state.handles
    stats = core.diagnostics.stats()
    layout = core.reduction.bucket_layout()  # (first, count, padded) per bucket
    padded = sum(layout[2::3])
    trainable = sum(size for first, size in zip(layout[0::3], layout[2::3]) if state.bucketed[first].requires_grad)
    shard = padded if ctx.stage == 0 else padded // ctx.shard_size
    reduce_dtype = precision.reduce_dtype or torch.float32
    staging = trainable * reduce_dtype.itemsize if ctx.stage == 0 or stage1_keeps_full_staging(
        ctx, bool(offload), reduce_dtype) else 0
    # "nvme": the accumulators are in the offload file between steps, and
    # stage 3 keeps no compute shard (a gather casts the master it reads in).
    in_host = offload is True
    accum = 4 * (trainable if ctx.stage == 0 else trainable // ctx.shard_size) if in_host else 0
    compute = precision.param_dtype.itemsize
    params = (shard * compute if in_host else 0) if ctx.stage == 3 else padded * compute
    return stats["grad_bytes"] == staging + accum and stats["param_bytes"] == params


def _mlp_mixed_loss(ctx: Context, dtype: torch.dtype):
    def loss(model, step, micro):
        total = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world, salt=micro)
            total = total + w * F.mse_loss(model(x.to(dtype)).float(), y)
        return total
    return loss


def _token_mixed_loss(ctx: Context):
    def loss(model, step, micro):
        total = 0.0
        for r, w in ctx.participants():
            g = torch.Generator().manual_seed(500 + step)
            tokens = torch.randint(0, VOCAB, (ctx.world * BATCH, SEQ + 1), generator=g)[r * BATCH:(r + 1) * BATCH]
            logits = model(tokens[:, :-1]).float()
            total = total + w * F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        return total
    return loss


def _mixed_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _mixed_scenario(name: str, doc: str, build, make_optimizer, dtype: torch.dtype, backwards: int,
                    mixed_precision, offload: bool = False, defer_replicas: bool = False,
                    units_of=None) -> Callable[[Context], None]:
    def scenario(ctx: Context) -> None:
        loss = _token_mixed_loss(ctx) if build is Blocks else _mlp_mixed_loss(ctx, dtype)
        model = build()
        _mixed_training(ctx, model, make_optimizer, loss, steps=3, backwards=backwards,
                        mixed_precision=mixed_precision, offload=offload, defer_replicas=defer_replicas,
                        units=units_of(model) if units_of is not None else None)
    scenario.__name__, scenario.__doc__ = name, doc
    return scenario


BF16_BF16 = zero_ext.MixedPrecision(torch.bfloat16, torch.bfloat16)
FP16_FP16 = zero_ext.MixedPrecision(torch.float16, torch.float16)
MIXED_PRECISION_SCENARIOS = [
    _mixed_scenario(*row) for row in [
        # name, what it shows, model, optimizer, compute dtype, backward calls per step, precision, offload
        ("mixed_precision_bf16_mlp", "bf16 compute, fp32 masters and reduction", Net, conditioned_adamw,
         torch.bfloat16, 2, "bf16"),
        ("mixed_precision_bf16_tied_blocks", "bf16 with tied weights", Blocks, _mixed_sgd, torch.bfloat16, 1, "bf16"),
        ("mixed_precision_bf16_reduced_in_bf16", "bf16 reduction", Net, conditioned_adamw, torch.bfloat16, 2,
         BF16_BF16),
        ("mixed_precision_fp16_mlp", "fp16, dynamic loss scaling under plain backward", Net, conditioned_adamw,
         torch.float16, 2, "fp16"),
        ("mixed_precision_fp16_tied_blocks", "fp16 with tied weights", Blocks, _mixed_sgd, torch.float16, 1, "fp16"),
        ("mixed_precision_fp16_reduced_in_fp16", "reduced scaled, in fp16's range; unscaled after", Net, _mixed_sgd,
         torch.float16, 2, FP16_FP16),
        ("offload_bf16_mlp", "offloaded AdamW: the C++ kernel writes the bf16 copy in its pass", Net, conditioned_adamw,
         torch.bfloat16, 2, "bf16", True),
        ("offload_fp16_tied_blocks", "offloaded fp16 with loss scaling", Blocks, conditioned_adamw, torch.float16, 2,
         "fp16", True),
        ("nvme_fp16_tied_blocks", "fp16 loss scaling with masters, gradients and state in offload files", Blocks,
         conditioned_adamw, torch.float16, 2, "fp16", "nvme"),
        ("fp16_reduced_in_fp16_replicas_deferred", "scaled fp16 results kept back unscaled, in fp32", Net, _mixed_sgd,
         torch.float16, 3, FP16_FP16, False, True),
        ("offload_bf16_replicas_deferred", "kept back on the device, landed on the host once", Net, conditioned_adamw,
         torch.bfloat16, 2, "bf16", True, True),
        ("parallel_lists_lora_bf16", "LoRA on parallel ModuleLists in bf16: merged units run interleaved",
         ParallelLists, conditioned_adamw, torch.bfloat16, 1, "bf16"),
        ("parallel_lists_lora_bf16_listed_units", "the same with units=[norms, *bases, downs, ups]",
         ParallelLists, conditioned_adamw, torch.bfloat16, 1, "bf16", False, False, ParallelLists.listed_units),
    ]
]
for _scenario in MIXED_PRECISION_SCENARIOS:
    if _scenario.__name__.endswith("_listed_units"):
        _scenario.stages = (3,)  # units= is a stage 3 option
    if _scenario.__name__.startswith("nvme_"):
        _scenario.stages, _scenario.flat_only = (1, 2, 3), True


class LogitsAndLoss(Net):
    """Returns its output and a loss computed from it: two outputs, one on
    the other's gradient path."""

    def forward(self, x, y):  # type: ignore[override]
        out = super().forward(x)
        return out, F.mse_loss(out.float(), y)


class Square(nn.Module):
    """Input and output of one size, so the model can be applied to its own output."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.a, self.b = nn.Linear(IN, IN), nn.Linear(IN, IN)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def fp16_output_on_another_outputs_path(ctx: Context) -> None:
    """The loss uses both returned tensors; the scale applies once.

    The model gets the fp32 target too and computes a loss of its fp32 output
    against it inside forward. The batch is cast by the caller, as in the
    reference, and cast_forward_inputs=False leaves the target fp32: with it
    cast to fp16, mse_loss mixes fp32 and fp16, whose backward torch 2.11
    refuses ("Found dtype Half but expected Float"; 2.13 promotes)."""
    def loss(model, step, micro):
        total = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world, salt=micro)
            out, inner = model(x.to(torch.float16), y)
            total = total + w * (F.mse_loss(out.float(), y) + inner)
        return total
    _mixed_training(ctx, LogitsAndLoss(), _mixed_sgd, loss, steps=2, backwards=2,
                    mixed_precision=zero_ext.MixedPrecision(torch.float16, cast_forward_inputs=False))


def fp16_model_applied_to_its_own_output(ctx: Context) -> None:
    def loss(model, step, micro):
        total = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world, salt=micro)
            h = model(x.to(torch.float16))
            total = total + w * (model(h).float().square().mean() + h.float().mean())
        return total
    _mixed_training(ctx, Square(), _mixed_sgd, loss, steps=2, backwards=2, mixed_precision="fp16")


def _inf_on_rank0(ctx: Context, param: torch.Tensor, armed: Dict[str, bool]) -> None:
    """While armed, rank 0's gradient of `param` gets an inf in element 0:
    only the rank whose shard holds that element can see it locally."""
    def hook(grad: torch.Tensor):
        if armed["on"] and (ctx.reference or ctx.rank == 0):
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad
        return None
    param.register_hook(hook)


def fp16_overflow_skips_the_step_on_every_rank(ctx: Context) -> None:
    """An overflow on one rank: every rank skips the step, the scale halves,
    and it doubles again after growth_interval clean steps."""
    model = Net()
    policy = zero_ext.DynamicLossScale(initial_scale=2.0 ** 10, growth_interval=2)
    labels = ["step 1 skipped: parameters unchanged", "step 1: scale halved", "step 1: found on this rank",
              "step 1: this rank's own shard marked non-finite", "steps 2-3 stepped: parameters changed",
              "step 3: scale grown back after 2 clean steps", "one skipped step counted"]
    if ctx.reference:
        ctx.record_checks(labels)
        return
    model, opt = zero_ext.wrap(model, conditioned_adamw(model.parameters()), stage=ctx.stage, bucket_mb=BUCKET_MB,
                               mixed_precision=zero_ext.MixedPrecision(torch.float16, loss_scale=policy),
                               **ctx.group_kwargs())
    core = model._zero_ext.handles
    armed = {"on": False}
    _inf_on_rank0(ctx, model.out.bias, armed)
    loss = _mlp_mixed_loss(ctx, torch.float16)
    results = {}
    for step in range(4):
        armed["on"] = step == 1
        loss(model, step, 0).backward()
        before = zero_ext.full_state_dict(model)
        if step == 1:
            results["found"] = core.optimizer.found_nonfinite()
            results["local"] = any(not torch.isfinite(p.grad).all()
                                   for g in opt.param_groups for p in g["params"] if p.grad is not None)
        opt.step()
        opt.zero_grad()
        after = zero_ext.full_state_dict(model)
        same = all(torch.equal(before[k], after[k]) for k in before)
        results[step] = (same, core.optimizer.loss_scale())
    checks = [results[1][0], results[1][1] == 2.0 ** 9, results["found"], results["local"],
              not results[2][0] and not results[3][0], results[2][1] == 2.0 ** 9 and results[3][1] == 2.0 ** 10,
              core.diagnostics.stats()["skipped_steps"] == 1]
    ctx.record_checks(labels, checks)


def grad_scaler_sees_overflow_on_every_rank(ctx: Context) -> None:
    """torch.amp.GradScaler over sharded gradients: an inf in one element on
    rank 0 makes every rank skip the step and lower the scale, like one
    process does; the other steps match it exactly."""
    model = Net()
    model, opt = ctx.wrap(model, adamw(model))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    armed = {"on": False}
    _inf_on_rank0(ctx, model.out.bias, armed)
    for step in range(4):
        armed["on"] = step == 1
        scaler.scale(mlp_loss(ctx, model, step)).backward()
        if step == 2:  # unscale explicitly first, as a loop that clips does
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ctx.record_params(f"step {step}", model)
        ctx.record_value(f"step {step}: scale", torch.tensor(scaler.get_scale()))


def fp16_hands_scaling_to_a_grad_scaler(ctx: Context) -> None:
    """fp16 driven by torch.amp.GradScaler: zero_ext's own scaling steps
    aside (with a warning) instead of scaling twice; training proceeds."""
    labels = ["zero_ext's scaling is off", "a warning said so", "parameters finite and trained"]
    if ctx.reference:
        ctx.record_checks(labels)
        return
    import warnings
    model = Net()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, opt = zero_ext.wrap(model, conditioned_adamw(model.parameters()), stage=ctx.stage, bucket_mb=BUCKET_MB,
                               mixed_precision="fp16", **ctx.group_kwargs())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    loss = _mlp_mixed_loss(ctx, torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            scaler.scale(loss(model, step, 0)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    full = zero_ext.full_state_dict(model)
    checks = [model._zero_ext.handles.optimizer.loss_scale() == 1.0,
              any("GradScaler drives this optimizer" in str(w.message) for w in caught),
              all(torch.isfinite(full[n]).all() and not torch.equal(full[n], initial[n]) for n in initial)]
    ctx.record_checks(labels, checks)


def output_dtype_cast(ctx: Context) -> None:
    """MixedPrecision(float32, output_dtype=bfloat16): the model's output
    comes back in bf16 (the reference casts by hand), compared at one bf16
    ulp, and its gradient flows back through the cast to fp32.

    The loss is linear in the output with bf16-exact coefficients, so the
    gradient reaching the model (w * c, w = 1/world a power of two) is exact
    whichever way each output rounds. A loss reading the output's value
    (mse) is not: an fp32 output within reduction noise of a bf16 rounding
    midpoint rounds to neighbours on two CPUs, and its gradient differs by
    2 w / numel * ulp (8e-5 on one CPU, against ATOL 1e-6)."""
    model = Net()
    model, opt = ctx.wrap(model, sgd(model),
                          mixed_precision=zero_ext.MixedPrecision(torch.float32, output_dtype=torch.bfloat16))
    for step in range(3):
        total = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world)
            out = model(x)
            if ctx.reference:
                out = out.to(torch.bfloat16)
            elif out.dtype != torch.bfloat16:
                raise AssertionError(f"the output is {out.dtype}")
            if r == ctx.rank:
                ctx.checkpoints.append((f"{BF16_ROUNDED}step {step}: output", {"output": out.detach().clone()}))
            coefficients = y.to(torch.bfloat16).float() / 8  # bf16-exact
            total = total + w * (out.float() * coefficients).sum()
        total.backward()
        step_and_record(ctx, model, opt, step)
