"""Every phase of zero_ext is labelled in a torch.profiler trace: the
reduction of each bucket, the epilogue, the step and (stage 3) the gather of
each unit; and a trace with Python stacks (with_stack=True) leaves training
exactly as it is (profiler_scenarios.py), at world size 2."""
import functools

import pytest

from dist_harness import assert_item_matched, run_items_on_ranks
from profiler_scenarios import LABEL_ITEMS, STACK_ITEMS, all_items


@functools.lru_cache(maxsize=None)
def results():
    return run_items_on_ranks(2, "profiler_scenarios:run_one", all_items(), item_deadline_s=120)


@pytest.mark.parametrize("item", LABEL_ITEMS)
def test_zero_ext_phases_are_labelled_in_a_trace(item):
    assert_item_matched(2, results()[item])


# torch's Python tracer reads each called module's own parameters and their
# .grad: a stage 3 parameter between uses and a sharded gradient's stand-in
# in .grad are unreadable ([Note: parameters under torch's Python tracer]).
@pytest.mark.parametrize("item", STACK_ITEMS)
def test_a_trace_with_python_stacks_changes_nothing(item):
    assert_item_matched(2, results()[item])
