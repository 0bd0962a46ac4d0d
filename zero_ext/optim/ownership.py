"""How an optimizer is sharded, and, for one that must see whole tensors,
which rank owns each parameter ([Note: whole-parameter layout] in
csrc/layout.h).

- Elementwise optimizers (torch.optim's Adam, SGD, ...; or a class that sets
  `zero_ext_elementwise = True`) update each element from that element's
  gradient and state alone: they step any slice, so buckets are cut in equal
  shards anywhere ("flat").
- Every other optimizer whose update reads one parameter at a time (Muon,
  Adafactor, LAMB, Shampoo-style, and any optimizer zero_ext does not know:
  unknown means whole, which is exact) steps whole parameters: each has one
  owner rank, which holds its state and (mixed precision) its fp32 master,
  receives its whole reduced gradient and steps it with the user's own class
  ("whole").
- Optimizers that read across parameters (LBFGS: one search direction over
  every parameter, with a closure it calls many times) are refused outside
  stage 0.
"""
from __future__ import annotations

from typing import List, Optional, Set, Tuple

import torch

# torch.optim optimizers whose update of an element depends only on that
# element's gradient and state: they can run on any slice of a parameter.
ELEMENTWISE_OPTIMIZERS = {
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam",
    "RAdam", "RMSprop", "Rprop",
}
# Optimizers whose step reads every parameter at once.
ACROSS_PARAMETERS = {"LBFGS": "its line search combines every parameter into one direction and calls the "
                              "closure several times per step"}

FLAT, WHOLE, REPLICATED = "flat", "whole", "replicated"


def is_elementwise(cls: type) -> bool:
    if getattr(cls, "zero_ext_elementwise", False):
        return True
    return cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE_OPTIMIZERS


def optimizer_sharding(optimizer: torch.optim.Optimizer, shards_state: bool) -> str:
    """FLAT, WHOLE or (`shards_state` False, stage 0: every rank steps
    everything) REPLICATED; raises TypeError for an optimizer that reads
    across parameters."""
    if not shards_state:
        return REPLICATED
    cls = type(optimizer)
    if is_elementwise(cls):
        return FLAT
    reason = ACROSS_PARAMETERS.get(cls.__name__) if cls.__module__.startswith("torch.optim") else None
    if reason is not None or getattr(cls, "zero_ext_across_parameters", False):
        raise TypeError(
            f"zero_ext stages 1-3 shard the optimizer by parameter, and {cls.__name__} reads across "
            f"parameters ({reason or 'it says so: zero_ext_across_parameters = True'}), so no rank could step "
            f"its part alone. Use stage=0 (every rank steps the whole model).")
    return WHOLE


def plan_owners(ordered: List[torch.nn.Parameter], counts: List[int], world: int,
                whole: Optional[Set[int]] = None) -> Tuple[List[torch.nn.Parameter], List[int]]:
    """(parameters in bucket order, grouped by owner within each bucket;
    each one's owner rank, or -1 in a bucket cut in equal shards). A bucket
    is whole when it holds a parameter whose id() is in `whole` (None: every
    bucket; buckets never mix optimizers). Within a whole bucket, largest
    first onto the rank with the fewest elements in that bucket, ties to the
    rank with the fewest overall: each bucket's widest region (its per-rank
    size) stays close to an equal share, and the owned totals balance across
    buckets."""
    total = [0] * world
    out: List[torch.nn.Parameter] = []
    owners: List[int] = []
    first = 0
    for count in counts:
        members = ordered[first:first + count]
        first += count
        if whole is not None and not any(id(p) in whole for p in members):
            out += members
            owners += [-1] * len(members)
            continue
        region = [0] * world
        owner_of = {}
        for k in sorted(range(len(members)), key=lambda k: (-members[k].numel(), k)):
            rank = min(range(world), key=lambda r: (region[r], total[r], r))
            owner_of[k] = rank
            region[rank] += members[k].numel()
            if members[k].requires_grad:  # frozen ones take room, not optimizer state
                total[rank] += members[k].numel()
        for k in sorted(range(len(members)), key=lambda k: (owner_of[k], k)):
            out.append(members[k])
            owners.append(owner_of[k])
    return out, owners
