"""Exports, clipping by value and launch checks (issue 32, item 8).

Under torchrun on 2 CPU ranks (tests/exports_scenarios.py): under bf16 every
export path of accelerate, the Trainer and peft writes zero_ext's fp32
masters with DDP's names and config.json; accelerator.clip_grad_value_ at
stages 0-3 equals DDP's; accelerator.prepare with zero_ext's objects. In
process: zero_ext's clip_grad_value_ against torch's on one process, and
wrap refusing a torchrun launch without a process group."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import zero_ext
from zero_ext.optim.clip import clip_grad_value_

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zero_ext.__file__)))  # the zero_ext under test


def test_exports_clip_value_and_prepare_on_two_ranks(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("peft")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29681",
           os.path.join(HERE, "exports_scenarios.py"), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([PACKAGE_ROOT, HERE]), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=env)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-10000:]
    with open(tmp_path / "exports.json") as f:
        result = json.load(f)
    print(json.dumps(result["figures"], indent=1))
    assert result["problems"] == [], result


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _train(model, optimizer, clip) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 3, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            clip(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_grad_value_matches_torch_in_one_process(stage):
    plain, unclipped = _model(), _model()
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), torch.nn.utils.clip_grad_value_)
    _train(unclipped, torch.optim.AdamW(unclipped.parameters(), lr=1e-2), None)
    model = _model()
    model, optimizer = zero_ext.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage)
    _train(model, optimizer, clip_grad_value_)
    full = zero_ext.full_state_dict(model)
    # The clip bites: without it the weights differ.
    assert max((unclipped.state_dict()[k] - v).abs().max().item() for k, v in plain.state_dict().items()) > 1e-3
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-6, atol=1e-7)


def test_wrap_refuses_a_launch_without_a_process_group(monkeypatch):
    assert not (dist.is_available() and dist.is_initialized())
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    model = _model()
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2.*torch\.distributed\.init_process_group"):
        zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # One process (a notebook, or a launch of one) still wraps without a group.
    monkeypatch.setenv("WORLD_SIZE", "1")
    zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
