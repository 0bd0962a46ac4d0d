"""torch.compile over a wrapped model at world size 2, stages 0-3: each
block compiled, and the whole model compiled (fullgraph=True, no graph
break, aot_eager bitwise and Inductor within its rounding), train like the
same model run eagerly (compile_scenarios.py); compiled autograd refused
with zero_ext's error."""
import functools

import pytest

from compile_scenarios import all_items
from dist_harness import assert_item_matched, run_items_on_ranks

WORLD = 2


@functools.lru_cache(maxsize=None)
def results():
    return run_items_on_ranks(WORLD, "compile_scenarios:run_one", all_items(), item_deadline_s=240)


@pytest.mark.parametrize("item", all_items())
def test_compiled_model_trains_like_eager(item):
    assert_item_matched(WORLD, results()[item])


@pytest.mark.parametrize("stage", [0, 3])
def test_compiled_autograd_is_refused_with_zero_ext_s_own_error(stage):
    """zero_ext's gradient hooks are C++ hooks, which compiled autograd
    cannot trace: the user gets zero_ext's message with the way out (compile
    the forward), not torch's "compiled_args nyi"."""
    import torch
    import torch.nn as nn

    import zero_ext

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model, _ = zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage)

    def step(x):
        loss = model(x).square().sum()
        loss.backward()
        return loss

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            with pytest.raises(RuntimeError, match="zero_ext: compiled autograd .* Compile the forward instead"):
                torch.compile(step, backend="aot_eager")(torch.randn(3, 4))
    finally:
        torch._dynamo.reset()
