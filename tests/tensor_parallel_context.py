"""What the tensor parallel scenarios share: the (dp, tp) meshes of each
layout, TPContext (one run: zero_ext over a TP model on a layout, or the
reference playing every data-parallel rank), the comparison tolerances and
labels, the optimizers and the training loop."""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_ext
from tensor_parallel_models import (
    BATCH, BUCKET_MB, IN, MoENet, OUT, SEQ, SequenceParallelNet, TPNet, parallelize, parallelize_experts,
    parallelize_sequence)


# Tensor parallelism sums a row-parallel layer's partial products (and the dp
# ranks' gradients) in another order than one process. Reassociating an fp32
# sum of n terms moves it by about sqrt(n) * u * sum|terms| (u = 2**-24, a
# random walk of roundings; (n - 1) * u * sum|terms| at worst). A gradient
# element here sums n ~ 8 samples x 12 hidden units ~ 100 products whose
# magnitudes add to at most ~3x the gradient's largest element, which this
# model's weights (N(0, 0.25)) and inputs (N(0, 1)) keep near 40: sqrt(100) *
# 6e-8 * 120 ~ 7e-5, so atol 1e-4 for elements near zero (torch's TP alone,
# no zero_ext, differs from the reference by 2.7e-5 here); rtol as parity's.
# bf16 compute against the fp32 reference: gradients reach ~40 in magnitude,
# where one bf16 ulp is 0.25; an element near zero keeps what rounding its
# large terms left: bf16's u = 2**-9 times the ~40 of those terms, 0.08, so
# atol 0.1 (rtol 2e-2, a few ulps, for the rest). The parameters SGD steps
# from them at lr 0.005 move by 0.005 x that, under the params' atol 0.01,
# which covers the bf16 compute copies' own rounding of values near 1.
BF16_LABEL, BF16_GRADS_LABEL = "[bf16] ", "[bf16 grads] "
# fp16 compute (u = 2**-12): gradients off by ~2**-12 x 40 = 0.01, stepped at
# lr 0.005 into the parameters: 5e-5, well under atol 1e-3; rtol 1e-2 as parity's fp16.
FP16_LABEL = "[fp16] "
TOLERANCES = {BF16_LABEL: (2e-2, 1e-2), BF16_GRADS_LABEL: (2e-2, 1e-1), FP16_LABEL: (1e-2, 1e-3),
              "": (1e-5, 1e-4)}
LAYOUTS = ("2x2", "1x4", "2x1x2")


_MESHES: dict = {}


def mesh_of(layout: str):
    """(process_group for wrap, the tp mesh, dp size, dp rank), made once per process."""
    if layout not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh
        sizes = tuple(int(v) for v in layout.split("x"))
        if len(sizes) == 2:
            mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("dp", "tp"))
            dp_mesh = mesh["dp"]
            dp_rank = dp_mesh.get_local_rank()
        else:
            mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("replicate", "shard", "tp"))
            dp_mesh = mesh["replicate", "shard"]
            r, s = dp_mesh.get_coordinate()
            dp_rank = r * sizes[1] + s
        _MESHES[layout] = (dp_mesh, mesh["tp"], sizes[0] * (sizes[1] if len(sizes) == 3 else 1), dp_rank)
    return _MESHES[layout]


class TPContext:
    """One run: zero_ext over a TP model on a layout, or the reference."""

    def __init__(self, stage: int, layout: str, reference: bool):
        self.stage, self.layout, self.reference = stage, layout, reference
        sizes = tuple(int(v) for v in layout.split("x"))
        self.dp = sizes[0] * (sizes[1] if len(sizes) == 3 else 1)
        if reference:
            self.dp_mesh = self.tp_mesh = None
            self.dp_rank = 0
        else:
            self.dp_mesh, self.tp_mesh, _, self.dp_rank = mesh_of(layout)
        self.checkpoints: list = []

    def model(self, cls=None, **kwargs) -> nn.Module:
        cls = cls or TPNet
        model = cls(**kwargs)
        if self.reference:
            return model
        how = {TPNet: parallelize, SequenceParallelNet: parallelize_sequence, MoENet: parallelize_experts}[cls]
        return how(model, self.tp_mesh)

    def wrap(self, model, opt, stage: Optional[int] = None, **options):
        if self.reference:
            return model, opt
        return zero_ext.wrap(model, opt, stage=self.stage if stage is None else stage, bucket_mb=BUCKET_MB,
                             process_group=self.dp_mesh, **options)

    def participants(self):
        if self.reference:
            return [(r, 1.0 / self.dp) for r in range(self.dp)]
        return [(self.dp_rank, 1.0)]

    def loss(self, model, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + 7)
        x = torch.randn(self.dp * BATCH, *((SEQ,) if isinstance(model, SequenceParallelNet) else ()), IN, generator=g)
        y = torch.randn(self.dp * BATCH, OUT, generator=g)
        total = 0.0
        for r, w in self.participants():
            sl = slice(r * BATCH, (r + 1) * BATCH)
            # .float(): bf16 outputs against fp32 targets (torch 2.11's mse_loss
            # backward returns an fp32 gradient for a bf16 input of mixed dtypes).
            total = total + w * F.mse_loss(model(x[sl]).float(), y[sl])
        return total

    def no_sync(self, model):
        return contextlib.nullcontext() if self.reference else model.no_sync()

    def clip(self, model, opt, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if self.reference:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return opt.clip_grad_norm_(max_norm, norm_type)

    def record_grads(self, label: str, model) -> None:
        if self.reference:
            grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
        else:
            grads = zero_ext.full_grads(model)
        self.checkpoints.append((f"{label}: grads", grads))

    def record_params(self, label: str, model) -> None:
        if self.reference:
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        else:
            full = zero_ext.full_state_dict(model)
            params = {n: full[n] for n, _ in model.named_parameters()}
        self.checkpoints.append((f"{label}: params", params))

    def record_value(self, label: str, value: torch.Tensor) -> None:
        self.checkpoints.append((label, {"value": value.detach().clone().reshape(())}))


def sgd_momentum(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def _train(ctx: TPContext, model, opt, steps: int, first_step: int = 0, backwards: int = 1, clip=None,
           retain: bool = False) -> None:
    for step in range(first_step, first_step + steps):
        for k in range(backwards):
            sync = k == backwards - 1
            with contextlib.nullcontext() if sync else ctx.no_sync(model):
                loss = ctx.loss(model, 10 * step + k)
                if retain and step % 2 == 0:  # a second backward over the same forward
                    (0.5 * loss).backward(retain_graph=True)
                    (0.5 * loss).backward()
                elif retain:  # the list form, two roots of one graph in one call
                    torch.autograd.backward([0.25 * loss, 0.75 * loss])
                else:
                    loss.backward()
        _record_step(ctx, model, opt, step, None if clip is None else lambda: ctx.clip(model, opt, *clip))


def _record_step(ctx: TPContext, model, opt, step: int, clip=None) -> None:
    """The gradients, the norm clip() returns (if any), a step, the parameters."""
    ctx.record_grads(f"step {step}", model)
    if clip is not None:
        ctx.record_value(f"step {step}: norm", clip())
    opt.step()
    opt.zero_grad()
    ctx.record_params(f"step {step}", model)


def _shared_dir(ctx: TPContext) -> str:
    name = tempfile.mkdtemp(prefix="zero_ext_tp_") if dist.get_rank() == 0 else ""
    box = [name]
    dist.broadcast_object_list(box, 0)
    return os.path.join(box[0], "ckpt")
