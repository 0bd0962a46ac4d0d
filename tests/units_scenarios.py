"""Stage 3 with merged units: scenarios run wrapped by zero_ext on N ranks and
as the parity suite's single-process reference over the global batch.

The parity suite wraps with bucket_mb ~500 bytes, so its tiny blocks stay one
unit each. Here wrap() keeps the default bucket_mb (25 MiB), so the default
policy merges all blocks of a model into one unit (see
zero_ext/runtime/hooks.py, [Note: merged units]): the parity suite's Blocks
scenarios run again that way, plus the cases merging adds (members skipped or
out of order, called on their own, fed from outside the chain, hidden states
with a loss of their own, no-grad forwards, experts inside blocks). One more
keeps one unit per block and checks what the default policy must not choose
(see zero_ext/wrapping/units.py): blocks kept as ModuleDicts, which have no forward of
their own. MoE experts that routing skips differently per rank:
tests/real_models_scenarios.py; experts the default policy cannot recognize,
skipped on one rank (the error names the units= to pass):
unrecognized_experts_skipped, run on its own by tests/test_units_policy.py.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import parity_mixed_scenarios as pmx
import parity_scenarios as ps
import zero_ext
from parity_scenarios import BATCH, DIM, SEQ, VOCAB, Block, Blocks
from real_models_scenarios import MoE


class MergedContext(ps.Context):
    """The parity Context with wrap() at stage 3 and the default bucket_mb
    and units policy (Blocks: every block in one merged unit). A scenario
    that passes its own bucket_mb checks its units itself."""

    def wrap(self, model: nn.Module, opt: torch.optim.Optimizer, **options):
        if "bucket_mb" in options:
            return (model, opt) if self.reference else zero_ext.wrap(model, opt, stage=3, **options)
        blocks = sum(1 for m in model.modules() if isinstance(m, ps.Block))
        if self.reference:
            self.record_check("blocks merged into fewer units", True)
            return model, opt
        model, opt = zero_ext.wrap(model, opt, stage=3, **options)
        units = model._zero_ext.handles.diagnostics.stats()["units"]
        self.record_check("blocks merged into fewer units", blocks < 2 or units < blocks + 1)
        return model, opt


def tokens_of(ctx: ps.Context, step: int, r: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (ctx.world * BATCH, SEQ + 1), generator=g)[r * BATCH:(r + 1) * BATCH]


def _train(ctx: ps.Context, model: nn.Module, loss_of_step: Callable[[nn.Module, int], torch.Tensor],
           steps: int = 3) -> nn.Module:
    model, opt = ctx.wrap(model, ps.adamw(model))
    for step in range(steps):
        loss_of_step(model, step).backward()
        ps.step_and_record(ctx, model, opt, step)
    return model


def members_skipped_or_out_of_order(ctx: ps.Context) -> None:
    """The last member skipped (its run is released by the model's
    post-forward hook), the first skipped, out of order, all."""
    plans = [[0, 1], [1, 2], [2, 0, 1], [0, 2], [0, 1, 2]]
    ps._blocks(ctx, steps=len(plans), plan=lambda step: plans[step])


def gathers_per_step(ctx: ps.Context) -> None:
    """A chain of three merged blocks costs one all-gather in forward and one
    in backward (the root: one, kept from forward to backward)."""
    model = Blocks()
    model, opt = ctx.wrap(model, ps.adamw(model))
    counts = []
    for step in range(3):
        before = None if ctx.reference else model._zero_ext.handles.diagnostics.stats()["param_gathers"]
        ps.token_loss(ctx, model, step).backward()
        if not ctx.reference:
            counts.append(model._zero_ext.handles.diagnostics.stats()["param_gathers"] - before)
        ps.step_and_record(ctx, model, opt, step)
    ctx.record_check("3 all-gathers per step (root 1, merged blocks 2)", ctx.reference or counts == [3, 3, 3])
    ctx.record_check("nothing gathered after the step",
                     ctx.reference or model._zero_ext.handles.diagnostics.stats()["gathered_units"] == 0)


class HiddenBlocks(Blocks):
    """Returns the logits and every block's output (output_hidden_states)."""

    def forward(self, tokens: torch.Tensor):  # type: ignore[override]
        h = self.embed(tokens)
        hidden = []
        for block in self.blocks:
            h = block(h)
            hidden.append(h)
        return self.head(h), hidden


def hidden_state_losses(ctx: ps.Context) -> None:
    """A loss of block 1's output, with the logits (step 0) and alone (step 1:
    block 2's output is unused, so its gradient never gathers the unit; the
    hook on block 1's output must)."""
    def loss(model, step):
        total = 0.0
        for r, w in ctx.participants():
            tokens = tokens_of(ctx, step, r)
            logits, hidden = model(tokens[:, :-1])
            term = hidden[1].square().mean()
            if step != 1:
                term = term + F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            total = total + w * term
        return total
    _train(ctx, HiddenBlocks(), loss, steps=3)


class SideInputBlock(Block):
    """A block that also reads a tensor from outside the chain through a
    frozen layer (a cross-attention's key projection, say)."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(DIM, DIM)
        self.side.requires_grad_(False)

    def forward(self, h: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(h) * torch.sigmoid(self.side(memory))


class SideInputBlocks(Blocks):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(6)
        self.memory = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(SideInputBlock() for _ in range(3))
        with torch.no_grad():
            for p in [*self.blocks.parameters(), *self.memory.parameters()]:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = self.embed(tokens)
        memory = torch.tanh(self.memory(h))
        for block in self.blocks:
            h = block(h, memory)
        return self.head(h)


def inputs_from_outside_the_chain(ctx: ps.Context) -> None:
    """Each member also reads `memory` (it requires grad) through a frozen
    layer: each use is tracked, so the unit stays gathered until the last
    frozen read of the backward."""
    ps._blocks(ctx, build=SideInputBlocks)


class ParallelBlocks(Blocks):
    """Every block reads the embedding output; their outputs are summed."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = self.embed(tokens)
        return self.head(sum(block(h) for block in self.blocks))


def members_in_parallel(ctx: ps.Context) -> None:
    ps._blocks(ctx, build=ParallelBlocks)


def members_called_on_their_own(ctx: ps.Context) -> None:
    """Blocks called directly, outside the model's forward (each call a use
    of its own), beside the model's forward."""
    def loss(model, step):
        total = 0.0
        for r, w in ctx.participants():
            tokens = tokens_of(ctx, step, r)
            logits = model(tokens[:, :-1])
            g = torch.Generator().manual_seed(70 + step + 10 * r)
            x = torch.randn(BATCH, SEQ, DIM, generator=g)
            side = model.blocks[1](x)  # a middle member alone: gathered and released
            side = model.blocks[2](model.blocks[0](side))
            total = total + w * (F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                                 + side.square().mean())
        return total
    _train(ctx, Blocks(), loss)


def no_grad_forwards_release_their_units(ctx: ps.Context) -> None:
    """Evaluation forwards (all blocks, the last one skipped, a member on its
    own) leave nothing gathered; training goes on."""
    model = Blocks()
    model, opt = ctx.wrap(model, ps.adamw(model))
    for step in range(2):
        ps.token_loss(ctx, model, step).backward()
        ps.step_and_record(ctx, model, opt, step)
        with torch.no_grad():
            for plan in ([0, 1, 2], [0, 1], [1]):
                ps.token_loss(ctx, model, 20 + step, plan=plan)
                ctx.record_check(f"step {step} plan {plan}: nothing gathered after a no-grad forward",
                                 ctx.reference or model._zero_ext.handles.diagnostics.stats()["gathered_units"] == 0)
            loss = ps.token_loss(ctx, model, 30 + step)
            if not ctx.reference and ctx.world > 1:  # this rank's loss: average it as the reference does
                torch.distributed.all_reduce(loss)
                loss = loss / ctx.world
            ctx.record_value(f"step {step} eval loss", loss)


class Experts(nn.Module):
    """A block of two small experts in a ModuleList, all run every step."""

    def __init__(self):
        super().__init__()
        self.norm = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(h))
        for expert in self.experts:
            h = h + torch.tanh(expert(h))
        return h


class ExpertBlocks(Blocks):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(8)
        self.blocks = nn.ModuleList(Experts() for _ in range(3))
        with torch.no_grad():
            for p in self.blocks.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def experts_stay_in_their_block(ctx: ps.Context) -> None:
    """Blocks merged into one unit; the experts inside them are no units of
    their own (the default policy never looks below a block)."""
    ps._blocks(ctx, build=ExpertBlocks)


# --- what the default policy must not choose ---------------------------------

ONE_UNIT_PER_BLOCK_MB = 1e-4  # ~100 bytes: no two blocks merge


class MoeDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)  # stands for attention: runs every step
        self.mlp = MoE()  # experts in a ModuleList, skipped when no token picks them

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + torch.tanh(self.attn(h))
        return h + self.mlp(h)


class TinyMoeModel(Blocks):
    """Decoder layers holding an MoE each. The class name matches /moe/ as
    transformers' Qwen2MoeModel does: its layers are still the units."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.blocks = nn.ModuleList(MoeDecoderLayer() for _ in range(3))
        with torch.no_grad():
            for p in self.blocks.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def _units_per_block(ctx: ps.Context, model: nn.Module) -> None:
    ctx.record_check("one unit per block", ctx.reference or
                     model._zero_ext.handles.diagnostics.stats()["units"] == 1 + len(model.blocks))


class DictBlocks(Blocks):
    """Blocks kept as ModuleDicts, their parts called by the parent: each
    ModuleDict is one unit of its parts (attn, mlp; not the activation)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(12)
        self.blocks = nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(DIM, DIM), "act": nn.Tanh(), "mlp": Block()})
                                    for _ in range(3))
        with torch.no_grad():
            for p in self.blocks.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = self.embed(tokens)
        for layer in self.blocks:
            h = h + layer["act"](layer["attn"](h))
            h = layer["mlp"](h)
        return self.head(h)


def module_dict_blocks(ctx: ps.Context) -> None:
    model = DictBlocks()
    model, opt = ctx.wrap(model, ps.adamw(model), bucket_mb=ONE_UNIT_PER_BLOCK_MB)
    _units_per_block(ctx, model)
    for step in range(3):
        ps.token_loss(ctx, model, step).backward()
        ps.step_and_record(ctx, model, opt, step)


class SequentialMLP(nn.Sequential):
    """The root is the container: Linear, Tanh, Linear, Tanh, Linear merge
    into one unit, the activations as members between the layers."""

    def __init__(self):
        g = torch.Generator().manual_seed(9)
        super().__init__(nn.Linear(ps.IN, ps.HIDDEN), nn.Tanh(), nn.Linear(ps.HIDDEN, ps.HIDDEN), nn.Tanh(),
                         nn.Linear(ps.HIDDEN, ps.OUT))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def sequential_with_activations(ctx: ps.Context) -> None:
    model = SequentialMLP()
    model, opt = ctx.wrap(model, ps.sgd(model))
    ctx.record_check("one unit besides the (empty) root",
                     ctx.reference or model._zero_ext.handles.diagnostics.stats()["units"] == 2)
    for step in range(3):
        ps.mlp_loss(ctx, model, step).backward()
        ps.step_and_record(ctx, model, opt, step)


def _merged_mixed(name: str) -> Callable[[ps.Context], None]:
    """The parity suite's mixed-precision Blocks scenario `name`, wrapped with
    the default bucket_mb (it passes the suite's tiny one) so its blocks merge."""
    base = next(s for s in ps.MIXED_PRECISION_SCENARIOS if s.__name__ == name)

    def scenario(ctx: ps.Context) -> None:
        tiny, pmx.BUCKET_MB = pmx.BUCKET_MB, 25.0  # read by _mixed_training's wrap() call
        try:
            base(ctx)
        finally:
            pmx.BUCKET_MB = tiny
    scenario.__name__ = f"{name}_merged"
    return scenario


SCENARIOS: Dict[str, Callable[[ps.Context], None]] = {
    f.__name__: f
    for f in [
        *ps.STAGE3_BLOCKS_SCENARIOS,  # the parity suite's Blocks scenarios, with merged units
        # what merging adds
        members_skipped_or_out_of_order,
        gathers_per_step,
        hidden_state_losses,
        inputs_from_outside_the_chain,
        members_in_parallel,
        members_called_on_their_own,
        no_grad_forwards_release_their_units,
        experts_stay_in_their_block,
        sequential_with_activations,
        _merged_mixed("mixed_precision_bf16_tied_blocks"),
        _merged_mixed("mixed_precision_fp16_tied_blocks"),
        _merged_mixed("offload_fp16_tied_blocks"),
        # what the default policy must not choose (one unit per block, not merged);
        # MoE experts skipped by routing: tests/real_models_scenarios.py
        module_dict_blocks,
    ]
}

# --- experts the default policy cannot tell: the error says what to pass -------

class SparseMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.up(h))


class SparseLayer(nn.Module):
    """Top-1 routing by a gate named `scorer` to experts in `ffns`: no name
    the default policy knows, so each expert is a unit of its own.
    `only`: the experts this forward may pick."""

    def __init__(self):
        super().__init__()
        self.scorer = nn.Linear(DIM, 4, bias=False)
        self.ffns = nn.ModuleList(SparseMLP() for _ in range(4))
        self.only: Optional[list] = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.reshape(-1, DIM)
        logits = self.scorer(tokens)
        if self.only is not None:
            mask = torch.full((4,), float("-inf"))
            mask[self.only] = 0.0
            logits = logits + mask
        weight, choice = logits.softmax(-1).max(-1)
        out = torch.zeros_like(tokens)
        for i, ffn in enumerate(self.ffns):
            picked = choice == i
            if picked.any():
                out = out.index_put((picked,), ffn(tokens[picked]) * weight[picked, None])
        return out.reshape(h.shape)


class BlocksAndSparseLayer(Blocks):
    """The parity Blocks (units) with an MoE outside any block, before the head."""

    def __init__(self):
        super().__init__()
        self.moe = SparseLayer()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h + self.moe(h))


def unrecognized_experts_skipped(rank: int, world: int) -> dict:
    """The default policy makes each of `moe.ffns` a unit; at step 1 rank 0
    routes to experts 0-1, the others to 2-3. Every rank must stop with
    zero_ext's error, naming the units and a units= value; a model wrapped
    with that value then trains through the same routing."""
    import re
    import time

    def train(model, opt, parting_step: int) -> list:
        losses = []
        for step in range(3):
            if step == parting_step:
                model.moe.only = [0, 1] if rank == 0 else [2, 3]
            g = torch.Generator().manual_seed(900 + step)
            tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=g)[rank * BATCH:(rank + 1) * BATCH]
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    torch.manual_seed(0)
    model = BlocksAndSparseLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = zero_ext.wrap(model, opt, stage=3, bucket_mb=ONE_UNIT_PER_BLOCK_MB, timeout=20.0)
    units = model._zero_ext.handles.diagnostics.stats()["units"]
    started = time.monotonic()
    try:
        train(model, opt, parting_step=1)
        error = None
    except RuntimeError as e:
        error = str(e)
    seconds = time.monotonic() - started
    suggested = re.findall(r"units=\{([^}]*)\}", error or "")
    classes = {c.__name__: c for c in (Block, SparseLayer, SparseMLP, nn.Linear, nn.Embedding)}
    after = None
    if suggested:
        torch.manual_seed(0)
        model = BlocksAndSparseLayer()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        policy = {classes[name.strip()] for name in suggested[0].split(",")}
        model, opt = zero_ext.wrap(model, opt, stage=3, bucket_mb=ONE_UNIT_PER_BLOCK_MB, units=policy,
                                   timeout=20.0)
        after = train(model, opt, parting_step=1)
    return {"units": units, "error": error, "seconds": seconds, "suggested": suggested, "after": after}


_REFERENCES: Dict[tuple, list] = {}


def run_one(rank: int, world: int, name: str) -> Optional[str]:
    """On each rank: None, or the first mismatch against the single-process
    reference (computed once per scenario and world size)."""
    if (name, world) not in _REFERENCES:
        ref_ctx = MergedContext(stage=0, rank=rank, world=world, reference=True)
        SCENARIOS[name](ref_ctx)
        _REFERENCES[(name, world)] = ref_ctx.checkpoints
    ctx = MergedContext(stage=3, rank=rank, world=world, reference=False)
    SCENARIOS[name](ctx)
    return ps.compare(_REFERENCES[(name, world)], ctx.checkpoints)
