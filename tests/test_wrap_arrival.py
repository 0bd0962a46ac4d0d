"""A rank that never reaches zero_ext.wrap(): the ranks waiting there end with
zero_ext's error naming it, within the wrap's timeout plus seconds
([Note: arrival at wrap] in zero_ext/groups/arrival.py), not at the process
group's timeout (120 s in fault_harness) or with gloo's error.

Also, elsewhere: every rank raises zero_ext's error when one reaches wrap()
past the timeout (test_real_models.py, "wrap_reached_late_by_one_rank"), and
ranks that reach it seconds apart within the timeout train as one process
does (test_parity.py, "ranks_reach_wrap_seconds_apart").
"""
import pytest

from fault_harness import run_with_fault

TIMEOUT = 4.0  # the wrap's timeout: the bound on waiting for the other ranks at wrap()
BOUND = TIMEOUT + 10.0  # from the fault to the waiting ranks' exit, on a loaded machine


def report(case, ends):
    times = ", ".join(f"rank {e.rank}: {e.seconds_after_fault:.2f} s" for e in ends
                      if e.seconds_after_fault is not None)
    print(f"\n{case}: exit after the fault: {times}")


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_stuck_in_parallelize_module_is_named_at_wrap(world):
    """Rank 0 waits inside parallelize_module for a collective the other
    ranks, whose plan is shorter, never issue; they wait at wrap() and name
    it. (Rank 0 then ends with torch's error once they are gone: zero_ext
    cannot reach into torch's collective.) Over a TCPStore, as torchrun's."""
    ends = run_with_fault(world, "wrap_arrival_scenarios:plan_differs_between_ranks", (TIMEOUT,),
                          deadline_s=BOUND + 30, store="tcp")
    report(f"world {world}, rank 0 stuck in parallelize_module", ends)
    assert all(e.exitcode is not None for e in ends), "a rank hung"
    for e in ends[1:]:
        assert e.exitcode == 1 and e.error is not None, (e.rank, e.exitcode, e.result)
        assert e.error.startswith("RuntimeError: zero_ext.wrap: rank 0 has not reached zero_ext.wrap within 4 s"), \
            e.error
        assert "still inside the model's set-up (e.g. parallelize_module" in e.error, e.error
        assert e.seconds_after_fault is not None and TIMEOUT - 0.5 < e.seconds_after_fault < BOUND, \
            (e.rank, e.seconds_after_fault)


@pytest.mark.parametrize("victim,store", [(1, "file"), (0, "tcp")])
def test_a_rank_that_died_before_wrap_is_named_or_its_store_is(victim, store):
    """A rank killed before wrap(): the others name it at the timeout; if it
    hosted the TCPStore (rank 0 under torchrun), they say the store is gone,
    at once."""
    ends = run_with_fault(2, "wrap_arrival_scenarios:dies_before_wrap", (victim, TIMEOUT), deadline_s=BOUND + 30,
                          store=store)
    report(f"rank {victim} killed before wrap ({store} store)", ends)
    assert ends[victim].exitcode == -9
    survivor = ends[1 - victim]
    assert survivor.exitcode == 1 and survivor.error is not None, (survivor.exitcode, survivor.result)
    if victim == 1:
        assert survivor.error.startswith("RuntimeError: zero_ext.wrap: rank 1 has not reached zero_ext.wrap"), \
            survivor.error
        assert "or stopped" in survivor.error
        # The bound runs from the survivor's own arrival, which may come before the victim's death.
        assert TIMEOUT / 2 < survivor.seconds_after_fault < BOUND, survivor.seconds_after_fault
    else:
        assert survivor.error.startswith("RuntimeError: zero_ext.wrap: waiting for every rank to reach "
                                         "zero_ext.wrap, the rendezvous store"), survivor.error
        assert survivor.seconds_after_fault < BOUND, survivor.seconds_after_fault
