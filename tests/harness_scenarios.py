"""Items for test_harness.py: each ends with a collective, like a real scenario."""
import os
import time

import torch
import torch.distributed as dist


def run_item(rank: int, world: int, item: str) -> str:
    if item == "raise-on-rank-1" and rank == 1:
        raise ValueError("planted")
    if item == "large-result":
        # A result the rank cannot have written out whole before the next item
        # kills it: the harness must still count it, not blame it for the death.
        dist.all_reduce(torch.ones(1))
        return "x" * (8 << 20)
    if item == "kill-rank-0" and rank == 0:
        os._exit(7)
    if item == "hang" and rank == 0:
        time.sleep(3600)
    flag = torch.ones(1)
    dist.all_reduce(flag)  # a peer that failed leaves this waiting: the harness must end it
    return f"{item} on {rank}"
