"""Stage 3's default units policy: consecutive small blocks merge into units of
at least bucket_mb (explicit units= never merge), parameters go to the right
unit, only modules that run a forward of their own on every rank are chosen
(no MoE experts, no ModuleDict/ModuleList), and merged units train exactly
like one process (world sizes 1 and 2, tests/units_scenarios.py)."""
import functools
import os

import pytest
import torch
import torch.nn as nn

import zero_ext
from alongside import step_alongside
from zero_ext.wrapping.units import assign_parameters, resolve_units

MiB = 2 ** 20


class Stack(nn.Module):
    def __init__(self, n_blocks: int, dim: int):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def nbytes(unit) -> int:
    return sum(p.numel() * p.element_size() for m in unit for p in m.parameters())


def merged_blocks(units):
    return [m for unit in units[1:] for m in unit]


def test_a_thousand_tiny_blocks_merge_into_few_units_of_at_least_the_threshold():
    model = Stack(1000, 32)  # 4224 bytes per block, 4.03 MiB in all
    units = resolve_units(model, None, min_bytes=MiB)
    assert units[0] == (model,)
    assert merged_blocks(units) == list(model.blocks)  # every block once, in order
    assert len(units) - 1 == 4
    assert all(nbytes(u) >= MiB for u in units[1:])
    # each unit is a run of consecutive blocks
    for unit in units[1:]:
        first = list(model.blocks).index(unit[0])
        assert list(unit) == list(model.blocks)[first:first + len(unit)]


def test_blocks_below_the_threshold_in_all_make_one_unit():
    model = Stack(1000, 32)
    units = resolve_units(model, None, min_bytes=25 * MiB)  # wrap()'s default bucket_mb
    assert len(units) == 2 and units[1] == tuple(model.blocks)


def test_wrap_merges_blocks_to_4_mib_not_to_the_bucket_size():
    # Eight 1.13 MiB blocks: merged in runs reaching 4 MiB (stage 3 holds
    # several buffers of its largest unit at once: units.py), whatever larger
    # bucket_mb is passed; a bucket_mb under 4 merges to it instead.
    for bucket_mb, runs in ((None, 2), (25.0, 2), (100.0, 2), (2.0, 4)):
        model = Stack(8, 544)
        options = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
        zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, **options)
        assert model._zero_ext.handles.diagnostics.stats()["units"] == 1 + runs, bucket_mb


def test_the_remainder_joins_the_unit_before_it():
    model = Stack(10, 32)
    units = resolve_units(model, None, min_bytes=4 * 4224)  # 4 blocks reach it
    assert [len(u) for u in units[1:]] == [4, 6]


def test_blocks_of_at_least_the_threshold_stay_one_unit_each():
    model = Stack(5, 64)  # 16640 bytes per block
    units = resolve_units(model, None, min_bytes=16640)
    assert units[1:] == [(b,) for b in model.blocks]
    assert resolve_units(model, None, min_bytes=0)[1:] == [(b,) for b in model.blocks]


def test_a_big_block_or_a_sibling_of_another_class_ends_a_run():
    big = nn.Linear(64, 64)
    seq = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8),
                        nn.Linear(8, 8), big, nn.Linear(8, 8), nn.Linear(8, 8))
    units = resolve_units(seq, None, min_bytes=4 * 64 * 64)
    assert units[1:] == [(seq[0], seq[1]), (seq[3], seq[4], seq[5]), (big,), (seq[7], seq[8])]
    owner = assign_parameters(seq, units)
    assert owner[id(seq[2].weight)] == 0  # the LayerNorm (its class does not repeat) stays in the root


def test_parameter_free_siblings_between_blocks_are_members():
    seq = nn.Sequential(nn.Tanh(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(), nn.Linear(8, 2),
                        nn.Tanh())
    units = resolve_units(seq, None, min_bytes=MiB)
    assert units[1:] == [tuple(seq[1:6])]  # not the leading or trailing activation


def test_explicit_units_are_never_merged():
    model = Stack(20, 8)
    for policy in ({nn.Linear}, lambda m: isinstance(m, nn.Linear)):
        units = resolve_units(model, policy, min_bytes=25 * MiB)
        assert units[1:] == [(model.embed,)] + [(b,) for b in model.blocks]
    wrapped = Stack(20, 8)
    zero_ext.wrap(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), stage=3, units={nn.Linear})
    assert wrapped._zero_ext.handles.diagnostics.stats()["units"] == 22


# --- only modules that run a forward of their own on every rank every step ---------

def test_experts_inside_blocks_stay_in_their_block():
    from units_scenarios import TinyMoeModel  # named like transformers' Qwen2MoeModel: /moe/ in the owner's class

    model = TinyMoeModel()
    units = resolve_units(model, None, min_bytes=0)
    assert units[1:] == [(layer,) for layer in model.blocks]
    owner = assign_parameters(model, units)
    for i, layer in enumerate(model.blocks):
        assert all(owner[id(p)] == 1 + i for p in layer.mlp.experts.parameters())
    merged = resolve_units(model, None, min_bytes=MiB)
    assert merged[1:] == [tuple(model.blocks)]  # small blocks still merge; nothing below them is a unit


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(8, 8)

    def forward(self, x):
        return self.w(x)


class FFN(Expert):
    pass


class MoELayer(nn.Module):
    def __init__(self, attribute: str, expert: type):
        super().__init__()
        self.router = nn.Linear(8, 4)
        setattr(self, attribute, nn.ModuleList(expert() for _ in range(4)))


class Router(MoELayer):
    pass


@pytest.mark.parametrize("layer", [
    lambda: Router("experts", FFN),  # the attribute's name
    lambda: Router("ffns", Expert),  # the experts' class
    lambda: MoELayer("ffns", FFN),  # the owner's class
], ids=["attribute", "expert_class", "owner_class"])
def test_experts_of_an_moe_outside_any_block_are_no_units(layer):
    model = nn.Module()
    model.embed = nn.Linear(8, 8)
    model.moe = layer()
    assert resolve_units(model, None, min_bytes=0) == [(model,)]


class DictBlocksModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"act": nn.GELU(), "attn": nn.Linear(8, 8), "mlp": nn.Linear(8, 8)}) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer["mlp"](layer["act"](layer["attn"](x)))
        return x


def test_a_block_kept_as_a_module_dict_is_one_unit_of_its_parts():
    model = DictBlocksModel()
    for min_bytes in (0, MiB):  # never merged with its neighbours
        units = resolve_units(model, None, min_bytes=min_bytes)
        assert units[1:] == [(layer["attn"], layer["mlp"]) for layer in model.layers]
    owner = assign_parameters(model, units)
    for i, layer in enumerate(model.layers):
        assert all(owner[id(p)] == 1 + i for p in layer.parameters())


class ParallelLists(nn.Module):
    """Norms and linears in parallel lists, in a ModuleList the parent indexes."""

    def __init__(self):
        super().__init__()
        self.stacks = nn.ModuleList([nn.ModuleList(nn.LayerNorm(8) for _ in range(3)),
                                     nn.ModuleList(nn.Linear(8, 8) for _ in range(3))])

    def forward(self, x):
        for norm, linear in zip(*self.stacks):
            x = x + torch.tanh(linear(norm(x)))
        return x


class PairLists(nn.Module):
    """A ModuleList of [LayerNorm, Linear] pairs."""

    def __init__(self):
        super().__init__()
        self.pairs = nn.ModuleList(nn.ModuleList([nn.LayerNorm(8), nn.Linear(8, 8)]) for _ in range(3))

    def forward(self, x):
        for norm, linear in self.pairs:
            x = x + torch.tanh(linear(norm(x)))
        return x


class NestedDicts(nn.Module):
    """A block holding a forward-less container with parameters: no unit."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(8, 8), "mlps": nn.ModuleList([nn.Linear(8, 8)])})
                                    for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer["mlps"][0](layer["attn"](x))
        return x


@pytest.mark.parametrize("build,expected", [
    (ParallelLists, lambda model: [tuple(stack) for stack in model.stacks]),
    (PairLists, lambda model: [tuple(pair) for pair in model.pairs]),
    (NestedDicts, lambda model: []),
], ids=["parallel_lists", "pair_lists", "nested_dicts"])
def test_no_container_without_forward_is_a_unit_and_training_works(build, expected):
    import copy

    torch.manual_seed(0)
    model = build()
    units = resolve_units(model, None, min_bytes=25 * MiB)
    assert all(type(m).forward is not nn.Module.forward for unit in units[1:] for m in unit)
    assert units[1:] == expected(model)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    zero_ext.wrap(model, opt, stage=3)
    for step in range(2):
        x = torch.randn(4, 8)
        step_alongside(((model, opt), (reference, ref_opt)), x)
    full = zero_ext.full_state_dict(model)
    for name, p in reference.state_dict().items():
        assert torch.equal(full[name], p), name


@pytest.mark.parametrize("policy", [lambda m: isinstance(m, nn.ModuleDict), {nn.ModuleDict}])
def test_explicit_units_without_a_forward_are_refused_by_path(policy):
    model = DictBlocksModel()
    with pytest.raises(ValueError, match=r"'layers\.0'.*pass the classes of the blocks inside it, or leave units=None"):
        zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, units=policy)


def test_transformers_moe_models_keep_their_layers_as_units():
    """Qwen2MoeModel's class matches /moe/, yet its layers (each holding an
    MoE) are no expert list: the owner-class rule must not skip them."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=16,
                                         moe_intermediate_size=8, shared_expert_intermediate_size=8,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         num_experts=4, num_experts_per_tok=1)
    model = transformers.Qwen2MoeForCausalLM(config)
    units = resolve_units(model, None, min_bytes=0)
    assert units[1:] == [(layer,) for layer in model.model.layers]


def test_tied_weights_belong_to_the_closest_common_unit():
    model = Stack(6, 8)
    model.head = nn.Linear(8, 8)
    model.blocks[1].weight = model.blocks[0].weight  # inside one merged unit
    model.blocks[5].weight = model.blocks[2].weight  # across two merged units
    model.head.weight = model.blocks[3].weight  # a block and the root
    units = resolve_units(model, None, min_bytes=3 * 4 * 72)
    assert [len(u) for u in units[1:]] == [3, 3]
    owner = assign_parameters(model, units)
    assert owner[id(model.blocks[0].weight)] == 1
    assert owner[id(model.blocks[2].weight)] == 0
    assert owner[id(model.blocks[3].weight)] == 0
    assert owner[id(model.blocks[4].weight)] == 2 and owner[id(model.blocks[0].bias)] == 1


def test_merged_units_train_like_the_plain_model_in_one_process():
    """World size 1 without torch.distributed: a merged Sequential against the
    plain model, bit for bit, with a member called on its own and a no-grad
    forward in between; 1000 blocks cost 3 all-gathers per step, not 2000."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(1000)))
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    zero_ext.wrap(model, opt, stage=3)
    stats = model._zero_ext.handles.diagnostics.stats
    assert stats()["units"] == 2
    for step in range(3):
        x = torch.randn(4, 32)
        for m, o in ((model, opt), (reference, ref_opt)):
            before = stats()["param_gathers"] if m is model else 0
            (m(x).square().mean() + m[7](x).sum() * 1e-3).backward()
            if m is model:
                # forward: the model 1, the call on its own 1; backward: 1 for both uses
                assert stats()["param_gathers"] - before == 3
            o.step()
            o.zero_grad()
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
        assert stats()["gathered_units"] == 0
    full = zero_ext.full_state_dict(model)
    for name, p in reference.state_dict().items():
        assert torch.equal(full[name], p), name


# --- several ranks ----------------------------------------------------------------

WORLD_SIZES = tuple(int(w) for w in os.environ.get("ZERO_EXT_UNITS_WORLDS", "1,2").split(","))


def scenario_names():
    from units_scenarios import SCENARIOS
    return list(SCENARIOS)


@functools.lru_cache(maxsize=None)
def group_results(world: int):
    from dist_harness import run_items_on_ranks
    return run_items_on_ranks(world, "units_scenarios:run_one", scenario_names(), item_deadline_s=180)


@pytest.mark.parametrize("name", scenario_names())
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_merged_units_match_one_process(world, name):
    from dist_harness import assert_item_matched
    assert_item_matched(world, group_results(world)[name])


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(self.norm(h))


def test_a_list_of_modules_is_one_unit_and_a_container_stands_for_its_children():
    model = _Head()
    units = resolve_units(model, [[model.head, model.norm], model.blocks, model.embed])
    assert units == [(model,), (model.embed,), tuple(model.blocks), (model.norm, model.head)]


@pytest.mark.parametrize("listing,match", [
    (lambda m: [[m.blocks[0], m.head]], "children of one module"),
    (lambda m: [m.head, [m.head, m.norm]], "lists 'head' twice"),
    (lambda m: [m], "not a submodule"),
    (lambda m: [nn.Linear(2, 2)], "not a submodule"),
])
def test_a_bad_listing_of_units_is_refused(listing, match):
    model = _Head()
    with pytest.raises(ValueError, match=match):
        resolve_units(model, listing(model))


def test_wrap_gathers_a_listed_group_by_its_members_hooks():
    model = _Head()
    model, _ = zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3,
                             units=[[model.embed, model.norm, model.head], model.blocks])
    hooked = [name for name, m in model.named_modules() if m.__dict__.get("_zero_ext_forward_hooks")]
    assert hooked == ["", "embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    assert model(torch.ones(2, 4)).shape == (2, 2)


# --- experts: recognized by their router, or named by the error ----------------

class Gated(nn.Module):
    """An MoE layer by structure only: its class and experts' names say nothing."""

    def __init__(self, router: str, as_parameter: bool = False, expert: type = FFN):
        super().__init__()
        if as_parameter:
            setattr(self, router, nn.Parameter(torch.zeros(8, 4)))
        else:
            setattr(self, router, nn.Linear(8, 4))
        self.ffns = nn.ModuleList(expert() for _ in range(4))

    def forward(self, x):
        return sum(ffn(x) for ffn in self.ffns)


@pytest.mark.parametrize("router,as_parameter", [
    ("gate", False), ("router", False), ("switch", False), ("gating", False), ("w_gate", True),
    ("router_weight", True), ("gate_linear", False),
])
def test_experts_beside_a_router_are_no_units(router, as_parameter):
    """The MoE layer held by the model (outside any block) and in a block of
    its own (its class does not repeat): no expert is a unit."""
    model = nn.Module()
    model.embed = nn.Linear(8, 8)
    model.moe = Gated(router, as_parameter)
    assert resolve_units(model, None, min_bytes=0) == [(model,)]
    stack = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Gated(router, as_parameter))
    assert resolve_units(stack, None, min_bytes=0)[1:] == [(stack[0],), (stack[1],)]


class GluFFN(nn.Module):
    """A gated expert: its `gate` is a GLU's, not a router (no container beside it)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 8)
        self.up = nn.Linear(8, 8)

    def forward(self, x):
        return self.up(x) * torch.sigmoid(self.gate(x))


class SparseMoeLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.scorer = nn.Linear(8, 4)
        self.ffns = nn.ModuleList(GluFFN() for _ in range(4))


@pytest.mark.parametrize("layer", [lambda: Gated("gate", expert=GluFFN), SparseMoeLayer], ids=["router", "moe_class"])
def test_gated_experts_are_experts_still(layer):
    """Experts with a GLU `gate` of their own do not pass for MoE layers (the
    rule that keeps the layers of an MoE model units must not see them)."""
    model = nn.Module()
    model.embed = nn.Linear(8, 8)
    model.moe = layer()
    assert resolve_units(model, None, min_bytes=0) == [(model,)]


def test_a_gated_mlp_projection_is_no_router():
    """`gate_proj` (a gated MLP's projection, as in Llama) beside a list of
    layers does not make them experts."""
    model = nn.Module()
    model.gate_proj = nn.Linear(8, 8)
    model.ffns = nn.ModuleList(FFN() for _ in range(3))
    assert resolve_units(model, None, min_bytes=0)[1:] == [(f,) for f in model.ffns]


def test_layers_beside_a_router_that_hold_mixtures_stay_units():
    """A model with a router of its own whose layers each hold an MoE: the
    layers are no experts."""
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = Gated("gate")

        def forward(self, x):
            return self.mlp(x)

    model = nn.Module()
    model.router = nn.Linear(8, 2)
    model.layers = nn.ModuleList(Layer() for _ in range(2))
    assert resolve_units(model, None, min_bytes=0)[1:] == [(layer,) for layer in model.layers]


def test_unit_advice_names_the_caller_and_a_units_value():
    from units_scenarios import BlocksAndSparseLayer, SparseMLP
    from zero_ext.wrapping.unit_advice import unit_advice

    model = BlocksAndSparseLayer()
    units = resolve_units(model, None, min_bytes=0)
    assert [u[0] for u in units[1:]] == [*model.blocks, *model.moe.ffns]  # the experts' names are unknown to it
    advice = unit_advice(model, units, default_policy=True)
    assert advice[0] == "" and len(advice) == len(units)
    expert = advice[1 + len(model.blocks)]
    assert "the modules in 'moe.ffns' (SparseMLP)" in expert
    assert "the unit of 'moe' (SparseLayer)" in expert and "units={Block, SparseLayer}" in expert
    assert all(a == expert for a in advice[1 + len(model.blocks):])  # the same for every expert
    # explicit units={SparseMLP}: the caller alone
    units = resolve_units(model, {SparseMLP}, min_bytes=0)
    assert "units={SparseLayer}" in unit_advice(model, units, default_policy=False)[1]


def test_an_expert_skipped_on_one_rank_names_its_units_and_what_to_pass():
    """Experts the default policy cannot recognize (`ffns` of SparseMLP,
    routed by a `scorer`), skipped differently per rank: every rank stops
    within seconds with zero_ext's error naming the experts' units, their
    caller and the units= to pass, and no longer claims the default policy
    kept them in their block; a model wrapped with that units= trains
    through the same routing."""
    from dist_harness import run_on_ranks

    outcomes = run_on_ranks(2, "units_scenarios:unrecognized_experts_skipped", deadline_s=240)
    for rank, out in enumerate(outcomes):
        error = out["error"]
        assert out["units"] == 1 + 3 + 4, out  # root, 3 blocks, 4 experts
        assert error is not None and error.startswith("zero_ext: "), (rank, out)
        assert out["seconds"] < 15, (rank, out["seconds"])
        assert "'moe.ffns." in error, error
        assert "About unit" in error and "the modules in 'moe.ffns' (SparseMLP)" in error, error
        assert "keep them in the unit of 'moe' (SparseLayer)" in error, error
        assert "wrap(..., units={Block, SparseLayer})" in error, error
        assert "as the default units policy does" not in error, error
        assert out["suggested"][0] == "Block, SparseLayer", out
        assert out["after"] is not None and len(out["after"]) == 3, out
