"""Stage 3 inside a graph torch.compile traces: each read of a parameter is
zero_ext's op ([Note: stage 3 in a compiled graph] in csrc/units.cpp).

Eagerly, a unit's hooks gather it into the parameters' own storage before
its forward and release it after. A traced graph takes the parameters as its
inputs and cannot see a hook change what they point at; so there, reading
`module.weight` gives `zero_ext::gathered_param(handle, index, weight)`: a
fresh tensor with the full value, its unit gathered by the op (the unit the
graph read before released). This is SimpleFSDP's way (sharding as ops the
graph holds): the module's class gets a property per parameter name, and
state_dict(), named_parameters() and the optimizer keep reading
`module._parameters`, so names and objects are unchanged.

Outside a traced graph the property returns the parameter itself: eager
stage 3 is as before (one Python property read in place of nn.Module's
__getattr__, which parameters went through anyway).

The op's result is saved for backward by no one: a selective activation
checkpoint marks it MUST_RECOMPUTE, so the backward graph reads the weight
again through the op (a gather in backward, as the eager pre-backward hook
does) instead of holding every unit from forward to backward; but for units
kept gathered after forward (reshard_after_forward=False), MUST_SAVE. A unit
resharded to a subgroup (reshard_after_forward=<int>) gathers again from the
whole group in a graph's backward.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, FrozenSet, Optional, Set

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..tools import extend_class


class _GatheredParam(torch.autograd.Function):
    """The parameter's full value; its gradient goes to the parameter (whose
    C++ hook reduces it, as after an eager backward)."""

    @staticmethod
    def forward(ctx: Any, handle: int, index: int, param: torch.Tensor) -> torch.Tensor:
        return torch.ops.zero_ext.gathered_param(handle, index, param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return None, None, grad


# By model handle: the parameters of units kept gathered from forward to
# backward (reshard_after_forward=False): their reads are saved, not recomputed.
_kept_params: Dict[int, FrozenSet[int]] = {}


def _recompute_gathers(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op is torch.ops.zero_ext.gathered_param.default:
        handle, index = args[0], args[1]
        return CheckpointPolicy.MUST_SAVE if index in _kept_params.get(handle, ()) else CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


# torch prints once per process that a context_fn under torch.compile must
# hold no in-place op: this region is the gather alone.
_GATHERS_RECOMPUTED = functools.partial(create_selective_checkpoint_contexts, _recompute_gathers)


def read_in_graph(handle: int, index: int, param: torch.Tensor) -> torch.Tensor:
    """The read of parameter `index` inside a traced graph."""
    return checkpoint(_GatheredParam.apply, handle, index, param, use_reentrant=False,
                      context_fn=_GATHERS_RECOMPUTED)


def _param_property(name: str) -> property:
    def read(self: torch.nn.Module) -> Optional[torch.Tensor]:
        param = self._parameters[name]
        if param is not None and torch.compiler.is_compiling():
            handle, index = self._zero_ext_graph_reads[name]
            return read_in_graph(handle, index, param)
        return param

    return property(read, doc=f"the parameter {name!r}; inside a compiled graph, its gathered value")


def install(model: torch.nn.Module, handle: int, index_of: Dict[int, int], kept: Set[int]) -> None:
    """Gives every module of `model` that holds parameters a property per
    parameter name. `index_of`: id(parameter) -> its index in the core;
    `kept`: the indices of parameters whose units stay gathered from forward
    to backward."""
    if kept:
        _kept_params[handle] = frozenset(kept)
        weakref.finalize(model, _kept_params.pop, handle, None)
    for module in model.modules():
        reads = {name: (handle, index_of[id(p)]) for name, p in module._parameters.items()
                 if p is not None and id(p) in index_of}
        if not reads:
            continue
        names = tuple(sorted(reads))
        extend_class(module, "Stage3", names, {name: _param_property(name) for name in names})
        module.__dict__["_zero_ext_graph_reads"] = reads
