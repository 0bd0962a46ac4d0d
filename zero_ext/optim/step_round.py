"""One optimizer step of a model, however many optimizers it has.

`zero_ext.wrap(model, [muon, adamw])` gives the model two optimizers over
disjoint parameters, stepped one after the other. Some decisions belong to
the step as a whole: whether it is skipped (fp16 overflow, skip_nonfinite;
the loss scale moves once), and when the gradients are zeroed (the core
zeroes a model's gradients together). A round opens at the first
optimizer's step after a backward and closes once every optimizer of the
model has stepped:
- the first step decides (the core's begin_step), the others take its decision;
  an optimizer stepping again in an open round opens a new one;
- zero_grad() of an optimizer that has stepped, while another has not yet
  in the open round, waits for it, and runs right after its step (the usual loop
  `for opt in opts: opt.step(); opt.zero_grad()` would otherwise zero
  AdamW's gradients before AdamW stepped). A round that opens while such a
  zero_grad still waits raises: those gradients were never zeroed.
With one optimizer every step is a round of its own, as before.
"""
from __future__ import annotations

import enum
from typing import Callable, Optional, Set, Tuple

import torch

from ..tools import attach_member, member_of


class StepRoundState(enum.Enum):
    """Where a model's optimizer step stands (Python only; not the C++
    BackwardRound's RoundState, csrc/backward_round.h, which tracks a backward)."""

    IDLE = enum.auto()      # no round open: the next step decides for the model's optimizers
    STEPPING = enum.auto()  # a round is open and its optimizers step
    SKIPPING = enum.auto()  # a round is open and its optimizers skip (non-finite gradients)


class StepRound:
    def __init__(self, handles, tensor_parallel=None) -> None:
        self.handles = handles
        self.size = 0  # optimizers of the model; each has a token 0..size-1 (tools.attach_member)
        self.state = StepRoundState.IDLE
        self.done: Set[int] = set()  # the open round's optimizers that have stepped
        self.waiting_zero: Optional[bool] = None  # set_to_none of a zero_grad that waits
        # A tensor-parallel model's TensorParallel: the core agrees on non-finite
        # gradients over the data-parallel group; the tp ranks then agree here,
        # so every rank skips (and moves the loss scale) alike.
        self.tensor_parallel = tensor_parallel
        # wrap(replicas=): averages the gradients over the live replicas once
        # the step is decided ([Note: a step across replicas]); None otherwise.
        self.before_step: Optional[Callable[[], None]] = None

    def join(self, optimizer) -> None:
        # A token on the optimizer, not id(): wrappers that copy its __dict__
        # (Lightning's LightningOptimizer) then count as the optimizer.
        attach_member(optimizer, self.size)
        self.size += 1

    def decide(self, optimizer) -> Tuple[bool, bool]:
        """(skip this step, decided now)."""
        if self.state is StepRoundState.IDLE or member_of(optimizer) in self.done or self.size == 1:
            if self.waiting_zero is not None:
                pending = self.size - len(self.done)
                self.waiting_zero = None
                raise RuntimeError(
                    f"zero_ext: a zero_grad() of one of this model's optimizers waited for {pending} other "
                    f"optimizer(s) to step first, and they did not: the gradients were never zeroed, so this "
                    f"step would use gradients accumulated over several backwards. zero_ext zeroes a model's "
                    f"gradients together; step every optimizer of the model (or none) between backwards, or "
                    f"call zero_grad() after the last one's step.")
            self._agree_nonfinite_over_tp()
            skip = bool(self.handles.optimizer.begin_step())
            if not skip and self.before_step is not None:
                self.before_step()
            self.state = StepRoundState.SKIPPING if skip else StepRoundState.STEPPING
            self.done = set()
            return skip, True
        return self.state is StepRoundState.SKIPPING, False

    def _agree_nonfinite_over_tp(self) -> None:
        """Collective over tp (one flag): if any tp rank's gradients were
        non-finite, this rank decides its step as if its own were."""
        tp = self.tensor_parallel
        if tp is None or tp.size < 2:
            return
        mine = bool(self.handles.optimizer.found_nonfinite())
        flag = torch.tensor([int(mine)], dtype=torch.int32, device=tp.device_of(torch.empty(0)))
        tp.all_reduce(flag, maximum=True)
        if bool(flag.item()) and not mine:
            self.handles.optimizer.note_nonfinite_elsewhere()

    def stepped(self, optimizer) -> None:
        if self.state is StepRoundState.IDLE:
            return  # a step that failed before its round opened (begin_step raised)
        self.done.add(member_of(optimizer))
        if len(self.done) >= self.size:
            self.state = StepRoundState.IDLE  # every optimizer stepped: the round closes
            if self.waiting_zero is not None:
                set_to_none, self.waiting_zero = self.waiting_zero, None
                self.handles.reduction.zero_grad(set_to_none)

    def zero_grad(self, optimizer, set_to_none: bool) -> None:
        # Waits only after this optimizer's own step, for another one's: a
        # zero_grad inside a step (LBFGS's closure) or with one optimizer
        # runs at once, as in PyTorch.
        if self.size > 1 and self.state is not StepRoundState.IDLE and member_of(optimizer) in self.done:
            self.waiting_zero = set_to_none  # another optimizer still reads these gradients
            return
        self.handles.reduction.zero_grad(set_to_none)
