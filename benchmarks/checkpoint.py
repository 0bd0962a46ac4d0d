"""Save and load time and peak memory of zero_ext checkpoints, and of
`python -m zero_ext.convert`, for a model of about 100M parameters.

    python benchmarks/checkpoint.py                  # world size 2, stage 2, ~101M params
    python benchmarks/checkpoint.py --stage 3 --layers 3
    python benchmarks/checkpoint.py --repeat 5       # medians of 5 saves and 5 loads per rank

Each rank trains one AdamW step (so optimizer state exists), saves --repeat
times (the first save is new, the others replace it), and loads as many
times into a fresh model; times are wall-clock medians with their range,
throughput is this rank's share of the checkpoint over the median, memory
is the growth of the process's peak RSS (ru_maxrss) during the operation. convert runs in a
child process; its whole peak RSS is reported beside the model's fp32 size.
Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import run_on_ranks  # noqa: E402

import zero_ext  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(args):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def body(args, rank, world):
    model, opt = build(args)
    zero_ext.wrap(model, opt, stage=args.stage)
    x = torch.randn(4, args.width)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    saves, loads = [], []
    before = peak_rss_mb()
    for _ in range(args.repeat):  # the first writes a new checkpoint, the others replace it
        start = time.perf_counter()
        zero_ext.save(args.path, model, opt)
        saves.append(time.perf_counter() - start)
    save_rss = peak_rss_mb() - before
    del model, opt
    model, opt = build(args)
    zero_ext.wrap(model, opt, stage=args.stage)
    before = peak_rss_mb()
    for _ in range(args.repeat):
        start = time.perf_counter()
        zero_ext.load(args.path, model, opt)
        loads.append(time.perf_counter() - start)
    return {"save_s": statistics.median(saves), "save_range": (min(saves), max(saves)), "save_rss_growth_mb": save_rss,
            "load_s": statistics.median(loads), "load_range": (min(loads), max(loads)),
            "load_rss_growth_mb": peak_rss_mb() - before, "peak_rss_mb": peak_rss_mb()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3, help="saves and loads per rank; medians are reported")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="zero_ext_ckpt_bench_")
    args.path = os.path.join(tmp, "ckpt")
    try:
        per_rank = run_on_ranks(args.world, body, args)
        n = args.layers * (args.width * args.width + args.width)
        size_mb = 4 * n / 2**20
        disk_mb = sum(os.path.getsize(os.path.join(args.path, f)) for f in os.listdir(args.path)) / 2**20
        print(f"{n / 1e6:.1f}M parameters (fp32 {size_mb:.0f} MiB), stage {args.stage}, world size {args.world}, "
              f"checkpoint {disk_mb:.0f} MiB on disk (params + AdamW state)")
        print(f"{'rank':>4} {'save s (range)':>18} {'save MiB/s':>10} {'save +RSS MiB':>14} {'load s (range)':>18} "
              f"{'load MiB/s':>10} {'load +RSS MiB':>14} {'peak RSS MiB':>13}")
        for rank, r in enumerate(per_rank):
            mine = disk_mb / args.world  # each rank writes and reads its share
            print(f"{rank:>4} {r['save_s']:>6.2f} ({r['save_range'][0]:.2f}-{r['save_range'][1]:.2f}) "
                  f"{mine / r['save_s']:>10.0f} {r['save_rss_growth_mb']:>14.0f} "
                  f"{r['load_s']:>6.2f} ({r['load_range'][0]:.2f}-{r['load_range'][1]:.2f}) {mine / r['load_s']:>10.0f} "
                  f"{r['load_rss_growth_mb']:>14.0f} {r['peak_rss_mb']:>13.0f}")
        start = time.perf_counter()
        verified = subprocess.run([sys.executable, "-m", "zero_ext.convert", "--verify", args.path],
                                  capture_output=True, text=True)
        if verified.returncode == 0:  # a zero_ext without --verify prints usage instead
            print(f"convert --verify: {time.perf_counter() - start:.2f} s ({disk_mb:.0f} MiB, interpreter start "
                  "included)")
        out = os.path.join(tmp, "plain.pt")
        # In a child of its own, which reports its own peak RSS (RUSAGE_CHILDREN
        # here would include the ranks).
        measure = ("import resource, sys, time; from zero_ext.convert import convert; "
                   "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024; t = time.perf_counter(); "
                   "convert(sys.argv[1], sys.argv[2]); "
                   "print(time.perf_counter() - t, before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
        done = subprocess.run([sys.executable, "-c", measure, args.path, out], check=True, capture_output=True, text=True)
        convert_s, base_mb, child_peak = map(float, done.stdout.split()[-3:])
        largest_mb = 4 * (args.width * args.width) / 2**20
        print(f"convert: {convert_s:.2f} s, peak RSS {child_peak:.0f} MiB (of which {base_mb:.0f} MiB is the "
              f"interpreter with torch and zero_ext imported): {(child_peak - base_mb):.0f} MiB for the data = "
              f"{(child_peak - base_mb) / size_mb:.2f}x the model's fp32 size, "
              f"{(child_peak - base_mb) / largest_mb:.2f}x its largest parameter ({largest_mb:.0f} MiB)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
