"""A wrapped model's parameters inside a graph torch.compile traces: each read
of a parameter is zero_ext's autograd function, whose backward hands the
read's gradient to zero_ext inside the backward graph ([Note: gradients
handed over in the graph] in csrc/sharded_model_graph.cpp), so buckets go out
while the compiled backward runs; at stage 3 its forward is zero_ext's
gather op ([Note: stage 3 in a compiled graph] in csrc/units_graph.cpp).

Eagerly, a unit's hooks gather it into the parameters' own storage before
its forward and release it after. A traced graph takes the parameters as its
inputs and cannot see a hook change what they point at; so there, reading
`module.weight` gives `zero_ext::gathered_param(handle, index, weight)`: a
fresh tensor with the full value, its unit gathered by the op (and released
once each of its parameters was read, or when the graph reads another unit). This is SimpleFSDP's way (sharding as ops the
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

from ..tools import extend_class, traced_only_inline


class _ParamRead(torch.autograd.Function):
    """A read of parameter `index` in a graph: its full value (stage 3: the
    gather op's fresh tensor; else the parameter itself). Its backward hands
    the read's gradient to zero_ext inside the graph ([Note: gradients handed
    over in the graph] in csrc/sharded_model_graph.cpp)."""

    @staticmethod
    def forward(ctx: Any, handle: int, index: int, param: torch.Tensor, gather: bool,
                anchor: Optional[torch.Tensor] = None) -> torch.Tensor:
        ctx.handle, ctx.index, ctx.anchored = handle, index, anchor is not None
        if gather:
            return torch.ops.zero_ext.gathered_param(handle, index, param)
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        if ctx.anchored:  # compiled autograd: `param` came detached; the token goes to the anchor
            return None, None, None, None, torch.ops.zero_ext.hand_over_grad(ctx.handle, ctx.index, grad)
        return None, None, torch.ops.zero_ext.grad_arrived(ctx.handle, ctx.index, grad), None, None


# By model handle: the anchor of its reads under compiled autograd ([Note:
# compiled autograd] in csrc/sharded_model_graph.cpp): a CPU scalar leaf
# every read takes as an input, whose gradient (the reads' tokens, summed)
# arrives once every read's gradient was handed over; its hook then ends
# the backward (zero_ext::backward_over).
_anchors: Dict[int, torch.Tensor] = {}


@torch.library.register_fake("zero_ext::hand_over_grad")
def _hand_over_grad_fake(model: int, index: int, grad: torch.Tensor) -> torch.Tensor:
    return grad.new_empty((), dtype=torch.float32, device="cpu")


@torch.library.register_fake("zero_ext::backward_over")
def _backward_over_fake(model: int, tokens: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tokens)


def _backward_over(handle: int, tokens: torch.Tensor) -> torch.Tensor:
    """The anchor's hook. Inside compiled autograd's graph it ends the
    backward; run by the engine itself (the forward was traced with compiled
    autograd on, its backward run without), the engine's callback does, as
    after any eager backward, once the parameters' nodes ran too."""
    from torch._dynamo import compiled_autograd

    if compiled_autograd.in_compiled_autograd_region:
        return torch.ops.zero_ext.backward_over(handle, tokens)
    return tokens


def _make_anchor(handle: int) -> torch.Tensor:
    anchor = torch.zeros((), requires_grad=True)
    # Its gradient defined from the start, as after any backward: compiled
    # autograd keys its graph on it, and would trace the second step again.
    anchor.grad = torch.zeros(())
    anchor.register_hook(functools.partial(_backward_over, handle))
    return anchor


def reads_detached() -> bool:
    """Whether reads traced now are detached, anchored ones: the backward of
    what is being traced will be compiled autograd's (torch.compile turns it
    on around each call of a function compiled while
    torch._dynamo.config.compiled_autograd was set)."""
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.compiled_autograd_enabled)


# By model handle: the parameters of units kept gathered from forward to
# backward (reshard_after_forward=False, and the root unit): their reads are
# saved, not recomputed.
_kept_params: Dict[int, FrozenSet[int]] = {}


def _recompute_gathers(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op is torch.ops.zero_ext.gathered_param.default:
        handle, index = args[0], args[1]
        return CheckpointPolicy.MUST_SAVE if index in _kept_params.get(handle, ()) else CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


# torch prints once per process that a context_fn under torch.compile must
# hold no in-place op: this region is the gather alone.
_GATHERS_RECOMPUTED = functools.partial(create_selective_checkpoint_contexts, _recompute_gathers)


# By model handle, within one traced forward of the model: what each
# parameter's first read returned. Later reads (a weight tied to another
# module, a block run twice) reuse it, so the backward graph sums the
# parameter's gradient before handing it over once, as the engine sums it
# before AccumulateGrad: two hand-overs could reduce apart and round apart.
# Opened and dropped by the model's traced pre- and post-forward hooks
# (open_reads, forget_reads), so it holds nothing after the forward. A graph
# of a part of the model (each block compiled) opens none: there each read
# hands its gradient over on its own (the core sums them, reducing a
# gradient that comes after its bucket went out in a second round).
_reads: Dict[int, Dict[int, torch.Tensor]] = {}


def read_in_graph(handle: int, index: int, param: torch.Tensor, gather: bool) -> torch.Tensor:
    """The read of parameter `index` inside a traced graph (`gather`: stage 3)."""
    reads = _reads.get(handle)
    value = reads.get(index) if reads is not None else None
    if value is None:
        anchor = _anchors.get(handle) if reads_detached() else None
        if anchor is not None:
            param = param.detach()  # no AccumulateGrad of the parameter in compiled autograd's graph
        if gather:
            value = checkpoint(_ParamRead.apply, handle, index, param, True, anchor, use_reentrant=False,
                               context_fn=_GATHERS_RECOMPUTED)
        else:
            value = _ParamRead.apply(handle, index, param, False, anchor)
        if reads is not None:
            reads[index] = value
    return value


def open_reads(handle: int) -> None:
    _reads[handle] = {}


def forget_reads(handle: int) -> None:
    _reads.pop(handle, None)


def _param_property(name: str) -> property:
    def read(self: torch.nn.Module) -> Optional[torch.Tensor]:
        param = self._parameters[name]
        if param is not None and torch.compiler.is_compiling():
            handle, index, gather = self._zero_ext_graph_reads[name]
            return read_in_graph(handle, index, param, gather)
        return param

    # Eager code (a frame Dynamo left eager) reads the parameter itself, as
    # its unit's eager hooks gathered it; never a graph of one read.
    return property(traced_only_inline(read), doc=f"the parameter {name!r}; inside a compiled graph, its read")


def install(model: torch.nn.Module, handle: int, index_of: Dict[int, int], gather: bool, kept: Set[int]) -> None:
    """Gives every module of `model` that holds parameters a property per
    parameter name. `index_of`: id(parameter) -> its index in the core;
    `gather`: stage 3 (reads gather); `kept`: the indices of parameters whose
    units stay gathered from forward to backward."""
    if kept:
        _kept_params[handle] = frozenset(kept)
        weakref.finalize(model, _kept_params.pop, handle, None)
    _anchors[handle] = _make_anchor(handle)
    weakref.finalize(model, _anchors.pop, handle, None)
    for module in model.modules():
        reads = {name: (handle, index_of[id(p)], gather) for name, p in module._parameters.items()
                 if p is not None and id(p) in index_of}
        if not reads:
            continue
        names = tuple(sorted(reads))
        extend_class(module, "GraphReads", names, {name: _param_property(name) for name in names})
        module.__dict__["_zero_ext_graph_reads"] = reads
