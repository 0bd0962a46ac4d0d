"""torch.compile over a wrapped model at world size 2, stages 0-3: each
block compiled with no graph break, and the whole model compiled, train
like the same model run eagerly (compile_scenarios.py)."""
import functools

import pytest

from compile_scenarios import all_items
from dist_harness import assert_item_matched, run_items_on_ranks

WORLD = 2


@functools.lru_cache(maxsize=None)
def results():
    return run_items_on_ranks(WORLD, "compile_scenarios:run_one", all_items(), item_deadline_s=240)


@pytest.mark.parametrize("item", all_items())
def test_compiled_model_trains_like_eager(item):
    assert_item_matched(WORLD, results()[item])
