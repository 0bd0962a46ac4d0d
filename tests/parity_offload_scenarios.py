"""Parity scenarios of optimizer offload, to the host (offload_optimizer=
"cpu": zero_ext's C++ Adam, or the torch optimizer) and to offload files
("nvme"): the same results as in memory; and the host bytes an offloaded
rank holds."""
from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

import zero_ext
from parity_accumulation_scenarios import _accumulate, no_sync_accumulation, replica_all_reduce_deferred_in_accumulation
from parity_models import Context, Net, adamw, mlp_loss, sgd, step_and_record


# Optimizer offload (fp32): the same results as without it. Adam/AdamW run
# zero_ext's C++ kernel on the host shards, others the torch optimizer.
OFFLOAD = {"offload_optimizer": "cpu"}


def offload_replica_all_reduce_deferred_in_accumulation(ctx: Context) -> None:
    replica_all_reduce_deferred_in_accumulation(ctx, **OFFLOAD)


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
    stats = model._zero_ext.handles.diagnostics.stats()
    padded = sum(model._zero_ext.handles.reduction.bucket_layout()[2::3])
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
