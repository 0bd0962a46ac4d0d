"""Stage 0 keeps DDP's buckets across steps and zero_grad(set_to_none) no
longer clears them (the next flush overwrites every slot): what a backward
shows must still never include a previous step's gradient, also for a
parameter frozen after wrap, whose bucket the backward skips."""
from __future__ import annotations

import torch

import zero_ext


def test_a_bucket_frozen_after_wrap_shows_zeros_not_the_last_steps_gradient():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    reference.load_state_dict(model.state_dict())
    model, opt = zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=0,
                               bucket_mb=1e-5)  # a bucket per parameter
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    for m, o in ((model, opt), (reference, ref_opt)):
        m(x).sum().backward()
        o.step()
        o.zero_grad()
        m[0].requires_grad_(False)
        m(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if name.startswith("0."):
            assert q.grad is None and torch.equal(p.grad, torch.zeros_like(p)), name  # zeros, as before
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
