"""Rank-side halves of the checkpoint tests (tests/test_checkpoint.py).

The global batch is fixed (GLOBAL rows per step) and split evenly over
however many ranks train, so runs at different world sizes see the same data
and can be compared with one single-process reference.
"""
from __future__ import annotations

import io
import os
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

import zero_ext
from parity_scenarios import IN, OUT, Net, device_mesh

GLOBAL = 8  # rows per step, divisible by every world size tested (1, 2, 4)
K = 2       # steps before and after a save


def global_batch(step: int):
    g = torch.Generator().manual_seed(4242 + step)
    return torch.randn(GLOBAL, IN, generator=g), torch.randn(GLOBAL, OUT, generator=g)


def make(stage: Optional[int], precision: Optional[str] = None, offload: bool = False, seed: int = 0,
         mesh: str = ""):
    """Net and AdamW, wrapped at `stage` (None: plain); `mesh` "RxS": hybrid."""
    model = Net(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, eps=1e-3)
    if stage is None:
        return model, opt
    group = {"process_group": device_mesh(*(int(v) for v in mesh.split("x")))} if mesh else {}
    return zero_ext.wrap(model, opt, stage=stage, bucket_mb=0.0005 * (1 + stage), mixed_precision=precision,
                         offload_optimizer="cpu" if offload else None, timeout=20, **group)


def train(model, opt, steps: range, rank: int, world: int, dtype=torch.float32) -> None:
    rows = GLOBAL // world
    for step in steps:
        x, y = global_batch(step)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        F.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()


def local_optimizer_state(opt) -> List[Dict[str, torch.Tensor]]:
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)) for k, v in opt.state[p].items()}
            for g in opt.param_groups for p in g["params"] if p in opt.state]


CONFIGS = [(stage, precision, offload) for stage in (0, 1, 2, 3)
           for precision, offload in ((None, False), ("bf16", False), (None, True), ("bf16", True))]


def resume_equivalence(rank: int, world: int, root: str, mesh: str = "") -> Dict[str, Optional[str]]:
    """Train K, save, train K; versus load and train K: bit-identical
    parameters (fp32 masters) and optimizer state, per configuration
    (hybrid over `mesh` if given)."""
    results = {}
    for stage, precision, offload in CONFIGS:
        label = f"stage{stage}-{precision or 'fp32'}{'-offload' if offload else ''}"
        dtype = torch.bfloat16 if precision else torch.float32
        path = os.path.join(root, label)
        model, opt = make(stage, precision, offload, mesh=mesh)
        train(model, opt, range(K), rank, world, dtype)
        zero_ext.save(path, model, opt, extra={"rank": rank, "label": label})
        train(model, opt, range(K, 2 * K), rank, world, dtype)
        want_params, want_state = zero_ext.full_state_dict(model), local_optimizer_state(opt)

        model2, opt2 = make(stage, precision, offload, seed=7, mesh=mesh)  # different init: all must come from the file
        extra = zero_ext.load(path, model2, opt2)
        train(model2, opt2, range(K, 2 * K), rank, world, dtype)
        got_params, got_state = zero_ext.full_state_dict(model2), local_optimizer_state(opt2)
        problem = None
        if extra != {"rank": rank, "label": label}:
            problem = f"extra {extra}"
        for name in want_params:
            if not torch.equal(want_params[name], got_params[name]):
                problem = problem or f"param {name} differs by {(want_params[name] - got_params[name]).abs().max()}"
        if len(want_state) != len(got_state):
            problem = problem or f"{len(got_state)} optimizer states, want {len(want_state)}"
        for a, b in zip(want_state, got_state):
            for key in a:
                if key not in b or not torch.equal(a[key], b[key]):
                    problem = problem or f"optimizer state {key} differs"
        results[label] = problem
    return results


# (stage, precision, mesh) saved at world 4: flat, and hybrid over a 2x2 mesh.
RESHARD_SAVES = [(3, None, ""), (1, None, ""), (2, "bf16", ""), (3, None, "2x2"), (2, "bf16", "2x2")]


def saved_name(stage: int, precision: Optional[str], mesh: str) -> str:
    return f"saved-stage{stage}-{precision or 'fp32'}" + (f"-mesh{mesh}" if mesh else "")


def save_for_resharding(rank: int, world: int, root: str) -> None:
    for stage, precision, mesh in RESHARD_SAVES:
        model, opt = make(stage, precision, mesh=mesh)
        train(model, opt, range(K), rank, world, torch.bfloat16 if precision else torch.float32)
        zero_ext.save(os.path.join(root, saved_name(stage, precision, mesh)), model, opt, extra={"saved_at": world})


def load_resharded(rank: int, world: int, root: str, mesh: str = "") -> bytes:
    """Each saved checkpoint loaded at this world size (hybrid over `mesh`
    if given) into every stage, then trained K more steps; returns the full
    parameters (torch.save bytes: the result queue cannot carry tensors out
    of a rank that exits)."""
    out = {}
    for stage, precision, saved_mesh in RESHARD_SAVES:
        for new_stage in (0, 1, 2, 3):
            model, opt = make(new_stage, precision, seed=7, mesh=mesh)
            extra = zero_ext.load(os.path.join(root, saved_name(stage, precision, saved_mesh)), model, opt)
            assert extra == {"saved_at": 4}, extra
            train(model, opt, range(K, 2 * K), rank, world, torch.bfloat16 if precision else torch.float32)
            out[f"{saved_name(stage, precision, saved_mesh)}->stage{new_stage}"] = zero_ext.full_state_dict(model)
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def save_twice_and_die(rank: int, world: int, root: str, fault: str) -> None:
    """A good checkpoint, then a save during which one rank exits at `fault`."""
    model, opt = make(2)
    train(model, opt, range(K), rank, world)
    path = os.path.join(root, "ckpt")
    zero_ext.save(path, model, opt, extra="first")
    train(model, opt, range(K, 2 * K), rank, world)
    armed = os.environ.get("ZERO_EXT_TEST_FAULT")  # a condition the test set (no_exchange) stays
    os.environ["ZERO_EXT_TEST_FAULT"] = f"{armed},{fault}" if armed else fault
    zero_ext.save(path, model, opt, extra="second")


def python_collectives_on_the_core(rank: int, world: int, root: str) -> Dict[str, int]:
    """Collectives the core's communicator issued for each Python-side
    collective call (clip_grad_norm_, save, load): zero_ext's Python never
    calls torch.distributed on its own group directly, so a failure there
    marks the group and a stall is diagnosed like the core's own."""
    model, opt = make(2)
    train(model, opt, range(1), rank, world)
    count = lambda: model._zero_ext.core.stats()["collectives"]  # noqa: E731
    x, y = global_batch(9)
    F.mse_loss(model(x), y).backward()
    out = {}
    before = count()
    opt.clip_grad_norm_(1.0)
    out["clip"] = count() - before
    before = count()
    zero_ext.save(os.path.join(root, "collectives"), model, opt)
    out["save"] = count() - before
    before = count()
    zero_ext.load(os.path.join(root, "collectives"), model, opt)
    out["load"] = count() - before
    return out
