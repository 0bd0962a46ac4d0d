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
    torchrun --nproc-per-node 4 exit_scenarios.py groups-freed
        Models wrapped and trained at stages 2 and 3 (one stage 3 model
        regathering in subgroups of 2), then dropped, then
        destroy_process_group(): every group torch had (the world's and
        zero_ext's) must be freed by then, and zero_ext's threads gone. A
        group alive at exit keeps gloo threads that may let go of a
        collective's tensors while the interpreter finalizes, which aborts
        the process ([Note: groups die with destroy_process_group] in
        zero_ext/groups/process_groups.py).
    exit_scenarios.py evaluation-then-barrier   (RANK, WORLD_SIZE, MASTER_* set)
        nanoGPT's master-only evaluation followed by a barrier at stage 3,
        zero_ext's and the world group's timeouts left at 30 minutes: rank 0's
        no_grad forward raises zero_ext's error within seconds (the others
        wait in dist.barrier()), printing "raised at <time.time()>" first, and
        is left uncaught: rank 0 must exit at once, though its header
        exchange is still in flight ([Note: abandoned collectives] in
        csrc/abandoned_collectives.h), and its exit ends the others' barrier.
    exit_scenarios.py peer-killed KIND VICTIM ROOT   (RANK, WORLD_SIZE, MASTER_* set)
        Rank VICTIM kills itself (SIGKILL) during zero_ext's background work
        of KIND, zero_ext's timeouts left at 30 minutes: async-save and
        async-save-dcp, victim 1 in its writer thread of save(...,
        async_save=True) once its files are written, before it posts its
        report (the test arms ZERO_EXT_TEST_FAULT=async_after_write:1:
        os._exit), victim 0 (the store's host) as the save returns;
        nvme, in the middle of a backward with parameters and optimizer
        state in files under ROOT (the I/O threads in flight). The
        survivor trains on, raises zero_ext's error, leaves it
        uncaught and must exit within seconds ([Note: an asynchronous save
        at exit] in zero_ext/files/asynchronous.py), printing no c10d
        warning with a C++ stack trace.
    exit_scenarios.py store-host-killed HOW   (RANK, WORLD_SIZE=2, MASTER_* set)
        Rank 0, the TCPStore's host, kills itself; rank 1 then adds to a key
        through the job's store, HOW: "quiet" (zero_ext's QuietStore, what
        its own exchanges use) or "plain" (torch's store object, as a
        control: c10d logs the broken connection with a C++ stack trace),
        prints "raised: <error>" and exits 0.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_ext


def _model(stage: int, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return zero_ext.wrap(model, opt, stage=stage, timeout=30, **options)


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


def groups_freed() -> None:
    # The user's order: the group first, then the optimizer, whose first
    # creation imports torch._dynamo and with it torch.distributed.nn.functional.
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for stage, reshard in ((2, True), (3, True), (3, 2)):
        model, opt = _model(stage, reshard_after_forward=reshard)
        _step(model, opt, rank)
        _step(model, opt, rank)
    del model, opt
    groups = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map]
    assert len(groups) > 1, "zero_ext made no groups of its own: the scenario tests nothing"
    dist.destroy_process_group()
    gc.collect()
    deadline = time.monotonic() + 5.0  # the whereabouts thread sees its model gone within a second
    while any(t.name.startswith("zero_ext") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()
    alive = [i for i, g in enumerate(groups) if g() is not None]
    threads = [t.name for t in threading.enumerate() if t.name.startswith("zero_ext")]
    assert not alive and not threads, (
        f"rank {rank}: after destroy_process_group() groups {alive} of {len(groups)} (0: the world's) are still "
        f"alive, and zero_ext threads {threads}")
    print(f"rank {rank}: {len(groups)} groups freed", flush=True)


def evaluation_then_barrier() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, opt = zero_ext.wrap(model, torch.optim.AdamW(model.parameters(), lr=0.01), stage=3)
    _step(model, opt, rank)
    print(f"rank {rank}: stepped", flush=True)
    if rank == 0:
        try:
            with torch.no_grad():
                model(torch.randn(4, 8))
        except RuntimeError:
            print(f"rank 0: raised at {time.time()}", flush=True)
            raise
    dist.barrier()
    raise AssertionError("unreachable: rank 0's forward must raise, and its exit end the barrier")


def peer_killed(kind: str, victim: int, root: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # 0.5M parameters: saves take a while
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    options = {}
    if kind == "nvme":
        options = dict(offload_params="nvme", offload_optimizer="nvme", offload_path=os.path.join(root, "offload"))
    model, opt = zero_ext.wrap(model, opt, stage=3 if kind == "nvme" else 2, **options)

    def die() -> None:
        print(f"rank {rank}: killed at {time.time()}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def step(n: int) -> None:
        g = torch.Generator().manual_seed(100 * n + rank)
        x = torch.randn(8, 256, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step(0)
    if kind == "nvme" and rank == victim:
        model[4].register_full_backward_hook(lambda *args: die())
    elif kind.startswith("async-save"):
        fmt = "dcp" if kind == "async-save-dcp" else "zero_ext"
        # Victim 1: its writer thread ends its process once its files are
        # written, before it posts its report (ZERO_EXT_TEST_FAULT, set by
        # the test): the survivor's writer waits for a report that never
        # comes. Victim 0 (the store's host) is killed as the save returns:
        # the survivor's writer finds the store gone.
        zero_ext.save(os.path.join(root, "ck"), model, opt, format=fmt, async_save=True)
        if rank == victim == 0:
            die()
    for n in range(1, 1000):
        step(n)
    raise AssertionError("unreachable: the victim died, so a collective must fail on the survivor")


def store_host_killed(how: str) -> None:
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    if how == "quiet":
        from zero_ext.tools import core_loader
        store = core_loader.QuietStore(dist.group.WORLD.group_name)
    else:
        store = dist.distributed_c10d._get_default_store()
    try:
        store.add("zero_ext_test/after", 1)
        print("raised: nothing", flush=True)
    except Exception as e:  # noqa: BLE001 - what the caller sees is the point
        print(f"raised: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "dead-peer":
        dead_peer(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "restart":
        restart(sys.argv[2])
    elif sys.argv[1] == "groups-freed":
        groups_freed()
    elif sys.argv[1] == "evaluation-then-barrier":
        evaluation_then_barrier()
    elif sys.argv[1] == "store-host-killed":
        store_host_killed(sys.argv[2])
    elif sys.argv[1] == "peer-killed":
        peer_killed(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown scenario {sys.argv[1]!r}")
