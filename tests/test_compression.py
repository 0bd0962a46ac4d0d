"""Block quantization ([Note: quantized payloads] in csrc/block_quantization.h)
through the registered ops, and wrap()'s compression arguments, in one
process. The collectives themselves run in the parity groups
(compression_scenarios.py, test_parity.py::test_compression)."""
import pytest
import torch

import zero_ext

ops = torch.ops.zero_ext


def payload_bytes(numel: int, bits: int, block: int) -> int:
    blocks = -(-numel // block)
    data = numel if bits == 8 else (numel + 1) // 2
    return -(-(4 * blocks + data) // 8) * 8


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block", [(1, 2048), (5, 4), (2048, 2048), (4099, 2048), (3001, 256)])
def test_round_trip_is_within_half_a_step_and_the_residual_is_what_was_lost(bits, numel, block):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)  # blocks of very different scales
    residual = torch.empty(numel)
    payload = ops.quantize_blocks(x, bits, block, residual)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(numel, bits, block)
    y = ops.dequantize_blocks(payload, numel, bits, block)
    qmax = 127 if bits == 8 else 7
    for start in range(0, numel, block):
        xs, ys = x[start:start + block], y[start:start + block]
        step = xs.abs().max() / qmax
        assert (xs - ys).abs().max() <= step / 2 * (1 + 1e-5), (start, (xs - ys).abs().max(), step)
        assert ys.abs().max() == pytest.approx(xs.abs().max().item(), rel=1e-6)  # the largest comes back
    torch.testing.assert_close(residual, x - y, rtol=0, atol=1e-6 * x.abs().max().item())


def test_a_block_with_inf_or_nan_dequantizes_to_nan_and_drops_its_residual():
    x = torch.tensor([1.0, float("inf"), 2.0, 3.0, float("nan"), 1.0, 0.5, -0.25])
    residual = torch.full((8,), 7.0)
    y = ops.dequantize_blocks(ops.quantize_blocks(x, 8, 2, residual), 8, 8, 2)
    assert torch.isnan(y[:2]).all() and torch.isnan(y[4:6]).all()
    assert torch.isfinite(y[2:4]).all() and torch.isfinite(y[6:]).all()
    assert torch.equal(residual[:2], torch.zeros(2)) and torch.equal(residual[4:6], torch.zeros(2))


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_and_subnormal_blocks_send_zeros_and_keep_their_values_in_the_residual(bits):
    x = torch.cat([torch.zeros(4), torch.full((4,), 1e-44)])
    residual = torch.empty(8)
    y = ops.dequantize_blocks(ops.quantize_blocks(x, bits, 4, residual), 8, bits, 4)
    assert torch.equal(y, torch.zeros(8))
    assert torch.equal(residual, x)


def test_error_feedback_over_repeated_rounding_keeps_the_sum_exact_to_one_step():
    """What the reduction does with a residual, alone: 32 roundings of the
    same values sum to 32 x the values within one rounding's error."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    residual, total = torch.zeros(5000), torch.zeros(5000)
    for _ in range(32):
        wanted = x + residual
        total += ops.dequantize_blocks(ops.quantize_blocks(wanted, 4, 2048, residual), 5000, 4, 2048)
    one_step = (x.abs().max() / 7).item()
    assert (total - 32 * x).abs().max().item() <= one_step  # without feedback: up to 32 / 2 steps


@pytest.mark.parametrize("kwargs,stage,needle", [
    ({"compress_weights": "int8"}, 2, "stage 2 gathers no parameters"),
    ({"compress_grads": "int8"}, 1, "stage 1 all-reduces whole gradients"),
    ({"compress_grads": "int8"}, 0, "stage 0 all-reduces"),
    ({"compress_grads": "int2"}, 2, "must be one of"),
    ({"compress_weights": "int4"}, 3, "must be one of"),
    ({"compress_grads": 8}, 2, "must be one of"),
])
def test_compression_arguments_are_checked_before_anything_runs(kwargs, stage, needle):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises((ValueError, TypeError), match=needle):
        zero_ext.wrap(model, opt, stage=stage, **kwargs)


def test_fp16_reductions_are_refused_with_compressed_gradients():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = zero_ext.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)
    with pytest.raises(ValueError, match="reduce_dtype=torch.float16"):
        zero_ext.wrap(model, opt, stage=2, mixed_precision=policy, compress_grads="int8")


@pytest.mark.parametrize("stage", [2, 3])
def test_one_process_trains_exactly_and_sends_nothing(stage):
    """A single rank has nothing to send: compression changes no number, and
    traffic() stays at zero."""
    results = []
    for compress in ({}, {"compress_grads": "int4"} | ({"compress_weights": "int8"} if stage == 3 else {})):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = zero_ext.wrap(model, opt, stage=stage, **compress)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert set(zero_ext.traffic(model).values()) == {0}
        results.append(zero_ext.full_state_dict(model))
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name


def test_traffic_of_a_model_zero_ext_did_not_wrap_is_an_error():
    with pytest.raises(ValueError, match="not wrapped"):
        zero_ext.traffic(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [7, 2048, 5001])
def test_the_aten_op_path_cuda_runs_gives_the_cpu_kernels_bytes(bits, numel):
    """Other devices quantize with ATen ops: the same arithmetic, so the same
    payload, bit for bit, and the same values back (run here on the CPU)."""
    g = torch.Generator().manual_seed(numel + bits)
    x = torch.randn(numel, generator=g) * torch.logspace(-2, 1, numel)
    x[3] = float("inf") if numel > 2048 else x[3]  # a non-finite block among finite ones
    residual_kernel, residual_ops = torch.empty(numel), torch.empty(numel)
    kernel = ops.quantize_blocks(x, bits, 2048, residual_kernel)
    with_ops = ops.quantize_blocks(x, bits, 2048, residual_ops, with_ops=True)
    assert torch.equal(kernel, with_ops)
    torch.testing.assert_close(residual_ops, residual_kernel, rtol=0, atol=1e-6 * x[torch.isfinite(x)].abs().max().item())
    back_kernel = ops.dequantize_blocks(kernel, numel, bits, 2048)
    back_ops = ops.dequantize_blocks(kernel, numel, bits, 2048, with_ops=True)
    torch.testing.assert_close(back_ops, back_kernel, rtol=0, atol=0, equal_nan=True)
