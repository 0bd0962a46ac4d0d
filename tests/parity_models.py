"""What the parity scenarios (parity_scenarios.py's registry) share: the
small models (Net, Blocks), each rank's slice of the global batch, the
Context a scenario is written against (zero_ext's run on one rank, or the
single-process reference playing every rank at once), the optimizers and
the plain training loop."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import zero_ext


BATCH = 4          # samples per rank
IN, HIDDEN, OUT = 6, 12, 3
BUCKET_MB = 0.0005  # ~500 bytes: several buckets even for these tiny models


class Net(nn.Module):
    """Small MLP with an optional side branch, for unused/rank-dependent tests."""

    def __init__(self, seed: int = 0, branch: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT)
        self.branch = nn.Linear(HIDDEN, OUT) if branch else None
        if branch:
            # Used on some ranks only in some scenarios: it must not be a
            # stage 3 unit of its own (its all-gather would run on those ranks only).
            self.branch.zero_ext_test_root = True
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        y = self.out(h)
        if use_branch:
            y = y + self.branch(h)
        return y


def net_units(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and not getattr(module, "zero_ext_test_root", False)


class LossNet(Net):
    """Computes its own loss inside forward()."""

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.mse_loss(super().forward(x), target)


VOCAB, DIM, SEQ = 11, 8, 5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.ff(h)) * torch.sigmoid(self.gate(h))


class Blocks(nn.Module):
    """Embedding, repeated blocks (stage 3's default units) and an output
    layer tied to the embedding."""

    def __init__(self, n_blocks: int = 3, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor, plan=None, checkpointing=None) -> torch.Tensor:
        h = self.embed(tokens)
        for i in plan if plan is not None else range(len(self.blocks)):
            if checkpointing is None:
                h = self.blocks[i](h)
            else:
                from torch.utils.checkpoint import checkpoint
                h = checkpoint(self.blocks[i], h, use_reentrant=checkpointing == "reentrant")
        return self.head(h)


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor


@dataclasses.dataclass
class LMOutput:
    logits: torch.Tensor
    aux: Optional[torch.Tensor] = None


class DataclassBlock(Block):
    def forward(self, x: Hidden) -> Hidden:  # type: ignore[override]
        return Hidden(super().forward(x.h))


class DataclassBlocks(Blocks):
    """Outputs that pytree does not look into: a unit returning a dataclass,
    and a model returning one."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(DataclassBlock() for _ in range(3))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in self.blocks.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor) -> LMOutput:  # type: ignore[override]
        h = Hidden(self.embed(tokens))
        for block in self.blocks:
            h = block(h)
        return LMOutput(self.head(h.h))


def token_loss(ctx: "Context", model: nn.Module, step: int, **forward_kwargs) -> torch.Tensor:
    total = 0.0
    for r, w in ctx.participants():
        g = torch.Generator().manual_seed(500 + step)
        tokens = torch.randint(0, VOCAB, (ctx.world * BATCH, SEQ + 1), generator=g)[r * BATCH:(r + 1) * BATCH]
        logits = model(tokens[:, :-1], **forward_kwargs)
        if isinstance(logits, LMOutput):
            logits = logits.logits
        total = total + w * F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return total


def batch(step: int, rank: int, world: int, salt: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice of the global batch of `step`."""
    g = torch.Generator().manual_seed(1000 * step + salt)
    x = torch.randn(world * BATCH, IN, generator=g)
    y = torch.randn(world * BATCH, OUT, generator=g)
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[sl], y[sl]


class Context:
    def __init__(self, stage: int, rank: int, world: int, reference: bool, mesh=None):
        self.stage, self.rank, self.world, self.reference = stage, rank, world, reference
        # Hybrid sharding: a 2-D (replicate, shard) DeviceMesh over the same
        # ranks; the data, and so the reference, stay those of the flat world.
        self.mesh = mesh
        self.replicas = mesh.mesh.shape[0] if mesh is not None else 1
        self.shard_size = world // self.replicas
        self.checkpoints: List[Tuple[str, Dict[str, Optional[torch.Tensor]]]] = []

    def group_kwargs(self) -> dict:
        """wrap()'s process_group for this run."""
        return {"process_group": self.mesh} if self.mesh is not None else {}

    # -- who this process plays -------------------------------------------
    def participants(self) -> List[Tuple[int, float]]:
        """(rank, weight) pairs: this rank alone, or every rank at 1/N."""
        if self.reference:
            return [(r, 1.0 / self.world) for r in range(self.world)]
        return [(self.rank, 1.0)]

    def wrap(self, model: nn.Module, opt: torch.optim.Optimizer, **options):
        if self.reference:
            return model, opt
        if self.stage == 3 and isinstance(model, Net):
            options.setdefault("units", net_units)  # each Linear its own unit; Blocks use the default policy
        options = {"bucket_mb": BUCKET_MB, **self.group_kwargs(), **options}
        return zero_ext.wrap(model, opt, stage=self.stage, **options)

    def no_sync(self, model: nn.Module):
        return contextlib.nullcontext() if self.reference else model.no_sync()

    def set_requires_all_reduce(self, model: nn.Module, requires: bool) -> None:
        if not self.reference:
            model.set_requires_all_reduce(requires)

    def clip(self, model: nn.Module, opt, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if self.reference:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return opt.clip_grad_norm_(max_norm, norm_type)

    # -- checkpoints --------------------------------------------------------
    def record_grads(self, label: str, model: nn.Module) -> None:
        if self.reference:
            grads = {n: None if p.grad is None else p.grad.detach().clone()
                     for n, p in model.named_parameters()}
        else:
            grads = zero_ext.full_grads(model)
        self.checkpoints.append((f"{label}: grads", grads))

    def record_params(self, label: str, model: nn.Module) -> None:
        if self.reference:
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        else:  # stage 3 parameters hold no memory between steps
            full = zero_ext.full_state_dict(model)
            params = {n: full[n] for n, _ in model.named_parameters()}
        self.checkpoints.append((f"{label}: params", params))

    def record_value(self, label: str, value: torch.Tensor) -> None:
        self.checkpoints.append((label, {"value": value.detach().clone().reshape(())}))

    def record_check(self, label: str, ok: bool) -> None:
        """A property only the zero_ext run can check (the reference records True)."""
        self.checkpoints.append((label, {"ok": torch.tensor(bool(ok) or self.reference)}))

    def record_checks(self, labels: List[str], checks: Optional[List[bool]] = None) -> None:
        """Several such properties; the reference passes no `checks`."""
        assert checks is not None or self.reference
        for label, ok in zip(labels, checks if checks is not None else [True] * len(labels)):
            self.record_check(label, ok)


def mlp_loss(ctx: Context, model: nn.Module, step: int, salt: int = 0, branch_on_rank0: bool = False) -> torch.Tensor:
    total = 0.0
    for r, w in ctx.participants():
        x, y = batch(step, r, ctx.world, salt)
        out = model(x, use_branch=branch_on_rank0 and r == 0) if branch_on_rank0 else model(x)
        total = total + w * F.mse_loss(out, y)
    return total


def step_and_record(ctx: Context, model: nn.Module, opt, step: int) -> None:
    """Records the gradients, steps, zeroes, records the parameters."""
    ctx.record_grads(f"step {step}", model)
    opt.step()
    opt.zero_grad()
    ctx.record_params(f"step {step}", model)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


# AdamW for parameters whose gradients can be near zero: low-precision
# gradients, or fp32 ones whose terms cancel (an MoE expert's weights).
# Adam's step lr * m/(sqrt(v)+eps) is scale-free where |g| >> eps and has
# slope 1/eps at g = 0 (up to 2/eps once m and v average over steps), so a
# gradient off by d (another reduction order, another CPU) moves its
# parameter by up to ~2 lr d / max(|g|, eps). With torch's eps=1e-8 an fp32
# gradient of 1e-6 off by 1e-9 moves it by 1e-5 (5e-6 seen on one CPU,
# beyond a small parameter's RTOL/ATOL); a low-precision gradient that
# rounds to zero on one side only, by lr. With eps = lr = 1e-2 a step adds
# at most 2 d: the parameters stay within the gradients' own tolerance.
def conditioned_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, eps=1e-2, weight_decay=0.1)


def _mlp_training(ctx: Context, model: nn.Module, make_optimizer, steps: int, **loss_kwargs) -> None:
    """The plain loop: one mlp_loss backward per step, recorded."""
    model, opt = ctx.wrap(model, make_optimizer(model))
    for step in range(steps):
        mlp_loss(ctx, model, step, **loss_kwargs).backward()
        step_and_record(ctx, model, opt, step)


def stage1_keeps_full_staging(ctx: Context, offload: bool = False, reduce_dtype=torch.float32) -> bool:
    """Stage 1 keeps a full fp32 staging buffer per bucket, unless its rank
    is alone in its group (world size 1), where gradients stage straight
    into the gradient shard ([Note: one rank's staging is its accumulator]):
    not with offload or a reduction dtype other than fp32."""
    alone = ctx.world == 1 and not offload and reduce_dtype == torch.float32
    return ctx.stage == 1 and not alone
