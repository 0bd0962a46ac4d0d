"""Optimizers that are not elementwise at stages 1-3: sharded by whole
parameter (optim/ownership.py, [Note: whole-parameter layout] in
csrc/layout.h). Every scenario of whole_param_optimizer_scenarios.py at
stages 1-3, world sizes 1, 2 and 4, against the same optimizer on one
process over the global batch; one group of spawned gloo ranks per world
size. ZERO_EXT_WHOLE_PARAM_WORLDS=2 limits the world sizes."""
import functools
import io
import os

import pytest
import torch

import zero_ext
from dist_harness import assert_item_matched, run_items_on_ranks, run_on_ranks
from whole_param_optimizer_scenarios import (RESHARD_CASES, STAGES, Matrices, TrustRatioSGD, WithBiases, all_items,
                                             reshard_reference)
from zero_ext.optim.ownership import FLAT, REPLICATED, WHOLE, optimizer_sharding, plan_owners

WORLD_SIZES = tuple(int(w) for w in os.environ.get("ZERO_EXT_WHOLE_PARAM_WORLDS", "1,2,4").split(","))


@functools.lru_cache(maxsize=None)
def group_results(world: int):
    return run_items_on_ranks(world, "whole_param_optimizer_scenarios:run_one", all_items(world),
                              item_deadline_s=180)


@pytest.mark.parametrize("world,item", [(world, item) for world in WORLD_SIZES for item in all_items(world)])
def test_whole_parameter_optimizer_matches_one_process(world, item):
    assert_item_matched(world, group_results(world)[item])


@pytest.fixture(scope="module")
def saved_at_world_2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("whole_reshard"))
    run_on_ranks(2, "whole_param_optimizer_scenarios:save_for_resharding", (root,), deadline_s=300)
    return root


@pytest.mark.parametrize("world,mesh", [(1, ""), (4, ""), (4, "2x2")])
def test_a_checkpoint_saved_at_world_2_continues_like_one_process_at_another(world, mesh, saved_at_world_2):
    """[muon, adamw] saved at stage 2, Adafactor (fp32 at stage 2, bf16 at
    stage 3) and an unknown optimizer at stage 1, all at world size 2 (owners
    of 2 ranks);
    loaded at world 1 and 4 (flat, and hybrid over 2x2: owners within a row)
    into stages 1-3 and trained on: as one process trained straight through."""
    per_rank = [torch.load(io.BytesIO(raw), weights_only=True) for raw in
                run_on_ranks(world, "whole_param_optimizer_scenarios:load_resharded", (saved_at_world_2, mesh),
                             deadline_s=600)]
    for case in RESHARD_CASES:
        want = reshard_reference(case)
        rtol, atol = (2e-2, 2e-3) if RESHARD_CASES[case][2] else (1e-5, 1e-6)
        for stage in STAGES:
            label = f"{case}->stage{stage}"
            for rank, got in enumerate(per_rank):
                for name, value in want.items():
                    assert torch.allclose(got[label][name], value, rtol=rtol, atol=atol), \
                        (rank, label, name, (got[label][name] - value).abs().max())


def test_the_optimizer_decides_how_it_is_sharded():
    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert optimizer_sharding(torch.optim.AdamW(params), shards_state=True) == FLAT
    assert optimizer_sharding(torch.optim.Muon(params), shards_state=True) == WHOLE
    assert optimizer_sharding(torch.optim.Adafactor(params), shards_state=True) == WHOLE
    assert optimizer_sharding(TrustRatioSGD(params), shards_state=True) == WHOLE  # unknown: whole, which is exact
    assert optimizer_sharding(torch.optim.LBFGS(params), shards_state=False) == REPLICATED

    class Declared(TrustRatioSGD):
        zero_ext_elementwise = True

    assert optimizer_sharding(Declared(params), shards_state=True) == FLAT


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_optimizer_that_reads_across_parameters_is_refused_with_the_reason(stage):
    model = WithBiases()
    with pytest.raises(TypeError, match="LBFGS reads across parameters.*line search.*Use stage=0"):
        zero_ext.wrap(model, torch.optim.LBFGS(model.parameters()), stage=stage)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_single_process_steps_every_parameter_whole(stage):
    """World 1 (no process group): the layout still gives the optimizer
    whole parameters in their shapes, so Muon runs at all."""
    model = Matrices()
    model, opt = zero_ext.wrap(model, torch.optim.Muon(model.parameters(), lr=0.02), stage=stage)
    assert model._zero_ext.whole_params
    shapes = sorted(tuple(t.shape) for g in opt.param_groups for t in g["params"])
    assert shapes == sorted(tuple(p.shape) for p in Matrices().parameters())
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()


def _params(*shapes):
    return [torch.nn.Parameter(torch.zeros(*s)) for s in shapes]


def test_owners_balance_within_each_bucket_and_overall():
    """Largest first onto the rank with the fewest elements in the bucket,
    ties to the rank with the fewest overall; each bucket lists its
    parameters grouped by owner (the layout requires it)."""
    params = _params((8, 8), (8,), (4, 4), (4,), (8, 8), (8,), (4, 4), (4,))
    ordered, owners = plan_owners(params, [4, 4], world=2)
    # Bucket 1: the matrix to rank 0, the rest to rank 1 (28 elements);
    # bucket 2: the matrix to rank 1, which had less overall: 92 and 92.
    assert owners == [0, 1, 1, 1, 0, 0, 0, 1]
    position = {id(p): k for k, p in enumerate(params)}
    assert [position[id(p)] for p in ordered] == [0, 1, 2, 3, 5, 6, 7, 4]
    totals = [sum(p.numel() for p, o in zip(ordered, owners) if o == r) for r in range(2)]
    assert totals == [92, 92]


def test_owners_of_frozen_parameters_take_room_but_no_state():
    frozen = torch.nn.Parameter(torch.zeros(10), requires_grad=False)
    params = [frozen] + _params((6,), (4,))
    _, owners = plan_owners(params, [3], world=2)
    assert owners == [0, 1, 1]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_zero_grad_that_waits_for_an_optimizer_that_never_steps_is_an_error(stage):
    """Zeroing waits for the model's other optimizers to step; a round that
    opens while it still waits raises instead of stepping on gradients
    accumulated over two backwards."""
    from whole_param_optimizer_scenarios import muon_and_adamw

    model = WithBiases()
    opts = muon_and_adamw(model.parameters())
    model, opts = zero_ext.wrap(model, opts, stage=stage)
    muon, _ = opts
    for _ in range(2):
        model(torch.randn(4, 6)).square().mean().backward()
        if _ == 1:
            with pytest.raises(RuntimeError, match="zero_grad.*waited for 1 other optimizer"):
                muon.step()
            break
        muon.step()
        muon.zero_grad()


@pytest.mark.parametrize("bad,match", [
    ([], "list of optimizers is empty"),
    (["sgd"], "a list or tuple of them, got str in the list"),
])
def test_a_bad_list_of_optimizers_is_refused(bad, match):
    model = WithBiases()
    with pytest.raises((TypeError, ValueError), match=match):
        zero_ext.wrap(model, bad, stage=2)


def test_a_parameter_in_two_optimizers_is_refused():
    model = WithBiases()
    with pytest.raises(ValueError, match="is in two of the optimizers"):
        zero_ext.wrap(model, [torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)],
                      stage=2)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_models_optimizers_skip_a_nonfinite_step_together_and_count_it_once(stage):
    """skip_nonfinite with [muon, adamw]: the first step decides for both
    (one skipped step, not two), and nothing moves."""
    from whole_param_optimizer_scenarios import muon_and_adamw

    model = WithBiases()
    model, opts = zero_ext.wrap(model, muon_and_adamw(model.parameters()), stage=stage, skip_nonfinite=True)
    before = {n: v.clone() for n, v in zero_ext.full_state_dict(model).items()}
    (model(torch.randn(4, 6)).sum() * float("inf")).backward()
    with pytest.warns(UserWarning, match="optimizer step skipped on every rank") as caught:
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert len([w for w in caught if "skipped" in str(w.message)]) == 1
    assert [opt.skipped_steps for opt in opts] == [1, 1]
    after = zero_ext.full_state_dict(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    model(torch.randn(4, 6)).square().mean().backward()  # a finite step then moves every parameter
    for opt in opts:
        opt.step()
        opt.zero_grad()
    after = zero_ext.full_state_dict(model)
    assert all(not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_loss_scale_moves_once_per_step_of_a_models_optimizers(stage):
    """fp16 dynamic loss scaling with [muon, adamw]: an overflow skips both
    and halves the scale once (not once per optimizer); clean steps then
    train both."""
    from whole_param_optimizer_scenarios import muon_and_adamw

    model = WithBiases()
    precision = zero_ext.MixedPrecision(torch.float16, loss_scale=zero_ext.DynamicLossScale(initial_scale=2.0 ** 8))
    model, opts = zero_ext.wrap(model, muon_and_adamw(model.parameters()), stage=stage, mixed_precision=precision)
    scale = model._zero_ext.handles.optimizer.loss_scale()
    (model(torch.randn(4, 6, dtype=torch.float16)).float().sum() * 1e30).backward()  # overflows in fp16
    for opt in opts:
        opt.step()
        opt.zero_grad()
    assert model._zero_ext.handles.optimizer.loss_scale() == scale / 2
    assert [opt.skipped_steps for opt in opts] == [1, 1]
    before = zero_ext.full_state_dict(model)
    model(torch.randn(4, 6, dtype=torch.float16)).float().square().mean().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    after = zero_ext.full_state_dict(model)
    assert all(not torch.equal(before[n], after[n]) for n in before)


def test_accelerate_prepare_refuses_a_list_with_the_way_around():
    """Several optimizers are not wired into accelerate's wrappers: zero_ext's
    own error, naming what works, before anything is wrapped."""
    pytest.importorskip("accelerate")
    from whole_param_optimizer_scenarios import muon_and_adamw

    from zero_ext.integrations.accelerate import prepare

    model = WithBiases()
    with pytest.raises(ValueError, match=r"takes one optimizer.*zero_ext.wrap\(model, \[muon, adamw\]\)"):
        prepare(None, model, muon_and_adamw(model.parameters()))
    assert not hasattr(model, "_zero_ext")


def test_grad_scaler_with_several_optimizers_is_refused_naming_fp16_loss_scaling():
    from whole_param_optimizer_scenarios import muon_and_adamw

    model = WithBiases()
    model, opts = zero_ext.wrap(model, muon_and_adamw(model.parameters()), stage=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    scaler.scale(model(torch.randn(4, 6)).square().mean()).backward()
    with pytest.raises(RuntimeError, match="GradScaler with several optimizers.*mixed_precision='fp16'"):
        scaler.step(opts[0])
