"""Every phase of zero_ext is labelled in a torch.profiler trace: the
reduction of each bucket, the epilogue, the step and (stage 3) the gather of
each unit (profiler_scenarios.py), at world size 2."""
import functools

import pytest

from dist_harness import assert_item_matched, run_items_on_ranks
from profiler_scenarios import all_items


@functools.lru_cache(maxsize=None)
def results():
    return run_items_on_ranks(2, "profiler_scenarios:run_one", all_items(), item_deadline_s=120)


@pytest.mark.parametrize("item", all_items())
def test_zero_ext_phases_are_labelled_in_a_trace(item):
    assert_item_matched(2, results()[item])
