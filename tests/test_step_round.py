"""StepRound (zero_ext/optim/step_round.py) alone, with a core that records
what it is asked: one decision per round of a model's optimizers, taken by
the first to step and followed by the others; a zero_grad that waits for the
round to close; and the rounds that a repeated step, a zero_grad that never
ran, or a failed decision leave. The optimizers call it as ZeroExtOptimizer
does: decide(), then stepped() whatever happened."""
import types

import pytest

from zero_ext.optim.step_round import StepRound


class RecordingCore:
    """begin_step answers from `decisions` (True: skip; an exception: raised)."""

    def __init__(self, *decisions) -> None:
        self.decisions = list(decisions)
        self.calls = []

    def begin_step(self):
        self.calls.append("begin_step")
        decision = self.decisions.pop(0)
        if isinstance(decision, Exception):
            raise decision
        return decision

    def zero_grad(self, set_to_none: bool) -> None:
        self.calls.append(f"zero_grad({set_to_none})")


def joined(core: RecordingCore, count: int):
    # The core's handles (tools/core_handles.py): the step decision and zero_grad, recorded in one list.
    step_round = StepRound(types.SimpleNamespace(optimizer=core, reduction=core))
    optimizers = [types.SimpleNamespace() for _ in range(count)]
    for optimizer in optimizers:
        step_round.join(optimizer)
    return step_round, optimizers


def step(step_round: StepRound, optimizer):
    try:
        return step_round.decide(optimizer)
    finally:  # as ZeroExtOptimizer._zero_ext_step
        step_round.stepped(optimizer)


@pytest.mark.parametrize("skip", [False, True])
def test_the_first_step_decides_and_the_others_follow(skip):
    core = RecordingCore(skip, not skip)
    step_round, (muon, adamw) = joined(core, 2)
    assert step(step_round, muon) == (skip, True)
    assert step(step_round, adamw) == (skip, False)
    assert core.calls == ["begin_step"]
    # The round closed: the next step decides again, for a round of its own.
    assert step(step_round, adamw) == (not skip, True)
    assert step(step_round, muon) == (not skip, False)
    assert core.calls == ["begin_step", "begin_step"]


def test_one_optimizer_decides_every_step_and_zeroes_at_once():
    core = RecordingCore(False, True)
    step_round, (adamw,) = joined(core, 1)
    assert step(step_round, adamw) == (False, True)
    step_round.zero_grad(adamw, True)
    assert step(step_round, adamw) == (True, True)
    assert core.calls == ["begin_step", "zero_grad(True)", "begin_step"]


def test_a_zero_grad_after_its_own_step_waits_for_the_round_to_close():
    core = RecordingCore(False)
    step_round, (muon, adamw) = joined(core, 2)
    step_round.zero_grad(muon, True)  # no round open: at once
    step(step_round, muon)
    step_round.zero_grad(muon, False)  # AdamW has not stepped: waits
    step_round.zero_grad(adamw, True)  # AdamW has not stepped itself: at once
    assert core.calls == ["zero_grad(True)", "begin_step", "zero_grad(True)"]
    step(step_round, adamw)  # the round closes; the waiting zero_grad runs, with its own set_to_none
    assert core.calls == ["zero_grad(True)", "begin_step", "zero_grad(True)", "zero_grad(False)"]


def test_stepping_again_before_the_others_opens_a_new_round():
    core = RecordingCore(True, False)
    step_round, (muon, adamw) = joined(core, 2)
    assert step(step_round, muon) == (True, True)
    assert step(step_round, muon) == (False, True)
    assert step(step_round, adamw) == (False, False)
    assert core.calls == ["begin_step", "begin_step"]


def test_a_round_that_opens_while_a_zero_grad_waits_is_an_error():
    core = RecordingCore(False, True)
    step_round, (muon, adamw) = joined(core, 2)
    step(step_round, muon)
    step_round.zero_grad(muon, True)
    with pytest.raises(RuntimeError, match=r"waited for 1 other optimizer\(s\) to step first"):
        step(step_round, muon)
    # The waiting zero_grad is dropped; the open round goes on without it.
    assert step(step_round, adamw) == (False, False)
    assert core.calls == ["begin_step"]
    assert step(step_round, muon) == (True, True)


def test_a_failed_decision_opens_no_round():
    core = RecordingCore(RuntimeError("collective failed"), False, True)
    step_round, (muon, adamw) = joined(core, 2)
    with pytest.raises(RuntimeError, match="collective failed"):
        step(step_round, muon)
    # No round opened: AdamW's step decides, and Muon's follows it.
    assert step(step_round, adamw) == (False, True)
    assert step(step_round, muon) == (False, False)
    assert step(step_round, muon) == (True, True)
    assert core.calls == ["begin_step"] * 3
