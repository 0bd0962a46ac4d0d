"""The soak: 1000 stage 3 steps with every training-loop feature mixed in,
measuring whether anything accumulates (resident memory, live tensors)."""
from __future__ import annotations

import gc
import os

import torch

import zero_ext
from fault_scenarios import loss_of, make_model


def resident_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


# Step 400 has what step 1000 has just before it (a checkpoint, a
# retain_graph step, no no_sync micro-batch): tensors a checkpoint hands to
# the C++ core keep their Python wrappers until replaced, so marks after
# different features differ by a few tensors without anything accumulating.
EARLY_MARK = 400


def soak(rank: int, world: int, checkpoint_dir: str, steps: int = 1000) -> dict:
    """retain_graph=True (a second backward over the same forward) every 10th
    step, a no_sync() micro-batch before the synced one every 3rd, and a
    checkpoint (save, then load back) every 200th, from step 0."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zero_ext.wrap(model, opt, stage=3)
    marks = {}
    for step in range(steps + 1):
        if step % 3 == 0:
            with model.no_sync():
                loss_of(model, step % 50 + 50, rank).backward()
        loss = loss_of(model, step % 50, rank)
        if step % 10 == 0:
            loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 200 == 0:
            path = os.path.join(checkpoint_dir, "soak")
            zero_ext.save(path, model, opt, extra={"step": step})
            assert zero_ext.load(path, model, opt)["step"] == step
        if step in (EARLY_MARK, steps):
            marks[step] = {"rss_kib": resident_kib(), "tensors": live_tensors(), "loss": loss.item()}
    return marks
