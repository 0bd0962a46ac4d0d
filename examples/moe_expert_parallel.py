"""A small mixture-of-experts language model with expert parallelism: each
rank holds experts / ep of every MoE layer's experts, tokens travel to their
expert's rank and back by all-to-all, and zero_ext shards the experts over
the ranks that hold the same experts (expert_process_group) and every other
parameter over all data-parallel ranks.

    torchrun --nproc-per-node 4 examples/moe_expert_parallel.py --ep 2 --stage 3
    torchrun --nproc-per-node 4 examples/moe_expert_parallel.py --ep 2 --stage 3 --save /tmp/moe-ckpt
    python examples/moe_expert_parallel.py --reference --world 4    # one process, the global batch

The mesh is torchtitan's: (dp_mod_ep, ep) over the data-parallel ranks;
process_group is every rank (dp), expert_process_group=mesh["dp_mod_ep"]. The
router sends each token to one expert (top-1, weighted by its softmax
probability); an expert no token reached still runs, on zero tokens, so
every expert gets a gradient (zeros), as a grouped GEMM does.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with its own backward (the same exchange, the
    split sizes swapped): the tokens' way to their experts and back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: List[int], receive: List[int], group) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = x.new_empty((sum(receive),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None


def _local(weight: torch.Tensor) -> torch.Tensor:
    """An expert weight as this rank computes with it: its local experts (a DTensor's local part)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class MoE(nn.Module):
    """Top-1 routed experts, packed: w1 (experts, dim, hidden), w2 (experts,
    hidden, dim). With an ep group, w1 and w2 are DTensors Shard(0) over it
    and tokens are dispatched by all-to-all."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)
        self.ep_group: Optional[dist.ProcessGroup] = None
        # As many MoE loops do: an expert no token reached is not run (its
        # weights then get no gradient on this rank), and the router may be
        # held to the first `routed` experts (tests: experts that get nothing).
        self.skip_empty = False
        self.routed = experts

    def _experts(self, x: torch.Tensor, which: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Each token through its expert (`which`: an index into w1/w2), every expert run (zero tokens too)."""
        order = torch.argsort(which, stable=True)
        counts = torch.bincount(which, minlength=w1.shape[0]).tolist()
        outs = [chunk.new_zeros(0, w2.shape[-1]) if self.skip_empty and chunk.shape[0] == 0
                else F.gelu(chunk @ w1[e]) @ w2[e] for e, chunk in enumerate(x[order].split(counts))]
        # On x * 0, not a fresh zeros: the result stays in x's graph even when no
        # expert ran here, so every rank's backward runs the dispatch's
        # all-to-all back (a collective) as every other rank's does.
        return x.mul(0).index_copy(0, order, torch.cat(outs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        if self.routed < self.experts:
            logits = logits.masked_fill(torch.arange(self.experts) >= self.routed, float("-inf"))
        gate, expert = F.softmax(logits, dim=-1).max(dim=-1)
        w1, w2 = _local(self.w1), _local(self.w2)
        if self.ep_group is None:
            y = self._experts(x, expert, w1, w2)
        else:
            y = self._dispatched(x, expert, w1, w2)
        return (y * gate.unsqueeze(-1)).reshape(shape)

    def _dispatched(self, x: torch.Tensor, expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Expert parallel: each token to the rank of its expert and back."""
        group, per_rank = self.ep_group, w1.shape[0]
        ep = dist.get_world_size(group)
        order = torch.argsort(expert, stable=True)  # grouped by destination rank, then local expert
        send = torch.bincount(expert // per_rank, minlength=ep)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=group)
        send_sizes, receive_sizes = send.tolist(), receive.tolist()
        local_expert = (expert[order] % per_rank).contiguous()
        arrived_expert = local_expert.new_empty(sum(receive_sizes))
        dist.all_to_all_single(arrived_expert, local_expert, receive_sizes, send_sizes, group=group)
        arrived = _AllToAll.apply(x[order], send_sizes, receive_sizes, group)
        done = self._experts(arrived, arrived_expert, w1, w2)
        back = _AllToAll.apply(done, receive_sizes, send_sizes, group)
        return torch.zeros_like(x).index_copy(0, order, back)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.moe = MoE(dim, hidden, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoELM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64, experts: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, hidden, experts) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def expert_parallel(model: nn.Module, ep_mesh) -> nn.Module:
    """Each MoE's experts split over the ep mesh (DTensor Shard(0): this
    rank keeps its experts of the same full weights), tokens dispatched
    over its group: what torchtitan's expert parallelism does."""
    from torch.distributed.tensor import DTensor, Shard
    rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
    for module in model.modules():
        if isinstance(module, MoE):
            if module.experts % size:
                raise SystemExit(f"{module.experts} experts do not split over ep {size}")
            for name in ("w1", "w2"):
                local = getattr(module, name).detach().chunk(size)[rank].clone()
                setattr(module, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))
            module.ep_group = ep_mesh.get_group()
    return model


def batch(step: int, global_batch: int, context: int, vocab: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (global_batch, context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size (divides the world)")
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--save", help="write a DCP checkpoint there at the end")
    parser.add_argument("--reference", action="store_true", help="one process over the global batch")
    parser.add_argument("--world", type=int, default=4, help="with --reference: the world it stands for")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = MoELM(experts=args.experts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if args.reference:
        for step in range(args.steps):
            x, y = batch(step, args.global_batch, args.context, 64)
            loss = loss_of(model, x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"step {step}: loss {loss.item():.4f}")
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import zero_ext
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world // args.ep, args.ep), mesh_dim_names=("dp_mod_ep", "ep"))
    expert_parallel(model, mesh["ep"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = zero_ext.wrap(model, optimizer, stage=args.stage, expert_process_group=mesh["dp_mod_ep"])
    per = args.global_batch // world
    for step in range(args.steps):
        x, y = batch(step, args.global_batch, args.context, 64)
        loss = loss_of(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step}: loss {mean.item() / world:.4f}")
    report = zero_ext.memory_report(model, optimizer, by_dimension=True)
    if rank == 0:
        print(f"rank 0 holds {report['params']} parameter bytes of the model's {report['params_full']} "
              f"(its experts and the rest: {report['params_ep_local']}), traffic {zero_ext.traffic(model)}")
    if args.save:
        zero_ext.save(args.save, model, optimizer, format="dcp")
        if rank == 0:
            print(f"saved {args.save}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
