"""Hybrid sharding beyond parity (test_parity.py runs every scenario over
2x2, 4x1 and 1x4 meshes): the meshes wrap() refuses."""
from dist_harness import run_on_ranks


def test_bad_meshes_are_refused_on_every_rank():
    results = run_on_ranks(4, "hybrid_scenarios:mesh_refusals", deadline_s=180)
    for rank, refusals in enumerate(results):
        assert "must be 1-D (shard) or 2-D (replicate, shard)" in refusals["3-D"], (rank, refusals)
        assert "takes (replicate, shard), the replicated dim first" in refusals["shard dim first"], (rank, refusals)
        assert "do not increase along every row and column" in refusals["rows not in rank order"], (rank, refusals)
        assert refusals["then a good one"] == "accepted", (rank, refusals)
