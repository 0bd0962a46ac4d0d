"""Plain PyTorch mixed precision as the parity references compute it:
MasterWeightReference (fp32 masters stepped for compute-dtype parameters),
ReferenceReduction (each backward's gradient terms caught and summed as
zero_ext must reduce them), and reduced_in, which tells in which dtype the
ranks' gradients were summed."""
from __future__ import annotations

import functools
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from parity_compare import ReducedSum, UNIT_ROUNDOFF, summation_bound


class MasterWeightReference:
    """Plain PyTorch mixed precision, the arithmetic zero_ext's must equal:
    parameters in the compute dtype, fp32 masters stepped by the optimizer
    from the low-precision gradients (divided by the loss scale the loss was
    multiplied by), parameters re-cast after each step; `step(grads)` steps
    from the fp32 gradients given instead (ReferenceReduction's)."""

    def __init__(self, model: nn.Module, make_optimizer, dtype: torch.dtype = torch.bfloat16,
                 loss_scale: float = 1.0):
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        self.loss_scale = loss_scale
        with torch.no_grad():
            for p in self.params:
                p.data = p.data.to(dtype)
        self.opt = make_optimizer(self.masters)

    def step(self, grads: Optional[List[Optional[torch.Tensor]]] = None) -> None:
        if grads is None:
            grads = [None if p.grad is None else p.grad.float() / self.loss_scale for p in self.params]
        for m, g in zip(self.masters, grads):
            m.grad = g
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


class ReferenceReduction:
    """The reference's gradients, reduced as zero_ext reduces them.

    Every gradient term autograd adds into a parameter's .grad (one per use
    of the parameter in each rank's forward) is caught by a hook on the graph
    node that sends it; since the last zero_grad, their exact sum (in fp64,
    whose rounding, 2**-53 of their magnitudes per addition, is negligible),
    the sum of their magnitudes and their count give each recorded gradient
    (ReducedSum). The optimizer steps from what the reduction gives: in fp32,
    the exact sum (to fp32 rounding, as zero_ext's); in the compute dtype,
    each backward's terms summed in it (autograd's own sum, in its order),
    accumulated in fp32 over the backward calls. The parameters' .grad is
    cleared after each backward, so that autograd sums one backward's terms."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, reduce_dtype: torch.dtype, scale: float):
        self.named = list(model.named_parameters())
        self.names = {id(p): n for n, p in self.named}
        self.dtype, self.scale = dtype, scale
        self.in_compute_dtype = reduce_dtype == dtype
        self.clear()

    def clear(self) -> None:
        self.total: Dict[str, torch.Tensor] = {}
        self.magnitude: Dict[str, torch.Tensor] = {}
        self.count: Dict[str, int] = {}
        self.reduced: Dict[str, torch.Tensor] = {}

    def watch(self, loss: torch.Tensor) -> None:
        """Hooks every node of `loss`'s graph that sends a gradient to a parameter."""
        self.backward = ({}, {}, {})  # this backward's total, magnitude, count
        seen, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            into = [(i, self.names[id(nxt.variable)]) for i, (nxt, _) in enumerate(node.next_functions)
                    if nxt is not None and id(getattr(nxt, "variable", None)) in self.names]
            if into:
                node.register_hook(functools.partial(self._add, into))
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    def _add(self, into, grad_inputs, grad_outputs) -> None:
        total, magnitude, count = self.backward
        for i, name in into:
            if grad_inputs[i] is None:
                continue
            term = grad_inputs[i].to(self.dtype).double()  # autograd casts it to the parameter's dtype too
            total[name] = total.get(name, 0.0) + term
            magnitude[name] = magnitude.get(name, 0.0) + term.abs()
            count[name] = count.get(name, 0) + 1

    def backward_done(self) -> None:
        """Takes this backward's terms and autograd's sum of them; clears .grad."""
        total, magnitude, count = self.backward
        for name, p in self.named:
            assert (p.grad is None) == (name not in count), f"{name}: .grad and the terms seen disagree"
            if p.grad is None:
                continue
            # autograd's order is one of those the bound holds for: beyond
            # it, a term was missed or the derivation is wrong.
            bound = summation_bound(count[name], UNIT_ROUNDOFF[self.dtype]) * magnitude[name]
            assert bool(((p.grad.double() - total[name]).abs() <= bound).all()), \
                f"{name}: autograd's sum is beyond the rounding bound of its terms' exact sum"
            if self.in_compute_dtype:  # an fp32 accumulator
                self.reduced[name] = self.reduced.get(name, 0.0) + p.grad.float() / self.scale
            self.total[name] = self.total.get(name, 0.0) + total[name]
            self.magnitude[name] = self.magnitude.get(name, 0.0) + magnitude[name]
            self.count[name] = self.count.get(name, 0) + count[name]
            p.grad = None

    def recorded(self) -> Dict[str, Optional[ReducedSum]]:
        """Each parameter's gradient since the last clear(), divided by the loss
        scale (a power of two: exactly), as compare() takes it."""
        u = UNIT_ROUNDOFF[self.dtype]
        return {n: ReducedSum(value=(self.total[n] / self.scale).float(),
                              bound=(summation_bound(self.count[n], u) * self.magnitude[n] / self.scale).float())
                if n in self.count else None for n, _ in self.named}

    def step_grads(self) -> List[Optional[torch.Tensor]]:
        """What the optimizer steps from: the reduced gradients in fp32, divided by the loss scale."""
        if self.in_compute_dtype:
            return [self.reduced.get(n) for n, _ in self.named]
        return [(self.total[n] / self.scale).float() if n in self.count else None for n, _ in self.named]


# Significant bits of each floating dtype (the implicit leading bit included).
SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def fits_in_bits(t: torch.Tensor, bits: int) -> bool:
    """Whether every element of `t` has at most `bits` significant bits, as
    a value of a dtype with that many does (whatever that dtype's range)."""
    mantissa, _ = torch.frexp(t.double())  # t = mantissa * 2**e, 0.5 <= |mantissa| < 1
    scaled = torch.ldexp(mantissa, torch.tensor(bits))
    return torch.equal(scaled, scaled.round())


def reduced_in(grads: Dict[str, Optional[torch.Tensor]], reduce_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether the ranks' `dtype` gradients of one backward (after zero_grad)
    were summed in `reduce_dtype`. A sum rounded to bf16 or fp16 last holds
    only that dtype's values (the world sizes here divide exactly; fp16's
    loss scale, a power of two, too). Summed in fp32, some of hundreds of
    sums of unrelated terms need more bits than the terms have."""
    reduced = [g for g in grads.values() if g is not None]
    if reduce_dtype != torch.float32:
        return all(fits_in_bits(g, SIGNIFICANT_BITS[reduce_dtype]) for g in reduced)
    return not all(fits_in_bits(g, SIGNIFICANT_BITS[dtype]) for g in reduced)
