"""What the ported scenarios share: each rank's slice of a step's global
batch, the wrap / step / record helpers, the bf16 training loop against
plain PyTorch master weights, and the small models of the DeepSpeed and
FSDP2 tests (written from scratch, as the scenarios are)."""
from __future__ import annotations

import collections
import contextlib
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import parity_scenarios as ps
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
    ok = ctx.reference or ctx.stage != 3 or model._zero_ext.handles.diagnostics.stats()["gathered_units"] == 0
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
    before = None if ctx.reference else model._zero_ext.handles.diagnostics.stats()["collectives"]
    loss.backward()
    if ctx.reference:
        ok = True
    else:
        issued = model._zero_ext.handles.diagnostics.stats()["collectives"] - before
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


# --- bf16 training against master weights ------------------------------------

BF16_LABEL = ps.BF16  # compared at bf16 tolerances by parity_scenarios.compare


def _bf16_adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3, eps=1e-2)  # eps above bf16 gradient noise (see parity_models)


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
            before = model._zero_ext.handles.diagnostics.stats()["collectives"]
            with ctx.no_sync(model) if micro < synced_from else contextlib.nullcontext():
                loss_of(model, step, micro, ctx.rank).backward()
            if micro < synced_from:
                quiet.append(model._zero_ext.handles.diagnostics.stats()["collectives"] == before)
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
