"""Tensor parallel refusals: each wrong use raises zero_ext's error on every
rank (one rank going on would hang in its next collective), a group made
after them gets one name on every rank, and a good wrap and training
follow."""
from __future__ import annotations

import datetime
import os
import shutil

import torch
import torch.distributed as dist

import zero_ext
from tensor_parallel_context import TPContext, _shared_dir, adamw, mesh_of
from tensor_parallel_models import BUCKET_MB, MoENet, TPNet, parallelize, parallelize_experts
from tensor_parallel_training_scenarios import sgd_momentum_plain


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
