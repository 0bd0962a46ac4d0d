"""Rank-side halves of the asynchronous save's snapshot tests (items of the
world-2 group of tests/test_checkpoint_trust.py): what a save defers to its
writer thread ([Note: the snapshot of an asynchronous save] in
zero_ext/tools/snapshot_gate.py) is copied before anything zero_ext does
changes it, and a user's in-place change in between fails the save on every
rank instead of saving it torn.

Every case arms the `async_slow_snapshot` fault: the writer thread waits
faults.PAUSE_S before it copies, so what the loop does right after the
call (steps, full_params(writeback=True), a load_state_dict, an edit)
certainly runs before the copy would, unless it waits for it."""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Any, Dict, Iterator, List

import torch
import torch.distributed as dist

import zero_ext
from checkpoint_trust_common import TIMEOUT, Tiny, attempt, litter, make, params_of, same, step
from zero_ext.tools import faults

CASES = ["steps-right-after", "edited", "gates"]

# (label, stage, wrap options): fp32 at every stage, fp32 masters in host
# memory (offload_optimizer="cpu"), and state in offload files ("nvme"),
# which an asynchronous save copies at the call.
CONFIGS = [(f"stage{s}", s, {}) for s in (0, 1, 2, 3)] + [
    ("stage2-bf16-cpu", 2, {"mixed_precision": "bf16", "offload_optimizer": "cpu"}),
    ("stage2-nvme", 2, {"offload_optimizer": "nvme", "persist_kb": 0}),
    ("stage3-nvme", 3, {"offload_optimizer": "nvme", "offload_params": "nvme", "persist_kb": 0}),
]


@contextlib.contextmanager
def slow_snapshot() -> Iterator[None]:
    """The writer threads of the saves made inside wait before copying."""
    os.environ[faults.VARIABLE] = faults.spec("async_slow_snapshot")
    try:
        yield
    finally:
        del os.environ[faults.VARIABLE]


def _wrap(root: str, label: str, stage: int, options: dict, seed: int = 0):
    model = Tiny(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    if "offload_optimizer" in options and options["offload_optimizer"] == "nvme":
        options = dict(options, offload_path=os.path.join(root, "snapshot-swap", f"{label}-{seed}"))
    return zero_ext.wrap(model, opt, stage=stage, bucket_mb=0.0001, timeout=TIMEOUT, **options)


def _optimizer_state(opt) -> List[Dict[str, torch.Tensor]]:
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)) for k, v in opt.state[p].items()}
            for g in opt.param_groups for p in g["params"] if p in opt.state]


def _same_state(a, b) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def run(root: str, case: str, rank: int, world: int) -> Any:
    return {"steps-right-after": _steps_right_after, "edited": _edited, "gates": _gates}[case](root, rank)


def _steps_right_after(root: str, rank: int) -> Dict[str, Any]:
    """Saved asynchronously, then at once a buffer changed in place and three
    steps: the checkpoint holds parameters, optimizer state and buffer as
    they were at the call, in both formats."""
    out = {}
    for label, stage, options in CONFIGS:
        for fmt in ("zero_ext", "dcp"):
            name = f"{label}-{fmt}"
            model, opt = _wrap(root, label, stage, options)
            step(model, opt, rank, n=2)
            want, want_state = params_of(model), _optimizer_state(opt)
            want_scale = model.scale.clone()
            path = os.path.join(root, "snapshot", name)
            shutil.rmtree(path, ignore_errors=True)
            with slow_snapshot():
                start = time.monotonic()
                handle = zero_ext.save(path, model, opt, format=fmt, async_save=True)
                call = time.monotonic() - start
                taken_at_call = handle.snapshot_taken.is_set()
                with torch.no_grad():
                    model.scale.add_(1.0)  # a buffer (a forward may change one): copied at the call
                start = time.monotonic()
                step(model, opt, rank, n=3)
                stepped = time.monotonic() - start
                waited = handle.snapshot_wait_s
                saved = attempt(handle.wait)
            fresh, fresh_opt = _wrap(root, label, stage, options, seed=9)
            loaded = attempt(lambda: zero_ext.load(path, fresh, fresh_opt)) if saved["error"] is None else saved
            out[name] = {"error": loaded["error"], "message": loaded["message"],
                         "params": loaded["error"] is None and same(params_of(fresh), want),
                         "state": loaded["error"] is None and _same_state(_optimizer_state(fresh_opt), want_state),
                         "buffer": torch.equal(fresh.scale, want_scale), "call": call, "stepped": stepped,
                         "waited": waited, "taken_at_call": taken_at_call}
    return out


def _edited(root: str, rank: int) -> Dict[str, Any]:
    """Rank 1 changes a parameter (stages 0-2, where the parameters hold the
    saved values) or its optimizer state in place right after the call:
    the save fails on every rank, saying so, nothing is published, the
    previous checkpoint stays, and (its error raised once more by the next
    save, as any asynchronous save's) saving goes on."""
    out = {}
    for stage in (0, 1, 2, 3):
        for what in (["param", "state"] if stage < 3 else ["state"]):
            for fmt in ("zero_ext", "dcp"):
                name = f"stage{stage}-{what}-{fmt}"
                model, opt = make(stage)
                step(model, opt, rank)
                path = os.path.join(root, "snapshot-edited", name)
                shutil.rmtree(path, ignore_errors=True)
                zero_ext.save(path, model, opt, extra="first", format=fmt)
                step(model, opt, rank)
                with slow_snapshot():
                    handle = zero_ext.save(path, model, opt, extra="second", format=fmt, async_save=True)
                    if rank == 1:
                        with torch.no_grad():
                            if what == "param":
                                next(iter(model.parameters())).mul_(2.0)
                            else:
                                max(opt.state.values(), key=lambda s: s["exp_avg"].numel())["exp_avg"].add_(1.0)
                    got = attempt(handle.wait)
                dist.barrier()
                got["litter"] = litter(path)
                m, o = make(stage, seed=4)
                got["previous"] = attempt(lambda: zero_ext.load(path, m, o))["value"]
                # The next save raises the failure once more (as documented), the one after works.
                again = [attempt(lambda: zero_ext.save(path, model, opt, extra="third", format=fmt,
                                                       async_save=True).wait())["error"] for _ in range(2)]
                m, o = make(stage, seed=5)
                got["next"] = (again, attempt(lambda: zero_ext.load(path, m, o))["value"])
                out[name] = got
    return out


def _gates(root: str, rank: int) -> Dict[str, Any]:
    """What zero_ext does that writes the saved tensors waits for the
    snapshot: full_params(writeback=True) and load_full_state_dict right
    after the call leave the checkpoint at the call's state, no error."""
    out = {}
    for stage in (1, 2, 3):
        model, opt = make(stage)
        step(model, opt, rank)
        for how in ("full_params", "load_full_state_dict"):
            name = f"stage{stage}-{how}"
            path = os.path.join(root, "snapshot-gates", name)
            shutil.rmtree(path, ignore_errors=True)
            want = params_of(model)
            with slow_snapshot():
                handle = zero_ext.save(path, model, opt, async_save=True)
                if how == "full_params":
                    with zero_ext.full_params(model, writeback=True), torch.no_grad():
                        for p in model.parameters():
                            p.mul_(0.5)
                else:
                    zero_ext.load_full_state_dict(model, {k: v * 0.5 for k, v in want.items()})
                waited = handle.snapshot_wait_s
                got = attempt(handle.wait)
            m, o = make(stage, seed=6)
            loaded = attempt(lambda: zero_ext.load(path, m, o))
            out[name] = {"error": got["error"], "message": got["message"], "waited": waited,
                         "saved_at_call": loaded["error"] is None and same(params_of(m), want),
                         "changed_after": not same(params_of(model), want)}
    return out
