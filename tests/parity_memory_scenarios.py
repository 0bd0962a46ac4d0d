"""Parity scenarios that also check memory: the exact bytes a rank holds at
each stage, and the stage 3 units gathered (and the full gradients alive)
while a block computes."""
from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

import zero_ext
from parity_models import Blocks, Context, Net, adamw, mlp_loss, stage1_keeps_full_staging, step_and_record, token_loss


def state_bytes_match_the_stage(ctx: Context) -> None:
    """Exact bytes each rank holds after a step: full parameters; gradients
    full (stage 0), full staging + fp32 shard (1; alone in its group only the
    shard) or only the shard (2);
    AdamW state for this rank's shard only (stages 1-2)."""
    model = Net(branch=True)
    n_elems = sum(p.numel() for p in model.parameters())
    model, opt = ctx.wrap(model, adamw(model))
    before_backward = None if ctx.reference else model._zero_ext.handles.diagnostics.stats()["grad_bytes"]
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
    stats = model._zero_ext.handles.diagnostics.stats()
    padded = sum(model._zero_ext.handles.reduction.bucket_layout()[2::3])
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
    after_zero_grad = model._zero_ext.handles.diagnostics.stats()["grad_bytes"]
    opt.zero_grad(set_to_none=False)
    after_zeroing = model._zero_ext.handles.diagnostics.stats()["grad_bytes"]
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


def _units_gathered(ctx: Context, build, checkpointing=None) -> None:
    """Stage 3: while a block computes, forward or backward, at most itself,
    the root and the prefetched neighbour are gathered; stages 2-3 hold at
    most a few buckets of full gradients during backward."""
    model = build()
    model, opt = ctx.wrap(model, adamw(model))
    grad_bytes = []
    if not ctx.reference:
        stats = model._zero_ext.handles.diagnostics.stats
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
        layout = model._zero_ext.handles.reduction.bucket_layout()
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


class _WideBlocks(torch.nn.Module):
    """Ten blocks of one 512 x 512 layer: each unit's full buffer (1 MiB and
    a bias) comes from the reusable host blocks ([Note: reusable host blocks]
    in csrc/reusable_blocks.h), which serve 1 MiB and more."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh()) for _ in range(10))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _wide_loss(ctx: Context, model, step: int) -> torch.Tensor:
    total = 0.0
    for r, w in ctx.participants():
        g = torch.Generator().manual_seed(900 + step)
        x = torch.randn(ctx.world * 2, 512, generator=g)[r * 2:(r + 1) * 2]
        total = total + w * model(x).square().mean()
    return total


def reusable_host_blocks(ctx: Context) -> None:
    """Stage 3 over more than one rank: a unit's gathers after the first steps
    reuse the blocks its earlier gathers freed (no buffer is mapped and faulted
    in anew per use), and the blocks a gather of every unit took for
    inspection (full_params) are given back within two steps. wrap() and
    load() are not steps: none of the blocks they used stays idle after them."""
    model = _WideBlocks()
    model, opt = ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), bucket_mb=1.0)
    labels = ["steady steps: every gather reuses a block", "an inspection's blocks are given back",
              "no block idle after wrap()", "no block idle after load()"]
    pooled = ctx.stage == 3 and ctx.world > 1 and not ctx.reference
    stats = (lambda: model._zero_ext.handles.diagnostics.stats()) if not ctx.reference else None
    idle_after_wrap = stats()["host_blocks_idle_bytes"] if pooled else 0
    counts = []
    for step in range(6):
        if step == 4 and not ctx.reference:
            with zero_ext.full_params(model):
                if pooled:
                    during = stats()
        if step == 2 and not ctx.reference:  # a save and a load of this very state: training goes on unchanged
            root = [tempfile.mkdtemp(prefix="zero_ext_blocks_") if ctx.rank == 0 else None]
            dist.broadcast_object_list(root, src=0)
            zero_ext.save(os.path.join(root[0], "ck"), model, opt)
            with zero_ext.full_params(model):  # blocks idle before load, as a step's are
                pass
            zero_ext.load(os.path.join(root[0], "ck"), model, opt)
            idle_after_load = stats()["host_blocks_idle_bytes"] if pooled else 0
            dist.barrier()
            if ctx.rank == 0:
                shutil.rmtree(root[0], ignore_errors=True)
        _wide_loss(ctx, model, step).backward()
        opt.step()  # recording the values each step would inspect every unit each step
        opt.zero_grad()
        if pooled:
            counts.append(stats())
    ctx.record_params("after 6 steps", model)
    if not pooled:
        ctx.record_checks(labels, None if ctx.reference else [True] * 4)
        return
    unit_bytes = 4 * (512 * 512 + 512)  # one block's full buffer, at least
    reused = counts[3]["host_blocks_reused"] - counts[1]["host_blocks_reused"]
    gathers = counts[3]["param_gathers"] - counts[1]["param_gathers"]
    kept_during = during["host_blocks_in_use_bytes"] + during["host_blocks_idle_bytes"]
    kept_after = counts[5]["host_blocks_in_use_bytes"] + counts[5]["host_blocks_idle_bytes"]
    ctx.record_checks(labels, [
        gathers > 0 and reused >= gathers,
        # The pool is the process's: blocks other models hold stay as they were, or fewer.
        kept_during - kept_after >= 3 * unit_bytes,
        idle_after_wrap == 0,
        idle_after_load == 0,
    ])
