"""Where a training step's time goes, per system: plain PyTorch (world 1) or
DDP, and zero_ext stages 0-3, measured in one run.

    python benchmarks/phases.py --world 1
    python benchmarks/phases.py --world 2 --systems ddp zero_ext-0 zero_ext-2
    python benchmarks/phases.py --world 2 --model llama-tiny --systems ddp fsdp2-s2 fsdp2 zero_ext-2 zero_ext-3
    python benchmarks/phases.py --world 2 --model small-blocks

Each system trains the same model on the same token batches: TinyGPT
(examples/train_lm.py, shaped by --dim, --layers, ...), a preset of
benchmarks/_models.py (llama-tiny: RMSNorm, grouped-query attention, SwiGLU,
d=256, 4 layers; needs transformers), or small-blocks (--blocks residual
tanh(Linear(32, 32)) blocks between an embedding and a head: per-module
overhead). Systems: plain (world 1), ddp, fsdp2 (fully_shard on each block
and the root, resharded after forward: ZeRO-3), fsdp2-s2 (the same kept
gathered after forward: ZeRO-2's traffic), zero_ext-N (stage N). The
systems take their steps in interleaved rounds (so drift in machine load
hits all alike). Per step, wall time of each phase:

  forward     the model's forward and the loss
  backward    loss.backward(): compute, zero_ext's gradient hooks, the
              reductions it overlaps, its epilogue (waits)
  step        optimizer.step() (zero_ext: the flat-shard step, stages 1-2's
              all-gather of updated shards, master-to-parameter copies)
  zero_grad   optimizer.zero_grad()

and, from one more step under torch.profiler (CPU), the time inside
zero_ext's own ranges (their totals, children included; the profiler slows
everything a little):

  hooks       zero_ext::accumulate_grad: each gradient copied or added into
              its bucket
  gather      zero_ext::gather_unit + release_unit (stage 3): the all-gather
              of a unit, waiting for it, and its release
  epilogue    zero_ext::run_epilogue: the flush of buckets not yet launched,
              the wait for every reduction, the exchange with the other ranks
  opt         zero_ext::step: the optimizer over zero_ext's segments and the
              refresh of the parameters from the masters

The table gives the median over rounds of each system's per-round median,
with the range over rounds for the whole step. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_lm import TinyGPT  # noqa: E402

from _models import PRESETS, blocks_of, build_model  # noqa: E402
from _ranks import add_tiny_gpt_arguments, run_on_ranks  # noqa: E402

import zero_ext  # noqa: E402

PHASES = ("forward", "backward", "step", "zero_grad")
RANGES = {"hooks": ("zero_ext::accumulate_grad",), "gather": ("zero_ext::gather_unit", "zero_ext::release_unit"),
          "epilogue": ("zero_ext::run_epilogue",), "opt": ("zero_ext::step",)}


class SmallBlocks(nn.Module):
    """Many small residual blocks between an embedding and a head."""

    def __init__(self, vocab: int, blocks: int, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def vocab_of(args) -> int:
    return PRESETS[args.model].vocab if args.model in PRESETS else args.vocab


def model_and_blocks(args):
    torch.manual_seed(0)
    if args.model == "tinygpt":
        model = TinyGPT(args.vocab, args.dim, args.layers, args.heads, args.context)
        return model, list(model.blocks)
    if args.model == "small-blocks":
        model = SmallBlocks(args.vocab, args.blocks)
        return model, list(model.blocks)
    model = build_model(args.model, seed=0)
    return model, blocks_of(model)


def build(args, system, world):
    model, blocks = model_and_blocks(args)
    if system.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=system == "fsdp2")
        fully_shard(model, mesh=mesh, reshard_after_forward=system == "fsdp2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    if system in ("plain", "ddp") or system.startswith("fsdp2"):
        trained = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb) if system == "ddp" else model
        return trained, opt
    return zero_ext.wrap(model, opt, stage=int(system.split("-")[1]), bucket_mb=args.bucket_mb)


def batch(args, rank, world, step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab_of(args), (world * args.batch, args.context + 1), generator=g)
    mine = tokens[rank * args.batch:(rank + 1) * args.batch]
    return mine[:, :-1], mine[:, 1:]


def one_step(model, opt, x, y):
    """Wall seconds of each phase."""
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    opt.zero_grad()
    t4 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "zero_grad": t4 - t3}


def profiled_ranges(model, opt, x, y):
    """Milliseconds inside zero_ext's ranges during one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one_step(model, opt, x, y)
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    return {name: sum(totals.get(k, 0.0) for k in keys) / 1e3 for name, keys in RANGES.items()}


def run(args, rank, world):
    built = {system: build(args, system, world) for system in args.systems}
    step = 0
    for _ in range(args.warmup):
        x, y = batch(args, rank, world, step)
        step += 1
        for system, (model, opt) in built.items():
            one_step(model, opt, x, y)
    rounds = {system: [] for system in args.systems}
    for _ in range(args.rounds):
        for system, (model, opt) in built.items():
            times = []
            for k in range(args.steps):
                x, y = batch(args, rank, world, step + k)
                if world > 1:
                    dist.barrier()
                times.append(one_step(model, opt, x, y))
            rounds[system].append({p: statistics.median(t[p] for t in times) * 1e3 for p in PHASES})
        step += args.steps
    out = {}
    for system, (model, opt) in built.items():
        x, y = batch(args, rank, world, step)
        per_round = rounds[system]
        totals = [sum(r.values()) for r in per_round]
        out[system] = {"phases": {p: statistics.median(r[p] for r in per_round) for p in PHASES},
                       "total": statistics.median(totals), "range": [min(totals), max(totals)],
                       "ranges": profiled_ranges(model, opt, x, y) if system.startswith("zero_ext") else {}}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--systems", nargs="+", default=None,
                        help="plain (world 1), ddp, fsdp2, fsdp2-s2, zero_ext-N "
                             "(default: plain or ddp, then stages 0-3)")
    parser.add_argument("--model", default="tinygpt", choices=["tinygpt", "small-blocks"] + sorted(PRESETS))
    parser.add_argument("--blocks", type=int, default=1000, help="small-blocks: how many")
    add_tiny_gpt_arguments(parser)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per system per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.systems is None:
        args.systems = ["plain" if args.world == 1 else "ddp"] + [f"zero_ext-{s}" for s in range(4)]
    per_rank = run_on_ranks(args.world, run, args)
    mean = lambda values: statistics.mean(values)  # noqa: E731 - over ranks
    base = mean(r[args.systems[0]]["total"] for r in per_rank)
    shape = {"tinygpt": f"TinyGPT d={args.dim} x{args.layers}",
             "small-blocks": f"{args.blocks} small blocks"}.get(args.model, args.model)
    print(f"{shape}, world {args.world} (gloo, CPU, 1 thread per rank), "
          f"{args.batch}x{args.context} tokens per rank; ms, median of {args.rounds} rounds x {args.steps} steps")
    header = (f"{'system':<12} {'step':>8} {'range':>15} {'vs ' + args.systems[0]:>9} "
              + " ".join(f"{p:>9}" for p in PHASES) + " | " + " ".join(f"{r:>8}" for r in RANGES))
    print(header)
    print("-" * len(header))
    for system in args.systems:
        total = mean(r[system]["total"] for r in per_rank)
        low = mean(r[system]["range"][0] for r in per_rank)
        high = mean(r[system]["range"][1] for r in per_rank)
        phases = " ".join(f"{mean(r[system]['phases'][p] for r in per_rank):>9.1f}" for p in PHASES)
        ranges = " ".join(f"{mean(r[system]['ranges'][k] for r in per_rank):>8.1f}" if per_rank[0][system]["ranges"]
                          else f"{'-':>8}" for k in RANGES)
        print(f"{system:<12} {total:>8.1f} {f'{low:.1f}-{high:.1f}':>15} {total / base:>8.3f}x {phases} | {ranges}")


if __name__ == "__main__":
    main()
