"""Rank side of tests/test_reduction.py: what stages 2-3 hold as the reduced
gradient over gloo, against the sum one process computes over the ranks'
gradients."""
from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_ext


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Two buckets (a 1 MiB first one) and shards that split parameters.
    return nn.Sequential(nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 200), nn.Tanh(), nn.Linear(200, 8))


def _batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)


def reduced_is_the_sum_over_ranks(rank: int, world: int) -> Dict[str, List[int]]:
    """{configuration: [elements that differ, elements]} for stages 2 and 3,
    fp32 and bf16 reductions: the reduced gradient must be, bit for bit, the sum
    over the ranks' (pre-divided) gradients in rank order, as
    torch.stack(...).sum(0) computes it in one process."""
    x, y = _batch(rank)
    plain = _model()
    F.mse_loss(plain(x), y).backward()
    local = {n: p.grad for n, p in plain.named_parameters()}
    out: Dict[str, List[int]] = {}
    for reduce_dtype in (torch.float32, torch.bfloat16):
        expected = {}
        for name, grad in local.items():
            every = [torch.empty_like(grad) for _ in range(world)]
            dist.all_gather(every, grad)
            expected[name] = torch.stack([g.to(reduce_dtype) / world for g in every]).sum(0).float()
        for stage in (2, 3):
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            precision = None if reduce_dtype == torch.float32 else zero_ext.MixedPrecision(
                param_dtype=torch.float32, reduce_dtype=reduce_dtype)
            model, opt = zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision, bucket_mb=2)
            F.mse_loss(model(x), y).backward()
            grads = zero_ext.full_grads(model)
            differ = sum(int((grads[n] != expected[n]).sum()) for n in expected)
            out[f"stage {stage} {str(reduce_dtype)[6:]}"] = [differ, sum(e.numel() for e in expected.values())]
            del model, opt
    return out
