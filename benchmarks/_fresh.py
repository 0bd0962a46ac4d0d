"""A step timed as a user's loop times it, and fresh ranks for every run
(issue 56): what step_time.py and user_loop.py share.

Their default mode times warmed ranks: every system in one group of
processes. A user's run is one fresh group instead, and this machine's slow
spells hit whichever system runs then, so one fresh run says little: an
outside harness saw zero_ext at 1.09-1.24x DDP in one invocation and
1.00-1.06x in the next. `--fresh N` runs each system N times, the systems
interleaved run by run (ddp, zero_ext-3, ddp, zero_ext-3, ...), each run a
new group of processes (spawn, init_process_group, build and wrap, then
--warmup + timed steps, each between a barrier and perf_counter as in
step_seconds). Per system: the min / median / max over runs of each run's
median step (the steps after --warmup) and of its first step (which pays the
warm-up costs a user's run pays: allocator growth, first gathers, lazy
initialization), the medians of the build's time (building and wrapping the
model between barriers; a process's first model also pays lazy imports and
initialization, over a second here even for DDP) and of the process's peak
resident memory (zero_ext.memory_report(process=True), the most of any rank).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import torch.distributed as dist
import torch.nn.functional as F

from _ranks import run_on_ranks

import zero_ext


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def step_seconds(model, opt, x, y, world: int) -> float:
    """One step between barriers: forward, loss, backward, step, zero_grad
    (forward, loss and backward one compiled function for a system that has
    a train_step: _systems.CompiledTrainStep)."""
    barrier(world)
    start = time.perf_counter()
    if hasattr(model, "train_step"):
        model.train_step(x, y)
    else:
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
    opt.step()
    opt.zero_grad()
    barrier(world)
    return time.perf_counter() - start


def add_fresh_argument(parser: Any) -> None:
    parser.add_argument("--fresh", type=int, default=0, metavar="N",
                        help="N runs per system, each on a fresh group of ranks, the systems interleaved run by run "
                             "(default 0: every system on one group of warmed ranks)")


def _one_run(payload, rank: int, world: int) -> Dict[str, Any]:
    args, system, build, batch, steps = payload
    barrier(world)
    start = time.perf_counter()
    model, opt = build(args, system, world)
    barrier(world)
    built = time.perf_counter() - start
    times = [1e3 * step_seconds(model, opt, *batch(args, rank, world, step), world) for step in range(steps)]
    return {"build_ms": 1e3 * built, "steps_ms": times, "pid": os.getpid(),
            "peak_rss": zero_ext.memory_report(getattr(model, "model", model), opt,
                                               process=True).get("process_peak_rss", 0)}


def fresh_runs(args, build: Callable, batch: Callable, timed: int) -> Dict[str, List[dict]]:
    """Every system's args.fresh runs, each on new ranks: `build(args,
    system, world)` gives (module to call, optimizer), `batch(args, rank,
    world, step)` (inputs, targets); args.warmup + `timed` steps a run, rank
    0's clock (the barriers make every rank's the same step)."""
    runs: Dict[str, List[dict]] = {system: [] for system in args.systems}
    for r in range(args.fresh):
        for system in args.systems:
            ranks = run_on_ranks(args.world, _one_run, (args, system, build, batch, args.warmup + timed),
                                 threads=args.threads)
            steps = ranks[0]["steps_ms"]
            run = {"first_ms": steps[0], "median_ms": statistics.median(steps[args.warmup:]),
                   "build_ms": ranks[0]["build_ms"], "peak_rss": max(rank["peak_rss"] for rank in ranks),
                   "steps_ms": steps, "pids": [rank["pid"] for rank in ranks]}
            runs[system].append(run)
            print(f"run {r + 1}/{args.fresh} {system}: median {run['median_ms']:.1f} ms, "
                  f"first {run['first_ms']:.1f} ms", file=sys.stderr, flush=True)
    return runs


def report_fresh(args, runs: Dict[str, List[dict]], title: str) -> None:
    """The table (per system, min / median / max over runs) and, with
    args.json, every number."""
    def spread(system, key):
        values = [run[key] for run in runs[system]]
        return min(values), statistics.median(values), max(values)

    base = spread(args.systems[0], "median_ms")[1]
    summary = {}
    rows = [["system", "median", "vs " + args.systems[0], "min", "max", "first med", "first min", "first max",
             "build ms", "peak RSS MiB"]]
    for system in args.systems:
        low, mid, high = spread(system, "median_ms")
        first_low, first_mid, first_high = spread(system, "first_ms")
        summary[system] = {"median_ms": [low, mid, high], "first_ms": [first_low, first_mid, first_high],
                           "build_ms": spread(system, "build_ms")[1], "peak_rss": spread(system, "peak_rss")[1],
                           "ratio": mid / base}
        ms = (f"{v:.1f}" for v in (low, high, first_mid, first_low, first_high))
        rows.append([system, f"{mid:.1f}", f"{mid / base:.3f}x", *ms, f"{summary[system]['build_ms']:.0f}",
                     f"{summary[system]['peak_rss'] / 2**20:.0f}"])
    print(f"{title}; {args.fresh} fresh runs per system, interleaved; per run the median of steps "
          f"{args.warmup + 1}-{len(runs[args.systems[0]][0]['steps_ms'])} and the first step, ms")
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print(" ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("-" * (sum(widths) + len(widths) - 1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "mode": "fresh", "summary": summary, "runs": runs}, f, indent=2)
