"""reshard_after_forward (False, per unit, the ints that mean True/False),
model.unshard()/reshard(), against one process over the global batch at
world sizes 1, 2 and 4 (tests/reshard_scenarios.py), and wrap()'s refusals."""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn as nn

import zero_ext
from alongside import step_alongside
from reshard_scenarios import ON_HYBRID_MESH, SUBGROUP_SCENARIOS

WORLD_SIZES = tuple(int(w) for w in os.environ.get("ZERO_EXT_RESHARD_WORLDS", "1,2,4").split(","))


def scenario_names():
    """Those run with every unit kept (regathers_within_subgroups needs world 4)."""
    from reshard_scenarios import SCENARIOS
    return [name for name in SCENARIOS if name != "regathers_within_subgroups"]


def items(world: int):
    if world != 4:
        return scenario_names()
    return (scenario_names() + [f"{name}/mesh2x2" for name in ON_HYBRID_MESH]
            + [f"{name}/sub2" for name in SUBGROUP_SCENARIOS])


@functools.lru_cache(maxsize=None)
def group_results(world: int):
    from dist_harness import run_items_on_ranks
    return run_items_on_ranks(world, "reshard_scenarios:run_one", items(world), item_deadline_s=180)


@pytest.mark.parametrize("name", scenario_names())
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_kept_units_match_one_process(world, name):
    from dist_harness import assert_item_matched
    assert_item_matched(world, group_results(world)[name])


@pytest.mark.skipif(4 not in WORLD_SIZES, reason="world size 4 not selected")
@pytest.mark.parametrize("name", SUBGROUP_SCENARIOS)
def test_units_resharded_to_subgroups_match_one_process(name):
    """reshard_after_forward=2 at world 4."""
    from dist_harness import assert_item_matched
    assert_item_matched(4, group_results(4)[f"{name}/sub2"])


# World 8 as a 2 x 4 mesh: units resharded to subgroups of 2 within each row of 4.
ON_MESH_2X4 = ["regathers_within_subgroups", "checkpoint_each_block_nonreentrant", "no_sync_accumulation",
               "explicit_unshard_and_reshard"]


@functools.lru_cache(maxsize=None)
def mesh_2x4_results():
    from dist_harness import run_items_on_ranks
    return run_items_on_ranks(8, "reshard_scenarios:run_one", [f"{n}/mesh2x4/sub2" for n in ON_MESH_2X4],
                              item_deadline_s=180)


@pytest.mark.skipif(4 not in WORLD_SIZES, reason="world size 4 not selected")
@pytest.mark.parametrize("name", ON_MESH_2X4)
def test_units_resharded_to_subgroups_of_a_mesh_row_match_one_process(name):
    from dist_harness import assert_item_matched
    assert_item_matched(8, mesh_2x4_results()[f"{name}/mesh2x4/sub2"])


@pytest.mark.skipif(4 not in WORLD_SIZES, reason="world size 4 not selected")
@pytest.mark.parametrize("name", ON_HYBRID_MESH)
def test_kept_units_on_a_hybrid_mesh_match_one_process(name):
    from dist_harness import assert_item_matched
    assert_item_matched(4, group_results(4)[f"{name}/mesh2x2"])


def _blocks():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))


@pytest.mark.parametrize("value", [True, 1, "no"])
def test_stages_0_to_2_refuse_resharding(value):
    model = _blocks()
    with pytest.raises((ValueError, TypeError), match="reshard_after_forward"):
        zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=2, reshard_after_forward=value
                      if value != 1 else 2)


def test_stage_2_accepts_false():
    """False at stage 2 asks for what stage 2 does (parameters kept whole):
    the model wraps as stage 2 and trains like the unwrapped one."""
    torch.manual_seed(0)
    model, reference = _blocks(), _blocks()
    reference.load_state_dict(model.state_dict())
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    model, opt = zero_ext.wrap(model, opt, stage=2, reshard_after_forward=False)
    state = model._zero_ext
    assert (state.stage, state.params_sharded, state.grads_sharded) == (2, False, True)
    x = torch.randn(3, 4)
    for _ in range(2):
        step_alongside(((model, opt), (reference, ref_opt)), x)
    full = zero_ext.full_state_dict(model)
    assert set(full) == set(reference.state_dict())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value)


@pytest.mark.parametrize("value, match", [(0, ">= 1"), (3.0, "must be True, False"), (2, "must divide the shard")])
def test_bad_values_are_refused(value, match):
    model = _blocks()
    with pytest.raises((ValueError, TypeError), match=match):
        zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, units={nn.Linear},
                      reshard_after_forward=value)


def test_members_of_one_unit_must_agree():
    model = _blocks()
    with pytest.raises(ValueError, match="answers differently for the members"):
        zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3,
                      units=[[model[0], model[1]]], reshard_after_forward=lambda m: m is model[0])


def test_ints_one_and_the_group_size_mean_false_and_true():
    for value, kept in ((1, 3), (True, 0), (False, 3)):
        model = _blocks()
        model, _ = zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, units={nn.Linear},
                                 reshard_after_forward=value)
        assert model._zero_ext.handles.diagnostics.stats()["units_kept_after_forward"] == kept, value


def test_unshard_and_reshard_do_nothing_below_stage_3():
    model = _blocks()
    model, _ = zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=2)
    assert model.unshard() is None
    model.unshard(async_op=True).wait()
    model.reshard()
    assert model(torch.ones(1, 4)).shape == (1, 2)


class _TiedHead(nn.Module):
    """A unit with no parameter of its own: it reads the embedding's."""

    def __init__(self, embed):
        super().__init__()
        self.weight = embed.weight

    def forward(self, x):
        return x @ self.weight.t()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = _TiedHead(self.embed)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.parametrize("how", ["kept", "prefetch"])
def test_a_last_unit_without_parameters_of_its_own(how):
    """The tied head is the last unit and owns no parameter (the root holds
    the embedding): keeping units and prefetch lists naming it work, and
    training equals the unwrapped model's."""
    torch.manual_seed(0)
    model = _TiedModel()
    reference = _TiedModel()
    reference.load_state_dict(model.state_dict())
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    options = {"reshard_after_forward": False} if how == "kept" else {}
    model, opt = zero_ext.wrap(model, opt, stage=3, units={_Block, _TiedHead}, **options)
    if how == "prefetch":
        zero_ext.set_modules_to_forward_prefetch(model.blocks[0], model.blocks[1:] + [model.head])
    tokens = torch.randint(0, 10, (2, 5))
    for _ in range(2):
        step_alongside(((model, opt), (reference, ref_opt)), tokens)
    full = zero_ext.full_state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value)
