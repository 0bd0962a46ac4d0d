"""The one accessor of the state zero_ext attaches to what it wraps: a
model's ZeroState (runtime/state.py), and the same object on each of its
optimizers; and an optimizer's member token in its model's step round
(optim/step_round.py). Every room reads and attaches them here, never
through the attributes, so where they live can change in one place."""
from __future__ import annotations

from typing import Any, Optional

import torch

_ATTRIBUTE = "_zero_ext"
# In the optimizer's __dict__, not keyed by id(): wrappers that copy the
# __dict__ (Lightning's LightningOptimizer) then count as the optimizer.
_MEMBER_ATTRIBUTE = "_zero_ext_member"


def attach_state(obj: Any, state: Any) -> None:
    """Makes `state` the zero_ext state of `obj` (a wrapped model or optimizer)."""
    setattr(obj, _ATTRIBUTE, state)


def state_or_none(obj: Any) -> Optional[Any]:
    """The zero_ext state of `obj`, or None when zero_ext did not wrap it."""
    return getattr(obj, _ATTRIBUTE, None)


def attach_member(optimizer: Any, token: int) -> None:
    """Gives `optimizer` its token (0..n-1) among its model's optimizers."""
    setattr(optimizer, _MEMBER_ATTRIBUTE, int(token))


def member_of(optimizer: Any) -> int:
    """The token attach_member gave `optimizer` (AttributeError when none)."""
    return getattr(optimizer, _MEMBER_ATTRIBUTE)


def state_of(model: Any):
    """The state of a wrapped model (or optimizer); ValueError when it is not wrapped."""
    state = state_or_none(model)
    if state is None:
        raise ValueError("zero_ext: this model is not wrapped; call zero_ext.wrap(model, optimizer) first")
    return state


def owner_state(module: torch.nn.Module):
    """The zero_ext state of the wrapped model that `module` is or belongs to."""
    state = state_or_none(module)
    if state is not None:
        return state
    for p in module.parameters():
        ref = getattr(p, "_zero_ext_owner", None)
        if ref is not None and ref() is not None:
            return ref()
    raise ValueError("zero_ext: this module is neither a model wrapped by zero_ext nor a submodule of one "
                     "(with parameters); call zero_ext.wrap(model, optimizer) first")
