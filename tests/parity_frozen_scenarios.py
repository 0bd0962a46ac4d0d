"""Parity scenarios of parameters without a gradient: unused ones, a branch
used on one rank only, parameters frozen before wrap() or after it
(unfrozen later, offloaded, saved and loaded), and frozen buckets skipping
their reduction."""
from __future__ import annotations

import os
import shutil
import tempfile

import torch.distributed as dist
import torch.nn.functional as F

import zero_ext
from parity_models import Context, Net, _mlp_training, adamw, batch, mlp_loss, sgd, step_and_record


def unused_parameters(ctx: Context) -> None:
    """The branch is unused in step 0, used in step 1, unused in step 2."""
    model = Net(branch=True)
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(3):
        loss = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world)
            loss = loss + w * F.mse_loss(model(x, use_branch=step == 1), y)
        loss.backward()
        step_and_record(ctx, model, opt, step)


def branch_on_rank0_only(ctx: Context) -> None:
    _mlp_training(ctx, Net(branch=True), adamw, steps=3, branch_on_rank0=True)


def frozen_parameters(ctx: Context) -> None:
    model = Net()
    model.mid.requires_grad_(False)
    _mlp_training(ctx, model, adamw, steps=2)  # the optimizer also holds the frozen ones


def frozen_and_unfrozen_after_wrap(ctx: Context) -> None:
    """requires_grad changed between steps after wrap(), GAN-style: `mid`
    frozen for steps 1-2 and trainable again at 3, and out.weight alone (its
    bias trainable, the same stage 3 unit) frozen for step 1. A frozen
    parameter gets no gradient and the optimizer skips it (no weight decay,
    no moment update), as torch's does."""
    model = Net()
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(4):
        model.mid.requires_grad_(step in (0, 3))
        model.out.weight.requires_grad_(step != 1)
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)


def frozen_after_wrap_offloaded(ctx: Context) -> None:
    """The same with the optimizer on the host (zero_ext's C++ Adam)."""
    model = Net()
    model, opt = ctx.wrap(model, adamw(model), offload_optimizer="cpu")
    for step in range(4):
        model.mid.requires_grad_(step in (0, 3))
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)


def frozen_after_wrap_saved_and_loaded(ctx: Context) -> None:
    """`mid` frozen after wrap (its AdamW state holds one step), saved, the
    model wrapped again from other weights and loaded, `mid` unfrozen at
    step 3: as one process trained straight through."""
    model = Net()
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(4):
        model.mid.requires_grad_(step in (0, 3))
        if step == 2 and not ctx.reference:
            root = [tempfile.mkdtemp(prefix="zero_ext_frozen_") if ctx.rank == 0 else None]
            dist.broadcast_object_list(root, src=0)
            path = os.path.join(root[0], "ck")
            zero_ext.save(path, model, opt)
            fresh = Net(seed=3)
            model, opt = ctx.wrap(fresh, adamw(fresh))
            zero_ext.load(path, model, opt)
            model.mid.requires_grad_(False)
            dist.barrier()
            if ctx.rank == 0:
                shutil.rmtree(root[0], ignore_errors=True)
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)


def frozen_buckets_skip_their_reduction(ctx: Context) -> None:
    """`mid` and `out` frozen after wrap: buckets of theirs alone hold no
    gradient anywhere, so a backward reduces nothing for them (fewer
    collectives), except where gradients of an earlier backward still wait:
    a no_sync() backward with them trainable, then frozen before the synced
    one (those local gradients are reduced), and the second of two synced
    backwards before a step (the first one's exchange is not settled yet).
    At stage 0-2 one bucket holds only theirs, at stage 3 their two units.
    Unfrozen, they reduce again; frozen between a forward and its backward,
    they get no gradient (torch's AccumulateGrad drops it) and are skipped.
    The gradients match one process throughout."""
    model = Net()
    model, opt = ctx.wrap(model, sgd(model))

    def skipped() -> int:
        return 0 if ctx.reference else model._zero_ext.handles.diagnostics.stats()["frozen_skips"]

    def freeze(frozen: bool) -> None:
        model.mid.requires_grad_(not frozen)
        model.out.requires_grad_(not frozen)

    skips = []
    for step in range(7):
        freeze(step in (1, 2, 3, 4))
        before = skipped()
        if step == 2:  # accumulated while trainable, reduced after they froze
            freeze(False)
            with ctx.no_sync(model):
                mlp_loss(ctx, model, step, salt=1).backward()
            freeze(True)
        if step == 3:  # the first of two synced backwards skips, the second reduces
            mlp_loss(ctx, model, step, salt=2).backward()
            skips_first = skipped() - before
        loss = mlp_loss(ctx, model, step)
        if step == 6:  # frozen between forward and backward: torch drops their gradients, and so does zero_ext
            freeze(True)
        loss.backward()
        skips.append(skipped() - before)
        step_and_record(ctx, model, opt, step)
    # A skipped bucket issues no collective; the sequence checks make every
    # rank skip alike or raise.
    ok = (skips[1] > 0 and skips[4] == skips[6] == skips[1] and skips[0] == skips[2] == skips[5] == 0
          and skips[3] == skips_first == skips[1])
    ctx.record_check("frozen buckets skipped only where nothing waits", ctx.reference or ok)


def frozen_at_wrap_unfrozen_later(ctx: Context) -> None:
    """Progressive unfreezing: `mid` frozen before wrap(unfreeze_later=True)
    (the optimizer holds it), trained from step 2 on; `inp` frozen before
    wrap and never unfrozen. Until then they get no gradient and the
    optimizer skips them, as torch's does."""
    model = Net()
    model.mid.requires_grad_(False)
    model.inp.requires_grad_(False)
    model, opt = ctx.wrap(model, adamw(model), unfreeze_later=True)
    for step in range(4):
        if step == 2:
            model.mid.requires_grad_(True)
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)
