"""Full (unsharded) views of a wrapped model: state and gradients."""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from ..tools import state_of


@torch.no_grad()
def full_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every entry of ``model.state_dict()``, full shape, on CPU, on every rank."""
    state = state_of(model)
    full = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if state.handles.optimizer.has_masters():  # mixed precision: the fp32 masters, not the rounded copies
        masters = {id(p): m for p, m in zip(state.bucketed, state.handles.optimizer.full_masters())}
        for name, p in model.named_parameters(remove_duplicate=False):  # tied names too
            if name in full and id(p) in masters:
                full[name] = masters[id(p)].to("cpu", copy=True)
    return full


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Loads a full state_dict (e.g. from an unwrapped model) into a wrapped
    model, in place, on every rank. Keys must match exactly."""
    state_of(model)
    model.load_state_dict(state_dict, strict=True)  # stage 3: gathers and writes shards


@torch.no_grad()
def full_grads(model: torch.nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """Each parameter's full averaged gradient accumulated since the last
    zero_grad(), fp32, on CPU, on every rank; None where no rank produced one.

    Collective: call it on every rank, after a backward outside no_sync() and
    before optimizer.step().
    """
    state = state_of(model)
    grads = state.handles.reduction.full_grads()
    has = state.handles.reduction.has_grad()
    by_id = {id(p): (g.float().cpu() if h else None) for p, g, h in zip(state.bucketed, grads, has)}
    return {name: by_id.get(id(p)) for name, p in model.named_parameters()}
