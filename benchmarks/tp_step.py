"""Step time and bytes of model state per rank of a Llama-style model under
2-D parallelism (data x tensor), against plain data parallelism, on 4 CPU
ranks (gloo), measured in one run.

    python benchmarks/tp_step.py                   # stage 3, AdamW
    python benchmarks/tp_step.py --stage 2 --rounds 30
    python benchmarks/tp_step.py --dim 128 --layers 2 --rounds 5     # quick

The systems, every one over the same global batch each step:

    zero_ext dp 4            the plain model, zero_ext.wrap(stage=S) over the world group
    zero_ext dp 2 x tp 2     each block made tensor parallel by torch's parallelize_module
                             over mesh["tp"] (examples/tensor_parallel.py's plan), then
                             zero_ext.wrap(stage=S, process_group=mesh["dp"])
    FSDP2 + TP dp 2 x tp 2   the same tensor parallel model, fully_shard on each block and
                             the root over mesh["dp"] (torchtitan's recipe)

The model is examples/tensor_parallel.py's Llama (RMSNorm, rotary causal
attention, SwiGLU), the same weights in every system (seed 0). The dp
ranks split the global batch; the tp ranks of one dp group take the same
slice. All three are built in the same processes, then step in rounds, each
system one timed step per round, the order rotating from round to round, so
that the machine's slow spells fall on all alike. A step is timed as a
user's loop would time it: dist.barrier(), then time.perf_counter() around
forward, backward, optimizer.step() and zero_grad(), nothing else (no
clipping, no profiler); a step's time is the slowest rank's. The table gives
min / median / max over the timed rounds after --warmup rounds, the bytes of
parameters, gradients and optimizer state a rank holds after backward (the
most over ranks; zero_ext.memory_report for zero_ext, the local shards of
the DTensors for FSDP2) and the loss of the global batch at the last timed
step (the same data and weights: the systems should agree to float
rounding). A system that fails is reported with its error, in the table and
as a traceback from rank 0, and the others go on. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))  # this checkout when none is installed
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "..", "examples"))
import zero_ext  # noqa: E402
from _ranks import run_on_ranks  # noqa: E402
from tensor_parallel import Llama, parallelize  # noqa: E402

SYSTEMS = ("zero_ext dp 4", "zero_ext dp 2 x tp 2", "FSDP2 + TP dp 2 x tp 2")
WORLD, TP = 4, 2


def fully_shard_api():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def make_model(args) -> Llama:
    torch.manual_seed(0)
    return Llama(args.vocab, args.dim, args.layers, args.heads)


def build(args, system: str):
    """(model, optimizer, dp, dp_rank, tp_rank) of one system on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    model = make_model(args)
    if system == "zero_ext dp 4":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        model, opt = zero_ext.wrap(model, opt, stage=args.stage, process_group=None)
        return model, opt, WORLD, dist.get_rank(), 0
    mesh = init_device_mesh("cpu", (WORLD // TP, TP), mesh_dim_names=("dp", "tp"))  # each system its own groups
    parallelize(model, mesh["tp"])
    if system == "zero_ext dp 2 x tp 2":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        model, opt = zero_ext.wrap(model, opt, stage=args.stage, process_group=mesh["dp"])
    else:
        fully_shard = fully_shard_api()
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return model, opt, WORLD // TP, mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()


def batch(args, step: int, dp: int, dp_rank: int):
    """This dp rank's slice of step's global batch (the same global batch at any dp)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, args.vocab, (args.global_batch, args.context + 1), generator=g)
    per = args.global_batch // dp
    mine = tokens[dp_rank * per:(dp_rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def fsdp2_bytes(model, opt):
    """FSDP2's parameters, gradients and optimizer state are DTensors; their local shards."""
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(local_bytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer_state": state}


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def agree_on_errors(errors: dict) -> None:
    """Every rank drops the systems any rank failed in (one world collective, outside the timed steps)."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, errors)
    for theirs in seen:
        for system, text in theirs.items():
            errors.setdefault(system, text)


def report_error(rank: int, system: str, where: str) -> None:
    if rank == 0:
        print(f"[tp_step] {system} failed {where}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)


def run(args, rank, world):
    errors, built = {}, {}
    for system in args.systems:
        try:
            built[system] = build(args, system)
        except Exception as e:  # reported: one failing system does not end the comparison
            errors[system] = error_text(e)
            report_error(rank, system, "to build")
    agree_on_errors(errors)

    def one_step(system, step, measure=False):
        model, opt, dp, dp_rank, _ = built[system]
        x, y = batch(args, step, dp, dp_rank)
        dist.barrier()
        start = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        held = None
        if measure:  # untimed: the bytes a rank holds after backward, where gradients peak
            held = fsdp2_bytes(model, opt) if system.startswith("FSDP2") else zero_ext.memory_report(model, opt)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start, loss.item(), held

    times = {system: [] for system in args.systems}
    losses, held = {}, {}
    for r in range(args.warmup + args.rounds + 1):
        order = list(args.systems)
        order = order[r % len(order):] + order[:r % len(order)]
        for system in order:
            if system in errors:
                continue
            try:
                if r == args.warmup + args.rounds:  # the last, untimed round measures the bytes
                    _, _, held[system] = one_step(system, r, measure=True)
                    continue
                elapsed, loss, _ = one_step(system, r)
                if r >= args.warmup:
                    times[system].append(elapsed)
                    losses[system] = loss
            except Exception as e:
                errors[system] = error_text(e)
                report_error(rank, system, f"in round {r}")
        agree_on_errors(errors)
    return {"times": times, "losses": losses, "held": held, "errors": errors,
            "coords": {s: list(built[s][2:]) for s in built}}


def markdown(args, per_rank) -> str:
    n_params = sum(p.numel() for p in make_model(args).parameters())
    lines = [f"{n_params / 1e6:.2f}M-parameter Llama (dim {args.dim}, {args.layers} layers, {args.heads} heads, "
             f"vocab {args.vocab}), world {WORLD} on CPU (gloo, {args.threads} thread(s) per rank), global batch "
             f"{args.global_batch} x {args.context} tokens, zero_ext stage {args.stage}, AdamW; "
             f"{args.rounds} rounds after {args.warmup}, each step the slowest rank's", "",
             "| system | ms/step min | median | max | params MiB | grads MiB | optim MiB | total MiB/rank | loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    errors = {}
    for r in per_rank:
        for system, text in r["errors"].items():
            errors.setdefault(system, text)
    for system in args.systems:
        if system in errors:
            lines.append(f"| {system} | error: {errors[system].replace('|', '/')} | | | | | | | |")
            continue
        steps = [max(r["times"][system][i] for r in per_rank) * 1e3 for i in range(args.rounds)]
        held = {k: max(r["held"][system][k] for r in per_rank) / 2 ** 20
                for k in ("params", "grads", "optimizer_state")}
        total = max(sum(r["held"][system].values()) for r in per_rank) / 2 ** 20
        # the global batch's loss: the mean over dp ranks (one per dp rank: tp rank 0)
        loss = statistics.mean(r["losses"][system] for r in per_rank if r["coords"][system][2] == 0)
        lines.append(f"| {system} | {min(steps):.1f} | {statistics.median(steps):.1f} | {max(steps):.1f} | "
                     f"{held['params']:.2f} | {held['grads']:.2f} | {held['optimizer_state']:.2f} | {total:.2f} | "
                     f"{loss:.5f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="zero_ext's stage")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=32,
                        help="sequences per step over all ranks (dp 4: a quarter each, dp 2: half)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS, metavar="SYSTEM",
                        help=f"a subset of: {', '.join(repr(s) for s in SYSTEMS)}")
    parser.add_argument("--json", help="also write the per-rank results here")
    args = parser.parse_args()
    if args.global_batch % WORLD:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over {WORLD} ranks")
    if args.heads % TP:
        raise SystemExit(f"--heads {args.heads} does not split over tp {TP}")

    started = time.perf_counter()
    per_rank = run_on_ranks(WORLD, run, args, threads=args.threads)
    print(markdown(args, per_rank))
    print(f"\n({time.perf_counter() - started:.0f} s in all)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": per_rank}, f, indent=2)


if __name__ == "__main__":
    main()
