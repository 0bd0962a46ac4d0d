"""compress_weights / compress_grads on a GPU: the ATen-op quantization CUDA
runs gives the CPU kernels' bytes, and a stage 3 model trains through NCCL's
all-gather and all-to-all of quantized payloads (a group of one rank sent
through NCCL all the same, ZERO_EXT_ONE_RANK_COLLECTIVES=1)."""
import pytest
import torch
import torch.nn as nn

import zero_ext

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("nccl_world_of_one")]
ops = torch.ops.zero_ext


@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_payloads_are_the_cpu_kernels_bytes(bits):
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(bits)) * 3
    on_gpu = ops.quantize_blocks(x.cuda(), bits, 2048, None)
    assert torch.equal(on_gpu.cpu(), ops.quantize_blocks(x, bits, 2048, None))
    back = ops.dequantize_blocks(on_gpu, x.numel(), bits, 2048)
    assert torch.equal(back.cpu(), ops.dequantize_blocks(on_gpu.cpu(), x.numel(), bits, 2048))


def test_a_compressed_stage3_model_trains_on_the_gpu():
    losses = {}
    for label, compress in (("plain", {}), ("int8", {"compress_weights": "int8", "compress_grads": "int8"})):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(4)]).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = zero_ext.wrap(model, opt, stage=3, bucket_mb=1, **compress)
        g = torch.Generator().manual_seed(1)
        for _ in range(10):
            x = torch.randn(8, 512, generator=g).cuda()
            loss = (model(x) - x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[label] = loss.item()
        assert set(zero_ext.traffic(model).values()) == {0}  # one rank: (n - 1) parts are none
    # The gathers went through int8 (one rank's own part too), so the numbers moved, a little.
    assert losses["int8"] != losses["plain"]
    assert losses["int8"] == pytest.approx(losses["plain"], rel=2e-2), losses
