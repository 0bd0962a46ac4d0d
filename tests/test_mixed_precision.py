"""Single-process checks of mixed-precision details the parity suite's
tolerances would not see."""
import pytest
import torch
import torch.nn as nn

import zero_ext


def _model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_reduction_unscales_in_fp32(stage):
    """Gradients reduced in fp16 while scaled keep values that would be
    subnormal or zero in fp16 once unscaled."""
    grads = {}
    for reduce_dtype in (torch.float32, torch.float16):
        model, opt = _model()
        zero_ext.wrap(model, opt, stage=stage, mixed_precision=zero_ext.MixedPrecision(
            torch.float16, reduce_dtype, loss_scale=zero_ext.DynamicLossScale(initial_scale=2.0 ** 16)))
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        (model(x).float().square().mean() * 1e-5).backward()
        grads[reduce_dtype] = zero_ext.full_grads(model)
    for name, want in grads[torch.float32].items():
        got = grads[torch.float16][name]
        assert (got == 0).sum() <= (want == 0).sum(), name
        assert torch.allclose(got, want, rtol=2e-3, atol=0), name


def test_stage0_reduces_in_the_requested_dtype():
    model, opt = _model()
    zero_ext.wrap(model, opt, stage=0, mixed_precision=zero_ext.MixedPrecision(torch.float32, torch.bfloat16))
    core = model._zero_ext.handles
    assert core.reduction.replicated()
    n = sum(p.numel() for p in model.parameters())
    layout = core.reduction.bucket_layout()
    padded = sum(layout[2::3])
    assert n <= padded
    # bf16 staging; the fp32 accumulator has memory from the first backward on.
    assert core.diagnostics.stats()["grad_bytes"] == padded * 2
    model(torch.randn(4, 16)).sum().backward()
    assert core.diagnostics.stats()["grad_bytes"] == padded * (2 + 4)


def test_loss_scaler_state_survives_a_checkpoint(tmp_path):
    model, opt = _model()
    zero_ext.wrap(model, opt, stage=2, mixed_precision=zero_ext.MixedPrecision(
        torch.float16, loss_scale=zero_ext.DynamicLossScale(initial_scale=2.0 ** 8, growth_interval=3)))
    x = torch.randn(4, 16)
    for step in range(2):
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    model(x).float().sum().backward()
    opt.step()  # skipped: the scale halves
    opt.zero_grad()
    zero_ext.save(str(tmp_path / "ckpt"), model, opt)
    state = model._zero_ext.handles.checkpoint.loss_scaler_state()
    assert state == [2.0 ** 7, 0.0, 1.0]
    other, other_opt = _model(1)
    zero_ext.wrap(other, other_opt, stage=3, mixed_precision="fp16")
    zero_ext.load(str(tmp_path / "ckpt"), other, other_opt)
    assert other._zero_ext.handles.checkpoint.loss_scaler_state() == state


class _SeesInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x, target):
        self.seen.append((x.dtype, target.dtype))
        return self.lin(x)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("cast", [True, False])
def test_cast_forward_inputs_decides_what_the_model_receives(stage, cast):
    """Default (as FSDP2, DeepSpeed): every floating argument, a target
    included, arrives in the compute dtype. cast_forward_inputs=False hands
    them over untouched."""
    model = _SeesInputs()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    zero_ext.wrap(model, opt, stage=stage,
                  mixed_precision=zero_ext.MixedPrecision(torch.bfloat16, cast_forward_inputs=cast))
    x = torch.randn(2, 4, dtype=torch.bfloat16 if not cast else torch.float32)
    model(x, torch.randn(2, 4)).float().sum().backward()
    want = (torch.bfloat16, torch.bfloat16) if cast else (torch.bfloat16, torch.float32)
    assert model.seen == [want]


def test_cast_forward_inputs_must_be_a_bool():
    model, opt = _model()
    with pytest.raises(TypeError, match="cast_forward_inputs must be True or False"):
        zero_ext.wrap(model, opt, stage=1, mixed_precision=zero_ext.MixedPrecision(cast_forward_inputs="no"))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_output_dtype_casts_what_forward_returns_and_trains_as_a_cast_by_hand(stage):
    """MixedPrecision(output_dtype=torch.float32): bf16 compute, fp32 outputs
    (with grad and under no_grad, a registered method too); training equals
    the same model whose loss casts the output itself, bit for bit."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    params = {}
    for output_dtype in (torch.float32, None):
        model, opt = _model()
        model, opt = zero_ext.wrap(model, opt, stage=stage, mixed_precision=zero_ext.MixedPrecision(
            torch.bfloat16, output_dtype=output_dtype))
        for _ in range(3):
            out = model(x)
            assert out.dtype == (torch.float32 if output_dtype else torch.bfloat16)
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            assert model(x).dtype == (torch.float32 if output_dtype else torch.bfloat16)
        params[output_dtype] = zero_ext.full_state_dict(model)
    for name, value in params[None].items():
        assert torch.equal(params[torch.float32][name], value), name


def test_output_dtype_must_be_a_floating_dtype():
    model, opt = _model()
    with pytest.raises(ValueError, match="output_dtype must be None or one of"):
        zero_ext.wrap(model, opt, stage=2, mixed_precision=zero_ext.MixedPrecision(output_dtype=torch.int64))
