"""The models of the tensor parallel scenarios and how each is made tensor
parallel over mesh["tp"] with torch's parallelize_module: TPNet (column
and row parallel blocks), SequenceParallelNet (SequenceParallel norms) and
MoENet (packed experts split whole over tp)."""
from __future__ import annotations

import torch
import torch.nn as nn


BATCH, IN, HIDDEN, FFN, OUT = 4, 6, 8, 12, 3
BUCKET_MB = 0.0005


class Block(nn.Module):
    """norm -> up (column parallel) -> tanh -> down (row parallel), residual."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(self.norm(h))))


class TPNet(nn.Module):
    """inp and out stay plain (replicated over tp); each block's up and down
    are made tensor parallel. FFN 12 over tp 4 splits evenly; HIDDEN 8 too."""

    def __init__(self, seed: int = 0, blocks: int = 2):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.out = nn.Linear(HIDDEN, OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def parallelize(model: TPNet, tp_mesh) -> TPNet:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


SEQ, EXPERTS = 4, 4


class SequenceParallelNet(nn.Module):
    """Sequence parallel (Megatron-SP): the norms see this rank's part of
    the sequence (SequenceParallel), up gathers it (ColwiseParallel from
    Shard(1)), down scatters it back (RowwiseParallel to Shard(1)); the
    norm weights are replicated DTensors whose gradients come out Partial."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(HIDDEN, OUT)
        self.tp_mesh = None
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, SEQ, IN)
        h = self.inp(x)
        if self.tp_mesh is not None:  # this rank's part of the sequence (its backward gathers the gradient)
            from torch.distributed.tensor import DTensor, Replicate, Shard
            h = DTensor.from_local(h, self.tp_mesh, [Replicate()]).redistribute(self.tp_mesh, [Shard(1)]).to_local()
        for block in self.blocks:
            h = block(h)
        if self.tp_mesh is not None:  # the whole sequence again (differentiable)
            from torch.distributed.tensor import DTensor, Shard
            h = DTensor.from_local(h, self.tp_mesh, [Shard(1)]).full_tensor()
        return self.out(h).mean(dim=1)


def parallelize_sequence(model: SequenceParallelNet, tp_mesh) -> SequenceParallelNet:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                            "down": RowwiseParallel(output_layouts=Shard(1))})
    model.tp_mesh = tp_mesh
    return model


class PackedExperts(nn.Module):
    """EXPERTS experts packed in two parameters, (E, HIDDEN, FFN) and (E,
    FFN, HIDDEN); made expert parallel by splitting them along dim 0 over
    the tp dimension (each tp rank holds whole experts). Tokens go to one
    expert each, weighted by a router's gate; an expert no token picks gets
    no gradient that step."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(EXPERTS, HIDDEN, FFN))
        self.w2 = nn.Parameter(torch.empty(EXPERTS, FFN, HIDDEN))

    def forward(self, x: torch.Tensor, route: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        w1, w2, first, mesh = self.w1, self.w2, 0, None
        if type(w1).__name__ == "DTensor":
            from torch.distributed.tensor import DTensor, Partial, Replicate
            mesh = w1.device_mesh
            w1, w2 = w1.to_local(), w2.to_local()
            first = mesh.get_local_rank() * w1.shape[0]
            # The same tokens on every tp rank; each rank's experts give a part
            # of their gradient, summed over tp in backward.
            x = DTensor.from_local(x, mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            gate = DTensor.from_local(gate, mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        out = torch.zeros_like(x)
        for e in range(w1.shape[0]):
            picked = route == first + e
            if bool(picked.any()):
                y = torch.tanh(x[picked] @ w1[e]) @ w2[e]
                out = out.index_add(0, picked.nonzero().view(-1), y * gate[picked, first + e:first + e + 1])
        if mesh is not None:  # each rank's experts' part, summed over tp
            # x and gate in every rank's graph, whatever the routing: their
            # backward all-reduces over tp run on every tp rank alike.
            out = out + 0.0 * (x.sum() + gate.sum())
            out = DTensor.from_local(out, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
        return out


class MoENet(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS)
        self.experts = PackedExperts()
        self.out = nn.Linear(HIDDEN, OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.routed = EXPERTS - 1  # experts tokens go to: the last one is skipped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        gate = torch.softmax(self.router(h), dim=-1)
        # Fixed routing (not the gate's argmax, which rounding could flip):
        # token k goes to expert k % routed (EXPERTS - 1: one expert is skipped).
        route = torch.arange(h.shape[0]) % self.routed
        return self.out(h + self.experts(h, route, gate))


def parallelize_experts(model: MoENet, tp_mesh) -> MoENet:
    from torch.distributed.tensor import Shard, distribute_tensor
    for name in ("w1", "w2"):
        param = getattr(model.experts, name)
        model.experts.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), tp_mesh, [Shard(0)])))
    return model
