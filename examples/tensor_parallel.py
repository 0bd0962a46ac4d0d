"""Train a small Llama-style language model with 2-D parallelism: torch's
tensor parallelism splits every block over one dimension of a device mesh
("tp"), zero_ext shards the result over the other ("dp", stage 3 by default).

    torchrun --nproc-per-node 4 examples/tensor_parallel.py             # dp 2 x tp 2
    torchrun --nproc-per-node 4 examples/tensor_parallel.py --tp 4      # dp 1 x tp 4
    python examples/tensor_parallel.py                                  # spawns 4 gloo CPU processes itself

The model: token embedding, --layers blocks of RMSNorm + causal attention
(q/k/v/o projections without bias, rotary positions,
scaled_dot_product_attention) + RMSNorm + SwiGLU MLP (gate/up/down), a final
RMSNorm and the output head. Each block is made tensor parallel by
``torch.distributed.tensor.parallel.parallelize_module`` over mesh["tp"]
(the Megatron plan: q/k/v and gate/up split by output features, o and down
by input features, so a block costs two all-reduces over tp in forward and
two in backward); attention then sees n_heads // tp heads on each rank. The
model and its AdamW go to ``zero_ext.wrap(..., process_group=mesh["dp"])``,
and training is the plain loop:

    loss.backward(); optimizer.clip_grad_norm_(1.0); optimizer.step(); optimizer.zero_grad()

Each dp rank reads its own slice of every batch (examples/data/corpus.txt,
characters as tokens); the tp ranks of one dp group read the same slice, as
tensor parallelism needs. Rank 0 logs the loss of the global batch.

--check compares, before training, one forward and backward of the tensor
parallel model on the dp slices against the same model (same seed) on one
process over the whole global batch: the loss and every gradient.
--reference trains without zero_ext: plain AdamW over torch's tensor
parallel parameters, gradients averaged over dp by hand (all_reduce) and
clipped by hand (torch.nn.utils.clip_grad_norm_ refuses the mix of DTensor
and plain gradients that tensor parallelism alone leaves); its losses are the curve
zero_ext's should follow.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import zero_ext  # noqa: E402
from train_lm import batches  # noqa: E402


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of (batch, seq, heads, head_dim) queries or keys."""
    t, d = x.shape[1], x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = torch.outer(torch.arange(t, dtype=torch.float32, device=x.device), freqs)[None, :, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: all of them on one process, n_heads // tp after the
        # column-wise split of wq/wk/wv (whose outputs are local tensors).
        q = rotary(self.wq(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        k = rotary(self.wk(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 the gate, w3 up, w2 down."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int = 0):
        super().__init__()
        if not hidden:  # Llama's 2/3 of 4 x dim, rounded up to a multiple of 64
            hidden = 64 * math.ceil(int(8 * dim / 3) / 64)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tp_plan():
    """torch's Megatron-style plan for one block (torchtitan's, without sequence parallelism)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def parallelize(model: Llama, tp_mesh) -> Llama:
    """Each block tensor parallel over `tp_mesh`, in place; embedding, norms
    and output head stay whole (replicated over tp)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.layers:
        parallelize_module(block, tp_mesh, tp_plan())
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective over its mesh); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def average_over_dp(model: nn.Module, dp_group, dp: int) -> None:
    """--reference: what data parallelism does for gradients, by hand."""
    for p in model.parameters():
        if p.grad is not None and dp > 1:
            g = local(p.grad)
            dist.all_reduce(g, group=dp_group)
            g /= dp


def clip_by_hand(params, max_norm: float) -> torch.Tensor:
    """--reference: torch.nn.utils.clip_grad_norm_ over a mix of DTensor
    (tensor parallel) and plain (replicated) gradients, which it refuses:
    the norm of a sharded gradient is its whole value's (an all-reduce over
    tp), a replicated one counts once."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.stack([full(torch.linalg.vector_norm(g)) for g in grads]).norm()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local(g).mul_(scale)
    return total


def check_parity(model, reference, data, args, mesh, dp_rank, dp, rank) -> None:
    """The tensor parallel model on the dp slices against `reference` (the
    same weights, one process) on the whole global batch: loss and gradients."""
    x, y = batches(data, args.context, args.batch, dp_rank, dp, 0)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    average_over_dp(model, mesh["dp"].get_group(), dp)
    value = loss.detach().clone()
    dist.all_reduce(value, group=mesh["dp"].get_group())
    value /= dp
    gx, gy = batches(data, args.context, dp * args.batch, 0, 1, 0)  # the global batch, in the same order
    expected = F.cross_entropy(reference(gx).flatten(0, 1), gy.flatten())
    expected.backward()
    theirs = dict(reference.named_parameters())
    grad_diff = torch.stack([(full(p.grad) - theirs[name].grad).abs().max() for name, p in model.named_parameters()])
    grad_diff = grad_diff.max()
    dist.all_reduce(grad_diff, op=dist.ReduceOp.MAX)  # the largest on any rank
    grad_scale = max(p.grad.abs().max().item() for p in reference.parameters())
    if rank == 0:
        print(f"--check: loss {value.item():.6f} (dp {dp} x tp {mesh['tp'].size()}) vs {expected.item():.6f} "
              f"(one process, global batch): |diff| {abs(value.item() - expected.item()):.2e}; "
              f"largest gradient |diff| {grad_diff:.2e} (largest gradient {grad_scale:.2e})", flush=True)
    model.zero_grad(set_to_none=True)


def train(args) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} processes")
    dp = world // args.tp
    if args.heads % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide --heads {args.heads}")
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()  # which slice of the batch; the same for the tp ranks of a dp group

    text = open(os.path.join(HERE, "data", "corpus.txt"), encoding="utf-8").read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    torch.manual_seed(0)  # the same weights on every rank
    model = Llama(len(chars), args.dim, args.layers, args.heads)
    n_params = sum(p.numel() for p in model.parameters())
    reference = copy.deepcopy(model) if args.check else None
    parallelize(model, mesh["tp"])
    if args.check:
        check_parity(model, reference, data, args, mesh, dp_rank, dp, rank)
        del reference

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    if args.reference:
        def clip(max_norm):
            return clip_by_hand(model.parameters(), max_norm)
    else:
        model, optimizer = zero_ext.wrap(model, optimizer, stage=args.stage, process_group=mesh["dp"])
        clip = optimizer.clip_grad_norm_
    if rank == 0:
        how = "without zero_ext (--reference)" if args.reference else f"zero_ext stage {args.stage} over dp"
        print(f"{n_params / 1e6:.2f}M-parameter Llama, dp {dp} x tp {args.tp} ({how}), "
              f"{dp} x {args.batch} sequences of {args.context} characters per step", flush=True)

    for step in range(1, args.steps + 1):
        x, y = batches(data, args.context, args.batch, dp_rank, dp, step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if args.reference:
            average_over_dp(model, mesh["dp"].get_group(), dp)
        norm = clip(1.0)
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()  # this dp slice's loss; the global batch's is their mean
        dist.all_reduce(value, group=mesh["dp"].get_group())
        if rank == 0 and (step % args.log_every == 0 or step in (1, args.steps)):
            print(f"step {step:3d}  loss {value.item() / dp:.4f}  grad norm {float(full(norm)):.4f}", flush=True)
    dist.destroy_process_group()


def _spawned(local_rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train(args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel degree; dp = processes / tp")
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4, help="sequences per dp rank per step")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--world", type=int, default=4, help="processes to spawn when not under torchrun")
    parser.add_argument("--check", action="store_true",
                        help="first compare one forward and backward against the same model on one process")
    parser.add_argument("--reference", action="store_true",
                        help="train without zero_ext (gradients averaged over dp by hand)")
    args = parser.parse_args()

    if "RANK" in os.environ:  # torchrun
        train(args)
    else:
        mp.spawn(_spawned, args=(args.world, free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
