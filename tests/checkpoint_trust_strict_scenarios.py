"""Checkpoint trust, world 1: loading is strict. Buffers and parameters
missing, unexpected or mis-shaped are refused, and with strict=False
loaded as far as they match (a mis-shaped parameter still refused); a
missing extra file is refused."""
from __future__ import annotations

import os
import shutil
from typing import Any, Dict

import torch
import torch.nn as nn

import zero_ext
from checkpoint_trust_common import TIMEOUT, Tiny, attempt, make, params_of, same, step


def _strict(root: str) -> Dict[str, Any]:
    out = {}
    model, opt = make(0, buffer_len=1)
    zero_ext.save(os.path.join(root, "buf1"), model, opt)
    model, opt = make(0)
    step(model, opt)
    path = os.path.join(root, "strict")
    zero_ext.save(path, model, opt)
    saved = params_of(model)

    m, o = make(0, seed=3)  # a saved (1,) buffer must not broadcast into a (4,) one
    out["buffer-shape"] = attempt(lambda: zero_ext.load(os.path.join(root, "buf1"), m, o))
    out["buffer-shape-nonstrict"] = attempt(lambda: zero_ext.load(os.path.join(root, "buf1"), m, o, strict=False))

    m, o = make(0, seed=3)
    m.register_buffer("count", torch.zeros(2))  # missing from the checkpoint
    out["buffer-missing"] = attempt(lambda: zero_ext.load(path, m, o))
    m, o = make(0, seed=3)
    m.register_buffer("count", torch.full((2,), 7.0))
    out["buffer-missing-nonstrict"] = attempt(lambda: zero_ext.load(path, m, o, strict=False))
    out["buffer-missing-nonstrict-kept"] = bool(torch.equal(m.count, torch.full((2,), 7.0)))
    out["buffer-missing-nonstrict-loaded"] = same(params_of(m), dict(saved, count=m.count))

    m, o = make(0, seed=3, buffer_len=None)  # the checkpoint's buffer is unexpected
    out["buffer-unexpected"] = attempt(lambda: zero_ext.load(path, m, o))
    m, o = make(0, seed=3, buffer_len=None)
    out["buffer-unexpected-nonstrict"] = attempt(lambda: zero_ext.load(path, m, o, strict=False))

    m, o = make(0, seed=3, more=True)  # parameters missing from the checkpoint
    more = {k: v.clone() for k, v in m.more.state_dict().items()}
    out["param-missing"] = attempt(lambda: zero_ext.load(path, m, o))
    m, o = make(0, seed=3, more=True)
    out["param-missing-nonstrict"] = attempt(lambda: zero_ext.load(path, m, o, strict=False))
    got = params_of(m)
    out["param-missing-nonstrict-loaded"] = (all(torch.equal(got[k], v) for k, v in saved.items())
                                             and all(torch.equal(got[f"more.{k}"], v) for k, v in more.items()))

    m2, o2 = make(0, more=True)
    more_path = os.path.join(root, "strict-more")
    zero_ext.save(more_path, m2, o2)
    m, o = make(0, seed=3)  # the checkpoint's extra parameters are unexpected
    out["param-unexpected"] = attempt(lambda: zero_ext.load(more_path, m, o))
    m, o = make(0, seed=3)
    out["param-unexpected-nonstrict"] = attempt(lambda: zero_ext.load(more_path, m, o, strict=False))

    m = Tiny(3)
    m.lin = nn.Linear(4, 2)  # a mis-shaped parameter is refused even when not strict
    o = torch.optim.AdamW(m.parameters())
    zero_ext.wrap(m, o, stage=0, timeout=TIMEOUT)
    out["param-shape-nonstrict"] = attempt(lambda: zero_ext.load(path, m, o, strict=False))

    missing = os.path.join(root, "no-extra")
    shutil.copytree(path, missing)
    os.remove(os.path.join(missing, "extra-rank0.pt"))
    m, o = make(0, seed=3)
    out["extra-missing"] = attempt(lambda: zero_ext.load(missing, m, o))
    return out
