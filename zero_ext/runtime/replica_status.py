"""zero_ext.replica_status(model): where a model's replicas stand
([Note: a step across replicas] in groups/replicas.py)."""
from __future__ import annotations

from typing import Any, Dict

import torch

from ..tools import require_module, state_of


def replica_status(model: torch.nn.Module) -> Dict[str, Any]:
    """{"step": optimizer steps the model has taken (a replica that joined
    reports its peer's), "live": the replica ids of the last quorum,
    "contributed": {step: the replica ids whose gradients it averaged}}
    for at least the last 100 steps. Local: no collective. A model wrapped
    without replicas raises ValueError."""
    require_module(model, "zero_ext.replica_status", "zero_ext.replica_status(model)")
    replicas = state_of(model).replica_set
    if replicas is None:
        raise ValueError("zero_ext.replica_status: the model was wrapped without replicas=zero_ext.Replicas(...)")
    return replicas.status()
