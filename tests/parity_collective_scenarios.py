"""Parity scenarios of the ranks' collectives: a user collective inside
backward, a straggler rank (the reductions in flight stay bounded), ranks
reaching wrap() seconds apart, a rank alone in its group, and one issue
order on every rank when a parameter is used on rank 0 only."""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from parity_models import (
    Context, DIM, HIDDEN, IN, Net, OUT, _mlp_training, adamw, batch, mlp_loss, sgd, step_and_record)


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
    core = model._zero_ext.handles
    stats = core.diagnostics.stats()
    largest = max(core.reduction.bucket_layout()[2::3]) * 4
    # The bound is enforced after each launch, so the bucket being launched
    # (in flight with its output and, over gloo, the exchange's receive
    # buffer: half the bound, which is two of the largest in flight) and one
    # filling (stage 3: the next unit's) come on top of it.
    persistent = sum(core.reduction.bucket_layout()[2::3]) * 4 if ctx.stage == 1 else 0  # stage 1: every bucket, padded
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
        core = model._zero_ext.handles
        model.layers[2].register_forward_hook(lambda *_: in_forward.append(core.diagnostics.stats()["param_bytes"]))
    for step in range(4):
        mlp_loss(ctx, model, step).backward()
        if step == 1 and not ctx.reference:
            peak_staging = model._zero_ext.handles.diagnostics.stats()["peak_staging_bytes"]
        if step >= 2:
            mlp_loss(ctx, model, step, salt=1).backward()
        step_and_record(ctx, model, opt, step)
    labels = ["collectives only over more than one rank", "staging buffers only over more than one rank",
              "alone, one copy of the parameters during forward"]
    if ctx.reference:
        ctx.record_checks(labels)
        return
    stats = model._zero_ext.handles.diagnostics.stats()
    alone = ctx.world == 1
    sharded = ctx.stage >= 1
    whole_bytes = sum(model._zero_ext.handles.reduction.bucket_layout()[2::3]) * 4  # every bucket, padded, fp32
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
        model._zero_ext.handles.diagnostics.log_issues(True)
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
    log = model._zero_ext.handles.diagnostics.take_issue_log()
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
                               model._zero_ext.handles.diagnostics.stats()["late_rounds"] == 0])
