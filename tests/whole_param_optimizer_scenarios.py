"""Optimizers that are not elementwise at stages 1-3 (optim/ownership.py):
Muon, Adafactor and an optimizer zero_ext has never heard of, each stepping
whole parameters on their owner rank, against the same optimizer stepped on
one process over the global batch (tests/parity_scenarios.py's Context and
compare()).

Each scenario records gradients and parameters after every step, and checks
that the optimizer state is sharded: every parameter's state lives on exactly
one rank, whole, and the ranks' state adds up to the reference's.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_ext
from parity_scenarios import BF16, Context, MasterWeightReference, batch, compare, device_mesh

BUCKET_MB = 0.0005  # ~500 bytes: several buckets even for these tiny models
STAGES = (1, 2, 3)
IN, HIDDEN, OUT = 6, 12, 3
STEPS = 3


class Matrices(nn.Module):
    """Bias-free layers (Muon steps 2-D parameters only)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN, bias=False)
        self.mid = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


class WithBiases(nn.Module):
    """Matrices and vectors: Adafactor factors the first, not the second."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(IN, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.mid(torch.tanh(self.inp(x))))))


class TrustRatioSGD(torch.optim.Optimizer):
    """An optimizer zero_ext does not know, written as a user would: SGD with
    momentum scaled per tensor by ||p|| / ||update|| (LAMB's trust ratio), so
    a slice of a parameter would step differently from the whole."""

    def __init__(self, params, lr: float = 0.05, momentum: float = 0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["step"] = torch.tensor(0.0)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad)
                state["step"] += 1
                ratio = (p.norm() / buf.norm().clamp_min(1e-12)).clamp(0.0, 10.0)
                p.add_(buf, alpha=-group["lr"] * float(ratio))
        return loss


def muon(params) -> torch.optim.Optimizer:
    return torch.optim.Muon(params, lr=0.02, weight_decay=0.1)


def adafactor(params) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=0.01, weight_decay=0.01)


def trust_ratio(params) -> torch.optim.Optimizer:
    return TrustRatioSGD(params)


def loss_of(ctx: Context, model: nn.Module, step: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    total = 0.0
    for r, w in ctx.participants():
        x, y = batch(step, r, ctx.world)
        if dtype is not None:
            x = x.to(dtype)
        total = total + w * F.mse_loss(model(x).float(), y)
    return total


def state_numel(opt) -> int:
    """Elements of tensor state this process holds (0-d counters aside)."""
    return sum(v.numel() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def record_state_sharded(ctx: Context, model: nn.Module, opt) -> None:
    """The ranks together hold the reference's optimizer state exactly once
    (the element counts add up to the reference's), each rank a part of it
    (world > 1), and every tensor the optimizer steps is a whole parameter,
    in its shape."""
    local = state_numel(opt)
    if ctx.reference:
        ctx.record_value("state elements over all ranks", torch.tensor(float(local)))
        ctx.record_checks(["state split over the ranks", "the optimizer steps whole parameters"])
        return
    total = torch.tensor(float(local))
    dist.all_reduce(total)
    total /= ctx.replicas  # hybrid sharding: each row holds the whole state once
    ctx.record_value("state elements over all ranks", total)
    shapes = sorted(tuple(p.shape) for p in model.parameters())
    stepped = [tuple(t.shape) for g in opt.param_groups for t in g["params"]]
    ctx.record_checks(["state split over the ranks", "the optimizer steps whole parameters"],
                      [ctx.world == 1 or local < total.item(), all(s in shapes for s in stepped)])


def _train(ctx: Context, build, make_optimizer, steps: int = STEPS) -> None:
    model = build()
    opt = make_optimizer(model.parameters())
    if not ctx.reference:
        model, opt = zero_ext.wrap(model, opt, stage=ctx.stage, bucket_mb=BUCKET_MB, **ctx.group_kwargs())
    for step in range(steps):
        loss_of(ctx, model, step).backward()
        ctx.record_grads(f"step {step}", model)
        opt.step()
        opt.zero_grad()
        ctx.record_params(f"step {step}", model)
    record_state_sharded(ctx, model, opt)


def muon_on_matrices(ctx: Context) -> None:
    _train(ctx, Matrices, muon)


def adafactor_on_matrices_and_vectors(ctx: Context) -> None:
    _train(ctx, WithBiases, adafactor)


def unknown_optimizer(ctx: Context) -> None:
    _train(ctx, WithBiases, trust_ratio)


def adafactor_bf16(ctx: Context) -> None:
    """bf16 compute, fp32 masters stepped by Adafactor on their owners."""
    model = WithBiases()
    names = [n for n, _ in model.named_parameters()]
    if ctx.reference:
        ref = opt = MasterWeightReference(model, adafactor, torch.bfloat16)
    else:
        model, opt = zero_ext.wrap(model, adafactor(model.parameters()), stage=ctx.stage, bucket_mb=BUCKET_MB,
                                   mixed_precision="bf16", **ctx.group_kwargs())
    for step in range(STEPS):
        loss_of(ctx, model, step, torch.bfloat16).backward()
        if ctx.reference:
            grads = {n: None if p.grad is None else p.grad.float() for n, p in model.named_parameters()}
            ctx.checkpoints.append((f"{BF16}step {step}: grads", grads))
        else:
            ctx.record_grads(f"{BF16}step {step}", model)
        opt.step()
        opt.zero_grad()
        if ctx.reference:
            masters = dict(zip(names, [m.clone() for m in ref.masters]))
        else:
            full = zero_ext.full_state_dict(model)
            masters = {n: full[n] for n in names}
        ctx.checkpoints.append((f"{BF16}step {step}: masters", masters))
    record_state_sharded(ctx, model, ref.opt if ctx.reference else opt)


def muon_and_adamw(params):
    """The standard recipe: Muon for the hidden matrices, AdamW for the rest."""
    params = list(params)
    matrices = [p for p in params if p.dim() == 2 and p.shape[0] == p.shape[1]]
    rest = [p for p in params if not any(p is m for m in matrices)]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1),
            torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1)]


def muon_and_adamw_as_a_list(ctx: Context) -> None:
    """wrap(model, [muon, adamw]) returns the list; the loop steps and zeroes
    each in turn (zero_grad of the first waits for the second's step)."""
    model = WithBiases()
    opts = muon_and_adamw(model.parameters())
    if not ctx.reference:
        model, got = zero_ext.wrap(model, opts, stage=ctx.stage, bucket_mb=BUCKET_MB, **ctx.group_kwargs())
        ctx.record_check("wrap returns the list it was given", got is opts)
    else:
        ctx.record_check("wrap returns the list it was given", True)
    _steps(ctx, model, opts, range(STEPS))
    for k, opt in enumerate(opts):
        local = torch.tensor(float(state_numel(opt)))
        if not ctx.reference and ctx.stage > 0:  # stage 0: every rank holds it all
            dist.all_reduce(local)
            local /= ctx.replicas  # hybrid sharding: each row holds it once
        ctx.record_value(f"optimizer {k}: state elements over all ranks", local)


def muon_and_adamw_tuple_zero_grad_first(ctx: Context) -> None:
    """A tuple, zero_grad on both at the top of the loop, then both steps."""
    model = WithBiases()
    opts = tuple(muon_and_adamw(model.parameters()))
    if not ctx.reference:
        model, got = zero_ext.wrap(model, opts, stage=ctx.stage, bucket_mb=BUCKET_MB, **ctx.group_kwargs())
        assert got is opts
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        loss_of(ctx, model, step).backward()
        ctx.record_grads(f"step {step}", model)
        for opt in reversed(opts):
            opt.step()
        ctx.record_params(f"step {step}", model)


def muon_and_adamw_offloaded_and_clipped(ctx: Context) -> None:
    """offload_optimizer="cpu" (zero_ext's C++ Adam for AdamW, torch's Muon on
    the owner's host copy) and zero_ext.clip_grad_norm_ over the whole model
    (the global norm across both optimizers and every rank)."""
    model = WithBiases()
    opts = muon_and_adamw(model.parameters())
    if not ctx.reference:
        model, opts = zero_ext.wrap(model, opts, stage=ctx.stage, bucket_mb=BUCKET_MB, offload_optimizer="cpu",
                                    **ctx.group_kwargs())
    for step in range(STEPS):
        loss_of(ctx, model, step).backward()
        clip = torch.nn.utils.clip_grad_norm_ if ctx.reference else zero_ext.clip_grad_norm_
        ctx.record_value(f"step {step}: norm before clipping", clip(model.parameters(), 0.05))
        ctx.record_grads(f"step {step}", model)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        ctx.record_params(f"step {step}", model)


def _steps(ctx: Context, model: nn.Module, opts, steps, record: bool = True) -> None:
    """The loop over a list of optimizers: backward, then each steps and zeroes."""
    for step in steps:
        loss_of(ctx, model, step).backward()
        if record:
            ctx.record_grads(f"step {step}", model)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if record:
            ctx.record_params(f"step {step}", model)


def _reloaded_at_next_stage(ctx: Context, model: nn.Module, opts, build, make):
    """zero_ext.save here, then a fresh model (other initial weights) wrapped at
    the next stage (1 -> 2 -> 3 -> 1) and zero_ext.load: (model, optimizers)."""
    root = [tempfile.mkdtemp(prefix="zero_ext_whole_") if ctx.rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    path = os.path.join(root[0], "ck")
    zero_ext.save(path, model, opts)
    model = build(seed=1)
    model, opts = zero_ext.wrap(model, make(model.parameters()), stage=ctx.stage % 3 + 1, bucket_mb=BUCKET_MB,
                                **ctx.group_kwargs())
    zero_ext.load(path, model, opts)
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(root[0], ignore_errors=True)
    return model, opts


def checkpoint_across_stages(ctx: Context) -> None:
    """Muon's state saved at this stage and loaded at the next, trained on:
    the same as the reference trained straight through."""
    model = Matrices()
    opt = muon(model.parameters())
    if not ctx.reference:
        model, opt = zero_ext.wrap(model, opt, stage=ctx.stage, bucket_mb=BUCKET_MB, **ctx.group_kwargs())
    _steps(ctx, model, [opt], range(2), record=False)
    if not ctx.reference:
        model, opt = _reloaded_at_next_stage(ctx, model, opt, Matrices, muon)
    _steps(ctx, model, [opt], range(2, 4))


def checkpoint_of_a_list_across_stages(ctx: Context) -> None:
    """[muon, adamw] saved at this stage and loaded as a list at the next one;
    memory_report takes the list too."""
    model = WithBiases()
    opts = muon_and_adamw(model.parameters())
    if not ctx.reference:
        model, opts = zero_ext.wrap(model, opts, stage=ctx.stage, bucket_mb=BUCKET_MB, **ctx.group_kwargs())
    _steps(ctx, model, opts, range(2), record=False)
    held = sum(t.numel() * t.element_size() for o in opts for st in o.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))
    ctx.record_check("memory_report counts both optimizers' state",
                     ctx.reference or zero_ext.memory_report(model, opts)["optimizer_state"] == held > 0)
    if not ctx.reference:
        model, opts = _reloaded_at_next_stage(ctx, model, opts, WithBiases, muon_and_adamw)
    _steps(ctx, model, opts, range(2, 4))


# -- a checkpoint saved at one world size, loaded at another -----------------
# The global batch is fixed (RESHARD_ROWS rows a step) and split over however
# many ranks train, so runs at world 1, 2 and 4 see the same data and compare
# with one process trained straight through. Owners differ between world
# sizes: the file must carry each whole parameter's state by name, not by rank.

RESHARD_ROWS = 8
RESHARD_K = 2  # steps before the save, and after the load


def reshard_batch(step: int):
    g = torch.Generator().manual_seed(5150 + step)
    return torch.randn(RESHARD_ROWS, IN, generator=g), torch.randn(RESHARD_ROWS, OUT, generator=g)


def reshard_train(model: nn.Module, opts, steps: range, rank: int, world: int, dtype=torch.float32) -> None:
    rows = RESHARD_ROWS // world
    for step in steps:
        x, y = reshard_batch(step)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        F.mse_loss(model(x.to(dtype)).float(), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


# name: (model, optimizers as a list, mixed precision, the stage it is saved at)
RESHARD_CASES = {
    "muon_adamw_list": (WithBiases, muon_and_adamw, None, 2),
    "adafactor": (WithBiases, lambda ps: [adafactor(ps)], None, 2),  # factored state: shaped unlike its parameter
    "adafactor_bf16": (WithBiases, lambda ps: [adafactor(ps)], "bf16", 3),
    "unknown": (Matrices, lambda ps: [trust_ratio(ps)], None, 1),
    # As DCP (state that is not elementwise: whole tensors of their own shape),
    # flat, and hybrid over 2x1 (an owner in each row: the first row's writes).
    "muon_adamw_list_dcp": (WithBiases, muon_and_adamw, None, 2),
    "adafactor_dcp_hybrid": (WithBiases, lambda ps: [adafactor(ps)], None, 2),
}
SAVED_AS = {"muon_adamw_list_dcp": ("dcp", ""), "adafactor_dcp_hybrid": ("dcp", "2x1")}  # (format, mesh); else ours, flat


def reshard_make(case: str, stage: Optional[int], seed: int = 0, mesh: str = ""):
    build, make, precision, _ = RESHARD_CASES[case]
    model = build(seed=seed)
    opts = make(model.parameters())
    if stage is None:
        return model, opts
    group = {"process_group": device_mesh(*(int(v) for v in mesh.split("x")))} if mesh else {}
    return zero_ext.wrap(model, opts, stage=stage, bucket_mb=BUCKET_MB, mixed_precision=precision, **group)


def reshard_dtype(case: str):
    return torch.bfloat16 if RESHARD_CASES[case][2] else torch.float32


def save_for_resharding(rank: int, world: int, root: str) -> None:
    assert world == 2, "the loads expect a checkpoint saved at world size 2"
    for case, (_, _, _, stage) in RESHARD_CASES.items():
        fmt, mesh = SAVED_AS.get(case, ("zero_ext", ""))
        model, opts = reshard_make(case, stage, mesh=mesh)
        reshard_train(model, opts, range(RESHARD_K), rank, world, reshard_dtype(case))
        zero_ext.save(os.path.join(root, case), model, opts, extra={"saved_at": world}, format=fmt)


def load_resharded(rank: int, world: int, root: str, mesh: str = "") -> bytes:
    """Every saved case loaded at this world size into stages 1-3 (fresh
    weights: all must come from the file), trained RESHARD_K more steps;
    the full parameters as torch.save bytes."""
    import io
    out = {}
    for case in RESHARD_CASES:
        for stage in STAGES:
            model, opts = reshard_make(case, stage, seed=7, mesh=mesh)
            extra = zero_ext.load(os.path.join(root, case), model, opts)
            assert extra == {"saved_at": 2}, extra
            reshard_train(model, opts, range(RESHARD_K, 2 * RESHARD_K), rank, world, reshard_dtype(case))
            out[f"{case}->stage{stage}"] = zero_ext.full_state_dict(model)
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def reshard_reference(case: str) -> Dict[str, torch.Tensor]:
    """One process over the global batch, trained 2 * RESHARD_K steps straight
    through (under bf16: zero_ext at world 1, stage 1, for the fp32 masters)."""
    if RESHARD_CASES[case][2]:
        model, opts = reshard_make(case, 1)
    else:
        model, opts = reshard_make(case, None)
    reshard_train(model, opts, range(2 * RESHARD_K), 0, 1, reshard_dtype(case))
    return zero_ext.full_state_dict(model) if RESHARD_CASES[case][2] else \
        {n: p.detach().clone() for n, p in model.named_parameters()}


SCENARIOS = {f.__name__: f for f in (muon_on_matrices, adafactor_on_matrices_and_vectors, unknown_optimizer,
                                     adafactor_bf16, muon_and_adamw_as_a_list, muon_and_adamw_tuple_zero_grad_first,
                                     muon_and_adamw_offloaded_and_clipped, checkpoint_across_stages,
                                     checkpoint_of_a_list_across_stages)}
_REFERENCES: Dict[tuple, list] = {}


def run_one(rank: int, world: int, item: str) -> Optional[str]:
    """One "scenario/stageN" (or "scenario/stageN/mesh2x2": hybrid sharding,
    owners within each row): None, or the first mismatch against the
    single-process reference (computed once per scenario)."""
    name, rest = item.rsplit("/stage", 1)
    stage, _, mesh = rest.partition("/mesh")
    if (name, world) not in _REFERENCES:
        ref = Context(stage=0, rank=rank, world=world, reference=True)
        SCENARIOS[name](ref)
        _REFERENCES[(name, world)] = ref.checkpoints
    ctx = Context(stage=int(stage), rank=rank, world=world, reference=False,
                  mesh=device_mesh(*(int(v) for v in mesh.split("x"))) if mesh else None)
    SCENARIOS[name](ctx)
    return compare(_REFERENCES[(name, world)], ctx.checkpoints)


# Hybrid sharding at world size 4: whole parameters owned within a row of 2.
HYBRID = ["muon_on_matrices", "muon_and_adamw_as_a_list"]


def all_items(world: int) -> List[str]:
    lists = [f"{name}/stage0" for name in SCENARIOS if name.startswith("muon_and_adamw")]  # stage 0 takes lists too
    hybrid = [f"{name}/stage{stage}/mesh2x2" for name in HYBRID for stage in STAGES] if world == 4 else []
    return [f"{name}/stage{stage}" for name in SCENARIOS for stage in STAGES] + lists + hybrid
