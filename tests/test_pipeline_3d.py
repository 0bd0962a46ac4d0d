"""3-D parallelism: dp 2 x tp 2 x pp 2 on 8 gloo ranks (pipeline_scenarios.three_d):
each pipeline stage's blocks made tensor parallel with parallelize_module,
wrapped over mesh["dp"] with pipeline_group=mesh["pp"], trained with 1F1B
and clipped by the whole model's norm, at every stage, against one process;
one DCP checkpoint of every rank read whole by one plain process.

World 8 on 2 cores takes 11-20 s (a tiny model, 3 steps per stage); it
runs in the jobs tier ([Note: the jobs tier] in tests/conftest.py), which
.ci/run runs after the README suite: with it, the README suite took 855 s
of its 900."""
import functools

import pytest

from dist_harness import assert_item_matched, run_items_on_ranks

ITEMS = [f"3d/stage{stage}" for stage in range(4)]


@functools.lru_cache(maxsize=None)
def results():
    return run_items_on_ranks(8, "pipeline_scenarios:three_d", ITEMS, item_deadline_s=300)


@pytest.mark.parametrize("item", ITEMS)
def test_dp_tp_pp_equals_one_process(item):
    assert_item_matched(8, results()[item])
