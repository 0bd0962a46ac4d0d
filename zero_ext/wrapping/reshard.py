"""reshard_after_forward: what a stage 3 unit holds between its forward and
its backward.

FSDP2's fully_shard(module, reshard_after_forward=...) per module, here one
wrap() option: True (the default) releases each unit after its forward and
gathers it again over the shard group for its backward; False keeps it
gathered from forward to backward (one all-gather per unit and step instead
of two, for the memory of the units kept); an int k (1 < k < the shard group
size, dividing it) reshards it to subgroups of k consecutive ranks: each
keeps 1/k of the unit, and its backward gathers within the subgroup (a node,
say) instead of the whole group ([Note: resharding to a subgroup] in
csrc/units.cpp). 1 means False and the shard group size True. A callable
decides per unit (torchtitan keeps the last block, whose backward comes
first); the units it reshards to subgroups share one k.

The root (the model's own parameters) always stays gathered from a forward
with grad to its backward, which starts with it. A forward under no_grad
releases every unit: no backward will come to release it.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, List, Union

import torch

Policy = Union[bool, int, Callable[[torch.nn.Module], Union[bool, int]]]


def check_policy(policy: Policy) -> None:
    """Type checks at wrap(), before any communication."""
    if isinstance(policy, bool) or callable(policy):
        return
    if isinstance(policy, numbers.Integral):
        if policy < 1:
            raise ValueError(f"zero_ext.wrap: reshard_after_forward as an int is the group size the parameters "
                             f"are resharded to after forward (>= 1), got {policy!r}")
        return
    raise TypeError(f"zero_ext.wrap: reshard_after_forward must be True, False, an int or a callable "
                    f"module -> bool, got {type(policy).__name__} {policy!r}")


KEEP, RELEASE = 0, -1


def _group_size(value: object, shard_size: int, where: str) -> int:
    """What a unit holds after forward: KEEP (whole), RELEASE (its shard),
    or the size of the subgroup it is resharded to."""
    if isinstance(value, bool):
        return RELEASE if value else KEEP
    if isinstance(value, numbers.Integral):
        value = int(value)
        if value == 1:
            return KEEP
        if value == shard_size:
            return RELEASE
        if value < 1 or value > shard_size or shard_size % value:
            raise ValueError(
                f"zero_ext.wrap: reshard_after_forward={value}{where} asks to reshard to groups of {value} ranks "
                f"after forward, which must divide the shard group's {shard_size} ranks (True: {shard_size}, "
                f"False: 1)")
        return value
    raise TypeError(f"zero_ext.wrap: reshard_after_forward{where} returned {type(value).__name__} {value!r}; "
                    f"it must return True, False or an int")


@dataclass(frozen=True)
class ReshardPlan:
    kept: List[int]  # units kept gathered from forward to backward
    to_subgroup: List[int]  # units resharded to subgroups of subgroup_size
    subgroup_size: int  # 0: none


def plan_reshard(policy: Policy, units: List[List[torch.nn.Module]], unit_names: List[str],
                 shard_size: int) -> ReshardPlan:
    """Each unit's group after forward (the root, unit 0, is always kept). A
    callable is asked about each member of a unit; the members of one unit
    must agree, and the units resharded to subgroups use one size."""
    kept, to_subgroup, sizes = [], [], set()
    for u in range(1, len(units)):
        if callable(policy) and not isinstance(policy, bool):
            found = {_group_size(policy(m), shard_size, f" (for unit '{unit_names[u]}')") for m in units[u]}
            if len(found) > 1:
                raise ValueError(
                    f"zero_ext.wrap: reshard_after_forward answers differently for the members of unit "
                    f"'{unit_names[u]}', which gathers and releases as one; return the same value for each")
            size = found.pop()
        else:
            size = _group_size(policy, shard_size, "")
        if size == KEEP:
            kept.append(u)
        elif size != RELEASE:
            to_subgroup.append(u)
            sizes.add(size)
    if len(sizes) > 1:
        raise ValueError(f"zero_ext.wrap: reshard_after_forward reshards units to subgroups of {sorted(sizes)} ranks; "
                         "one wrapped model reshards to one subgroup size")
    return ReshardPlan(kept, to_subgroup, sizes.pop() if sizes else 0)
