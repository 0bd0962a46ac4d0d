"""Test-only fault injection: one variable says where zero_ext fails on purpose,
so tests can check what every rank sees then. Nothing here runs unless a test
sets it.

    ZERO_EXT_TEST_FAULT="point:rank[:step][,point:rank[:step]...]"

`rank` is a global rank, or `*` for every rank. The points:
- in the C++ core, raised once (csrc/fault_injection.h): `grad_hook` (inside
  zero_ext's own gradient hook) and `epilogue` (the once-per-backward
  epilogue), at optimizer step `step` if given. Read once per wrap() and
  handed to the core through a test-only setter, never parsed in the hot
  path.
- in a save, where the rank exits at once with code 17, as a killed process
  would: `after_shards` (files/save.py), `before_publish`, `after_exchange`,
  or without exchange `between_renames` and `after_renames`, and
  `removing_old` (the replaced checkpoint partly removed; files/publish.py).
- conditions: `no_exchange` publishes as where the OS or the filesystem
  cannot swap two directories in one step (files/publish.py);
  `async_slow_snapshot` makes an asynchronous save's writer thread wait
  PAUSE_S before it takes its snapshot (files/asynchronous.py), so what
  training does right after the call runs before the copy.
- across replicas (optim/replica_step.py), where the rank exits at once
  with code 17 at optimizer step `step` if given: `replica_average` (before
  the gradients' sum over the quorum) and `replica_recover` (a replica
  catching up, after it learned the state's layout, before its tensors come);
  and one condition: `replica_damaged`, where a replica catching up changes
  one value it received before the states' checksums are compared
  (files/peer_state.py).
- `build_check_signal:*:N`: the build check's child kills itself with signal
  N, standing in for a build that crashes (tools/build_check.py, which runs
  by path and so reads this variable itself).

A malformed entry injects nothing.
"""
from __future__ import annotations

import os
import time
from typing import List, NamedTuple, Optional

VARIABLE = "ZERO_EXT_TEST_FAULT"
CORE_POINTS = ("grad_hook", "epilogue")
EXIT_CODE = 17
PAUSE_S = 1.0  # how long a pause point waits


class Fault(NamedTuple):
    point: str
    rank: Optional[int]  # None: every rank
    step: int  # -1: the first time the point is reached


def spec(point: str, rank: Optional[int] = None, step: Optional[int] = None) -> str:
    """The variable's value for one fault (what tests set)."""
    text = f"{point}:{'*' if rank is None else rank}"
    return text if step is None else f"{text}:{step}"


def armed_faults() -> List[Fault]:
    faults = []
    for entry in os.environ.get(VARIABLE, "").split(","):
        parts = entry.strip().split(":")
        if len(parts) < 2 or not parts[0]:
            continue
        try:
            rank = None if parts[1] == "*" else int(parts[1])
            step = int(parts[2]) if len(parts) > 2 and parts[2] else -1
        except ValueError:
            continue
        faults.append(Fault(parts[0], rank, step))
    return faults


def armed(point: str, rank: Optional[int] = None) -> bool:
    """Whether `point` is armed for `rank` (None: armed for any rank)."""
    return any(f.point == point and (rank is None or f.rank is None or f.rank == rank) for f in armed_faults())


def exit_if_armed(point: str, rank: int, step: Optional[int] = None) -> None:
    """Ends this process at once, as a kill would, where `point` is armed for
    `rank` (and, if the fault names a step, at that `step`)."""
    if any(f.point == point and (f.rank is None or f.rank == rank) and (f.step < 0 or f.step == step)
           for f in armed_faults()):
        os._exit(EXIT_CODE)


def pause_if_armed(point: str, rank: int) -> None:
    """Waits PAUSE_S where `point` is armed for `rank` (a slow thread)."""
    if armed(point, rank):
        time.sleep(PAUSE_S)


def arm_core(handles, rank: int) -> None:
    """Hands the C++ core the faults armed for this rank in it."""
    for fault in armed_faults():
        if fault.point in CORE_POINTS and (fault.rank is None or fault.rank == rank):
            handles.diagnostics.set_test_fault(fault.point, fault.step)
