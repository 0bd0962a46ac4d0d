"""Tensor parallelism under zero_ext (SPEC.md, "Tensor parallelism"): a model
made tensor parallel with torch's parallelize_module over mesh["tp"], wrapped
with process_group=mesh["dp"], against one process trained on the global
batch (the same model, not parallel).

Items run in the world-4 parity group (parity_scenarios.run_one hands over
"name/stageN/tpLAYOUT"): LAYOUT is "2x2" (dp 2 x tp 2), "1x4" (dp 1 x tp 4)
or "2x1x2" (a 3-D (replicate 2, shard 1, tp 2) mesh: hybrid sharding over
the first two dimensions). The tp ranks of one data-parallel coordinate see
the same data; the reference plays every data-parallel rank at 1/dp.

The scenarios live in tensor_parallel_training_scenarios.py,
tensor_parallel_layer_scenarios.py, tensor_parallel_state_scenarios.py and
tensor_parallel_refusal_scenarios.py, on tensor_parallel_models.py and
tensor_parallel_context.py; this module is their registry (SCENARIOS,
LAYOUT_SCENARIOS) and the entry point (run_one).
"""
from __future__ import annotations

from typing import List, Optional

from tensor_parallel_context import LAYOUTS, TOLERANCES, TPContext
from tensor_parallel_layer_scenarios import (
    loss_parallel_uneven_head, packed_experts_skipping_one, sequence_parallel_norms)
from tensor_parallel_refusal_scenarios import _refusals_reference
from tensor_parallel_state_scenarios import (
    checkpoint_at_another_stage_and_convert, full_state_dict_in_and_functional_clip)
from tensor_parallel_training_scenarios import (
    activation_checkpointed_blocks, adamw_no_sync_accumulation_clip, bf16_offloaded_sgd, fp16_overflow_on_one_tp_rank,
    inf_norm_clip_retain_graph, sgd_momentum_plain)

from tensor_parallel_models import TPNet  # noqa: F401 - wrap_arrival_scenarios.py imports it from here


SCENARIOS = {f.__name__: f for f in [
    sgd_momentum_plain,
    adamw_no_sync_accumulation_clip,
    inf_norm_clip_retain_graph,
    activation_checkpointed_blocks,
    bf16_offloaded_sgd,
    fp16_overflow_on_one_tp_rank,
    sequence_parallel_norms,
    packed_experts_skipping_one,
    loss_parallel_uneven_head,
    full_state_dict_in_and_functional_clip,
    checkpoint_at_another_stage_and_convert,
]}
SCENARIOS["refusals"] = _refusals_reference
# The 1x4 and 3-D layouts run a representative pair.
LAYOUT_SCENARIOS = {"2x2": list(SCENARIOS), "1x4": ["adamw_no_sync_accumulation_clip", "sgd_momentum_plain"],
                    "2x1x2": ["adamw_no_sync_accumulation_clip", "checkpoint_at_another_stage_and_convert"]}


STAGES_OF = {"refusals": (1, 3)}  # stage-independent but for the checkpoint case


def all_items() -> List[str]:
    return [f"{name}/stage{stage}/tp{layout}" for layout in LAYOUTS for name in LAYOUT_SCENARIOS[layout]
            for stage in STAGES_OF.get(name, range(4))]


_REFERENCES: dict = {}


def run_one(item: str, compare) -> Optional[str]:
    name, rest = item.rsplit("/stage", 1)
    stage, _, layout = rest.partition("/tp")
    key = (name, layout)
    if key not in _REFERENCES:
        ref = TPContext(0, layout, reference=True)
        SCENARIOS[name](ref)
        _REFERENCES[key] = ref.checkpoints
    ctx = TPContext(int(stage), layout, reference=False)
    SCENARIOS[name](ctx)
    return compare(_REFERENCES[key], ctx.checkpoints, TOLERANCES)
