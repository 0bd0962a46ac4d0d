"""Checkpoint trust, world 1: crafted metadata (every field a forger could
bend, files outside the directory, links, unknown versions) refused before
a byte is read; checkpoint files that would run code when unpickled; what
extra may hold, and what it may not, refused at save."""
from __future__ import annotations

import os
import shutil
from typing import Any, Dict

import torch

import zero_ext
from zero_ext.convert import convert
from checkpoint_trust_common import (
    Custom, Evil, SECRET_VALUE, _entry, _meta, _piece, _put_meta, _refresh_size, _secret, attempt, litter, make,
    params_of, same, step)


def _base(root: str) -> str:
    """A world-1 stage-0 checkpoint of Tiny after one step, saved once."""
    path = os.path.join(root, "base")
    if not os.path.isdir(path):
        model, opt = make(0)
        step(model, opt)
        zero_ext.save(path, model, opt, extra={"step": 1})
    return path


def _copy_base(root: str, case: str) -> str:
    where = os.path.join(root, case)
    shutil.rmtree(where, ignore_errors=True)
    os.makedirs(where)
    path = os.path.join(where, "ckpt")
    shutil.copytree(_base(root), path)
    return path


def _load_and_convert(path: str) -> Dict[str, Any]:
    """Loads `path` into a fresh model and converts it; reports both and
    whether the secret value reached the model or the converted file."""
    model, opt = make(0, seed=9)
    before = params_of(model)
    loaded = attempt(lambda: zero_ext.load(path, model, opt))
    after = params_of(model)
    out = os.path.join(os.path.dirname(path), "plain.pt")
    converted = attempt(lambda: convert(path, out))
    written = b""
    for name in (out, out + ".partial"):
        if os.path.exists(name):
            with open(name, "rb") as f:
                written += f.read()
    secret_bytes = torch.full((4,), SECRET_VALUE).numpy().tobytes()
    return {
        "load": loaded, "convert": converted,
        "model_unchanged": same(before, after),
        "secret_in_model": any(bool((v == SECRET_VALUE).any()) for v in after.values()),
        "secret_in_output": secret_bytes in written,
        "metadata": os.path.join(path, "metadata.json"),
    }


def _mutate_meta(path: str, case: str) -> None:
    where = os.path.dirname(path)
    meta = _meta(path)
    weight = _piece(meta, "lin.weight")
    if case == "traversal":
        weight["file"] = "../secret.bin"
        meta["files"]["../secret.bin"] = _entry(_secret(where))
    elif case == "absolute":
        secret = _secret(where)
        weight["file"] = secret
        meta["files"][secret] = _entry(secret)
    elif case == "proc":
        weight["file"] = "/proc/self/environ"
        meta["files"]["/proc/self/environ"] = {"size": os.path.getsize("/proc/self/environ"), "checksum": None}
    elif case == "symlink":
        shard = os.path.join(path, "rank0.bin")
        secret = _secret(where, os.path.getsize(shard))
        os.remove(shard)
        os.symlink(secret, shard)
    elif case == "negative-offset":
        weight["offset"] = -4
    elif case == "huge-offset":
        weight["offset"] = 2 ** 62
    elif case == "huge-length":
        weight["length"] = 2 ** 40
    elif case == "unknown-dtype":
        weight["dtype"] = "torch.complex64"
    elif case == "lying-dtype":
        weight["dtype"] = "torch.float64"  # the bytes are float32
    elif case == "missing-key":
        del weight["offset"]
    elif case == "wrong-type":
        weight["start"] = "0"
    elif case == "not-a-dict":
        meta = [meta]
    elif case == "deep":
        with open(os.path.join(path, "metadata.json"), "w") as f:
            f.write("[" * 100000 + "]" * 100000)
        return
    elif case == "overlap":
        # [0, 5) plus [0, 1) counts 6 elements for a 6-element weight: the
        # element 5 would be left uninitialized.
        weight["length"] = 5
        meta["pieces"].append(dict(weight, length=1))
    elif case == "gap":
        weight["length"] = 5
    elif case == "unknown-file":
        meta["files"]["evil.sh"] = {"size": 0, "checksum": None}
        open(os.path.join(path, "evil.sh"), "w").close()
    elif case == "bad-optimizer-class":
        meta["optimizer_classes"] = ["torch.optim.AdamW; import os"]
    elif case == "no-optimizer-classes":  # version 4 records them
        del meta["optimizer_classes"]
    elif case == "newer-version":
        meta["version"] = 6
    elif case == "older-version":
        meta["version"] = 2
    else:
        raise ValueError(case)
    _put_meta(path, meta)


META_CASES = ["traversal", "absolute", "proc", "symlink", "negative-offset", "huge-offset", "huge-length",
              "unknown-dtype", "lying-dtype", "missing-key", "wrong-type", "not-a-dict", "deep", "overlap",
              "gap", "unknown-file", "bad-optimizer-class", "no-optimizer-classes", "newer-version", "older-version"]


def _evil(root: str, target: str) -> Dict[str, Any]:
    """One file of a checkpoint replaced by a pickle that would create a marker."""
    path = _copy_base(root, f"evil-{target}")
    marker = os.path.join(os.path.dirname(path), "ran-code")
    name = "buffers.pt" if target == "convert" else target
    torch.save(Evil(marker), os.path.join(path, name))
    _refresh_size(path, name)
    if target == "convert":
        outcome = attempt(lambda: convert(path, os.path.join(os.path.dirname(path), "plain.pt")))
    else:
        model, opt = make(0, seed=9)
        outcome = attempt(lambda: zero_ext.load(path, model, opt))
    outcome["value"] = None  # an unpickled object would not travel back
    outcome["marker"] = os.path.exists(marker)
    return outcome


def _extra_kinds(root: str) -> Dict[str, Any]:
    """What extra may hold round-trips; anything else is refused at save."""
    model, opt = make(0)
    step(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    extra = {"sched": sched.state_dict(), "rng": torch.get_rng_state(), "nested": [1, 2.5, ("a", None), {"t": True}]}
    path = os.path.join(root, "extra-good")
    zero_ext.save(path, model, opt, extra=extra)
    got = zero_ext.load(path, model, opt)
    good = (got["sched"] == extra["sched"] and torch.equal(got["rng"], extra["rng"])
            and got["nested"] == extra["nested"])
    bad = os.path.join(root, "extra-bad")
    refused = attempt(lambda: zero_ext.save(bad, model, opt, extra={"sched": sched.state_dict(), "obj": Custom()}))
    return {"round_trip": good, "refused": refused, "written": os.path.exists(bad) or bool(litter(bad))}
