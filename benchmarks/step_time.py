"""Step time of zero_ext stages 0-3 against torch DDP and FSDP2, measured in one run.

    python benchmarks/step_time.py                 # 2 CPU ranks (gloo)
    python benchmarks/step_time.py --world 4 --dim 384 --layers 6
    python benchmarks/step_time.py --systems zero_ext-2 zero_ext-2-bf16 zero_ext-2-offload

Any system followed by -compile runs under torch.compile (Inductor; see
build_system), its first step taking the compilation:

    python benchmarks/step_time.py --systems ddp ddp-compile zero_ext-2 zero_ext-2-compile --fresh 3

A zero_ext system is zero_ext-STAGE, optionally followed by -bf16 or -fp16
(mixed precision), -offload (offload_optimizer="cpu"), -keep (stage 3 with
reshard_after_forward=False: units stay gathered from forward to backward),
-reshardK (stage 3 with reshard_after_forward=K: units keep 1/K after forward
and gather within subgroups of K ranks for backward) and -unchecked (without the collective sequence checks, to measure what they
cost: see [Note: collectives that prove what they are] in
csrc/collective_sequence.h).

    python benchmarks/step_time.py --systems fsdp2 fsdp2-keep zero_ext-3 zero_ext-3-keep

For zero_ext, two more columns: the parameter bytes a rank holds between
forward and backward (shards plus gathered units: what reshard_after_forward
trades) and the all-gathers of parameter buckets per step.

    python benchmarks/step_time.py --systems zero_ext-3 zero_ext-3-unchecked --steps 40

Every system trains the same transformer on the same token batches in the same
group of processes; the systems take their steps in turn (round-robin), each
timed over --steps steps after --warmup steps, and the median is reported. Prints a table (ms per step, ratio
against DDP, bytes of model state per rank, final loss) and optionally writes
it as JSON. Timings are not asserted anywhere.

    python benchmarks/step_time.py --fresh 6 --systems ddp zero_ext-0 zero_ext-1 zero_ext-2 zero_ext-3

--fresh N times the systems as a user's runs meet them instead: each run a
fresh group of ranks, N per system, interleaved run by run, every step
between barriers; per system the min / median / max over runs of each run's
median step and of its first step (benchmarks/_fresh.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_lm import TinyGPT  # noqa: E402

from _fresh import add_fresh_argument, fresh_runs, report_fresh  # noqa: E402
from _ranks import add_tiny_gpt_arguments, run_on_ranks, timed_step  # noqa: E402

import zero_ext  # noqa: E402


def make_batch(args, rank, world, step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, args.vocab, (world * args.batch, args.context + 1), generator=g)
    mine = tokens[rank * args.batch:(rank + 1) * args.batch]
    return mine[:, :-1], mine[:, 1:]


def build_system(args, system, world):
    """(model, what the loop calls, optimizer). A system name ending in
    -compile is the same system under torch.compile (Inductor): the whole
    model for DDP and zero_ext stages 0-2 (no graph break of zero_ext's:
    docs/torch-compile-and-profiling.md), each block for FSDP2 and zero_ext
    stage 3 (torchtitan's regional compilation; their hooks break the graph
    around a whole model)."""
    compiled = system.endswith("-compile")
    system = system[:-len("-compile")] if compiled else system
    model, trained, opt = _build_eager(args, system, world)
    if compiled:
        if system.startswith("fsdp2") or system.startswith("zero_ext-3"):
            for block in model.blocks:
                block.compile()
        else:
            trained = torch.compile(trained)
    return model, trained, opt


def _build_eager(args, system, world):
    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.dim, args.layers, args.heads, args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if system == "ddp":
        trained = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb) if world > 1 else model
    elif system.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        reshard = _reshard_policy(system.split("-"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        trained = model
    else:
        parts = system.split("-")
        precision = next((p for p in parts if p in ("bf16", "fp16")), None)
        os.environ["ZERO_EXT_COLLECTIVE_CHECKS"] = "0" if "unchecked" in parts else "1"
        trained, opt = zero_ext.wrap(model, opt, stage=int(parts[1]), bucket_mb=args.bucket_mb,
                                     mixed_precision=precision,
                                     offload_optimizer="cpu" if "offload" in parts else None,
                                     reshard_after_forward=_reshard_policy(parts))
        os.environ.pop("ZERO_EXT_COLLECTIVE_CHECKS")
    return model, trained, opt


def build_for_loop(args, system, world):
    """(the module to call, the optimizer) for --fresh."""
    _, trained, opt = build_system(args, system, world)
    return trained, opt


def _reshard_policy(parts):
    """-keep: False; -reshardK: K; otherwise True."""
    if "keep" in parts:
        return False
    sizes = [int(p[len("reshard"):]) for p in parts if p.startswith("reshard")]
    return sizes[0] if sizes else True


def fsdp2_bytes(model, opt):
    """FSDP2 parameters are DTensor shards; count the local shard bytes."""
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    params = sum(local(p) for p in model.parameters())
    state = sum(local(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": params, "optimizer_state": state}


def run_systems(args, rank, world):
    """Steps the systems round-robin, so drift in machine load hits all alike."""
    built = {system: build_system(args, system, world) for system in args.systems}
    times = {system: [] for system in args.systems}
    losses = {}
    held_after_forward = {system: 0 for system in args.systems}  # zero_ext: parameter bytes, most seen
    gathers = {system: 0 for system in args.systems}

    def compute_loss(system, trained, x, y):
        loss = F.cross_entropy(trained(x).float().flatten(0, 1), y.flatten())
        if system.startswith("zero_ext"):  # one stats() read, outside zero_ext's work
            held = trained._zero_ext.handles.diagnostics.stats()["param_bytes"]
            held_after_forward[system] = max(held_after_forward[system], held)
        return loss

    for step in range(args.warmup + args.steps):
        x, y = make_batch(args, rank, world, step)
        for system, (model, trained, opt) in built.items():
            if world > 1:
                dist.barrier()
            before = trained._zero_ext.handles.diagnostics.stats()["param_gathers"] if system.startswith("zero_ext") else 0
            elapsed, losses[system] = timed_step(lambda: compute_loss(system, trained, x, y), opt)
            if system.startswith("zero_ext"):
                gathers[system] = trained._zero_ext.handles.diagnostics.stats()["param_gathers"] - before
            if step >= args.warmup:
                times[system].append(elapsed)
    results = {}
    for system, (model, trained, opt) in built.items():
        if system.startswith("fsdp2"):
            report = fsdp2_bytes(model, opt)
        else:
            report = zero_ext.memory_report(model, opt)
        if system == "ddp":  # zero_grad() cleared them; during a step DDP holds full grads
            report["grads"] = sum(p.numel() * p.element_size() for p in model.parameters())
        results[system] = {"median_ms": 1e3 * statistics.median(times[system]), "loss": losses[system],
                           "params_after_forward": held_after_forward[system], "gathers_per_step": gathers[system],
                           **report}
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    add_tiny_gpt_arguments(parser)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--systems", nargs="+",
                        default=["ddp", "fsdp2", "fsdp2-keep", "zero_ext-0", "zero_ext-1", "zero_ext-2", "zero_ext-3"],
                        help="ddp, fsdp2 (reshard after forward), fsdp2-keep (no reshard), fsdp2-reshardK, "
                             "zero_ext-N[-keep|-reshardK]...")
    parser.add_argument("--json", help="also write the results here")
    add_fresh_argument(parser)
    args = parser.parse_args()

    n_params = sum(p.numel() for p in TinyGPT(args.vocab, args.dim, args.layers, args.heads, args.context).parameters())
    title = (f"{n_params / 1e6:.2f}M parameters, world size {args.world} (gloo, CPU), "
             f"{args.batch}x{args.context} tokens per rank")
    if args.fresh:
        report_fresh(args, fresh_runs(args, build_for_loop, make_batch, args.steps), title)
        return
    per_rank = run_on_ranks(args.world, run_systems, args, threads=args.threads)
    print(f"{title}, median of {args.steps} steps")
    base = statistics.mean(r["ddp"]["median_ms"] for r in per_rank) if "ddp" in args.systems else None
    header = (f"{'system':<20} {'ms/step':>9} {'vs DDP':>7} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} "
              f"{'loss':>7} {'params after fwd MiB':>21} {'gathers/step':>13}")
    print(header)
    print("-" * len(header))
    table = {}
    for system in args.systems:
        ms = statistics.mean(r[system]["median_ms"] for r in per_rank)
        r0 = per_rank[0][system]
        ratio = f"{ms / base:.2f}x" if base else "-"
        zero = system.startswith("zero_ext")
        after = f"{r0['params_after_forward'] / 2**20:.2f}" if zero else "-"
        print(f"{system:<20} {ms:>9.1f} {ratio:>7} {r0['params'] / 2**20:>11.2f} {r0['grads'] / 2**20:>10.2f} "
              f"{r0['optimizer_state'] / 2**20:>10.2f} {r0['loss']:>7.4f} {after:>21} "
              f"{r0['gathers_per_step'] if zero else '-':>13}")
        table[system] = {"ms_per_step": ms, "ratio_vs_ddp": ms / base if base else None, **r0}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": table}, f, indent=2)


if __name__ == "__main__":
    main()
