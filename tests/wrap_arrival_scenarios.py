"""Ranks that never reach zero_ext.wrap(), run by fault_harness.run_with_fault
(tests/test_wrap_arrival.py): one stuck in torch's parallelize_module (a
tensor-parallel plan that differs between ranks), one that died before
wrap(). The ranks waiting at wrap() must end with zero_ext's error naming the
missing rank within the wrap's timeout plus seconds ([Note: arrival at wrap]
in zero_ext/groups/arrival.py), never wait out the process group's timeout.
"""
from __future__ import annotations

import os
import signal

import torch

import zero_ext
from fault_harness import record_fault
from tensor_parallel_scenarios import TPNet


def plan_differs_between_ranks(rank: int, world: int, timeout: float) -> str:
    """Tensor parallel over all `world` ranks (dp 1 x tp world). Rank 0's plan
    covers both blocks, the others' only the first: with torch's default
    src_data_rank=0, rank 0's second block waits in a collective the others
    never issue, while they go on to wrap()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model = TPNet(blocks=2)
    blocks = model.blocks if rank == 0 else model.blocks[:1]
    for block in blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    # Rank 0 never gets here: the others' wait at wrap() starts now.
    record_fault()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    zero_ext.wrap(model, optimizer, stage=2, process_group=mesh["dp"], timeout=timeout)
    return "wrapped"


def dies_before_wrap(rank: int, world: int, victim: int, timeout: float) -> str:
    """`victim` is killed before wrap() (out of memory while loading, say)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == victim:
        record_fault()
        os.kill(os.getpid(), signal.SIGKILL)
    zero_ext.wrap(model, optimizer, stage=2, timeout=timeout)
    return "wrapped"
