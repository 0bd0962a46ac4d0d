"""Train a small character-level transformer language model with zero_ext.

    torchrun --nproc-per-node 2 examples/train_lm.py --stage 2

Each rank reads its own slice of every batch from examples/data/corpus.txt;
training is plain `loss.backward(); optimizer.step()`. At the end it prints,
for each rank, the bytes of parameters, gradients and optimizer state that
zero_ext holds during a step (after backward, before optimizer.step(), where
gradients peak) at the chosen stage next to what DDP holds for the same model.

Across nodes, `--mesh nodes` shards within each node and replicates across
nodes (hybrid sharding); `--resume-dir DIR --save-every N` saves every N
steps and, started again (by torchrun's --max-restarts after a failure, at
the same or another world size), goes on from the last complete save. With
--global-batch the data of a step does not depend on the world size.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import zero_ext
from zero_ext.groups.process_groups import handed_to_backend
from zero_ext.tools import state_of

HERE = os.path.dirname(os.path.abspath(__file__))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tokens(idx) + self.positions(torch.arange(t, device=idx.device))
        for block in self.blocks:
            h = block(h, src_mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def batches(data: torch.Tensor, context: int, batch: int, rank: int, world: int, step: int):
    """This rank's slice of the global batch of `step` (same on every run)."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - context - 1, (world * batch,), generator=g)[rank * batch:(rank + 1) * batch]
    x = torch.stack([data[s:s + context] for s in starts])
    y = torch.stack([data[s + 1:s + context + 1] for s in starts])
    return x, y


def progress(step: int, total: int, loss: float, started: float) -> None:
    width = 30
    done = int(width * step / total)
    rate = step / max(time.perf_counter() - started, 1e-9)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total}  loss {loss:.3f}  {rate:.1f} steps/s")
    sys.stdout.flush()


def kill_once(args, rank: int, step: int) -> None:
    """--kill-at RANK:STEP (testing restarts): that rank dies by SIGKILL in
    the middle of that step, after its backward, once per --resume-dir."""
    if not args.kill_at:
        return
    who, when = (int(v) for v in args.kill_at.split(":"))
    marker = os.path.join(args.resume_dir or ".", "killed-once")
    if rank == who and step == when and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


def log_line(step: int, total: int, loss: float, norm: float, tokens_per_s: float, held: dict) -> str:
    """One --log-every line: the step, the global batch's loss, the gradient
    norm before clipping, throughput over every rank, and the bytes this rank
    holds (zero_ext.memory_report)."""
    mib = {k: v / 2 ** 20 for k, v in held.items()}
    return (f"step {step}/{total} | loss {loss:.4f} | grad norm {norm:.4f} | {tokens_per_s:.0f} tok/s | "
            f"held {sum(mib.values()):.2f} MiB (params {mib['params']:.2f}, grads {mib['grads']:.2f}, "
            f"optimizer {mib['optimizer_state']:.2f})")


def train(args, model, opt, sched, clip, data, rank, world, show, first_step=1, save=None, in_step=None):
    """Trains steps first_step..args.steps; the global batch's loss at each step.
    `save(step)` runs after every args.save_every-th step. `in_step` (a dict)
    receives the bytes this rank holds during the last step, after backward
    and before optimizer.step(): the peak that gradient sharding changes."""
    started = time.perf_counter()
    interval_start, interval_steps = started, 0
    losses = []
    for step in range(first_step, args.steps + 1):
        x, y = batches(data, args.context, args.batch, rank, world, step)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        if in_step is not None and step == args.steps:
            in_step.update(zero_ext.memory_report(model, opt))
        kill_once(args, rank, step)
        if args.step_seconds:
            time.sleep(args.step_seconds)
        norm = clip(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if world > 1:
            with handed_to_backend(value):
                dist.all_reduce(value)
            value /= world
        losses.append(value.item())
        interval_steps += 1
        if args.log_every and (step % args.log_every == 0 or step == args.steps):
            if show:
                held = zero_ext.memory_report(model, opt)  # rank 0's, between steps (after zero_grad)
                now = time.perf_counter()
                rate = interval_steps * world * args.batch * args.context / max(now - interval_start, 1e-9)
                print(log_line(step, args.steps, losses[-1], float(norm), rate, held), flush=True)
            interval_start, interval_steps = time.perf_counter(), 0
        elif show and not args.log_every and (step % 5 == 0 or step == args.steps):
            progress(step, args.steps, losses[-1], started)
        if save is not None and args.save_every and step % args.save_every == 0:
            save(step)
    return losses


def data_mesh(spec: str, world: int):
    """--mesh: None (flat over every rank), "nodes" (shard within a node,
    replicate across nodes) or "RxS"."""
    if spec == "flat" or world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if spec == "nodes":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        shape = (world // per_node, per_node)
    else:
        shape = tuple(int(v) for v in spec.split("x"))
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def ddp_losses(args, vocab, data, rank, world):
    """The same run under torch DDP in fp32: the reference curve for --plot."""
    model, opt = build(args, vocab)
    ddp = DistributedDataParallel(model) if world > 1 else model
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    clip = lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # noqa: E731
    return train(args, ddp, opt, sched, clip, data, rank, world, show=False)


def plot_losses(path, args, world, ours, reference):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib)")
        return
    steps = range(1, len(ours) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    precision = args.mixed_precision or "fp32"
    top.plot(steps, reference, label="torch DDP (fp32)", linewidth=3, alpha=0.5)
    top.plot(steps, ours, label=f"zero_ext stage {args.stage} ({precision})", linestyle="--")
    top.set_ylabel("training loss")
    top.set_title(f"examples/train_lm.py, {world} rank(s)")
    top.legend()
    bottom.plot(steps, [a - b for a, b in zip(ours, reference)])
    bottom.set_ylabel("zero_ext - DDP")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def fmt(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.2f} MiB"


def build(args, vocab):
    torch.manual_seed(0)
    model = TinyGPT(vocab, args.dim, args.layers, args.heads, args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    return model, opt


def ddp_bytes(args, vocab, data, rank, world):
    """What DDP holds for the same model during a step, after backward and
    before optimizer.step() (its second, so Adam's state exists)."""
    model, opt = build(args, vocab)
    ddp = DistributedDataParallel(model) if world > 1 else model
    for step in (0, 1):
        x, y = batches(data, args.context, args.batch, rank, world, step)
        F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
        if step == 1:
            held = zero_ext.memory_report(model, opt)
        opt.step()
        opt.zero_grad()
    return held


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--mixed-precision", choices=["bf16", "fp16"], default=None,
                        help="compute in bf16 or fp16 (with dynamic loss scaling) over fp32 master weights")
    parser.add_argument("--offload", action="store_true",
                        help="offload_optimizer='cpu': fp32 masters, gradient shards and Adam state in host memory")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus", default=os.path.join(HERE, "data", "corpus.txt"))
    parser.add_argument("--plot", metavar="PNG",
                        help="also train the same model under torch DDP and plot both loss curves here")
    parser.add_argument("--mesh", default="flat",
                        help="flat (shard over every rank), nodes (shard within a node, replicate across "
                             "nodes) or RxS (R replicas of an S-way sharding)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step over all ranks (overrides --batch; the same data at any world size)")
    parser.add_argument("--resume-dir", default=None,
                        help="save here every --save-every steps; if a save is there, go on from it")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--save-final", metavar="PT", default=None,
                        help="rank 0 writes the trained full state_dict here (torch.save)")
    parser.add_argument("--kill-at", metavar="RANK:STEP", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--step-seconds", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slower step
    parser.add_argument("--no-report", action="store_true", help="skip the closing bytes table")
    parser.add_argument("--compress-weights", choices=["int8"], default=None,
                        help="stage 3: all-gather parameters as block-quantized int8")
    parser.add_argument("--compress-grads", choices=["int8", "int4"], default=None,
                        help="stages 2-3: reduce gradients as block-quantized integers, with error feedback")
    parser.add_argument("--log-every", type=int, default=0, metavar="N",
                        help="every N steps, rank 0 logs loss, grad norm, tokens/s and bytes held "
                             "(default: a progress bar)")
    return parser.parse_args()


def start_ranks(args):
    """(rank, world): the process group under torchrun; --global-batch split into --batch."""
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if args.global_batch:
        if args.global_batch % world:
            raise SystemExit(f"--global-batch {args.global_batch} does not split over {world} ranks")
        args.batch = args.global_batch // world
    return rank, world


def read_corpus(path: str):
    """(the corpus's characters, sorted; the corpus as their indices)."""
    text = open(path, encoding="utf-8").read()
    chars = sorted(set(text))
    return chars, torch.tensor([chars.index(c) for c in text], dtype=torch.long)


def wrapped(args, vocab: int, world: int):
    """(model, optimizer, scheduler, mesh, parameter count): the model wrapped by zero_ext."""
    model, opt = build(args, vocab)
    n_params = sum(p.numel() for p in model.parameters())
    mesh = data_mesh(args.mesh, world)
    model, opt = zero_ext.wrap(model, opt, stage=args.stage, mixed_precision=args.mixed_precision,
                               offload_optimizer="cpu" if args.offload else None, process_group=mesh,
                               compress_weights=args.compress_weights, compress_grads=args.compress_grads)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    return model, opt, sched, mesh, n_params


def resume(args, model, opt, sched, rank: int, world: int):
    """(first step, save function or None): --resume-dir's last complete save loaded, if any."""
    if not args.resume_dir:
        return 1, None
    first_step = 1
    checkpoint = os.path.join(args.resume_dir, "checkpoint")
    # Every rank must see the save (a shared filesystem). checkpoint_exists
    # says what load would find, also a save a crash left aside while
    # publishing; it only reads the filesystem, so each rank asks alone.
    if zero_ext.checkpoint_exists(checkpoint):
        extra = zero_ext.load(checkpoint, model, opt)
        sched.load_state_dict(extra["scheduler"])
        first_step = extra["step"] + 1
        if rank == 0:
            print(f"resumed from {checkpoint} after step {extra['step']} at world size {world} "
                  f"(unix time {time.time():.3f})", flush=True)

    def save_checkpoint(step: int) -> None:
        zero_ext.save(checkpoint, model, opt, extra={"step": step, "scheduler": sched.state_dict()})
    return first_step, save_checkpoint


def print_setup(args, n_params: int, world: int, mesh) -> None:
    precision = (args.mixed_precision or "fp32") + (", optimizer offloaded" if args.offload else "")
    print(f"zero_ext stage {args.stage} ({precision}): {n_params / 1e3:.1f}K-parameter transformer, "
          f"{world} rank(s) x {args.batch} sequences of {args.context} characters"
          + (f", hybrid: {mesh.mesh.shape[0]} replicas of a {mesh.mesh.shape[1]}-way sharding" if mesh else ""))


def print_outcome(args, model, opt, losses, vocab: int, world: int, sent: dict) -> None:
    """Rank 0: the loss's fall, the bytes sent, and (fp16) the loss scale."""
    print(f"\nloss {losses[0]:.3f} -> {losses[-1]:.3f} (uniform guess: {math.log(vocab):.3f})")
    if world > 1:
        print("rank 0 sent (MiB): " + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sent.items() if v))
    if args.mixed_precision == "fp16":
        print(f"fp16 loss scale {state_of(model).handles.optimizer.loss_scale():g}, "
              f"{opt.skipped_steps} step(s) skipped on overflow")


def compare_with_ddp(args, losses, vocab: int, data, rank: int, world: int) -> None:
    """--plot: the same run under DDP, both curves plotted, the largest gap printed."""
    reference = ddp_losses(args, vocab, data, rank, world)
    if rank == 0:
        plot_losses(args.plot, args, world, losses, reference)
        gap = max(abs(a - b) for a, b in zip(losses, reference))
        print(f"largest loss difference against DDP over {args.steps} steps: {gap:.2e}")


def report_bytes(args, model, opt, in_step: dict, vocab: int, data, rank: int, world: int) -> None:
    """The closing table: bytes held per rank during a step, zero_ext against DDP."""
    # During the last step (after backward, before optimizer.step()): between
    # steps stage 2 holds no gradient at all, which would hide its shard.
    mine = in_step or zero_ext.memory_report(model, opt)
    theirs = ddp_bytes(args, vocab, data, rank, world)
    rows = [None] * world
    row = (rank, mine, theirs)
    if world > 1:
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    if rank == 0:
        print(f"\nbytes held per rank during a step (after backward, before optimizer.step()): "
              f"zero_ext stage {args.stage} vs DDP")
        print(f"{'rank':>4} | {'params':>21} | {'grads':>21} | {'optimizer state':>21}")
        for r, z, d in rows:
            cells = [f"{fmt(z[k])} vs {fmt(d[k])}" for k in ("params", "grads", "optimizer_state")]
            print(f"{r:>4} | " + " | ".join(f"{c:>21}" for c in cells))


def main() -> None:
    args = parse_args()
    rank, world = start_ranks(args)
    chars, data = read_corpus(args.corpus)
    model, opt, sched, mesh, n_params = wrapped(args, len(chars), world)
    first_step, save = resume(args, model, opt, sched, rank, world)
    if rank == 0:
        print_setup(args, n_params, world, mesh)

    in_step = {}
    losses = train(args, model, opt, sched, opt.clip_grad_norm_, data, rank, world, show=rank == 0,
                   first_step=first_step, save=save, in_step=in_step)
    if args.save_final:
        full = zero_ext.full_state_dict(model)  # collective
        if rank == 0:
            torch.save(full, args.save_final)
    losses = losses or [float("nan")]
    sent = zero_ext.traffic(model)
    if rank == 0:
        print_outcome(args, model, opt, losses, len(chars), world, sent)
    if args.plot:
        compare_with_ddp(args, losses, len(chars), data, rank, world)
    if not args.no_report:
        report_bytes(args, model, opt, in_step, len(chars), data, rank, world)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
