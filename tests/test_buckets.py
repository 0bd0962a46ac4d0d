"""Gradient bucket planning (zero_ext/wrapping/buckets.py): reverse
registration order, one dtype per bucket, and a small first bucket, as DDP's
reducer makes it, so a reduction starts early in backward."""
import torch
import torch.nn as nn

import zero_ext
from zero_ext.wrapping.buckets import FIRST_BUCKET_BYTES, plan_buckets

MiB = 1 << 20


def layers(n: int, width: int = 256) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(n)))  # 257 KiB of fp32 each


def test_first_bucket_closes_at_one_mib_then_bucket_mb():
    model = layers(12)  # 3 MiB in all, under a 25 MiB bucket
    params = list(model.parameters())
    ordered, counts = plan_buckets(params, 25 * MiB)
    assert ordered == params[::-1]  # the order backward produces them
    sizes = []
    first = 0
    for count in counts:
        sizes.append(sum(p.numel() * p.element_size() for p in ordered[first:first + count]))
        first += count
    assert len(sizes) == 2, sizes
    assert FIRST_BUCKET_BYTES <= sizes[0] < FIRST_BUCKET_BYTES + 257 * 1024 + 1024, sizes  # the layer that crossed 1 MiB
    # A bucket_mb below 1 MiB caps the first bucket too; first_bucket_bytes can be raised.
    assert len(plan_buckets(params, 256 * 1024)[1]) == len(plan_buckets(params, 256 * 1024, 25 * MiB)[1])
    assert plan_buckets(params, 25 * MiB, first_bucket_bytes=25 * MiB)[1] == [len(params)]


def test_wrapped_model_has_the_small_first_bucket():
    model = layers(12)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zero_ext.wrap(model, opt, stage=2, bucket_mb=25)
    layout = model._zero_ext.handles.reduction.bucket_layout()  # (first, count, padded) per bucket
    padded = layout[2::3]
    assert len(padded) == 2 and padded[0] * 4 < 2 * MiB <= padded[1] * 4, padded
