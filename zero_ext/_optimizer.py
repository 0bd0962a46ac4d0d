"""The user's optimizer, re-pointed in place at this rank's shards.

The optimizer object, its class, its param_groups' hyperparameters and any LR
scheduler already attached to it all stay; what changes:
  - stages 1-3: each group's "params" become views of this rank's shard of the
    flat buckets, cut at parameter boundaries ("segments"), so per-parameter
    semantics hold exactly: a parameter with no gradient on any rank has
    grad None and is skipped, with its own step count, as in PyTorch;
  - step() is followed by an all-gather of the updated shards (a post hook,
    so a scheduler that wrapped step() before wrap() still triggers it);
  - zero_grad() and clip_grad_norm_() act on zero_ext's gradients.
"""
from __future__ import annotations

import math
from typing import Dict, List

import torch
import torch.distributed as dist

# torch.optim optimizers whose update of an element depends only on that
# element's gradient and state: they can run on any slice of a parameter.
ELEMENTWISE_OPTIMIZERS = {
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam",
    "RAdam", "RMSprop", "Rprop",
}


def check_elementwise(optimizer: torch.optim.Optimizer, stage: int) -> None:
    if stage == 0:
        return
    cls = type(optimizer)
    if getattr(cls, "zero_ext_elementwise", False):
        return
    if cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE_OPTIMIZERS:
        return
    raise TypeError(
        f"zero_ext stage {stage} shards the optimizer elementwise, and {cls.__name__} is not "
        f"known to update each element independently (LBFGS, Adafactor, Muon, LAMB and "
        f"SparseAdam are not). Use stage=0, or, if {cls.__name__} really is elementwise, set "
        f"`{cls.__name__}.zero_ext_elementwise = True` before wrap()."
    )


class ZeroExtOptimizer:
    """Mixin placed in front of the user's optimizer class by wrap()."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_ext.buckets.zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the global gradient (every rank's shards) in place and returns
        its total norm before clipping, like torch.nn.utils.clip_grad_norm_."""
        state = self._zero_ext
        norm_type = float(norm_type)
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        device = state.device
        if not grads:
            local = torch.zeros((), device=device)
        elif math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in grads]).max().float()
        else:
            norms = torch._foreach_norm(grads, norm_type)
            local = torch.stack(norms).float().pow(norm_type).sum()
        if state.stage >= 1 and state.process_group is not None and state.world_size > 1:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            dist.all_reduce(local, op=op, group=state.process_group)
        total = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
        clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if grads:
            torch._foreach_mul_(grads, clip_coef.to(grads[0].dtype))
        return total


_wrapped_classes: Dict[type, type] = {}


def shard_optimizer(optimizer: torch.optim.Optimizer, state, ordered_params: List[torch.Tensor],
                    group_of: Dict[int, int]) -> None:
    """Re-points `optimizer` at this rank's segments and installs the hooks."""
    if state.stage >= 1:
        segments = state.buckets.segments()
        owners = state.buckets.segment_param_indices()
        per_group: List[List[torch.Tensor]] = [[] for _ in optimizer.param_groups]
        for segment, owner in zip(segments, owners):
            per_group[group_of[id(ordered_params[owner])]].append(segment)
        for group, params in zip(optimizer.param_groups, per_group):
            group["params"] = params
        optimizer.state.clear()

    cls = type(optimizer)
    if cls not in _wrapped_classes:
        _wrapped_classes[cls] = type(f"ZeroExt{cls.__name__}", (ZeroExtOptimizer, cls), {})
    optimizer.__class__ = _wrapped_classes[cls]
    optimizer._zero_ext = state

    def before_step(opt, args, kwargs) -> None:
        state.check_parameters_unchanged()
        state.buckets.check_before_step()

    def after_step(opt, args, kwargs) -> None:
        state.buckets.after_step()

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
