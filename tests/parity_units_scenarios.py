"""Parity scenarios of stage 3 units and model structures: grouped and
container units, tied weights in a group unit, parallel ModuleLists
(LoRA), the Blocks model's variants (a block called twice, skipped,
frozen, checkpointed), deferred initialization, dataclass inputs and
outputs, and registered forward methods."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import zero_ext
from parity_models import (
    BUCKET_MB, Blocks, Context, DIM, DataclassBlocks, HIDDEN, IN, OUT, VOCAB, adamw, batch, mlp_loss, step_and_record,
    token_loss)


class EmbedBlocksHead(nn.Module):
    """embed -> blocks (a ModuleList, no forward of its own) -> norm -> head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(3)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(self.norm(h))


def grouped_and_container_units(ctx: Context) -> None:
    """units=[[embed, norm, head], blocks]: one unit of three siblings (used
    first and last in the forward, another unit gathered in between) and a
    ModuleList as one unit; then the head called on its own (a use of its
    unit like any other)."""
    model = EmbedBlocksHead()
    opt = adamw(model)
    if not ctx.reference:
        model, opt = zero_ext.wrap(model, opt, stage=ctx.stage, bucket_mb=BUCKET_MB,
                                   units=[[model.embed, model.norm, model.head], model.blocks],
                                   **ctx.group_kwargs())
    for step in range(3):
        total = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world)
            extra = model.head(torch.tanh(torch.ones(2, HIDDEN) * 0.1 * (step + 1))).square().mean()
            total = total + w * (F.mse_loss(model(x), y) + extra)
        total.backward()
        step_and_record(ctx, model, opt, step)


grouped_and_container_units.stages = (3,)


def tied_weights_in_a_group_unit(ctx: Context) -> None:
    """units=[[embed, head], *blocks] with the head tied to the embedding:
    the tied weight lives in the group, gathered before the embedding's
    forward and kept to the head's (other units gathered in between), its
    gradient the sum of both uses; the head also called on its own."""
    model = Blocks()
    opt = adamw(model)
    if not ctx.reference:
        model, opt = zero_ext.wrap(model, opt, stage=ctx.stage, bucket_mb=BUCKET_MB,
                                   units=[[model.embed, model.head], *model.blocks], **ctx.group_kwargs())
        ctx.record_check("four units and the root", model._zero_ext.handles.diagnostics.stats()["units"] == 5)
    else:
        ctx.record_check("four units and the root", True)
    for step in range(3):
        extra = 0.0
        for r, w in ctx.participants():
            extra = extra + w * model.head(torch.full((2, DIM), 0.1 * (step + 1))).square().mean()
        (token_loss(ctx, model, step) + extra).backward()
        step_and_record(ctx, model, opt, step)


tied_weights_in_a_group_unit.stages = (3,)


class ParallelLists(nn.Module):
    """A model that keeps its layers' parts in parallel ModuleLists iterated
    together in forward (norms[i], bases[i], downs[i], ups[i]), LoRA-style:
    the input layer, norms and bases frozen, downs and ups trainable. Small
    siblings of one list merge into one stage 3 unit (the default policy at
    BUCKET_MB) whose members run interleaved with the other lists' modules;
    the norms' backward needs their frozen weights for the input gradients.
    The first norm's input requires no grad (the frozen input layer's output),
    so that member returns nothing to hook."""

    LAYERS = 3

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(self.LAYERS))
        self.bases = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(self.LAYERS))
        self.downs = nn.ModuleList(nn.Linear(HIDDEN, 2, bias=False) for _ in range(self.LAYERS))
        self.ups = nn.ModuleList(nn.Linear(2, HIDDEN, bias=False) for _ in range(self.LAYERS))
        self.out = nn.Linear(HIDDEN, OUT)
        with torch.no_grad():  # not 1 and 0: the norms' weights matter to their input gradients
            for norm in self.norms:
                norm.weight.copy_(1.0 + 0.3 * torch.randn(HIDDEN))
                norm.bias.copy_(0.3 * torch.randn(HIDDEN))
        for frozen in (self.inp, self.norms, self.bases):
            frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for norm, base, down, up in zip(self.norms, self.bases, self.downs, self.ups):
            n = norm(h)
            h = h + torch.tanh(base(n) + up(down(n)))
        return self.out(h)

    def listed_units(self) -> list:
        """The same units as the default policy's, listed by the user."""
        return [self.norms, *self.bases, self.downs, self.ups]

    @classmethod
    def units(cls) -> int:
        """Stage 3: the root, one merged unit per small list, one per base."""
        return 1 + 3 + cls.LAYERS


def _parallel_lists(ctx: Context, listed: bool) -> None:
    model = ParallelLists()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1)
    options = {"units": model.listed_units()} if listed else {}
    model, opt = ctx.wrap(model, opt, **options)
    ctx.record_check("stage 3: the small lists merged into units",
                     ctx.reference or ctx.stage != 3 or model._zero_ext.handles.diagnostics.stats()["units"] == ParallelLists.units())
    for step in range(3):
        mlp_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)


def parallel_lists_lora(ctx: Context) -> None:
    """LoRA on a model of parallel ModuleLists: merged units whose members
    run interleaved with other units, frozen members read by backward."""
    _parallel_lists(ctx, listed=False)


def parallel_lists_lora_listed_units(ctx: Context) -> None:
    """The same with units=[norms, *bases, downs, ups] (containers as units)."""
    _parallel_lists(ctx, listed=True)


parallel_lists_lora_listed_units.stages = (3,)  # units= is a stage 3 option


def _blocks(ctx: Context, steps: int = 3, build=None, **forward_kwargs_by_step) -> None:
    model = build() if build else Blocks()
    model, opt = ctx.wrap(model, adamw(model))
    for step in range(steps):
        kwargs = {k: v(step) for k, v in forward_kwargs_by_step.items()}
        token_loss(ctx, model, step, **kwargs).backward()
        step_and_record(ctx, model, opt, step)


class InitBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ff = nn.Linear(DIM, 2 * DIM)
        self.out = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.out(torch.tanh(self.ff(self.norm(h))))


class InitBlocks(nn.Module):
    """Initialized by its modules' own reset_parameters() (no custom init),
    with a tied output layer and a buffer: what deferred initialization
    must reproduce from the seed."""

    SCALE = torch.linspace(0.5, 1.5, DIM)

    def __init__(self, n_blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(InitBlock() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))  # meta under torch.device("meta")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def built_deferred_or_not(ctx: Context, seed: int, build=InitBlocks) -> nn.Module:
    """The reference constructs the model normally from `seed`; zero_ext
    builds it under zero_ext.empty_init() and wrap() initializes it from the
    same seed."""
    if ctx.reference:
        torch.manual_seed(seed)
        return build()
    with zero_ext.empty_init():
        model = build()
    torch.manual_seed(seed)
    return model


def deferred_init_then_training(ctx: Context) -> None:
    """Deferred initialization gives the normally constructed values on every
    rank, and training from them matches the reference."""
    model = built_deferred_or_not(ctx, seed=11)
    model, opt = ctx.wrap(model, adamw(model))
    ctx.record_params("after wrap", model)
    for step in range(3):
        token_loss(ctx, model, step).backward()
        step_and_record(ctx, model, opt, step)


def tied_embedding_default_units(ctx: Context) -> None:
    _blocks(ctx)


def block_called_twice_per_forward(ctx: Context) -> None:
    _blocks(ctx, plan=lambda step: [0, 1, 1, 2])


def block_skipped_on_some_steps(ctx: Context) -> None:
    _blocks(ctx, plan=lambda step: [0, 2] if step == 1 else [0, 1, 2])


def frozen_block(ctx: Context) -> None:
    def build():
        model = Blocks()
        model.blocks[1].requires_grad_(False)
        return model
    _blocks(ctx, build=build)


def checkpoint_each_block_reentrant(ctx: Context) -> None:
    _blocks(ctx, checkpointing=lambda step: "reentrant")


def checkpoint_each_block_nonreentrant(ctx: Context) -> None:
    _blocks(ctx, checkpointing=lambda step: "non-reentrant")


def dataclass_inputs_with_frozen_weights(ctx: Context) -> None:
    """LoRA-like blocks whose input is a dataclass: the frozen weight is read
    after the trainable ones got their gradients, so the unit must stay
    gathered until the gradient of its (dataclass-wrapped) input is done."""
    def build():
        model = DataclassBlocks()
        for block in model.blocks:
            block.ff.weight.requires_grad_(False)
        return model
    _blocks(ctx, build=build)


def dataclass_outputs(ctx: Context) -> None:
    _blocks(ctx, build=DataclassBlocks)


class FeatureBlock(nn.Module):
    """A block with a second entry point (a ViT's forward_features) that its
    forward also calls, then uses a parameter after it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc3(self.forward_features(h))

    def forward_features(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(h)))


class WithFeatureMethods(nn.Module):
    """Methods besides forward: `features` (reads the root's own layer and
    calls one block's forward_features directly) and `generate` (calls the
    model's forward in a loop, under no_grad)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.inp = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([FeatureBlock() for _ in range(3)])
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(self.blocks[1].forward_features(h) + self.blocks[0](h))

    def generate(self, x: torch.Tensor, steps: int = 3) -> torch.Tensor:
        outs = []
        for _ in range(steps):
            y = self(x)
            outs.append(y)
            x = torch.cat([y, y], dim=-1)[:, :IN]
        return torch.stack(outs)


def registered_forward_methods(ctx: Context) -> None:
    """zero_ext.register_forward_method on the model (features, generate) and
    on each block (forward_features, also called from the block's own
    forward): trained through both entry points, and generate's outputs, as
    in one process. At stage 3 each block is a unit of the default policy."""
    model = WithFeatureMethods()
    model, opt = ctx.wrap(model, adamw(model))
    if not ctx.reference:
        zero_ext.register_forward_method(model, "features")
        zero_ext.register_forward_method(model, "generate")
        for block in model.blocks:
            zero_ext.register_forward_method(block, "forward_features")
    for step in range(3):
        total = 0.0
        for r, w in ctx.participants():
            x, y = batch(step, r, ctx.world)
            total = total + w * (F.mse_loss(model(x), y) + F.mse_loss(model.features(x), y))
        total.backward()
        step_and_record(ctx, model, opt, step)
        with torch.no_grad():
            x, _ = batch(50 + step, 0, 1)
            ctx.record_value(f"step {step}: generate", model.generate(x).sum())
