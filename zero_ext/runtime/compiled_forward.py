"""The root module's hooks inside a graph torch.compile traces (stages 0-2).

Eagerly, zero_ext's hooks run outside any graph (`outside_compile`): the
model's begin_forward and end_forward are calls into the C++ core, and
end_forward hooks the gradients of the model's outputs to learn when a
backward reaches the model. While Dynamo traces a wrapped model (a whole
`torch.compile(model)`, `fullgraph=True` included), the root hooks take this
path instead, so that zero_ext puts no graph break in the model's forward:

- `zero_ext::begin_forward(handle, grad)` and `zero_ext::end_forward(handle)`,
  registered ops the graph calls at run time, in place of the core calls
  (`grad`: grad mode at trace time; the compiled forward runs under no_grad);
- each output that requires grad passes through `_BackwardBegins`, whose
  backward calls `zero_ext::backward_begins(handle, grad)` in the backward
  graph: the epilogue is armed there, as the eager output hook does.

Gradients still reach zero_ext through the C++ hooks on the parameters'
gradient accumulators, which run after the compiled backward as they do
after an eager one. See [Note: the model's forward in a compiled graph] in
csrc/core_ops.cpp for why the ops take an int and why backward_begins reads
the gradient.

Under fp16 loss scaling the outputs pass through `_ScaledBackwardBegins`
instead: fp16 outputs leave the model in fp32, and the backward calls
`zero_ext::scale_output_grad(handle, grad, dtype)`, which arms the epilogue
and returns the gradient times the loss scale of that moment, as the eager
LossScaleBoundary (csrc/autograd_boundaries.cpp) does.

At stage 3 the units' hooks do nothing in a graph: each read of a parameter
there is zero_ext's gather op (runtime/compiled_units.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map_only

from . import compiled_units

_OPS = ("begin_forward", "end_forward", "backward_begins", "scale_output_grad", "grad_arrived", "hand_over_grad",
        "backward_over")


def _mark_side_effects() -> None:
    """No graph pass may drop these ops: what they do is on the model, not on
    a tensor the graph sees (most return nothing; a gradient handed over is
    taken even where the graph drops what the op returns, as compiled
    autograd's graph does once a hook drops the engine's copy)."""
    from torch.fx.node import has_side_effect

    for name in _OPS:
        has_side_effect(getattr(torch.ops.zero_ext, name).default)


_mark_side_effects()


class _BackwardBegins(torch.autograd.Function):
    """The identity; its backward tells the model (by handle) that a
    backward reached its output, then passes the gradient on."""

    @staticmethod
    def forward(ctx: Any, handle: int, output: torch.Tensor) -> torch.Tensor:
        ctx.handle = handle
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        torch.ops.zero_ext.backward_begins(ctx.handle, grad)
        return None, grad


class _ScaledBackwardBegins(torch.autograd.Function):
    """fp16 with loss scaling: an fp16 output leaves in fp32; the backward
    arms the epilogue and scales the gradient by the loss scale."""

    @staticmethod
    def forward(ctx: Any, handle: int, output: torch.Tensor) -> torch.Tensor:
        ctx.handle, ctx.dtype = handle, output.dtype
        return output.float() if output.dtype == torch.float16 else output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return None, torch.ops.zero_ext.scale_output_grad(ctx.handle, grad, ctx.dtype)


def pre_forward(handle: int, cast_to: Optional[torch.dtype], args: tuple, kwargs: dict) -> Any:
    """The root pre-forward hook's work in a traced graph."""
    torch.ops.zero_ext.begin_forward(handle, torch.is_grad_enabled(), compiled_units.reads_detached())
    compiled_units.open_reads(handle)
    if cast_to is None:
        return None
    return tree_map_only(torch.Tensor, lambda t: t.to(cast_to) if t.is_floating_point() else t, (args, kwargs))


def post_forward(handle: int, output_dtype: Optional[torch.dtype], scales_loss: bool, output: Any) -> Any:
    """The root forward hook's work in a traced graph: the outputs that
    require grad (with grad enabled) through _BackwardBegins (or, with
    `scales_loss`, _ScaledBackwardBegins), then the model's end_forward;
    floating outputs cast to `output_dtype`."""
    if torch.is_grad_enabled():
        boundary = _ScaledBackwardBegins if scales_loss else _BackwardBegins
        output = tree_map_only(torch.Tensor, lambda t: boundary.apply(handle, t) if t.requires_grad else t, output)
    torch.ops.zero_ext.end_forward(handle)
    compiled_units.forget_reads(handle)
    if output_dtype is not None:
        output = tree_map_only(torch.Tensor, lambda t: t.to(output_dtype) if t.is_floating_point() else t, output)
    return output
