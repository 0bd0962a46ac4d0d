"""Behaviours that DeepSpeed's ZeRO "user backward" tests
(tests/unit/v1/zero/test_zero_user_backward.py) check, written from scratch
against zero_ext's API: the loss inside or outside the model, non-scalar
backward, accumulation, several models in one loss, two losses of one
forward, ModuleList branches, activation checkpointing with frozen
parameters (norms, LoRA bases, ModuleDict blocks, a two-output block, bf16)."""
from __future__ import annotations

from typing import Callable, List

import torch
import torch.nn as nn
import torch.nn.functional as F

from parity_scenarios import Context
from ported_models import (
    Branches, CheckpointedTwoLayer, FrozenNormBlocks, FrozenNormCheckpointed, LoRAStyle, TwoLayer, TwoLayerLoss,
    TwoOutputFrozenBlock, TwoOutputFrozenModel, _adam, _bf16_training, _classes, _is_linear, _released, _rows, _seeded,
    _step, _wrap)


# --- DeepSpeed: TestZeroUserBackward* ----------------------------------------------

def ds_loss_backward_matches_ddp(ctx: Context) -> None:
    """DeepSpeed TestZeroUserBackwardBasic.test_loss_backward_matches_ddp: loss inside forward(), plain loss.backward()."""
    model = TwoLayerLoss(seed=1)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(3):
        sum(w * model(_rows(step, r, ctx.world), _classes(step, r, ctx.world))
            for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}")


def ds_non_scalar_backward(ctx: Context) -> None:
    """DeepSpeed TestZeroUserBackwardNonScalar: out.backward(grad) on a non-scalar output (ones, then random)."""
    model = TwoLayer(seed=2)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(2):
        outs, grads = [], []
        for r, w in ctx.participants():
            out = model(_rows(step, r, ctx.world))
            g = torch.ones_like(out) if step == 0 else torch.randn(out.shape, generator=_seeded(r))
            outs.append(out)
            grads.append(w * g)
        torch.cat(outs).backward(torch.cat(grads))
        _step(ctx, model, opt, f"step {step}")


def ds_grad_accumulation_scaled_and_unscaled(ctx: Context) -> None:
    """DeepSpeed TestZeroUserBackwardGradAccumulation: 4 backward calls per step, (loss / 4) then unscaled (scale_wrt_gas=False)."""
    model = TwoLayerLoss(seed=3)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step, divisor in enumerate((4.0, 1.0)):
        for micro in range(4):
            loss = sum(w * model(_rows(step, r, ctx.world, salt=micro), _classes(step, r, ctx.world, salt=micro))
                       for r, w in ctx.participants())
            (loss / divisor).backward()
            if micro == 1:
                ctx.record_grads(f"step {step} after 2 backward calls", model)
        _step(ctx, model, opt, f"step {step} boundary")


def ds_multiple_models_combined_loss(ctx: Context) -> None:
    """DeepSpeed TestZeroUserBackwardMultipleEngines: three wrapped models, one combined loss; then torch.autograd.backward([...])."""
    models, opts = [], []
    for i in range(3):
        m = TwoLayerLoss(seed=30 + i)
        m, o = _wrap(ctx, m, _adam(m.parameters()), units=_is_linear)
        models.append(m)
        opts.append(o)
    for step in range(2):
        losses = [sum(w * m(_rows(step, r, ctx.world), _classes(step, r, ctx.world)) for r, w in ctx.participants())
                  / (i + 1) for i, m in enumerate(models)]
        if step == 0:
            sum(losses).backward()
        else:
            torch.autograd.backward(losses)
        for i, m in enumerate(models):
            ctx.record_grads(f"step {step} model {i}", m)
        for o in opts:
            o.step()
            o.zero_grad()
        for i, m in enumerate(models):
            ctx.record_params(f"step {step} model {i}", m)


def ds_separate_loss_function(ctx: Context) -> None:
    """DeepSpeed TestZeroUserBackwardSeparateLoss.test_separate_loss_function: the model returns logits, nn.CrossEntropyLoss outside."""
    model = TwoLayer(seed=4)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(2):
        sum(w * loss_fn(model(_rows(step, r, ctx.world)), _classes(step, r, ctx.world))
            for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}")


def ds_two_losses_one_forward_zero_grad_between(ctx: Context) -> None:
    """DeepSpeed test_two_losses_separate_backward_gas1 (issue 7352): one forward, zero_grad, loss1.backward(retain_graph=True), zero_grad, loss2.backward(): no leftover of loss1."""
    model = TwoLayer(seed=5)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(2):
        l1 = l2 = 0.0
        for r, w in ctx.participants():
            out = model(_rows(step, r, ctx.world))
            l1 = l1 + w * F.cross_entropy(out, _classes(step, r, ctx.world, salt=1))
            l2 = l2 + w * F.cross_entropy(out, _classes(step, r, ctx.world, salt=2))
        zero = model.zero_grad if step == 0 else opt.zero_grad  # the module's own zero_grad, then the optimizer's
        zero()
        l1.backward(retain_graph=True)
        ctx.record_grads(f"step {step} loss1", model)
        zero()
        l2.backward()
        ctx.record_grads(f"step {step} loss2 alone", model)
        opt.step()
        opt.zero_grad()
        ctx.record_params(f"step {step}", model)


def ds_module_list_branches(ctx: Context) -> None:
    """DeepSpeed TestZeroUserBackwardLeafModule: all branches of a ModuleList used per forward, scalar then non-scalar backward."""
    model = Branches()
    model, opt = _wrap(ctx, model, _adam(model.parameters()))  # stage 3: the automatic units policy
    for step in range(3):
        if step == 1:
            outs, grads = [], []
            for r, w in ctx.participants():
                out = model(_rows(step, r, ctx.world))
                outs.append(out)
                grads.append(w * torch.randn(out.shape, generator=_seeded(50 + r)))
            torch.cat(outs).backward(torch.cat(grads))
        else:
            sum(w * model(_rows(step, r, ctx.world), _classes(step, r, ctx.world))
                for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}")


def _checkpointed_two_layer(ctx: Context, reentrant: bool) -> None:
    """Input that requires grad; non-scalar backward twice (ones, random), then a scalar loss; the input's
    gradient on this rank is recorded too (the reference's is divided by its weight)."""
    model = CheckpointedTwoLayer(reentrant)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(3):
        inputs, outs, grads, loss = {}, [], [], 0.0
        for r, w in ctx.participants():
            x = _rows(step, r, ctx.world).requires_grad_(True)
            inputs[r] = (x, w)
            out = model(x)
            if step < 2:
                g = torch.ones_like(out) if step == 0 else torch.randn(out.shape, generator=_seeded(r))
                outs.append(out)
                grads.append(w * g)
            else:
                loss = loss + w * F.cross_entropy(out, _classes(step, r, ctx.world))
        if step < 2:
            torch.cat(outs).backward(torch.cat(grads))
        else:
            loss.backward()
        x, w = inputs[ctx.rank]
        ctx.checkpoints.append((f"step {step}: input gradient of rank {ctx.rank}",
                                {"x": x.grad / w if ctx.reference else x.grad}))
        _step(ctx, model, opt, f"step {step}")


def ds_checkpointed_backward_reentrant(ctx: Context) -> None:
    """DeepSpeed TestZeroUserBackwardWithCheckpointing (use_reentrant=True): non-scalar, scalar and repeated backward."""
    _checkpointed_two_layer(ctx, reentrant=True)


def ds_checkpointed_backward_nonreentrant(ctx: Context) -> None:
    """DeepSpeed TestZeroUserBackwardWithCheckpointing (use_reentrant=False): non-scalar, scalar and repeated backward."""
    _checkpointed_two_layer(ctx, reentrant=False)


def _frozen_checkpointed(ctx: Context, model: nn.Module, reentrant: Callable[[int], bool], units=_is_linear,
                         steps: int = 3) -> None:
    """DeepSpeed's run_frozen_checkpoint_comparison: the optimizer holds the
    trainable parameters only; out.sum().backward() with an input that
    requires grad; after every backward stage 3 holds no unit gathered."""
    opt = _adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = _wrap(ctx, model, opt, units=units)
    for step in range(steps):
        model.reentrant = reentrant(step)
        sum(w * model(_rows(step, r, ctx.world).requires_grad_(True)).sum() for r, w in ctx.participants()).backward()
        _released(ctx, model, f"step {step}")
        _step(ctx, model, opt, f"step {step}")


def _norm_or_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.LayerNorm))


def ds_frozen_norm_checkpointed_reentrant(ctx: Context) -> None:
    """DeepSpeed TestZeroUserBackwardFrozenParamCheckpointing (reentrant, fp32): frozen LayerNorm (a unit of its own) in a checkpoint."""
    _frozen_checkpointed(ctx, FrozenNormCheckpointed(), lambda step: True, units=_norm_or_linear)


def ds_frozen_norm_checkpointed_nonreentrant(ctx: Context) -> None:
    """DeepSpeed TestZeroUserBackwardFrozenParamCheckpointing (non-reentrant, fp32, issue 4332): frozen LayerNorm unit in a checkpoint."""
    _frozen_checkpointed(ctx, FrozenNormCheckpointed(), lambda step: False, units=_norm_or_linear)


def ds_frozen_norm_module_dict_blocks_checkpointed(ctx: Context) -> None:
    """DeepSpeed TestZeroFrozenParamCheckpointingVariants.test_multi_block: ModuleDict blocks with frozen norms, each checkpointed (non-reentrant, reentrant, non-reentrant)."""
    _frozen_checkpointed(ctx, FrozenNormBlocks(), lambda step: step % 2 == 1, units=None)  # the automatic policy


def ds_lora_style_frozen_base_checkpointed(ctx: Context) -> None:
    """DeepSpeed TestZeroFrozenParamCheckpointingVariants.test_lora_style: frozen base Linear (its own unit) plus adapter, checkpointed both ways."""
    _frozen_checkpointed(ctx, LoRAStyle(), lambda step: step % 2 == 1)


def ds_frozen_two_output_block_checkpointed(ctx: Context) -> None:
    """DeepSpeed TestZeroFrozenParamMultiTensorLeaf: a unit with a frozen norm returning two tensors, checkpointed both ways."""
    _frozen_checkpointed(ctx, TwoOutputFrozenModel(), lambda step: step % 2 == 0, units={TwoOutputFrozenBlock})


def ds_frozen_norm_checkpointed_bf16(ctx: Context) -> None:
    """DeepSpeed TestZeroUserBackwardFrozenParamCheckpointing (bf16): frozen norm in a checkpoint, computed in bf16, fp32 masters."""
    def loss(model, step, micro, r):
        model.reentrant = step == 1
        return model(_rows(step, r, ctx.world).to(torch.bfloat16).requires_grad_(True)).float().sum()
    model = FrozenNormCheckpointed()
    dtypes: List[torch.dtype] = []
    model.norm.register_forward_pre_hook(lambda module, args: dtypes.append(module.weight.dtype))

    def frozen_norm_in_bf16(step: int) -> None:
        # The reference computes the frozen norm in bf16 by construction; SPEC: so does every stage.
        ctx.record_check(f"step {step}: the frozen norm's weight is bf16 in forward (SPEC: frozen parameters "
                         f"compute in param_dtype in every stage)", ctx.reference or set(dtypes) == {torch.bfloat16})
        dtypes.clear()

    _bf16_training(ctx, model, loss, steps=2, micros=1, synced_from=0,
                   optimizer_params=lambda m: [p for p in m.parameters() if p.requires_grad],
                   after_backward=frozen_norm_in_bf16)
