"""Rank-side halves of tests/test_hybrid.py: what wrap() refuses in a
DeviceMesh."""
from __future__ import annotations

from typing import Dict

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import zero_ext
from parity_scenarios import Net, adamw, device_mesh


def _refusal(mesh) -> str:
    model = Net()
    try:
        zero_ext.wrap(model, adamw(model), stage=2, process_group=mesh)
    except ValueError as e:
        return str(e)
    return "accepted"


def mesh_refusals(rank: int, world: int) -> Dict[str, str]:
    """Each bad mesh raises ValueError on every rank, before any
    collective (a rank that went on would hang in the next one)."""
    return {
        "3-D": _refusal(init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))),
        "shard dim first": _refusal(init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))),
        "rows not in rank order": _refusal(DeviceMesh("cpu", [[1, 0], [3, 2]])),
        # A usable mesh after the refusals: nothing was left half done.
        "then a good one": _refusal(device_mesh(2, 2)),
    }
