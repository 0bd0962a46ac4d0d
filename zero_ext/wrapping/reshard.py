"""reshard_after_forward: which stage 3 units a forward leaves gathered.

FSDP2's fully_shard(module, reshard_after_forward=...) per module, here one
wrap() option: True (the default) releases each unit after its forward and
gathers it again for its backward, False keeps it gathered from forward to
backward (one all-gather per unit and step instead of two, for the memory of
the units kept), a callable decides per unit (torchtitan keeps the last
block, whose backward comes first). An int resharding to a smaller group is
accepted where it means one of those: 1 (kept whole: False) and the shard
group's size (True).

The root (the model's own parameters) always stays gathered from a forward
with grad to its backward, which starts with it. A forward under no_grad
releases every unit: no backward will come to release it.
"""
from __future__ import annotations

import numbers
from typing import Callable, List, Union

import torch

Policy = Union[bool, int, Callable[[torch.nn.Module], Union[bool, int]]]


def check_policy(policy: Policy, stage: int) -> None:
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


def _as_keep(value: object, shard_size: int, where: str) -> bool:
    """Whether a unit stays gathered after forward (False given, or int 1)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, numbers.Integral):
        if value == 1:
            return True
        if value == shard_size:
            return False
        raise ValueError(
            f"zero_ext.wrap: reshard_after_forward={value}{where} asks to reshard to groups of {value} ranks "
            f"after forward; zero_ext reshards to the whole shard group ({shard_size} ranks: True or "
            f"{shard_size}) or not at all (False or 1). For a gather that stays within a node, shard within "
            f"the node: pass a 2-D DeviceMesh (replicate, shard) with the node as the shard dimension.")
    raise TypeError(f"zero_ext.wrap: reshard_after_forward{where} returned {type(value).__name__} {value!r}; "
                    f"it must return True, False or an int")


def kept_units(policy: Policy, units: List[List[torch.nn.Module]], unit_names: List[str],
               shard_size: int) -> List[int]:
    """The indices of the units (root 0 excluded: always kept) that a forward
    with grad leaves gathered. A callable is asked about each member of a
    unit; the members of one unit must agree."""
    kept = []
    for u in range(1, len(units)):
        if callable(policy) and not isinstance(policy, bool):
            keeps = {_as_keep(policy(m), shard_size, f" (for unit '{unit_names[u]}')") for m in units[u]}
            if len(keeps) > 1:
                raise ValueError(
                    f"zero_ext.wrap: reshard_after_forward answers differently for the members of unit "
                    f"'{unit_names[u]}', which gathers and releases as one; return the same value for each")
            keep = keeps.pop()
        else:
            keep = _as_keep(policy, shard_size, "")
        if keep:
            kept.append(u)
    return kept
