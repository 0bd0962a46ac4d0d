"""Tensor parallel layers beyond column and row parallel Linear:
SequenceParallel norms, packed experts split over tp with one expert routed
no token (saved and loaded at dp 1 x tp 4), and a column parallel head
under loss_parallel with an uneven split of its classes."""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero_ext
from tensor_parallel_context import TPContext, _record_step, _shared_dir, _train, adamw, mesh_of, sgd_momentum
from tensor_parallel_models import BATCH, BUCKET_MB, EXPERTS, IN, MoENet, OUT, SequenceParallelNet, parallelize_experts


def sequence_parallel_norms(ctx: TPContext) -> None:
    """SequenceParallel norms (their weights' gradients Partial over tp,
    summed by the leaves' DTensor), clipped, momentum SGD."""
    model = ctx.model(SequenceParallelNet)
    model, opt = ctx.wrap(model, sgd_momentum(model))
    _train(ctx, model, opt, steps=2, clip=(0.5,))


def packed_experts_skipping_one(ctx: TPContext) -> None:
    """A packed-expert MoE, experts split whole over tp (expert parallel on
    the tp dimension), one expert routed no token: AdamW, clipped. Then
    saved and loaded at dp 1 x tp 4 (every split along dim 0, so another
    tp and dp size reads it), where one more step over the same global batch
    (now one dp rank's, every expert routed) goes on as one process."""
    model = ctx.model(MoENet)
    model, opt = ctx.wrap(model, adamw(model))
    _train(ctx, model, opt, steps=2, clip=(0.5,))
    if ctx.layout != "2x2":
        return
    g = torch.Generator().manual_seed(77)
    x = torch.randn(ctx.dp * BATCH, IN, generator=g)
    y = torch.randn(ctx.dp * BATCH, OUT, generator=g)

    def global_loss(m):  # the dp 2 global batch, as dp 1 x tp 4 (or the reference) computes it whole
        return sum(0.5 * F.mse_loss(m(x[r * BATCH:(r + 1) * BATCH]), y[r * BATCH:(r + 1) * BATCH]) for r in range(2))
    if ctx.reference:
        wide, wide_opt = model, opt
    else:
        path = _shared_dir(ctx)
        zero_ext.save(path, model, opt)
        other_dp, other_tp, _, _ = mesh_of("1x4")
        wide = parallelize_experts(MoENet(seed=3), other_tp)
        wide, wide_opt = zero_ext.wrap(wide, adamw(wide), stage=ctx.stage, process_group=other_dp,
                                       bucket_mb=BUCKET_MB)
        zero_ext.load(path, wide, wide_opt)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    wide.routed = EXPERTS
    global_loss(wide).backward()
    wide_opt.step()
    wide_opt.zero_grad()
    ctx.record_params("loaded at dp 1 x tp 4, one more step", wide)


def loss_parallel_uneven_head(ctx: TPContext) -> None:
    """The output head column parallel with its logits left sharded (OUT 3
    over tp 2: an uneven split, 2 + 1 classes), cross-entropy under torch's
    loss_parallel(); momentum SGD, clipped."""
    model = ctx.model()
    if not ctx.reference:
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        parallelize_module(model.out, ctx.tp_mesh, ColwiseParallel(use_local_output=False))
    model, opt = ctx.wrap(model, sgd_momentum(model))
    for step in range(2):
        g = torch.Generator().manual_seed(1000 * step + 11)
        x = torch.randn(ctx.dp * BATCH, IN, generator=g)
        y = torch.randint(0, OUT, (ctx.dp * BATCH,), generator=g)
        if ctx.reference:
            sum(w * F.cross_entropy(model(x[r * BATCH:(r + 1) * BATCH]), y[r * BATCH:(r + 1) * BATCH])
                for r, w in ctx.participants()).backward()
        else:
            from torch.distributed.tensor.parallel import loss_parallel
            sl = slice(ctx.dp_rank * BATCH, (ctx.dp_rank + 1) * BATCH)
            with loss_parallel():
                F.cross_entropy(model(x[sl]), y[sl]).backward()
        _record_step(ctx, model, opt, step, lambda: ctx.clip(model, opt, 0.5))
