"""Tensor parallelism under zero_ext (SPEC.md, "Tensor parallelism"): a model
made tensor parallel with torch's parallelize_module over mesh["tp"], wrapped
with process_group=mesh["dp"], against one process trained on the global
batch (the same model, not parallel).

Items run in the world-4 parity group (parity_scenarios.run_one hands over
"name/stageN/tpLAYOUT"): LAYOUT is "2x2" (dp 2 x tp 2), "1x4" (dp 1 x tp 4)
or "2x1x2" (a 3-D (replicate 2, shard 1, tp 2) mesh: hybrid sharding over
the first two dimensions). The tp ranks of one data-parallel coordinate see
the same data; the reference plays every data-parallel rank at 1/dp.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_ext

BATCH, IN, HIDDEN, FFN, OUT = 4, 6, 8, 12, 3
BUCKET_MB = 0.0005
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


class Block(nn.Module):
    """norm -> up (column parallel) -> tanh -> down (row parallel), residual."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(self.norm(h))))


class TPNet(nn.Module):
    """inp and out stay plain (replicated over tp); each block's up and down
    are made tensor parallel. FFN 12 over tp 4 splits evenly; HIDDEN 8 too."""

    def __init__(self, seed: int = 0, blocks: int = 2):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.out = nn.Linear(HIDDEN, OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def parallelize(model: TPNet, tp_mesh) -> TPNet:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


SEQ, EXPERTS = 4, 4


class SequenceParallelNet(nn.Module):
    """Sequence parallel (Megatron-SP): the norms see this rank's part of
    the sequence (SequenceParallel), up gathers it (ColwiseParallel from
    Shard(1)), down scatters it back (RowwiseParallel to Shard(1)); the
    norm weights are replicated DTensors whose gradients come out Partial."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(HIDDEN, OUT)
        self.tp_mesh = None
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, SEQ, IN)
        h = self.inp(x)
        if self.tp_mesh is not None:  # this rank's part of the sequence (its backward gathers the gradient)
            from torch.distributed.tensor import DTensor, Replicate, Shard
            h = DTensor.from_local(h, self.tp_mesh, [Replicate()]).redistribute(self.tp_mesh, [Shard(1)]).to_local()
        for block in self.blocks:
            h = block(h)
        if self.tp_mesh is not None:  # the whole sequence again (differentiable)
            from torch.distributed.tensor import DTensor, Shard
            h = DTensor.from_local(h, self.tp_mesh, [Shard(1)]).full_tensor()
        return self.out(h).mean(dim=1)


def parallelize_sequence(model: SequenceParallelNet, tp_mesh) -> SequenceParallelNet:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                            "down": RowwiseParallel(output_layouts=Shard(1))})
    model.tp_mesh = tp_mesh
    return model


class PackedExperts(nn.Module):
    """EXPERTS experts packed in two parameters, (E, HIDDEN, FFN) and (E,
    FFN, HIDDEN); made expert parallel by splitting them along dim 0 over
    the tp dimension (each tp rank holds whole experts). Tokens go to one
    expert each, weighted by a router's gate; an expert no token picks gets
    no gradient that step."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(EXPERTS, HIDDEN, FFN))
        self.w2 = nn.Parameter(torch.empty(EXPERTS, FFN, HIDDEN))

    def forward(self, x: torch.Tensor, route: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        w1, w2, first, mesh = self.w1, self.w2, 0, None
        if type(w1).__name__ == "DTensor":
            from torch.distributed.tensor import DTensor, Partial, Replicate
            mesh = w1.device_mesh
            w1, w2 = w1.to_local(), w2.to_local()
            first = mesh.get_local_rank() * w1.shape[0]
            # The same tokens on every tp rank; each rank's experts give a part
            # of their gradient, summed over tp in backward.
            x = DTensor.from_local(x, mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            gate = DTensor.from_local(gate, mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        out = torch.zeros_like(x)
        for e in range(w1.shape[0]):
            picked = route == first + e
            if bool(picked.any()):
                y = torch.tanh(x[picked] @ w1[e]) @ w2[e]
                out = out.index_add(0, picked.nonzero().view(-1), y * gate[picked, first + e:first + e + 1])
        if mesh is not None:  # each rank's experts' part, summed over tp
            # x and gate in every rank's graph, whatever the routing: their
            # backward all-reduces over tp run on every tp rank alike.
            out = out + 0.0 * (x.sum() + gate.sum())
            out = DTensor.from_local(out, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
        return out


class MoENet(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS)
        self.experts = PackedExperts()
        self.out = nn.Linear(HIDDEN, OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.routed = EXPERTS - 1  # experts tokens go to: the last one is skipped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        gate = torch.softmax(self.router(h), dim=-1)
        # Fixed routing (not the gate's argmax, which rounding could flip):
        # token k goes to expert k % routed (EXPERTS - 1: one expert is skipped).
        route = torch.arange(h.shape[0]) % self.routed
        return self.out(h + self.experts(h, route, gate))


def parallelize_experts(model: MoENet, tp_mesh) -> MoENet:
    from torch.distributed.tensor import Shard, distribute_tensor
    for name in ("w1", "w2"):
        param = getattr(model.experts, name)
        model.experts.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), tp_mesh, [Shard(0)])))
    return model


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


def full_state_dict_in_and_functional_clip(ctx: TPContext) -> None:
    """load_full_state_dict of one process's weights into a fresh TP model
    (another seed), then training clipped by zero_ext.clip_grad_norm_ (the
    functional form) over model.parameters()."""
    model = ctx.model(seed=1)
    model, opt = ctx.wrap(model, sgd_momentum(model))
    full = TPNet(seed=0).state_dict()
    if ctx.reference:
        model.load_state_dict(full)
    else:
        zero_ext.load_full_state_dict(model, full)
    for step in range(2):
        ctx.loss(model, 10 * step).backward()
        clip = torch.nn.utils.clip_grad_norm_ if ctx.reference else zero_ext.clip_grad_norm_
        _record_step(ctx, model, opt, step, lambda: clip(model.parameters(), 0.5))


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


def checkpoint_at_another_stage_and_convert(ctx: TPContext) -> None:
    """Two steps, save; a fresh model wrapped at the next stage loads it and
    trains two more; convert writes full shapes equal to the full state, as
    a state_dict and as safetensors."""
    model = ctx.model()
    model, opt = ctx.wrap(model, adamw(model))
    _train(ctx, model, opt, steps=2)
    if ctx.reference:
        _train(ctx, model, opt, steps=2, first_step=2)
        ctx.checkpoints.append(("converted equals full state", {"ok": torch.tensor(True)}))
        ctx.checkpoints.append(("DCP loaded at dp 1 x tp 4 equals full state", {"ok": torch.tensor(True)}))
        return
    path = _shared_dir(ctx)
    try:
        # DCP, in the background: chunks in full-tensor coordinates, so another
        # tp layout reads splits along any dimension (zero_ext's format refuses).
        handle = zero_ext.save(path + "-dcp", model, opt, format="dcp", async_save=True)
        saved = zero_ext.full_state_dict(model)
        other_dp, other_tp, _, _ = mesh_of("1x4")
        wide = parallelize(TPNet(seed=5), other_tp)
        wide, wide_opt = zero_ext.wrap(wide, adamw(wide), stage=(ctx.stage + 2) % 4, process_group=other_dp,
                                       bucket_mb=BUCKET_MB)
        handle.wait()
        zero_ext.load(path + "-dcp", wide, wide_opt)
        loaded = zero_ext.full_state_dict(wide)
        same = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
        zero_ext.save(path, model, opt)
        fresh = ctx.model(seed=1)
        fresh, fresh_opt = ctx.wrap(fresh, adamw(fresh), stage=(ctx.stage + 1) % 4)
        zero_ext.load(path, fresh, fresh_opt)
        _train(ctx, fresh, fresh_opt, steps=2, first_step=2)
        ok = True
        if dist.get_rank() == 0:
            from zero_ext.convert import convert
            out = os.path.join(path + "-converted.pt")
            convert(path, out)
            converted = torch.load(out, weights_only=True)
            full = zero_ext.full_state_dict(model)
            from safetensors.torch import load_file
            convert(path, path + "-converted.safetensors", format="safetensors")
            ok = (_converted_matches(converted, full)
                  and _converted_matches(load_file(path + "-converted.safetensors"), full))
        else:
            zero_ext.full_state_dict(model)
        flag = torch.tensor([int(ok)])
        dist.broadcast(flag, 0)
        ctx.checkpoints.append(("converted equals full state", {"ok": torch.tensor(bool(flag.item()))}))
        ctx.checkpoints.append(("DCP loaded at dp 1 x tp 4 equals full state", {"ok": torch.tensor(same)}))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
            for suffix in ("-converted.pt", "-converted.safetensors"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path + suffix)


def _converted_matches(converted: dict, full: dict) -> bool:
    params = converted.get("model", converted)
    return all(k in params and params[k].shape == v.shape and torch.equal(params[k].float(), v.float())
               for k, v in full.items())


def _shared_dir(ctx: TPContext) -> str:
    name = tempfile.mkdtemp(prefix="zero_ext_tp_") if dist.get_rank() == 0 else ""
    box = [name]
    dist.broadcast_object_list(box, 0)
    return os.path.join(box[0], "ckpt")


REFUSALS = {  # case: what every rank's error must say
    "process_group=None (the world, which holds the tp ranks)": "Pass the data-parallel dimension",
    "process_group=mesh['tp']": "Pass the data-parallel dimension",
    "a non-elementwise optimizer on tensor-parallel parameters": "not elementwise",
    "stage 2 on tp rank 1, 3 elsewhere (each dp group agrees)": "stage",
    # tp rank 0's ranks raise what differs, the others that their peers' dp group failed
    "another bucket_mb on one rank of tp rank 0's dp group only": ("bucket", "their data-parallel group wrapped"),
    "save_weights of a tensor-parallel model": "full_state_dict",
    "a dp 2 x tp 2 checkpoint loaded at dp 1 x tp 4": "split over tensor parallel along dim 1",
    "load_full_state_dict of a rank's parts (model.state_dict())": "pass full tensors",
    "every expert of tp rank 1 routed no token (its part gets no gradient)": "on some of its 2 tensor-parallel ranks",
}


AFTER_REFUSALS = "a group every rank makes after the refusals gets one name on every rank"


class _NotElementwise(torch.optim.Optimizer):
    """Reads a whole parameter (a row norm): what zero_ext steps by owner."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad / (p.grad.norm() + 1e-6), alpha=-group["lr"])


def refusals(ctx: TPContext) -> None:
    """Each case raises zero_ext's error on every rank (one rank going on
    would hang in its next collective), and a good wrap follows each."""
    if ctx.reference:
        for case in REFUSALS:
            ctx.checkpoints.append((case, {"ok": torch.tensor(True)}))
        ctx.checkpoints.append((AFTER_REFUSALS, {"ok": torch.tensor(True)}))
        return
    dp_mesh, tp_mesh, _, dp_rank = mesh_of(ctx.layout)
    tp_rank = tp_mesh.get_local_rank()

    def attempt(case: str) -> str:
        model = ctx.model()
        opt = adamw(model)
        try:
            if case.startswith("process_group=None"):
                zero_ext.wrap(model, opt, stage=ctx.stage)
            elif case.startswith("process_group=mesh['tp']"):
                zero_ext.wrap(model, opt, stage=ctx.stage, process_group=tp_mesh)
            elif case.startswith("a non-elementwise"):
                zero_ext.wrap(model, _NotElementwise(model.parameters()), stage=ctx.stage, process_group=dp_mesh)
            elif case.startswith("stage 2 on tp rank 1"):
                zero_ext.wrap(model, opt, stage=2 if tp_rank == 1 else 3, process_group=dp_mesh)
            elif case.startswith("another bucket_mb"):
                zero_ext.wrap(model, opt, stage=ctx.stage, process_group=dp_mesh,
                              bucket_mb=1.0 if (tp_rank, dp_rank) == (0, 1) else BUCKET_MB)
            elif case.startswith("load_full_state_dict"):
                model, opt = ctx.wrap(model, opt)
                zero_ext.load_full_state_dict(model, {k: v.clone() for k, v in model.state_dict().items()})
            elif case.startswith("every expert of tp rank 1"):
                moe = parallelize_experts(MoENet(), tp_mesh)
                moe, moe_opt = ctx.wrap(moe, adamw(moe))
                moe.routed = 2  # experts 0 and 1, both on tp rank 0
                ctx.loss(moe, 0).backward()
                try:
                    moe_opt.step()
                except RuntimeError as error:
                    raise ValueError(str(error)) from error
            elif case.startswith("save_weights"):
                model, opt = ctx.wrap(model, opt)
                zero_ext.save_weights(model, _shared_dir(ctx))
            else:
                model, opt = ctx.wrap(model, opt)
                path = _shared_dir(ctx)
                zero_ext.save(path, model, opt)
                other_dp, other_tp, _, _ = mesh_of("1x4")
                wide = parallelize(TPNet(), other_tp)
                wide_opt = adamw(wide)
                wide, wide_opt = zero_ext.wrap(wide, wide_opt, stage=ctx.stage, process_group=other_dp,
                                               bucket_mb=BUCKET_MB)
                try:
                    zero_ext.load(path, wide, wide_opt)
                finally:
                    dist.barrier()
                    if dist.get_rank() == 0:
                        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        except (ValueError, NotImplementedError) as error:
            return str(error)
        return "accepted"

    for case, expected in REFUSALS.items():
        message = attempt(case)
        ok = any(e in message for e in (expected if isinstance(expected, tuple) else (expected,)))
        ctx.checkpoints.append((case, {"ok": torch.tensor(ok)}))
        if not ok:
            print(f"[tp refusal] {case}: {message[:400]}", flush=True)
    # The refused wraps made groups on some dp rows and not on others (tp rank
    # 0's row wrapped at stage 3, tp rank 1's at stage 2); a group every rank
    # makes now must still get one name everywhere (torch 2.15 salts names
    # with a counter that member-only groups advanced on their members alone).
    everyone = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=30))
    agreed = torch.ones(1)
    dist.all_reduce(agreed, group=everyone)
    ctx.checkpoints.append((AFTER_REFUSALS, {"ok": torch.tensor(agreed.item() == dist.get_world_size())}))
    # Nothing was left half done: the same ranks wrap and train.
    sgd_momentum_plain(ctx)


def _refusals_reference(ctx: TPContext) -> None:
    refusals(ctx)
    if ctx.reference:
        sgd_momentum_plain(ctx)


SCENARIOS = {f.__name__: f for f in [
    sgd_momentum_plain,
    adamw_no_sync_accumulation_clip,
    inf_norm_clip_retain_graph,
    activation_checkpointed_blocks,
    bf16_offloaded_sgd,
    fp16_overflow_on_one_tp_rank,
    sequence_parallel_norms,
    packed_experts_skipping_one,
    loss_parallel_uneven_head,
    full_state_dict_in_and_functional_clip,
    checkpoint_at_another_stage_and_convert,
]}
SCENARIOS["refusals"] = _refusals_reference
# The 1x4 and 3-D layouts run a representative pair.
LAYOUT_SCENARIOS = {"2x2": list(SCENARIOS), "1x4": ["adamw_no_sync_accumulation_clip", "sgd_momentum_plain"],
                    "2x1x2": ["adamw_no_sync_accumulation_clip", "checkpoint_at_another_stage_and_convert"]}


STAGES_OF = {"refusals": (1, 3)}  # stage-independent but for the checkpoint case


def all_items() -> List[str]:
    return [f"{name}/stage{stage}/tp{layout}" for layout in LAYOUTS for name in LAYOUT_SCENARIOS[layout]
            for stage in STAGES_OF.get(name, range(4))]


_REFERENCES: dict = {}


def run_one(item: str, compare) -> Optional[str]:
    name, rest = item.rsplit("/stage", 1)
    stage, _, layout = rest.partition("/tp")
    key = (name, layout)
    if key not in _REFERENCES:
        ref = TPContext(0, layout, reference=True)
        SCENARIOS[name](ref)
        _REFERENCES[key] = ref.checkpoints
    ctx = TPContext(int(stage), layout, reference=False)
    SCENARIOS[name](ctx)
    return compare(_REFERENCES[key], ctx.checkpoints, TOLERANCES)
