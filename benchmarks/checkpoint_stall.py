"""How long a checkpoint save stops training: zero_ext's save, at once and
asynchronous (async_save=True), in its own format and as DCP, against
FSDP2 with torch.distributed.checkpoint's save and async_save, each on the
same model, world size and data, interleaved round by round.

    python benchmarks/checkpoint_stall.py                          # gpt2-50m, world 2
    python benchmarks/checkpoint_stall.py --model gpt2-75m --stage 2 --rounds 5
    python benchmarks/checkpoint_stall.py --model llama-200m --rounds 2

A round, per system: barrier; the save call (timed: the part that blocks
the loop); then --steps training steps timed one by one (a background
write slows them: the excess over that system's median step without a save
is stall too, and so is a step's wait for an asynchronous save's snapshot,
reported apart for zero_ext); then whatever is left of the background write
(waited for, as the next save would). The stall is the sum; the slowest
rank's counts. Round 1 is each system's first save: its call is reported
apart (a first asynchronous save allocates its host buffers), and every
call as a share of its format's synchronous save (the median of that
system's stall). zero_ext runs at --stage (default 3) with AdamW, FSDP2
with fully_shard per block and AdamW; DCP's async_save gets a gloo group
of its own, as its documentation asks. Checkpoints go to --dir (default: a
temporary directory on this machine's disk, page cache and all: a cold
disk or a network filesystem makes every save slower, and asynchrony worth
more). --systems picks some of the systems (comma-separated). Nothing is
asserted.

gpt2-75m is this script's own preset (75.3M parameters: GPT-2 shape, dim
640, 11 layers, 10 heads, vocabulary 32000), beside benchmarks/_models.py's.
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
import _models  # noqa: E402
from _models import Preset, blocks_of, build_model, describe  # noqa: E402
from _ranks import run_on_ranks  # noqa: E402

import zero_ext  # noqa: E402

# This script's own preset, registered where build_model looks (in every
# spawned rank too, which imports this module): issue 56's ~75M model.
_models.PRESETS.setdefault("gpt2-75m", Preset("gpt2", 640, 11, 10, 32000, 1024))

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
    pair = {"zero_ext": (ours, ours_opt)}
    if any(s.startswith("FSDP2") for s in args.systems):
        fsdp = build_model(args.model, builtin=True)
        mesh = init_device_mesh("cpu", (world,))
        for block in blocks_of(fsdp):
            fully_shard(block, mesh=mesh)
        fully_shard(fsdp, mesh=mesh)
        pair["FSDP2"] = (fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-4))
    side = dist.new_group(backend="gloo")  # DCP's async_save: its collectives off the training group

    step = [0]
    def train(system: str) -> float:
        model, opt = pair[system.split()[0]]
        step[0] += 1
        return _step(model, opt, _batch(args, rank, step[0], vocab))

    base = {}
    for name in pair:  # warm up, then each system's step without a save
        for _ in range(2):
            train(name)
        base[name] = statistics.median(train(name) for _ in range(args.steps))

    rows = {s: [] for s in args.systems}
    pending = {}
    for r in range(args.rounds):
        for system in args.systems:
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
            # zero_ext: how long steps waited for the snapshot (part of `excess`), and the copy itself
            gate = getattr(handle, "snapshot_wait_s", 0.0)
            copy = getattr(handle, "snapshot_s", 0.0)
            rows[system].append((call, excess, left, gate, copy))
            pending[system] = path
        dist.barrier()
        if rank == 0:
            for name in os.listdir(args.dir):
                if name.startswith("FSDP2"):
                    shutil.rmtree(os.path.join(args.dir, name), ignore_errors=True)
        dist.barrier()
    return {"rows": rows, "base": base}


def _ms(values) -> str:
    values = sorted(values)
    return f"{values[0] * 1e3:.0f} / {statistics.median(values) * 1e3:.0f} / {values[-1] * 1e3:.0f}"


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
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of: {', '.join(SYSTEMS)}")
    args = parser.parse_args()
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose among {SYSTEMS}")
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
          "rank): " + ", ".join(f"{name} {max(r['base'][name] for r in results) * 1e3:.0f} ms"
                                for name in results[0]["base"]))
    print()
    print("ms, slowest rank; min / median / max over rounds where three figures. call: what the save call blocks "
          "(first: round 1's; later: rounds 2 on); % sync: that call over its format's synchronous save (median "
          "stall); snapshot wait: steps waiting for an asynchronous save's snapshot (part of the slower steps); "
          "copy: the snapshot's copy in the writer thread")
    print()
    print("| system | first call | later calls | call % sync (first / later median) | slower steps "
          "| snapshot wait / copy | left to wait | stall | stall / sync |")
    print("|---|---|---|---|---|---|---|---|---|")
    stalls = {}
    per_system = {}
    for system in args.systems:
        per_round = [[max(r["rows"][system][k][i] for r in results) for i in range(5)]
                     for k in range(args.rounds)]
        per_system[system] = per_round
        stalls[system] = [x[0] + x[1] + x[2] for x in per_round]
    for system in args.systems:
        per_round = per_system[system]
        stall = stalls[system]
        sync = {"zero_ext async": "zero_ext", "zero_ext dcp async": "zero_ext dcp",
                "FSDP2 dcp.async_save": "FSDP2 dcp.save"}.get(system)
        reference = statistics.median(stalls[sync]) if sync in stalls else None
        calls = [x[0] for x in per_round]
        later = calls[1:] or calls
        share = (f"{100 * calls[0] / reference:.0f}% / {100 * statistics.median(later) / reference:.0f}%"
                 if reference else "-")
        ratio = f"{statistics.median(stall) / reference:.2f}" if reference else ("1" if sync is None else "-")
        gate = (f"{statistics.median(x[3] for x in per_round) * 1e3:.0f} / "
                f"{statistics.median(x[4] for x in per_round) * 1e3:.0f}" if system.startswith("zero_ext") and sync
                else "-")
        print(f"| {system} | {calls[0] * 1e3:.0f} | {_ms(later)} | {share} | {_ms(x[1] for x in per_round)} "
              f"| {gate} | {_ms(x[2] for x in per_round)} | {_ms(stall)} | {ratio} |")


if __name__ == "__main__":
    main()
