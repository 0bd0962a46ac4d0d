"""Train a small Llama-style language model with 3-D parallelism: pipeline
stages ("pp", torch.distributed.pipelining), tensor parallelism inside each
stage ("tp", parallelize_module), and zero_ext sharding what is left over
the data-parallel dimension ("dp", stage 3 by default).

    torchrun --nproc-per-node 8 examples/pipeline_3d.py      # pp 2 x dp 2 x tp 2
    python examples/pipeline_3d.py                           # spawns 8 gloo CPU processes itself
    python examples/pipeline_3d.py --reference               # one process, the whole model, the global batch

The model is examples/tensor_parallel.py's Llama with its blocks kept by
index (a ModuleDict, as torchtitan keeps them), so that each rank's stage is
the whole model with the other stages' blocks deleted: every stage keeps the
model's own parameter names, and a checkpoint holds the whole model. Each
stage's blocks are made tensor parallel over mesh["tp"] (the Megatron plan),
the stage is wrapped with

    zero_ext.wrap(stage_module, optimizer, stage=3, process_group=mesh["dp"], pipeline_group=mesh["pp"])

and handed to a PipelineStage; 1F1B runs --microbatches microbatches of
each dp rank's slice of the batch. zero_ext reduces the gradients once per
step (at optimizer.clip_grad_norm_, which clips by the norm of the whole
model: every stage, dp rank and tp shard). The last stage's ranks log the
loss of the global batch (the mean of its microbatches' over dp) and the
norm; --reference trains the same model (same seed) on one process over
the whole global batch and logs the same lines, the curve zero_ext's should
follow to the printed digit. --save DIR writes one DCP checkpoint of every
rank at the end (zero_ext.save(..., format="dcp")), which `python -m
zero_ext.convert DIR model.pt` turns into the whole model's state_dict.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import zero_ext  # noqa: E402
from tensor_parallel import Llama, free_port, tp_plan  # noqa: E402
from train_lm import batches  # noqa: E402


class PipelinedLlama(Llama):
    """Llama with its blocks in a ModuleDict by index, and the embedding,
    final norm and head None on the stages without them."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int):
        super().__init__(vocab, dim, layers, heads)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(self.layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def keep_stage(model: PipelinedLlama, pp_rank: int, pp: int) -> PipelinedLlama:
    """This rank's stage, in place: its blocks (an equal share, in order);
    the embedding on the first stage, the final norm and head on the last."""
    per = len(model.layers) // pp
    for name in list(model.layers):
        if int(name) // per != pp_rank:
            del model.layers[name]
    if pp_rank != 0:
        model.tok_embeddings = None
    if pp_rank != pp - 1:
        model.norm = None
        model.output = None
    return model


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def corpus():
    text = open(os.path.join(HERE, "data", "corpus.txt"), encoding="utf-8").read()
    chars = sorted(set(text))
    return chars, torch.tensor([chars.index(c) for c in text], dtype=torch.long)


def log(step: int, loss: float, norm: float, args) -> None:
    if step % args.log_every == 0 or step in (1, args.steps):
        print(f"step {step:3d}  loss {loss:.4f}  grad norm {norm:.4f}", flush=True)


def reference(args) -> None:
    """One process, the whole model, the whole global batch, plain AdamW."""
    torch.set_num_threads(args.threads)
    chars, data = corpus()
    torch.manual_seed(0)
    model = PipelinedLlama(len(chars), args.dim, args.layers, args.heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter Llama, one process (--reference)",
          flush=True)
    for step in range(1, args.steps + 1):
        x, y = batches(data, args.context, args.dp * args.batch, 0, 1, step)  # the global batch, dp slices in order
        loss = loss_fn(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        log(step, loss.item(), float(norm), args)


def train(args) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import parallelize_module

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.pp * args.dp * args.tp:
        raise SystemExit(f"{world} processes for pp {args.pp} x dp {args.dp} x tp {args.tp}")
    mesh = init_device_mesh("cpu", (args.pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    last = pp_rank == args.pp - 1
    chars, data = corpus()

    torch.manual_seed(0)  # the same weights on every rank: each keeps its stage's
    model = keep_stage(PipelinedLlama(len(chars), args.dim, args.layers, args.heads), pp_rank, args.pp)
    for block in model.layers.values():
        parallelize_module(block, mesh["tp"], tp_plan())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model, optimizer = zero_ext.wrap(model, optimizer, stage=args.stage, process_group=mesh["dp"],
                                     pipeline_group=mesh["pp"])
    stage = PipelineStage(model, pp_rank, args.pp, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    logs = last and dp_rank == 0 and mesh["tp"].get_local_rank() == 0
    if rank == 0:
        print(f"pp {args.pp} x dp {args.dp} x tp {args.tp}, zero_ext stage {args.stage}, 1F1B over "
              f"{args.microbatches} microbatches of {args.batch} // {args.microbatches} sequences per dp rank",
              flush=True)

    for step in range(1, args.steps + 1):
        x, y = batches(data, args.context, args.batch, dp_rank, args.dp, step)
        optimizer.zero_grad()
        losses = []
        if pp_rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        norm = optimizer.clip_grad_norm_(1.0)  # the whole model's norm; gradients reduced here, once
        optimizer.step()
        if last:  # the global batch's loss: the microbatches' mean, averaged over dp
            value = torch.stack(losses).mean().detach()
            dist.all_reduce(value, group=mesh["dp"].get_group())
            if logs:
                log(step, value.item() / args.dp, float(norm), args)
    if args.save:
        zero_ext.save(args.save, model, optimizer, format="dcp")
        if rank == 0:
            print(f"saved {args.save}", flush=True)
    dist.destroy_process_group()


def _spawned(local_rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="sequences per dp rank per step")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--save", help="a DCP checkpoint of every rank, written at the end")
    parser.add_argument("--reference", action="store_true",
                        help="train the whole model on one process over the global batch instead")
    args = parser.parse_args()
    if args.layers % args.pp or args.batch % args.microbatches or args.heads % args.tp:
        raise SystemExit("--layers must split over --pp, --batch over --microbatches, --heads over --tp")
    if args.reference:
        reference(args)
    elif "RANK" in os.environ:  # torchrun
        train(args)
    else:
        world = args.pp * args.dp * args.tp
        mp.spawn(_spawned, args=(world, free_port(), args), nprocs=world)


if __name__ == "__main__":
    main()
