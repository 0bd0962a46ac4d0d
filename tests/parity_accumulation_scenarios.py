"""Parity scenarios of gradient accumulation: several backward calls per
step, no_sync() and require_backward_grad_sync, the all-reduce across
replicas deferred (set_requires_all_reduce), and the gradient divide
factor."""
from __future__ import annotations

import contextlib
from typing import List

import torch.nn as nn

from parity_models import Context, Net, adamw, mlp_loss, sgd, stage1_keeps_full_staging, step_and_record


def _accumulate(ctx: Context, counts: List[int], make_optimizer=adamw, **options) -> None:
    model = Net()
    model, opt = ctx.wrap(model, make_optimizer(model), **options)
    for step, count in enumerate(counts):
        for micro in range(count):
            mlp_loss(ctx, model, step, salt=micro).backward()
            ctx.record_grads(f"step {step} backward {micro}", model)
        opt.step()
        opt.zero_grad()
        ctx.record_params(f"step {step}", model)


def four_backward_per_step(ctx: Context) -> None:
    _accumulate(ctx, [4, 4])


def varying_backward_per_step(ctx: Context) -> None:
    _accumulate(ctx, [2, 5, 3])


def no_sync_accumulation(ctx: Context, **options) -> None:
    model = Net()
    model, opt = ctx.wrap(model, sgd(model), **options)
    for step in range(2):
        with ctx.no_sync(model):
            for micro in range(3):
                mlp_loss(ctx, model, step, salt=micro).backward()
        mlp_loss(ctx, model, step, salt=3).backward()
        step_and_record(ctx, model, opt, step)


def ddp_require_backward_grad_sync(ctx: Context) -> None:
    """nanoGPT's DDP idiom: `model.require_backward_grad_sync = (micro ==
    last)` instead of no_sync(); the micro-steps before the last reduce
    nothing (no collective on any group) and accumulate like one process."""
    model = Net()
    model, opt = ctx.wrap(model, sgd(model))
    quiet = []
    for step in range(2):
        for micro in range(4):
            if not ctx.reference:
                model.require_backward_grad_sync = micro == 3
                before = model._zero_ext.handles.diagnostics.stats()["collectives"]
            mlp_loss(ctx, model, step, salt=micro).backward()
            if not ctx.reference and micro < 3:
                quiet.append(model._zero_ext.handles.diagnostics.stats()["collectives"] == before)
        step_and_record(ctx, model, opt, step)
    ctx.record_check("no collective in the micro-steps with require_backward_grad_sync False",
                     ctx.reference or all(quiet))
    ctx.record_check("require_backward_grad_sync reads back", ctx.reference or model.require_backward_grad_sync)


def _replica_traffic_and_bytes(ctx: Context, model: nn.Module, collectives_before: int, backwards: int,
                               deferring: bool = True, **options) -> List[bool]:
    """While backwards keep the all-reduce across replicas back (hybrid,
    stages 1-3): the replicas exchanged only each backward's small agreement,
    and a rank holds one fp32 shard more than synced (the deferred sum).
    `deferring` False: after a synced backward, whose all-reduce carried it
    all, nothing is kept back any more."""
    if ctx.reference:
        return [True, True]
    stats = model._zero_ext.handles.diagnostics.stats()
    defers = deferring and ctx.replicas > 1 and ctx.stage > 0
    sent = stats["replica_collectives"] - collectives_before
    padded = sum(model._zero_ext.handles.reduction.bucket_layout()[2::3])  # (first, count, padded) per bucket
    shard = padded if ctx.stage == 0 else padded // ctx.shard_size
    offload = "offload_optimizer" in options
    staging = 4 * padded if ctx.stage == 0 or stage1_keeps_full_staging(ctx, offload) else 0
    accum = 4 * shard if ctx.stage > 0 or offload else 0
    traffic_ok = sent == backwards if defers else True
    return [traffic_ok, stats["grad_bytes"] == staging + accum * (2 if defers else 1)]


def replica_all_reduce_deferred_in_accumulation(ctx: Context, **options) -> None:
    """set_requires_all_reduce(False) over the first backwards of each step,
    True for the last: its all-reduce across replicas carries them all."""
    model = Net()
    model, opt = ctx.wrap(model, adamw(model), **options)
    for step in range(3):
        ctx.set_requires_all_reduce(model, False)
        before = 0 if ctx.reference else model._zero_ext.handles.diagnostics.stats()["replica_collectives"]
        for micro in range(3):
            mlp_loss(ctx, model, step, salt=micro).backward()
        ctx.record_checks([f"step {step}: deferred backwards send only their agreement across replicas",
                           f"step {step}: deferred, a rank holds one more fp32 gradient shard"],
                          _replica_traffic_and_bytes(ctx, model, before, backwards=3, **options))
        ctx.set_requires_all_reduce(model, True)
        mlp_loss(ctx, model, step, salt=3).backward()
        ctx.record_check(f"step {step}: the synced backward's all-reduce took the deferred sum along",
                         _replica_traffic_and_bytes(ctx, model, 0, backwards=0, deferring=False, **options)[1])
        step_and_record(ctx, model, opt, step)


def replica_all_reduce_deferred_until_read(ctx: Context) -> None:
    """Every backward of the step deferred (after a no_sync one): the sum
    across replicas goes when the gradients are read, by clip (step 0),
    optimizer.step() (step 1) or full_grads (step 2)."""
    model = Net()
    model, opt = ctx.wrap(model, sgd(model))
    ctx.set_requires_all_reduce(model, False)
    for step in range(3):
        with ctx.no_sync(model):
            mlp_loss(ctx, model, step, salt=0).backward()
        for micro in (1, 2):
            mlp_loss(ctx, model, step, salt=micro).backward()
        if step == 0:
            ctx.record_value("step 0: total norm", ctx.clip(model, opt, 0.05))
        if step == 1:
            opt.step()
            opt.zero_grad()
            ctx.record_params("step 1", model)
            continue
        step_and_record(ctx, model, opt, step)


def gradient_divide_factor(ctx: Context) -> None:
    """model.set_gradient_divide_factor (FSDP2's): step 0 sums the ranks'
    gradients (factor 1: a loss normalized by hand), step 1 divides by 3
    with two backward calls accumulated under no_sync() and a synced one,
    step 2 averages again (None). SGD with momentum: the scale shows."""
    model = Net()
    model, opt = ctx.wrap(model, sgd(model))
    for step, factor, backwards in ((0, 1.0, 1), (1, 3.0, 3), (2, None, 1)):
        if not ctx.reference:
            model.set_gradient_divide_factor(factor)
        scale = ctx.world / (factor or ctx.world) if ctx.reference else 1.0
        for k in range(backwards):
            with ctx.no_sync(model) if k < backwards - 1 else contextlib.nullcontext():
                (scale * mlp_loss(ctx, model, step, salt=k)).backward()
        step_and_record(ctx, model, opt, step)
