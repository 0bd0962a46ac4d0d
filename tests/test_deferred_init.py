"""Deferred initialization: a model built under zero_ext.empty_init() (or
torch.device("meta")) is materialized by wrap() module by module, in every
stage at world sizes 1, 2 and 4, with the values the same model constructed
normally from the same seed has; stage 3 never holds more than the root unit
and one unit whole; bad models are refused before any communication, and an
initializer failing on one rank raises on every rank."""
import functools

import pytest
import torch
import torch.nn as nn

import zero_ext
from deferred_init_scenarios import BUILDS, CONFIGS, init_fails_on_one_rank  # noqa: F401
from dist_harness import run_on_ranks
from parity_scenarios import InitBlocks


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_on_ranks(world, "deferred_init_scenarios:check_values_and_bytes", deadline_s=600)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_values_equal_the_normally_built_model_in_every_stage(world):
    results = _results(world)
    failures = [f"rank {r} {label}: {problem}" for r, per_rank in enumerate(results)
                for label, problem in per_rank.items() if problem]
    assert len(results[0]) == len(CONFIGS) * len(BUILDS)
    assert not failures, "\n".join(failures)


def test_an_initializer_failing_on_one_rank_raises_on_every_rank():
    messages = run_on_ranks(2, "deferred_init_scenarios:init_fails_on_one_rank", deadline_s=120)
    for rank, message in enumerate(messages):
        assert "blocks.1.ff" in message and "no weights for this layer" in message \
            and "raised on rank 1" in message, (rank, message)


def test_pretrained_weights_stream_in_after_deferred_init(tmp_path):
    from zero_ext.files.weights import safetensors as st

    torch.manual_seed(5)
    weights = InitBlocks().state_dict()
    del weights["head.weight"]  # the tied alias, as save_pretrained drops it
    st.save_file(str(tmp_path / "model.safetensors"), weights)
    for world in (1, 2):
        problems = run_on_ranks(world, "deferred_init_scenarios:load_after_deferred_init",
                                (str(tmp_path / "model.safetensors"),), deadline_s=120)
        assert problems == [None] * world


def test_skip_init_opens_nothing_is_nan_until_loaded_then_loads(tmp_path):
    from zero_ext.files.weights import safetensors as st

    torch.manual_seed(5)
    weights = InitBlocks().state_dict()
    del weights["head.weight"]
    st.save_file(str(tmp_path / "model.safetensors"), weights)
    for world in (1, 2):
        results = run_on_ranks(world, "deferred_init_scenarios:skip_init_then_load",
                               (str(tmp_path / "model.safetensors"),), deadline_s=300)
        failures = [f"world {world} rank {r} {label}: {problem}" for r, per_rank in enumerate(results)
                    for label, problem in per_rank.items() if problem]
        assert len(results[0]) == len(CONFIGS)
        assert not failures, "\n".join(failures)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01)


class Rotary(nn.Module):
    """A module with a buffer but no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)))


class WithRotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.rotary = Rotary()
        self.scale = nn.Parameter(torch.ones(4))


def test_modules_that_nothing_initializes_are_named():
    with zero_ext.empty_init():
        model = WithRotary()
    # Buffers stay real under empty_init: only the root's own parameter lacks an initializer.
    assert not model.rotary.inv_freq.is_meta
    with pytest.raises(ValueError, match=r"1 modules hold meta.*<root> \(WithRotary: scale\).*param_init_fn"):
        zero_ext.wrap(model, _optimizer(model), stage=3)
    with torch.device("meta"):
        model = WithRotary()
    with pytest.raises(ValueError, match=r"2 modules.*<root> \(WithRotary: scale\).*rotary \(Rotary: inv_freq\)"):
        zero_ext.wrap(model, _optimizer(model), stage=3)


def test_param_init_fn_runs_on_each_module_with_meta_state_in_named_modules_order():
    with torch.device("meta"):
        model = WithRotary()
    calls = []

    def init(module):
        calls.append(type(module).__name__)
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        elif isinstance(module, Rotary):
            module.inv_freq.copy_(torch.tensor([1.0, 0.01]))
        else:
            module.scale.fill_(2.0)

    torch.manual_seed(0)
    model, _ = zero_ext.wrap(model, _optimizer(model), stage=3, param_init_fn=init)
    assert calls == ["WithRotary", "Linear", "Rotary"]
    full = zero_ext.full_state_dict(model)
    torch.manual_seed(0)
    assert torch.equal(full["proj.weight"], nn.Linear(4, 4).weight)
    assert torch.equal(full["scale"], torch.full((4,), 2.0))
    assert torch.equal(model.rotary.inv_freq, torch.tensor([1.0, 0.01]))


def test_meta_buffers_are_initialized_by_reset_parameters():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model, _ = zero_ext.wrap(model, _optimizer(model), stage=2)
    assert torch.equal(model[1].running_var, torch.ones(4)) and int(model[1].num_batches_tracked) == 0
    model(torch.randn(3, 4)).sum().backward()


def test_mixed_meta_and_real_parameters_are_refused():
    with zero_ext.empty_init():
        model = nn.Sequential(nn.Linear(4, 4))
    model.append(nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"mixes meta and real parameters \(real: \['1.weight', '1.bias'\]\)"):
        zero_ext.wrap(model, _optimizer(model), stage=3)


def test_device_and_param_init_fn_need_a_meta_model():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="apply to a model whose parameters are on the meta device"):
        zero_ext.wrap(model, _optimizer(model), param_init_fn=lambda m: None)
    with pytest.raises(ValueError, match="apply to a model whose parameters are on the meta device"):
        zero_ext.wrap(model, _optimizer(model), device="cpu")
    with zero_ext.empty_init():
        model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match="param_init_fn must be a callable"):
        zero_ext.wrap(model, _optimizer(model), param_init_fn=3)
    with pytest.raises(ValueError, match="cannot be 'meta'"):
        zero_ext.wrap(model, _optimizer(model), device="meta")


def test_an_initializer_error_names_the_module_and_leaves_no_hook_installed():
    with zero_ext.empty_init():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def init(module):
        if module is model[1]:
            raise RuntimeError("boom")
        module.reset_parameters()

    with pytest.raises(RuntimeError, match=r"initializing module '1' \(param_init_fn\) failed: boom"):
        zero_ext.wrap(model, _optimizer(model), stage=3, param_init_fn=init)


def test_empty_init_puts_parameters_on_meta_keeps_buffers_and_restores_registration():
    with zero_ext.empty_init():
        layer = nn.BatchNorm1d(4)
    assert layer.weight.is_meta and layer.weight.requires_grad and isinstance(layer.weight, nn.Parameter)
    assert not layer.running_mean.is_meta
    with pytest.raises(KeyError):
        with zero_ext.empty_init():
            raise KeyError("inside")
    assert not nn.Linear(2, 2).weight.is_meta


def test_a_stage3_parameter_reads_as_sharded_after_deferred_init():
    with zero_ext.empty_init():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model, _ = zero_ext.wrap(model, _optimizer(model), stage=3)
    with pytest.raises(RuntimeError, match="zero_ext.full_params"):
        print(model[0].weight)
    with zero_ext.full_params(model):
        assert model[0].weight.abs().sum() > 0


class NonPersistentRotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(2.0) + 1, persistent=False)
        self.register_buffer("running", torch.ones(2))

    def reset_parameters(self):
        pass  # its parameters belong to proj; its buffers are left alone


def test_a_non_persistent_meta_buffer_nothing_fills_is_refused():
    with torch.device("meta"):
        model = NonPersistentRotary()
    with pytest.raises(ValueError, match=r"non-persistent buffer 'inv_freq' \(NonPersistentRotary\).*meta device"):
        zero_ext.wrap(model, _optimizer(model), stage=3)
    with zero_ext.empty_init():  # its buffers stay real
        model = NonPersistentRotary()
    model, _ = zero_ext.wrap(model, _optimizer(model), stage=3)
    assert torch.equal(model.inv_freq, torch.tensor([1.0, 2.0])) and torch.equal(model.running, torch.ones(2))
    with torch.device("meta"):  # a persistent buffer left unfilled is NaN until loaded: loud, not silent
        model = NonPersistentRotary()
    model.inv_freq = torch.ones(2)
    model, _ = zero_ext.wrap(model, _optimizer(model), stage=3)
    assert torch.isnan(model.running).all()


# --- transformers models ------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
def test_a_transformers_model_gets_the_values_normal_construction_gives(world):
    """deepspeed.zero.Init's counterpart (docs/coming-from-deepspeed.md): a
    Llama built from its config under empty_init, wrapped with no
    param_init_fn in every stage, equals the model built normally from the
    same seed, and trains as it does."""
    pytest.importorskip("transformers")
    from deferred_init_scenarios import PRETRAINED_CONFIGS

    results = run_on_ranks(world, "deferred_init_scenarios:pretrained_values", deadline_s=600)
    failures = [f"rank {r} {label}: {problem}" for r, per_rank in enumerate(results)
                for label, problem in per_rank.items() if problem]
    assert len(results[0]) == 2 * len(PRETRAINED_CONFIGS)
    assert not failures, "\n".join(failures)


def test_gpt2_under_empty_init_has_the_distributions_of_normal_construction():
    pytest.importorskip("transformers")
    assert run_on_ranks(2, "deferred_init_scenarios:gpt2_statistics", deadline_s=300) == [None, None]


def test_param_init_fn_init_weights_is_the_default_for_a_transformers_model():
    transformers = pytest.importorskip("transformers")
    from deferred_init_scenarios import llama_config

    config = llama_config(tied=True)
    torch.manual_seed(0)
    want = transformers.LlamaForCausalLM(config).state_dict()
    with zero_ext.empty_init():
        model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    model, _ = zero_ext.wrap(model, _optimizer(model), stage=3, param_init_fn=model._init_weights)
    full = zero_ext.full_state_dict(model)
    assert [n for n, v in want.items() if not torch.equal(full[n], v)] == []


def test_a_transformers_parameter_nothing_initializes_is_named():
    transformers = pytest.importorskip("transformers")
    from deferred_init_scenarios import llama_config

    class WithGain(transformers.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.gain = nn.Parameter(torch.ones(4))  # after post_init: neither reset_parameters nor _init_weights

    with zero_ext.empty_init():
        model = WithGain(llama_config(tied=False))
    with pytest.raises(ValueError, match=r"1 parameters .* neither by a reset_parameters\(\) nor by its _init_weights: "
                       r"gain \(WithGain\)\. .*param_init_fn"):
        zero_ext.wrap(model, _optimizer(model), stage=3)
