"""Full (unsharded) views of a wrapped model: state and gradients."""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from ..optim import check_tensor_parallel_grads
from ..tools import require_module, state_of


@torch.no_grad()
def full_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every entry of ``model.state_dict()``, full shape, on CPU, on every rank."""
    require_module(model, "zero_ext.full_state_dict", "zero_ext.full_state_dict(model)")
    state = state_of(model)
    full = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if state.handles.optimizer.has_masters():  # mixed precision: the fp32 masters, not the rounded copies
        masters = {id(p): m for p, m in zip(state.bucketed, state.handles.optimizer.full_masters())}
        for name, p in model.named_parameters(remove_duplicate=False):  # tied names too
            if name in full and id(p) in masters:
                full[name] = masters[id(p)].to("cpu", copy=True)
    return _over_tensor_parallel(state, model, full, lambda tp, t, spec: tp.full(t, spec))


def _over_tensor_parallel(state, model: torch.nn.Module, values: Dict[str, Optional[torch.Tensor]], how) -> dict:
    """A tensor-parallel model, or one with expert-parallel experts: each
    local leaf's entry made full (gathered over tp or ep, a collective in
    named_parameters() order) or local, by `how`."""
    dimensions = [d for d in (state.tensor_parallel, state.experts) if d is not None]
    if not dimensions:
        return values
    out = dict(values)
    for name, p in model.named_parameters(remove_duplicate=False):
        for dimension in dimensions:
            spec = dimension.spec_of(p)
            if spec is not None and out.get(name) is not None:
                out[name] = how(dimension, out[name], spec)
    return out


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Loads a full state_dict (e.g. from an unwrapped model) into a wrapped
    model, in place, on every rank. Keys must match exactly."""
    require_module(model, "zero_ext.load_full_state_dict", "zero_ext.load_full_state_dict(model, state_dict)")
    state = state_of(model)
    for dimension in (state.tensor_parallel, state.experts):  # full tensors in: refused alike before any change
        if dimension is None:
            continue
        for name, p in model.named_parameters(remove_duplicate=False):
            spec = dimension.spec_of(p)
            if spec is not None and name in state_dict and tuple(state_dict[name].shape) != tuple(spec.shape):
                raise ValueError(
                    f"zero_ext.load_full_state_dict: '{name}' has shape {tuple(state_dict[name].shape)}, and this "
                    f"tensor-parallel model's parameter is {tuple(spec.shape)} in full; pass full tensors "
                    "(zero_ext.full_state_dict's), not a rank's part (model.state_dict()'s)")
    local = _over_tensor_parallel(state, model, dict(state_dict), lambda tp, t, spec: tp.local_of(t, spec))
    model.load_state_dict(local, strict=True)  # stage 3: gathers and writes shards


@torch.no_grad()
def full_grads(model: torch.nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """Each parameter's full averaged gradient accumulated since the last
    zero_grad(), fp32, on CPU, on every rank; None where no rank produced one.

    Collective: call it on every rank, after a backward outside no_sync() and
    before optimizer.step().
    """
    require_module(model, "zero_ext.full_grads", "zero_ext.full_grads(model)")
    state = state_of(model)
    grads = state.handles.reduction.full_grads()
    check_tensor_parallel_grads(state)  # a gradient on some tp ranks only raises, never hangs the gather
    has = state.handles.reduction.has_grad()
    by_id = {id(p): (g.float().cpu() if h else None) for p, g, h in zip(state.bucketed, grads, has)}
    out = {name: by_id.get(id(p)) for name, p in model.named_parameters()}
    return _over_tensor_parallel(state, model, out, lambda tp, t, spec: tp.full(t, spec))
