"""Checkpoint trust, world 2: a save is one collective decision. An error on
one rank in any phase (shards, fsync, metadata, rename, a file that
vanished) reaches every rank at once and leaves the previous checkpoint
loadable; bad targets, a bad extra and options that one rank alone passes
loosely are refused on every rank before anything is written or loaded."""
from __future__ import annotations

import os
from typing import Any, Dict

import torch.distributed as dist

import zero_ext
from zero_ext.files.checkpoint import format as _checkpoint_files
from zero_ext.files.checkpoint import publish as _publish
from checkpoint_trust_common import Custom, attempt, litter, make, params_of, same, step


def _fresh_checkpoint(root: str, case: str, rank: int, world: int):
    """A model, its optimizer and a good checkpoint with extra 'first'."""
    model, opt = make(2)
    step(model, opt, rank)
    path = os.path.join(root, case, "ckpt")
    zero_ext.save(path, model, opt, extra="first")
    return model, opt, path


def _after_failed_save(path: str, outcome: Dict[str, Any], model, opt) -> Dict[str, Any]:
    """What a failed save left: litter, and whether the previous checkpoint loads."""
    dist.barrier()  # every rank has seen its outcome before anyone looks at the disk
    outcome["litter"] = litter(path)
    m, o = make(2, seed=4)
    outcome["previous"] = attempt(lambda: zero_ext.load(path, m, o))
    return outcome


def _save_fails(root: str, case: str, rank: int, world: int) -> Dict[str, Any]:
    """A save where one rank hits an error in one phase."""
    model, opt, path = _fresh_checkpoint(root, case, rank, world)
    step(model, opt, rank)
    patches = []

    def patch(owner, name, replacement):
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def planted(*args, **kwargs):
        raise OSError(f"planted {case}")

    if case == "fail-shards-rank1" and rank == 1:
        patch(_checkpoint_files.ShardWriter, "write", planted)
    elif case == "fail-fsync-rank1" and rank == 1:
        patch(os, "fsync", planted)
    elif case == "fail-metadata-rank0" and rank == 0:
        patch(os, "replace", planted)
    elif case == "fail-rename-rank0" and rank == 0:
        patch(os, "rename", planted)
        patch(_publish, "_exchange", planted)  # replacing a checkpoint exchanges, where the OS can
    elif case == "file-vanishes-rank1" and rank == 1:
        close = _checkpoint_files.ShardWriter.close

        def close_and_lose(self):
            close(self)
            os.remove(self.path)
        patch(_checkpoint_files.ShardWriter, "close", close_and_lose)
    try:
        outcome = attempt(lambda: zero_ext.save(path, model, opt, extra="second"))
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)
    return _after_failed_save(path, outcome, model, opt)


def _bad_target(root: str, case: str, rank: int, world: int) -> Dict[str, Any]:
    """Paths that must be refused on every rank before anything is written."""
    model, opt = make(2)
    where = os.path.join(root, f"target-{case}")
    if rank == 0:
        os.makedirs(where, exist_ok=True)
    dist.barrier()
    path = os.path.join(where, "ckpt")
    extra = None
    if case == "paths-differ":
        path = os.path.join(where, f"ckpt-{rank}")
    elif case == "regular-file":
        if rank == 0:
            with open(path, "w") as f:
                f.write("keep me")
    elif case == "symlink":
        target = os.path.join(where, "real")
        if rank == 0:
            os.symlink(target, path)
        dist.barrier()
        zero_ext.save(target, model, opt, extra="target")
    elif case == "not-a-checkpoint":
        if rank == 0:
            os.makedirs(path)
            with open(os.path.join(path, "notes.txt"), "w") as f:
                f.write("keep me")
    elif case == "bad-extra-rank1":
        extra = {"sched": {"last_epoch": 3}, "obj": Custom()} if rank == 1 else {"sched": {"last_epoch": 3}}
    dist.barrier()
    outcome = attempt(lambda: zero_ext.save(path, model, opt, extra=extra))
    dist.barrier()
    outcome["entries"] = sorted(os.listdir(where))
    if case == "regular-file":
        with open(path) as f:
            outcome["kept"] = f.read() == "keep me"
    elif case == "not-a-checkpoint":
        outcome["kept"] = os.listdir(path) == ["notes.txt"]
    elif case == "symlink":
        m, o = make(2, seed=4)
        outcome["kept"] = os.path.islink(path) and zero_ext.load(os.path.join(where, "real"), m, o) == "target"
    return outcome


def _extra_rule(root: str, rank: int, world: int) -> Dict[str, Any]:
    out = {}
    model, opt, path = _fresh_checkpoint(root, "extra-rule", rank, world)
    zero_ext.save(path, model, opt, extra=f"rank{rank}")
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(path, "extra-rank1.pt"))
    dist.barrier()
    m, o = make(2, seed=4)
    out["missing"] = attempt(lambda: zero_ext.load(path, m, o))
    # The writer had one rank: rank 1 of two gets rank 0's extra.
    m, o = make(2, seed=4)
    out["fewer-writers"] = attempt(lambda: zero_ext.load(os.path.join(root, "base"), m, o))
    return out


def _waited(handle) -> None:
    """An asynchronous save's handle waited for (a save that should have been refused, before issue 54)."""
    if handle is not None:
        handle.wait()


def _loose_inputs_rank1(root: str, rank: int, world: int) -> Dict[str, Any]:
    """Rank 1 alone passes an option loosely (a str for a bool, a dcp_layout
    without format="dcp", a format to load): the call is refused on every
    rank, at once, naming the option, before anything is written or loaded."""
    model, opt, path = _fresh_checkpoint(root, "loose-inputs", rank, world)
    step(model, opt, rank)
    before = params_of(model)
    new = os.path.join(root, "loose-inputs", "new")
    loose = rank == 1
    out = {
        "async_save": attempt(lambda: _waited(zero_ext.save(new, model, opt, async_save="yes" if loose else True))),
        "dcp_layout": attempt(lambda: zero_ext.save(new, model, opt,
                                                    dcp_layout="torchtitan" if loose else "get_state_dict")),
        "load_format": attempt(lambda: zero_ext.load(path, model, opt, **({"format": "zero_ext"} if loose else {}))),
        "load_strict": attempt(lambda: zero_ext.load(path, model, opt, strict="False" if loose else False)),
    }
    dist.barrier()
    out["written"] = sorted(os.listdir(os.path.dirname(new)))
    out["model_unchanged"] = same(before, params_of(model))
    return out
