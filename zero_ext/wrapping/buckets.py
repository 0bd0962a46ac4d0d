"""Which parameters share a gradient bucket, decided once at wrap time."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch


# The first bucket to fill is small, as DDP's reducer makes it
# (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES): its reduction starts
# while backward has most of its work ahead, instead of waiting for a whole
# bucket_mb of gradients (a model smaller than bucket_mb would otherwise
# reduce nothing before backward ends).
FIRST_BUCKET_BYTES = 1 << 20


def plan_buckets(
    params: Sequence[torch.nn.Parameter],
    bucket_bytes: int,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
) -> Tuple[List[torch.nn.Parameter], List[int]]:
    """Groups parameters into buckets of about `bucket_bytes`.

    Parameters are taken in reverse registration order, the order backward
    usually produces their gradients, so early buckets fill first. A bucket
    holds one dtype on one device; param groups need no buckets of their own,
    since the optimizer steps per-parameter views of the shard. Returns the
    parameters in bucket order and the number of parameters in each bucket.
    The first bucket closes at min(first_bucket_bytes, bucket_bytes).
    """
    open_buckets: Dict[tuple, List[torch.nn.Parameter]] = {}
    open_bytes: Dict[tuple, int] = {}
    closed: List[Tuple[int, List[torch.nn.Parameter]]] = []
    opened_at: Dict[tuple, int] = {}
    for position, p in enumerate(reversed(list(params))):
        key = (p.dtype, p.device)
        if key not in open_buckets:
            open_buckets[key] = []
            open_bytes[key] = 0
            opened_at[key] = position
        open_buckets[key].append(p)
        open_bytes[key] += p.numel() * p.element_size()
        if open_bytes[key] >= (min(first_bucket_bytes, bucket_bytes) if not closed else bucket_bytes):
            closed.append((opened_at[key], open_buckets.pop(key)))
            del open_bytes[key]
    for key, bucket in open_buckets.items():
        closed.append((opened_at[key], bucket))
    closed.sort(key=lambda item: item[0])
    ordered = [p for _, bucket in closed for p in bucket]
    return ordered, [len(bucket) for _, bucket in closed]
