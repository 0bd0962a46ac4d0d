"""Rank-side halves of tests/test_checkpoint_trust.py: crafted, damaged,
mixed and racing checkpoints, and saves that go wrong on one rank.

Every item catches what zero_ext raises and returns a small report (exception
type, message, seconds, what is on disk) for the test to judge, so one
expected error never ends the group; only a crash or a hang fails an item.
Items are (case, root) tuples, run with dist_harness.run_items_on_ranks.

The cases live by concern in checkpoint_trust_crafted_scenarios.py,
checkpoint_trust_strict_scenarios.py, checkpoint_trust_mixing_scenarios.py,
checkpoint_trust_optimizer_scenarios.py,
checkpoint_trust_zero_size_scenarios.py,
checkpoint_trust_collective_scenarios.py (on checkpoint_trust_common.py),
dcp_trust_scenarios.py and async_snapshot_scenarios.py; this module holds each group's entry point,
which hands a case to them.
"""
from __future__ import annotations

from typing import Any

from checkpoint_trust_collective_scenarios import _bad_target, _extra_rule, _loose_inputs_rank1, _save_fails
from checkpoint_trust_crafted_scenarios import _copy_base, _evil, _extra_kinds, _load_and_convert, _mutate_meta
from checkpoint_trust_mixing_scenarios import _mixed, _race, _ranks_open_different_saves
from checkpoint_trust_optimizer_scenarios import _optimizer_class, _optimizer_class_world2, _scalar_per_slice
from checkpoint_trust_strict_scenarios import _strict
from checkpoint_trust_zero_size_scenarios import _zero_size_convert, _zero_size_load, _zero_size_save

# Imported from here by test_checkpoint_trust.py, dcp_trust_scenarios.py and
# checkpoint_integrity_scenarios.py.
from checkpoint_trust_common import Evil, _secret, attempt, litter, make, params_of, same, step  # noqa: F401
from checkpoint_trust_crafted_scenarios import META_CASES  # noqa: F401


# --- world 1, first: crafted files and metadata, strictness, mixing ---------

def first_world1(rank: int, world: int, item) -> Any:
    case, root = item
    if case.startswith("dcp:"):
        import dcp_trust_scenarios
        return dcp_trust_scenarios.world1(root, case[4:])
    if case.startswith("meta:"):
        path = _copy_base(root, case[5:])
        _mutate_meta(path, case[5:])
        return _load_and_convert(path)
    if case.startswith("evil:"):
        return _evil(root, case[5:])
    if case == "extra-kinds":
        return _extra_kinds(root)
    if case == "strict":
        return _strict(root)
    if case.startswith("mixed:"):
        return _mixed(root, case[6:])
    if case.startswith("race:"):
        return _race(root, int(case[5:]))
    if case == "zero-size-save":
        return _zero_size_save(root, world, rank)
    if case == "optimizer-class":
        return _optimizer_class(root)
    raise ValueError(case)


# --- world 2: collective decisions and error propagation --------------------

def world2(rank: int, world: int, item) -> Any:
    case, root = item
    if case == "loose-inputs-rank1":
        return _loose_inputs_rank1(root, rank, world)
    if case.startswith("dcp:"):
        import dcp_trust_scenarios
        return dcp_trust_scenarios.world2(root, case[4:], rank, world)
    if case.startswith("snapshot:"):
        import async_snapshot_scenarios
        return async_snapshot_scenarios.run(root, case[9:], rank, world)
    if case.startswith("fail-") or case.startswith("file-vanishes"):
        return _save_fails(root, case, rank, world)
    if case == "extra-rule":
        return _extra_rule(root, rank, world)
    if case == "ranks-open-different-saves":
        return _ranks_open_different_saves(root, rank, world)
    if case == "zero-size-save":
        return _zero_size_save(root, world, rank)
    if case.startswith("zero-size-load-from-w"):
        return _zero_size_load(root, world, rank, int(case[-1]))
    if case == "optimizer-class":
        return _optimizer_class_world2(root, rank)
    if case == "scalar-per-slice":
        return _scalar_per_slice(root, rank)
    return _bad_target(root, case, rank, world)


# --- world 1, last: world-2 checkpoints loaded and every one converted ------

def last_world1(rank: int, world: int, item) -> Any:
    case, root = item
    if case.startswith("zero-size-load-from-w"):
        return _zero_size_load(root, world, rank, int(case[-1]))
    if case == "zero-size-convert":
        return _zero_size_convert(root)
    raise ValueError(case)
