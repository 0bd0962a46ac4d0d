"""Stage 3 with reshard_after_forward=False (units kept gathered from forward
to backward), a per-unit policy, and explicit model.unshard()/reshard():
scenarios run wrapped by zero_ext on N ranks and as the parity suite's
single-process reference over the global batch.

The parity suite's stage 3 scenarios run again with every unit kept
(KeptContext): backward forms, retain_graph, no_sync, checkpointing, rank-
dependent branches, freezing after wrap. The rest check what keeping
changes: one all-gather per unit and step instead of two, forwards under
no_grad and forwards whose graph is dropped, explicit gathering.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn as nn

import parity_scenarios as ps
import zero_ext
from parity_scenarios import Blocks


class KeptContext(ps.Context):
    """The parity Context at stage 3 with reshard_after_forward=False (or
    `policy`) unless a scenario passes its own."""

    policy = False

    def wrap(self, model: nn.Module, opt: torch.optim.Optimizer, **options):
        policy = options.setdefault("reshard_after_forward", self.policy)
        model, opt = super().wrap(model, opt, **options)
        if policy is False and not self.reference:  # raises rather than records: some scenarios wrap twice
            stats = _stats(self, model)
            assert stats["units_kept_after_forward"] == stats["units"] - 1, "not every unit kept"  # noqa: S101
        return model, opt


def _stats(ctx: ps.Context, model: nn.Module) -> Dict[str, int]:
    return {} if ctx.reference else model._zero_ext.handles.diagnostics.stats()


def _same_on_every_rank(model: nn.Module, seed: int) -> torch.Tensor:
    """A forward of the same tokens on every rank (and in the reference)."""
    g = torch.Generator().manual_seed(seed)
    return model(torch.randint(0, ps.VOCAB, (2, ps.SEQ), generator=g)).square().mean()


def gathers_per_step_kept(ctx: ps.Context) -> None:
    """Blocks (embed/head tied in the root, three block units): kept, each
    block is gathered once a step (forward) and the root once; resharded
    (the default), blocks twice. Both train like one process."""
    for policy, expected in ((False, 4), (True, 7)):
        model = Blocks()
        model, opt = ctx.wrap(model, ps.adamw(model), reshard_after_forward=policy)
        counts = []
        for step in range(2):
            before = _stats(ctx, model).get("param_gathers", 0)
            ps.token_loss(ctx, model, step).backward()
            counts.append(_stats(ctx, model).get("param_gathers", 0) - before)
            ps.step_and_record(ctx, model, opt, step)
        ctx.record_check(f"reshard_after_forward={policy}: {expected} all-gathers a step",
                         ctx.reference or counts == [expected, expected])
        ctx.record_check("nothing gathered after the step",
                         ctx.reference or _stats(ctx, model)["gathered_units"] == 0)


def kept_units_held_until_their_backward(ctx: ps.Context) -> None:
    """Between forward and backward the kept units stay gathered (all four:
    the root and three blocks); with the default only the root does."""
    for policy, expected in ((False, 4), (True, 1)):
        model = Blocks()
        model, opt = ctx.wrap(model, ps.adamw(model), reshard_after_forward=policy)
        loss = ps.token_loss(ctx, model, 0)
        ctx.record_check(f"reshard_after_forward={policy}: {expected} units gathered after forward",
                         ctx.reference or _stats(ctx, model)["gathered_units"] == expected)
        loss.backward()
        ctx.record_check("released by the backward", ctx.reference or _stats(ctx, model)["gathered_units"] == 0)
        ps.step_and_record(ctx, model, opt, 0)


def last_block_kept_torchtitan_style(ctx: ps.Context) -> None:
    """A callable policy: every block resharded but the last, whose backward
    comes first (torchtitan's choice): 1 + 2 + 2 + 1 gathers a step."""
    model = Blocks()
    last = model.blocks[-1]
    model, opt = ctx.wrap(model, ps.adamw(model), reshard_after_forward=lambda m: m is not last)
    for step in range(3):
        before = _stats(ctx, model).get("param_gathers", 0)
        ps.token_loss(ctx, model, step).backward()
        ctx.record_check(f"step {step}: 6 all-gathers",
                         ctx.reference or _stats(ctx, model)["param_gathers"] - before == 6)
        ps.step_and_record(ctx, model, opt, step)


def no_grad_and_dropped_forwards(ctx: ps.Context) -> None:
    """A forward under no_grad releases every unit (no backward will); a
    forward with grad whose graph is dropped leaves the kept units gathered,
    on every rank alike, and the next forward uses them as they are; a
    step makes them stale and releases them."""
    model = Blocks()
    model, opt = ctx.wrap(model, ps.adamw(model))
    for step in range(3):
        with torch.no_grad():
            ctx.record_value(f"step {step}: eval", _same_on_every_rank(model, 10 + step))
        ctx.record_check("no_grad forward releases", ctx.reference or _stats(ctx, model)["gathered_units"] == 0)
        dropped = _same_on_every_rank(model, 20 + step)
        ctx.record_value(f"step {step}: dropped", dropped)
        del dropped
        ctx.record_check("a dropped graph's units stay gathered",
                         ctx.reference or _stats(ctx, model)["gathered_units"] == 4)
        ps.token_loss(ctx, model, step).backward()
        ps.step_and_record(ctx, model, opt, step)
        ctx.record_check("released after the step", ctx.reference or _stats(ctx, model)["gathered_units"] == 0)


def explicit_unshard_and_reshard(ctx: ps.Context) -> None:
    """model.unshard() before forward (sync, then async with the handle's
    wait(), then async waited by the forward itself) with the default
    policy: the forward finds its units gathered and releases them as
    usual, so the step costs 4 + 3 gathers instead of 7; model.reshard()
    releases what unshard() gathered."""
    model = Blocks()
    model, opt = ctx.wrap(model, ps.adamw(model), reshard_after_forward=ctx.policy or True)  # sub2: 2
    for step, mode in enumerate(("sync", "handle", "forward waits")):
        before = _stats(ctx, model).get("param_gathers", 0)
        if not ctx.reference:
            handle = model.unshard(async_op=mode != "sync")
            if mode == "handle":
                handle.wait()
        if mode == "sync":
            ctx.record_check("unshard() gathers every unit", ctx.reference or _stats(ctx, model)["gathered_units"] == 4)
        ps.token_loss(ctx, model, step).backward()
        ctx.record_check(f"step {step} ({mode}): 7 all-gathers",
                         ctx.reference or _stats(ctx, model)["param_gathers"] - before == 7)
        ps.step_and_record(ctx, model, opt, step)
    if not ctx.reference:
        model.unshard()
        model.reshard()
    ctx.record_check("reshard() releases", ctx.reference or _stats(ctx, model)["gathered_units"] == 0)
    with torch.no_grad():
        ctx.record_value("after reshard", _same_on_every_rank(model, 9))


def mixed_requires_grad_across_units(ctx: ps.Context) -> None:
    """FSDP2's frozen test (each Linear a unit, every other one frozen after
    wrap, a no_grad step between, all unfrozen at the last), kept gathered."""
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(ps.IN, ps.IN), nn.ReLU())])
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if not ctx.reference:
        model, opt = zero_ext.wrap(model, opt, stage=3, bucket_mb=ps.BUCKET_MB, reshard_after_forward=ctx.policy,
                                   units={nn.Linear}, **ctx.group_kwargs())
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for lin in linears[::2]:
        lin.requires_grad_(False)
    for step in range(4):
        if step == 3:
            model.requires_grad_(True)
        total = 0.0
        for r, w in ctx.participants():
            x, _ = ps.batch(step, r, ctx.world)
            with torch.set_grad_enabled(step != 1):
                total = total + w * model(x).square().mean()
        if step == 1:
            with torch.no_grad():
                ctx.record_value(f"step {step}: no_grad", model(torch.ones(2, ps.IN)).sum())
        else:
            total.backward()
            ps.step_and_record(ctx, model, opt, step)


def regathers_within_subgroups(ctx: ps.Context) -> None:
    """reshard_after_forward=2 at world 4: after forward each block keeps half
    of its bucket (the subgroup of 2 holds a whole copy), its backward
    gathers within the subgroup: 4 all-gathers over the group (root and
    blocks in forward) and 3 within subgroups a step; then a no_grad forward
    releases outright, and a block called twice regathers from its parts."""
    model = Blocks()
    model, opt = ctx.wrap(model, ps.adamw(model), reshard_after_forward=2)
    for step in range(2):
        before = _stats(ctx, model)
        loss = ps.token_loss(ctx, model, step)
        after = _stats(ctx, model)
        ctx.record_check(f"step {step}: three blocks hold parts after forward",
                         ctx.reference or (after["units_holding_parts"] == 3 and after["gathered_units"] == 1))
        loss.backward()
        done = _stats(ctx, model)
        ctx.record_check(f"step {step}: 7 gathers, 3 of them within subgroups",
                         ctx.reference or (done["param_gathers"] - before["param_gathers"] == 7
                                           and done["regathers"] - before["regathers"] == 3))
        ctx.record_check("nothing held after backward",
                         ctx.reference or done["units_holding_parts"] + done["gathered_units"] == 0)
        ps.step_and_record(ctx, model, opt, step)
    with torch.no_grad():
        ctx.record_value("no_grad", _same_on_every_rank(model, 3))
    ctx.record_check("no_grad forward holds nothing", ctx.reference or _stats(ctx, model)["units_holding_parts"] == 0)
    ps.token_loss(ctx, model, 5, plan=[0, 1, 1, 2]).backward()
    ps.step_and_record(ctx, model, opt, 5)


def explicit_prefetch_lists(ctx: ps.Context) -> None:
    """set_modules_to_forward/backward_prefetch with prefetch=0: block 0's
    forward starts blocks 1 and 2's gathers, block 2's backward those of
    blocks 1 and 0, so every block is gathered at once in each direction
    (4 units with the root; without the lists 2); block 1 prefetches
    nothing (an empty list). Gathers per step and results unchanged."""
    model = Blocks()
    model, opt = ctx.wrap(model, ps.adamw(model), reshard_after_forward=ctx.policy or True, prefetch=0)
    if not ctx.reference:
        b = model.blocks
        zero_ext.set_modules_to_forward_prefetch(b[0], [b[1], b[2]])
        zero_ext.set_modules_to_forward_prefetch(b[1], [])
        zero_ext.set_modules_to_backward_prefetch(b[2], [b[1], b[0]])
    for step in range(2):
        ps.token_loss(ctx, model, step).backward()
        ps.step_and_record(ctx, model, opt, step)
    stats = _stats(ctx, model)
    ctx.record_check("every block gathered at once in forward and in backward",
                     ctx.reference or (stats["peak_gathered_units_forward"] == 4
                                       and stats["peak_gathered_units_backward"] == 4))


_REUSED = [
    *ps.STAGE3_BLOCKS_SCENARIOS,
    ps.scalar_loss_outside_model,
    ps.nonscalar_backward,
    ps.autograd_backward_list,
    ps.retain_graph_two_losses,
    ps.retain_graph_zero_grad_between,
    ps.four_backward_per_step,
    ps.no_sync_accumulation,
    ps.unused_parameters,
    ps.branch_on_rank0_only,
    ps.frozen_parameters,
    ps.autograd_grad_is_side_effect_free,
    ps.checkpoint_reentrant_param_used_twice,
    ps.checkpoint_nonreentrant_param_used_twice,
    ps.offload_no_sync_accumulation,
    ps.registered_forward_methods,
    ps.frozen_and_unfrozen_after_wrap,
    ps.frozen_after_wrap_saved_and_loaded,
]

SCENARIOS: Dict[str, Callable[[ps.Context], None]] = {
    f.__name__: f
    for f in _REUSED + [
        gathers_per_step_kept,
        kept_units_held_until_their_backward,
        last_block_kept_torchtitan_style,
        no_grad_and_dropped_forwards,
        explicit_unshard_and_reshard,
        mixed_requires_grad_across_units,
        regathers_within_subgroups,
        explicit_prefetch_lists,
    ]
}

_REFERENCES: Dict[tuple, list] = {}


# At world 4, reshard_after_forward=2 (a unit kept as halves in subgroups of 2
# between forward and backward) runs the same scenarios as "name/sub2".
SUBGROUP_SCENARIOS = [f.__name__ for f in _REUSED] + ["explicit_unshard_and_reshard", "regathers_within_subgroups",
                                                      "mixed_requires_grad_across_units", "explicit_prefetch_lists"]


class SubgroupContext(KeptContext):
    policy = 2


# Run again on a 2 x 2 hybrid mesh (world 4): kept units gather over the shard row.
ON_HYBRID_MESH = ["gathers_per_step_kept", "no_sync_accumulation", "retain_graph_two_losses",
                  "checkpoint_each_block_nonreentrant", "explicit_unshard_and_reshard", "branch_on_rank0_only"]


def run_one(rank: int, world: int, item: str) -> Optional[str]:
    """On each rank: None, or the first mismatch against the single-process
    reference (computed once per scenario and world size). "name/mesh2x2":
    on a 2 x 2 (replicate, shard) mesh; "name/sub2": resharded to subgroups of
    2 after forward (both: "name/mesh2x4/sub2")."""
    name, *variants = item.split("/")
    mesh = None
    for variant in variants:
        if variant.startswith("mesh"):
            mesh = ps.device_mesh(*(int(v) for v in variant[len("mesh"):].split("x")))
    if (name, world) not in _REFERENCES:
        ref_ctx = KeptContext(stage=0, rank=rank, world=world, reference=True)
        SCENARIOS[name](ref_ctx)
        _REFERENCES[(name, world)] = ref_ctx.checkpoints
    context = SubgroupContext if "sub2" in variants else KeptContext
    ctx = context(stage=3, rank=rank, world=world, reference=False, mesh=mesh)
    SCENARIOS[name](ctx)
    return ps.compare(_REFERENCES[(name, world)], ctx.checkpoints)
