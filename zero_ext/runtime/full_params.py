"""zero_ext.full_params: full parameter values in place, for reading
(printing, norms for logging, an EMA) and for weight surgery."""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch

from ..tools import owner_state, require_module, wait_for_snapshot


@contextlib.contextmanager
def full_params(module: torch.nn.Module, writeback: bool = False) -> Iterator[None]:
    """Inside, every parameter of `module` (the wrapped model or one of its
    submodules) holds its full value, on every rank, in every stage, in the
    dtype it computes in (the compute copy under mixed precision;
    zero_ext.full_state_dict gives the fp32 masters).

    Collective: every rank of the model's group enters and leaves it, in the
    same order. With ``writeback=True`` changes made inside (the same on every
    rank) become the new values on exit: fp32 masters and shards are
    rewritten for the parameters that changed, and those bump their autograd
    version. Without it, stage 3 discards changes at exit; in stages 0-2 the
    parameters are the full compute copies themselves, so change them only
    with writeback=True, or the next step overwrites the change on some
    elements and not others.
    """
    require_module(module, "zero_ext.full_params", "zero_ext.full_params(model)",
                   "the wrapped model or one of its submodules")
    if not isinstance(writeback, bool):
        raise TypeError(f"zero_ext.full_params: writeback must be True or False, got {writeback!r}")
    state = owner_state(module)
    if writeback:  # changes made inside may write what a save in flight has not copied yet
        wait_for_snapshot(state)  # [Note: the snapshot of an asynchronous save]
    position = {id(p): i for i, p in enumerate(state.bucketed)}
    mine: List[int] = sorted({position[id(p)] for p in module.parameters() if id(p) in position})
    handles = state.handles
    before: List[torch.Tensor] = []
    if writeback and handles.optimizer.has_masters():
        before = handles.optimizer.full_masters()  # collective in stages 1-3
    if state.params_sharded:
        handles.units.gather_units_of(mine)
    try:
        yield
        if writeback:
            _write_back(state, mine, before)
    finally:
        if state.params_sharded:
            handles.units.unpin_units_of(mine)  # released unless an enclosing context holds them


@torch.no_grad()
def _write_back(state, mine: List[int], before: List[torch.Tensor]) -> None:
    handles = state.handles
    params = state.bucketed
    changed = []
    if before:
        # A parameter whose compute value is still its rounded master keeps
        # the master's fp32 precision; a changed one takes the new value.
        masters = list(before)
        for i in mine:
            p = params[i]
            old = masters[i].to(device=p.device, dtype=p.dtype).view(p.shape)
            if not torch.equal(p.detach(), old):
                masters[i] = p.detach().to(torch.float32).reshape(masters[i].shape)
                changed.append(i)
        if changed:
            handles.optimizer.load_masters(masters)
    elif state.params_sharded:
        changed = list(mine)
    if state.params_sharded:
        handles.units.write_back_shards()  # this rank's shard of the (gathered) full values
    for i in changed:
        torch.autograd.graph.increment_version(params[i])
