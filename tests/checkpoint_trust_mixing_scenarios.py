"""Checkpoint trust: a load never mixes two saves. One file of a save
replaced by another save's, a save landing in the middle of a load, and
ranks that open different saves at one path."""
from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import zero_ext
from zero_ext.files.checkpoint import load as _load_module
from checkpoint_trust_common import _refresh_size, attempt, make, params_of, same, step


def _two_saves(root: str, case: str):
    """Checkpoints A (extra 'A', lr 0.05, buffer 1s) and B (one more step,
    extra 'B', lr 0.5, buffer 2s) of one model, and what each holds."""
    model, opt = make(0)
    step(model, opt)
    model.scale.fill_(1.0)
    a = os.path.join(root, case, "A")
    zero_ext.save(a, model, opt, extra="A")
    want_a = params_of(model)
    step(model, opt)
    model.scale.fill_(2.0)
    for g in opt.param_groups:
        g["lr"] = 0.5
    b = os.path.join(root, case, "B")
    zero_ext.save(b, model, opt, extra="B")
    want_b = params_of(model)
    return a, b, model, opt, want_a, want_b


def _which(model, opt, extra, want_a, want_b) -> List[str]:
    """Which checkpoint each part of a loaded model came from."""
    def of(match_a, match_b):
        return "A" if match_a else "B" if match_b else "?"
    got = params_of(model)
    weights = {k: v for k, v in got.items() if k != "scale"}
    return [
        of(same(weights, {k: v for k, v in want_a.items() if k != "scale"}),
           same(weights, {k: v for k, v in want_b.items() if k != "scale"})),
        of(bool((model.scale == 1.0).all()), bool((model.scale == 2.0).all())),
        of(opt.param_groups[0]["lr"] == 0.05, opt.param_groups[0]["lr"] == 0.5),
        of(extra == "A", extra == "B"),
    ]


def _mixed(root: str, name: str) -> Dict[str, Any]:
    """One file of A replaced by B's: the directory now mixes two saves."""
    a, b, model, opt, want_a, want_b = _two_saves(root, f"mixed-{name}")
    shutil.copyfile(os.path.join(b, name), os.path.join(a, name))
    _refresh_size(a, name)
    m, o = make(0, seed=9)
    outcome = attempt(lambda: zero_ext.load(a, m, o))
    outcome["parts"] = _which(m, o, outcome["value"], want_a, want_b) if outcome["error"] is None else None
    return outcome


def _race(root: str, when: int) -> Dict[str, Any]:
    """A save of B to the same path lands during a load of A: just before
    the load's `when`-th torch.load call."""
    a, b, model, opt, want_a, want_b = _two_saves(root, f"race-{when}")
    real = torch.load
    calls = [0]

    def racing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == when:
            torch.load = real
            zero_ext.save(a, model, opt, extra="B")  # model and opt hold B
        return real(*args, **kwargs)

    m, o = make(0, seed=9)
    torch.load = racing
    try:
        outcome = attempt(lambda: zero_ext.load(a, m, o))
    finally:
        torch.load = real
    outcome["saved_during"] = calls[0] >= when
    outcome["parts"] = _which(m, o, outcome["value"], want_a, want_b) if outcome["error"] is None else None
    return outcome


def _ranks_open_different_saves(root: str, rank: int, world: int) -> Dict[str, Any]:
    """Rank 0 opens checkpoint A; then B is renamed into its place; then rank
    1 opens the path: the ranks must notice they hold different saves."""
    model, opt = make(2)
    where = os.path.join(root, "ranks-differ")
    a, b = os.path.join(where, "ckpt"), os.path.join(where, "B")
    zero_ext.save(a, model, opt, extra="A")
    step(model, opt, rank)
    zero_ext.save(b, model, opt, extra="B")
    real = _load_module.Checkpoint

    def opened_in_turn(*args, **kwargs):
        if rank == 0:
            checkpoint = real(*args, **kwargs)
        dist.barrier()
        if rank == 1:
            os.rename(a, a + "-gone")
            os.rename(b, a)
            checkpoint = real(*args, **kwargs)
        dist.barrier()
        return checkpoint

    m, o = make(2, seed=4)
    before = params_of(m)
    _load_module.Checkpoint = opened_in_turn
    try:
        outcome = attempt(lambda: zero_ext.load(a, m, o))
    finally:
        _load_module.Checkpoint = real
    outcome["model_unchanged"] = same(before, params_of(m))
    return outcome
