"""Tensor parallel full state and checkpoints: load_full_state_dict of one
process's weights and the functional clip_grad_norm_; a checkpoint loaded
at another stage, DCP loaded at another tp layout, and convert writing
full shapes (a state_dict and safetensors)."""
from __future__ import annotations

import contextlib
import os
import shutil

import torch
import torch.distributed as dist

import zero_ext
from tensor_parallel_context import TPContext, _record_step, _shared_dir, _train, adamw, mesh_of, sgd_momentum
from tensor_parallel_models import BUCKET_MB, TPNet, parallelize


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
