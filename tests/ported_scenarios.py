"""Behaviours that DeepSpeed's ZeRO "user backward" tests
(tests/unit/v1/zero/test_zero_user_backward.py) and PyTorch FSDP2's
fully_shard tests (test/distributed/_composable/fsdp/test_fully_shard_*.py)
check, written from scratch against zero_ext's API.

Each scenario is a function of a parity Context (tests/parity_scenarios.py):
it runs once wrapped by zero_ext on N gloo ranks and once as the
single-process reference that plays every rank over the global batch, and
records checkpoints (gradients after a backward, parameters after a step,
values, checks) that must match at fp32 tolerances (parity_scenarios.compare).
Where the original test compares against DDP, the reference here is plain
PyTorch on one process over the global batch, which is what DDP computes.

Only behaviours that zero_ext's SPEC promises are ported; see
tests/test_ported.py for the ones left out and why.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import parity_scenarios as ps
import real_models_scenarios as rms
import zero_ext
from parity_scenarios import BATCH, DIM, SEQ, VOCAB, Context

D = 6  # width of the small square models


# --- helpers -----------------------------------------------------------------

def _init(module: nn.Module, seed: int, scale: float = 0.5) -> nn.Module:
    """Deterministic values for every parameter (the same on every rank and in the reference)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return module


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(step: int, rank: int, world: int, cols: int = D, salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s BATCH rows of the global batch of `step`."""
    g = torch.Generator().manual_seed(20_000 + 101 * step + salt)
    return torch.randn(world * BATCH, cols, generator=g)[rank * BATCH:(rank + 1) * BATCH]


def _classes(step: int, rank: int, world: int, n: int = D, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(30_000 + 101 * step + salt)
    return torch.randint(0, n, (world * BATCH,), generator=g)[rank * BATCH:(rank + 1) * BATCH]


def _tokens(step: int, rank: int, world: int, salt: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(40_000 + 101 * step + salt)
    return torch.randint(0, vocab, (world * BATCH, SEQ + 1), generator=g)[rank * BATCH:(rank + 1) * BATCH]


def _lm(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _wrap(ctx: Context, model: nn.Module, opt, units=None, **options):
    """zero_ext.wrap at the context's stage (units only in stage 3), or the plain pair for the reference."""
    if ctx.reference:
        return model, opt
    return zero_ext.wrap(model, opt, stage=ctx.stage, bucket_mb=ps.BUCKET_MB,
                         units=units if ctx.stage == 3 else None, **ctx.group_kwargs(), **options)


def _adam(params, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def _step(ctx: Context, model: nn.Module, opt, label: str, set_to_none: bool = True) -> None:
    """Records the gradients, steps, zeroes (set_to_none as given), records the parameters."""
    ctx.record_grads(label, model)
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    ctx.record_params(label, model)


def _released(ctx: Context, model: nn.Module, label: str) -> None:
    """Stage 3: no unit is left gathered after a backward, frozen ones included
    (DeepSpeed's assert_all_partitioned)."""
    ok = ctx.reference or ctx.stage != 3 or model._zero_ext.core.stats()["gathered_units"] == 0
    ctx.record_check(f"{label}: every unit released after backward", ok)


def _mean_over_ranks(ctx: Context, value: torch.Tensor) -> torch.Tensor:
    """A per-rank quantity averaged over the ranks (the reference already holds the weighted sum)."""
    if ctx.reference or ctx.world == 1:
        return value
    value = value.clone()
    dist.all_reduce(value)
    return value / ctx.world


def _backward_counting(ctx: Context, model: nn.Module, loss: torch.Tensor, label: str, expect_quiet: bool) -> None:
    """loss.backward(); records whether it issued no gradient collective
    (expected under no_sync() / require_backward_grad_sync False) or some
    (outside it, world size above 1), like FSDP2's reduce-scatter counts."""
    before = None if ctx.reference else model._zero_ext.core.stats()["collectives"]
    loss.backward()
    if ctx.reference:
        ok = True
    else:
        issued = model._zero_ext.core.stats()["collectives"] - before
        ok = issued == 0 if expect_quiet else (issued > 0 or ctx.world == 1)
    ctx.record_check(f"{label}: {'no' if expect_quiet else 'some'} gradient collective in this backward", ok)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


# --- models --------------------------------------------------------------------

class TwoLayer(nn.Module):
    """DeepSpeed's SimpleOutputModel / SimpleNonScalarModel: returns its output."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(D, D), nn.Linear(D, D)
        _init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(torch.tanh(self.linear1(x)))


class TwoLayerLoss(TwoLayer):
    """DeepSpeed's SimpleModel: the cross-entropy loss computed inside forward()."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.cross_entropy(super().forward(x), y)


class Branches(nn.Module):
    """DeepSpeed's LeafModuleModel / LeafNonScalarModel: every branch of a
    ModuleList runs in each forward; a loss when given targets, else the output."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.final_layer = nn.Linear(D, D)
        _init(self, 8)

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.final_layer(torch.tanh(self.branches[0](x) + self.branches[1](x)))
        return out if y is None else F.cross_entropy(out, y)


class CheckpointedTwoLayer(nn.Module):
    """DeepSpeed's CheckpointedModel: the first block runs under activation checkpointing."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(D, D), nn.Linear(D, D)
        self.reentrant = reentrant
        _init(self, 9)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(checkpoint(self.block, x, use_reentrant=self.reentrant))


class FrozenNormCheckpointed(nn.Module):
    """DeepSpeed's FrozenParamCheckpointedModel: a frozen LayerNorm inside the checkpointed block."""

    def __init__(self, reentrant: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.linear1, self.linear2 = nn.Linear(D, D), nn.Linear(D, D)
        self.reentrant = reentrant
        _init(self, 10)
        self.norm.requires_grad_(False)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear1(self.norm(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(checkpoint(self.block, x, use_reentrant=self.reentrant))


class FrozenNormBlocks(nn.Module):
    """DeepSpeed's MultiBlockFrozenModel: blocks kept as ModuleDicts, each
    with a frozen norm, each run under a checkpoint that gets the block as an argument."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(D), "linear": nn.Linear(D, D)})
                                    for _ in range(3))
        self.reentrant = False
        _init(self, 11)
        for block in self.blocks:
            block["norm"].requires_grad_(False)

    @staticmethod
    def block_forward(block: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(block["linear"](block["norm"](x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(self.block_forward, block, x, use_reentrant=self.reentrant)
        return x


class LoRAStyle(nn.Module):
    """DeepSpeed's LoRAStyleFrozenModel: a frozen base Linear plus a trainable low-rank adapter, checkpointed."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(D, D, bias=False)
        self.lora_a, self.lora_b = nn.Linear(D, 2, bias=False), nn.Linear(2, D, bias=False)
        self.head = nn.Linear(D, D)
        self.reentrant = False
        _init(self, 12)
        self.base.requires_grad_(False)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


class TwoOutputFrozenBlock(nn.Module):
    """DeepSpeed's MultiTensorLeafBlock: a frozen norm, two outputs."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.linear_a, self.linear_b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor):
        h = self.norm(x)
        return self.linear_a(h), torch.tanh(self.linear_b(h))


class TwoOutputFrozenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = TwoOutputFrozenBlock()
        self.head = nn.Linear(D, D)
        self.reentrant = False
        _init(self, 13)
        self.block.norm.requires_grad_(False)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.block(x)
        return a * b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.inner, x, use_reentrant=self.reentrant))


class DoubleLinear(nn.Module):
    """FSDP2's DoubleLinear: two outputs, or one (the second Linear never runs)."""

    def __init__(self, use_second_linear: bool):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(D, D), nn.Linear(D, D)
        self.use_second_linear = use_second_linear
        _init(self, 14)

    def forward(self, x: torch.Tensor):
        a = torch.tanh(self.lin1(x))
        return (a, torch.tanh(self.lin2(x))) if self.use_second_linear else a


NT = collections.namedtuple("NT", "x y")


class ToContainer(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor):
        return {"list": lambda: [x], "namedtuple": lambda: NT(x, torch.ones_like(x)),
                "tuple": lambda: (x,), "dict": lambda: {"x": x}}[self.kind]()


class ContainerBlock(nn.Module):
    """FSDP2's nontensor-activation Module: takes and returns a container."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(D, D), nn.Linear(D, D)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin2(torch.tanh(self.lin1(x))))

    def forward(self, inp):
        if isinstance(inp, list):
            return [self._forward(inp[0])]
        if isinstance(inp, NT):
            return NT(self._forward(inp.x) * inp.y, inp.y)
        if isinstance(inp, tuple):
            return (self._forward(inp[0]),)
        return {"x": self._forward(inp["x"])}


class FromContainer(nn.Module):
    def forward(self, inp):
        return inp["x"] if isinstance(inp, dict) else inp[0]


class Inner(nn.Linear):
    pass


class MultiForward(nn.Module):
    """FSDP2's MultiForwardModule: `inner` runs twice in one forward."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = Inner(D, D), nn.Linear(D, 5)
        _init(self, 15)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = self.inner(x)
        j = self.inner(torch.tanh(i))
        return self.outer(i + j)


class ChunkedHead(nn.Module):
    """FSDP2's ChunkedHeadModel: forward may stop before the head, which the
    loop then calls by itself on chunks of the hidden states."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        _init(self, 16)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.in_proj(x)))


class MLPStack(nn.Sequential):
    """FSDP2's Sequential of MLPs (optionally after a plain Linear), each MLP
    optionally under a non-reentrant checkpoint."""

    def __init__(self, n: int = 3, lead_linear: bool = False, seed: int = 17):
        super().__init__(*([nn.Linear(D, D)] if lead_linear else []), *(MLP() for _ in range(n)))
        self.checkpointing = False
        _init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self:
            x = checkpoint(module, x, use_reentrant=False) if self.checkpointing else module(x)
        return x


class MultiForwardMixed(nn.Module):
    """FSDP2's test_multi_forward_mixed_requires_grad model: a frozen and a
    trainable layer run three times, the trainable one under no_grad as well."""

    def __init__(self):
        super().__init__()
        self.layer_0, self.layer_no_grad, self.layer_with_grad = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        _init(self, 18)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(torch.tanh(self.layer_with_grad(x)))
            with torch.no_grad():
                x += torch.tanh(self.layer_with_grad(x))
        return x


class TiedEmbedOutput(nn.Module):
    """FSDP2's TiedModel: embedding and output layer share one weight."""

    def __init__(self, vocab: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, D)
        self.output = nn.Linear(D, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight
        _init(self, 19)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.output(torch.tanh(self.tok_embeddings(ids)))


class ParamOnly(nn.Module):
    """FSDP2's ParameterOnlyModule: forward() takes no inputs."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(D, D))
        _init(self, 20)

    def forward(self) -> torch.Tensor:
        return self.weight @ self.weight


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


BF16_LABEL = ps.BF16  # compared at bf16 tolerances by parity_scenarios.compare


def _bf16_adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3, eps=1e-2)  # eps above bf16 gradient noise (see parity_scenarios)


def _bf16_training(ctx: Context, model: nn.Module, loss_of, steps: int, micros: int, synced_from: int,
                   optimizer_params, after_backward: Optional[Callable[[int], None]] = None) -> None:
    """bf16 compute, fp32 masters: zero_ext's mixed_precision="bf16" (fp32
    reduction) against plain PyTorch's master-weight arithmetic
    (parity_scenarios.MasterWeightReference), whose reference adds each
    rank's bf16 gradient in fp32 as a reduction in fp32 does.
    `loss_of(model, step, micro, rank)` is one rank's loss; backward calls
    before `synced_from` run under no_sync() and must communicate nothing;
    `after_backward(step)` records more after each step's backward calls."""
    names = [n for n, _ in model.named_parameters()]
    if ctx.reference:
        ref = ps.MasterWeightReference(model, _bf16_adam, torch.bfloat16)
    else:
        model, opt = zero_ext.wrap(model, _bf16_adam(optimizer_params(model)), stage=ctx.stage, bucket_mb=ps.BUCKET_MB,
                                   mixed_precision="bf16", **ctx.group_kwargs())
    quiet = []
    for step in range(steps):
        sums: Dict[str, Optional[torch.Tensor]] = {n: None for n in names}
        for micro in range(micros):
            if ctx.reference:
                for r, w in ctx.participants():
                    (w * loss_of(model, step, micro, r)).backward()
                    for n, p in model.named_parameters():
                        if p.grad is not None:
                            sums[n] = p.grad.float() if sums[n] is None else sums[n] + p.grad.float()
                            p.grad = None
                continue
            before = model._zero_ext.core.stats()["collectives"]
            with ctx.no_sync(model) if micro < synced_from else contextlib.nullcontext():
                loss_of(model, step, micro, ctx.rank).backward()
            if micro < synced_from:
                quiet.append(model._zero_ext.core.stats()["collectives"] == before)
        if after_backward is not None:
            after_backward(step)
        if ctx.reference:
            ctx.checkpoints.append((f"{BF16_LABEL}step {step}: grads", dict(sums)))
            for n, p, m in zip(names, ref.params, ref.masters):
                m.grad = sums[n]
            ref.opt.step()
            with torch.no_grad():
                for p, m in zip(ref.params, ref.masters):
                    p.copy_(m)
            masters = dict(zip(names, [m.clone() for m in ref.masters]))
        else:
            ctx.record_grads(f"{BF16_LABEL}step {step}", model)
            opt.step()
            opt.zero_grad()
            full = zero_ext.full_state_dict(model)
            masters = {n: full[n] for n in names}
        ctx.checkpoints.append((f"{BF16_LABEL}step {step}: masters", masters))
    ctx.record_check("no collective in a backward under no_sync()", ctx.reference or all(quiet))


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


# --- FSDP2: test_fully_shard_autograd.py --------------------------------------------

def fsdp_unused_forward_output(ctx: Context) -> None:
    """FSDP2 test_unused_forward_output: both outputs in the loss, then only the first; zero_grad(set_to_none) alternating."""
    model = DoubleLinear(use_second_linear=True)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(4):
        loss = 0.0
        for r, w in ctx.participants():
            out1, out2 = model(_rows(step, r, ctx.world))
            loss = loss + w * ((out1 * out2).sum() if step < 2 else out1.sum())
        loss.backward()
        # zero_grad(set_to_none=False) after step 1: lin2 keeps a zero gradient that Adam steps in steps 2-3
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_unused_forward_module(ctx: Context) -> None:
    """FSDP2 test_unused_forward_module: a Linear (a stage 3 unit) that never runs; its gradient stays None."""
    model = DoubleLinear(use_second_linear=False)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(3):
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def _nontensor_activations(ctx: Context, kind: str) -> None:
    model = _init(nn.Sequential(ToContainer(kind), ContainerBlock(), ContainerBlock(), ContainerBlock(),
                                FromContainer()), 21)
    model, opt = _wrap(ctx, model, _adam(model.parameters()))  # stage 3: each ContainerBlock by the automatic policy
    for step in range(2):
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_nontensor_activations_list(ctx: Context) -> None:
    """FSDP2 test_nontensor_activations (list): units take and return lists."""
    _nontensor_activations(ctx, "list")


def fsdp_nontensor_activations_namedtuple(ctx: Context) -> None:
    """FSDP2 test_nontensor_activations (namedtuple): units take and return namedtuples with a passthrough tensor."""
    _nontensor_activations(ctx, "namedtuple")


def fsdp_nontensor_activations_tuple(ctx: Context) -> None:
    """FSDP2 test_nontensor_activations (tuple): units take and return tuples."""
    _nontensor_activations(ctx, "tuple")


def fsdp_nontensor_activations_dict(ctx: Context) -> None:
    """FSDP2 test_nontensor_activations (dict): units take and return dicts."""
    _nontensor_activations(ctx, "dict")


def fsdp_multi_grad_hook_and_tensor_hooks(ctx: Context) -> None:
    """FSDP2's register_multi_grad_hook use (ModuleTracker) and test_post_acc_grad_hook_runs: user multi-grad hooks on a unit's activations and parameters, and post-accumulate-grad hooks, fire once per backward with the right gradients."""
    model = ps.Net()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=ps.net_units)
    fired: Dict[str, List[torch.Tensor]] = {"activations": [], "parameters": []}
    handles = []

    def on_activations(grads):
        fired["activations"].append(torch.stack([g.sum() for g in grads]))

    def on_parameters(grads):
        fired["parameters"].append(torch.stack([g.sum() for g in grads]))

    def forward_hook(module, args, out):  # what torch.utils.module_tracker does
        handles.append(torch.autograd.graph.register_multi_grad_hook([args[0], out], on_activations))

    model.mid.register_forward_hook(forward_hook)
    torch.autograd.graph.register_multi_grad_hook([model.mid.weight, model.mid.bias], on_parameters)
    accumulated = collections.Counter()  # FSDP2 test_post_acc_grad_hook_runs
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: accumulated.update([name]))
    for step in range(2):
        ps.mlp_loss(ctx, model, step).backward()
        counts = {k: len(v) for k, v in fired.items()}
        ctx.record_check(f"step {step}: activation hook fired once per forward, parameter hook once",
                         counts == {"activations": len(ctx.participants()), "parameters": 1})
        ctx.record_check(f"step {step}: every parameter's post-accumulate-grad hook fired once",
                         dict(accumulated) == {n: 1 for n, _ in model.named_parameters()})
        accumulated.clear()
        for kind, values in fired.items():
            ctx.checkpoints.append((f"step {step}: {kind} hook gradient sums",
                                    {"sums": _mean_over_ranks(ctx, torch.stack(values).sum(0))}))
            values.clear()
        _step(ctx, model, opt, f"step {step}")


# --- FSDP2: test_fully_shard_training.py ---------------------------------------------

def fsdp_multi_forward_module(ctx: Context) -> None:
    """FSDP2 test_multi_forward_module: a unit that runs twice in one forward."""
    model = MultiForward()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units={Inner})
    for step in range(3):
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_two_forwards_one_backward_checkpointed(ctx: Context) -> None:
    """FSDP2 test_double_forward_with_nested_fsdp_and_checkpoint (DPO): two forwards, one loss over both; checkpointed blocks (non-reentrant, reentrant, none)."""
    model = ps.Blocks()
    model, opt = _wrap(ctx, model, _adam(model.parameters()))  # stage 3: one unit per block
    for step, mode in enumerate(("non-reentrant", "reentrant", None)):
        loss = 0.0
        for r, w in ctx.participants():
            chosen, rejected = _tokens(step, r, ctx.world, salt=0), _tokens(step, r, ctx.world, salt=1)
            ce1 = _lm(model(chosen[:, :-1], checkpointing=mode), chosen)
            ce2 = _lm(model(rejected[:, :-1], checkpointing=mode), rejected)
            loss = loss + w * ((ce1 - ce2).square() + ce1)
        loss.backward()
        _step(ctx, model, opt, f"step {step} ({mode})")


def fsdp_double_partial_forward_then_backward(ctx: Context) -> None:
    """FSDP2 test_double_partial_forward_then_backward: two forwards that skip the head (a unit), one backward; the head's gradient stays None."""
    model = ChunkedHead()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(2):
        loss = 0.0
        for r, w in ctx.participants():
            if step == 0:
                h1 = model(_tokens(step, r, ctx.world, salt=0)[:, :-1], skip_head=True)
                h2 = model(_tokens(step, r, ctx.world, salt=1)[:, :-1], skip_head=True)
                loss = loss + w * (h1.tanh().sum() + h2.square().mean())
            else:
                tokens = _tokens(step, r, ctx.world)
                loss = loss + w * _lm(model(tokens[:, :-1]), tokens)
        loss.backward()
        _step(ctx, model, opt, f"step {step}")


def _chunked_head_backward(ctx: Context, model: nn.Module, step: int, salt: int, record: bool,
                           quiet: Optional[bool] = None, chunks: int = 2) -> None:
    """FSDP2's chunked-loss loop: forward without the head, then per chunk of
    the detached hidden states the head called by itself (the root does not
    take part) and a backward each, then h.backward(cat(chunk grads)).
    `quiet`: check that every backward issues no gradient collective (True) or some (False)."""
    def backward(loss: torch.Tensor, label: str) -> None:
        if quiet is None:
            loss.backward()
        else:
            _backward_counting(ctx, model, loss, label, expect_quiet=quiet)

    hidden = {}
    for r, w in ctx.participants():
        tokens = _tokens(step, r, ctx.world, salt=salt)
        hidden[r] = (w, tokens, model(tokens[:, :-1], skip_head=True), [])
    for k in range(chunks):
        loss = 0.0
        for r, (w, tokens, h, chunk_grads) in hidden.items():
            chunk = h.detach().chunk(chunks, dim=1)[k].contiguous().requires_grad_(True)
            start = sum(c.shape[1] for c in h.chunk(chunks, dim=1)[:k])
            target = tokens[:, 1:][:, start:start + chunk.shape[1]]
            logits = model.head(chunk)
            loss = loss + w * F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / (BATCH * SEQ)
            chunk_grads.append(chunk)
        backward(loss, f"step {step} micro-batch {salt} chunk {k}")
        if record:
            ctx.record_grads(f"step {step} after chunk {k}", model)
    outs = [h for (w, tokens, h, chunk_grads) in hidden.values()]
    grads = [torch.cat([c.grad for c in chunk_grads], dim=1) for (w, tokens, h, chunk_grads) in hidden.values()]
    if quiet is None:
        torch.autograd.backward(outs, grads)
    else:
        before = None if ctx.reference else model._zero_ext.core.stats()["collectives"]
        torch.autograd.backward(outs, grads)
        issued = 0 if ctx.reference else model._zero_ext.core.stats()["collectives"] - before
        ctx.record_check(f"step {step} micro-batch {salt} h.backward: "
                         f"{'no' if quiet else 'some'} gradient collective",
                         ctx.reference or (issued == 0 if quiet else issued > 0 or ctx.world == 1))


def fsdp_chunked_head_loss_standalone_head(ctx: Context) -> None:
    """FSDP2 test_partial_group_forward_then_standalone (root not participating): the head called by itself per chunk, a backward each, then h.backward(cat(chunk grads))."""
    model = ChunkedHead()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(2):
        _chunked_head_backward(ctx, model, step, salt=0, record=True)
        _step(ctx, model, opt, f"step {step}")


def fsdp_chunked_head_loss_grad_accumulation(ctx: Context) -> None:
    """FSDP2 test_partial_group_forward_grad_accum_chunked: the chunked-head loop over 3 micro-batches, the first two under no_sync()."""
    model = ChunkedHead()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(2):
        for micro in range(3):
            with ctx.no_sync(model) if micro < 2 else contextlib.nullcontext():
                _chunked_head_backward(ctx, model, step, salt=micro, record=False, quiet=micro < 2)
        _step(ctx, model, opt, f"step {step}")


def fsdp_non_root_forward_backward(ctx: Context) -> None:
    """FSDP2 test_non_root_forward_backward: a step through the root, then a step through model[0] alone."""
    model = MLPStack(n=3, seed=22)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units={MLP})
    for step in range(2):
        sum(w * (model(_rows(step, r, ctx.world)) if step == 0 else model[0](_rows(step, r, ctx.world))).sum()
            for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}")
    with torch.no_grad():
        ctx.record_value(f"no_grad loss on rank {ctx.rank}'s rows", model(_rows(9, ctx.rank, ctx.world)).sum())


def fsdp_root_without_forward_inputs(ctx: Context) -> None:
    """FSDP2 test_root_no_forward_inputs: forward() takes no arguments; the loss weights its output per rank."""
    model = ParamOnly()
    model, opt = _wrap(ctx, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for step in range(3):
        sum(w * (model() * torch.randn(D, D, generator=_seeded(60 + 10 * step + r))).sum()
            for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}")


def fsdp_optimizer_step_hooks(ctx: Context) -> None:
    """FSDP2 test_post_optim_event (optimizer.register_step_post_hook): pre- and post-step hooks on the returned optimizer fire once per step and see the old and new values."""
    model = ps.Blocks()
    model, opt = _wrap(ctx, model, torch.optim.AdamW(model.parameters(), lr=0.01))
    calls = {"pre": 0, "post": 0}
    full = contextlib.nullcontext if ctx.reference else (lambda: zero_ext.full_params(model))

    def norm_of_parameters() -> torch.Tensor:
        with torch.no_grad(), full():
            return torch.stack([p.norm() for p in model.parameters()]).norm()

    def hook(kind):
        def fn(optimizer, args, kwargs):
            calls[kind] += 1
            ctx.record_value(f"{kind}-step hook call {calls[kind]}: norm of the parameters", norm_of_parameters())
        return fn

    opt.register_step_pre_hook(hook("pre"))
    opt.register_step_post_hook(hook("post"))
    for step in range(3):
        ps.token_loss(ctx, model, step).backward()
        _step(ctx, model, opt, f"step {step}")
    ctx.record_check("each hook fired once per step", calls == {"pre": 3, "post": 3})


def fsdp_tied_embedding_uneven_vocab(ctx: Context) -> None:
    """FSDP2 test_train_shared_params_uneven_shard: tied embedding/output with a vocabulary that does not divide by the world size; every row trains."""
    vocab = 4 * ctx.world + 1
    model = TiedEmbedOutput(vocab)
    initial = model.tok_embeddings.weight.detach().clone()
    model, opt = _wrap(ctx, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(3):
        sum(w * _lm(model(ids[:, :-1]), ids) for r, w in ctx.participants()
            for ids in [_tokens(step, r, ctx.world, vocab=vocab)]).backward()
        _step(ctx, model, opt, f"step {step}")
    final = model.tok_embeddings.weight if ctx.reference else zero_ext.full_state_dict(model)["tok_embeddings.weight"]
    ctx.record_check("every row of the tied weight changed", all(
        not torch.equal(initial[row], final[row]) for row in range(vocab)))


def fsdp_train_parity_with_shared_params_checkpointed(ctx: Context) -> None:
    """FSDP2 test_train_parity_with_shared_params: tied embedding/head with checkpointed blocks; zero_grad(set_to_none) alternating."""
    model = ps.Blocks()
    model, opt = _wrap(ctx, model, _adam(model.parameters()))
    for step in range(3):
        ps.token_loss(ctx, model, step, checkpointing="non-reentrant").backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_grad_accumulation_with_and_without_sync(ctx: Context) -> None:
    """FSDP2 test_gradient_accumulation: 3 micro-batches, the first two without sync (no_sync(), then DDP's require_backward_grad_sync), then all synced; zero_grad(set_to_none) alternating."""
    model = MLPStack(n=3, lead_linear=True, seed=23)
    model, opt = _wrap(ctx, model, _adam(model.parameters()))  # stage 3: one unit per MLP, the root holds the Linear
    for step in range(3):
        for micro in range(3):
            last = micro == 2
            unsynced = micro < 2 and step < 2
            if step == 1 and not ctx.reference:
                model.require_backward_grad_sync = last
            loss = sum(w * model(_rows(step, r, ctx.world, salt=micro)).sum() for r, w in ctx.participants())
            with ctx.no_sync(model) if step == 0 and not last else contextlib.nullcontext():
                _backward_counting(ctx, model, loss, f"step {step} micro {micro}", expect_quiet=unsynced)
        ctx.record_check(f"step {step}: require_backward_grad_sync reads True",
                         ctx.reference or model.require_backward_grad_sync)
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 1)


def fsdp_forwards_first_then_backwards(ctx: Context) -> None:
    """FSDP2 test_1f1b_microbatching (several forwards before backward): three micro-batch forwards, then their backward calls, the first two under no_sync."""
    model = ps.Blocks()
    model, opt = _wrap(ctx, model, _adam(model.parameters()))
    for step in range(2):
        losses = [sum(w * _lm(model(t[:, :-1]), t) for r, w in ctx.participants()
                      for t in [_tokens(step, r, ctx.world, salt=micro)]) for micro in range(3)]
        with ctx.no_sync(model):
            _backward_counting(ctx, model, losses[0], f"step {step} first", expect_quiet=True)
            _backward_counting(ctx, model, losses[1], f"step {step} second", expect_quiet=True)
        _backward_counting(ctx, model, losses[2], f"step {step} third", expect_quiet=False)
        _step(ctx, model, opt, f"step {step}")


def fsdp_bf16_grad_accumulation_no_sync(ctx: Context) -> None:
    """FSDP2 test_grad_acc_with_reduce_dtype: bf16 compute, fp32 reduction, accumulation over no_sync micro-batches."""
    def loss(model, step, micro, r):
        return F.mse_loss(model(_rows(step, r, ctx.world, salt=micro).to(torch.bfloat16)).float(),
                          _rows(step, r, ctx.world, salt=10 + micro))
    _bf16_training(ctx, MLPStack(n=2, seed=24), loss, steps=2, micros=3, synced_from=2,
                   optimizer_params=lambda m: m.parameters())


# --- FSDP2: test_fully_shard_frozen.py -------------------------------------------------

def fsdp_biases_only_trainable_checkpointed(ctx: Context) -> None:
    """FSDP2 test_train_mixed_requires_grad_per_group (BitFit): frozen weights and trainable biases in one unit, with and without checkpointing."""
    model = MLPStack(n=3, seed=25)
    for name, p in model.named_parameters():
        if "bias" not in name:
            p.requires_grad_(False)
    model, opt = _wrap(ctx, model, _adam(model.parameters()))
    for step in range(4):
        model.checkpointing = step % 2 == 1
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _released(ctx, model, f"step {step}")
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_frozen_linears_across_units_with_no_grad_step(ctx: Context) -> None:
    """FSDP2 test_train_mixed_requires_grad_across_groups: frozen and trainable Linear units interleaved, and a torch.no_grad() forward between training steps."""
    model = _init(nn.Sequential(*(m for _ in range(6) for m in (nn.Linear(D, D), nn.Tanh()))), 26)
    for i in range(0, 12, 4):
        model[i].requires_grad_(False)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                ctx.record_value(f"no_grad loss on rank {ctx.rank}'s rows",
                                 model(_rows(step, ctx.rank, ctx.world)).sum())
            continue
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_multi_forward_mixed_requires_grad(ctx: Context) -> None:
    """FSDP2 test_multi_forward_mixed_requires_grad: a frozen and a trainable unit run three times per forward, the trainable one under no_grad too."""
    model = MultiForwardMixed()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(3):
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


class RaisesWhenAsked(nn.Module):
    """A block whose forward raises while `fail` is set, after its Linear ran:
    on every rank alike, as an out-of-memory error on the same batch would."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        if self.fail:
            raise RuntimeError("injected out of memory")
        return y


def fsdp_reset_after_an_exception_on_every_rank(ctx: Context) -> None:
    """FSDP2 test_reset_iter_state_after_exception, and accelerate's find_executable_batch_size: a forward raises on every rank at the same point (inside the middle unit, after the first gathers and prefetches), twice in a row, is caught, and training goes on exactly."""
    model = _init(nn.Sequential(nn.Linear(D, D), RaisesWhenAsked(), nn.Linear(D, D), nn.Linear(D, D)), 61)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    raiser = model[1]
    for step in range(3):
        if step == 1:
            raiser.fail = True
            for attempt in range(2):
                try:
                    sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants())
                    raised = False
                except RuntimeError as e:
                    raised = "injected out of memory" in str(e)
                ctx.record_check(f"step {step}: attempt {attempt} raised the injected error", raised)
            raiser.fail = False
        sum(w * model(_rows(step, r, ctx.world)).square().sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}")
    with torch.no_grad():  # and an evaluation forward that raises, then one that does not
        raiser.fail = True
        try:
            model(_rows(9, ctx.rank, ctx.world))
        except RuntimeError:
            pass
        raiser.fail = False
        ctx.record_value("evaluation after a raised one", _mean_over_ranks(
            ctx, sum(w * model(_rows(9, r, ctx.world)).sum() for r, w in ctx.participants())))


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


SCENARIOS: Dict[str, Callable[[Context], None]] = {
    f.__name__: f
    for f in [
        ds_loss_backward_matches_ddp,
        ds_non_scalar_backward,
        ds_grad_accumulation_scaled_and_unscaled,
        ds_multiple_models_combined_loss,
        ds_separate_loss_function,
        ds_two_losses_one_forward_zero_grad_between,
        ds_module_list_branches,
        ds_checkpointed_backward_reentrant,
        ds_checkpointed_backward_nonreentrant,
        ds_frozen_norm_checkpointed_reentrant,
        ds_frozen_norm_checkpointed_nonreentrant,
        ds_frozen_norm_module_dict_blocks_checkpointed,
        ds_lora_style_frozen_base_checkpointed,
        ds_frozen_two_output_block_checkpointed,
        ds_frozen_norm_checkpointed_bf16,
        fsdp_unused_forward_output,
        fsdp_unused_forward_module,
        fsdp_nontensor_activations_list,
        fsdp_nontensor_activations_namedtuple,
        fsdp_nontensor_activations_tuple,
        fsdp_nontensor_activations_dict,
        fsdp_multi_grad_hook_and_tensor_hooks,
        fsdp_multi_forward_module,
        fsdp_two_forwards_one_backward_checkpointed,
        fsdp_double_partial_forward_then_backward,
        fsdp_chunked_head_loss_standalone_head,
        fsdp_chunked_head_loss_grad_accumulation,
        fsdp_non_root_forward_backward,
        fsdp_root_without_forward_inputs,
        fsdp_optimizer_step_hooks,
        fsdp_tied_embedding_uneven_vocab,
        fsdp_train_parity_with_shared_params_checkpointed,
        fsdp_grad_accumulation_with_and_without_sync,
        fsdp_forwards_first_then_backwards,
        fsdp_bf16_grad_accumulation_no_sync,
        fsdp_biases_only_trainable_checkpointed,
        fsdp_frozen_linears_across_units_with_no_grad_step,
        fsdp_multi_forward_mixed_requires_grad,
        fsdp_reset_after_an_exception_on_every_rank,
        moe_skipped_experts_accumulation_two_forwards,
        autograd_grad_penalty_then_backward,
    ]
}
STAGES = (0, 1, 2, 3)


def stages_of(name: str):
    return getattr(SCENARIOS[name], "stages", STAGES)


def items() -> List[str]:
    return [f"{name}/stage{stage}" for name in SCENARIOS for stage in stages_of(name)]


_REFERENCES: Dict = {}


def run_one(rank: int, world: int, item: str) -> Optional[str]:
    """Entry point on each rank for one "name/stageN": None, or the first
    mismatch against the single-process reference (computed once per scenario)."""
    name, stage = item.rsplit("/stage", 1)
    if (name, world) not in _REFERENCES:
        ref_ctx = Context(stage=0, rank=rank, world=world, reference=True)
        SCENARIOS[name](ref_ctx)
        _REFERENCES[(name, world)] = ref_ctx.checkpoints
    ctx = Context(stage=int(stage), rank=rank, world=world, reference=False)
    SCENARIOS[name](ctx)
    return ps.compare(_REFERENCES[(name, world)], ctx.checkpoints)
