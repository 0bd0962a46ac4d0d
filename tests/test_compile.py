"""torch.compile over a wrapped model at world size 2, stages 0-3: each
block compiled, and the whole model compiled (fullgraph=True, no graph
break, aot_eager bitwise and Inductor within its rounding), train like the
same model run eagerly (compile_scenarios.py), with compiled autograd too;
compiled autograd over a forward zero_ext ran eagerly refused with zero_ext's
error."""
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


def _small_wrapped(stage):
    import torch
    import torch.nn as nn

    import zero_ext

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model, _ = zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage)
    return model


@pytest.mark.parametrize("stage", [0, 3])
def test_compiled_autograd_over_an_eager_forward_is_refused_with_zero_ext_s_own_error(stage):
    """A forward zero_ext ran eagerly leaves the gradients to zero_ext's C++
    hooks, which compiled autograd cannot trace: the user gets zero_ext's
    message with the way out, not torch's "compiled_args nyi"."""
    import torch

    model = _small_wrapped(stage)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            backward = torch.compile(lambda loss: loss.backward(), backend="aot_eager")
        loss = model(torch.randn(3, 4)).square().sum()
        with pytest.raises(RuntimeError, match="zero_ext: compiled autograd .* forward ran eagerly"):
            backward(loss)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("stage", [0, 2])
def test_compiled_autograd_refuses_a_gradient_from_outside_the_compiled_forward(stage):
    """Under compiled autograd a compiled forward reads the parameters
    detached; a gradient that still reaches one (eager code using the
    parameter itself) would land unreduced in .grad: zero_ext's error."""
    import torch

    model = _small_wrapped(stage)

    def step(x, extra):
        loss = model(x).square().sum() + extra
        loss.backward()

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            compiled = torch.compile(step, backend="aot_eager")
        extra = model[0].weight.square().sum()  # eager: the parameter itself
        with pytest.raises(Exception, match="parameter '0.weight' got a gradient from outside the compiled forward"):
            compiled(torch.randn(3, 4), extra)
    finally:
        torch._dynamo.reset()
