"""Where a rank's resident memory goes at the step's peak (the end of a
forward), DDP against zero_ext's stages: glibc's heap (in use and free
holes), malloc's own mappings, zero_ext's reusable blocks (in use, idle), and
the process's RSS then and at its highest over the timed steps.

    python benchmarks/resident_memory.py                         # gpt2-14m, world 2: ddp, zero_ext-3
    python benchmarks/resident_memory.py --systems ddp zero_ext-2 zero_ext-3 --model gpt2-tiny

Each system runs on its own fresh ranks (gloo, one thread per rank), AdamW,
--warmup + --steps steps of 4 x 128 tokens (or the model's context), the buckets of compare.py
(25 MiB). Rank 0's figures after the last forward. Reads glibc's mallinfo2
(glibc 2.33 and later; the heap columns are empty elsewhere). The figures of
docs/benchmarks.md's "Resident memory: stage 3 against DDP (issue 56)".
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time
from typing import Any, Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _models import PRESETS, build_model  # noqa: E402
from _ranks import run_on_ranks  # noqa: E402

MIB = 2 ** 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_now() -> Dict[str, float]:
    """glibc's heap: bytes in use, free (holes it keeps), and its mappings."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"heap_in_use": info.uordblks / MIB, "heap_free": info.fordblks / MIB, "malloc_mapped": info.hblkhd / MIB}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def rank_body(args: Dict[str, Any], rank: int, world: int) -> Dict[str, float]:
    torch.manual_seed(0)
    model = build_model(args["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args["system"] == "ddp":
        forward = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    else:
        import zero_ext
        forward, opt = zero_ext.wrap(model, opt, stage=int(args["system"].rsplit("-", 1)[1]), bucket_mb=25)
    highest = [0.0]
    sampling = [True]

    def sample() -> None:  # the process's RSS every half millisecond: the peak within a step
        while sampling[0]:
            highest[0] = max(highest[0], rss_mib())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    at_peak: Dict[str, float] = {}
    steps = args["warmup"] + args["steps"]
    preset = PRESETS[args["model"]]
    seq = min(128, preset.context)
    for step in range(steps):
        if step == args["warmup"]:
            sampler.start()
        dist.barrier()
        tokens = torch.randint(0, preset.vocab, (4, seq + 1), generator=torch.Generator().manual_seed(step * 10 + rank))
        out = forward(tokens[:, :-1])
        logits = out.logits if hasattr(out, "logits") else out
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        if step == steps - 1:
            at_peak = {"rss_end_of_forward": rss_mib(), **heap_now()}
            if args["system"] != "ddp":
                stats = model._zero_ext.handles.diagnostics.stats()
                at_peak["blocks_in_use"] = stats["host_blocks_in_use_bytes"] / MIB
                at_peak["blocks_idle"] = stats["host_blocks_idle_bytes"] / MIB
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sampling[0] = False
    at_peak["rss_highest"] = highest[0]
    return at_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-14m")
    parser.add_argument("--systems", nargs="+", default=["ddp", "zero_ext-3"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    columns = ["heap_in_use", "heap_free", "malloc_mapped", "blocks_in_use", "blocks_idle", "rss_end_of_forward",
               "rss_highest"]
    rows = []
    for system in args.systems:
        body_args = {"model": args.model, "system": system, "warmup": args.warmup, "steps": args.steps}
        rows.append((system, run_on_ranks(args.world, rank_body, body_args)[0]))
        print(f"  {system}: done", flush=True)
    print(f"{args.model}, world {args.world}, rank 0 at the end of the last forward, MiB "
          f"(rss_highest: the most over the {args.steps} timed steps)")
    print(f"{'system':<12}" + "".join(f"{c:>20}" for c in columns))
    for system, r in rows:
        print(f"{system:<12}" + "".join(f"{r[c]:>20.1f}" if c in r else f"{'-':>20}" for c in columns))


if __name__ == "__main__":
    main()
