"""Training scenarios run twice: wrapped by zero_ext on N ranks, and as a
single-process reference over the global batch.

A scenario is written once against a Context. The reference context plays
every rank at once: each forward computes the sum over ranks r of
(1/N) * loss_r, so its gradients are exactly what averaging N ranks' gradients
must give, rank-dependent branches included. A scenario returns a list of
named checkpoints (gradients after a backward, parameters after a step,
returned norms); the two lists must match.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import tempfile
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_ext

BATCH = 4          # samples per rank
IN, HIDDEN, OUT = 6, 12, 3
BUCKET_MB = 0.0005  # ~500 bytes: several buckets even for these tiny models


class Net(nn.Module):
    """Small MLP with an optional side branch, for unused/rank-dependent tests."""

    def __init__(self, seed: int = 0, branch: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT)
        self.branch = nn.Linear(HIDDEN, OUT) if branch else None
        if branch:
            # Used on some ranks only in some scenarios: it must not be a
            # stage 3 unit of its own (its all-gather would run on those ranks only).
            self.branch.zero_ext_test_root = True
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        y = self.out(h)
        if use_branch:
            y = y + self.branch(h)
        return y


def net_units(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and not getattr(module, "zero_ext_test_root", False)


class LossNet(Net):
    """Computes its own loss inside forward()."""

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.mse_loss(super().forward(x), target)


VOCAB, DIM, SEQ = 11, 8, 5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.ff(h)) * torch.sigmoid(self.gate(h))


class Blocks(nn.Module):
    """Embedding, repeated blocks (stage 3's default units) and an output
    layer tied to the embedding."""

    def __init__(self, n_blocks: int = 3, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor, plan=None, checkpointing=None) -> torch.Tensor:
        h = self.embed(tokens)
        for i in plan if plan is not None else range(len(self.blocks)):
            if checkpointing is None:
                h = self.blocks[i](h)
            else:
                from torch.utils.checkpoint import checkpoint
                h = checkpoint(self.blocks[i], h, use_reentrant=checkpointing == "reentrant")
        return self.head(h)


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor


@dataclasses.dataclass
class LMOutput:
    logits: torch.Tensor
    aux: Optional[torch.Tensor] = None


class DataclassBlock(Block):
    def forward(self, x: Hidden) -> Hidden:  # type: ignore[override]
        return Hidden(super().forward(x.h))


class DataclassBlocks(Blocks):
    """Outputs that pytree does not look into: a unit returning a dataclass,
    and a model returning one."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(DataclassBlock() for _ in range(3))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in self.blocks.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor) -> LMOutput:  # type: ignore[override]
        h = Hidden(self.embed(tokens))
        for block in self.blocks:
            h = block(h)
        return LMOutput(self.head(h.h))


def token_loss(ctx: "Context", model: nn.Module, step: int, **forward_kwargs) -> torch.Tensor:
    total = 0.0
    for r, w in ctx.participants():
        g = torch.Generator().manual_seed(500 + step)
        tokens = torch.randint(0, VOCAB, (ctx.world * BATCH, SEQ + 1), generator=g)[r * BATCH:(r + 1) * BATCH]
        logits = model(tokens[:, :-1], **forward_kwargs)
        if isinstance(logits, LMOutput):
            logits = logits.logits
        total = total + w * F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return total


def batch(step: int, rank: int, world: int, salt: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice of the global batch of `step`."""
    g = torch.Generator().manual_seed(1000 * step + salt)
    x = torch.randn(world * BATCH, IN, generator=g)
    y = torch.randn(world * BATCH, OUT, generator=g)
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[sl], y[sl]


class Context:
    def __init__(self, stage: int, rank: int, world: int, reference: bool, mesh=None):
        self.stage, self.rank, self.world, self.reference = stage, rank, world, reference
        # Hybrid sharding: a 2-D (replicate, shard) DeviceMesh over the same
        # ranks; the data, and so the reference, stay those of the flat world.
        self.mesh = mesh
        self.replicas = mesh.mesh.shape[0] if mesh is not None else 1
        self.shard_size = world // self.replicas
        self.checkpoints: List[Tuple[str, Dict[str, Optional[torch.Tensor]]]] = []

    def group_kwargs(self) -> dict:
        """wrap()'s process_group for this run."""
        return {"process_group": self.mesh} if self.mesh is not None else {}

    # -- who this process plays -------------------------------------------
    def participants(self) -> List[Tuple[int, float]]:
        """(rank, weight) pairs: this rank alone, or every rank at 1/N."""
        if self.reference:
            return [(r, 1.0 / self.world) for r in range(self.world)]
        return [(self.rank, 1.0)]

    def wrap(self, model: nn.Module, opt: torch.optim.Optimizer, **options):
        if self.reference:
            return model, opt
        if self.stage == 3 and isinstance(model, Net):
            options.setdefault("units", net_units)  # each Linear its own unit; Blocks use the default policy
        options = {**self.group_kwargs(), **options}
        return zero_ext.wrap(model, opt, stage=self.stage, bucket_mb=BUCKET_MB, **options)

    def no_sync(self, model: nn.Module):
        return contextlib.nullcontext() if self.reference else model.no_sync()

    def set_requires_all_reduce(self, model: nn.Module, requires: bool) -> None:
        if not self.reference:
            model.set_requires_all_reduce(requires)

    def clip(self, model: nn.Module, opt, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if self.reference:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return opt.clip_grad_norm_(max_norm, norm_type)

    # -- checkpoints --------------------------------------------------------
    def record_grads(self, label: str, model: nn.Module) -> None:
        if self.reference:
            grads = {n: None if p.grad is None else p.grad.detach().clone()
                     for n, p in model.named_parameters()}
        else:
            grads = zero_ext.full_grads(model)
        self.checkpoints.append((f"{label}: grads", grads))

    def record_params(self, label: str, model: nn.Module) -> None:
        if self.reference:
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        else:  # stage 3 parameters hold no memory between steps
            full = zero_ext.full_state_dict(model)
            params = {n: full[n] for n, _ in model.named_parameters()}
        self.checkpoints.append((f"{label}: params", params))

    def record_value(self, label: str, value: torch.Tensor) -> None:
        self.checkpoints.append((label, {"value": value.detach().clone().reshape(())}))

    def record_check(self, label: str, ok: bool) -> None:
        """A property only the zero_ext run can check (the reference records True)."""
        self.checkpoints.append((label, {"ok": torch.tensor(bool(ok) or self.reference)}))

    def record_checks(self, labels: List[str], checks: Optional[List[bool]] = None) -> None:
        """Several such properties; the reference passes no `checks`."""
        assert checks is not None or self.reference
        for label, ok in zip(labels, checks if checks is not None else [True] * len(labels)):
            self.record_check(label, ok)


def mlp_loss(ctx: Context, model: nn.Module, step: int, salt: int = 0, branch_on_rank0: bool = False) -> torch.Tensor:
    total = 0.0
    for r, w in ctx.participants():
        x, y = batch(step, r, ctx.world, salt)
        out = model(x, use_branch=branch_on_rank0 and r == 0) if branch_on_rank0 else model(x)
        total = total + w * F.mse_loss(out, y)
    return total


def step_and_record(ctx: Context, model: nn.Module, opt, step: int) -> None:
    """Records the gradients, steps, zeroes, records the parameters."""
    ctx.record_grads(f"step {step}", model)
    opt.step()
    opt.zero_grad()
    ctx.record_params(f"step {step}", model)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


# AdamW for parameters whose gradients can be near zero: low-precision
# gradients, or fp32 ones whose terms cancel (an MoE expert's weights).
# Adam's step lr * m/(sqrt(v)+eps) is scale-free where |g| >> eps and has
# slope 1/eps at g = 0 (up to 2/eps once m and v average over steps), so a
# gradient off by d (another reduction order, another CPU) moves its
# parameter by up to ~2 lr d / max(|g|, eps). With torch's eps=1e-8 an fp32
# gradient of 1e-6 off by 1e-9 moves it by 1e-5 (5e-6 seen on one CPU,
# beyond a small parameter's RTOL/ATOL); a low-precision gradient that
# rounds to zero on one side only, by lr. With eps = lr = 1e-2 a step adds
# at most 2 d: the parameters stay within the gradients' own tolerance.
def conditioned_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, eps=1e-2, weight_decay=0.1)


# ---------------------------------------------------------------------------
# Scenarios. Each takes a Context and records checkpoints.
# ---------------------------------------------------------------------------

def _mlp_training(ctx: Context, model: nn.Module, make_optimizer, steps: int, **loss_kwargs) -> None:
    """The plain loop: one mlp_loss backward per step, recorded."""
    model, opt = ctx.wrap(model, make_optimizer(model))
    for step in range(steps):
        mlp_loss(ctx, model, step, **loss_kwargs).backward()
        step_and_record(ctx, model, opt, step)


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
                         ctx.reference or model._zero_ext.core.stats()["last_keep_graph"] == 1)
        ctx.record_grads(f"step {step} after first backward", model)
        if zero_between:
            opt.zero_grad()
        gathers = None if ctx.reference else model._zero_ext.core.stats()["param_gathers"]
        total.backward()  # goes through l1's retained graph a second time
        ctx.record_check(f"step {step}: no parameter all-gather in the second backward",
                         ctx.reference or model._zero_ext.core.stats()["param_gathers"] == gathers)
        ctx.record_check(f"step {step}: second backward did not keep graph",
                         ctx.reference or model._zero_ext.core.stats()["last_keep_graph"] == 0)
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
        gathers = None if ctx.reference else model._zero_ext.core.stats()["param_gathers"]
        out.backward(grad, retain_graph=True)
        ctx.record_check(f"step {step}: no parameter all-gather in the second backward",
                         ctx.reference or model._zero_ext.core.stats()["param_gathers"] == gathers)
        step_and_record(ctx, model, opt, step)


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
                before = model._zero_ext.core.stats()["collectives"]
            mlp_loss(ctx, model, step, salt=micro).backward()
            if not ctx.reference and micro < 3:
                quiet.append(model._zero_ext.core.stats()["collectives"] == before)
        step_and_record(ctx, model, opt, step)
    ctx.record_check("no collective in the micro-steps with require_backward_grad_sync False",
                     ctx.reference or all(quiet))
    ctx.record_check("require_backward_grad_sync reads back", ctx.reference or model.require_backward_grad_sync)


def stage1_keeps_full_staging(ctx: Context, offload: bool = False, reduce_dtype=torch.float32) -> bool:
    """Stage 1 keeps a full fp32 staging buffer per bucket, unless its rank
    is alone in its group (world size 1), where gradients stage straight
    into the gradient shard ([Note: one rank's staging is its accumulator]):
    not with offload or a reduction dtype other than fp32."""
    alone = ctx.world == 1 and not offload and reduce_dtype == torch.float32
    return ctx.stage == 1 and not alone


def _replica_traffic_and_bytes(ctx: Context, model: nn.Module, collectives_before: int, backwards: int,
                               deferring: bool = True, **options) -> List[bool]:
    """While backwards keep the all-reduce across replicas back (hybrid,
    stages 1-3): the replicas exchanged only each backward's small agreement,
    and a rank holds one fp32 shard more than synced (the deferred sum).
    `deferring` False: after a synced backward, whose all-reduce carried it
    all, nothing is kept back any more."""
    if ctx.reference:
        return [True, True]
    stats = model._zero_ext.core.stats()
    defers = deferring and ctx.replicas > 1 and ctx.stage > 0
    sent = stats["replica_collectives"] - collectives_before
    padded = sum(model._zero_ext.core.bucket_layout()[2::3])  # (first, count, padded) per bucket
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
        before = 0 if ctx.reference else model._zero_ext.core.stats()["replica_collectives"]
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


def offload_replica_all_reduce_deferred_in_accumulation(ctx: Context) -> None:
    replica_all_reduce_deferred_in_accumulation(ctx, **OFFLOAD)


# Optimizer offload (fp32): the same results as without it. Adam/AdamW run
# zero_ext's C++ kernel on the host shards, others the torch optimizer.
OFFLOAD = {"offload_optimizer": "cpu"}


def offload_four_backward_per_step_adamw(ctx: Context) -> None:
    _accumulate(ctx, [4, 4], **OFFLOAD)


def offload_varying_backward_per_step_sgd(ctx: Context) -> None:
    _accumulate(ctx, [2, 5, 3], make_optimizer=sgd, **OFFLOAD)


def offload_no_sync_accumulation(ctx: Context) -> None:
    no_sync_accumulation(ctx, **OFFLOAD)


def offload_adam_param_groups_amsgrad_scheduler(ctx: Context) -> None:
    """L2-decay Adam with amsgrad in one group, another lr in the other, and
    a scheduler built before wrap(): every option of the kernel."""
    model = Net()
    opt = torch.optim.Adam([
        {"params": [*model.inp.parameters(), *model.mid.parameters()], "amsgrad": True, "weight_decay": 0.1},
        {"params": list(model.out.parameters()), "lr": 0.02},
    ], lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = ctx.wrap(model, opt, **OFFLOAD)
    for step in range(3):
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)
        sched.step()


# offload_*="nvme" (stages 1-3; stage 3 also the parameters): shards,
# masters, gradients and optimizer state in offload files, streamed through
# the step; the same results as in memory. Each rank's files are unlinked
# at once: nothing is ever left in the directory.
def nvme_options(ctx: Context) -> dict:
    if ctx.reference:
        return {}
    global _NVME_DIR
    if _NVME_DIR is None:
        _NVME_DIR = tempfile.mkdtemp(prefix="zero_ext_nvme_")
    return {"offload_optimizer": "nvme", "offload_params": "nvme" if ctx.stage == 3 else None,
            "offload_path": _NVME_DIR, "persist_kb": 0}  # these models' buckets are all below the default


_NVME_DIR = None


def _nvme_dir_empty(ctx: Context) -> bool:
    return ctx.reference or not os.listdir(_NVME_DIR)


def nvme_accumulation_no_sync_clip_adamw(ctx: Context) -> None:
    """Three backwards a step (two under no_sync), clipped, AdamW (the C++
    kernel over each streamed bucket); gradients read back from the files."""
    model = Net()
    model, opt = ctx.wrap(model, adamw(model), **nvme_options(ctx))
    ctx.record_check("no offload file left in the directory", _nvme_dir_empty(ctx))
    for step in range(3):
        with ctx.no_sync(model):
            for micro in range(2):
                mlp_loss(ctx, model, step, salt=micro).backward()
        mlp_loss(ctx, model, step, salt=2).backward()
        ctx.record_grads(f"step {step}", model)
        ctx.record_value(f"step {step} norm", ctx.clip(model, opt, 0.5))
        opt.step()
        opt.zero_grad()
        ctx.record_params(f"step {step}", model)


def nvme_retain_graph_momentum_sgd(ctx: Context) -> None:
    """Two backwards over one forward (retain_graph), momentum SGD (torch's
    own step over each streamed bucket), accumulation across steps."""
    model = Net()
    model, opt = ctx.wrap(model, sgd(model), **nvme_options(ctx))
    for step in range(3):
        loss = mlp_loss(ctx, model, step)
        loss.backward(retain_graph=True)
        (loss * 0.5).backward()
        mlp_loss(ctx, model, step, salt=1).backward()
        step_and_record(ctx, model, opt, step)


def nvme_checkpoints_across_offload_settings(ctx: Context) -> None:
    """Saved with nvme offload, loaded without; saved without, loaded with:
    as one process trained straight through."""
    settings = [nvme_options(ctx), {}, nvme_options(ctx)]
    model = Net()
    model, opt = ctx.wrap(model, sgd(model), **settings[0])
    for step in range(3):
        if step > 0 and not ctx.reference:
            root = [tempfile.mkdtemp(prefix="zero_ext_nvme_ck_") if ctx.rank == 0 else None]
            dist.broadcast_object_list(root, src=0)
            path = os.path.join(root[0], "ck")
            zero_ext.save(path, model, opt)
            fresh = Net(seed=3)
            model, opt = ctx.wrap(fresh, sgd(fresh), **settings[step])
            zero_ext.load(path, model, opt)
            dist.barrier()
            if ctx.rank == 0:
                shutil.rmtree(root[0], ignore_errors=True)
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)


for _scenario in (nvme_accumulation_no_sync_clip_adamw, nvme_retain_graph_momentum_sgd,
                  nvme_checkpoints_across_offload_settings):
    _scenario.stages = (1, 2, 3)  # stage 0 shards no optimizer state to offload
    _scenario.flat_only = True  # nvme offload is refused with hybrid sharding


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


class EmbedBlocksHead(nn.Module):
    """embed -> blocks (a ModuleList, no forward of its own) -> norm -> head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(3)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(self.norm(h))


def grouped_and_container_units(ctx: Context) -> None:
    """units=[[embed, norm, head], blocks]: one unit of three siblings (used
    first and last in the forward, another unit gathered in between) and a
    ModuleList as one unit; then the head called on its own (a use of its
    unit like any other)."""
    model = EmbedBlocksHead()
    opt = adamw(model)
    if not ctx.reference:
        model, opt = zero_ext.wrap(model, opt, stage=ctx.stage, bucket_mb=BUCKET_MB,
                                   units=[[model.embed, model.norm, model.head], model.blocks],
                                   **ctx.group_kwargs())
    for step in range(3):
        total = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world)
            extra = model.head(torch.tanh(torch.ones(2, HIDDEN) * 0.1 * (step + 1))).square().mean()
            total = total + w * (F.mse_loss(model(x), y) + extra)
        total.backward()
        step_and_record(ctx, model, opt, step)


grouped_and_container_units.stages = (3,)


def tied_weights_in_a_group_unit(ctx: Context) -> None:
    """units=[[embed, head], *blocks] with the head tied to the embedding:
    the tied weight lives in the group, gathered before the embedding's
    forward and kept to the head's (other units gathered in between), its
    gradient the sum of both uses; the head also called on its own."""
    model = Blocks()
    opt = adamw(model)
    if not ctx.reference:
        model, opt = zero_ext.wrap(model, opt, stage=ctx.stage, bucket_mb=BUCKET_MB,
                                   units=[[model.embed, model.head], *model.blocks], **ctx.group_kwargs())
        ctx.record_check("four units and the root", model._zero_ext.core.stats()["units"] == 5)
    else:
        ctx.record_check("four units and the root", True)
    for step in range(3):
        extra = 0.0
        for r, w in ctx.participants():
            extra = extra + w * model.head(torch.full((2, DIM), 0.1 * (step + 1))).square().mean()
        (token_loss(ctx, model, step) + extra).backward()
        step_and_record(ctx, model, opt, step)


tied_weights_in_a_group_unit.stages = (3,)


class ParallelLists(nn.Module):
    """A model that keeps its layers' parts in parallel ModuleLists iterated
    together in forward (norms[i], bases[i], downs[i], ups[i]), LoRA-style:
    the input layer, norms and bases frozen, downs and ups trainable. Small
    siblings of one list merge into one stage 3 unit (the default policy at
    BUCKET_MB) whose members run interleaved with the other lists' modules;
    the norms' backward needs their frozen weights for the input gradients.
    The first norm's input requires no grad (the frozen input layer's output),
    so that member returns nothing to hook."""

    LAYERS = 3

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(self.LAYERS))
        self.bases = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(self.LAYERS))
        self.downs = nn.ModuleList(nn.Linear(HIDDEN, 2, bias=False) for _ in range(self.LAYERS))
        self.ups = nn.ModuleList(nn.Linear(2, HIDDEN, bias=False) for _ in range(self.LAYERS))
        self.out = nn.Linear(HIDDEN, OUT)
        with torch.no_grad():  # not 1 and 0: the norms' weights matter to their input gradients
            for norm in self.norms:
                norm.weight.copy_(1.0 + 0.3 * torch.randn(HIDDEN))
                norm.bias.copy_(0.3 * torch.randn(HIDDEN))
        for frozen in (self.inp, self.norms, self.bases):
            frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for norm, base, down, up in zip(self.norms, self.bases, self.downs, self.ups):
            n = norm(h)
            h = h + torch.tanh(base(n) + up(down(n)))
        return self.out(h)

    def listed_units(self) -> list:
        """The same units as the default policy's, listed by the user."""
        return [self.norms, *self.bases, self.downs, self.ups]

    @classmethod
    def units(cls) -> int:
        """Stage 3: the root, one merged unit per small list, one per base."""
        return 1 + 3 + cls.LAYERS


def _parallel_lists(ctx: Context, listed: bool) -> None:
    model = ParallelLists()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1)
    options = {"units": model.listed_units()} if listed else {}
    model, opt = ctx.wrap(model, opt, **options)
    ctx.record_check("stage 3: the small lists merged into units",
                     ctx.reference or ctx.stage != 3 or model._zero_ext.core.stats()["units"] == ParallelLists.units())
    for step in range(3):
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)


def parallel_lists_lora(ctx: Context) -> None:
    """LoRA on a model of parallel ModuleLists: merged units whose members
    run interleaved with other units, frozen members read by backward."""
    _parallel_lists(ctx, listed=False)


def parallel_lists_lora_listed_units(ctx: Context) -> None:
    """The same with units=[norms, *bases, downs, ups] (containers as units)."""
    _parallel_lists(ctx, listed=True)


parallel_lists_lora_listed_units.stages = (3,)  # units= is a stage 3 option


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


def param_groups_and_scheduler(ctx: Context) -> None:
    model = Net()
    opt = torch.optim.Adam([
        {"params": list(model.inp.parameters()) + list(model.out.parameters()), "lr": 0.02, "weight_decay": 0.0},
        {"params": model.mid.parameters(), "lr": 0.005, "weight_decay": 0.05},
    ])
    model, opt = ctx.wrap(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        mlp_loss(ctx, model, step).backward()
        ctx.record_grads(f"step {step}", model)
        opt.step()
        sched.step()
        opt.zero_grad()
        ctx.record_params(f"step {step}", model)
        ctx.record_value(f"step {step} lr group 1", torch.tensor(opt.param_groups[1]["lr"]))


def _clip_training(ctx: Context, clip) -> None:
    """clip(model, opt, max_norm, norm_type) after each backward."""
    model = Net(branch=True)  # the unused branch must not count
    model, opt = ctx.wrap(model, sgd(model))
    for step in range(2):
        (10.0 * mlp_loss(ctx, model, step)).backward()
        norm = clip(model, opt, 0.5, 2.0 if step == 0 else float("inf"))
        ctx.record_value(f"step {step} total norm", norm)
        ctx.record_grads(f"step {step} clipped", model)
        opt.step()
        opt.zero_grad()
        ctx.record_params(f"step {step}", model)


def clip_grad_norm(ctx: Context) -> None:
    """optimizer.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_."""
    _clip_training(ctx, ctx.clip)


def zero_ext_clip_grad_norm_over_model_parameters(ctx: Context) -> None:
    """zero_ext.clip_grad_norm_(model.parameters(), ...) with torch's
    signature, against torch.nn.utils.clip_grad_norm_ on one process."""
    clip = torch.nn.utils.clip_grad_norm_ if ctx.reference else zero_ext.clip_grad_norm_
    _clip_training(ctx, lambda model, opt, max_norm, norm_type: clip(model.parameters(), max_norm, norm_type))


def zero_ext_clip_grad_norm_over_the_optimizer_tensors(ctx: Context) -> None:
    """The same over what the optimizer holds (this rank's shards in stages
    1-3): the global norm still counts every rank's shard."""
    clip = torch.nn.utils.clip_grad_norm_ if ctx.reference else zero_ext.clip_grad_norm_
    _clip_training(ctx, lambda model, opt, max_norm, norm_type: clip(
        [p for g in opt.param_groups for p in g["params"]], max_norm, norm_type))


def parameter_listed_twice_in_a_group(ctx: Context) -> None:
    """torch.optim warns and steps such a parameter twice: so does every stage."""
    model = Net()
    params = list(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "duplicate parameters" warning
        opt = torch.optim.SGD([{"params": params + [model.mid.weight]}], lr=0.1, momentum=0.9)
        model, opt = ctx.wrap(model, opt)
    for step in range(2):
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)


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


def full_params_read_ema_and_writeback(ctx: Context) -> None:
    """Inside zero_ext.full_params every parameter holds its full value on
    every rank (norms for logging, an EMA copy); writeback=True makes a change
    the new value; a submodule alone can be gathered."""
    model = Blocks()
    model, opt = ctx.wrap(model, adamw(model))
    full = contextlib.nullcontext if ctx.reference else zero_ext.full_params
    ema = None
    for step in range(2):
        token_loss(ctx, model, step).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad(), (full(model) if not ctx.reference else full()):
            norms = {n: p.norm() for n, p in model.named_parameters()}
            current = {n: p.detach().clone() for n, p in model.named_parameters()}
            ema = current if ema is None else {n: 0.9 * ema[n] + 0.1 * current[n] for n in current}
        ctx.record_value(f"step {step} norm of all parameters", torch.stack(list(norms.values())).norm())
        ctx.checkpoints.append((f"step {step} ema", ema))
    with torch.no_grad(), (full(model.blocks[1], writeback=True) if not ctx.reference else full()):
        model.blocks[1].ff.weight.mul_(0.5)
        model.blocks[1].gate.bias.data.add_(1.0)  # through .data: no version bump of its own
    ctx.record_params("after writeback", model)
    token_loss(ctx, model, 5).backward()
    step_and_record(ctx, model, opt, 5)


def autograd_grad_is_side_effect_free(ctx: Context) -> None:
    model = Net()
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(2):
        mlp_loss(ctx, model, step).backward()
        ctx.record_grads(f"step {step} before autograd.grad", model)
        # Only returns gradients: .grad, optimizer gradients and comm state stay.
        reductions = None if ctx.reference else model._zero_ext.core.stats()["synced_epilogues"]
        g = torch.autograd.grad(mlp_loss(ctx, model, step, salt=5), [model.inp.weight])[0]
        ctx.record_check(f"step {step} autograd.grad returned a gradient", g.abs().sum() > 0)
        ctx.record_check(f"step {step} autograd.grad reduced no gradient",
                         ctx.reference or model._zero_ext.core.stats()["synced_epilogues"] == reductions)
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
        reads = None if ctx.reference else model._zero_ext.core.stats()["agreement_reads"]
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
                         ctx.reference or model._zero_ext.core.stats()["agreement_reads"] == reads)
        step_and_record(ctx, model, opt, step)
        ctx.record_check(f"step {step}: one host read for the step",
                         ctx.reference or model._zero_ext.core.stats()["agreement_reads"] == reads + 1)


def checkpoint_reentrant_param_used_twice(ctx: Context) -> None:
    _checkpointed(ctx, reentrant=True)


def checkpoint_nonreentrant_param_used_twice(ctx: Context) -> None:
    _checkpointed(ctx, reentrant=False)


def full_state_dict_round_trip(ctx: Context) -> None:
    """full_state_dict() of a trained model drives a plain model to the same
    outputs; load_full_state_dict() of a plain model's weights (never wrapped)
    resets training to them."""
    model = Net()
    model, opt = ctx.wrap(model, sgd(model))
    fresh = Net(seed=11)
    for step in range(2):
        mlp_loss(ctx, model, step).backward()
        opt.step()
        opt.zero_grad()
    sd = model.state_dict() if ctx.reference else zero_ext.full_state_dict(model)
    ctx.checkpoints.append(("full_state_dict", {k: v.clone() for k, v in sd.items()}))
    plain = Net(seed=5)
    plain.load_state_dict(sd)
    x, _ = batch(9, 0, 1)
    ctx.record_check("plain model loaded from it gives the same outputs",
                     torch.allclose(plain(x), model(x), rtol=0, atol=0))
    if ctx.reference:
        model.load_state_dict(fresh.state_dict())
    else:
        zero_ext.load_full_state_dict(model, fresh.state_dict())
    ctx.record_params("after load_full_state_dict", model)
    for step in range(2, 4):
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)


def state_bytes_match_the_stage(ctx: Context) -> None:
    """Exact bytes each rank holds after a step: full parameters; gradients
    full (stage 0), full staging + fp32 shard (1; alone in its group only the
    shard) or only the shard (2);
    AdamW state for this rank's shard only (stages 1-2)."""
    model = Net(branch=True)
    n_elems = sum(p.numel() for p in model.parameters())
    model, opt = ctx.wrap(model, adamw(model))
    before_backward = None if ctx.reference else model._zero_ext.core.stats()["grad_bytes"]
    mlp_loss(ctx, model, 0, branch_on_rank0=True).backward()
    opt.step()
    ctx.record_params("after step", model)
    labels = ["before the first backward: no gradient shard memory yet (only DDP-style buckets)",
              "padding below world size per bucket", "parameter bytes: full model (stage 3: shard)",
              "gradient bytes match the stage", "optimizer state covers exactly its elements",
              "optimizer shards tile the model exactly once",
              "zero_grad(): the gradient shards' memory goes back (only DDP-style buckets stay)",
              "zero_grad(set_to_none=False): zeroed gradients hold their memory again"]
    if ctx.reference:
        ctx.record_checks(labels)
        return
    stats = model._zero_ext.core.stats()
    padded = sum(model._zero_ext.core.bucket_layout()[2::3])
    shard = padded // ctx.shard_size
    full_staging = padded if ctx.stage == 0 or stage1_keeps_full_staging(ctx) else 0
    expected_grad = (full_staging + (shard if ctx.stage > 0 else 0)) * 4
    expected_params = (shard if ctx.stage == 3 else padded) * 4
    state_elems = sum(t.numel() for st in opt.state.values() for k, t in st.items() if k != "step")
    opt_elems = sum(p.numel() for g in opt.param_groups for p in g["params"])
    total = torch.tensor([opt_elems])
    if ctx.stage > 0 and ctx.world > 1:
        torch.distributed.all_reduce(total)
    # set_to_none=True frees gradients as in plain PyTorch; stages 0-1 keep
    # their full buckets, as DDP keeps its.
    opt.zero_grad()
    after_zero_grad = model._zero_ext.core.stats()["grad_bytes"]
    opt.zero_grad(set_to_none=False)
    after_zeroing = model._zero_ext.core.stats()["grad_bytes"]
    checks = [
        before_backward == full_staging * 4,
        n_elems <= padded < n_elems + ctx.shard_size * stats["buckets"],
        stats["param_bytes"] == expected_params and stats["gathered_units"] == 0,
        stats["grad_bytes"] == expected_grad,
        state_elems == 2 * opt_elems,
        int(total) == n_elems * (ctx.replicas if ctx.stage > 0 else 1),  # each replica tiles it once
        after_zero_grad == full_staging * 4,
        after_zeroing == expected_grad,
    ]
    ctx.record_checks(labels, checks)


def offload_state_bytes(ctx: Context) -> None:
    """Offload holds the fp32 master and gradient shards in host memory, one
    of each, and a step with one backward lands the reduced shard directly in
    the accumulator (no host landing buffer)."""
    model = Net()
    model, opt = ctx.wrap(model, adamw(model), **OFFLOAD)
    mlp_loss(ctx, model, 0).backward()
    opt.step()
    ctx.record_params("after step", model)
    labels = ["host bytes: one fp32 master and one fp32 gradient shard", "no landing buffer",
              "optimizer state on the host shard only", "AdamW runs zero_ext's C++ kernel"]
    if ctx.reference:
        ctx.record_checks(labels)
        return
    stats = model._zero_ext.core.stats()
    padded = sum(model._zero_ext.core.bucket_layout()[2::3])
    shard = padded if ctx.stage == 0 else padded // ctx.shard_size  # stage 0: replicated
    state_elems = sum(t.numel() for st in opt.state.values() for k, t in st.items() if k != "step")
    opt_elems = sum(p.numel() for g in opt.param_groups for p in g["params"])
    checks = [
        stats["host_bytes"] == 2 * 4 * shard and stats["master_bytes"] == 4 * shard,
        stats["host_landing_buffers"] == 0,
        state_elems == 2 * opt_elems and all(t.device.type == "cpu" for st in opt.state.values() for t in st.values()),
        opt._zero_ext_cpu_adam,
    ]
    ctx.record_checks(labels, checks)


def _blocks(ctx: Context, steps: int = 3, build=None, **forward_kwargs_by_step) -> None:
    model = build() if build else Blocks()
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(steps):
        kwargs = {k: v(step) for k, v in forward_kwargs_by_step.items()}
        token_loss(ctx, model, step, **kwargs).backward()
        step_and_record(ctx, model, opt, step)


class InitBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ff = nn.Linear(DIM, 2 * DIM)
        self.out = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.out(torch.tanh(self.ff(self.norm(h))))


class InitBlocks(nn.Module):
    """Initialized by its modules' own reset_parameters() (no custom init),
    with a tied output layer and a buffer: what deferred initialization
    must reproduce from the seed."""

    SCALE = torch.linspace(0.5, 1.5, DIM)

    def __init__(self, n_blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(InitBlock() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))  # meta under torch.device("meta")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def built_deferred_or_not(ctx: Context, seed: int, build=InitBlocks) -> nn.Module:
    """The reference constructs the model normally from `seed`; zero_ext
    builds it under zero_ext.empty_init() and wrap() initializes it from the
    same seed."""
    if ctx.reference:
        torch.manual_seed(seed)
        return build()
    with zero_ext.empty_init():
        model = build()
    torch.manual_seed(seed)
    return model


def deferred_init_then_training(ctx: Context) -> None:
    """Deferred initialization gives the normally constructed values on every
    rank, and training from them matches the reference."""
    model = built_deferred_or_not(ctx, seed=11)
    model, opt = ctx.wrap(model, adamw(model))
    ctx.record_params("after wrap", model)
    for step in range(3):
        token_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)


def tied_embedding_default_units(ctx: Context) -> None:
    _blocks(ctx)


def block_called_twice_per_forward(ctx: Context) -> None:
    _blocks(ctx, plan=lambda step: [0, 1, 1, 2])


def block_skipped_on_some_steps(ctx: Context) -> None:
    _blocks(ctx, plan=lambda step: [0, 2] if step == 1 else [0, 1, 2])


def frozen_block(ctx: Context) -> None:
    def build():
        model = Blocks()
        model.blocks[1].requires_grad_(False)
        return model
    _blocks(ctx, build=build)


def checkpoint_each_block_reentrant(ctx: Context) -> None:
    _blocks(ctx, checkpointing=lambda step: "reentrant")


def checkpoint_each_block_nonreentrant(ctx: Context) -> None:
    _blocks(ctx, checkpointing=lambda step: "non-reentrant")


def _units_gathered(ctx: Context, build, checkpointing=None) -> None:
    """Stage 3: while a block computes, forward or backward, at most itself,
    the root and the prefetched neighbour are gathered; stages 2-3 hold at
    most a few buckets of full gradients during backward."""
    model = build()
    model, opt = ctx.wrap(model, adamw(model))
    grad_bytes = []
    if not ctx.reference:
        stats = model._zero_ext.core.stats
        for block in model.blocks:  # sees the state as the block's backward starts
            block.register_full_backward_pre_hook(lambda mod, grad: grad_bytes.append(stats()["grad_bytes"]))
    for step in range(2):
        with ctx.no_sync(model):  # accumulation steps release units too
            token_loss(ctx, model, step + 10, checkpointing=checkpointing).backward()
        token_loss(ctx, model, step, checkpointing=checkpointing).backward()
        step_and_record(ctx, model, opt, step)
    peaks = (0, 0) if ctx.reference else (stats()["peak_gathered_units_forward"],
                                          stats()["peak_gathered_units_backward"])
    stage3 = ctx.stage == 3 and not ctx.reference
    # root + the block computing + the one prefetched (prefetch=1)
    ctx.record_check("forward: block, root and prefetched block gathered at most", not stage3 or peaks[0] == 3)
    ctx.record_check("backward: block, root and prefetched block gathered at most", not stage3 or peaks[1] == 3)
    # Reductions are retired during backward only once complete (never waited
    # for in a hook), so the bound is exact only with no communication.
    if not ctx.reference and ctx.stage >= 2 and ctx.world == 1:
        layout = model._zero_ext.core.bucket_layout()
        biggest = max(layout[2::3]) * 4
        accum = sum(layout[2::3]) // ctx.world * 4
        ctx.record_check("backward: full gradients of at most 3 buckets alive",
                         max(grad_bytes) <= accum + 3 * biggest)
    else:
        ctx.record_check("backward: full gradients of at most 3 buckets alive", True)


def units_gathered_during_forward_and_backward(ctx: Context) -> None:
    _units_gathered(ctx, lambda: Blocks(n_blocks=6))


def units_gathered_with_frozen_biases(ctx: Context) -> None:
    """LoRA-like: a frozen parameter in every block must not keep blocks gathered."""
    def build():
        model = Blocks(n_blocks=6)
        for block in model.blocks:
            block.ff.bias.requires_grad_(False)
        return model
    _units_gathered(ctx, build)


def units_gathered_with_reentrant_checkpoints(ctx: Context) -> None:
    _units_gathered(ctx, lambda: Blocks(n_blocks=6), checkpointing="reentrant")


def units_gathered_with_nonreentrant_checkpoints(ctx: Context) -> None:
    """The recompute's graph is never backpropagated: its uses must not keep
    the units gathered."""
    _units_gathered(ctx, lambda: Blocks(n_blocks=6), checkpointing="non-reentrant")


def dataclass_inputs_with_frozen_weights(ctx: Context) -> None:
    """LoRA-like blocks whose input is a dataclass: the frozen weight is read
    after the trainable ones got their gradients, so the unit must stay
    gathered until the gradient of its (dataclass-wrapped) input is done."""
    def build():
        model = DataclassBlocks()
        for block in model.blocks:
            block.ff.weight.requires_grad_(False)
        return model
    _blocks(ctx, build=build)


class _SyncInBackward(torch.autograd.Function):
    """Identity whose backward runs a collective of the user's own (a metric
    all-reduce, a tensor-parallel layer): zero_ext must not block a hook
    waiting for a peer that is stuck in it."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(torch.ones(1))
        return grad


class SyncNet(Net):
    """Net with a user collective in the middle of its backward."""

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = _SyncInBackward.apply(torch.tanh(self.mid(torch.tanh(self.inp(x)))))
        y = self.out(h)
        return y + self.branch(h) if use_branch else y


def user_collective_in_backward_with_rank_dependent_layer(ctx: Context) -> None:
    # The reference runs the collective once per rank it plays, on every rank.
    _mlp_training(ctx, SyncNet(branch=True), sgd, steps=2, branch_on_rank0=True)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a straggler rank."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class DeepNet(nn.Module):
    """Eight layers, one gradient bucket each at BUCKET_MB."""

    def __init__(self, slow_seconds: float = 0.0):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.inp = nn.Linear(IN, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(6))
        self.out = nn.Linear(HIDDEN, OUT)
        self.slow_seconds = slow_seconds
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
            if self.slow_seconds:
                h = _SlowBackward.apply(h, self.slow_seconds)
        return self.out(h)


def straggler_rank_bounds_reductions_in_flight(ctx: Context) -> None:
    """Rank 1 is slow in backward, so rank 0 launches every bucket's
    reduction long before any can complete. Stages 2-3 must still hold no
    more than the in-flight bound of staging (plus the bucket filling), not
    the whole model's gradient, and never lift the bound for a peer that is
    merely slow. Stage 1 keeps its whole staging; over gloo its exchanges'
    receive buffers and outputs are bounded the same way, not one per
    bucket on top of it."""
    model = DeepNet(slow_seconds=0.03 if not ctx.reference and ctx.rank == 1 else 0.0)
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(3):
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)
    labels = ["peak staging within the in-flight bound plus a bucket launching and one filling",
              "bound never lifted"]
    if ctx.reference:
        ctx.record_checks(labels)
        return
    core = model._zero_ext.core
    stats = core.stats()
    largest = max(core.bucket_layout()[2::3]) * 4
    # The bound is enforced after each launch, so the bucket being launched
    # (in flight with its output and, over gloo, the exchange's receive
    # buffer: half the bound, which is two of the largest in flight) and one
    # filling (stage 3: the next unit's) come on top of it.
    persistent = sum(core.bucket_layout()[2::3]) * 4 if ctx.stage == 1 else 0  # stage 1: every bucket, padded
    ctx.record_checks(labels, [stats["peak_staging_bytes"] - persistent
                               <= 1.5 * stats["max_in_flight_bytes"] + (largest if ctx.stage > 1 else 0),
                               stats["bound_lifts"] == 0])


straggler_rank_bounds_reductions_in_flight.stages = (1, 2, 3)


def ranks_reach_wrap_seconds_apart(ctx: Context) -> None:
    """Rank 0 reaches wrap() 2.5 s after the others (loading weights alone,
    say), within its timeout of 10 s: the others wait for it at wrap()
    ([Note: arrival at wrap]) and train as one process does."""
    if not ctx.reference and ctx.rank == 0 and ctx.world > 1:
        time.sleep(2.5)
    model = Net()
    model, opt = ctx.wrap(model, sgd(model), timeout=10.0)
    for step in range(2):
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)


ranks_reach_wrap_seconds_apart.stages = (2,)  # the wait at wrap() is the same for every stage
ranks_reach_wrap_seconds_apart.flat_only = True  # and for every mesh


def one_rank_group_reduces_locally(ctx: Context) -> None:
    """Alone in its group (world size 1 under torch.distributed), a rank
    sends nothing: its reductions and gathers are local copies, and stages
    1-3 stage a backward's gradients straight into their empty accumulators
    (no staging buffer); stage 3 keeps one copy of the parameters, its
    shard being the whole buffer, so a gather allocates and copies nothing.
    Over more ranks the same model issues its collectives and stages as
    before. Then gradient accumulation over two backwards (the second stages
    apart, as it adds), exact."""
    model = DeepNet()
    model, opt = ctx.wrap(model, adamw(model))
    peak_staging, in_forward = 0, []
    if not ctx.reference:
        core = model._zero_ext.core
        model.layers[2].register_forward_hook(lambda *_: in_forward.append(core.stats()["param_bytes"]))
    for step in range(4):
        mlp_loss(ctx, model, step).backward()
        if step == 1 and not ctx.reference:
            peak_staging = model._zero_ext.core.stats()["peak_staging_bytes"]
        if step >= 2:
            mlp_loss(ctx, model, step, salt=1).backward()
        step_and_record(ctx, model, opt, step)
    labels = ["collectives only over more than one rank", "staging buffers only over more than one rank",
              "alone, one copy of the parameters during forward"]
    if ctx.reference:
        ctx.record_checks(labels)
        return
    stats = model._zero_ext.core.stats()
    alone = ctx.world == 1
    sharded = ctx.stage >= 1
    whole_bytes = sum(model._zero_ext.core.bucket_layout()[2::3]) * 4  # every bucket, padded, fp32
    ctx.record_checks(labels, [(stats["collectives"] + stats["all_gathers"] == 0) == alone,
                               not sharded or (peak_staging == 0) == alone,
                               not alone or set(in_forward) == {whole_bytes}])


class GatedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, gated: bool) -> torch.Tensor:
        update = torch.tanh(self.ff(h))
        return h + (update * torch.sigmoid(self.gate(h)) if gated else update)


class GatedNet(nn.Module):
    """Blocks (stage 3's default units), the second to last of which uses
    its gate on rank 0 only: that unit's bucket misses a gradient on the
    other ranks while the backward still gathers four units after it."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(6))
        self.out = nn.Linear(DIM, OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = block(h, gated=i != 4 or rank == 0)
        return self.out(h)


def issue_order_same_on_every_rank(ctx: Context) -> None:
    """[Note: issue order] in csrc/grad_reducer.cpp: with a parameter used on
    rank 0 only, every rank still issues its gathers and reductions (two
    groups) in the same order, and no gradient counts as late."""
    model = GatedNet()
    model, opt = ctx.wrap(model, adamw(model))
    if not ctx.reference:
        model._zero_ext.core.log_issues(True)
    for step in range(2):
        loss = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world)
            loss = loss + w * F.mse_loss(model(x, rank=r), y)
        loss.backward()
        step_and_record(ctx, model, opt, step)
    labels = ["the same collectives in the same order on every rank", "no late gradient round"]
    if ctx.reference:
        ctx.record_checks(labels)
        return
    log = model._zero_ext.core.take_issue_log()
    if ctx.mesh is not None:
        # Hybrid on gloo: a replica all-reduce is issued once its reduction
        # within the row is seen done, a moment that differs between ranks;
        # each group's own sequence is what must match (NCCL issues it at
        # once after the row's, in launch order).
        log = [e for e in log if not e.startswith("replicate")] + [e for e in log if e.startswith("replicate")]
    logs = [None] * ctx.world
    if ctx.world > 1:
        torch.distributed.all_gather_object(logs, log)
    else:
        logs = [log]
    ctx.record_checks(labels, [all(other == logs[0] for other in logs) and (len(log) > 0 or ctx.world == 1),
                               model._zero_ext.core.stats()["late_rounds"] == 0])


def dataclass_outputs(ctx: Context) -> None:
    _blocks(ctx, build=DataclassBlocks)


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


def zero_grad_keeping_zeros(ctx: Context) -> None:
    """zero_grad(set_to_none=False): gradients become zeros, not None, so
    AdamW keeps stepping them (weight decay), exactly as PyTorch; a frozen
    block stays untouched and a skipped block keeps its zero gradient."""
    def build():
        model = Blocks()
        model.blocks[0].requires_grad_(False)
        return model
    model = build()
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(3):
        token_loss(ctx, model, step, plan=[0, 1] if step == 1 else [0, 1, 2]).backward()
        ctx.record_grads(f"step {step}", model)
        opt.step()
        opt.zero_grad(set_to_none=False)
        ctx.record_params(f"step {step}", model)


class MasterWeightReference:
    """Plain PyTorch mixed precision, the arithmetic zero_ext's must equal:
    parameters in the compute dtype, fp32 masters stepped by the optimizer
    from the low-precision gradients (divided by the loss scale the loss was
    multiplied by), parameters re-cast after each step; `step(grads)` steps
    from the fp32 gradients given instead (ReferenceReduction's)."""

    def __init__(self, model: nn.Module, make_optimizer, dtype: torch.dtype = torch.bfloat16,
                 loss_scale: float = 1.0):
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        self.loss_scale = loss_scale
        with torch.no_grad():
            for p in self.params:
                p.data = p.data.to(dtype)
        self.opt = make_optimizer(self.masters)

    def step(self, grads: Optional[List[Optional[torch.Tensor]]] = None) -> None:
        if grads is None:
            grads = [None if p.grad is None else p.grad.float() / self.loss_scale for p in self.params]
        for m, g in zip(self.masters, grads):
            m.grad = g
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


@dataclasses.dataclass
class ReducedSum:
    """A reference gradient that is a sum of low-precision terms, as zero_ext
    must reduce it: `value`, their exact sum (fp32), and `bound`, elementwise,
    the most any order of adding them in the compute dtype or finer may move
    it. compare() takes got within `bound` (besides its label's rtol and
    atol) of `value`.

    With m terms t_i, S = sum |t_i| and u the compute dtype's unit roundoff
    (half an ulp relative: 2**-8 for bf16, 2**-11 for fp16), any sum of them
    by m - 1 additions, each rounded to a precision of u or finer, lies within
    gamma(m - 1) * S of the exact sum, gamma(n) = n*u / (1 - n*u) (Higham,
    Accuracy and Stability of Numerical Algorithms, 4.2): each addition
    rounds its result by at most u times itself (a subnormal result adds
    exactly), and no partial sum exceeds S(1+u)**k. A bound relative to the
    sum itself cannot hold: where the terms cancel, S is many times |sum|.
    zero_ext adds the same terms (each rank's, from the same compute-dtype
    parameters and kernels, divided by a power-of-two world size: exactly) by
    m - 1 additions in the compute dtype, the reduction dtype or its fp32
    accumulator. The bound is what one backward's rounding may do; after a
    step, the two runs' parameters may differ too (their label's rtol and
    atol cover that)."""
    value: torch.Tensor
    bound: torch.Tensor


UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def summation_bound(terms: int, unit_roundoff: float) -> float:
    """gamma(terms - 1): the most rounding moves a sum of `terms` terms, per unit of sum |term|."""
    n = max(terms - 1, 0)
    assert n * unit_roundoff < 1
    return n * unit_roundoff / (1 - n * unit_roundoff)


class ReferenceReduction:
    """The reference's gradients, reduced as zero_ext reduces them.

    Every gradient term autograd adds into a parameter's .grad (one per use
    of the parameter in each rank's forward) is caught by a hook on the graph
    node that sends it; since the last zero_grad, their exact sum (in fp64,
    whose rounding, 2**-53 of their magnitudes per addition, is negligible),
    the sum of their magnitudes and their count give each recorded gradient
    (ReducedSum). The optimizer steps from what the reduction gives: in fp32,
    the exact sum (to fp32 rounding, as zero_ext's); in the compute dtype,
    each backward's terms summed in it (autograd's own sum, in its order),
    accumulated in fp32 over the backward calls. The parameters' .grad is
    cleared after each backward, so that autograd sums one backward's terms."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, reduce_dtype: torch.dtype, scale: float):
        self.named = list(model.named_parameters())
        self.names = {id(p): n for n, p in self.named}
        self.dtype, self.scale = dtype, scale
        self.in_compute_dtype = reduce_dtype == dtype
        self.clear()

    def clear(self) -> None:
        self.total: Dict[str, torch.Tensor] = {}
        self.magnitude: Dict[str, torch.Tensor] = {}
        self.count: Dict[str, int] = {}
        self.reduced: Dict[str, torch.Tensor] = {}

    def watch(self, loss: torch.Tensor) -> None:
        """Hooks every node of `loss`'s graph that sends a gradient to a parameter."""
        self.backward = ({}, {}, {})  # this backward's total, magnitude, count
        seen, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            into = [(i, self.names[id(nxt.variable)]) for i, (nxt, _) in enumerate(node.next_functions)
                    if nxt is not None and id(getattr(nxt, "variable", None)) in self.names]
            if into:
                node.register_hook(functools.partial(self._add, into))
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    def _add(self, into, grad_inputs, grad_outputs) -> None:
        total, magnitude, count = self.backward
        for i, name in into:
            if grad_inputs[i] is None:
                continue
            term = grad_inputs[i].to(self.dtype).double()  # autograd casts it to the parameter's dtype too
            total[name] = total.get(name, 0.0) + term
            magnitude[name] = magnitude.get(name, 0.0) + term.abs()
            count[name] = count.get(name, 0) + 1

    def backward_done(self) -> None:
        """Takes this backward's terms and autograd's sum of them; clears .grad."""
        total, magnitude, count = self.backward
        for name, p in self.named:
            assert (p.grad is None) == (name not in count), f"{name}: .grad and the terms seen disagree"
            if p.grad is None:
                continue
            # autograd's order is one of those the bound holds for: beyond
            # it, a term was missed or the derivation is wrong.
            bound = summation_bound(count[name], UNIT_ROUNDOFF[self.dtype]) * magnitude[name]
            assert bool(((p.grad.double() - total[name]).abs() <= bound).all()), \
                f"{name}: autograd's sum is beyond the rounding bound of its terms' exact sum"
            if self.in_compute_dtype:  # an fp32 accumulator
                self.reduced[name] = self.reduced.get(name, 0.0) + p.grad.float() / self.scale
            self.total[name] = self.total.get(name, 0.0) + total[name]
            self.magnitude[name] = self.magnitude.get(name, 0.0) + magnitude[name]
            self.count[name] = self.count.get(name, 0) + count[name]
            p.grad = None

    def recorded(self) -> Dict[str, Optional[ReducedSum]]:
        """Each parameter's gradient since the last clear(), divided by the loss
        scale (a power of two: exactly), as compare() takes it."""
        u = UNIT_ROUNDOFF[self.dtype]
        return {n: ReducedSum(value=(self.total[n] / self.scale).float(),
                              bound=(summation_bound(self.count[n], u) * self.magnitude[n] / self.scale).float())
                if n in self.count else None for n, _ in self.named}

    def step_grads(self) -> List[Optional[torch.Tensor]]:
        """What the optimizer steps from: the reduced gradients in fp32, divided by the loss scale."""
        if self.in_compute_dtype:
            return [self.reduced.get(n) for n, _ in self.named]
        return [(self.total[n] / self.scale).float() if n in self.count else None for n, _ in self.named]


# Significant bits of each floating dtype (the implicit leading bit included).
SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def fits_in_bits(t: torch.Tensor, bits: int) -> bool:
    """Whether every element of `t` has at most `bits` significant bits, as
    a value of a dtype with that many does (whatever that dtype's range)."""
    mantissa, _ = torch.frexp(t.double())  # t = mantissa * 2**e, 0.5 <= |mantissa| < 1
    scaled = torch.ldexp(mantissa, torch.tensor(bits))
    return torch.equal(scaled, scaled.round())


def reduced_in(grads: Dict[str, Optional[torch.Tensor]], reduce_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether the ranks' `dtype` gradients of one backward (after zero_grad)
    were summed in `reduce_dtype`. A sum rounded to bf16 or fp16 last holds
    only that dtype's values (the world sizes here divide exactly; fp16's
    loss scale, a power of two, too). Summed in fp32, some of hundreds of
    sums of unrelated terms need more bits than the terms have."""
    reduced = [g for g in grads.values() if g is not None]
    if reduce_dtype != torch.float32:
        return all(fits_in_bits(g, SIGNIFICANT_BITS[reduce_dtype]) for g in reduced)
    return not all(fits_in_bits(g, SIGNIFICANT_BITS[dtype]) for g in reduced)


# Checkpoint label prefixes compared at low-precision tolerances (see compare()).
BF16, FP16 = "[bf16] ", "[fp16] "
LOW_PRECISION_LABEL = {torch.bfloat16: BF16, torch.float16: FP16}
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
            ok_scale = model._zero_ext.core.loss_scale() == scale  # no step was skipped
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
    core = state.core
    stats = core.stats()
    layout = core.bucket_layout()  # (first, count, padded) per bucket
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
    core = model._zero_ext.core
    armed = {"on": False}
    _inf_on_rank0(ctx, model.out.bias, armed)
    loss = _mlp_mixed_loss(ctx, torch.float16)
    results = {}
    for step in range(4):
        armed["on"] = step == 1
        loss(model, step, 0).backward()
        before = zero_ext.full_state_dict(model)
        if step == 1:
            results["found"] = core.found_nonfinite()
            results["local"] = any(not torch.isfinite(p.grad).all()
                                   for g in opt.param_groups for p in g["params"] if p.grad is not None)
        opt.step()
        opt.zero_grad()
        after = zero_ext.full_state_dict(model)
        same = all(torch.equal(before[k], after[k]) for k in before)
        results[step] = (same, core.loss_scale())
    checks = [results[1][0], results[1][1] == 2.0 ** 9, results["found"], results["local"],
              not results[2][0] and not results[3][0], results[2][1] == 2.0 ** 9 and results[3][1] == 2.0 ** 10,
              core.stats()["skipped_steps"] == 1]
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
    checks = [model._zero_ext.core.loss_scale() == 1.0,
              any("GradScaler drives this optimizer" in str(w.message) for w in caught),
              all(torch.isfinite(full[n]).all() and not torch.equal(full[n], initial[n]) for n in initial)]
    ctx.record_checks(labels, checks)


class FeatureBlock(nn.Module):
    """A block with a second entry point (a ViT's forward_features) that its
    forward also calls, then uses a parameter after it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc3(self.forward_features(h))

    def forward_features(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(h)))


class WithFeatureMethods(nn.Module):
    """Methods besides forward: `features` (reads the root's own layer and
    calls one block's forward_features directly) and `generate` (calls the
    model's forward in a loop, under no_grad)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.inp = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([FeatureBlock() for _ in range(3)])
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(self.blocks[1].forward_features(h) + self.blocks[0](h))

    def generate(self, x: torch.Tensor, steps: int = 3) -> torch.Tensor:
        outs = []
        for _ in range(steps):
            y = self(x)
            outs.append(y)
            x = torch.cat([y, y], dim=-1)[:, :IN]
        return torch.stack(outs)


def registered_forward_methods(ctx: Context) -> None:
    """zero_ext.register_forward_method on the model (features, generate) and
    on each block (forward_features, also called from the block's own
    forward): trained through both entry points, and generate's outputs, as
    in one process. At stage 3 each block is a unit of the default policy."""
    model = WithFeatureMethods()
    model, opt = ctx.wrap(model, adamw(model))
    if not ctx.reference:
        zero_ext.register_forward_method(model, "features")
        zero_ext.register_forward_method(model, "generate")
        for block in model.blocks:
            zero_ext.register_forward_method(block, "forward_features")
    for step in range(3):
        total = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world)
            total = total + w * (F.mse_loss(model(x), y) + F.mse_loss(model.features(x), y))
        total.backward()
        step_and_record(ctx, model, opt, step)
        with torch.no_grad():
            x, _ = batch(50 + step, 0, 1)
            ctx.record_value(f"step {step}: generate", model.generate(x).sum())


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
        return 0 if ctx.reference else model._zero_ext.core.stats()["frozen_skips"]

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


# The Blocks scenarios that suites of other stage 3 settings (merged units,
# units kept gathered after forward) run again.
STAGE3_BLOCKS_SCENARIOS = [
    tied_embedding_default_units,
    block_called_twice_per_forward,
    block_skipped_on_some_steps,
    frozen_block,
    checkpoint_each_block_reentrant,
    checkpoint_each_block_nonreentrant,
    dataclass_outputs,
    dataclass_inputs_with_frozen_weights,
    zero_grad_keeping_zeros,
    full_params_read_ema_and_writeback,
    nonscalar_backward_retained_twice,
]


SCENARIOS: Dict[str, Callable[[Context], None]] = {
    f.__name__: f
    for f in [
        scalar_loss_outside_model,
        loss_inside_model_adamw,
        nonscalar_backward,
        autograd_backward_list,
        three_models_one_loss,
        retain_graph_two_losses,
        retain_graph_zero_grad_between,
        nonscalar_backward_retained_twice,
        four_backward_per_step,
        varying_backward_per_step,
        no_sync_accumulation,
        ddp_require_backward_grad_sync,
        replica_all_reduce_deferred_in_accumulation,
        replica_all_reduce_deferred_until_read,
        offload_replica_all_reduce_deferred_in_accumulation,
        step_with_closure,
        nvme_accumulation_no_sync_clip_adamw,
        nvme_retain_graph_momentum_sgd,
        nvme_checkpoints_across_offload_settings,
        unused_parameters,
        branch_on_rank0_only,
        frozen_parameters,
        param_groups_and_scheduler,
        clip_grad_norm,
        autograd_grad_is_side_effect_free,
        checkpoint_reentrant_param_used_twice,
        checkpoint_nonreentrant_param_used_twice,
        late_gradients_accumulate_over_backwards,
        full_state_dict_round_trip,
        state_bytes_match_the_stage,
        tied_embedding_default_units,
        deferred_init_then_training,
        block_called_twice_per_forward,
        block_skipped_on_some_steps,
        frozen_block,
        checkpoint_each_block_reentrant,
        checkpoint_each_block_nonreentrant,
        units_gathered_during_forward_and_backward,
        units_gathered_with_frozen_biases,
        units_gathered_with_reentrant_checkpoints,
        dataclass_outputs,
        units_gathered_with_nonreentrant_checkpoints,
        dataclass_inputs_with_frozen_weights,
        user_collective_in_backward_with_rank_dependent_layer,
        straggler_rank_bounds_reductions_in_flight,
        ranks_reach_wrap_seconds_apart,
        one_rank_group_reduces_locally,
        issue_order_same_on_every_rank,
        *MIXED_PRECISION_SCENARIOS,
        fp16_output_on_another_outputs_path,
        fp16_model_applied_to_its_own_output,
        offload_four_backward_per_step_adamw,
        offload_varying_backward_per_step_sgd,
        offload_no_sync_accumulation,
        offload_adam_param_groups_amsgrad_scheduler,
        offload_state_bytes,
        fp16_overflow_skips_the_step_on_every_rank,
        grad_scaler_sees_overflow_on_every_rank,
        fp16_hands_scaling_to_a_grad_scaler,
        two_models_rank_dependent_branch,
        zero_grad_keeping_zeros,
        zero_ext_clip_grad_norm_over_model_parameters,
        zero_ext_clip_grad_norm_over_the_optimizer_tensors,
        parameter_listed_twice_in_a_group,
        graph_from_before_the_step_raises,
        full_params_read_ema_and_writeback,
        registered_forward_methods,
        parallel_lists_lora,
        parallel_lists_lora_listed_units,
        frozen_and_unfrozen_after_wrap,
        frozen_after_wrap_offloaded,
        frozen_after_wrap_saved_and_loaded,
        grouped_and_container_units,
        tied_weights_in_a_group_unit,
        gradient_divide_factor,
        frozen_at_wrap_unfrozen_later,
        output_dtype_cast,
        frozen_buckets_skip_their_reduction,
    ]
}
STAGES = (0, 1, 2, 3)
RTOL, ATOL = 1e-5, 1e-6
# [bf16] and [fp16] labels: low-precision training (8 and 11 significant
# bits). Where the reference records a gradient as a ReducedSum (the
# mixed-precision scenarios here), the rounding of its reduction, in any
# order, is the ReducedSum's own bound, derived from its terms; these rtol
# and atol cover the rest: what that rounding changes later (masters
# stepped from gradients that differ by it, compute-dtype parameters
# rounded from the masters to neighbours, the gradients those give); in
# suites whose references record autograd's own sum of the ranks' gradients
# in the compute dtype (whole-parameter optimizers, frozen mixed precision),
# that sum's rounding too. tests/test_tolerances.py perturbs the references so.
BF16_RTOL, BF16_ATOL = 2e-2, 2e-3
FP16_RTOL, FP16_ATOL = 1e-2, 1e-3
# A value computed in fp32 and then cast to bf16 (output_dtype_cast's
# output): fp32 values that differ by rounding alone cast to the same bf16
# value or to neighbours one bf16 ulp apart, and with 8 significant bits an
# ulp is at most 2**-7 of the value; ATOL covers fp32 noise around zero.
BF16_ROUNDED = "[bf16-rounded] "
BF16_ROUNDED_RTOL, BF16_ROUNDED_ATOL = 2.0 ** -7, ATOL
# (rtol, atol) by checkpoint label prefix; other labels compare at RTOL, ATOL.
TOLERANCES: Dict[str, Tuple[float, float]] = {
    BF16: (BF16_RTOL, BF16_ATOL), FP16: (FP16_RTOL, FP16_ATOL), BF16_ROUNDED: (BF16_ROUNDED_RTOL, BF16_ROUNDED_ATOL)}


def stages_of(name: str):
    return getattr(SCENARIOS[name], "stages", STAGES)


def tolerance_of(label: str, tolerances: Dict[str, Tuple[float, float]]) -> Tuple[float, float]:
    return next((tol for prefix, tol in tolerances.items() if label.startswith(prefix)), (RTOL, ATOL))


def within(got: torch.Tensor, want: torch.Tensor, rtol: float, atol) -> bool:
    """|got - want| <= atol + rtol * |want| elementwise (atol a number or a tensor); NaN never is."""
    return bool(((got - want).abs() <= atol + rtol * want.abs()).all())


def compare(ref, got, tolerances: Optional[Dict[str, Tuple[float, float]]] = None) -> Optional[str]:
    """First mismatch between two checkpoint lists, or None. Lists that
    compare nothing are refused as a mismatch: a scenario that recorded
    nothing (or only Nones) would otherwise pass whatever zero_ext did.
    A reference value recorded as a ReducedSum allows its bound besides
    the label's rtol and atol.
    `tolerances`: more label prefixes and their (rtol, atol), beside TOLERANCES."""
    tolerances = {**TOLERANCES, **(tolerances or {})}
    if not ref or not got:
        return (f"nothing to compare: {len(got)} checkpoints, reference has {len(ref)} "
                f"(every scenario must record at least one)")
    if len(ref) != len(got):
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a[0] != b[0]), min(len(ref), len(got)))
        return (f"{len(got)} checkpoints, reference has {len(ref)}; first difference at #{first}: "
                f"{got[first][0] if first < len(got) else 'none'!r} vs reference "
                f"{ref[first][0] if first < len(ref) else 'none'!r}")
    compared = 0
    for (label, want), (label2, have) in zip(ref, got):
        if label != label2:
            return f"checkpoint {label2!r} where the reference has {label!r}"
        if not want:
            return f"{label}: recorded no values"
        if set(want) != set(have):
            return f"{label}: keys {sorted(have)} != reference {sorted(want)}"
        for key in want:
            a, b = want[key], have[key]
            bound = None
            if isinstance(a, ReducedSum):  # the exact sum, and what rounding may move it by
                a, bound = a.value, a.bound
            if isinstance(b, ReducedSum):  # another reference's
                b = b.value
            if a is None or b is None:
                if a is not None or b is not None:
                    return f"{label} [{key}]: got {'None' if b is None else 'a tensor'}, reference {'None' if a is None else 'a tensor'}"
                continue
            compared += 1
            if a.dtype == torch.bool:
                if not bool(b):
                    return f"{label}: check failed"
                continue
            rtol, atol = tolerance_of(label, tolerances)
            if a.shape != b.shape or not (torch.allclose(b.float(), a.float(), rtol=rtol, atol=atol) if bound is None
                                          else within(b.float(), a.float(), rtol, atol + bound)):
                diff = (b.float() - a.float()).abs().max().item() if a.shape == b.shape else "shape"
                return f"{label} [{key}]: max abs diff {diff}"
    if not compared:
        return f"nothing compared: all {len(ref)} checkpoints hold only None (no gradients or values recorded)"
    return None


_REFERENCES: Dict[Tuple[str, int], list] = {}


_MESHES: Dict[Tuple[int, int], object] = {}


def device_mesh(replicas: int, shard_size: int):
    """The (replicate, shard) CPU mesh over every rank, made once per process."""
    if (replicas, shard_size) not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh
        _MESHES[(replicas, shard_size)] = init_device_mesh(
            "cpu", (replicas, shard_size), mesh_dim_names=("replicate", "shard"))
    return _MESHES[(replicas, shard_size)]


def run_one(rank: int, world: int, item: str) -> Optional[str]:
    """Entry point on each rank for one "scenario/stageN" (or
    "scenario/stageN/meshRxS", hybrid sharding over an R x S mesh): None, or
    the first mismatch against the single-process reference (computed once
    per scenario)."""
    if item.startswith("compression:"):  # quantized collectives (compression_scenarios.py), worlds 2 and 4
        import compression_scenarios
        return compression_scenarios.run_one(item, device_mesh)
    if "/tp" in item:  # tensor parallel (tensor_parallel_scenarios.py), in the world-4 group
        import tensor_parallel_scenarios
        return tensor_parallel_scenarios.run_one(item, compare)
    name, rest = item.rsplit("/stage", 1)
    stage, _, mesh_name = rest.partition("/mesh")
    mesh = None
    if mesh_name:
        replicas, shard_size = (int(v) for v in mesh_name.split("x"))
        assert replicas * shard_size == world, f"{item} needs world size {replicas * shard_size}"
        mesh = device_mesh(replicas, shard_size)
    if (name, world) not in _REFERENCES:
        ref_ctx = Context(stage=0, rank=rank, world=world, reference=True)
        SCENARIOS[name](ref_ctx)
        _REFERENCES[(name, world)] = ref_ctx.checkpoints
    ctx = Context(stage=int(stage), rank=rank, world=world, reference=False, mesh=mesh)
    SCENARIOS[name](ctx)
    return compare(_REFERENCES[(name, world)], ctx.checkpoints)


def all_items(names: Optional[List[str]] = None, mesh: str = "") -> List[str]:
    """Items of the named scenarios (all by default); `mesh`: "RxS" runs them hybrid."""
    suffix = f"/mesh{mesh}" if mesh else ""
    return [f"{name}/stage{stage}{suffix}" for name in SCENARIOS if not names or name in names
            if not (mesh and getattr(SCENARIOS[name], "flat_only", False)) for stage in stages_of(name)]
