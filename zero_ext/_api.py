"""Public configuration types."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """Compute dtype of parameters and dtype gradients are reduced in.

    The optimizer always updates fp32 master weights.
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: Optional[torch.dtype] = torch.float32
