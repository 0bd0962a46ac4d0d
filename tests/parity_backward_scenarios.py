"""Parity scenarios of the forms a backward takes: a loss outside or inside
the model, non-scalar and list backward, several models under one loss,
retained graphs, autograd.grad, a graph from before the step,
step(closure), and activation checkpoints whose parameters' gradients
arrive late."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parity_models import (
    BATCH, Blocks, Context, LossNet, Net, OUT, SEQ, VOCAB, _mlp_training, adamw, batch, mlp_loss, sgd, step_and_record)


def scalar_loss_outside_model(ctx: Context) -> None:
    _mlp_training(ctx, Net(), sgd, steps=3)


def loss_inside_model_adamw(ctx: Context) -> None:
    model = LossNet()
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(3):
        loss = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world)
            loss = loss + w * model(x, y)
        loss.backward()
        step_and_record(ctx, model, opt, step)


def nonscalar_backward(ctx: Context) -> None:
    model = Net()
    model, opt = ctx.wrap(model, sgd(model))
    for step in range(2):
        outs, grads = [], []
        for r, w in ctx.participants():
            x, _ = batch(step, r, ctx.world)
            g = torch.Generator().manual_seed(7 + step + 100 * r)
            outs.append(model(x))
            grads.append(w * torch.randn(BATCH, OUT, generator=g))
        torch.cat(outs).backward(torch.cat(grads))
        step_and_record(ctx, model, opt, step)


def autograd_backward_list(ctx: Context) -> None:
    model = Net()
    model, opt = ctx.wrap(model, sgd(model))
    for step in range(2):
        l1 = mlp_loss(ctx, model, step)
        l2 = 0.5 * mlp_loss(ctx, model, step, salt=1)
        torch.autograd.backward([l1, l2])
        step_and_record(ctx, model, opt, step)


def three_models_one_loss(ctx: Context) -> None:
    models, opts = [], []
    for seed in range(3):
        m = Net(seed=seed)
        m, o = ctx.wrap(m, sgd(m))
        models.append(m)
        opts.append(o)
    for step in range(2):
        loss = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world)
            h = models[0](x)
            h2 = models[1](torch.cat([h, h], dim=1))
            loss = loss + w * (F.mse_loss(h2, y) + models[2](x).square().mean())
        loss.backward()
        for i, m in enumerate(models):
            ctx.record_grads(f"step {step} model {i}", m)
        for o in opts:
            o.step()
            o.zero_grad()
        for i, m in enumerate(models):
            ctx.record_params(f"step {step} model {i}", m)


def _retain_graph(ctx: Context, zero_between: bool) -> None:
    model = Net()
    model, opt = ctx.wrap(model, sgd(model))
    for step in range(2):
        l1 = mlp_loss(ctx, model, step)
        out_sq = 0.0
        for r, w in ctx.participants():
            x, _ = batch(step, r, ctx.world)
            out_sq = out_sq + w * model(x).square().mean()
        total = l1 + out_sq
        l1.backward(retain_graph=True)
        ctx.record_check(f"step {step}: keep_graph seen from C++",
                         ctx.reference or model._zero_ext.handles.diagnostics.stats()["last_keep_graph"] == 1)
        ctx.record_grads(f"step {step} after first backward", model)
        if zero_between:
            opt.zero_grad()
        gathers = None if ctx.reference else model._zero_ext.handles.diagnostics.stats()["param_gathers"]
        total.backward()  # goes through l1's retained graph a second time
        ctx.record_check(f"step {step}: no parameter all-gather in the second backward",
                         ctx.reference or model._zero_ext.handles.diagnostics.stats()["param_gathers"] == gathers)
        ctx.record_check(f"step {step}: second backward did not keep graph",
                         ctx.reference or model._zero_ext.handles.diagnostics.stats()["last_keep_graph"] == 0)
        ctx.record_grads(f"step {step} after second backward", model)
        opt.step()
        opt.zero_grad()
        ctx.record_params(f"step {step}", model)


def retain_graph_two_losses(ctx: Context) -> None:
    _retain_graph(ctx, zero_between=False)


def retain_graph_zero_grad_between(ctx: Context) -> None:
    _retain_graph(ctx, zero_between=True)


def nonscalar_backward_retained_twice(ctx: Context) -> None:
    """out.backward(g, retain_graph=True) twice over one forward: the second
    backward needs no parameter all-gather in stage 3."""
    model = Blocks()
    model, opt = ctx.wrap(model, sgd(model))
    for step in range(2):
        outs, grads = [], []
        for r, w in ctx.participants():
            g = torch.Generator().manual_seed(40 + step)
            tokens = torch.randint(0, VOCAB, (ctx.world * BATCH, SEQ), generator=g)[r * BATCH:(r + 1) * BATCH]
            outs.append(model(tokens))
            grads.append(w * torch.randn(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(r)) / (BATCH * SEQ))
        out, grad = torch.cat(outs), torch.cat(grads)
        out.backward(grad, retain_graph=True)
        ctx.record_grads(f"step {step} first", model)
        gathers = None if ctx.reference else model._zero_ext.handles.diagnostics.stats()["param_gathers"]
        out.backward(grad, retain_graph=True)
        ctx.record_check(f"step {step}: no parameter all-gather in the second backward",
                         ctx.reference or model._zero_ext.handles.diagnostics.stats()["param_gathers"] == gathers)
        step_and_record(ctx, model, opt, step)


def step_with_closure(ctx: Context) -> None:
    """optimizer.step(closure), as Lightning and LBFGS-style loops call it:
    the closure's backward is reduced before the update uses it."""
    model = Net()
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(3):
        losses = []

        def closure():
            opt.zero_grad()
            losses.append(mlp_loss(ctx, model, step))
            losses[-1].backward()
            return losses[-1]
        returned = opt.step(closure)
        ctx.record_check(f"step {step}: step() returns the closure's loss", returned is losses[-1])
        ctx.record_params(f"step {step}", model)


def graph_from_before_the_step_raises(ctx: Context) -> None:
    """The GAN pattern: a graph built before optimizer.step() saw the old
    parameter values; its backward after the step raises PyTorch's in-place
    error (the step bumped the parameters' versions), as in plain PyTorch.
    A backward of a graph built after the step, and a retained graph's second
    backward, do not."""
    model = Net()
    model, opt = ctx.wrap(model, sgd(model))
    mlp_loss(ctx, model, 0).backward()
    stale = mlp_loss(ctx, model, 1)  # built before the step
    opt.step()
    opt.zero_grad()
    try:
        stale.backward()
        raised = "no error"
    except RuntimeError as error:
        raised = "inplace" if "modified by an inplace operation" in str(error) else str(error)
    opt.zero_grad()  # whatever the failed backward accumulated before it raised
    ctx.record_value(f"stale backward raised the in-place error: {raised}",
                     torch.tensor(float(raised == "inplace")))
    fresh = mlp_loss(ctx, model, 2)
    fresh.backward(retain_graph=True)
    fresh.backward()
    step_and_record(ctx, model, opt, 2)


def autograd_grad_is_side_effect_free(ctx: Context) -> None:
    model = Net()
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(2):
        mlp_loss(ctx, model, step).backward()
        ctx.record_grads(f"step {step} before autograd.grad", model)
        # Only returns gradients: .grad, optimizer gradients and comm state stay.
        reductions = None if ctx.reference else model._zero_ext.handles.diagnostics.stats()["synced_epilogues"]
        g = torch.autograd.grad(mlp_loss(ctx, model, step, salt=5), [model.inp.weight])[0]
        ctx.record_check(f"step {step} autograd.grad returned a gradient", g.abs().sum() > 0)
        ctx.record_check(f"step {step} autograd.grad reduced no gradient",
                         ctx.reference or model._zero_ext.handles.diagnostics.stats()["synced_epilogues"] == reductions)
        ctx.record_grads(f"step {step} after autograd.grad", model)
        opt.step()
        opt.zero_grad()
        ctx.record_params(f"step {step}", model)


def _checkpointed(ctx: Context, reentrant: bool) -> None:
    """`mid` runs inside an activation checkpoint and again outside it, so its
    gradient arrives twice per backward (from an inner graph task when
    reentrant), possibly after its bucket was already reduced."""
    from torch.utils.checkpoint import checkpoint

    model = Net()
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(2):
        loss = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world)
            h = torch.tanh(model.inp(x))
            h = checkpoint(lambda t: torch.tanh(model.mid(t)), h, use_reentrant=reentrant)
            h = torch.tanh(model.mid(h))
            loss = loss + w * F.mse_loss(model.out(h), y)
        loss.backward()
        step_and_record(ctx, model, opt, step)


def late_gradients_accumulate_over_backwards(ctx: Context) -> None:
    """Two backward passes per step through a reentrant checkpoint that
    reaches `mid` again after its bucket went out: the late gradient of the
    first backward joins the second's reduction, the second's late one a
    round at the step. Nothing is read on the host in either backward: the
    ranks' agreement is read once, when the gradients are."""
    from torch.utils.checkpoint import checkpoint

    model = Net()
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(2):
        reads = None if ctx.reference else model._zero_ext.handles.diagnostics.stats()["agreement_reads"]
        for micro in range(2):
            loss = 0.0
            for r, w in ctx.participants():
                x, y = batch(step, r, ctx.world, salt=micro)
                h = torch.tanh(model.inp(x))
                h = checkpoint(lambda t: torch.tanh(model.mid(t)), h, use_reentrant=True)
                h = torch.tanh(model.mid(h))
                loss = loss + w * F.mse_loss(model.out(h), y)
            loss.backward()
        ctx.record_check(f"step {step}: no host read of the agreement in backward",
                         ctx.reference or model._zero_ext.handles.diagnostics.stats()["agreement_reads"] == reads)
        step_and_record(ctx, model, opt, step)
        ctx.record_check(f"step {step}: one host read for the step",
                         ctx.reference or model._zero_ext.handles.diagnostics.stats()["agreement_reads"] == reads + 1)


def checkpoint_reentrant_param_used_twice(ctx: Context) -> None:
    _checkpointed(ctx, reentrant=True)


def checkpoint_nonreentrant_param_used_twice(ctx: Context) -> None:
    _checkpointed(ctx, reentrant=False)


def two_models_rank_dependent_branch(ctx: Context) -> None:
    """Model A's branch runs on rank 0 only, so A's buckets go out at
    different moments on different ranks; model B's collectives must not get
    mixed up with them."""
    a, b = Net(branch=True), Net(seed=1)
    a, opt_a = ctx.wrap(a, sgd(a))
    b, opt_b = ctx.wrap(b, sgd(b))
    for step in range(2):
        loss = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world)
            h = a(x, use_branch=r == 0)
            loss = loss + w * F.mse_loss(b(torch.cat([h, h], dim=1)), y)
        loss.backward()
        for name, m, o in (("a", a, opt_a), ("b", b, opt_b)):
            ctx.record_grads(f"step {step} {name}", m)
            o.step()
            o.zero_grad()
            ctx.record_params(f"step {step} {name}", m)
