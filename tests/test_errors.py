"""Bad input: each gets an error whose message names the problem and the fix."""
import pytest
import torch
import torch.nn as nn

import zero_ext
from alongside import step_alongside
from errors_common import make, train_step


@pytest.mark.parametrize("stage", [-1, 4])
def test_stage_outside_range(stage):
    model, opt = make()
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        zero_ext.wrap(model, opt, stage=stage)


@pytest.mark.parametrize("stage", ["2", 2.5, 3.0, True, None])
def test_stage_of_another_type(stage):
    model, opt = make()
    with pytest.raises(TypeError, match="stage must be the int 0, 1, 2 or 3"):
        zero_ext.wrap(model, opt, stage=stage)


def test_optimizer_over_other_parameters():
    model, _ = make()
    other, other_opt = make(1)
    with pytest.raises(ValueError, match="not parameters of this model.*model.parameters"):
        zero_ext.wrap(model, other_opt, stage=1)


def test_trainable_parameter_missing_from_optimizer():
    model, _ = make()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"not in the optimizer.*freeze them"):
        zero_ext.wrap(model, opt, stage=1)


def test_wrap_twice():
    model, opt = make()
    zero_ext.wrap(model, opt, stage=1)
    with pytest.raises(ValueError, match="already wrapped"):
        zero_ext.wrap(model, opt, stage=1)


def test_wrap_submodule_of_wrapped_model():
    model, opt = make()
    zero_ext.wrap(model, opt, stage=2)
    with pytest.raises(ValueError, match="already wrapped"):
        zero_ext.wrap(model[0], torch.optim.SGD(model[0].parameters(), lr=0.1), stage=2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_reading_across_parameters(stage):
    model, _ = make()
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(TypeError, match="LBFGS reads across parameters.*stage=0"):
        zero_ext.wrap(model, opt, stage=stage)


def test_no_trainable_parameters():
    model, opt = make()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        zero_ext.wrap(model, opt, stage=2)


def test_not_a_module_or_optimizer():
    model, opt = make()
    with pytest.raises(TypeError, match="torch.nn.Module"):
        zero_ext.wrap(object(), opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        zero_ext.wrap(model, object())


def test_optimizer_that_already_stepped():
    model, _ = make()
    opt = torch.optim.Adam(model.parameters())
    train_step(model, opt)
    with pytest.raises(ValueError, match="already has state"):
        zero_ext.wrap(model, opt, stage=1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameter_replaced_by_new_object_after_wrap(stage):
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    train_step(model, opt)
    model[2].weight = nn.Parameter(torch.zeros(2, 8))
    model(torch.randn(3, 4)).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"changed after zero_ext.wrap\(\).*2.weight"):
        opt.step()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameter_data_swapped_to_other_dtype_after_wrap(stage):
    """The accumulator is re-created, so the hook would never see the gradient."""
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    train_step(model, opt)
    for layer in model:  # Module._apply assigns param.data: new accumulators (the root refuses it)
        layer.double()
    with pytest.raises(RuntimeError, match=r"'\d.(weight|bias)' got a gradient that zero_ext never saw"):
        model(torch.randn(3, 4, dtype=torch.float64)).square().mean().backward()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bypassed_hook_is_caught_without_forward_hooks(stage):
    """Submodules called directly: no output hook ran, so the epilogue is armed
    by the first gradient hook, and it still catches the bypassed layer."""
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    model[0].double()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"'0.(weight|bias)' got a gradient that zero_ext never saw"):
        model[2](torch.tanh(model[0](x)).float()).square().mean().backward()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bypassed_hooks_are_caught_at_step(stage):
    """No hook of zero_ext ran in that backward at all: step() catches it."""
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    for layer in model:
        layer.double()
    x = torch.randn(3, 4, dtype=torch.float64)
    model[2](torch.tanh(model[0](x))).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"(got a gradient that zero_ext never saw|zero_ext did not reduce)"):
        opt.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameter_storage_swapped_after_wrap(stage):
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    model[0].bias.data = torch.zeros(8)
    model(torch.randn(3, 4)).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"storage of parameter '0.bias' was replaced"):
        opt.step()


@pytest.mark.parametrize("bad", [{"mixed_precision": "int8"}, {"offload_optimizer": "disk"},
                                 {"bucket_mb": 0}, {"timeout": -1}])
def test_bad_option_values(bad):
    model, opt = make()
    with pytest.raises(ValueError, match="|".join(bad)):
        zero_ext.wrap(model, opt, **bad)


def test_model_on_several_devices():
    model, opt = make()
    model.register_buffer("meta_buf", torch.zeros(1, device="meta"))
    with pytest.raises(ValueError, match="several devices.*model.to"):
        zero_ext.wrap(model, opt)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_after_only_no_sync_backward(stage):
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    with model.no_sync():
        model(torch.randn(3, 4)).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"did not reduce.*no_sync\(\)"):
        opt.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_before_any_backward_is_a_noop(stage):
    model, opt = make()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero_ext.wrap(model, opt, stage=stage)
    opt.step()
    after = zero_ext.full_state_dict(model)
    for n in before:
        assert torch.equal(after[n], before[n])


def test_units_outside_stage_3_or_matching_nothing():
    model, opt = make()
    with pytest.raises(ValueError, match="units only applies to stage 3"):
        zero_ext.wrap(model, opt, stage=2, units={nn.Linear})
    with pytest.raises(ValueError, match="matched no submodule"):
        zero_ext.wrap(model, opt, stage=3, units={nn.Conv2d})
    with pytest.raises(TypeError, match="set of nn.Module classes, a callable"):
        zero_ext.wrap(model, opt, stage=3, units="blocks")


class FailingBackward(torch.autograd.Function):
    fail = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if FailingBackward.fail:
            raise RuntimeError("injected failure in backward")
        return grad


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_training_recovers_after_a_backward_that_raised(stage):
    """No epilogue runs when a node throws; the next forward resets the round."""
    model, opt = make()
    reference, ref_opt = make()
    reference.load_state_dict(model.state_dict())
    zero_ext.wrap(model, opt, stage=stage, bucket_mb=0.0001)
    x = torch.randn(3, 4)
    FailingBackward.fail = True
    with pytest.raises(RuntimeError, match="injected failure"):
        model[2](FailingBackward.apply(torch.tanh(model[0](x)))).square().mean().backward()
    opt.zero_grad()
    FailingBackward.fail = False
    for _ in range(2):
        step_alongside(((model, opt), (reference, ref_opt)), x)
    full = zero_ext.full_state_dict(model)
    for name, q in reference.named_parameters():
        assert torch.allclose(full[name], q, atol=1e-6), name


@pytest.mark.parametrize("bad,match", [
    ("fp8", "mixed_precision must be None, 'bf16', 'fp16'"),
    (torch.float16, "mixed_precision must be None"),
    (zero_ext.MixedPrecision(torch.int8), "param_dtype must be one of"),
    (zero_ext.MixedPrecision(torch.bfloat16, torch.float64), "reduce_dtype must be one of"),
    (zero_ext.MixedPrecision(torch.bfloat16, loss_scale=128.0), "loss_scale applies to float16 compute only"),
    (zero_ext.MixedPrecision(torch.float16, loss_scale=-1.0), "loss_scale must be None"),
    (zero_ext.MixedPrecision(torch.float16, loss_scale="auto"), "loss_scale must be None"),
])
def test_bad_mixed_precision(bad, match):
    model, opt = make()
    with pytest.raises(ValueError, match=match):
        zero_ext.wrap(model, opt, stage=2, mixed_precision=bad)


def test_bad_loss_scaling_options():
    model, opt = make()
    with pytest.raises(ValueError, match="0 < backoff_factor < 1"):
        zero_ext.wrap(model, opt, stage=2, mixed_precision=zero_ext.MixedPrecision(
            torch.float16, loss_scale=zero_ext.DynamicLossScale(backoff_factor=2.0)))
    assert model[0].weight.dtype == torch.float32 and type(model) is torch.nn.Sequential  # untouched


def test_patched_step_is_refused_before_anything_changes():
    model, opt = make()
    opt.step = lambda *a, **k: None
    with pytest.raises(ValueError, match="optimizer.step was replaced"):
        zero_ext.wrap(model, opt, stage=2)
    assert type(model) is torch.nn.Sequential and opt.param_groups[0]["params"][0] is model[0].weight


def test_bad_offload_value():
    model, opt = make()
    with pytest.raises(ValueError, match="offload_optimizer must be None, 'cpu' or 'nvme'"):
        zero_ext.wrap(model, opt, stage=2, offload_optimizer="disk")


def test_fp16_loss_from_parameters_directly_is_an_error():
    """Loss scaling happens at the model's outputs; a loss that bypasses them
    would be unscaled wrongly, so it is refused rather than trained on."""
    model, opt = make()
    zero_ext.wrap(model, opt, stage=2, mixed_precision="fp16")
    with pytest.raises(RuntimeError, match="without passing through any of them"):
        model[0].weight.float().square().sum().backward()


def test_nccl_group_with_a_cpu_model_is_refused(monkeypatch, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        model, opt = make()
        with pytest.raises(ValueError, match="NCCL, which reduces GPU tensors only.*model.to"):
            zero_ext.wrap(model, opt)
        assert not hasattr(model, "_zero_ext")
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameter_resized_after_wrap(stage):
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    model[2].weight.data = torch.zeros(3, 8)  # a grown output layer, say
    with pytest.raises(RuntimeError, match=r"'2.weight' changed shape after zero_ext.wrap\(\) "
                                           r"\(from \[2, 8\] to \[3, 8\]\).*before calling wrap"):
        model(torch.randn(3, 4))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_load_state_dict_of_another_model(stage):
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    other = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    with pytest.raises(RuntimeError, match=r"size mismatch for 0.weight"):
        model.load_state_dict(other.state_dict())
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "encoder.weight"'):
        model.load_state_dict({**model.state_dict(), "encoder.weight": torch.zeros(1)})


def test_nested_units_are_supported_not_refused():
    """A unit inside a unit (FSDP allows it too): each parameter belongs to
    its innermost unit; training matches the plain model exactly."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                          nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    zero_ext.wrap(model, opt, stage=3, units=lambda m: isinstance(m, (nn.Sequential, nn.Linear)))
    for _ in range(3):
        x = torch.randn(3, 4)
        step_alongside(((model, opt), (reference, ref_opt)), x)
    full = zero_ext.full_state_dict(model)
    for name, p in reference.state_dict().items():
        assert torch.equal(full[name], p), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_skip_nonfinite_is_off_by_default_and_skips_when_on(stage):
    for skip in (False, True):
        model, opt = make()
        zero_ext.wrap(model, opt, stage=stage, skip_nonfinite=skip)
        (model(torch.randn(3, 4)).sum() * float("inf")).backward()
        before = {k: v.clone() for k, v in zero_ext.full_state_dict(model).items()}
        if skip:
            with pytest.warns(UserWarning, match="step skipped on every rank.*1 step"):
                opt.step()
        else:
            opt.step()
        after = zero_ext.full_state_dict(model)
        assert opt.skipped_steps == int(skip)
        assert opt.step_was_skipped == skip  # accelerate reads it from every optimizer
        assert all(torch.equal(before[k], after[k]) for k in before) == skip
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        assert not opt.step_was_skipped


def test_bad_skip_nonfinite_value():
    model, opt = make()
    with pytest.raises(TypeError, match="skip_nonfinite must be True or False"):
        zero_ext.wrap(model, opt, skip_nonfinite="yes")


def test_checks_that_need_several_ranks():
    """wrap() over a group this rank is not in; skip_nonfinite when only the
    last rank's gradient is inf (every rank skips, and trains on after)."""
    from dist_harness import run_on_ranks

    results = run_on_ranks(2, "fault_scenarios:foreign_group_and_one_sided_nonfinite", deadline_s=300)
    assert "not a member of the process_group" in results[1]["foreign_group"]
    for rank, per_stage in enumerate(results):
        for stage in range(4):
            assert per_stage[f"stage{stage}"] == {"skipped": 1, "unchanged": True, "warned": True,
                                                 "then_trained": True}, (rank, stage)


def test_lbfgs_at_stage_0_calls_its_closure_as_in_pytorch():
    """LBFGS calls the closure itself, several times per step: at stage 0
    zero_ext passes it through, and the result is plain PyTorch's."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    results = []
    for wrapped in (False, True):
        model, _ = make()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
        if wrapped:
            model, opt = zero_ext.wrap(model, opt, stage=0)
        calls = []

        def closure():
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            calls.append(loss.item())
            return loss
        for _ in range(2):
            opt.step(closure)
        results.append((calls, [p.detach().clone() for p in model.parameters()]))
    (calls, params), (zcalls, zparams) = results
    assert len(zcalls) == len(calls) > 2
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params, zparams))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimizer_state_dict_is_refused_where_it_is_a_shard(stage):
    """In stages 1-3 torch's optimizer.state_dict() would hold this rank's
    slice in zero_ext's layout (accelerate's save_state writes rank 0's for
    every rank): refused, naming zero_ext.save/load. Stage 0 steps whole
    parameters: torch's own round trip holds."""
    model, _ = make()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    zero_ext.wrap(model, opt, stage=stage)
    train_step(model, opt)
    if stage == 0:
        saved = opt.state_dict()
        shapes = [tuple(p.shape) for p in model.parameters()]
        assert [tuple(saved["state"][i]["exp_avg"].shape) for i in range(4)] == shapes
        opt.load_state_dict(saved)
        return
    for call in (opt.state_dict, lambda: opt.load_state_dict({"state": {}, "param_groups": []})):
        with pytest.raises(RuntimeError, match=r"optimizer\.(load_)?state_dict\(\) is refused.*zero_ext\.save"):
            call()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_with_a_closure_skips_on_the_closures_nonfinite_gradients(stage):
    """Lightning passes its forward+backward as step(closure): the non-finite
    check (skip_nonfinite, like fp16's overflow check) must see that
    backward's gradients, at stage 0 too, and skip instead of stepping on
    inf."""
    model, _ = make()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    zero_ext.wrap(model, opt, stage=stage, skip_nonfinite=True)
    train_step(model, opt)
    before = {k: v.clone() for k, v in zero_ext.full_state_dict(model).items()}

    def closure():
        loss = model(torch.randn(3, 4)).square().mean() * float("inf")
        loss.backward()
        return loss

    with pytest.warns(UserWarning, match="optimizer step skipped"):
        opt.step(closure)
    assert opt.skipped_steps == 1 and opt.step_was_skipped
    after = zero_ext.full_state_dict(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("stage", [1, 2])
def test_reading_a_sharded_grad_names_zero_exts_clip_functions(stage):
    """param.grad is a stand-in at stages 1-2: reading it (torch's own clip
    functions do) names the zero_ext calls that see the sharded gradients."""
    model, opt = make()
    model, opt = zero_ext.wrap(model, opt, stage=stage)
    model(torch.randn(3, 4)).square().mean().backward()
    grad = next(model.parameters()).grad
    with pytest.raises(RuntimeError, match=r"zero_ext.clip_grad_norm_.*zero_ext.clip_grad_value_.*full_grads"):
        grad.abs().max().item()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_parameter_frozen_at_wrap_and_unfrozen_later_is_named_with_the_way_around(stage):
    """Trainable at wrap and frozen since may be unfrozen again (the parity
    scenario frozen_and_unfrozen_after_wrap); frozen at wrap cannot train."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    model, opt = zero_ext.wrap(model, torch.optim.AdamW(model.parameters()), stage=stage)
    model[1].requires_grad_(False)  # trainable at wrap: allowed, and back
    model[1].requires_grad_(True)
    model[0].requires_grad_(True)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"\['0.weight', '0.bias'\] were frozen .* at zero_ext.wrap\(\).*"
                                           r"unfreeze_later=True"):
        opt.step()


def test_unfreeze_later_takes_a_bool_and_restores_the_flags():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    with pytest.raises(TypeError, match="unfreeze_later must be True or False"):
        zero_ext.wrap(model, torch.optim.AdamW(model.parameters()), unfreeze_later="yes")
    with pytest.raises(ValueError, match="stage must be"):  # a failed wrap leaves requires_grad as it was
        zero_ext.wrap(model, torch.optim.AdamW(model.parameters()), stage=5, unfreeze_later=True)
    assert not model[0].weight.requires_grad and model[1].weight.requires_grad
    model, _ = zero_ext.wrap(model, torch.optim.AdamW(model.parameters()), stage=2, unfreeze_later=True)
    assert not model[0].weight.requires_grad and model[1].weight.requires_grad
