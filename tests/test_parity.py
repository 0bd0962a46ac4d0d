"""Every scenario of parity_scenarios.py, stages 0-2, world sizes 1, 2 and 4,
against a single-process reference over the global batch (fp32, tight tolerance).

All scenarios of one world size run inside one group of spawned gloo ranks;
the group's results are cached and reported one test per scenario and stage.
"""
import functools

import pytest

from dist_harness import run_on_ranks
from parity_scenarios import SCENARIOS, stages_of

WORLD_SIZES = (1, 2, 4)


@functools.lru_cache(maxsize=None)
def group_results(world: int):
    try:
        per_rank = run_on_ranks(world, "parity_scenarios:run_all", deadline_s=900)
    except RuntimeError as error:
        return error
    return per_rank


@pytest.mark.parametrize("scenario,stage", [(n, s) for n in SCENARIOS for s in stages_of(n)])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_parity(world, scenario, stage):
    results = group_results(world)
    if isinstance(results, Exception):
        pytest.fail(f"the world-size-{world} group failed: {results}")
    for rank, per_scenario in enumerate(results):
        mismatch = per_scenario[f"{scenario}/stage{stage}"]
        assert mismatch is None, f"rank {rank}: {mismatch}"
