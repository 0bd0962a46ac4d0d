"""wrap()'s offload_params and offload_path (SPEC "Beyond device and host
memory"): checked before anything changes, with errors that say what to
pass; offload_params="cpu" on a CPU model is accepted and recorded (the
ranks compare it), changes nothing else of the plan and trains exactly as
without it; on a model on an accelerator it is refused."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import zero_ext
from zero_ext.tools import state_of
from zero_ext.wrapping import plan as wrap_plan


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: t.clone() for n, t in zero_ext.full_state_dict(model).items()}


def planned(offload_params):
    """What wrap() checks and plans (wrapping/plan.py) for make()'s model at stage 3."""
    model, opt = make()
    return wrap_plan.check_and_plan(
        model, opt, stage=3, process_group=None, mixed_precision=None, offload_optimizer=None,
        offload_params=offload_params, offload_path=None, units=None, bucket_mb=None, timeout=None, prefetch=1,
        skip_nonfinite=False, device=None, param_init_fn=None, reshard_after_forward=None, max_live_mb=None,
        persist_kb=None, compress_weights=None, compress_grads=None)


def test_offload_params_cpu_on_a_cpu_model_is_recorded_and_changes_nothing_else():
    """The shards of a CPU model are host memory already: "cpu" is kept in
    the options and in what the ranks compare at wrap() (two ranks passing
    different values are refused: tests/real_models_scenarios.py,
    wrap_different_offload_params), and nothing else of the plan moves: no
    offload file, the default buckets, the same layout."""
    plain, cpu = planned(None), planned("cpu")
    assert cpu.model_device == torch.device("cpu")
    assert cpu.options == dataclasses.replace(plain.options, offload_params="cpu")
    assert not cpu.nvme and cpu.options.offload_path is None and cpu.options.persist_bytes == 0
    assert cpu.options.bucket_bytes == plain.options.bucket_bytes
    assert [f for f in cpu.fields if f not in plain.fields] == [("offload_params", "cpu", "offload_params='cpu'")]
    assert [f for f in plain.fields if f not in cpu.fields] == [("offload_params", None, "offload_params=None")]
    assert (cpu.counts, cpu.unit_of_bucket, cpu.names, cpu.unit_names) == \
        (plain.counts, plain.unit_of_bucket, plain.names, plain.unit_names)


def test_offload_params_cpu_on_an_accelerator_model_is_refused(monkeypatch):
    """The other branch, planned on this CPU-only machine: a model that
    would be materialized on cuda (a stand-in for plan_deferred's answer)
    plans without offload_params, and is refused with it."""
    monkeypatch.setattr(wrap_plan, "plan_deferred", lambda *args: types.SimpleNamespace(device=torch.device("cuda", 0)))
    assert planned(None).model_device == torch.device("cuda", 0)
    with pytest.raises(NotImplementedError, match="offload_params='cpu' for a model on cuda is not available"):
        planned("cpu")


def test_offload_params_cpu_on_a_cpu_model_trains_exactly_as_without():
    plain = train(*zero_ext.wrap(*make(), stage=3))
    model, opt = zero_ext.wrap(*make(), stage=3, offload_params="cpu")
    state = state_of(model)
    assert not state.offload and state.offload_path is None and not state.streams_optimizer
    offloaded = train(model, opt)
    for name, value in plain.items():
        assert torch.equal(offloaded[name], value), name


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_params_needs_stage_3(stage):
    model, opt = make()
    with pytest.raises(ValueError, match="offload_params='cpu' needs stage=3"):
        zero_ext.wrap(model, opt, stage=stage, offload_params="cpu")
    assert type(model) is torch.nn.Sequential  # nothing changed


def test_offload_values_are_checked():
    model, opt = make()
    with pytest.raises(ValueError, match="offload_params must be None, 'cpu' or 'nvme', got 'disk'"):
        zero_ext.wrap(model, opt, stage=3, offload_params="disk")


@pytest.mark.parametrize("option", ["offload_optimizer", "offload_params"])
def test_nvme_needs_an_offload_path(option):
    model, opt = make()
    with pytest.raises(ValueError, match="'nvme' offload needs offload_path=DIR"):
        zero_ext.wrap(model, opt, stage=3, **{option: "nvme"})


def test_an_offload_path_without_nvme_is_refused(tmp_path):
    model, opt = make()
    with pytest.raises(ValueError, match="offload_path is where 'nvme' offload keeps its files"):
        zero_ext.wrap(model, opt, stage=3, offload_optimizer="cpu", offload_path=str(tmp_path))


def test_an_unusable_offload_path_is_refused_before_anything_changes(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    model, opt = make()
    with pytest.raises(ValueError, match="offload_path .* is not a directory"):
        zero_ext.wrap(model, opt, stage=2, offload_optimizer="nvme", offload_path=str(blocker))
    assert type(model) is torch.nn.Sequential


def test_nvme_creates_its_directory_and_leaves_nothing_in_it(tmp_path):
    model, opt = make()
    target = tmp_path / "offload" / "run1"
    model, opt = zero_ext.wrap(model, opt, stage=3, offload_optimizer="nvme", offload_params="nvme", offload_path=target)
    assert target.is_dir() and list(target.iterdir()) == []  # each file unlinked once open
    train(model, opt, steps=1)
    assert list(target.iterdir()) == []


def test_the_integrations_take_the_offload_options():
    """Lightning's strategy takes them by keyword; accelerate and the HF
    Trainer take wrap()'s signature as their option list."""
    pytest.importorskip("lightning")
    from zero_ext.integrations._common import WRAP_OPTIONS
    from zero_ext.integrations.lightning import ZeroExtStrategy

    assert {"offload_params", "offload_path"} <= set(WRAP_OPTIONS)
    strategy = ZeroExtStrategy(stage=3, offload_params="cpu")
    assert strategy._wrap_options["offload_params"] == "cpu" and strategy._wrap_options["offload_path"] is None
