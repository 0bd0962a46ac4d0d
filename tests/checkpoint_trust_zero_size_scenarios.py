"""Checkpoint trust: zero-size and one-element parameters, saved at every
stage at world sizes 1 and 2, loaded into every stage at both (the same
full state, and a step after it), and converted."""
from __future__ import annotations

import os
from typing import Any, Dict

import torch

import zero_ext
from zero_ext.convert import convert
from checkpoint_trust_common import Tiny, attempt, make, params_of, same, step


def _zero_size_save(root: str, world: int, rank: int) -> Dict[str, Any]:
    """Saves Tiny at every stage at this world size, with the full state to compare."""
    out = {}
    for stage in range(4):
        path = os.path.join(root, f"zs-w{world}-s{stage}")

        def save():
            model, opt = make(stage, zero_size=True)
            step(model, opt, rank, n=2)
            zero_ext.save(path, model, opt, extra={"rank": rank})
            want = params_of(model)  # collective
            if rank == 0:
                torch.save(want, path + ".want")
        out[stage] = attempt(save)
    return out


def _zero_size_load(root: str, world: int, rank: int, saved_world: int) -> Dict[str, Any]:
    """Every stage's checkpoint from `saved_world` into every stage here: the
    same full state; then one more step works."""
    out = {}
    for saved in range(4):
        path = os.path.join(root, f"zs-w{saved_world}-s{saved}")
        for stage in range(4):
            def load():
                model, opt = make(stage, seed=5, zero_size=True)
                extra = zero_ext.load(path, model, opt)
                want = torch.load(path + ".want", weights_only=True)
                if not same(params_of(model), want):
                    raise AssertionError("the loaded state differs from the saved one")
                step(model, opt, rank)
                return extra["rank"]
            out[f"{saved}->{stage}"] = attempt(load)
    return out


def _zero_size_convert(root: str) -> Dict[str, Any]:
    out = {}
    for world in (1, 2):
        for stage in range(4):
            path = os.path.join(root, f"zs-w{world}-s{stage}")

            def check():
                convert(path, path + ".plain.pt")
                plain = torch.load(path + ".plain.pt", weights_only=True)
                fresh = Tiny(seed=8, zero_size=True)
                fresh.load_state_dict(plain)
                if not same(dict(fresh.state_dict()), torch.load(path + ".want", weights_only=True)):
                    raise AssertionError("the converted state differs from the saved one")
            out[f"w{world}-s{stage}"] = attempt(check)
    return out
