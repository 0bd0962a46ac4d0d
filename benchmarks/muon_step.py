"""Muon + AdamW (the standard recipe: Muon for the blocks' matrices, AdamW for
embeddings, norms and biases) under DDP, FSDP2 and zero_ext stages 1-3:
where the step time goes, and how the optimizer state is spread.

DDP runs Muon's Newton-Schulz on every rank for every matrix; zero_ext shards
Muon by whole parameter (optim/ownership.py), so each rank orthogonalizes only
the matrices it owns. The issue's goal: zero_ext stage 2's step at most DDP's
minus (1 - 1/world) of DDP's Muon time, within 10%.

    python benchmarks/muon_step.py --world 2            # step times, a 4-layer d=512 GPT on CPU
    python benchmarks/muon_step.py --balance            # state bytes per rank, GPT-2 small, worlds 2/4/8

Prints a table; writes benchmarks/results/muon-<time>.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import PRESETS, BuiltinGPT2, Preset  # noqa: E402
from _ranks import run_on_ranks  # noqa: E402

SMALL = Preset("gpt2", 512, 4, 8, 8192, 256)  # 12.6M parameters in the blocks' matrices
SYSTEMS = ("ddp", "fsdp2", "zero_ext-1", "zero_ext-2", "zero_ext-3")


def is_block_matrix(name: str, p: torch.Tensor) -> bool:
    return p.dim() == 2 and ".h." in f".{name}" and not name.startswith(("wte", "wpe"))


def muon_and_adamw(model: torch.nn.Module) -> List[torch.optim.Optimizer]:
    matrices = [p for n, p in model.named_parameters() if is_block_matrix(n, p)]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=3e-4)]


def _body(args, rank: int, world: int) -> Dict[str, object]:
    torch.manual_seed(0)
    model = BuiltinGPT2(SMALL)
    system = args["system"]
    try:
        if system == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(model)
            opts = muon_and_adamw(model.module)
        elif system == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for block in model.h:
                fully_shard(block)
            fully_shard(model)
            opts = muon_and_adamw(model)
        else:
            import zero_ext
            opts = muon_and_adamw(model)
            model, opts = zero_ext.wrap(model, opts, stage=int(system.split("-")[1]))
        fwd_bwd, muon, adamw, total, losses = [], [], [], [], []
        gen = torch.Generator().manual_seed(rank)
        for step in range(args["warmup"] + args["steps"]):
            idx = torch.randint(0, SMALL.vocab, (args["batch"], args["seq"]), generator=gen)
            dist.barrier()
            t0 = time.perf_counter()
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
            t1 = time.perf_counter()
            opts[0].step()
            t2 = time.perf_counter()
            opts[1].step()
            for opt in opts:
                opt.zero_grad()
            t3 = time.perf_counter()
            losses.append(loss.item())
            if step >= args["warmup"]:
                fwd_bwd.append(t1 - t0)
                muon.append(t2 - t1)
                adamw.append(t3 - t2)
                total.append(t3 - t0)
        state = sum(t.numel() * t.element_size() for opt in opts for st in opt.state.values()
                    for t in st.values() if isinstance(t, torch.Tensor))
        med = statistics.median
        return {"fwd_bwd_ms": 1e3 * med(fwd_bwd), "muon_ms": 1e3 * med(muon), "adamw_ms": 1e3 * med(adamw),
                "step_ms": 1e3 * med(total), "loss": losses[-1], "state_bytes": state}
    except Exception as e:  # recorded: one failing system does not end the comparison
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}


def step_times(args) -> Dict[str, object]:
    results = {}
    for system in args.systems:
        ranks = run_on_ranks(args.world, _body, {"system": system, "warmup": args.warmup, "steps": args.steps,
                                                 "batch": args.batch, "seq": args.seq}, threads=args.threads)
        if any("error" in r for r in ranks):
            results[system] = {"error": next(r["error"] for r in ranks if "error" in r)}
            continue
        mean = {k: statistics.mean(r[k] for r in ranks) for k in ("fwd_bwd_ms", "muon_ms", "adamw_ms", "step_ms")}
        mean["max_state_bytes"] = max(r["state_bytes"] for r in ranks)
        mean["loss"] = ranks[0]["loss"]
        results[system] = mean
    ddp = results.get("ddp", {})
    goal = None
    if "step_ms" in ddp:
        goal = ddp["step_ms"] - (1 - 1 / args.world) * ddp["muon_ms"]
    lines = [f"Muon + AdamW, {SMALL.layers}-layer d={SMALL.dim} GPT (vocab {SMALL.vocab}), world {args.world} on CPU "
             f"(gloo, {args.threads} thread(s) per rank), batch {args.batch} x {args.seq}; medians of "
             f"{args.steps} steps after {args.warmup}, averaged over ranks", "",
             "| system | fwd+bwd ms | Muon step ms | AdamW step + zero_grad ms | step ms | max state MiB/rank | loss |",
             "|---|---|---|---|---|---|---|"]
    for system, r in results.items():
        if "error" in r:
            lines.append(f"| {system} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {system} | {r['fwd_bwd_ms']:.1f} | {r['muon_ms']:.1f} | {r['adamw_ms']:.1f} | "
                     f"{r['step_ms']:.1f} | {r['max_state_bytes'] / 2 ** 20:.1f} | {r['loss']:.4f} |")
    if goal is not None:
        lines += ["", f"goal for zero_ext-2: step <= DDP's {ddp['step_ms']:.1f} - (1 - 1/{args.world}) x "
                      f"DDP's Muon {ddp['muon_ms']:.1f} = {goal:.1f} ms (x1.1: {1.1 * goal:.1f})"]
    return {"results": results, "goal_ms": goal, "table": "\n".join(lines)}


def balance(args) -> Dict[str, object]:
    """From the plan alone (no ranks): optimizer-state bytes each rank would
    hold for GPT-2 small with Muon + AdamW at stage 2: Muon's momentum for
    the matrices a rank owns whole, AdamW's two moments for its equal shard
    of every AdamW bucket; and the per-rank gradient shard of the Muon
    buckets (whole regions are padded to the widest)."""
    from zero_ext.optim.ownership import plan_owners
    from zero_ext.wrapping.buckets import plan_buckets
    from zero_ext.wrapping.plan import _split_by_optimizer

    with torch.device("meta"):
        model = BuiltinGPT2(PRESETS["gpt2-124m"])
    muon, adamw = muon_and_adamw(model)
    trainable = list(model.parameters())
    ordered, counts = plan_buckets(trainable, 25 * 2 ** 20)
    ordered, counts, _ = _split_by_optimizer(ordered, counts, [muon, adamw], [])
    whole = {id(p) for g in muon.param_groups for p in g["params"]}
    rows = []
    for world in args.balance_worlds:
        placed, owners = plan_owners(ordered, counts, world, whole)
        state = [0] * world
        grad_shard = [0] * world
        first = 0
        for count in counts:
            members = list(zip(placed[first:first + count], owners[first:first + count]))
            first += count
            numel = sum(p.numel() for p, _ in members)
            if members[0][1] >= 0:  # Muon: whole, on its owner
                widest = max(sum(p.numel() for p, o in members if o == r) for r in range(world))
                for p, o in members:
                    state[o] += 4 * p.numel()
                for r in range(world):
                    grad_shard[r] += 4 * widest
            else:  # AdamW: equal shards
                shard = -(-numel // world)
                for r in range(world):
                    state[r] += 8 * shard
                    grad_shard[r] += 4 * shard
        mean = statistics.mean(state)
        flat_grad = 4 * sum(-(-sum(p.numel() for p in placed[f:f + c]) // world)
                            for f, c in zip([sum(counts[:k]) for k in range(len(counts))], counts))
        rows.append({"world": world, "max_state_mib": max(state) / 2 ** 20, "mean_state_mib": mean / 2 ** 20,
                     "max_over_mean": max(state) / mean, "grad_shard_mib": max(grad_shard) / 2 ** 20,
                     "flat_grad_shard_mib": flat_grad / 2 ** 20})
    lines = ["Optimizer state per rank, GPT-2 small (124M; Muon on the 48 block matrices, AdamW on the rest), "
             "stage 2 plan (25 MiB buckets), from the plan without launching", "",
             "| world | max state MiB | mean state MiB | max/mean | grad shard MiB/rank | if all flat |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['max_state_mib']:.1f} | {r['mean_state_mib']:.1f} | "
                     f"{r['max_over_mean']:.3f} | {r['grad_shard_mib']:.1f} | {r['flat_grad_shard_mib']:.1f} |")
    return {"rows": rows, "table": "\n".join(lines)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=129)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--balance", action="store_true", help="only the state-balance table (no ranks)")
    parser.add_argument("--balance-worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = balance(args) if args.balance else step_times(args)
    print(out["table"])
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    base = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"muon-{stamp}-{'balance' if args.balance else f'w{args.world}'}")
    with open(base + ".json", "w") as f:
        json.dump({k: v for k, v in out.items() if k != "table"}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(out["table"] + "\n")


if __name__ == "__main__":
    main()
