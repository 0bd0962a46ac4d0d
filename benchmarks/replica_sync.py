"""Gradient accumulation over a hybrid (replicate, shard) mesh: what each way of
accumulating sends, holds and costs per optimizer step.

    python benchmarks/replica_sync.py                       # gpt2-10m, 2x2 gloo ranks, 4 backwards a step
    python benchmarks/replica_sync.py --stages 2 --micro 8 --mesh 2x2

Modes, each the same K backward calls per step:
  synced     every backward reduces within the row and all-reduces its shard
             across replicas
  deferred   model.set_requires_all_reduce(False) for the first K-1: they
             still reduce within the row (gradients stay sharded), and the
             last backward's all-reduce across replicas carries all K
  no_sync    `with model.no_sync()` for the first K-1: nothing is sent, but
             each rank holds whole (unsharded) gradients until the last one

Reported per stage and mode (rank 0; every rank sends the same):
  row MiB / replicas MiB  bytes sent per step within the row and across
             replicas, from zero_ext's own issue log (benchmarks/_accounting.py
             sent_bytes_by_group: gloo's algorithms)
  grad MiB   gradient bytes the rank holds before the step's last backward
             (stats()["grad_bytes"], plus param.grad under no_sync)
  ms/step    median wall time of a step (K forward+backward, step, zero_grad)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import zero_ext  # noqa: E402
from _models import PRESETS, build_model  # noqa: E402
from _ranks import run_on_ranks  # noqa: E402
from _accounting import sent_bytes_by_group  # noqa: E402

MODES = ("synced", "deferred", "no_sync")
MIB = 2.0 ** 20


def tokens(args, rank: int, world: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + micro)
    vocab = min(512, PRESETS[args.model].vocab)
    t = torch.randint(0, vocab, (world * args.batch, args.seq + 1), generator=g)[rank * args.batch:(rank + 1) * args.batch]
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def held_grad_bytes(model) -> int:
    """zero_ext's gradient buffers plus what param.grad holds on its own
    (no_sync's whole local gradients)."""
    own = model._zero_ext.handles.diagnostics.stats()["grad_bytes"]
    extra = 0
    for p in model.parameters():
        g = p.grad
        # A stand-in for a sharded gradient claims its size but holds no memory
        # ([Note: gradient stand-ins]): its storage is never resizable.
        if g is not None and g.untyped_storage().resizable():
            extra += g.untyped_storage().nbytes()
    return own + extra


def run_mode(args, mesh, replicas: int, shard: int, stage: int, mode: str, rank: int, world: int) -> Dict:
    model = build_model(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zero_ext.wrap(model, opt, stage=stage, process_group=mesh)
    core = model._zero_ext.handles
    times: List[float] = []
    result: Dict = {}
    for step in range(args.warmup + args.steps + 1):
        measured = step == args.warmup + args.steps  # the last step: traffic only
        if measured:
            core.diagnostics.log_issues(True)
        dist.barrier()
        start = time.perf_counter()
        for micro in range(args.micro):
            last = micro == args.micro - 1
            if mode == "deferred":
                model.set_requires_all_reduce(last)
            if last and measured:
                result["grad_bytes"] = held_grad_bytes(model)
            x, y = tokens(args, rank, world, step, micro)
            with model.no_sync() if mode == "no_sync" and not last else contextlib.nullcontext():
                F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        if measured:
            core.diagnostics.log_issues(False)
            result.update(sent_bytes_by_group(core.diagnostics.take_issue_log(), replicas, shard))
        elif step >= args.warmup:
            times.append(elapsed)
    result["ms_per_step"] = 1e3 * statistics.median(times)
    return result


def body(args, rank: int, world: int) -> Dict:
    from torch.distributed.device_mesh import init_device_mesh

    replicas, shard = (int(v) for v in args.mesh.split("x"))
    mesh = init_device_mesh("cpu", (replicas, shard), mesh_dim_names=("replicate", "shard"))
    out = {}
    for stage in args.stages:
        for mode in MODES:
            out[f"{stage}/{mode}"] = run_mode(args, mesh, replicas, shard, stage, mode, rank, world)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-10m", choices=sorted(PRESETS))
    parser.add_argument("--mesh", default="2x2", help="RxS: replicas x shard size")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--micro", type=int, default=4, help="backward calls per step")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per backward")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    replicas, shard = (int(v) for v in args.mesh.split("x"))
    results = run_on_ranks(replicas * shard, body, args)[0]
    print(f"{args.model}, mesh {args.mesh} (replicate, shard), gloo, {args.micro} backwards a step, "
          f"{args.batch}x{args.seq} tokens per rank per backward")
    print("| stage | mode | row MiB | replicas MiB | grad MiB before the last backward | ms/step |")
    print("|---|---|---|---|---|---|")
    for key, r in results.items():
        stage, mode = key.split("/")
        print(f"| {stage} | {mode} | {r['within_row'] / MIB:.1f} | {r['across_replicas'] / MIB:.1f} | "
              f"{r['grad_bytes'] / MIB:.1f} | {r['ms_per_step']:.0f} |")


if __name__ == "__main__":
    main()
