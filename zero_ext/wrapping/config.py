"""Public configuration types."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass(frozen=True)
class DynamicLossScale:
    """fp16 loss scaling that adapts: a step whose gradients hold inf/nan on
    any rank is skipped and the scale multiplied by `backoff_factor` (after
    `hysteresis` such steps in a row); after `growth_interval` clean steps in
    a row it is multiplied by `growth_factor`. Defaults follow DeepSpeed's
    (initial_scale_power=16, loss_scale_window=1000, min_loss_scale=1), with
    hysteresis 1 so every overflow lowers the scale, as torch.amp.GradScaler does.
    """

    initial_scale: float = 2.0 ** 16
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    hysteresis: int = 1


@dataclass(frozen=True)
class MixedPrecision:
    """Compute dtype of parameters and dtype gradients are reduced in.

    The optimizer always updates fp32 master weights.

    loss_scale: fp16 only. None (the default) scales dynamically with
    DynamicLossScale(); a DynamicLossScale to tune it; a number for a static
    scale (overflowing steps are still skipped). 1.0 turns zero_ext's own
    scaling off, for loops that drive torch.amp.GradScaler themselves.

    cast_forward_inputs: floating tensors passed to the model are cast to
    `param_dtype` on the way in (as FSDP2 and DeepSpeed do), so an fp32 batch
    meets low-precision weights. That casts every floating argument, targets
    included: a loss computed inside forward() from an fp32 output and a cast
    target mixes dtypes, which torch releases before 2.13 cannot
    differentiate for some losses (mse_loss: "Found dtype Half but expected
    Float"). Pass False to hand the model its inputs untouched (cast the
    batch yourself).
    output_dtype: floating tensors the model's forward returns are cast to
    it (FSDP2's MixedPrecisionPolicy.output_dtype), e.g. torch.float32 for a
    loss computed outside the model in fp32. None (the default) leaves them
    in whatever dtype the model computed.
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: Optional[torch.dtype] = torch.float32
    loss_scale: Union[None, float, DynamicLossScale] = None
    cast_forward_inputs: bool = True
    output_dtype: Optional[torch.dtype] = None
