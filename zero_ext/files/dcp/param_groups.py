"""Which parameters each param group holds, over every rank: what a DCP
checkpoint's param_groups entries list and what its load matches them
against. A rank's optimizer holds its own segments only, so each rank's
part is gathered."""
from __future__ import annotations

from typing import List

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
