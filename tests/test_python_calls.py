"""No Python runs in zero_ext during a backward, at any stage.

Gradient arrival, bucket reduction, stage 3 unit release and the end-of-backward
work are C++ autograd hooks and nodes: sys.setprofile sees no call of a function
defined in the zero_ext package during one loss.backward() (world size 1, a
stack of nn.Linear blocks in a ModuleList, so every block is a stage 3 unit).
The counting is benchmarks/python_calls.py's, which also prints the table.

Positive control, in the same measured backward: a Python tensor hook on each
block's output calls one zero_ext Python function (a pure one, never on the
backward path). The counter must report exactly those calls, so it is shown
to see Python run by this backward's autograd hooks, on the thread that runs
them, and to attribute it to zero_ext; any call beyond them is zero_ext's own.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import python_calls  # noqa: E402
from python_calls import measure_backward  # noqa: E402
from zero_ext.runtime.hooks import tensors_requiring_grad  # noqa: E402

CONTROL = "runtime/hooks.py:tensors_requiring_grad"  # its key in the counter's zero_ext_functions


def _control_hook(grad: torch.Tensor) -> None:
    tensors_requiring_grad(grad)  # a grad needs no grad: one call, no nested zero_ext calls


class ControlledStack(python_calls.Stack):
    """The benchmark's Stack, with the control hook on every block's output:
    it fires once per block in each backward (the measured one included)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if x.requires_grad:
                x.register_hook(_control_hook)
        return x


@pytest.mark.parametrize("n_params", [40, 400])
@pytest.mark.parametrize("stage, unit_per_block", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_backward_makes_no_zero_ext_python_calls(monkeypatch, stage, unit_per_block, n_params):
    monkeypatch.setattr(python_calls, "Stack", ControlledStack)  # measure_backward builds its model by this name
    r = measure_backward(stage, n_params, unit_per_block=unit_per_block)
    if unit_per_block:
        assert r["units"] == n_params // 2 + 1  # every Linear a unit (and the root): the per-unit path is covered
    blocks = n_params // 2
    assert r["zero_ext_functions"].get(CONTROL, 0) >= blocks, (
        f"the counter missed the control: {r['zero_ext_functions']} (expected {CONTROL}: {blocks})")
    assert r["zero_ext_calls"] == blocks, (
        f"stage {stage}, {n_params} parameters ({r['units']} units): {r['zero_ext_calls'] - blocks} calls of "
        f"zero_ext's Python during one backward besides the {blocks} control calls: {r['zero_ext_functions']}")
