"""Per-backward bookkeeping overhead: many small parameters, almost no compute.

    python benchmarks/backward_overhead.py                 # 2 gloo ranks
    python benchmarks/backward_overhead.py --params 4000 --world 1

The model is a chain of --params parameters of --numel elements each (a scale
per parameter), so a backward is dominated by what each system does per
gradient: hooks, bucket copies, the end-of-backward work. Each system runs the
same forward/backward round-robin in one process group (an optimizer step with
lr 0 follows each backward, outside the timed region, so that DeepSpeed's
bookkeeping is in its usual state; DeepSpeed's backward is engine.backward,
the only form that runs its end-of-backward work);
the table gives the median time per backward and the extra over plain
PyTorch without communication (hooks, copies and the reduction of
params x numel x 4 bytes, 8 MiB by default). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import zero_ext
from _ranks import run_on_ranks

DEEPSPEED_SYSTEMS = ("deepspeed-1", "deepspeed-2", "deepspeed-3")


class Chain(nn.Module):
    def __init__(self, n: int, numel: int):
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(numel)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.scales:
            x = x * s
        return x


def build(system: str, args, world: int):
    """(forward, backward(loss), untimed step) for one system."""
    model = Chain(args.params, args.numel)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def plain_backward(loss):
        loss.backward()

    def clear_grads():
        opt.step()
        opt.zero_grad(set_to_none=True)

    if system == "plain":
        return model, plain_backward, clear_grads
    if system == "ddp":
        return (DistributedDataParallel(model) if world > 1 else model), plain_backward, clear_grads
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)), reshard_after_forward=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        return model, plain_backward, clear_grads
    if system in DEEPSPEED_SYSTEMS:
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 9,
                  "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": int(system[-1])}}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        return engine, engine.backward, engine.step
    model, opt = zero_ext.wrap(model, opt, stage=int(system[-1]))
    return model, plain_backward, clear_grads


def time_backwards(args, rank, world):
    """Median seconds per backward of each system on this rank."""
    if any(name in DEEPSPEED_SYSTEMS for name in args.systems):
        import deepspeed

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        deepspeed.init_distributed(dist_backend="gloo")
    systems = {name: build(name, args, world) for name in args.systems}
    x = torch.ones(args.numel)
    times = {name: [] for name in systems}
    for it in range(args.warmup + args.iters):
        for name, (forward, backward, untimed_step) in systems.items():
            loss = forward(x).sum()
            dist.barrier()
            start = time.perf_counter()
            backward(loss)
            elapsed = time.perf_counter() - start
            if it >= args.warmup:
                times[name].append(elapsed)
            untimed_step()
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--params", type=int, default=2000)
    parser.add_argument("--numel", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--systems", nargs="+",
                        default=["plain", "ddp", "fsdp2", "deepspeed-1", "deepspeed-2", "deepspeed-3",
                                 "zero_ext-0", "zero_ext-1", "zero_ext-2", "zero_ext-3"])
    parser.add_argument("--port", type=int, default=29618, help="DeepSpeed's MASTER_PORT")
    args = parser.parse_args()
    if any(name in DEEPSPEED_SYSTEMS for name in args.systems):
        # DeepSpeed reads the rendezvous from the environment even when the
        # process group exists; spawned ranks inherit these.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    per_rank = run_on_ranks(args.world, time_backwards, args)
    print(f"{args.params} parameters x {args.numel} elements, world size {args.world} (gloo, CPU), "
          f"median of {args.iters} backward passes")
    base = statistics.mean(r["plain"] for r in per_rank) if "plain" in args.systems else None
    print(f"{'system':<12} {'ms/backward':>12} {'extra ms':>9} {'us/param':>9}")
    for name in args.systems:
        ms = 1e3 * statistics.mean(r[name] for r in per_rank)
        extra = ms - 1e3 * base if base is not None else float("nan")
        print(f"{name:<12} {ms:>12.2f} {extra:>9.2f} {1e3 * extra / args.params:>9.2f}")


if __name__ == "__main__":
    main()
