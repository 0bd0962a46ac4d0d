"""Explicit prefetch lists per stage 3 unit, as FSDP2's
set_modules_to_forward_prefetch / set_modules_to_backward_prefetch.

By default a unit's forward starts the gathers of the next `prefetch` units
of the last forward's order, and its backward those of the units before it
(csrc/units.cpp). A list set here replaces that for the unit: when its
forward (backward) begins, exactly the listed units' gathers start, in the
order given; an empty list prefetches nothing. The lists stay until set
again. Every rank must set the same lists: gathers issued in another order
on one rank end every rank in zero_ext's error (the collective checks)."""
from __future__ import annotations

from typing import Iterable, List, Sequence

import torch

from ..tools import owner_state, require_module


def _unit_index(state, module: torch.nn.Module, what: str) -> int:
    u = state.unit_of_module.get(id(module), 0)
    if u <= 0:
        raise ValueError(
            f"zero_ext.{what}: {type(module).__name__} is not a stage 3 unit (nor a member of one) of this model; "
            "prefetch lists name units: the modules wrap's units= (or its default policy) made units")
    return u


def _set(module: torch.nn.Module, modules: Sequence[torch.nn.Module], forward: bool, what: str) -> None:
    require_module(module, f"zero_ext.{what}", f"zero_ext.{what}(unit, [units])", "a unit of the wrapped model")
    # Checked at every stage, though stages 0-2 have nothing to prefetch: a wrong call is wrong everywhere.
    listed = isinstance(modules, (torch.nn.ModuleList, torch.nn.Sequential)) or (
        isinstance(modules, Iterable) and not isinstance(modules, (torch.nn.Module, str, bytes)))
    modules = list(modules) if listed else []
    if not listed or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise TypeError(f"zero_ext.{what}: pass a list of modules (units of the model)")
    state = owner_state(module)
    if not state.params_sharded:
        return  # stages 0-2: parameters are never released, nothing to gather ahead
    u = _unit_index(state, module, what)
    targets: List[int] = [_unit_index(state, m, what) for m in modules]
    state.handles.units.set_prefetch(u, forward, targets)


def set_modules_to_forward_prefetch(module: torch.nn.Module, modules: Sequence[torch.nn.Module]) -> None:
    """When `module`'s (a unit's) forward begins, the gathers of `modules`
    (units) start; replaces the automatic forward prefetch for it."""
    _set(module, modules, True, "set_modules_to_forward_prefetch")


def set_modules_to_backward_prefetch(module: torch.nn.Module, modules: Sequence[torch.nn.Module]) -> None:
    """When `module`'s (a unit's) backward begins, the gathers of `modules`
    (units) start; replaces the automatic backward prefetch for it."""
    _set(module, modules, False, "set_modules_to_backward_prefetch")
