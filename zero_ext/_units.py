"""Stage 3 units: which submodules gather their parameters as one.

Unit 0 is the root (the wrapped model): it owns every parameter no other unit
claims. A parameter registered in several units' subtrees (tied weights, e.g.
an embedding shared with the output layer) belongs to their closest common
unit, so it is gathered whenever either user runs.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Dict, List, Set, Union

import torch.nn as nn

UnitPolicy = Union[None, Set[type], Callable[[nn.Module], bool]]


def default_policy(model: nn.Module) -> Set[int]:
    """Each child of a ModuleList/Sequential whose class repeats there (the
    blocks of a transformer, say) is a unit."""
    chosen: Set[int] = set()
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            counts = Counter(type(c) for c in children)
            for child in children:
                if counts[type(child)] >= 2 and any(True for _ in child.parameters()):
                    chosen.add(id(child))
    return chosen


def resolve_units(model: nn.Module, units: UnitPolicy) -> List[nn.Module]:
    """The unit modules, root first, then the rest in registration order."""
    if units is None:
        chosen = default_policy(model)
    elif isinstance(units, (set, frozenset, list, tuple)):
        classes = tuple(units)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError("zero_ext.wrap: units must be a set of nn.Module classes or a callable module -> bool")
        chosen = {id(m) for m in model.modules() if isinstance(m, classes) and m is not model}
    elif callable(units):
        chosen = {id(m) for m in model.modules() if m is not model and units(m)}
    else:
        raise TypeError("zero_ext.wrap: units must be a set of nn.Module classes or a callable module -> bool")
    if units is not None and not chosen:
        raise ValueError(
            "zero_ext.wrap: the units policy matched no submodule of the model; pass the classes of "
            "its blocks (e.g. units={MyBlock}) or leave units=None for the automatic policy"
        )
    return [model] + [m for m in model.modules() if id(m) in chosen and m is not model]


def assign_parameters(model: nn.Module, unit_modules: List[nn.Module]) -> Dict[int, int]:
    """Maps id(parameter) to the index of the unit that owns it."""
    unit_index = {id(m): i for i, m in enumerate(unit_modules)}
    parent: Dict[int, int] = {0: -1}
    users: Dict[int, Set[int]] = {}

    def walk(module: nn.Module, current: int) -> None:
        here = unit_index.get(id(module), current)
        if here != current:
            parent[here] = current
        for p in module._parameters.values():
            if p is not None:
                users.setdefault(id(p), set()).add(here)
        for child in module.children():
            walk(child, here)

    walk(model, 0)

    def ancestry(u: int) -> List[int]:
        path = []
        while u != -1:
            path.append(u)
            u = parent[u]
        return path

    owner: Dict[int, int] = {}
    for pid, us in users.items():
        paths = [ancestry(u) for u in us]
        common = set(paths[0]).intersection(*map(set, paths[1:]))
        owner[pid] = next(u for u in paths[0] if u in common)  # the deepest common unit
    return owner
