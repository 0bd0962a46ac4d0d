"""Rank side of test_default_settings.py (and tests/cuda): the same training
and checkpoint round trip with torch's global defaults untouched, and with a
user's defaults set around every zero_ext call (default dtype float64
throughout; default device "meta" on CPU, "cuda" on a GPU, around save, load
and the full state dict)."""
from __future__ import annotations

import contextlib
import io
import os
from typing import Dict

import torch
import torch.nn.functional as F

import zero_ext
from checkpoint_scenarios import global_batch, local_optimizer_state
from parity_scenarios import Net


@contextlib.contextmanager
def user_defaults(on: bool, device: str = None):
    """torch.set_default_dtype / torch.set_default_device as a user sets them."""
    if not on:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device(device) if device else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(old)


def _train(model, opt, steps, rank, world, on, device):
    for step in steps:
        x, y = global_batch(step)  # the data: fp32, outside the user's defaults
        rows = x.shape[0] // world
        x, y = x[rank * rows:(rank + 1) * rows].float(), y[rank * rows:(rank + 1) * rows].float()
        x, y = x.to(device), y.to(device)
        with user_defaults(on):
            F.mse_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()


def round_trip(rank: int, world: int, item) -> Dict[str, object]:
    """Train 2 steps, save, train 1, load, train 1: the final state, with
    every dtype zero_ext's tensors have."""
    root, stage, precision, offload, on, device = item
    default_device = "meta" if device == "cpu" else device  # meta: what would crash on a CPU-only machine
    path = os.path.join(root, f"ckpt-{stage}-{precision}-{offload}-{on}-{device}")
    model = Net(seed=1).to(device)  # built before the user's defaults: an fp32 model either way
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    with user_defaults(on):
        model, opt = zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision, bucket_mb=0.001,
                                   offload_optimizer="cpu" if offload else None)
    _train(model, opt, range(2), rank, world, on, device)
    with user_defaults(on, device=default_device):
        zero_ext.save(path, model, opt, extra={"step": 2})
    _train(model, opt, range(2, 3), rank, world, on, device)
    with user_defaults(on, device=default_device):
        extra = zero_ext.load(path, model, opt)
    _train(model, opt, range(2, 3), rank, world, on, device)
    with user_defaults(on, device=default_device):
        full = zero_ext.full_state_dict(model)
    # torch.optim itself keeps "step" in float64 under a float64 default
    # (torch.optim.optimizer._get_scalar_dtype): compare its value only.
    state = [{k: (float(v) if k == "step" else v) for k, v in s.items()} for s in local_optimizer_state(opt)]
    # As bytes: tensors through a multiprocessing queue are shared with the
    # sending process, which may be gone by the time the parent reads them.
    out = io.BytesIO()
    torch.save({"extra": extra, "full": full, "optimizer": state,
            "dtypes": sorted({f"{k}:{v.dtype}:{v.device}" for s in state for k, v in s.items()
                              if isinstance(v, torch.Tensor)} |
                                   {f"param:{p.dtype}:{p.device}" for p in model.parameters()})}, out)
    return out.getvalue()
