"""The C++ CPU Adam/AdamW kernel against torch.optim, step by step."""
import pytest
import torch

from zero_ext.optim.cpu_adam import adam_step_

SIZES = [1, 7, 33, 1000, 70001]  # none a multiple of any vector width but 1000


def run_both(n, decoupled, amsgrad, weight_decay, maximize=False, lowp=None, steps=5, betas=(0.9, 0.99)):
    g = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) * (10.0 ** (-(k % 5))) for k in range(steps)]
    ref = p0.clone().requires_grad_(True)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([ref], lr=1e-2, betas=betas, eps=1e-8, weight_decay=weight_decay,
              amsgrad=amsgrad, maximize=maximize, foreach=False)
    mine = p0.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    vmax = torch.zeros(n) if amsgrad else None
    low = torch.empty(n, dtype=lowp) if lowp else None
    for step, grad in enumerate(grads, start=1):
        ref.grad = grad.clone()
        opt.step()
        adam_step_(mine, grad, m, v, step=step, lr=1e-2, beta1=betas[0], beta2=betas[1], eps=1e-8,
                   weight_decay=weight_decay, decoupled_weight_decay=decoupled, amsgrad=amsgrad,
                   maximize=maximize, max_exp_avg_sq=vmax, param_lowp=low)
    state = opt.state[ref]
    return ref.detach(), mine, state, m, v, vmax, low


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_matches_torch_optim(n, decoupled, amsgrad):
    ref, mine, state, m, v, vmax, _ = run_both(n, decoupled, amsgrad, weight_decay=0.1)
    torch.testing.assert_close(mine, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(m, state["exp_avg"], rtol=0, atol=1e-6)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=0, atol=1e-6)
    if amsgrad:
        torch.testing.assert_close(vmax, state["max_exp_avg_sq"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.9999)])
def test_usual_betas_over_many_steps(betas):
    """1 - beta is rounded from double as torch does; with beta2 = 0.9999 a
    float subtraction would drift past the tolerance within 50 steps."""
    ref, mine, state, m, v, *_ = run_both(10007, decoupled=True, amsgrad=False, weight_decay=0.1,
                                           steps=50, betas=betas)
    # 50 steps of rounding differences (FMA, one division): a few ulps.
    torch.testing.assert_close(mine, ref, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=2e-6, atol=0)


def test_maximize_and_no_weight_decay():
    ref, mine, *_ = run_both(333, decoupled=True, amsgrad=False, weight_decay=0.0, maximize=True)
    torch.testing.assert_close(mine, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_copy_is_the_rounded_update(dtype):
    ref, mine, *_, low = run_both(70001, decoupled=True, amsgrad=False, weight_decay=0.1, lowp=dtype)
    torch.testing.assert_close(mine, ref, rtol=0, atol=1e-6)
    assert torch.equal(low, mine.to(dtype))  # same rounding as torch's cast


def test_bfloat16_copy_keeps_nan_and_inf():
    p = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    z = torch.zeros(4)
    low = torch.empty(4, dtype=torch.bfloat16)
    adam_step_(p, z, z.clone(), z.clone(), step=1, lr=0.0, param_lowp=low)
    assert torch.equal(low[1:], p[1:].to(torch.bfloat16)) and torch.isnan(low[0])


def test_bad_operands_are_refused():
    p = torch.zeros(8)
    with pytest.raises(RuntimeError, match="grad must be a contiguous float32 CPU tensor"):
        adam_step_(p, torch.zeros(8, dtype=torch.float64), torch.zeros(8), torch.zeros(8), step=1, lr=1.0)
    with pytest.raises(RuntimeError, match="amsgrad=True needs max_exp_avg_sq"):
        adam_step_(p, torch.zeros(8), torch.zeros(8), torch.zeros(8), step=1, lr=1.0, amsgrad=True)
    with pytest.raises(RuntimeError, match="step counts from 1"):
        adam_step_(p, torch.zeros(8), torch.zeros(8), torch.zeros(8), step=0, lr=1.0)


def test_opcheck():
    n = 100
    args = (torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n), None,
            torch.empty(n, dtype=torch.bfloat16), 1e-3, 0.9, 0.999, 1e-8, 0.01, 1, True, False, False)
    torch.library.opcheck(torch.ops.zero_ext.adam_step_.default, args,
                          test_utils=("test_schema", "test_faketensor"))
