"""Rank side of tests/test_exit.py and scripts/exit_soak.py: jobs whose point
is how their processes end.

    torchrun --nproc-per-node 2 exit_scenarios.py dead-peer STAGE ROOT
        One step at STAGE, then zero_ext.save(ROOT/ck); the launcher sets
        ZERO_EXT_TEST_FAULT=after_shards:1, so rank 1 exits (os._exit(17))
        mid-save. The survivor must raise zero_ext's RuntimeError, which is left
        uncaught: it exits with code 1, never with SIGABRT at interpreter exit.
    torchrun --max-restarts 1 ... exit_scenarios.py restart ROOT
        An elastic restart: the first attempt wraps (creating zero_ext's
        groups), trains a step and rank 1 dies; the agent restarts both and
        the second attempt wraps again and trains. Each attempt writes
        ROOT/attempt-<n>-rank<r> when it is done. Needs
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 with torch 2.13
        (docs/multi-node.md, "Restarts").
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_ext


def _model(stage: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return zero_ext.wrap(model, opt, stage=stage, timeout=30)


def _step(model, opt, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 4, generator=g)).backward()
    opt.step()
    opt.zero_grad()


def dead_peer(stage: int, root: str) -> None:
    dist.init_process_group("gloo")
    model, opt = _model(stage)
    _step(model, opt, dist.get_rank())
    zero_ext.save(os.path.join(root, "ck"), model, opt, extra={"rank": dist.get_rank()})
    raise AssertionError("unreachable: a rank exits mid-save, so the save must fail on the survivor")


def restart(root: str) -> None:
    attempt = len([n for n in os.listdir(root) if n.startswith("started-")]) // 2
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    open(os.path.join(root, f"started-{attempt}-rank{rank}"), "w").close()
    model, opt = _model(2)
    _step(model, opt, rank)
    if attempt == 0 and rank == 1:
        os._exit(17)  # the agent restarts both workers
    _step(model, opt, rank)
    open(os.path.join(root, f"attempt-{attempt}-rank{rank}"), "w").close()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "dead-peer":
        dead_peer(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "restart":
        restart(sys.argv[2])
    else:
        raise SystemExit(f"unknown scenario {sys.argv[1]!r}")
