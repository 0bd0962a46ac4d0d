"""The reduced gradient of stages 2-3 over gloo: each rank receives its
chunk of every rank's buffer and sums the chunks in rank order ([Note:
gloo's reduce-scatter as an exchange] in csrc/exchange_reduce_scatter.h), so
it is bit for bit the sum one process computes over the ranks' gradients
(gloo's all-reduce, the reduce-scatter's old form, summed each chunk in the
ring's order), in fp32 and in bf16. Stage 1 keeps its whole staging until
the flush and reduces it in place with the all-reduce: an exchange would
need a second buffer as large."""
import pytest

from dist_harness import run_on_ranks


@pytest.mark.parametrize("world", [2, 4])
def test_reduced_gradient_is_the_sum_over_ranks(world):
    results = run_on_ranks(world, "reduction_scenarios:reduced_is_the_sum_over_ranks")
    for rank, result in enumerate(results):
        assert len(result) == 4, result
        for configuration, (differ, total) in result.items():
            assert total > 400_000 and differ == 0, f"rank {rank}, {configuration}: {differ} of {total} differ"
