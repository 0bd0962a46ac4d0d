"""zero_ext.register_forward_method's refusals and idempotence, on one
process; its parity with one process over stages 0-3 and world sizes 1, 2,
4 is the registered_forward_methods scenario of tests/parity_scenarios.py."""
import pytest
import torch

import zero_ext
from parity_scenarios import WithFeatureMethods


def _wrapped(stage):
    model = WithFeatureMethods()
    return zero_ext.wrap(model, torch.optim.AdamW(model.parameters()), stage=stage)


def test_a_module_that_is_not_a_unit_is_refused_at_stage_3():
    model, _ = _wrapped(3)
    with pytest.raises(ValueError, match="neither the wrapped model nor a stage 3 unit"):
        zero_ext.register_forward_method(model.blocks[0].fc1, "forward")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_any_submodule_needs_nothing_where_parameters_are_present(stage):
    model, _ = _wrapped(stage)
    zero_ext.register_forward_method(model.blocks[0].fc1, "forward")
    assert model.blocks[0].fc1(torch.ones(2, 12)).shape == (2, 12)


def test_a_missing_method_is_named():
    model, _ = _wrapped(3)
    with pytest.raises(ValueError, match="has no method 'generat'"):
        zero_ext.register_forward_method(model, "generat")


def test_registering_twice_wraps_once_and_a_plain_model_is_refused():
    model, _ = _wrapped(3)
    zero_ext.register_forward_method(model, "generate")
    first = model.generate
    zero_ext.register_forward_method(model, "generate")
    assert model.generate is first
    assert model.generate(torch.ones(2, 6)).shape == (3, 2, 3)
    with pytest.raises(ValueError, match="neither a model wrapped by zero_ext"):
        zero_ext.register_forward_method(WithFeatureMethods(), "generate")
