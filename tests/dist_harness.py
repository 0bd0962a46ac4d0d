"""Runs a function on N gloo ranks (spawned processes) and returns each rank's result.

A rank that raises reports its traceback and exits at once; the parent then
ends the whole group, so one failing scenario can never leave ranks hanging in
a collective. A deadline bounds the whole run as well.
"""
from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from typing import Any, List


def _rank_main(rank: int, world: int, init_file: str, target: str, args: tuple, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        module_name, fn_name = target.split(":")
        fn = getattr(importlib.import_module(module_name), fn_name)
        out = fn(rank, world, *args)
        results.put((rank, "ok", out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report anything, then leave the group
        report = traceback.format_exc()
        print(f"[rank {rank}] {report}", file=sys.stderr, flush=True)
        results.put((rank, "error", report))
        results.close()
        results.join_thread()  # os._exit would drop a report still in the feeder thread
        os._exit(1)


def run_on_ranks(world: int, target: str, args: tuple = (), deadline_s: float = 600.0) -> List[Any]:
    """Calls ``module:function(rank, world, *args)`` on `world` gloo ranks."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, init_file, target, args, results), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: List[Any] = [None] * world
        received = 0
        errors = []
        end = time.monotonic() + deadline_s
        try:
            while received < world:
                try:
                    rank, status, payload = results.get(timeout=0.5)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead and not errors:
                        errors.append(f"rank(s) {dead} died without a report (exit codes "
                                      f"{[procs[r].exitcode for r in dead]})")
                    if errors or time.monotonic() > end:
                        break
                    continue
                if status == "error":
                    errors.append(f"rank {rank} raised:\n{payload}")
                    break
                out[rank] = payload
                received += 1
            if not errors and received < world:
                errors.append(f"ranks did not finish within {deadline_s:.0f} s")
        finally:
            if errors:
                for p in procs:
                    if p.is_alive():
                        p.kill()
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        if errors:
            raise RuntimeError("\n".join(errors))
        return out
