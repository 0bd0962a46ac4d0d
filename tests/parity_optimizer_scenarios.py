"""Parity scenarios of the optimizer and the full state: param groups and a
scheduler, gradient clipping three ways, a parameter listed twice,
zero_grad(set_to_none=False), full_params (an EMA, writeback) and
full_state_dict / load_full_state_dict."""
from __future__ import annotations

import contextlib
import warnings

import torch

import zero_ext
from parity_models import Blocks, Context, Net, adamw, batch, mlp_loss, sgd, step_and_record, token_loss


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
