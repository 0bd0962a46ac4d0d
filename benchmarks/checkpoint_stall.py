"""How long a checkpoint save stops training: zero_ext's save, at once and
asynchronous (async_save=True), in its own format and as DCP, against
FSDP2 with torch.distributed.checkpoint's save and async_save, each on the
same model, world size and data, interleaved round by round.

    python benchmarks/checkpoint_stall.py                          # gpt2-50m, world 2
    python benchmarks/checkpoint_stall.py --model llama-200m --rounds 2

A round, per system: barrier; the save call (timed: the part that blocks
the loop); then --steps training steps timed one by one (a background
write slows them: the excess over that system's median step without a save
is stall too); then whatever is left of the background write (waited for,
as the next save would). The stall is the sum; the slowest rank's counts.
zero_ext runs at --stage (default 3) with AdamW, FSDP2 with fully_shard per
block and AdamW; DCP's async_save gets a gloo group of its own, as its
documentation asks. Checkpoints go to --dir (default: a temporary directory
on this machine's disk, page cache and all: a cold disk or a network
filesystem makes every save slower, and asynchrony worth more). Nothing is
asserted.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import blocks_of, build_model, describe  # noqa: E402
from _ranks import run_on_ranks  # noqa: E402

import zero_ext  # noqa: E402

SYSTEMS = ["zero_ext", "zero_ext async", "zero_ext dcp", "zero_ext dcp async", "FSDP2 dcp.save",
           "FSDP2 dcp.async_save"]


def _batch(args, rank: int, step: int, vocab: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)


def _step(model, opt, tokens) -> float:
    start = time.perf_counter()
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def body(args, rank, world):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ours = build_model(args.model, builtin=True)
    vocab = ours.lm_head.out_features if hasattr(ours, "lm_head") else 32000
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    ours, ours_opt = zero_ext.wrap(ours, ours_opt, stage=args.stage)
    fsdp = build_model(args.model, builtin=True)
    mesh = init_device_mesh("cpu", (world,))
    for block in blocks_of(fsdp):
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4)
    side = dist.new_group(backend="gloo")  # DCP's async_save: its collectives off the training group
    pair = {"zero_ext": (ours, ours_opt), "FSDP2": (fsdp, fsdp_opt)}

    step = [0]
    def train(system: str) -> float:
        model, opt = pair[system.split()[0]]
        step[0] += 1
        return _step(model, opt, _batch(args, rank, step[0], vocab))

    base = {}
    for name in ("zero_ext", "FSDP2"):  # warm up, then each system's step without a save
        for _ in range(2):
            train(name)
        base[name] = statistics.median(train(name) for _ in range(args.steps))

    rows = {s: [] for s in SYSTEMS}
    pending = {}
    for r in range(args.rounds):
        for system in SYSTEMS:
            path = os.path.join(args.dir, system.replace(" ", "_").replace(".", "_"))
            model, opt = pair[system.split()[0]]
            dist.barrier()
            start = time.perf_counter()
            if system.startswith("zero_ext"):
                handle = zero_ext.save(path, model, opt, format="dcp" if "dcp" in system else "zero_ext",
                                       async_save="async" in system)
            else:
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optim": osd}
                target = f"{path}-{r}"  # DCP writes in place: a new directory per save, as torchtitan does
                if "async" in system:
                    handle = dcp.async_save(state, checkpoint_id=target, process_group=side)
                else:
                    dcp.save(state, checkpoint_id=target)
                    handle = None
            call = time.perf_counter() - start
            excess = sum(max(0.0, train(system) - base[system.split()[0]]) for _ in range(args.steps))
            start = time.perf_counter()
            if handle is not None:
                handle.wait() if hasattr(handle, "wait") else handle.result()
            left = time.perf_counter() - start
            rows[system].append((call, excess, left))
            pending[system] = path
        dist.barrier()
        if rank == 0:
            for name in os.listdir(args.dir):
                if name.startswith("FSDP2"):
                    shutil.rmtree(os.path.join(args.dir, name), ignore_errors=True)
        dist.barrier()
    return {"rows": rows, "base": base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-50m")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="training steps after each save call")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    own = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="zero_ext-stall-")
    try:
        results = run_on_ranks(args.world, body, args, threads=args.threads)
    finally:
        if own:
            shutil.rmtree(args.dir, ignore_errors=True)
    params = sum(p.numel() for p in build_model(args.model, builtin=True).parameters())
    print(f"{describe(args.model)}: {params / 1e6:.1f}M parameters, world {args.world}, zero_ext stage {args.stage}, "
          f"AdamW; {args.rounds} rounds, {args.steps} steps after each save; step without a save (median, slowest "
          f"rank): zero_ext {max(r['base']['zero_ext'] for r in results) * 1e3:.0f} ms, FSDP2 "
          f"{max(r['base']['FSDP2'] for r in results) * 1e3:.0f} ms")
    print()
    print("| system | save call blocks (ms) min / median / max | slower steps after it (ms) | left to wait (ms) "
          "| stall (ms) median | stall / its own format's synchronous save |")
    print("|---|---|---|---|---|---|")
    medians = {}
    for system in SYSTEMS:
        per_round = [[max(r["rows"][system][k][i] for r in results) for i in range(3)]
                     for k in range(args.rounds)]
        stall = [sum(x) for x in per_round]
        medians[system] = statistics.median(stall)
        calls = sorted(x[0] for x in per_round)
        sync = {"zero_ext async": "zero_ext", "zero_ext dcp async": "zero_ext dcp",
                "FSDP2 dcp.async_save": "FSDP2 dcp.save"}.get(system)
        ratio = f"{medians[system] / medians[sync]:.2f}" if sync else "1"
        print(f"| {system} | {calls[0] * 1e3:.0f} / {statistics.median(calls) * 1e3:.0f} / {calls[-1] * 1e3:.0f} "
              f"| {statistics.median(x[1] for x in per_round) * 1e3:.0f} "
              f"| {statistics.median(x[2] for x in per_round) * 1e3:.0f} | {medians[system] * 1e3:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
