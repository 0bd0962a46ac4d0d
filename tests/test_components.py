"""The C++ components that can be tested alone: the layout's arithmetic
against a Python reference, and the step gate's decisions with the loss
scaler (torch.classes.zero_ext.Layout / StepGate are test probes over the
same classes the core uses)."""
from __future__ import annotations

import math
import random

import pytest
import torch

import zero_ext  # noqa: F401  (registers torch.classes.zero_ext.*)

LAYOUTS = ("ddp_in_place", "replicated", "sharded_persistent", "sharded_transient")
STEP, SKIP_OVERFLOW, SKIP_NONFINITE = 0, 1, 2


def reference(numels, trainable, per_bucket, layout, rank, world):
    """Buckets (first, count, numel, padded, shard), this rank's pieces
    (param, start in param, bucket, start in shard, length), and each rank's
    checkpoint slices, computed the obvious way."""
    buckets, offsets, bucket_of = [], [], []
    first = 0
    for b, count in enumerate(per_bucket):
        numel = 0
        for i in range(first, first + count):
            offsets.append(numel)
            bucket_of.append(b)
            numel += numels[i]
        padded = math.ceil(max(numel, 1) / world) * world
        shard = padded if layout == "replicated" else padded // world
        buckets.append((first, count, numel, padded, shard))
        first += count

    def pieces(r, width_of, start_of):
        out = []
        for i, n in enumerate(numels):
            b = bucket_of[i]
            lo = start_of(b, r)
            hi = lo + width_of(b)
            s, e = max(lo, offsets[i]), min(hi, offsets[i] + n)
            if s < e:
                out.append((i, s - offsets[i], b, s - lo, e - s))
        return out

    local = pieces(rank, lambda b: buckets[b][4], lambda b, r: 0 if layout == "replicated" else r * buckets[b][4])
    owned = {r: [(i, s, s + n) for i, s, _, _, n in pieces(r, lambda b: buckets[b][3] // world,
                                                          lambda b, r: r * (buckets[b][3] // world))]
             for r in range(world)}
    return buckets, local, owned


def triples(flat, k):
    return [tuple(flat[j:j + k]) for j in range(0, len(flat), k)]


@pytest.mark.parametrize("seed", range(40))
def test_layout_matches_reference(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    numels = [rng.choice([0, 1, 2, 3, 7, 16, 33]) for _ in range(n)]
    shapes = [[m] if rng.random() < 0.5 or m == 0 else [1, m] for m in numels]
    world = rng.randint(1, 5)
    rank = rng.randrange(world)
    stage = rng.randint(0, 3)
    layout = {0: rng.choice(LAYOUTS[:2]), 1: "sharded_persistent"}.get(stage, "sharded_transient")
    per_bucket, left = [], n
    while left:
        per_bucket.append(rng.randint(1, left))
        left -= per_bucket[-1]
    if stage == 3:
        trainable = [1 if rng.random() < 0.7 else 0 for _ in range(n)]
    else:  # frozen parameters (mixed precision) have buckets of their own
        frozen_bucket = [layout != "ddp_in_place" and rng.random() < 0.3 for _ in per_bucket]
        trainable = [0 if frozen else 1 for frozen, count in zip(frozen_bucket, per_bucket) for _ in range(count)]
    units = list(range(len(per_bucket))) if stage == 3 else []
    probe = torch.classes.zero_ext.Layout(shapes, trainable, per_bucket, units, stage, layout, rank, world, [])

    buckets, local, owned = reference(numels, trainable, per_bucket, layout, rank, world)
    got = triples(probe.buckets(), 7)
    assert [g[:5] for g in got] == buckets
    assert [g[5] for g in got] == [sum(trainable[f:f + c]) for f, c, *_ in buckets]
    assert [g[6] for g in got] == (units or [-1] * len(per_bucket))
    assert triples(probe.pieces(False), 5) == local
    segments = [] if layout == "ddp_in_place" else [p for p in local if trainable[p[0]]]
    assert triples(probe.pieces(True), 5) == segments
    for r in range(world):
        assert triples(probe.owned_ranges(r), 3) == owned[r]
    # Every element of every parameter is owned by exactly one rank.
    for i, m in enumerate(numels):
        covered = sorted((s, e) for r in range(world) for j, s, e in owned[r] if j == i)
        assert sum(e - s for s, e in covered) == m
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


@pytest.mark.parametrize("seed", range(200))
def test_whole_parameter_layout_puts_each_parameter_in_its_owners_shard(seed):
    """[Note: whole-parameter layout]: given owners (grouped within each
    bucket), every parameter is one piece, at its owner, in the shape's
    order; a rank's shard is the largest region; gaps are exactly the
    elements of no parameter."""
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    numels = [rng.choice([0, 1, 2, 3, 7, 16, 33]) for _ in range(n)]
    shapes = [[m] if rng.random() < 0.5 or m == 0 else [1, m] for m in numels]
    world = rng.randint(1, 5)
    stage = rng.randint(1, 3)
    layout = "sharded_persistent" if stage == 1 else "sharded_transient"
    per_bucket, left = [], n
    while left:
        per_bucket.append(rng.randint(1, left))
        left -= per_bucket[-1]
    owners, whole_bucket = [], []
    for count in per_bucket:  # some buckets whole, some cut in equal shards (owner -1)
        whole_bucket.append(rng.random() < 0.7)
        owners += sorted(rng.randrange(world) for _ in range(count)) if whole_bucket[-1] else [-1] * count
    trainable = [1] * n
    units = list(range(len(per_bucket))) if stage == 3 else []
    probes = [torch.classes.zero_ext.Layout(shapes, trainable, per_bucket, units, stage, layout, r, world, owners)
              for r in range(world)]
    first = 0
    for b, (_, count, numel, padded, shard, _, _) in enumerate(triples(probes[0].buckets(), 7)):
        members = range(first, first + count)
        if whole_bucket[b]:
            regions = [sum(numels[i] for i in members if owners[i] == r) for r in range(world)]
            assert shard == max(max(regions), 1) and padded == shard * world and numel == sum(regions)
        else:
            assert padded == -(-max(numel, 1) // world) * world and shard == padded // world
        gaps = triples(probes[0].gaps(b), 2)
        assert sum(length for _, length in gaps) == padded - numel
        first += count
    for r, probe in enumerate(probes):
        pieces = [p for p in triples(probe.pieces(True), 5) if owners[p[0]] >= 0]
        assert [p[0] for p in pieces] == [i for i in range(n) if owners[i] == r and numels[i] > 0]
        assert all(p[1] == 0 and p[4] == numels[p[0]] for p in pieces)  # whole, from its first element
        owned = [t for t in triples(probe.owned_ranges(r), 3) if owners[t[0]] >= 0]
        assert owned == [(i, 0, numels[i]) for i in range(n) if owners[i] == r and numels[i] > 0]
    # Every element of every parameter is owned by exactly one rank, in either kind of bucket.
    for i, m in enumerate(numels):
        covered = sorted((s, e) for r, probe in enumerate(probes) for j, s, e in triples(probe.owned_ranges(r), 3)
                         if j == i)
        assert sum(e - s for s, e in covered) == m
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


def test_whole_parameter_layout_refuses_a_bucket_of_both_kinds():
    with pytest.raises(RuntimeError, match="mixes whole parameters"):
        torch.classes.zero_ext.Layout([[2], [3]], [1, 1], [2], [], 2, "sharded_transient", 0, 2, [0, -1])


def test_whole_parameter_layout_refuses_owners_out_of_order():
    with pytest.raises(RuntimeError, match="grouped by owner"):
        torch.classes.zero_ext.Layout([[2], [3]], [1, 1], [2], [], 2, "sharded_transient", 0, 2, [1, 0])


def test_layout_refuses_a_bad_plan():
    with pytest.raises(RuntimeError, match="bucket plan"):
        torch.classes.zero_ext.Layout([[2], [3]], [1, 1], [3], [], 1, "sharded_persistent", 0, 1, [])


def test_layout_refuses_frozen_and_trainable_in_one_bucket_outside_stage_3():
    with pytest.raises(RuntimeError, match="bucketed apart from trainable ones"):
        torch.classes.zero_ext.Layout([[2], [3]], [1, 0], [2], [], 1, "sharded_persistent", 0, 1, [])


def gate(scaling: bool = False, **changes):
    g = torch.classes.zero_ext.StepGate()
    if scaling:
        options = dict(initial_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
                       min_scale=1.0, hysteresis=1, dynamic=True)
        options.update(changes)
        g.enable_loss_scaling(*options.values())
    return g


def test_step_gate_steps_unless_told_to_skip():
    g = gate()
    g.note_nonfinite_backward()
    assert g.decide() == STEP  # fp32, skip_nonfinite off: the step goes ahead (as in plain PyTorch)
    g.set_skip_nonfinite(True)
    assert g.decide() == SKIP_NONFINITE  # still flagged: nothing cleared it
    g.clear_nonfinite()
    assert g.decide() == STEP
    assert g.skipped_steps() == 1 and g.step_index() == 3


def test_step_gate_loss_scaler_backs_off_and_grows():
    g = gate(scaling=True)
    scales = []
    for overflow in (True, False, False, False, True, True):
        if overflow:
            g.note_nonfinite_backward()
        decision = g.decide()
        assert decision == (SKIP_OVERFLOW if overflow else STEP)
        g.clear_nonfinite()
        scales.append(g.loss_scale())
    assert scales == [2.0 ** 15, 2.0 ** 15, 2.0 ** 15, 2.0 ** 16, 2.0 ** 15, 2.0 ** 14]
    assert g.skipped_steps() == 3


def test_step_gate_hysteresis_min_scale_and_static():
    g = gate(True, initial_scale=4.0, hysteresis=2, min_scale=2.0)
    seen = []
    for _ in range(5):
        g.note_nonfinite_backward()
        assert g.decide() == SKIP_OVERFLOW
        seen.append(g.loss_scale())
    assert seen == [4.0, 2.0, 2.0, 2.0, 2.0]  # lowered every second overflow, never below min_scale
    static = gate(True, initial_scale=8.0, dynamic=False)
    static.note_nonfinite_backward()
    assert static.decide() == SKIP_OVERFLOW and static.loss_scale() == 8.0
    static.clear_nonfinite()
    for _ in range(5):
        assert static.decide() == STEP
    assert static.loss_scale() == 8.0


def test_unit_input_boundary_passes_gradients_and_reports_the_use():
    """The C++ node a stage 3 unit's inputs pass through: its outputs are
    connected to the inputs (a tensor list given to the node as one opaque
    argument would leave them with no gradient edge, and everything upstream
    of the unit without gradients), its backward hands the gradients through
    unchanged, inputs that need no grad pass as they are, and the unit is
    released once the use is reported over."""
    import copy

    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), stage=3, units={nn.Linear})
    core = model._zero_ext.handles
    x = torch.randn(3, 4, requires_grad=True)
    frozen = torch.randn(3, 4)
    passed = core.units.track_unit_inputs(1, [x, frozen])
    assert passed[0] is not x and passed[0].grad_fn is not None and passed[0].requires_grad
    assert passed[0].data_ptr() == x.data_ptr()  # an alias, no copy
    assert passed[1] is frozen
    weights = torch.randn(3, 4)
    (passed[0] * weights).sum().backward()
    assert torch.equal(x.grad, weights)

    # Through the model: the gradient reaches the input upstream of both units.
    y = torch.randn(3, 4, requires_grad=True)
    y_ref = y.detach().clone().requires_grad_()
    model(y).square().sum().backward()
    reference(y_ref).square().sum().backward()
    assert torch.equal(y.grad, y_ref.grad)
    assert core.diagnostics.stats()["gathered_units"] == 0
