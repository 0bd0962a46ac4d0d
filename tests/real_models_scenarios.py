"""Models people train off the dense path, wrapped by zero_ext on N ranks and
as the parity suite's single-process reference over the global batch
(tests/parity_scenarios.py's Context): MoE layers whose routing skips experts
differently on every rank, a top-level MoE outside any block, blocks kept in
ModuleDicts. Plus the ways ranks can disagree (an expert made a unit of its
own and skipped, a rank-0-only evaluation, with or without a barrier after
it, evaluation loops of different lengths, a forward that raised on one rank
only, wrap() with different models or options): every rank must end in
zero_ext's own error, never a wrong number, a hang or an abort inside gloo.
Those scenarios catch the error and return it, so one group of ranks runs
them all (zero_ext never hands a failed model's groups to another model).

The models live in real_models_common.py, the parity scenarios in
real_models_parity_scenarios.py and the divergences in
real_models_divergence_scenarios.py; this module is their registry and the
entry point each rank runs (run_one).
"""
from __future__ import annotations

from typing import Callable, Dict, List

import parity_scenarios as ps
from real_models_divergence_scenarios import DIVERGENCES
from real_models_parity_scenarios import module_dict_blocks, moe_in_blocks, moe_in_blocks_compiled, moe_outside_any_block

# Imported from here by ported_spec_scenarios.py and units_scenarios.py.
from real_models_common import (  # noqa: F401
    CHECK_TIMEOUT, N_EXPERTS, ONE_UNIT_PER_BLOCK_MB, Expert, FlatMoEModel, MoE, MoEBlock, MoEModel,
    _ranks_ran_different_experts, global_loss, lm_loss, tokens_of)


SCENARIOS: Dict[str, Callable[[ps.Context], None]] = {
    f.__name__: f for f in [moe_in_blocks, moe_in_blocks_compiled, moe_outside_any_block, module_dict_blocks]
}
STAGES = {"moe_outside_any_block": (3,), "module_dict_blocks": (3,), "moe_in_blocks_compiled": (0, 3)}


def items() -> List[str]:
    return [f"{name}/stage{stage}" for name in SCENARIOS for stage in STAGES.get(name, (0, 1, 2, 3))]


_REFERENCES: Dict = {}


def run_one(rank: int, world: int, item: str):
    """A parity item ("name/stageN": None or the first mismatch) or a
    divergence item ("diverge/name": what each rank saw)."""
    if item.startswith("diverge/"):
        return DIVERGENCES[item.split("/", 1)[1]](rank, world)
    name, stage = item.rsplit("/stage", 1)
    if (name, world) not in _REFERENCES:
        ref_ctx = ps.Context(stage=0, rank=rank, world=world, reference=True)
        SCENARIOS[name](ref_ctx)
        _REFERENCES[(name, world)] = ref_ctx.checkpoints
    ctx = ps.Context(stage=int(stage), rank=rank, world=world, reference=False)
    SCENARIOS[name](ctx)
    return ps.compare(_REFERENCES[(name, world)], ctx.checkpoints)
