"""The C++ core's bound surface (csrc/core_views.h): one bound class per
concern, none wider than 40 methods, each handle (tools/core_handles.py)
binding exactly what its view offers; the model itself offers no methods and
is built whole from one CoreConfig (tools/core_config.py), so nothing
configures it after construction."""
import dataclasses

import torch
import torch.nn as nn

import zero_ext
from zero_ext.tools import CoreConfig, CoreHandles

WIDEST = 40
# What a handle calls on its view besides BOUND (it converts the result).
CONVERTED = {"reduction": {"grad_layout"}, "diagnostics": {"stats"}, "offload": {"swap_stats"}}
# The calls that configured the model after it was built, before CoreConfig.
CONFIGURE_AFTER_BUILD = ("enable_loss_scaling", "set_skip_nonfinite", "enable_compression", "set_max_live_bytes",
                         "enable_swap", "enable_stall_diagnosis", "enable_collective_checks", "set_unit_names",
                         "set_unit_advice", "keep_gathered_after_forward", "reshard_to_subgroup")


def handles_of(stage: int = 3, **options) -> CoreHandles:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    model, _ = zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage, **options)
    return model._zero_ext.handles


def methods(script_object) -> set:
    return {name for name in script_object._method_names() if not name.startswith("__")}


def test_each_concern_is_a_small_bound_class_bound_whole():
    handles = handles_of()
    widths = {}
    for field in dataclasses.fields(handles):
        handle = getattr(handles, field.name)
        offered = methods(handle._view)
        widths[field.name] = len(offered)
        assert set(handle.BOUND) | CONVERTED.get(field.name, set()) == offered, field.name
    assert max(widths.values()) <= WIDEST, widths
    assert len(widths) == 7


def test_the_model_offers_no_methods_of_its_own():
    model = handles_of().units.model()
    assert methods(model) == set()


def test_nothing_configures_the_model_after_it_is_built():
    handles = handles_of()
    for field in dataclasses.fields(handles):
        view = getattr(handles, field.name)._view
        assert not methods(view) & set(CONFIGURE_AFTER_BUILD), field.name


def test_config_fields_and_defaults_are_the_cores():
    python_side = CoreConfig()
    core_side = python_side.to_core()
    assert {p.name for p in core_side._properties()} == {f.name for f in dataclasses.fields(CoreConfig)}
    for field in dataclasses.fields(CoreConfig):
        assert getattr(core_side, field.name) == getattr(python_side, field.name), field.name


def test_the_config_reaches_the_core():
    handles = handles_of(stage=2, mixed_precision="fp16", skip_nonfinite=True)
    assert handles.optimizer.loss_scaling()
    assert handles.optimizer.loss_scale() == 2.0 ** 16  # DynamicLossScale's default initial scale
    plain = handles_of(stage=2)
    assert not plain.optimizer.loss_scaling() and plain.optimizer.loss_scale() == 1.0
