"""Where a training step's time goes, per system: plain PyTorch (world 1) or
DDP, and zero_ext stages 0-3, measured in one run.

    python benchmarks/phases.py --world 1
    python benchmarks/phases.py --world 2 --systems ddp zero_ext-0 zero_ext-2
    python benchmarks/phases.py --world 2 --model llama-tiny --vocab 4096 --batch 4 --context 128
    python benchmarks/phases.py --world 2 --model llama-tiny --systems ddp fsdp2-s2 fsdp2 zero_ext-2 zero_ext-3
    python benchmarks/phases.py --world 2 --model small-blocks --ranges

The models and systems are benchmarks/_systems.py's (the same as
user_loop.py's). The systems take their steps in interleaved rounds, the
order rotating each round (so drift in machine load hits all alike, and no
system always follows the same one); rounds are short (2 steps) for the
reason user_loop.py gives. Each step starts after a barrier; its
phases are timed with perf_counter, nothing else runs inside it:

  forward     the model's forward and the loss
  backward    loss.backward(): compute, zero_ext's gradient hooks, the
              reductions it overlaps, its epilogue (waits)
  step        optimizer.step() (zero_ext: the flat-shard step, stages 1-2's
              all-gather of updated shards, master-to-parameter copies)
  zero_grad   optimizer.zero_grad()

The step's time is the sum of its phases: median, min and max over every
timed step, so a slow mode a system falls into for a while shows in its
max (user_loop.py times the same steps between two barriers; the two agree
within their ranges). The phases are the medians of each phase.

Where the CPU goes, from the same steps, without a profiler: the CPU time
(/proc/self/task, in clock ticks of 10 ms: over 24 steps a figure resolves
0.4 ms per step) of this rank's threads per step, read between rounds:

  main        the training thread (forward, backward, hooks, the step)
  gloo        the process groups' worker threads (pt_gloo_runloop): the
              collectives' own copies and sums
  tcp         gloo's socket loops (gloo_tcp_loop)
  other       every other thread (zero_ext's whereabouts thread, ...)
  threads     the threads building the system started in the rank (its
              process groups' workers and socket loops, ...); the world
              group's own are there before any system

With --ranges, one more step per zero_ext system under torch.profiler (CPU),
after the timed rounds (so the profiler slows no timed step), gives the time
inside zero_ext's own ranges (their totals, children included):

  hooks       zero_ext::accumulate_grad: each gradient copied or added into
              its bucket
  gather      zero_ext::gather_unit + release_unit (stage 3): the all-gather
              of a unit, waiting for it, and its release
  epilogue    zero_ext::run_epilogue: the flush of buckets not yet launched,
              the wait for every reduction, the exchange with the other ranks
  opt         zero_ext::step: the optimizer over zero_ext's segments and the
              refresh of the parameters from the masters

Figures are means over ranks. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch.distributed as dist
import torch.nn.functional as F

from _ranks import run_on_ranks
from _systems import add_model_arguments, batch, build, default_systems, describe_model

PHASES = ("forward", "backward", "step", "zero_grad")
THREADS = ("main", "gloo", "tcp", "other")
RANGES = {"hooks": ("zero_ext::accumulate_grad",), "gather": ("zero_ext::gather_unit", "zero_ext::release_unit"),
          "epilogue": ("zero_ext::run_epilogue",), "opt": ("zero_ext::step",)}


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


def thread_cpu_seconds():
    """CPU seconds (user + system) of this process's threads, by kind, and
    how many threads there are."""
    tick = os.sysconf("SC_CLK_TCK")
    main_tid = os.getpid()
    totals = dict.fromkeys(THREADS, 0.0)
    tids = os.listdir("/proc/self/task")
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        kind = ("main" if int(tid) == main_tid else "gloo" if name.startswith("pt_gloo")
                else "tcp" if name.startswith("gloo_tcp") else "other")
        totals[kind] += seconds
    return totals, len(tids)


def profiled_ranges(model, opt, x, y):
    """Milliseconds inside zero_ext's ranges during one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one_step(model, opt, x, y)
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    return {name: sum(totals.get(k, 0.0) for k in keys) / 1e3 for name, keys in RANGES.items()}


def run(args, rank, world):
    built, added = {}, {}
    for system in args.systems:
        before = thread_cpu_seconds()[1]
        built[system] = build(args, system, world)
        added[system] = thread_cpu_seconds()[1] - before
    step = 0
    for _ in range(args.warmup):
        x, y = batch(args, rank, world, step)
        step += 1
        for model, opt in built.values():
            one_step(model, opt, x, y)
    steps = {system: [] for system in args.systems}
    cpu = {system: dict.fromkeys(THREADS, 0.0) for system in args.systems}
    for r in range(args.rounds):
        order = args.systems[r % len(args.systems):] + args.systems[:r % len(args.systems)]
        for system in order:
            model, opt = built[system]
            before, _ = thread_cpu_seconds()
            for k in range(args.steps):
                x, y = batch(args, rank, world, step + k)
                if world > 1:
                    dist.barrier()
                steps[system].append({p: t * 1e3 for p, t in one_step(model, opt, x, y).items()})
            if world > 1:
                dist.barrier()  # the last step's collectives are done on every rank
            after, _ = thread_cpu_seconds()
            for kind in THREADS:
                cpu[system][kind] += (after[kind] - before[kind]) * 1e3 / (args.rounds * args.steps)
        step += args.steps
    out = {}
    for system, (model, opt) in built.items():
        totals = [sum(t.values()) for t in steps[system]]
        out[system] = {"phases": {p: statistics.median(t[p] for t in steps[system]) for p in PHASES},
                       "total": [statistics.median(totals), min(totals), max(totals)],
                       "cpu": cpu[system], "threads": added[system], "ranges": {}}
    if args.ranges:
        x, y = batch(args, rank, world, step)
        for system, (model, opt) in built.items():
            if system.startswith("zero_ext"):
                out[system]["ranges"] = profiled_ranges(model, opt, x, y)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--systems", nargs="+", default=None,
                        help="plain (world 1), ddp, fsdp2, fsdp2-s2, zero_ext-N[-unchecked] "
                             "(default: plain or ddp, then stages 0-3)")
    add_model_arguments(parser)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per system per round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--ranges", action="store_true",
                        help="also zero_ext's profiler ranges, from one more step after the timed rounds")
    args = parser.parse_args()
    args.systems = args.systems or default_systems(args.world)
    per_rank = run_on_ranks(args.world, run, args)
    mean = lambda values: statistics.mean(values)  # noqa: E731 - over ranks
    base = mean(r[args.systems[0]]["total"][0] for r in per_rank)
    print(f"{describe_model(args)}, world {args.world} (gloo, CPU, 1 thread per rank), "
          f"{args.batch}x{args.context} tokens per rank; ms, {args.rounds} interleaved rounds x {args.steps} steps")
    columns = list(PHASES) + ["cpu " + k for k in THREADS]
    header = (f"{'system':<20} {'step':>7} {'min':>7} {'max':>7} {'vs ' + args.systems[0]:>9} "
              + " ".join(f"{c:>9}" for c in columns) + f" {'+threads':>8}"
              + (" | " + " ".join(f"{r:>8}" for r in RANGES) if args.ranges else ""))
    print(header)
    print("-" * len(header))
    for system in args.systems:
        total, low, high = (mean(r[system]["total"][i] for r in per_rank) for i in range(3))
        phases = " ".join(f"{mean(r[system]['phases'][p] for r in per_rank):>9.1f}" for p in PHASES)
        cpu = " ".join(f"{mean(r[system]['cpu'][k] for r in per_rank):>9.1f}" for k in THREADS)
        line = (f"{system:<20} {total:>7.1f} {low:>7.1f} {high:>7.1f} {total / base:>8.3f}x {phases} {cpu} "
                f"{per_rank[0][system]['threads']:>8}")
        if args.ranges:
            line += " | " + " ".join(f"{mean(r[system]['ranges'][k] for r in per_rank):>8.1f}"
                                     if per_rank[0][system]["ranges"] else f"{'-':>8}" for k in RANGES)
        print(line)


if __name__ == "__main__":
    main()
