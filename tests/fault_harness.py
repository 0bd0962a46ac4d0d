"""Runs a function on N gloo ranks where some rank is expected to fail, and
reports how every rank ended: its error (if any), when it exited, and whether
it had to be killed because it hung.

Unlike dist_harness, a failing rank does not end the group: the point is to
see whether the other ranks end by themselves, and how long they take. A rank
that raises writes its error and leaves with os._exit (tearing down the
process group could block on a dead peer). A victim rank calls
``record_fault()`` just before it kills itself or raises, so the parent can
time every other rank's exit from the fault. Each rank's standard error
(C++ warnings too) is captured into RankEnd.stderr, and echoed.
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, List, Optional

from dist_harness import rank_context, start_rank

_fault_file: Optional[str] = None


def record_fault() -> None:
    """Called by the victim rank at the moment of the fault. Where several
    ranks fault (their forwards raise at once), the first one's time stays:
    the file is created exclusively, then renamed into place whole."""
    now = time.time()
    claim = _fault_file + ".claimed"
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    partial = _fault_file + ".partial"
    with open(partial, "w") as f:
        json.dump({"time": now}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, _fault_file)


def linger_until_the_others_end(world: int, rank: int, at_most_s: float) -> None:
    """Keeps the calling rank alive (its connections open) until every other
    rank has written how it ended, or at_most_s passed: the others must end by
    their own bounded waits, not by noticing that this rank is gone."""
    tmp = os.path.dirname(_fault_file)
    others = [os.path.join(tmp, f"rank{r}.json") for r in range(world) if r != rank]
    end = time.monotonic() + at_most_s
    while time.monotonic() < end and not all(os.path.exists(f) for f in others):
        time.sleep(0.1)


def _rank_main(rank: int, world: int, tmp: str, target: str, args: tuple, init_method: str) -> None:
    global _fault_file
    _fault_file = os.path.join(tmp, "fault.json")
    out_file = os.path.join(tmp, f"rank{rank}.json")
    # fd 2 itself, so what C++ (c10 logging, gloo) writes is captured too
    os.dup2(os.open(os.path.join(tmp, f"rank{rank}.stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method or f"file://{os.path.join(tmp, 'rdv')}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        module_name, fn_name = target.split(":")
        result = getattr(importlib.import_module(module_name), fn_name)(rank, world, *args)
        outcome = {"result": result, "error": None}
    except BaseException as e:  # noqa: BLE001 - every way out is reported
        outcome = {"result": None, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    outcome["time"] = time.time()
    with open(out_file, "w") as f:
        json.dump(outcome, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if outcome["error"] is None else 1)


@dataclass
class RankEnd:
    rank: int
    exitcode: Optional[int]  # None: hung, killed by the parent; negative: killed by a signal
    error: Optional[str]
    result: Any
    seconds_after_fault: Optional[float]
    stderr: str = ""  # everything the rank wrote to its standard error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_with_fault(world: int, target: str, args: tuple = (), deadline_s: float = 120.0,
                   store: str = "file") -> List[RankEnd]:
    """Calls ``module:function(rank, world, *args)`` on `world` ranks and
    waits (at most deadline_s) for every rank to exit by itself. `store`:
    "file" (a FileStore) or "tcp" (a TCPStore hosted by rank 0, as torchrun's
    env:// gives: rank 0's death takes the store with it)."""
    if store not in ("file", "tcp"):
        raise ValueError(f"store must be 'file' or 'tcp', not {store!r}")
    init_method = f"tcp://127.0.0.1:{_free_port()}" if store == "tcp" else ""
    ctx = rank_context()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [start_rank(ctx, _rank_main, (r, world, tmp, target, args, init_method)) for r in range(world)]
        end = time.monotonic() + deadline_s
        exit_times = [None] * world
        while time.monotonic() < end and any(t is None for t in exit_times):
            for r, p in enumerate(procs):
                if exit_times[r] is None and p.exitcode is not None:
                    exit_times[r] = time.time()
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.exitcode is None]
        for r in hung:
            procs[r].kill()
        for p in procs:
            p.join(timeout=10)
        fault_time = None
        if os.path.exists(os.path.join(tmp, "fault.json")):
            with open(os.path.join(tmp, "fault.json")) as f:
                fault_time = json.load(f)["time"]
        ends = []
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"rank{r}.json")
            outcome = {"result": None, "error": None}
            if os.path.exists(path):
                with open(path) as f:
                    outcome = json.load(f)
            stderr = ""
            if os.path.exists(os.path.join(tmp, f"rank{r}.stderr")):
                with open(os.path.join(tmp, f"rank{r}.stderr"), errors="replace") as f:
                    stderr = f.read()
                if stderr:
                    print(f"[rank {r} stderr]\n{stderr}", file=sys.stderr)
            if outcome.get("traceback"):
                print(f"[rank {r}] {outcome['traceback']}", file=sys.stderr)
            ended = exit_times[r]
            ends.append(RankEnd(
                rank=r, exitcode=None if r in hung else p.exitcode, error=outcome.get("error"),
                result=outcome.get("result"),
                seconds_after_fault=None if ended is None or fault_time is None else ended - fault_time,
                stderr=stderr))
        return ends
