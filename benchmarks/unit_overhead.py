"""Per-unit cost of stage 3: many tiny blocks, almost no compute.

    python benchmarks/unit_overhead.py --world 1        # plain, DDP, FSDP2, zero_ext stage 3
    python benchmarks/unit_overhead.py --world 2
    python benchmarks/unit_overhead.py --world 2 --blocks 200 --systems fsdp2 zero_ext-3 zero_ext-2

The model is --blocks nn.Linear(32, 32) blocks in an nn.ModuleList (2 parameters
each: 2000 for the default 1000 blocks), applied in turn to a small batch. So a
step is dominated by what each system does per block: hooks, a gather and a
release per unit, one reduction per unit. The systems:

  plain          the model, unwrapped (world size 1 only)
  ddp            DistributedDataParallel (also at world size 1: its reducer's cost)
  fsdp2          torch.distributed.fsdp.fully_shard on each block, then the root
                 (one parameter group per block, resharded after forward)
  fsdp2-1group   fully_shard on the root only: one group holding every parameter
  zero_ext-N     zero_ext.wrap(stage=N), default units (stage 3: each block, by
                 the default policy at the time of the run)

Every system trains the same model on the same batches with AdamW in the same
process group, round-robin (so drift in machine load hits all alike); a step is
forward + backward + optimizer.step() + zero_grad(), timed over --steps steps
after --warmup, and the table gives the median ms per step (mean over ranks).
Nothing is asserted.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from _ranks import run_on_ranks, timed_step

import zero_ext


class Blocks(nn.Module):
    def __init__(self, n: int, dim: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build(system: str, args, world: int):
    """(trained module, optimizer, units) for one system."""
    torch.manual_seed(0)
    model = Blocks(args.blocks, args.dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    units = "-"
    if system == "plain":
        return model, opt, units
    if system == "ddp":
        return DistributedDataParallel(model), opt, units
    if system.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        if system == "fsdp2":
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            units = args.blocks + 1
        else:
            units = 1
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        return model, opt, units
    stage = int(system.split("-")[1])
    model, opt = zero_ext.wrap(model, opt, stage=stage)
    if stage == 3:
        try:
            units = int(model._zero_ext.handles.diagnostics.stats()["units"])
        except Exception:  # noqa: BLE001 - internal; informative only
            units = "?"
    return model, opt, units


def run_systems(args, rank, world):
    built = {system: build(system, args, world) for system in args.systems}
    times = {system: [] for system in args.systems}
    losses = {}
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step)
        batch = torch.randn(world * args.batch, args.dim, generator=g)[rank * args.batch:(rank + 1) * args.batch]
        for system, (model, opt, _) in built.items():
            dist.barrier()
            elapsed, losses[system] = timed_step(lambda: model(batch).square().mean(), opt)
            if step >= args.warmup:
                times[system].append(elapsed)
    return {system: {"median_ms": 1e3 * statistics.median(times[system]), "loss": losses[system],
                     "units": built[system][2]} for system in args.systems}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="rows per rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--systems", nargs="+", default=None,
                        help="plain, ddp, fsdp2, fsdp2-1group, zero_ext-N (default: all of them but "
                             "zero_ext 0-2; plain at world size 1 only)")
    args = parser.parse_args()
    if args.systems is None:
        args.systems = (["plain"] if args.world == 1 else []) + ["ddp", "fsdp2", "fsdp2-1group", "zero_ext-3"]
    if "plain" in args.systems and args.world != 1:
        raise SystemExit("plain runs at world size 1 only")

    per_rank = run_on_ranks(args.world, run_systems, args, threads=args.threads)
    n_params = 2 * args.blocks
    print(f"{args.blocks} x nn.Linear({args.dim}, {args.dim}) blocks in a ModuleList ({n_params} parameters), "
          f"world size {args.world} (gloo, CPU, {args.threads} thread per rank), {args.batch} rows per rank, "
          f"AdamW, median of {args.steps} steps")
    base_name = "plain" if "plain" in args.systems else ("ddp" if "ddp" in args.systems else None)
    base = statistics.mean(r[base_name]["median_ms"] for r in per_rank) if base_name else None
    header = f"{'system':<14} {'units':>6} {'ms/step':>9} {'vs ' + (base_name or '-'):>9} {'loss':>9}"
    print(header)
    print("-" * len(header))
    for system in args.systems:
        ms = statistics.mean(r[system]["median_ms"] for r in per_rank)
        r0 = per_rank[0][system]
        ratio = f"{ms / base:.2f}x" if base else "-"
        print(f"{system:<14} {str(r0['units']):>6} {ms:>9.1f} {ratio:>9} {r0['loss']:>9.5f}")


if __name__ == "__main__":
    main()
