"""Typed wrapper over the C++ CPU Adam/AdamW kernel (torch.ops.zero_ext.adam_step_)."""
from __future__ import annotations

from typing import Optional

import torch

from ..tools import core_loader  # noqa: F401  (registers the op)


def adam_step_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
    weight_decay: float = 0.0, decoupled_weight_decay: bool = True, amsgrad: bool = False,
    maximize: bool = False, max_exp_avg_sq: Optional[torch.Tensor] = None,
    param_lowp: Optional[torch.Tensor] = None,
) -> None:
    """One Adam (decoupled_weight_decay=False) or AdamW step, in place, on
    contiguous fp32 CPU tensors; `step` counts from 1 and includes this one.
    If `param_lowp` (bf16/fp16) is given it receives the updated parameter."""
    torch.ops.zero_ext.adam_step_(
        param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_lowp, lr, beta1, beta2, eps,
        weight_decay, step, decoupled_weight_decay, amsgrad, maximize,
    )
