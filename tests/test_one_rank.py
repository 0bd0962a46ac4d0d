"""A rank alone in its group (one process, no torch.distributed here; the
same local path as a world of one under torch.distributed) keeps the
semantics it has on more ranks, though its stage 3 shard is its full buffer
and gradients stage straight into the gradient shard:
- changes made inside full_params(writeback=False) are discarded,
- a load_state_dict that raises changes nothing,
- a backward that fails part way leaves no partial gradient behind
  (stages 1-2: the round's gradients go, as when they stage apart)."""
import pytest
import torch
import torch.nn as nn

import zero_ext


def wrapped(stage: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = zero_ext.wrap(model, opt, stage=stage, units={nn.Linear} if stage == 3 else None)
    return model, opt


def values(model):
    return {k: v.clone() for k, v in zero_ext.full_state_dict(model).items()}


def assert_same(before, after):
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_full_params_without_writeback_discards_changes():
    model, _ = wrapped(3)
    before = values(model)
    with torch.no_grad(), zero_ext.full_params(model):
        model[0].weight.fill_(7.0)
    assert_same(before, values(model))
    with torch.no_grad(), zero_ext.full_params(model, writeback=True):
        model[0].weight.fill_(7.0)
    assert torch.equal(values(model)["0.weight"], torch.full((8, 4), 7.0))


def test_failed_load_changes_nothing():
    model, _ = wrapped(3)
    before = values(model)
    bad = {k: torch.zeros_like(v) for k, v in before.items()}
    bad["unexpected"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        model.load_state_dict(bad)
    assert_same(before, values(model))


@pytest.mark.parametrize("stage", [1, 2])
def test_failed_backward_leaves_no_partial_gradient(stage):
    model, opt = wrapped(stage)
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # the accumulators stay, zeroed
    before = values(model)
    h = model[1](model[0](torch.randn(3, 4)))
    h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model[2](h).square().mean().backward()
    opt.step()  # the failed round is abandoned: nothing to step
    assert_same(before, values(model))
