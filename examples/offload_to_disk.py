"""Train a language model whose training state is several times the memory
the process may use: parameters, gradients and AdamW's state in offload
files (offload_params="nvme", offload_optimizer="nvme", stage 3).

    python examples/offload_to_disk.py --offload-path /mnt/nvme/zero_ext
    torchrun --nproc-per-node 2 examples/offload_to_disk.py --offload-path /tmp/zero_ext

The model is examples/train_lm.py's TinyGPT, built under zero_ext.empty_init
(no memory until wrap() gives each unit its shard, which goes to the file).
Each log line prints the loss, the step time and the peak resident memory
the training added (VmHWM, from before the model was built) next to the
training state's size; --max-fraction F ends the run with an error if it
ever adds more than F x the state (default 0.25). Under a cgroup memory
limit (which counts resident memory, as this figure does) the same run fits
in a quarter of its state. A data-size ulimit (RLIMIT_DATA) counts address
space instead, which wrap() still reserves for the model once, untouched.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import zero_ext  # noqa: E402
from train_lm import TinyGPT, batches  # noqa: E402


def status_bytes(key: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))


def initialize(module: torch.nn.Module) -> None:
    """Each module's own initializer (MultiheadAttention names it _reset_parameters)."""
    (getattr(module, "_reset_parameters", None) or module.reset_parameters)()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--offload-path", default="/tmp/zero_ext_offload", help="a directory on a local drive")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--max-fraction", type=float, default=0.25,
                        help="fail if the peak resident memory added exceeds this fraction of the training state")
    parser.add_argument("--log-every", type=int, default=2)
    args = parser.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if distributed else 0
    world = torch.distributed.get_world_size() if distributed else 1
    text = open(os.path.join(HERE, "data", "corpus.txt"), encoding="utf-8").read()
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # torch's first optimizer imports its modules
    torch.manual_seed(0)
    with zero_ext.empty_init():
        model = TinyGPT(len(vocab), args.dim, args.layers, heads=8, context=args.context)
    params = sum(p.numel() for p in model.parameters())
    state = 16 * params // world  # this rank's fp32 values, gradients and AdamW's two moments
    base = status_bytes("VmRSS:")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model, optimizer = zero_ext.wrap(model, optimizer, stage=3, offload_params="nvme", offload_optimizer="nvme",
                                     offload_path=args.offload_path, param_init_fn=initialize)
    if rank == 0:
        print(f"{params / 1e6:.1f} M parameters on {world} rank(s); this rank's training state "
              f"{state / 2**20:.0f} MiB (fp32 values, gradients, AdamW's two moments); offload files under "
              f"{args.offload_path}", flush=True)
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        x, y = batches(data, args.context, args.batch, rank, world, step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - start
        added = status_bytes("VmHWM:") - base
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            print(f"step {step:3d}  loss {loss.item():.3f}  {seconds * 1e3:5.0f} ms  peak resident added "
                  f"{added / 2**20:5.0f} MiB = {added / state:.2f} x the training state", flush=True)
        if added > args.max_fraction * state:
            raise SystemExit(f"rank {rank}: peak resident memory added {added / 2**20:.0f} MiB exceeds "
                             f"{args.max_fraction} x the training state ({state / 2**20:.0f} MiB)")
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
