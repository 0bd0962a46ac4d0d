"""Quantized collectives (wrap's compress_weights / compress_grads): bytes sent,
step time and learning of the demo language model (examples/train_lm.py's
TinyGPT on its corpus), against the same run uncompressed.

    python benchmarks/compression.py                      # stage 3, 2 gloo ranks, 200 steps
    python benchmarks/compression.py --world 4 --stage 2
    python benchmarks/compression.py --world 4 --mesh 2x2 # hybrid: the replicas' all-reduce quantized too
    python benchmarks/compression.py --text --model gpt2-10m  # real text, a held-out loss (below)

Every configuration trains its own copy of the model from the same weights on
the same batches; their steps are interleaved (a barrier, then each
configuration's step in turn, the order rotated every step), timed as a
user's loop would (perf_counter around forward, backward, step, zero_grad).
Reported (rank 0):
  loss           the global batch's loss, mean of the last 10 steps
  MiB/step       bytes this rank sent per step, by zero_ext.traffic(model):
                 all-gather (stage 3 gathers; stage 2's after the step) and
                 reduce-scatter (gradients), all-reduce (across replicas on a
                 mesh, and the small per-backward agreements)
  ms/step        min / median / max over the steps after the first 10
Then the quantization kernels' throughput on this CPU, per block size.

The demo corpus is 2.5 KB repeated: a model memorizes it, and its training
loss moves by a few percent either way with any change to the trajectory.
--text trains on real text instead, torch.nn's Python sources as bytes
(vocabulary 256; ~1.9 MB with torch 2.13), and holds out their last 10%:
  held-out loss  after the last step, the mean loss over --eval-windows
                 windows of --context bytes spread evenly over the held-out
                 part (no gradient), split between the ranks
A last row, "uncompressed, other batches", trains uncompressed on other
batches of the same text: the gap a data order alone makes, against which
the compressed rows' gaps read.
--model picks the model: the demo's TinyGPT (--dim, --layers, --heads) or a
preset of benchmarks/_models.py with a 256-token vocabulary (gpt2-10m: a
transformers GPT-2, 4 layers, 256 wide).
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

CONFIGS = {
    "uncompressed": {},
    "int8 grads": {"compress_grads": "int8"},
    "int4 grads": {"compress_grads": "int4"},
    "int8 weights + int8 grads": {"compress_weights": "int8", "compress_grads": "int8"},
    "int8 weights + int4 grads": {"compress_weights": "int8", "compress_grads": "int4"},
}
OTHER_BATCHES = "uncompressed, other batches"  # --text: how far another data order alone moves the loss


def corpus(args):
    """(training tokens, held-out tokens or None, vocabulary size)."""
    if args.text:
        sources = sorted(glob.glob(os.path.join(os.path.dirname(torch.nn.__file__), "**", "*.py"), recursive=True))
        raw = b"".join(open(path, "rb").read() for path in sources)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        split = len(data) - len(data) // 10
        return data[:split], data[split:], 256
    text = open(os.path.join(os.path.dirname(HERE), "examples", "data", "corpus.txt"), encoding="utf-8").read()
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text], dtype=torch.long), None, len(chars)


def build(args, vocab: int):
    import train_lm
    if args.model == "tinygpt":
        return train_lm.build(args, vocab)
    from _models import build_model
    model = build_model(args.model, seed=0, vocab=vocab)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


@torch.no_grad()
def held_out_loss(args, model, held: torch.Tensor, rank: int, world: int) -> float:
    """The mean loss over args.eval_windows windows spread evenly over
    `held` (rounded down to a whole batch on every rank), this rank's share
    of them, averaged over the ranks."""
    per_rank = max(args.eval_windows // (world * args.batch), 1) * args.batch
    starts = torch.linspace(0, len(held) - args.context - 1, per_rank * world).long()[rank::world]
    total = torch.zeros(())
    for chunk in starts.split(args.batch):
        x = torch.stack([held[s:s + args.context] for s in chunk])
        y = torch.stack([held[s + 1:s + args.context + 1] for s in chunk])
        total += F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) * len(chunk)
    dist.all_reduce(total)
    return total.item() / (per_rank * world)


def body(args, rank: int, world: int) -> Dict[str, dict]:
    import zero_ext
    import train_lm
    data, held, vocab = corpus(args)
    names = [n for n, c in CONFIGS.items() if args.stage == 3 or "compress_weights" not in c]
    names += [OTHER_BATCHES] if args.text else []
    group = None
    if args.mesh:  # hybrid: (replicate, shard)
        from torch.distributed.device_mesh import init_device_mesh
        group = init_device_mesh("cpu", tuple(int(v) for v in args.mesh.split("x")),
                                 mesh_dim_names=("replicate", "shard"))
    runs = {}
    for name in names:
        model, opt = build(args, vocab)
        runs[name] = zero_ext.wrap(model, opt, stage=args.stage, bucket_mb=args.bucket_mb, process_group=group,
                                   **CONFIGS.get(name, {}))
    losses: Dict[str, List[float]] = {n: [] for n in names}
    times: Dict[str, List[float]] = {n: [] for n in names}
    for step in range(1, args.steps + 1):
        batch = train_lm.batches(data, args.context, args.batch, rank, world, step)
        other = train_lm.batches(data, args.context, args.batch, rank, world, args.steps + step)
        order = names[step % len(names):] + names[:step % len(names)]
        for name in order:
            model, opt = runs[name]
            x, y = other if name == OTHER_BATCHES else batch
            dist.barrier()
            start = time.perf_counter()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            times[name].append(time.perf_counter() - start)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses[name].append(mean.item() / world)
    out = {}
    for name in names:
        sent = zero_ext.traffic(runs[name][0])
        settled = times[name][10:]
        out[name] = {"loss": statistics.mean(losses[name][-10:]), "first_loss": losses[name][0],
                     "sent": {k: v / args.steps for k, v in sent.items()},
                     "ms": [1e3 * min(settled), 1e3 * statistics.median(settled), 1e3 * max(settled)]}
        if held is not None:
            out[name]["held_out_loss"] = held_out_loss(args, runs[name][0], held, rank, world)
    return out


def kernel_throughput() -> List[str]:
    import zero_ext  # noqa: F401  (registers torch.ops.zero_ext in this process: the ranks' import is theirs)
    ops = torch.ops.zero_ext
    x = torch.randn(1 << 22)  # 16 MiB of fp32
    rows = []
    for bits in (8, 4):
        for block in (256, 2048, 8192):
            q, d = [], []
            for _ in range(5):
                start = time.perf_counter()
                payload = ops.quantize_blocks(x, bits, block, None)
                q.append(time.perf_counter() - start)
                start = time.perf_counter()
                y = ops.dequantize_blocks(payload, x.numel(), bits, block)
                d.append(time.perf_counter() - start)
            error = ((x - y).norm() / x.norm()).item()
            rows.append(f"| int{bits} | {block} | {16 / min(q) / 1024:.1f} | {16 / min(d) / 1024:.1f} | "
                        f"{payload.numel() / x.nbytes:.4f} | {error:.4f} |")
    return rows


def main() -> None:
    from _ranks import run_on_ranks
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3, choices=[2, 3])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mesh", default="", help="RxS: hybrid sharding, R replicas of an S-way sharding")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--text", action="store_true",
                        help="train on torch.nn's sources as bytes and report a held-out loss on their last 10%%")
    parser.add_argument("--eval-windows", type=int, default=256, help="--text: held-out windows of --context bytes")
    parser.add_argument("--model", default="tinygpt",
                        help="tinygpt (the demo's, shaped by --dim, --layers, --heads) or a benchmarks/_models.py "
                             "preset (gpt2-10m: transformers GPT-2, 4 layers, 256 wide), with the corpus's vocabulary")
    args = parser.parse_args()
    results = run_on_ranks(args.world, body, args)[0]
    base = results["uncompressed"]
    model = f"the demo LM (dim {args.dim}, {args.layers} layers)" if args.model == "tinygpt" else args.model
    data = "torch.nn's sources as bytes, last 10% held out" if args.text else "the demo corpus"
    print(f"stage {args.stage}, {args.world} gloo ranks, {args.steps} steps of {model} on {data}, "
          f"torch {torch.__version__}")
    if args.mesh:
        print(f"hybrid mesh {args.mesh} (replicate x shard): all-reduce MiB/step is mostly across replicas")
    held = " held-out loss (vs uncompressed) |" if args.text else ""
    print(f"| configuration | loss (vs uncompressed) |{held} all-gather MiB/step | reduce-scatter MiB/step | "
          "all-reduce MiB/step | ms/step min / median / max |")
    print("|---|---|---|---|---|---|" + ("---|" if args.text else ""))

    def versus(r, key):
        return f" {r[key]:.4f} ({(r[key] - base[key]) / base[key]:+.2%}) |"

    for name, r in results.items():
        ag, rs = r["sent"]["all_gather"] / 2**20, r["sent"]["reduce_scatter"] / 2**20
        ag0, rs0 = base["sent"]["all_gather"] / 2**20, base["sent"]["reduce_scatter"] / 2**20
        ar, ar0 = r["sent"]["all_reduce"] / 2**20, base["sent"]["all_reduce"] / 2**20
        print(f"| {name} |{versus(r, 'loss')}{versus(r, 'held_out_loss') if args.text else ''} "
              f"{ag:.3f} ({ag / ag0:.3f}x) | {rs:.3f} ({rs / rs0:.3f}x) | "
              f"{ar:.3f} ({ar / ar0:.3f}x) | " + " / ".join(f"{v:.1f}" for v in r["ms"]) + " |")
    print("\nquantization kernels, one core's share (16 MiB of fp32):")
    print("| bits | block | quantize GiB/s | dequantize GiB/s | payload / fp32 | relative error |")
    print("|---|---|---|---|---|---|")
    torch.set_num_threads(1)
    for row in kernel_throughput():
        print(row)


if __name__ == "__main__":
    main()
