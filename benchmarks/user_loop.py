"""Step time as a user's training loop measures it: nothing but a barrier and
perf_counter around each step, no profiler, no timing inside the step.

    python benchmarks/user_loop.py                       # world 2, Llama vocab 4096, 4x128 tokens per rank
    python benchmarks/user_loop.py --model llama-tiny --vocab 2048 --batch 8 --context 64
    python benchmarks/user_loop.py --world 1 --systems plain zero_ext-0 zero_ext-1 zero_ext-2 zero_ext-3
    python benchmarks/user_loop.py --systems ddp fsdp2 zero_ext-3 --model small-blocks

Every rank runs, for each step:

    dist.barrier(); start = time.perf_counter()
    loss = cross_entropy(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    dist.barrier(); elapsed = time.perf_counter() - start

so a step's time is the slowest rank's, barriers included, as a user timing
their loop sees it. The systems (benchmarks/_systems.py: the same models and
builds as phases.py) take their steps in many short interleaved rounds (2
steps each by default), the order rotating each round so that none always
follows the same one: this shared 2-core machine has slow spells of a few
seconds that come from outside the benchmark, and short rounds spread them
over every system alike instead of landing on whichever ran then. Every
step is kept. The table gives, per system, the median, quartiles, min and
max over all timed steps (rank 0's clock) and the median's ratio to the
first system: a slow spell shows in the upper quartile and the max.
Nothing is asserted. phases.py splits the same steps into phases; the two
should agree within their spread (docs/benchmarks.md).

    python benchmarks/user_loop.py --fresh 6 --systems ddp zero_ext-3

--fresh N: each run on a fresh group of ranks instead, N per system,
interleaved run by run, --warmup + --rounds x --steps steps a run; per system
the min / median / max over runs of each run's median step and of its first
step (benchmarks/_fresh.py). --json writes every number.
"""
from __future__ import annotations

import argparse
import json
import statistics

from _fresh import add_fresh_argument, fresh_runs, report_fresh, step_seconds
from _ranks import run_on_ranks
from _systems import add_model_arguments, batch, build, default_systems, describe_model


def run(args, rank, world):
    built = {system: build(args, system, world) for system in args.systems}
    step = 0
    for _ in range(args.warmup):
        x, y = batch(args, rank, world, step)
        step += 1
        for model, opt in built.values():
            step_seconds(model, opt, x, y, world)
    rounds = {system: [] for system in args.systems}
    for r in range(args.rounds):
        order = args.systems[r % len(args.systems):] + args.systems[:r % len(args.systems)]
        for system in order:
            model, opt = built[system]
            rounds[system].append([1e3 * step_seconds(model, opt, *batch(args, rank, world, step + k), world)
                                   for k in range(args.steps)])
        step += args.steps
    return rounds


def summarize(steps):
    """median, 25th and 75th percentiles, min, max."""
    q1, _, q3 = statistics.quantiles(steps, n=4) if len(steps) > 1 else (steps[0],) * 3
    return statistics.median(steps), q1, q3, min(steps), max(steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--systems", nargs="+", default=None,
                        help="plain (world 1), ddp, fsdp2, fsdp2-s2, zero_ext-N[-unchecked] "
                             "(default: plain or ddp, then stages 0-3)")
    add_model_arguments(parser, model="llama-tiny", vocab=4096, batch=4, context=128)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per system first")
    parser.add_argument("--steps", type=int, default=2, help="steps per system per round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", help="also write every step's time here")
    add_fresh_argument(parser)
    args = parser.parse_args()
    args.systems = args.systems or default_systems(args.world)
    title = (f"{describe_model(args)}, world {args.world} (gloo, CPU, {args.threads} thread(s) per rank), "
             f"{args.batch}x{args.context} tokens per rank")
    if args.fresh:
        report_fresh(args, fresh_runs(args, build, batch, args.rounds * args.steps), title)
        return
    rounds = run_on_ranks(args.world, run, args, threads=args.threads)[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "mode": "warmed", "rounds_ms": rounds}, f, indent=2)
    base = statistics.median(t for r in rounds[args.systems[0]] for t in r)
    print(f"{title}; ms per step between barriers, {args.rounds} interleaved rounds x {args.steps} steps")
    header = (f"{'system':<20} {'median':>8} {'vs ' + args.systems[0]:>10} {'p25':>8} {'p75':>8} "
              f"{'min':>8} {'max':>8}")
    print(header)
    print("-" * len(header))
    for system in args.systems:
        median, q1, q3, low, high = summarize([t for r in rounds[system] for t in r])
        print(f"{system:<20} {median:>8.1f} {median / base:>9.3f}x {q1:>8.1f} {q3:>8.1f} {low:>8.1f} {high:>8.1f}")


if __name__ == "__main__":
    main()
