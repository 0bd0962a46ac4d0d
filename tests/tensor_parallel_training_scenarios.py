"""Tensor parallel training against one process: momentum SGD (and
memory_report per dimension), AdamW with no_sync accumulation and global
norm clipping, retained graphs with an inf-norm clip, activation
checkpointing, bf16 with the optimizer offloaded, and an fp16 overflow on
one tp rank that every rank skips."""
from __future__ import annotations

import torch
import torch.distributed as dist

import zero_ext
from tensor_parallel_context import BF16_GRADS_LABEL, BF16_LABEL, FP16_LABEL, TPContext, _train, adamw, sgd_momentum
from tensor_parallel_models import TPNet, parallelize


def sgd_momentum_plain(ctx: TPContext) -> None:
    model = ctx.model()
    model, opt = ctx.wrap(model, sgd_momentum(model))
    _train(ctx, model, opt, steps=3)
    ok = True
    if not ctx.reference:  # memory_report per dimension: the full model, then this rank's tp part
        report = zero_ext.memory_report(model, opt, by_dimension=True)
        ok = set(zero_ext.memory_report(model, opt)) == {"params", "grads", "optimizer_state"}
        whole = {n: p.numel() * 4 for n, p in TPNet().named_parameters()}
        split = {n for n in whole if n.endswith(("up.weight", "up.bias", "down.weight"))}
        tp = ctx.tp_mesh.size()
        ok = ok and (report["params_full"] == sum(whole.values())
              and report["params_tp_local"] == sum(b // tp if n in split else b for n, b in whole.items()))
    ctx.checkpoints.append(("memory_report per dimension", {"ok": torch.tensor(ok)}))


def adamw_no_sync_accumulation_clip(ctx: TPContext) -> None:
    """Three backwards a step, two under no_sync; clipped by the global norm
    (across dp and tp) to below it, so clipping scales."""
    model = ctx.model()
    model, opt = ctx.wrap(model, adamw(model))
    _train(ctx, model, opt, steps=3, backwards=3, clip=(0.5,))


def inf_norm_clip_retain_graph(ctx: TPContext) -> None:
    """Two backwards over one forward (retain_graph), then
    torch.autograd.backward over a list of roots; an inf-norm clip."""
    model = ctx.model()
    model, opt = ctx.wrap(model, sgd_momentum(model))
    _train(ctx, model, opt, steps=2, clip=(0.05, float("inf")), retain=True)


def activation_checkpointed_blocks(ctx: TPContext) -> None:
    """Each block under torch.utils.checkpoint (non-reentrant): the forward
    runs again in backward, its DTensors built over the leaves again."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(TPNet):
        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = checkpoint(block, h, use_reentrant=False)
            return self.out(h)
    model = Checkpointed()
    if not ctx.reference:
        parallelize(model, ctx.tp_mesh)
    model, opt = ctx.wrap(model, adamw(model))
    _train(ctx, model, opt, steps=2)


def bf16_offloaded_sgd(ctx: TPContext) -> None:
    """bf16 compute over fp32 masters, the optimizer offloaded, accumulation
    under no_sync: within bf16's tolerance of the fp32 reference. Momentum
    SGD, whose step is linear in the gradient (Adam's first steps move by
    +-lr wherever a near-zero gradient's sign differs in bf16)."""
    model = ctx.model()
    options = {} if ctx.reference else {"mixed_precision": "bf16", "offload_optimizer": "cpu"}
    # A small lr: at 0.1 the first step moves these weights by several units,
    # and the second step's gradients (hundreds) amplify bf16's first-step rounding.
    model, opt = ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9), **options)
    before = len(ctx.checkpoints)
    _train(ctx, model, opt, steps=2, backwards=2)
    ctx.checkpoints[before:] = [(f"{BF16_GRADS_LABEL if label.endswith('grads') else BF16_LABEL}{label}", values)
                                for label, values in ctx.checkpoints[before:]]


def fp16_overflow_on_one_tp_rank(ctx: TPContext) -> None:
    """fp16 with dynamic loss scaling. In step 0 only tp rank 1's part of one
    split gradient overflows (a hook makes it inf there, so only that tp
    rank's dp group sees it): every rank skips the step and halves its scale
    alike. Step 1 then equals one process that skipped step 0's update,
    within fp16's tolerance (labels [fp16])."""
    model = ctx.model()
    scale = zero_ext.DynamicLossScale(initial_scale=16.0)  # no natural overflow at these magnitudes
    options = {} if ctx.reference else {"mixed_precision": zero_ext.MixedPrecision(
        torch.float16, loss_scale=scale, output_dtype=torch.float32)}
    model, opt = ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.005), **options)
    leaf = model.blocks[0].up._parameters["weight"]
    hook = leaf.register_hook(lambda g: g * float("inf")) \
        if not ctx.reference and ctx.tp_mesh.get_local_rank() == 1 else None
    ctx.loss(model, 0).backward()
    if hook is not None:
        hook.remove()
    if ctx.reference:
        opt.zero_grad()  # the skipped step
        checks = [True, True]
    else:
        opt.step()
        opt.zero_grad()
        mine = torch.tensor([float(opt.skipped_steps), float(state_loss_scale(model))])
        everyone = [torch.empty(2) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        checks = [all(float(e[0]) == 1.0 for e in everyone), all(float(e[1]) == 8.0 for e in everyone)]
    for label, ok in zip(["step 0 skipped on every rank", "the loss scale halved alike on every rank"], checks):
        ctx.checkpoints.append((label, {"ok": torch.tensor(ok)}))
    ctx.loss(model, 1).backward()
    opt.step()
    opt.zero_grad()
    ctx.record_params(f"{FP16_LABEL}step 1", model)


def state_loss_scale(model) -> float:
    from zero_ext.tools import state_of
    return state_of(model).handles.optimizer.loss_scale()
