"""zero_ext SPEC behaviours in the ported tests' style: MoE routing that
skips experts per rank, under DeepSpeed's accumulation (no_sync) and
FSDP2's two forwards before one backward; torch.autograd.grad
(create_graph=True) before the backward, WGAN-GP style."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import parity_scenarios as ps
import real_models_scenarios as rms
from parity_scenarios import Context
from ported_models import _adam, _backward_counting, _step, _wrap


# --- zero_ext SPEC behaviours in the tests' style --------------------------------------

def moe_skipped_experts_accumulation_two_forwards(ctx: Context) -> None:
    """SPEC: MoE routing skips experts differently per rank inside a block's unit; with DeepSpeed's accumulation (no_sync) and FSDP2's two forwards before one backward."""
    model = rms.MoEModel()
    model, opt = _wrap(ctx, model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
    for step in range(2):
        with ctx.no_sync(model):
            loss = sum(w * (rms.lm_loss(model, rms.tokens_of(ctx.world, step, r, salt=0))
                            + rms.lm_loss(model, rms.tokens_of(ctx.world, step, r, salt=1)))
                       for r, w in ctx.participants())
            _backward_counting(ctx, model, loss, f"step {step} under no_sync", expect_quiet=True)
        loss = sum(w * rms.lm_loss(model, rms.tokens_of(ctx.world, step, r, salt=2)) for r, w in ctx.participants())
        _backward_counting(ctx, model, loss, f"step {step} synced", expect_quiet=False)
        _step(ctx, model, opt, f"step {step}")
    ctx.record_check("the ranks ran different experts", rms._ranks_ran_different_experts(ctx, model))


def autograd_grad_penalty_then_backward(ctx: Context) -> None:
    """SPEC (torch.autograd.grad leaves .grad alone), WGAN-GP style: autograd.grad(create_graph=True) of the input gradient, then backward of loss plus penalty."""
    model = ps.Net()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=ps.net_units)
    for step in range(2):
        before = [p.grad is None for p in model.parameters()]
        total = 0.0
        for r, w in ctx.participants():
            x, y = ps.batch(step, r, ctx.world)
            x.requires_grad_(True)
            out = model(x)
            (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
            total = total + w * (F.mse_loss(out, y) + 0.1 * gx.square().sum(1).mean())
        ctx.record_check(f"step {step}: autograd.grad left every .grad as it was",
                         [p.grad is None for p in model.parameters()] == before)
        total.backward()
        _step(ctx, model, opt, f"step {step}")
