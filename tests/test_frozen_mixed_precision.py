"""Frozen floating-point parameters under mixed precision compute in the
compute dtype at every stage (LoRA in bf16): every scenario of
frozen_mixed_precision_scenarios.py at stages 0-3, world sizes 2 and 4, against
a single-process reference over the global batch; all scenarios of one world
size run in one group of spawned gloo ranks (see tests/test_parity.py); one
scenario also over a 2x2 (replicate, shard) mesh at world size 4.
ZERO_EXT_FROZEN_MP_WORLDS=2 limits the world sizes."""
import functools
import os

import pytest
import torch

import zero_ext
from dist_harness import assert_item_matched, run_items_on_ranks
from frozen_mixed_precision_scenarios import LoRANet, all_items

WORLD_SIZES = tuple(int(w) for w in os.environ.get("ZERO_EXT_FROZEN_MP_WORLDS", "2,4").split(","))


@functools.lru_cache(maxsize=None)
def group_results(world: int):
    return run_items_on_ranks(world, "frozen_mixed_precision_scenarios:run_one", all_items(world),
                              item_deadline_s=180)


@pytest.mark.parametrize("world,item", [(world, item) for world in WORLD_SIZES for item in all_items(world)])
def test_frozen_mixed_precision(world, item):
    assert_item_matched(world, group_results(world)[item])


def _lora(stage: int, mixed_precision):
    model = LoRANet()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return zero_ext.wrap(model, opt, stage=stage, mixed_precision=mixed_precision, bucket_mb=0.0005)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_without_mixed_precision_frozen_parameters_stay_outside_the_buckets(stage):
    """fp32 compute: nothing to cast, so frozen weights stay plain fp32
    tensors outside zero_ext's buckets, as before."""
    model, _ = _lora(stage, None)
    bucketed = {id(p) for p in model._zero_ext.bucketed}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and not any(id(p) in bucketed for p in frozen)
    assert all(p.dtype == torch.float32 for p in frozen)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_buckets_never_mix_with_trainable_ones(stage):
    """Under mixed precision frozen weights are bucketed in buckets of their
    own outside stage 3 (stage 3 buckets by unit), so no reduction carries them."""
    model, _ = _lora(stage, "bf16")
    state = model._zero_ext
    layout = state.handles.reduction.bucket_layout()
    kinds = [{state.bucketed[i].requires_grad for i in range(first, first + count)}
             for first, count in zip(layout[0::3], layout[1::3])]
    assert len(state.bucketed) == len(list(model.parameters()))
    if stage != 3:
        assert all(len(k) == 1 for k in kinds), kinds
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
