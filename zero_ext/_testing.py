"""Test-only hooks into the C++ core. Nothing here runs unless a test asks.

ZERO_EXT_TEST_FAULT=point:rank[:step] makes zero_ext raise inside its own
gradient hook (point "grad_hook") or epilogue ("epilogue") on that rank, at
that optimizer step if given, once: the fault tests check that the other ranks
learn of it within seconds. It is read here, once per wrap(), and handed to
the core through a test-only setter, never parsed in the hot path.
"""
from __future__ import annotations

import os


def apply_test_fault(core, rank: int) -> None:
    spec = os.environ.get("ZERO_EXT_TEST_FAULT")
    if not spec:
        return
    parts = spec.split(":")
    try:
        point, victim = parts[0], int(parts[1])
        step = int(parts[2]) if len(parts) > 2 and parts[2] else -1
    except (IndexError, ValueError):
        return  # malformed: no fault, as before
    if victim == rank:
        core.set_test_fault(point, step)
