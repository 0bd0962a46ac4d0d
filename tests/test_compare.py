"""parity_scenarios.compare, the one comparison the scenario suites share
(parity, real models, units, reshard, ported, frozen mixed precision):
lists that compare nothing are refused, and each label prefix has its
tolerance."""
import torch

import frozen_mixed_precision_scenarios as frozen
import parity_scenarios as ps


def test_lists_that_compare_nothing_are_refused():
    assert "nothing to compare" in ps.compare([], [])
    only_nones = [("step 0: grads", {"w": None})]
    assert "nothing compared" in ps.compare(only_nones, only_nones)
    assert "recorded no values" in ps.compare([("step 0: grads", {})], [("step 0: grads", {})])


def test_each_label_prefix_has_its_tolerance():
    def pair(label, want, got):
        return [(label, {"v": torch.tensor(want)})], [(label, {"v": torch.tensor(got)})]

    assert ps.compare(*pair("step 0: grads", 1.0, 1.0 + 5e-6)) is None
    assert "max abs diff" in ps.compare(*pair("step 0: grads", 1.0, 1.0 + 5e-5))
    assert ps.compare(*pair(f"{ps.BF16}step 0: grads", 1.0, 1.01)) is None
    # One bf16 ulp (2**-7 at 1.0) passes a cast output, two do not.
    assert ps.compare(*pair(f"{ps.BF16_ROUNDED}step 0: output", 1.0, 1.0 + 2.0 ** -7)) is None
    assert "max abs diff" in ps.compare(*pair(f"{ps.BF16_ROUNDED}step 0: output", 1.0, 1.0 + 2.0 ** -6))
    # A caller's prefix adds to the table.
    curve = f"{frozen.CURVE}step 0: loss"
    assert ps.compare(*pair(curve, 1.0, 1.02), frozen.TOLERANCES) is None
    assert "max abs diff" in ps.compare(*pair(curve, 1.0, 1.02))


def test_a_reduced_sum_adds_its_rounding_bound_elementwise():
    """A reference gradient recorded as an exact sum and its bound
    (ReducedSum): got may lie up to the bound, besides the label's rtol and
    atol, from the exact sum; the bound of one element lends nothing to another."""
    label = f"{ps.BF16}step 0 backward 0: grads"
    want = [(label, {"v": ps.ReducedSum(value=torch.tensor([0.0, 1.0]), bound=torch.tensor([0.1, 0.0]))})]

    def got(*values):
        return [(label, {"v": torch.tensor(values)})]

    rtol, atol = ps.TOLERANCES[ps.BF16]
    assert ps.compare(want, got(0.1 + atol * 0.99, 1.0 + rtol)) is None
    assert "max abs diff" in ps.compare(want, got(0.1 + atol * 1.01, 1.0))
    assert "max abs diff" in ps.compare(want, got(0.0, 1.0 + rtol + atol * 1.01))
    # Another reference's (a perturbed one's) exact sum is compared as got.
    assert ps.compare(want, [(label, {"v": ps.ReducedSum(torch.tensor([0.05, 1.0]), torch.tensor([9.0, 9.0]))})]) is None


def test_frozen_mixed_precision_refuses_a_scenario_that_records_nothing(monkeypatch):
    """Its items go through the shared compare, guard included."""
    monkeypatch.setitem(frozen.SCENARIOS, "records_nothing", lambda ctx: None)
    assert "nothing to compare" in frozen.run_one(0, 1, "records_nothing/stage0")
