"""Optimizer state streamed through an offload file (zero_ext/optim/state_offload.py,
the core of offload_optimizer="nvme"): stepping chunk by chunk with the state
read in and written back gives exactly the values of the optimizer stepping
everything at once, and between steps no parameter-shaped state stays in memory."""
from __future__ import annotations

import pytest
import torch

from zero_ext.optim.state_offload import OffloadedState, probe_state_layout

SHAPES = [(7,), (33, 5), (1,), (300,), (4, 4, 4), (2,)]
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=True), dict(lr=3e-3, weight_decay=0.0)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, foreach=False), dict(lr=1e-3, betas=(0.8, 0.9))),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True), dict(lr=0.05, momentum=0.5)),
    "sgd_plain": (torch.optim.SGD, dict(lr=0.1), dict(lr=0.05)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True), dict(lr=1e-3)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-1), dict(lr=1e-2, lr_decay=0.01)),
}


def make(name: str):
    cls, first, second = OPTIMIZERS[name]
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(*shape, generator=g).requires_grad_() for shape in SHAPES]
    groups = [{"params": params[:4], **first}, {"params": params[4:], **second}]
    return cls, params, cls(groups)


def grads_for(step: int, params):
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(p.shape, generator=g) for p in params]
    if step == 1:
        out[2] = None  # a parameter without a gradient this step keeps its state unchanged
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("chunk_bytes", [1, 2048, 1 << 30])
def test_streamed_steps_equal_the_optimizer_stepping_at_once(tmp_path, name, chunk_bytes):
    cls, ref_params, ref = make(name)
    _, params, opt = make(name)
    offloaded = OffloadedState(opt, cls, str(tmp_path), rank=0, chunk_bytes=chunk_bytes, io_threads=2)
    stateful = any(offloaded.keys[id(p)] for p in params)
    assert len(offloaded.chunks) == (len(params) if chunk_bytes == 1 and stateful else
                                     1 if chunk_bytes > 1 << 20 or not stateful else len(offloaded.chunks))
    for step in range(4):
        for group, p_list in ((ref, ref_params), (opt, params)):
            for p, g in zip(p_list, grads_for(step, p_list)):
                p.grad = g
        ref.step()
        offloaded.step(lambda: cls.step(opt))
        for a, b in zip(ref_params, params):
            assert torch.equal(a, b), (name, step)
        # Between steps only what is not shaped like the parameter stays.
        for p in params:
            assert all(not (isinstance(v, torch.Tensor) and v.shape == p.shape) for v in opt.state[p].values())
    with offloaded.materialized():
        for a, b in zip(ref_params, params):
            ref_state, state = ref.state[a], opt.state[b]
            assert ref_state.keys() == state.keys(), name
            for key in ref_state:
                if isinstance(ref_state[key], torch.Tensor):
                    assert torch.equal(ref_state[key], state[key]), (name, key)
    assert all(not (isinstance(v, torch.Tensor) and v.shape == p.shape) for p in params for v in opt.state[p].values())


def test_the_probe_finds_each_optimizers_parameter_shaped_state():
    layouts = {name: probe_state_layout(make(name)[2], OPTIMIZERS[name][0]) for name in OPTIMIZERS}
    assert [k for k, _ in layouts["adamw"][0]] == ["exp_avg", "exp_avg_sq"]
    assert [k for k, _ in layouts["adam_amsgrad"][0]] == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    assert [k for k, _ in layouts["adam_amsgrad"][1]] == ["exp_avg", "exp_avg_sq"]  # per group: amsgrad off there
    assert [k for k, _ in layouts["sgd_nesterov"][0]] == ["momentum_buffer"]
    assert layouts["sgd_plain"] == [[], []]
    assert [k for k, _ in layouts["rmsprop"][0]] == ["square_avg", "momentum_buffer", "grad_avg"]


def test_an_optimizer_that_cannot_be_probed_is_refused_naming_it(tmp_path):
    class Broken(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("needs a closure")

    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="cannot tell which state Broken keeps per parameter"):
        OffloadedState(Broken([p], lr=0.1), Broken, str(tmp_path), rank=0)
