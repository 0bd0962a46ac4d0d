"""Bandwidth of the "nvme" offload files (zero_ext/tools/offload_file.py) against
the drive's own, measured in one run on the same directory.

    python benchmarks/offload_io.py --path /mnt/nvme/tmp
    python benchmarks/offload_io.py --path /tmp --mib 512 --threads 1 2 4 8
    python benchmarks/offload_io.py --path /mnt/nvme/tmp --latency   # also one read at a time, by size

For each thread count, the offload file writes and then reads --mib MiB in
regions of --region-mib (as an optimizer step streams its buckets: every
region's transfer issued at once, then waited on). The drive's figure is dd
with O_DIRECT (oflag=direct / iflag=direct, 8 MiB blocks) over a file of
the same size in the same directory: what a sequential stream gets without
zero_ext. Reads of a file just written may come from the drive's own cache
(or, where O_DIRECT is refused, the page cache): the "direct" column says
which. Best of --repeat runs, MiB/s. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout when none is installed
from zero_ext.tools.offload_file import CHUNK_BYTES, OffloadFile  # noqa: E402


def dd_mib_per_s(path: str, mib: int, write: bool) -> float:
    """dd's own rate for mib MiB in 8 MiB blocks with O_DIRECT (buffered if refused)."""
    for direct in (True, False):
        flag = ([f"oflag={'direct' if direct else 'dsync'}"] if write else ["iflag=direct"] if direct else [])
        src, dst = ("/dev/zero", path) if write else (path, "/dev/null")
        cmd = ["dd", f"if={src}", f"of={dst}", "bs=8M", f"count={mib // 8}", *flag]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            seconds = float(re.search(r"([\d.]+) s,", done.stderr).group(1))
            return mib / seconds
    raise RuntimeError(done.stderr)


def swap_mib_per_s(directory: str, mib: int, region_mib: int, threads: int):
    regions = {f"r{i}": region_mib << 20 for i in range(mib // region_mib)}
    f = OffloadFile(directory, 0, regions, threads=threads, chunk_bytes=CHUNK_BYTES)
    data = {k: torch.full((region_mib << 18,), float(i)) for i, k in enumerate(regions)}
    start = time.perf_counter()
    for t in [f.write(k, v) for k, v in data.items()]:
        t.wait()
    wrote = time.perf_counter() - start
    start = time.perf_counter()
    outs = [f.read(k, like=v) for k, v in data.items()]
    for t in outs:
        t.wait()
    read = time.perf_counter() - start
    ok = all(torch.equal(o.wait(), data[k]) for o, k in zip(outs, data))
    return mib / wrote, mib / read, f.direct, ok


def read_latency_us(directory: str, sizes_kib, reads: int = 40) -> dict:
    """Median time of one read of each region size (one at a time, as a
    small unit's gather waits for it): the drive's latency plus bytes over
    its bandwidth; where the first term dominates, offload saves little
    memory for its cost (wrap()'s persist_kb default comes from here)."""
    import statistics
    regions = {f"{kib}/{i}": kib << 10 for kib in sizes_kib for i in range(8)}
    f = OffloadFile(directory, 0, regions)
    for key, size in regions.items():
        f.write(key, torch.ones(size // 4)).wait()
    out = {}
    for kib in sizes_kib:
        buffer = torch.empty((kib << 10) // 4)
        times = []
        for r in range(reads):
            start = time.perf_counter()
            f.read(f"{kib}/{r % 8}", buffer).wait()
            times.append(time.perf_counter() - start)
        out[kib] = statistics.median(times) * 1e6
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="/tmp", help="a directory on the drive to measure")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--region-mib", type=int, default=16)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--latency", action="store_true", help="also one read at a time, 4 KiB to 4 MiB")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.path, exist_ok=True)
    probe = os.path.join(args.path, f"zero_ext-dd-{os.getpid()}")
    try:
        dd_write = max(dd_mib_per_s(probe, args.mib, True) for _ in range(args.repeat))
        dd_read = max(dd_mib_per_s(probe, args.mib, False) for _ in range(args.repeat))
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    print(f"{args.mib} MiB in {args.region_mib} MiB regions under {args.path}; best of {args.repeat}, MiB/s")
    print(f"{'who':<24} {'write':>8} {'read':>8} {'direct':>7} {'exact':>6}")
    print(f"{'dd (8 MiB blocks)':<24} {dd_write:>8.0f} {dd_read:>8.0f} {'-':>7} {'-':>6}")
    for threads in args.threads:
        runs = [swap_mib_per_s(args.path, args.mib, args.region_mib, threads) for _ in range(args.repeat)]
        write = max(r[0] for r in runs)
        read = max(r[1] for r in runs)
        print(f"{f'offload file, {threads} thread(s)':<24} {write:>8.0f} {read:>8.0f} {str(runs[0][2]):>7} "
              f"{str(all(r[3] for r in runs)):>6}")
    if args.latency:
        print()
        print("| region | one read (median of 40) | MiB/s |")
        print("|---|---|---|")
        for kib, us in read_latency_us(args.path, [4, 16, 64, 128, 256, 1024, 4096]).items():
            print(f"| {kib} KiB | {us:.0f} us | {kib / 1024 / (us / 1e6):.0f} |")


if __name__ == "__main__":
    main()
