"""Step time and bubble of torch.distributed.pipelining's schedules at
pp 2 x dp 2 on 4 CPU ranks (gloo): zero_ext on each stage against FSDP2
applied to each stage the same way (torchtitan's recipe).

    python benchmarks/pipeline_step.py                      # stage 3, 4 microbatches
    python benchmarks/pipeline_step.py --microbatches 8 --rounds 20
    python benchmarks/pipeline_step.py --dim 64 --rounds 3  # quick

The systems, every one over the same global batch each step:

    zero_ext S<stage>   each rank's stage module wrapped with
                        zero_ext.wrap(stage=S, process_group=mesh["dp"], pipeline_group=mesh["pp"])
    FSDP2 per stage     fully_shard on each block of the stage and on the stage module over
                        mesh["dp"] (the schedule drives its gradient sync: torch's
                        backward_maybe_with_nosync and REDUCE_GRAD)

and the schedules GPipe, 1F1B (one stage per rank, the model cut in 2) and
interleaved 1F1B (two stages per rank, cut in 4). The model: an embedding,
--layers pre-norm MLP blocks (LayerNorm, Linear 4x, GELU, Linear, residual)
and a head, the same weights everywhere (seed 0).

Every system is built in the same processes, then steps in rounds, one timed
step per system per round, the order rotating from round to round. A step
is timed as a user's loop times it: dist.barrier(), then
time.perf_counter() around zero_grad, schedule.step() and optimizer.step();
a step's time is the slowest rank's. "first" is each system's first step
(metadata inference, first gathers and allocations: what a fresh run pays
once). The bubble is the share of a rank's step not spent computing its own
stages: 1 - compute / step, where compute is the same stage modules' forward
and backward over the same microbatches, run alone on the rank without the
pipeline and without zero_ext or FSDP2 (the median of --rounds such runs);
it holds the schedule's idle time and what the system adds (its
communication, its waits). "ideal bubble" is the schedule's own,
(p - 1) / (v m + p - 1) for p stages of v chunks per rank and m
microbatches. On a machine with fewer cores than ranks an idle rank lends
its core to a busy one, so the measured bubble there is lower than on
devices of their own. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))  # this checkout when none is installed
sys.path.insert(0, HERE)
import zero_ext  # noqa: E402
from _ranks import run_on_ranks  # noqa: E402

SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B")
WORLD, PP = 4, 2


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(layers)})
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) if self.emb is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h


def stage_module(full: LM, index: int, n_stages: int) -> LM:
    module = copy.deepcopy(full)
    per = len(full.layers) // n_stages
    if index != 0:
        module.emb = None
    if index != n_stages - 1:
        module.head = None
    for name in list(module.layers):
        if int(name) // per != index:
            del module.layers[name]
    return module


def fully_shard_api():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


class Built:
    """One system's stages on this rank, its optimizers and schedule."""

    def __init__(self, args, system: str, schedule: str) -> None:
        from torch.distributed import pipelining
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (PP, WORLD // PP), mesh_dim_names=("pp", "dp"))  # each system its own groups
        self.pp, self.dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        torch.manual_seed(0)
        full = LM(args.vocab, args.dim, args.layers)
        multi = schedule == "ScheduleInterleaved1F1B"
        n_stages = 2 * PP if multi else PP
        indices = [self.pp, self.pp + PP] if multi else [self.pp]
        self.plain = [stage_module(full, i, n_stages) for i in indices]  # for the compute-alone measurement
        self.models, self.optimizers, stages = [], [], []
        for index in indices:
            module = stage_module(full, index, n_stages)
            if system.startswith("zero_ext"):
                opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
                module, opt = zero_ext.wrap(module, opt, stage=args.stage, process_group=mesh["dp"],
                                            pipeline_group=mesh["pp"])
            else:
                fully_shard = fully_shard_api()
                for block in module.layers.values():
                    fully_shard(block, mesh=mesh["dp"])
                fully_shard(module, mesh=mesh["dp"])
                opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
            self.models.append(module)
            self.optimizers.append(opt)
            stages.append(pipelining.PipelineStage(module, index, n_stages, torch.device("cpu"),
                                                   group=mesh["pp"].get_group()))
        self.indices, self.n_stages = indices, n_stages
        cls = getattr(pipelining, schedule)
        self.schedule = cls(stages if multi else stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)

    def step(self, args, step: int) -> float:
        x, y = batch(args, step, self.dp)
        dist.barrier()
        start = time.perf_counter()
        for opt in self.optimizers:
            opt.zero_grad()
        losses = []
        if 0 in self.indices:
            self.schedule.step(x, target=y if self.n_stages - 1 in self.indices else None, losses=losses)
        else:
            self.schedule.step(target=y, losses=losses)
        for opt in self.optimizers:
            opt.step()
        return time.perf_counter() - start


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def batch(args, step: int, dp_rank: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, args.vocab, (args.global_batch, args.context + 1), generator=g)
    per = args.global_batch // (WORLD // PP)
    mine = tokens[dp_rank * per:(dp_rank + 1) * per]
    # Contiguous: torch 2.11's pipelining checks each microbatch's strides
    # against the first one's, and raises on the first stage's rank alone.
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def compute_alone(args, built: Built) -> float:
    """This rank's stages' forward and backward over the step's microbatches,
    alone: what the rank computes with no pipeline and no data parallelism."""
    x, y = batch(args, 0, built.dp)
    start = time.perf_counter()
    for mx, my in zip(x.chunk(args.microbatches), y.chunk(args.microbatches)):
        for module, index in zip(built.plain, built.indices):
            h = mx if index == 0 else torch.randn(*mx.shape, args.dim, requires_grad=True)
            out = module(h)
            if index == built.n_stages - 1:
                loss_fn(out, my).backward()
            else:
                out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def run(args, rank, world):
    systems = [(s, sch) for sch in SCHEDULES for s in (f"zero_ext S{args.stage}", "FSDP2 per stage")]
    built, errors = {}, {}
    for key in systems:
        try:
            built[key] = Built(args, *key)
        except Exception as e:  # reported: one failing system does not end the comparison
            errors[key] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
            if rank == 0:
                traceback.print_exc()
    times = {key: [] for key in systems}
    first = {}
    for r in range(args.warmup + args.rounds + 1):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for key in order:
            if key in errors:
                continue
            # A step that raised ends the run: it raised on some ranks only (a
            # stage's check), and the others wait in its sends and receives.
            elapsed = built[key].step(args, r)
            if r == 0:
                first[key] = elapsed
            elif r > args.warmup:
                times[key].append(elapsed)
    alone = {}
    for key in systems:
        if key in built:
            alone[key] = statistics.median(compute_alone(args, built[key]) for _ in range(max(3, args.rounds // 4)))
    return {"times": {f"{s}|{sch}": t for (s, sch), t in times.items()},
            "first": {f"{s}|{sch}": t for (s, sch), t in first.items()},
            "alone": {f"{s}|{sch}": t for (s, sch), t in alone.items()},
            "errors": {f"{s}|{sch}": t for (s, sch), t in errors.items()}}


def markdown(args, per_rank) -> str:
    n_params = sum(p.numel() for p in LM(args.vocab, args.dim, args.layers).parameters())
    lines = [f"{n_params / 1e6:.2f}M parameters (dim {args.dim}, {args.layers} blocks, vocab {args.vocab}), pp {PP} x "
             f"dp {WORLD // PP} on {WORLD} CPU ranks (gloo), global batch {args.global_batch} x {args.context} tokens "
             f"in {args.microbatches} microbatches per dp rank, AdamW; {args.rounds} rounds after {args.warmup} + the "
             f"first, each step the slowest rank's", "",
             "| schedule | system | first ms | ms/step min | median | max | bubble (median) | ideal bubble |",
             "|---|---|---|---|---|---|---|---|"]
    keys = list(per_rank[0]["times"])
    # A rank's own compute, per schedule (the same stage modules for both
    # systems): the busiest rank's, the median over the systems' measurements.
    busy_of = {}
    for key in keys:
        if key in per_rank[0]["alone"]:
            busy_of.setdefault(key.split("|")[1], []).append(max(r["alone"][key] for r in per_rank) * 1e3)
    for key in keys:
        system, schedule = key.split("|")
        failed = next((r["errors"][key] for r in per_rank if key in r["errors"]), None)
        if failed:
            lines.append(f"| {schedule} | {system} | error: {failed.replace('|', '/')} | | | | | |")
            continue
        steps = [max(r["times"][key][i] for r in per_rank) * 1e3 for i in range(args.rounds)]
        first = max(r["first"][key] for r in per_rank) * 1e3
        median = statistics.median(steps)
        busy = statistics.median(busy_of[schedule])
        chunks = 2 if schedule == "ScheduleInterleaved1F1B" else 1  # stages per rank
        ideal = (PP - 1) / (chunks * args.microbatches + PP - 1)  # (p - 1) / (v m + p - 1)
        lines.append(f"| {schedule} | {system} | {first:.0f} | {min(steps):.1f} | {median:.1f} | {max(steps):.1f} | "
                     f"{max(0.0, 1 - busy / median):.0%} | {ideal:.0%} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="zero_ext's stage")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    if args.layers % (2 * PP):
        raise SystemExit(f"--layers {args.layers} does not split into {2 * PP} stages")
    if (args.global_batch // (WORLD // PP)) % args.microbatches:
        raise SystemExit("--global-batch per dp rank does not split into --microbatches")
    started = time.perf_counter()
    per_rank = run_on_ranks(WORLD, run, args, threads=args.threads)
    print(markdown(args, per_rank))
    print(f"\n({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
