"""Which parameters each param group holds, over every rank: what a DCP
checkpoint's param_groups entries list and what its load matches them
against. A rank's optimizer holds its own segments only, so each rank's
part is gathered."""
from __future__ import annotations

from typing import Dict, List, Optional

from .. import plan
from ...tools import state_or_none


def group_members(state, optimizer, ranks) -> List[List[int]]:
    """Each param group's parameters (bucketed indices) over every rank.
    Collective; an optimizer not wrapped with this model raises on every rank."""
    error, mine = None, None
    try:
        if state_or_none(optimizer) is not state:
            raise ValueError("zero_ext: this optimizer was not wrapped together with this model")
        mine = plan.optimizer_pieces_by_group(state, optimizer)
    except Exception as e:  # noqa: BLE001 - raised on every rank by settle
        error = e
    every = ranks.settle(error, mine)
    return [sorted(set().union(*(r[g] for r in every))) for g in range(len(mine))]


def group_names(state, optimizer, members: Optional[List[List[int]]], ranks) -> Optional[List[List[str]]]:
    """Each param group's parameter names, as a DCP save lists them under the
    group's index. A pipeline stage (`ranks` across pp): every stage's names
    under the same index, gathered (collective over every rank, whether or
    not `members` came: None where this rank failed before, and then None
    is returned everywhere and the caller's settle raises that failure).
    The stages' groups of one index must then hold the same hyperparameters,
    which one entry per index can only hold once; ValueError otherwise."""
    mine = None if members is None else [[state.bucketed_names[i] for i in m] for m in members]
    if ranks.pp is None:
        return mine
    hyper = None if mine is None else [repr(sorted((k, repr(v)) for k, v in g.items() if k != "params"))
                                       for g in optimizer.param_groups]
    every = ranks.gather((mine, hyper))
    if any(m is None for m, _ in every):
        return None
    counts = {len(m) for m, _ in every}
    if len(counts) > 1 or any(h != every[0][1] for _, h in every):
        raise ValueError(
            "zero_ext.save: the pipeline stages' optimizers differ in their param groups (their number or a group's "
            "hyperparameters), and a DCP checkpoint in get_state_dict's layout keys param groups by index across the "
            "whole model: give every stage's optimizer the same groups in the same order, or save with "
            "dcp_layout=\"torchtitan\" (hyperparameters per parameter). Nothing was written")
    merged: List[List[str]] = []
    for g in range(len(every[0][0])):
        seen: Dict[str, None] = {}
        for names, _ in every:
            seen.update(dict.fromkeys(names[g]))
        merged.append(list(seen))
    return merged
