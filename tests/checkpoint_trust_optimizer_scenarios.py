"""Checkpoint trust: each optimizer's class is recorded at save and compared
at load. An AdamW checkpoint into SGD is refused, or loaded fresh or whole
when asked (on one rank, and sharded over two where the ranks disagree
about how); a version 3 checkpoint, without classes, loads into any;
several optimizers each keep theirs. Optimizer state that differs per
slice of a parameter is refused at save."""
from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import zero_ext
from zero_ext.convert import convert
from checkpoint_trust_common import TIMEOUT, Tiny, _meta, _put_meta, attempt, litter, make, params_of, same, step


def _groups(opt) -> List[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _state_keys(opt) -> List[List[str]]:
    return sorted(sorted(st) for st in opt.state.values())


def _sgd(stage: int = 0, rank: int = 0):
    """Tiny with SGD (momentum), stepped once: it has momentum buffers of its own."""
    model = Tiny(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=0.0001, timeout=TIMEOUT)
    step(model, opt, rank)
    return model, opt


def _into_sgd(path: str, saved: Dict[str, torch.Tensor], stage: int = 0, rank: int = 0) -> Dict[str, Any]:
    """An AdamW checkpoint into SGD: refused by default (nothing changes), with
    "fresh" the model loads and SGD starts without state, its own groups kept,
    and trains on; with "load" AdamW's state and hyperparameters load."""
    out = {}
    model, opt = _sgd(stage, rank)
    before, groups, keys = params_of(model), _groups(opt), _state_keys(opt)
    out["refused"] = attempt(lambda: zero_ext.load(path, model, opt))
    out["refused-unchanged"] = (same(before, params_of(model)) and _groups(opt) == groups
                                and _state_keys(opt) == keys and keys and keys[0] == ["momentum_buffer"])
    model, opt = _sgd(stage, rank)
    groups = _groups(opt)
    out["fresh"] = attempt(lambda: zero_ext.load(path, model, opt, optimizer_class_mismatch="fresh"))
    out["fresh-loaded"] = same(params_of(model), saved)
    out["fresh-groups-kept"] = _groups(opt) == groups
    out["fresh-state"] = _state_keys(opt)
    out["fresh-trains"] = attempt(lambda: step(model, opt, rank))
    out["fresh-state-after-step"] = _state_keys(opt)
    model, opt = _sgd(stage, rank)
    out["load"] = attempt(lambda: zero_ext.load(path, model, opt, optimizer_class_mismatch="load"))
    out["load-loaded"] = same(params_of(model), saved)
    out["load-state"] = _state_keys(opt)
    out["load-betas"] = opt.param_groups[0].get("betas")
    return out


def _step_all(model, opts) -> None:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(7))
    model(x).pow(2).mean().backward()
    for o in opts:
        o.step()
        o.zero_grad()


def _pair(first, second):
    """Tiny with one optimizer for `lin` and another for `one`."""
    model = Tiny(seed=3)
    opts = [first(model.lin.parameters(), lr=0.05), second([model.one], lr=0.05)]
    return zero_ext.wrap(model, opts, stage=0, timeout=TIMEOUT)


def _optimizer_class(root: str) -> Dict[str, Any]:
    """Each optimizer's class is recorded at save and compared at load; a
    checkpoint saved before classes were recorded (version 3) loads into any."""
    model, opt = make(0)
    step(model, opt)
    path = os.path.join(root, "optimizer-class")
    zero_ext.save(path, model, opt)
    saved = params_of(model)
    out = {"recorded": _meta(path).get("optimizer_classes"), "into-sgd": _into_sgd(path, saved)}
    model, opt = _sgd()
    out["bad-option"] = attempt(lambda: zero_ext.load(path, model, opt, optimizer_class_mismatch="allow"))
    model, opt = make(0, seed=3)
    out["same-class"] = attempt(lambda: zero_ext.load(path, model, opt))
    out["same-class-state"] = _state_keys(opt)

    # Version 3, exactly as saved before classes were recorded: that field absent.
    old = os.path.join(root, "optimizer-class-v3")
    shutil.copytree(path, old)
    meta = _meta(old)
    meta.pop("optimizer_classes", None)
    meta["version"] = 3
    _put_meta(old, meta)
    model, opt = _sgd()
    out["v3-into-sgd"] = attempt(lambda: zero_ext.load(old, model, opt))  # accepted, as it was
    out["v3-into-sgd-state"] = _state_keys(opt)
    model, opt = make(0, seed=3)
    out["v3"] = attempt(lambda: zero_ext.load(old, model, opt))
    out["v3-loaded"] = same(params_of(model), saved)
    out["v3-state"] = _state_keys(opt)

    def converted(src):
        convert(src, src + ".plain.pt")
        fresh = Tiny(seed=8)
        fresh.load_state_dict(torch.load(src + ".plain.pt", weights_only=True))
        return same({k: v for k, v in fresh.state_dict().items() if k != "scale"},
                    {k: v for k, v in saved.items() if k != "scale"})
    out["convert"] = attempt(lambda: converted(path))
    out["v3-convert"] = attempt(lambda: converted(old))

    # Several optimizers: each one's class, in order.
    model, opts = _pair(torch.optim.AdamW, torch.optim.SGD)
    _step_all(model, opts)
    pair = os.path.join(root, "optimizer-class-pair")
    zero_ext.save(pair, model, opts)
    out["pair-recorded"] = _meta(pair).get("optimizer_classes")
    model, opts = _pair(torch.optim.AdamW, torch.optim.Adam)
    out["pair-refused"] = attempt(lambda: zero_ext.load(pair, model, opts))
    model, opts = _pair(torch.optim.AdamW, torch.optim.SGD)
    out["pair"] = attempt(lambda: zero_ext.load(pair, model, opts))
    return out


def _optimizer_class_world2(root: str, rank: int) -> Dict[str, Any]:
    """Stage 2 (sharded state): an AdamW checkpoint into SGD on every rank."""
    model, opt = make(2)
    step(model, opt, rank)
    path = os.path.join(root, "optimizer-class-w2")
    zero_ext.save(path, model, opt)
    out = _into_sgd(path, params_of(model), stage=2, rank=rank)
    model, opt = _sgd(2, rank)
    mode = "fresh" if rank == 0 else "load"
    out["modes-differ"] = attempt(lambda: zero_ext.load(path, model, opt, optimizer_class_mismatch=mode))
    return out


class SliceNormSGD(torch.optim.SGD):
    """Marked elementwise, but keeps a scalar that depends on the slice it
    steps (its gradient's norm): ranks holding parts of one parameter hold
    different values, which one checkpoint value per parameter cannot keep."""
    zero_ext_elementwise = True

    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["grad_norm"] = float(p.grad.norm())
        return loss


def _scalar_per_slice(root: str, rank: int) -> Dict[str, Any]:
    model = Tiny(seed=0)
    opt = SliceNormSGD(model.parameters(), lr=0.05)
    model, opt = zero_ext.wrap(model, opt, stage=2, bucket_mb=0.0001, timeout=TIMEOUT)
    step(model, opt, rank)
    path = os.path.join(root, "scalar-per-slice", "ckpt")
    outcome = attempt(lambda: zero_ext.save(path, model, opt))
    dist.barrier()
    outcome["published"] = os.path.exists(path)
    outcome["litter"] = litter(path)
    return outcome
