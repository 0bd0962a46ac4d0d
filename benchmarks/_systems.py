"""The models and training systems phases.py and user_loop.py time, built the
same way in both, so the two harnesses differ only in how they time a step.

A model is TinyGPT (examples/train_lm.py, shaped by --dim, --layers, ...),
small-blocks (--blocks residual tanh(Linear(32, 32)) blocks between an
embedding and a head: per-module overhead) or a preset of
benchmarks/_models.py (llama-tiny: RMSNorm, grouped-query attention, SwiGLU,
d=256, 4 layers; transformers' Llama, or with --builtin the plain-torch one),
with --vocab tokens when given. A system is plain (world 1), ddp, fsdp2
(fully_shard on each block and the root, resharded after forward: ZeRO-3),
fsdp2-s2 (the same kept gathered after forward: ZeRO-2's traffic) or
zero_ext-N (stage N; zero_ext-N-unchecked: without the collective sequence
checks; zero_ext-3-blocks: every block a unit of its own, none merged);
any of them followed by -compile (the whole model under torch.compile),
-compileca (the whole train step, forward, loss and backward, compiled with
compiled autograd) or -compileblocks (each block compiled). Every system
steps torch's AdamW (foreach).
"""
from __future__ import annotations

import os
import sys
from typing import Any, List, Tuple

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_lm import TinyGPT  # noqa: E402

from _models import PRESETS, blocks_of, build_model  # noqa: E402

import zero_ext  # noqa: E402

MODELS = ["tinygpt", "small-blocks"] + sorted(PRESETS)


class CompiledTrainStep:
    """A system whose step is one compiled function: forward, loss and
    backward under compiled autograd (the -compileca suffix); `model` is the
    module it trains."""

    def __init__(self, model: nn.Module):
        self.model = model

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            loss.backward()
            return loss

        with torch._dynamo.config.patch(compiled_autograd=True):
            self.train_step = torch.compile(train_step)


class SmallBlocks(nn.Module):
    """Many small residual blocks between an embedding and a head."""

    def __init__(self, vocab: int, blocks: int, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def add_model_arguments(parser: Any, model: str = "tinygpt", vocab: int = 0, batch: int = 8,
                        context: int = 64) -> None:
    parser.add_argument("--model", default=model, choices=MODELS)
    parser.add_argument("--builtin", action="store_true",
                        help="a preset as the plain-torch model of benchmarks/_models.py, not transformers'")
    parser.add_argument("--blocks", type=int, default=1000, help="small-blocks: how many")
    parser.add_argument("--vocab", type=int, default=vocab,
                        help="tokens (default: the preset's; TinyGPT and small-blocks 256)")
    parser.add_argument("--dim", type=int, default=256, help="TinyGPT only")
    parser.add_argument("--layers", type=int, default=4, help="TinyGPT only")
    parser.add_argument("--heads", type=int, default=4, help="TinyGPT only")
    parser.add_argument("--context", type=int, default=context)
    parser.add_argument("--batch", type=int, default=batch, help="sequences per rank")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="zero_ext's bucket_mb and DDP's bucket_cap_mb")


def vocab_of(args) -> int:
    if args.vocab:
        return args.vocab
    return PRESETS[args.model].vocab if args.model in PRESETS else 256


def describe_model(args) -> str:
    if args.model == "tinygpt":
        return f"TinyGPT d={args.dim} x{args.layers}, vocab {vocab_of(args)}"
    if args.model == "small-blocks":
        return f"{args.blocks} small blocks"
    kind = "plain torch" if args.builtin else "transformers"
    return f"{args.model} ({kind}), vocab {vocab_of(args)}"


def model_and_blocks(args) -> Tuple[nn.Module, List[nn.Module]]:
    torch.manual_seed(0)
    if args.model == "tinygpt":
        model = TinyGPT(vocab_of(args), args.dim, args.layers, args.heads, args.context)
        return model, list(model.blocks)
    if args.model == "small-blocks":
        model = SmallBlocks(vocab_of(args), args.blocks)
        return model, list(model.blocks)
    model = build_model(args.model, builtin=args.builtin, seed=0, vocab=vocab_of(args))
    return model, blocks_of(model)


def build(args, system: str, world: int):
    """(the module to call, the optimizer to step) for `system`. A system
    name ending in -compile is the same system with the whole model under
    torch.compile (Inductor; for zero_ext the whole sharded step, stage 3's
    gathers included: docs/torch-compile-and-profiling.md); -compileblocks
    compiles each block in place instead (torchtitan's regional compilation,
    the way FSDP2 compiles). The first step carries the compilation."""
    if system.endswith("-compileca"):
        trained, opt = build(args, system[:-len("-compileca")], world)
        return CompiledTrainStep(trained), opt
    for suffix, whole in (("-compileblocks", False), ("-compile", True)):
        if system.endswith(suffix):
            trained, opt = build(args, system[:-len(suffix)], world)
            if whole:
                return torch.compile(trained), opt
            for block in blocks_of_trained(trained):
                block.compile()
            return trained, opt
    model, blocks = model_and_blocks(args)
    if system.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=system == "fsdp2")
        fully_shard(model, mesh=mesh, reshard_after_forward=system == "fsdp2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    if system in ("plain", "ddp") or system.startswith("fsdp2"):
        trained = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb) if system == "ddp" else model
        return trained, opt
    parts = system.split("-")
    os.environ["ZERO_EXT_COLLECTIVE_CHECKS"] = "0" if "unchecked" in parts else "1"
    try:
        units = {type(block) for block in blocks} if "blocks" in parts else None
        return zero_ext.wrap(model, opt, stage=int(parts[1]), bucket_mb=args.bucket_mb, units=units)
    finally:
        os.environ.pop("ZERO_EXT_COLLECTIVE_CHECKS")


def blocks_of_trained(trained: nn.Module) -> List[nn.Module]:
    """The repeated blocks of a built system's model (DDP's inner module)."""
    model = trained.module if isinstance(trained, DistributedDataParallel) else trained
    if hasattr(model, "blocks"):
        return list(model.blocks)
    return blocks_of(model)


def batch(args, rank: int, world: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step `step`'s global batch: (inputs, targets)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab_of(args), (world * args.batch, args.context + 1), generator=g)
    mine = tokens[rank * args.batch:(rank + 1) * args.batch]
    return mine[:, :-1], mine[:, 1:]


def default_systems(world: int) -> List[str]:
    return ["plain" if world == 1 else "ddp"] + [f"zero_ext-{s}" for s in range(4)]
