"""Step time with offload to files (offload_optimizer="nvme", offload_params="nvme",
stage 3, one process) against the bound the disk sets, measured in one run on
the same directory.

    python benchmarks/offload_step.py --path /mnt/nvme/tmp
    python benchmarks/offload_step.py --blocks 40 --width 1024 --rounds 6

The bound is max(the same model's step in memory, bytes moved per step / the
disk's bandwidth), where the bytes are counted by the offload files
themselves (reads and writes of one step: shards read for the forward and
the backward, gradients written and read, masters and optimizer state read
and written by the step) and the bandwidth is measured by the same engine
(zero_ext's SwapFile, its threads and chunk size) writing then reading
regions of one bucket's size, and by dd with O_DIRECT for comparison:
reads take read_bytes / read_bw, writes write_bytes / write_bw, one after
the other (the drive does both). A ratio near 1 means the I/O is overlapped
with itself and with compute, not added to it. Steps are timed as a user's
loop would (perf_counter around forward, backward, step, zero_grad), the two
systems interleaved in rounds; median, min and max. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout when none is installed
import zero_ext  # noqa: E402
from zero_ext.tools import state_of  # noqa: E402
from offload_io import dd_mib_per_s, swap_mib_per_s  # noqa: E402


def peak_rss_mib() -> float:
    return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))


def build(blocks: int, width: int, nvme_path):
    with zero_ext.empty_init():
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(blocks)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    options = {} if nvme_path is None else {"offload_optimizer": "nvme", "offload_params": "nvme",
                                            "offload_path": nvme_path}
    return zero_ext.wrap(model, opt, stage=3, **options)


def moved(model, opt):
    """(read, written) bytes of the model's offload files so far."""
    stats = state_of(model).handles.offload.stats()
    read, written = stats["bytes_read"], stats["bytes_written"]
    streamed = opt._zero_ext_streamed
    if streamed is not None and streamed.offloaded is not None:
        w, r = streamed.offloaded.file.bytes_moved()
        read, written = read + r, written + w
    return read, written


def step(model, opt, x) -> float:
    start = time.perf_counter()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=None, help="a directory on the drive (default: a new one under /tmp)")
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per round and system")
    parser.add_argument("--io-mib", type=int, default=256, help="bytes the bandwidth measurement moves")
    args = parser.parse_args()
    torch.manual_seed(0)
    directory = args.path or tempfile.mkdtemp(prefix="zero_ext_offload_step_")
    os.makedirs(directory, exist_ok=True)

    bucket_mib = max(1, (args.width * (args.width + 1) * 4) >> 20)
    swap_w, swap_r, direct, ok = max((swap_mib_per_s(directory, args.io_mib, bucket_mib, 4) for _ in range(3)),
                                     key=lambda t: t[0] + t[1])
    dd_file = os.path.join(directory, "dd.bin")
    dd_w = dd_mib_per_s(dd_file, args.io_mib, write=True)
    dd_r = dd_mib_per_s(dd_file, args.io_mib, write=False)
    os.unlink(dd_file)

    x = torch.randn(args.batch, args.width)
    memory = build(args.blocks, args.width, None)
    nvme = build(args.blocks, args.width, directory)
    for system in (memory, nvme):  # warm-up: the optimizer state exists, the files hold values
        step(*system, x)
    times = {"memory": [], "nvme": []}
    read0, written0 = moved(*nvme)
    for _ in range(args.rounds):
        for name, system in (("memory", memory), ("nvme", nvme)):
            times[name].extend(step(*system, x) for _ in range(args.steps))
    read1, written1 = moved(*nvme)
    steps = args.rounds * args.steps
    read, written = (read1 - read0) / steps, (written1 - written0) / steps
    mib = 1 << 20
    io_bound = read / mib / swap_r + written / mib / swap_w
    compute = statistics.median(times["memory"])
    bound = max(compute, io_bound)
    params = sum(p.numel() for p in memory[0].parameters())
    print(f"model: {args.blocks} x Linear({args.width}, {args.width}), {params / 1e6:.1f} M parameters, stage 3, "
          f"AdamW; training state (fp32 values, gradients, 2 moments) {16 * params / mib:.1f} MiB")
    print(f"disk under {directory}: zero_ext's SwapFile (4 threads, {bucket_mib} MiB regions, "
          f"O_DIRECT {direct}, read back {'exact' if ok else 'WRONG'}): write {swap_w:.0f} MiB/s, read "
          f"{swap_r:.0f} MiB/s; dd O_DIRECT 8 MiB blocks: write {dd_w:.0f} MiB/s, read {dd_r:.0f} MiB/s")
    print(f"moved per step: read {read / mib:.1f} MiB, written {written / mib:.1f} MiB -> I/O bound "
          f"{io_bound * 1e3:.0f} ms at the SwapFile's bandwidth")
    print()
    print("| system | step ms median | min | max |")
    print("|---|---|---|---|")
    for name in ("memory", "nvme"):
        t = times[name]
        print(f"| {name} | {statistics.median(t) * 1e3:.0f} | {min(t) * 1e3:.0f} | {max(t) * 1e3:.0f} |")
    print()
    print(f"bound max(compute {compute * 1e3:.0f} ms, I/O {io_bound * 1e3:.0f} ms) = {bound * 1e3:.0f} ms; "
          f"nvme step / bound = {statistics.median(times['nvme']) / bound:.2f}x")
    print(f"peak resident memory of this process (both models, the in-memory one whole): {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
