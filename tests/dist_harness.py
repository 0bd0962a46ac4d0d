"""Runs a function on N gloo ranks (processes forked from a server that
imported torch) and returns each rank's result; or many scenarios in one
group, where a failing one fails alone (run_items_on_ranks).

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
from typing import Any, Dict, List, Optional, Tuple


# [Note: ranks forked from a server that imported torch]
# Importing torch costs a rank about 1.4 s of CPU, and the suite starts a few
# hundred ranks. They fork from multiprocessing's forkserver, which imported
# torch once and then never ran an op or started a thread (forking is safe
# there, as it is for a DataLoader). What a spawned rank would have taken from
# the test's process at start, its environment, is passed along and set
# first; zero_ext and the scenario modules are imported by each rank after
# that, so whatever they read from the environment is the test's.
_CONTEXT = None


def rank_context():
    """The multiprocessing context ranks start from (see the note above)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])
    return _CONTEXT


def start_rank(ctx, target, args: tuple):
    """Starts target(*args) as a daemon process with the caller's environment."""
    process = ctx.Process(target=_with_environment, args=(dict(os.environ), target, args), daemon=True)
    process.start()
    return process


def _with_environment(environment: dict, target, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environment)
    target(*args)


def _join(rank: int, world: int, init_file: str, target: str):
    """Joins the gloo group of this run; returns the function `target` names."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    module_name, fn_name = target.split(":")
    return getattr(importlib.import_module(module_name), fn_name)


def _report_and_exit(rank: int, results, message: tuple) -> None:
    report = traceback.format_exc()
    print(f"[rank {rank}] {report}", file=sys.stderr, flush=True)
    results.put(message + (report,))
    results.close()
    results.join_thread()  # os._exit would drop a report still in the feeder thread
    os._exit(1)


def _rank_main(rank: int, world: int, init_file: str, target: str, args: tuple, results) -> None:
    import torch.distributed as dist

    try:
        fn = _join(rank, world, init_file, target)
        out = fn(rank, world, *args)
        results.put((rank, "ok", out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report anything, then leave the group
        _report_and_exit(rank, results, (rank, "error"))


def run_on_ranks(world: int, target: str, args: tuple = (), deadline_s: float = 600.0) -> List[Any]:
    """Calls ``module:function(rank, world, *args)`` on `world` gloo ranks."""
    ctx = rank_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [start_rank(ctx, _rank_main, (r, world, init_file, target, args, results)) for r in range(world)]
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


# --- many scenarios in one group, each failing on its own -------------------

def _items_rank_main(rank: int, world: int, init_file: str, target: str, items: list, channel) -> None:
    """Runs items in order; reports ('done', i, out) after each. An item that
    raises is reported and ends this rank: its peers may be inside a collective
    it will never join, so the group cannot be trusted to go on.

    `channel` is this rank's own pipe, written synchronously: what a rank sent
    before it died (os._exit, a signal) is the parent's to read, so a death is
    blamed on the item the rank was running. A Queue's feeder thread would drop
    what it had not yet written, and blame an item the rank had finished."""
    import torch.distributed as dist

    index = -1
    try:
        fn = _join(rank, world, init_file, target)
        for index, item in enumerate(items):
            channel.send(("done", index, fn(rank, world, item)))
        channel.send(("finished", len(items), None))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report anything, then leave the group
        report = traceback.format_exc()
        print(f"[rank {rank}] {report}", file=sys.stderr, flush=True)
        try:
            channel.send(("error", index, report))
        finally:
            os._exit(1)


def _receive_ready(channels: list, timeout: float) -> List[Tuple[int, str, int, Any]]:
    """The messages ranks have sent, waiting up to `timeout` for the first;
    a closed pipe (its rank ended) yields nothing."""
    from multiprocessing.connection import wait

    messages = []
    ready = wait([c for c in channels if not c.closed], timeout=timeout)
    for conn in ready:
        rank = channels.index(conn)
        try:
            while conn.poll(0):
                messages.append((rank,) + tuple(conn.recv()))
        except (EOFError, OSError):
            conn.close()
    return messages


def run_items_on_ranks(world: int, target: str, items: List[Any], item_deadline_s: float = 180.0,
                       deadline_s: float = 1800.0) -> Dict[Any, Any]:
    """Calls ``module:function(rank, world, item)`` for every item on `world`
    gloo ranks, in order, and returns {item: [result of rank 0, ...]} or
    {item: "error text"} for an item that raised, killed a rank or made no
    progress within `item_deadline_s`. After a failure the group is ended and
    a fresh one goes on with the items not yet run, so one defect is one failure."""
    ctx = rank_context()
    outcome: Dict[Any, Any] = {}
    remaining = list(items)
    end = time.monotonic() + deadline_s
    while remaining:
        per_item: List[List[Any]] = [[None] * world for _ in remaining]
        done_count = [0] * len(remaining)
        failure: Optional[Tuple[int, str]] = None
        finished = 0
        with tempfile.TemporaryDirectory() as tmp:
            init_file = os.path.join(tmp, "rendezvous")
            pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
            procs = [start_rank(ctx, _items_rank_main, (r, world, init_file, target, remaining, pipes[r][1]))
                     for r in range(world)]
            for _, sending in pipes:
                sending.close()  # the ranks hold theirs: a dead rank's pipe reads as closed
            channels = [receiving for receiving, _ in pipes]

            def record(messages) -> Optional[Tuple[int, str]]:
                nonlocal finished
                error = None
                for rank, status, index, payload in messages:
                    if status == "error":
                        error = error or (rank, index, payload)
                    elif status == "finished":
                        finished += 1
                    else:
                        per_item[index][rank] = payload
                        done_count[index] += 1
                return error

            progress_at = time.monotonic()
            try:
                while finished < world and failure is None:
                    messages = _receive_ready(channels, timeout=0.5)
                    error = record(messages)
                    if error is not None:
                        time.sleep(0.2)  # a peer's death often causes the error: name it too
                        record(_receive_ready(channels, timeout=0))  # what peers finished before it
                        rank, index, payload = error
                        dead = [r for r, p in enumerate(procs) if r != rank and p.exitcode not in (None, 0)]
                        died = (f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]}); "
                                if dead else "")
                        failure = (max(index, 0), f"{died}rank {rank} raised:\n{payload}")
                        break
                    if messages:
                        progress_at = time.monotonic()
                        continue
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead:
                        record(_receive_ready(channels, timeout=0))  # all a dead rank sent is in its pipe
                        first_open = next((i for i, c in enumerate(done_count) if c < world), 0)
                        failure = (first_open, f"rank(s) {dead} died without a report (exit codes "
                                               f"{[procs[r].exitcode for r in dead]})")
                    elif time.monotonic() - progress_at > item_deadline_s or time.monotonic() > end:
                        first_open = next((i for i, c in enumerate(done_count) if c < world), 0)
                        failure = (first_open, f"no progress within {item_deadline_s:.0f} s (a hang?)")
            finally:
                for p in procs:
                    if failure is not None and p.is_alive():
                        p.kill()
                for p in procs:
                    p.join(timeout=30)
                    if p.is_alive():
                        p.kill()
                for conn in channels:
                    conn.close()
        left = []
        for i, item in enumerate(remaining):
            if done_count[i] == world:
                outcome[item] = per_item[i]
            elif failure is not None and i == failure[0]:
                outcome[item] = failure[1]
            else:
                left.append(item)  # not reached by every rank before the failure: run again
        remaining = left
        if remaining and time.monotonic() > end:
            for item in remaining:
                outcome[item] = f"not run: the {deadline_s:.0f} s deadline passed"
            break
    return outcome


def assert_item_matched(world: int, result: Any) -> None:
    """Fails a test on one item of run_items_on_ranks: a string is the group's
    error (a rank raised, died or hung); otherwise each rank's mismatch, if any."""
    import pytest

    if isinstance(result, str):
        pytest.fail(f"world size {world}: {result}")
    for rank, mismatch in enumerate(result):
        assert mismatch is None, f"rank {rank}: {mismatch}"


# --- inside a rank: what a scenario's ranks settle together ------------------

def agree_on_ranks(text: Optional[str]) -> Optional[str]:
    """Every rank's verdict (collective): a mismatch on one rank fails every rank's item."""
    import torch.distributed as dist
    texts: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    bad = [(r, t) for r, t in enumerate(texts) if t]
    return None if not bad else f"rank {bad[0][0]}: {bad[0][1]}"


def shared_directory(prefix: str) -> str:
    """A new directory rank 0 made, its path on every rank (collective)."""
    import torch.distributed as dist
    path = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def expect_refused(problems: List[str], what: str, needle: str, call) -> None:
    """call() must raise a ValueError whose message holds `needle`; what it
    did instead is added to `problems`."""
    try:
        call()
    except ValueError as error:
        if needle not in str(error):
            problems.append(f"{what}: {error}")
        return
    problems.append(f"{what}: accepted")


def free_port_pair() -> int:
    """A local port free now whose next one is too (a coordinator's store takes PORT + 1)."""
    import socket
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 60000:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
