"""One replica of tests/test_replicas.py: a small model wrapped with
replicas=zero_ext.Replicas(...), trained for --steps steps on the batches
of its replica id and step (the step zero_ext.replica_status reports, so a
replica that joins takes up where the others are). Each rank 0 prints one
line per step, "step S contributors A,B t=SECONDS", and at the end writes
the full state and the status to --out.

    torchrun --nproc-per-node 2 tests/replica_job.py --coordinator HOST:PORT --replica a --steps 12 --out a.pt
"""
import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import zero_ext

DIM, BATCH = 8, 8  # BATCH: the replica's global batch, split over its ranks


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(replica: str, step: int):
    """The replica's global batch at a step (the same however many ranks it has)."""
    g = torch.Generator().manual_seed(7919 * step + sum(map(ord, replica)))
    x = torch.randn(BATCH, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def loss_of(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="another seed: the join must bring the weights")
    parser.add_argument("--width", type=int, default=16, help="another width: refused at join")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--mixed-precision", default=None)
    parser.add_argument("--offload-optimizer", default=None)
    parser.add_argument("--compress-grads", default=None)
    parser.add_argument("--save", default="", help="zero_ext.save there at the end (replica a)")
    parser.add_argument("--rank1-replica", default="", help="rank 1 passes this replica id instead (a mistake)")
    parser.add_argument("--hold", action="append", default=[], metavar="STEP:FILE",
                        help="before step STEP, wait for FILE to exist (repeatable)")
    parser.add_argument("--die-in", choices=["forward", "backward"], help="rank 1 kills itself there at --die-at")
    parser.add_argument("--die-at", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = model_and_optimizer(args.seed)
    if args.width != 16:
        model[2] = nn.Linear(16, args.width)
        model[4] = nn.Linear(args.width, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with open(f"{args.out}.pid{rank}", "w") as f:
        f.write(str(os.getpid()))
    model, optimizer = zero_ext.wrap(model, optimizer, stage=args.stage, mixed_precision=args.mixed_precision,
                                     offload_optimizer=args.offload_optimizer, compress_grads=args.compress_grads,
                                     replicas=zero_ext.Replicas(coordinator=args.coordinator,
                                                                replica_id=args.rank1_replica if rank == 1 and
                                                                args.rank1_replica else args.replica,
                                                                timeout=args.timeout))
    if rank == 0:  # wrapped: its heartbeats run, and its next call asks for a quorum
        open(f"{args.out}.wrapped", "w").close()
    per = BATCH // world
    while zero_ext.replica_status(model)["step"] < args.steps:
        step = zero_ext.replica_status(model)["step"]
        for hold in args.hold:
            at, _, gate = hold.partition(":")
            while step == int(at) and not os.path.exists(gate):
                time.sleep(0.05)
        x, y = batch(args.replica, step)
        dying = rank == min(1, world - 1) and step == args.die_at
        if dying and args.die_in == "forward":
            os.kill(os.getpid(), signal.SIGKILL)
        loss = loss_of(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        if dying and args.die_in == "backward":  # mid-backward: the first layer's gradient comes last
            next(iter(model.parameters())).register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        status = zero_ext.replica_status(model)
        if rank == 0:
            print(f"step {status['step'] - 1} contributors {','.join(status['contributed'][status['step'] - 1])} "
                  f"t={time.time():.3f}", flush=True)
        time.sleep(args.step_sleep)
    if args.save:
        zero_ext.save(args.save, model, optimizer)
    state = zero_ext.full_state_dict(model)
    if rank == 0:
        torch.save({"state": state, "status": zero_ext.replica_status(model)}, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
