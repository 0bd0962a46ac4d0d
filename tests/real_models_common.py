"""The models the real-model scenarios train off the dense path: MoE layers
whose routing skips experts differently on every rank (inside decoder
blocks, or held by the model itself), each rank's tokens and the language
model loss, and a check that the ranks really ran different experts."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import parity_scenarios as ps
from parity_scenarios import BATCH, DIM, SEQ, VOCAB


N_EXPERTS = 4
ONE_UNIT_PER_BLOCK_MB = 1e-4  # ~100 bytes: no two blocks merge into one unit
CHECK_TIMEOUT = 20.0  # seconds; bounds any wait a failing scenario leaves behind


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(h)))


class MoE(nn.Module):
    """Top-1 routing by a learned gate, as transformers v4 and most third-party
    code write it: experts in an nn.ModuleList, one that no token picks does
    not run. `only`: the experts this forward may run (a rank-dependent
    choice, to make ranks disagree on purpose)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, N_EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(N_EXPERTS))
        self.ran: List[List[int]] = []
        self.only: Optional[List[int]] = None
        self.dense = False  # every expert on every token (weighted): no expert skipped

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.reshape(-1, DIM)
        logits = self.gate(tokens)
        if self.dense:
            weights = logits.softmax(-1)
            self.ran.append(list(range(N_EXPERTS)))
            return sum(weights[:, i, None] * e(tokens) for i, e in enumerate(self.experts)).reshape(h.shape)
        if self.only is not None:
            mask = torch.full((N_EXPERTS,), float("-inf"))
            mask[self.only] = 0.0
            logits = logits + mask
        weight, choice = logits.softmax(-1).max(-1)
        out = torch.zeros_like(tokens)
        ran = []
        for i, expert in enumerate(self.experts):
            picked = choice == i
            if picked.any():
                out = out.index_put((picked,), expert(tokens[picked]) * weight[picked, None])
                ran.append(i)
        self.ran.append(ran)
        return out.reshape(h.shape)


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mix = nn.Linear(DIM, DIM)  # stands for attention: runs every step
        self.moe = MoE()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + torch.tanh(self.mix(self.norm(h)))
        return h + self.moe(h)


class MoEModel(nn.Module):
    """Embedding, decoder blocks each holding an MoE, a head."""

    def __init__(self, n_blocks: int = 3, seed: int = 21, std: float = 0.5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, VOCAB)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" not in name:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def moes(self) -> List[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class FlatMoEModel(MoEModel):
    """An MoE outside any block (the model holds it directly): its experts are
    repeated children of a ModuleList, yet never default units."""

    def __init__(self):
        super().__init__(n_blocks=0, seed=22)
        g = torch.Generator().manual_seed(24)  # a seed whose routing differs between ranks at worlds 2 and 4
        self.inner = nn.Linear(DIM, DIM)
        self.moe = MoE()
        with torch.no_grad():
            for p in list(self.inner.parameters()) + list(self.moe.parameters()):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(self.embed(tokens)))
        return self.head(h + self.moe(h))


def tokens_of(world: int, step: int, rank: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(700 + 31 * step + salt)
    return torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=g)[rank * BATCH:(rank + 1) * BATCH]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def global_loss(ctx: ps.Context, model: nn.Module, step: int) -> torch.Tensor:
    return sum(w * lm_loss(model, tokens_of(ctx.world, step, r)) for r, w in ctx.participants())


def _ranks_ran_different_experts(ctx: ps.Context, model: nn.Module) -> bool:
    """Whether, in the forwards since the last call, some rank ran a set of
    experts another did not (the point of the scenario)."""
    ran = torch.zeros(len(model.moes()), N_EXPERTS)
    for k, moe in enumerate(model.moes()):
        for forward in moe.ran:
            ran[k, forward] += 1
        moe.ran.clear()
    if ctx.reference or ctx.world == 1:
        return True
    every = [torch.zeros_like(ran) for _ in range(ctx.world)]
    dist.all_gather(every, ran)
    return any(not torch.equal(every[0], other) for other in every[1:])
