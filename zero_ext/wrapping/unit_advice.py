"""What an error that finds the ranks at different stage 3 units says to do
about each unit, should it run on some ranks only.

A unit gathers its parameters before its forward, on every rank at once; one
that routing or data skips on some ranks (an MoE expert no token picked)
leaves the ranks at different units, and zero_ext stops every rank naming
each rank's unit (csrc/collective_sequence.cpp, csrc/communicator.cpp). The
cure is to keep such modules inside the unit of the module that calls them,
which runs on every rank: this file words that for each unit of a model, with
a `units=` value to pass, and wrap() hands it to the core
(ShardedModel::set_unit_advice), whose errors add the advice for the units
they name (Layout::advice_for).

The suggested value is a set of classes: every class the current units are
made of, but for the units in question, plus the class of their caller.
It is offered only when it selects the caller and nothing inside what it must
keep whole; else the advice says so in words.
"""
from __future__ import annotations

from typing import Dict, List, Set, Tuple

import torch.nn as nn

from .units import Unit, _has_own_forward, _has_params


def _class_set(classes: List[type]) -> str:
    return "{" + ", ".join(c.__name__ for c in classes) + "}"


def unit_advice(model: nn.Module, units: List[Unit], default_policy: bool) -> List[str]:
    """One text per unit ("" for the root): units as resolve_units returns
    them; `default_policy`: units=None chose them."""
    parent: Dict[int, nn.Module] = {id(c): m for m in model.modules() for c in m.children()}
    path = {id(m): n for n, m in model.named_modules()}
    advice = [""]
    by_scope: Dict[Tuple[int, ...], str] = {}
    for members in units[1:]:
        holder = parent.get(id(members[0]))
        if holder is None:  # not below the model: nothing to say
            advice.append("")
            continue
        # A container (ModuleList, ModuleDict) is indexed by its caller's
        # forward: any of its modules may be the one skipped. A module with a
        # forward of its own calls this unit alone.
        container = not _has_own_forward(holder)
        scope = (holder,) if container else members
        key = tuple(id(m) for m in scope)
        if key not in by_scope:
            caller = holder
            while caller is not model and not _has_own_forward(caller):
                caller = parent[id(caller)]
            by_scope[key] = _advice(model, units, scope, container, caller, path, default_policy)
        advice.append(by_scope[key])
    return advice


def _advice(model: nn.Module, units: List[Unit], scope: Tuple[nn.Module, ...], container: bool,
            caller: nn.Module, path: Dict[int, str], default_policy: bool) -> str:
    inside: Set[int] = {id(m) for top in scope for m in top.modules()}
    if container:
        kinds = sorted({type(m).__name__ for m in scope[0].children()})
        what = f"the modules in {path[id(scope[0])]!r} ({', '.join(kinds)})"
    else:
        what = " and ".join(f"{path[id(m)]!r} ({type(m).__name__})" for m in scope)
    keep: List[type] = []
    for members in units[1:]:
        for m in members:
            if id(m) not in inside and _has_params(m) and type(m) not in keep:
                keep.append(type(m))
    if caller is not model and type(caller) not in keep:
        keep.append(type(caller))
    whole = [m for top in scope for m in top.modules()]
    valid = bool(keep) and not any(type(m) in keep for m in whole)
    where = "the root unit (the model's own)" if caller is model else (
        f"the unit of {path[id(caller)]!r} ({type(caller).__name__}), which calls them on every rank")
    if valid:
        how = f"wrap(..., units={_class_set(keep)})"
    elif caller is not model:
        how = (f"a units= policy that selects {path[id(caller)]!r} and nothing inside "
               f"{' or '.join(repr(path[id(m)]) for m in scope)}")
    else:
        how = "stage=2 (no units), as no units= policy can leave them out and select something else"
    text = (f"if routing or data skips one of {what} on some ranks (an MoE's experts), none of them may be a "
            f"stage 3 unit of its own: keep them in {where}: {how}; or run each of them on every rank.")
    if default_policy:
        text += (" (units=None tells experts by name: a container or class named like /expert/, or a caller "
                 "named like /moe/ or with a child named gate or router; docs/stage3-units.md.)")
    return text
