"""A model's optimizers seen as one, by the calls that take "the optimizer"
(save, load, memory_report): `zero_ext.wrap(model, [muon, adamw])` hands the
user their list back, and these calls take that list.

The view's param_groups are the optimizers' own group dicts, one after the
other (a checkpoint lists them in that order), and its state reads and
writes each tensor's state in the optimizer that steps it.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, MutableMapping, Sequence, Union

import torch

from ..tools import state_or_none
from .sharded_optimizer import ZeroExtOptimizer


class _StateView(MutableMapping):
    def __init__(self, optimizers: List[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def _holder(self, tensor: torch.Tensor) -> torch.optim.Optimizer:
        for opt in self._optimizers:
            if any(p is tensor for g in opt.param_groups for p in g["params"]):
                return opt
        raise KeyError("zero_ext: a tensor that none of the model's optimizers steps")

    def __getitem__(self, tensor: torch.Tensor) -> Dict[str, Any]:
        for opt in self._optimizers:
            if tensor in opt.state:
                return opt.state[tensor]
        raise KeyError(tensor)

    def __setitem__(self, tensor: torch.Tensor, value: Dict[str, Any]) -> None:
        self._holder(tensor).state[tensor] = value

    def __delitem__(self, tensor: torch.Tensor) -> None:
        for opt in self._optimizers:
            if tensor in opt.state:
                del opt.state[tensor]
                return
        raise KeyError(tensor)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self._optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)

    def clear(self) -> None:
        for opt in self._optimizers:
            opt.state.clear()


class OptimizerSet:
    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self.state = _StateView(self.optimizers)

    @property
    def param_groups(self) -> List[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def _zero_ext(self):
        """The wrapped model's state, if every optimizer was wrapped with the same model."""
        states = {id(state_or_none(opt)): state_or_none(opt) for opt in self.optimizers}
        return next(iter(states.values())) if len(states) == 1 else None

    @property
    def class_name(self) -> str:
        return "+".join(class_name(opt) for opt in self.optimizers)


def user_class(optimizer: torch.optim.Optimizer) -> type:
    """The user's optimizer class: wrap() swaps in a subclass that puts
    zero_ext's mixin first (wrapping/class_swap.py)."""
    return next(c for c in type(optimizer).__mro__ if not issubclass(c, ZeroExtOptimizer))


def class_name(optimizer: Union[torch.optim.Optimizer, OptimizerSet]) -> str:
    """The user's optimizer class, or the classes of a set joined by '+'."""
    if isinstance(optimizer, OptimizerSet):
        return optimizer.class_name
    return user_class(optimizer).__name__


def qualified_class_names(optimizer: Union[torch.optim.Optimizer, OptimizerSet]) -> List[str]:
    """module.qualname of the user's class of each optimizer (one, or each of a set, in order)."""
    optimizers = optimizer.optimizers if isinstance(optimizer, OptimizerSet) else [optimizer]
    return [f"{cls.__module__}.{cls.__qualname__}" for cls in map(user_class, optimizers)]


def as_one(optimizer: Any) -> Any:
    """One optimizer as it is; a list or tuple of them as an OptimizerSet."""
    if isinstance(optimizer, (list, tuple)):
        return OptimizerSet(optimizer)
    return optimizer
