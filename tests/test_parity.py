"""Every scenario of parity_scenarios.py, stages 0-3, world sizes 1, 2 and 4,
against a single-process reference over the global batch (fp32, tight tolerance).

All scenarios of one world size run inside one group of spawned gloo ranks;
a scenario that raises, kills a rank or hangs fails alone: the group is ended
and a fresh one goes on with the next scenario. Results are cached per world
size and reported one test per scenario and stage.
ZERO_EXT_PARITY_WORLDS=1,2 limits the world sizes (the torch-versions subset).
"""
import functools
import os

import pytest

from dist_harness import assert_item_matched, run_items_on_ranks
from parity_scenarios import all_items

WORLD_SIZES = tuple(int(w) for w in os.environ.get("ZERO_EXT_PARITY_WORLDS", "1,2,4").split(","))


@functools.lru_cache(maxsize=None)
def group_results(world: int):
    return run_items_on_ranks(world, "parity_scenarios:run_one", all_items(), item_deadline_s=180)


@pytest.mark.parametrize("item", all_items())
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_parity(world, item):
    result = group_results(world)[item]
    assert_item_matched(world, result)
