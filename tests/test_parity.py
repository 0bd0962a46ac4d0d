"""Every scenario of parity_scenarios.py, stages 0-3, world sizes 1, 2 and 4,
against a single-process reference over the global batch (fp32, tight tolerance).

All scenarios of one world size run inside one group of spawned gloo ranks;
a scenario that raises, kills a rank or hangs fails alone: the group is ended
and a fresh one goes on with the next scenario. Results are cached per world
size and reported one test per scenario and stage.
ZERO_EXT_PARITY_WORLDS=1,2 limits the world sizes (the torch-versions subset).

Tensor parallelism: tensor_parallel_scenarios.py's items, in the world-4 group.
Pipeline stages: pipeline_scenarios.py's items, in the world-4 group (a
(pp 2, dp 2) mesh), or in a group of their own without world 4.
Experts on their own mesh dimension: expert_scenarios.py's items, in the
world-4 group ((dp_mod_ep, ep) meshes), or in a group of their own.
Quantized collectives: compression_scenarios.py's items, in the world-2 and
world-4 groups and the 2x2 mesh group.

Hybrid sharding: every scenario again at world size 4 as a 2x2 (replicate,
shard) DeviceMesh, and a representative set on the degenerate 4x1 (replicas
only) and 1x4 (one row: flat) meshes, against the same flat reference.
"""
import functools
import os

import pytest

from dist_harness import assert_item_matched, run_items_on_ranks
from parity_scenarios import all_items
from tensor_parallel_scenarios import all_items as tensor_parallel_items
from compression_scenarios import all_items as compression_items
from pipeline_scenarios import all_items as pipeline_items
from expert_scenarios import all_items as expert_items

WORLD_SIZES = tuple(int(w) for w in os.environ.get("ZERO_EXT_PARITY_WORLDS", "1,2,4").split(","))


# The degenerate meshes: every stage of the plain loop, accumulation,
# no_sync, clipping, unused and rank-dependent parameters, mixed precision,
# offload, retain_graph, state bytes, stage 3 units, deferred init, the
# replica all-reduce deferred.
DEGENERATE = ["scalar_loss_outside_model", "four_backward_per_step", "no_sync_accumulation", "clip_grad_norm",
              "unused_parameters", "branch_on_rank0_only", "mixed_precision_bf16_mlp", "offload_state_bytes",
              "state_bytes_match_the_stage", "retain_graph_two_losses", "tied_embedding_default_units",
              "deferred_init_then_training", "replica_all_reduce_deferred_in_accumulation"]
# A (1, S) mesh resolves to the flat group, so a few scenarios show it does.
FLAT_AS_MESH = ["scalar_loss_outside_model", "no_sync_accumulation", "state_bytes_match_the_stage"]
MESHES = {"2x2": None, "4x1": DEGENERATE, "1x4": FLAT_AS_MESH}
HYBRID = 4 in WORLD_SIZES


def mesh_items(mesh: str):
    names = MESHES[mesh]
    items = all_items(mesh=mesh)
    return items if names is None else [i for i in items if any(i.startswith(n + "/") for n in names)]


# Quantized collectives (compression_scenarios.py): every item at world 2, the
# learning at world 4 too (the rest depends on the world size only through n).
COMPRESSION = {2: compression_items(),
               4: [i for i in compression_items(world_4=True) if "learns_like" in i or "subgroup" in i]}

# Tensor parallelism (tensor_parallel_scenarios.py): its items run in the flat
# world-4 group, or (the torch-versions subset, without world 4) in a group of their own.
TENSOR_PARALLEL = tensor_parallel_items()
# Pipeline stages (pipeline_scenarios.py): in the flat world-4 group before the
# TP items (whose refusals leave rows holding different numbers of pooled
# groups, which wrap() compares; a refused pipeline wrap holds none, so the
# ranks stay alike), or a group of their own.
PIPELINE = pipeline_items()
# Experts on their own mesh dimension (expert_scenarios.py): in the flat
# world-4 group after the pipeline items, or a group of their own.
EXPERTS = expert_items()


@functools.lru_cache(maxsize=None)
def group_results(world: int, mesh: str = ""):
    if mesh == "tp":
        items = TENSOR_PARALLEL
    elif mesh == "pp":
        items = PIPELINE
    elif mesh == "ep":
        items = EXPERTS
    elif mesh:
        items = mesh_items(mesh) + (compression_items(mesh) if mesh == "2x2" else [])
    else:
        # The TP items last: their dp rows pool different numbers of groups
        # (a refused wrap on one row), which a later wrap over every rank refuses.
        items = all_items() + COMPRESSION.get(world, []) + (PIPELINE + EXPERTS + TENSOR_PARALLEL if world == 4 else [])
    return run_items_on_ranks(world, "parity_scenarios:run_one", items, item_deadline_s=180)


@pytest.mark.parametrize("item", all_items())
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_parity(world, item):
    result = group_results(world)[item]
    assert_item_matched(world, result)


@pytest.mark.skipif(not HYBRID, reason="world size 4 not in ZERO_EXT_PARITY_WORLDS")
@pytest.mark.parametrize("item", [i for mesh in MESHES for i in mesh_items(mesh)])
def test_hybrid_parity(item):
    mesh = item.rsplit("/mesh", 1)[1]
    assert_item_matched(4, group_results(4, mesh)[item])


@pytest.mark.parametrize("world,item", [(w, i) for w, items in COMPRESSION.items() if w in WORLD_SIZES
                                         for i in items]
                         + [(4, i) for i in (compression_items("2x2") if HYBRID else [])])
def test_compression(world, item):
    """compress_weights / compress_grads against the same model uncompressed
    (compression_scenarios.py): learning, traffic, error feedback,
    checkpoints both ways, ranks that disagree; the hybrid items in the 2x2
    mesh group."""
    assert_item_matched(world, group_results(4, "2x2")[item] if "/mesh" in item else group_results(world)[item])


@pytest.mark.parametrize("item", TENSOR_PARALLEL)
def test_tensor_parallel_parity(item):
    """A model made tensor parallel with parallelize_module, wrapped over
    mesh['dp'] (dp 2 x tp 2, dp 1 x tp 4, (replicate 2, shard 1) x tp 2),
    against one process over the global batch."""
    assert_item_matched(4, (group_results(4) if 4 in WORLD_SIZES else group_results(4, "tp"))[item])


@pytest.mark.parametrize("item", PIPELINE)
def test_pipeline_parity(item):
    """Pipeline stages (torch.distributed.pipelining) over zero_ext on a
    (pp 2, dp 2) mesh: GPipe, 1F1B, interleaved 1F1B, looped BFS,
    interleaved zero bubble, ZBV zero bubble and DualPipeV against one
    process over the global batch (the
    whole model's norm clipped), one reduction per step whatever the number
    of microbatches, one DCP checkpoint of the whole model, and what ranks
    disagree on refused on every rank."""
    assert_item_matched(4, (group_results(4) if 4 in WORLD_SIZES else group_results(4, "pp"))[item])


@pytest.mark.parametrize("item", EXPERTS)
def test_expert_parity(item):
    """Experts on their own mesh dimension: examples/moe_expert_parallel.py's
    MoE (experts Shard(0) over mesh['ep'], all-to-all dispatch) wrapped with
    expert_process_group=mesh['dp_mod_ep'] at ep 2 x 2 and ep 4 x 1, against
    one process over the global batch (AdamW with the whole model's norm
    clipped, SGD in bf16, experts no token reached, offload, no_sync), the
    bytes each group reduces, checkpoints loaded at another ep size and
    converted whole, and ranks that disagree on the ep size refused on
    every rank."""
    assert_item_matched(4, (group_results(4) if 4 in WORLD_SIZES else group_results(4, "ep"))[item])
