"""Real models against the parity suite's single-process reference over
the global batch (tests/parity_scenarios.py's Context): MoE layers inside
decoder blocks and outside any block, and blocks kept in ModuleDicts,
trained in stages 0-3 and evaluated under torch.no_grad() like the
unwrapped model."""
from __future__ import annotations

import torch
import torch.nn as nn

import parity_scenarios as ps
from parity_scenarios import DIM, VOCAB
from real_models_common import FlatMoEModel, MoEModel, _ranks_ran_different_experts, global_loss, lm_loss, tokens_of


def _train_then_evaluate(ctx: ps.Context, model: nn.Module, wrap_options: dict, steps: int = 3,
                         compiled: bool = False) -> None:
    """AdamW steps over the global batch (gradients and parameters recorded
    against the reference), then each rank's loss on held-out tokens under
    torch.no_grad(), against the unwrapped model's. `compiled`: the wrapped
    model called through torch.compile (aot_eager; the reference eager)."""
    # Some expert weights get gradients near zero whose terms cancel: eps=1e-2 keeps
    # Adam's step within the gradients' tolerance (parity_scenarios.conditioned_adamw).
    opt = ps.conditioned_adamw(model.parameters())
    model, opt = ctx.wrap(model, opt, **wrap_options)
    forward = model
    if compiled and not ctx.reference:
        torch._dynamo.reset()
        forward = torch.compile(model, backend="aot_eager")
    for step in range(steps):
        global_loss(ctx, forward, step).backward()
        ps.step_and_record(ctx, model, opt, step)
    differed = _ranks_ran_different_experts(ctx, model)
    model.eval()
    with torch.no_grad():
        for k in range(2):
            ctx.record_value(f"no_grad evaluation {k} on rank {ctx.rank}'s tokens",
                             lm_loss(forward, tokens_of(ctx.world, 100 + k, ctx.rank, salt=5)))
    differed = _ranks_ran_different_experts(ctx, model) or differed  # collective: both calls on every rank
    ctx.record_check("the ranks ran different experts", differed)
    blocks = len(getattr(model, "blocks", []))
    ctx.record_check(f"stage 3: one unit per block ({blocks}) and the root, no expert a unit",
                     ctx.reference or ctx.stage != 3 or model._zero_ext.handles.diagnostics.stats()["units"] == 1 + blocks)


def moe_in_blocks(ctx: ps.Context) -> None:
    """Experts in an nn.ModuleList inside each decoder block, skipped when no
    token routes to them, differently on every rank: each block is a unit,
    its experts inside it (the default policy never looks below a block).
    Weights of std 0.3: at 0.5 the gradients (up to 7) move by up to 100
    times a change of the parameters' rounding, beyond RTOL/ATOL where the
    ranks' gradients are summed in another order."""
    _train_then_evaluate(ctx, MoEModel(std=0.3), {})


def moe_in_blocks_compiled(ctx: ps.Context) -> None:
    """The same, the whole model compiled: the routing's data-dependent
    branches in a loop make Dynamo run the blocks' forward eagerly and
    compile the frames inside it, so zero_ext's hooks run eagerly there (a
    hook is traced only within its module's call: runtime/hooks.py) and the
    parameters its eager code reads are gathered."""
    _train_then_evaluate(ctx, MoEModel(std=0.3), {}, compiled=True)


def moe_outside_any_block(ctx: ps.Context) -> None:
    """An MoE the model holds directly: its experts are no units (the
    default policy skips expert lists)."""
    _train_then_evaluate(ctx, FlatMoEModel(), {})


class DictBlocksModel(nn.Module):
    """Blocks kept as nn.ModuleDicts, their parts called by the parent."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(24)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(DIM), "attn": nn.Linear(DIM, DIM), "mlp": nn.Linear(DIM, DIM)})
            for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" not in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + torch.tanh(layer["attn"](layer["norm"](h)))
            h = h + torch.tanh(layer["mlp"](h))
        return self.head(h)


def module_dict_blocks(ctx: ps.Context) -> None:
    model = DictBlocksModel()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    model, opt = ctx.wrap(model, opt)  # the parity Context's ~500-byte buckets: one unit per block
    ctx.record_check("stage 3: one unit per ModuleDict block and the root",
                     ctx.reference or ctx.stage != 3 or model._zero_ext.handles.diagnostics.stats()["units"] == 4)
    for step in range(3):
        global_loss(ctx, model, step).backward()
        ps.step_and_record(ctx, model, opt, step)
    with torch.no_grad():
        ctx.record_value(f"no_grad evaluation on rank {ctx.rank}'s tokens",
                         lm_loss(model, tokens_of(ctx.world, 100, ctx.rank, salt=5)))
