"""On a GPU, at world size 1 over NCCL: an asynchronous save's snapshot of
CUDA tensors ([Note: the snapshot of an asynchronous save] in
zero_ext/tools/snapshot_gate.py) is copied by the writer thread into pinned
host buffers on a stream of its own, after the work queued before the call
and before the steps that follow it: with the copy held back a second
(the async_slow_snapshot fault), three steps right after the call leave
the checkpoint at the call's state, and an in-place edit of a parameter
before the copy fails the save."""
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zero_ext
from zero_ext.tools import faults

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("nccl_world_of_one")]


def _model(stage: int, precision, offload: bool):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision, bucket_mb=1,
                         offload_optimizer="cpu" if offload else None)


def _steps(model, opt, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(8, 512, generator=g).cuda()
        F.mse_loss(model(x).float(), torch.zeros(8, 512, device="cuda")).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("fmt", ["zero_ext", "dcp"])
@pytest.mark.parametrize("stage,precision,offload", [(0, None, False), (2, None, False), (3, None, False),
                                                     (2, "bf16", False), (3, "bf16", True)])
def test_steps_right_after_an_asynchronous_save_leave_it_at_the_call(tmp_path, monkeypatch, stage, precision,
                                                                    offload, fmt):
    model, opt = _model(stage, precision, offload)
    _steps(model, opt, 2, seed=1)
    want = {k: v.clone() for k, v in zero_ext.full_state_dict(model).items()}
    monkeypatch.setenv(faults.VARIABLE, faults.spec("async_slow_snapshot"))
    handle = zero_ext.save(str(tmp_path / "ck"), model, opt, format=fmt, async_save=True)
    _steps(model, opt, 3, seed=2)  # queued on the GPU while the copy waits; the first step waits for it
    assert handle.snapshot_wait_s > 0.5
    handle.wait()
    monkeypatch.delenv(faults.VARIABLE)
    fresh, fresh_opt = _model(stage, precision, offload)
    zero_ext.load(str(tmp_path / "ck"), fresh, fresh_opt)
    got = zero_ext.full_state_dict(fresh)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_in_place_edit_before_the_copy_fails_the_save(tmp_path, monkeypatch):
    model, opt = _model(2, None, False)
    _steps(model, opt, 1, seed=1)
    monkeypatch.setenv(faults.VARIABLE, faults.spec("async_slow_snapshot"))
    handle = zero_ext.save(str(tmp_path / "ck"), model, opt, async_save=True)
    with torch.no_grad():
        next(iter(model.parameters())).mul_(2.0)
    with pytest.raises(RuntimeError, match="changed in place after this asynchronous save was called"):
        handle.wait()
    assert not os.path.exists(str(tmp_path / "ck"))
