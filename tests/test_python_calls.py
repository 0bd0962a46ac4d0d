"""No Python runs in zero_ext during a backward, at any stage.

Gradient arrival, bucket reduction, stage 3 unit release and the end-of-backward
work are C++ autograd hooks and nodes: sys.setprofile sees no call of a function
defined in the zero_ext package during one loss.backward() (world size 1, a
stack of nn.Linear blocks in a ModuleList, so every block is a stage 3 unit).
The counting is benchmarks/python_calls.py's, which also prints the table.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from python_calls import measure_backward  # noqa: E402


@pytest.mark.parametrize("n_params", [40, 400])
@pytest.mark.parametrize("stage, unit_per_block", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_backward_makes_no_zero_ext_python_calls(stage, unit_per_block, n_params):
    r = measure_backward(stage, n_params, unit_per_block=unit_per_block)
    if unit_per_block:
        assert r["units"] == n_params // 2 + 1  # every Linear a unit (and the root): the per-unit path is covered
    assert r["zero_ext_calls"] == 0, (
        f"stage {stage}, {n_params} parameters ({r['units']} units): {r['zero_ext_calls']} calls of zero_ext's "
        f"Python during one backward: {r['zero_ext_functions']}")
