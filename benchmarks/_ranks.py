"""Runs a benchmark body on N spawned gloo ranks and returns every rank's result."""
from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, init_file: str, body: Callable, args: Any, threads: int, out_file: str) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    result = body(args, rank, world)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()
    # DDP's reducer and FSDP2's device meshes (torch's own cache) keep the
    # world group and its gloo threads alive past destroy_process_group();
    # leaving before the interpreter finalizes gives no such thread a
    # teardown to abort ([Note: groups die with destroy_process_group]).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(world: int, body: Callable, args: Any, threads: int = 1) -> List[Any]:
    """Calls ``body(args, rank, world)`` on `world` ranks; its (JSON-able)
    results, one per rank."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "results.json")
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "rdv"), body, args, threads, out_file), nprocs=world)
        with open(out_file) as f:
            return json.load(f)


def timed_step(compute_loss: Callable[[], torch.Tensor], opt: Any) -> Tuple[float, float]:
    """One training step (forward through `compute_loss`, backward, step,
    zero_grad): its wall seconds, then the loss."""
    start = time.perf_counter()
    loss = compute_loss()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start, loss.item()


def add_tiny_gpt_arguments(parser: Any, bucket_mb: float = 25.0) -> None:
    """The shape of examples/train_lm.py's TinyGPT and the per-rank batch, as
    step_time.py and phases.py take them."""
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--bucket-mb", type=float, default=bucket_mb)
