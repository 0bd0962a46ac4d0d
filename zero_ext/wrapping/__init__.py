"""wrap() and what it plans before training starts: the arguments and the
launch, the ranks' agreement on the model, stage 3 units, gradient buckets,
deferred (meta) initialization, and the configuration types."""
from __future__ import annotations

from .arguments import check_stage
from .config import DynamicLossScale, MixedPrecision
from .deferred_init import empty_init, skip_init
from .wrap import wrap

__all__ = ["DynamicLossScale", "MixedPrecision", "check_stage", "empty_init", "skip_init", "wrap"]
