"""Rank-side halves of tests/test_checkpoint_trust.py: crafted, damaged,
mixed and racing checkpoints, and saves that go wrong on one rank.

Every item catches what zero_ext raises and returns a small report (exception
type, message, seconds, what is on disk) for the test to judge, so one
expected error never ends the group; only a crash or a hang fails an item.
Items are (case, root) tuples, run with dist_harness.run_items_on_ranks.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import zero_ext
from zero_ext.files.checkpoint import format as _checkpoint_files
from zero_ext.files.checkpoint import load as _load_module
from zero_ext.files.checkpoint import publish as _publish
from zero_ext.files.checkpoint.checksum import digest
from zero_ext.files.checkpoint.metadata import seal
from zero_ext.convert import convert

TIMEOUT = 30  # the model group's collective timeout: a hang would take this long
SECRET_VALUE = 1234.5  # the float a secret file next to a checkpoint is made of


class Tiny(nn.Module):
    """A linear layer, a one-element parameter (and a zero-size one) and a buffer."""

    def __init__(self, seed: int = 0, buffer_len: Optional[int] = 4, more: bool = False, zero_size: bool = False,
                 scalar: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(3, 2)
        self.one = nn.Parameter(torch.empty(1))
        self.empty = nn.Parameter(torch.empty(0)) if zero_size else None
        self.scalar = nn.Parameter(torch.empty(())) if scalar else None  # 0-d, as CLIP's logit_scale
        if buffer_len is not None:
            self.register_buffer("scale", torch.empty(buffer_len))
        if more:
            self.more = nn.Linear(2, 2)
        with torch.no_grad():
            for t in list(self.parameters()) + list(self.buffers()):
                t.copy_(torch.randn(t.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.one
        if self.empty is not None:
            y = y + self.empty.sum()
        if self.scalar is not None:
            y = y * self.scalar
        return self.more(y) if hasattr(self, "more") else y


def make(stage: int = 0, seed: int = 0, lr: float = 0.05, **kw):
    model = Tiny(seed, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return zero_ext.wrap(model, opt, stage=stage, bucket_mb=0.0001, timeout=TIMEOUT)


def step(model, opt, rank: int = 0, n: int = 1) -> None:
    for i in range(n):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(100 * i + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def attempt(fn: Callable[[], Any]) -> Dict[str, Any]:
    """{'error': type name or None, 'message', 'seconds', 'value'}."""
    start = time.monotonic()
    try:
        value = fn()
        return {"error": None, "message": "", "seconds": time.monotonic() - start, "value": value}
    except Exception as e:  # noqa: BLE001 - the test judges it
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start, "value": None}


def params_of(model) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in zero_ext.full_state_dict(model).items()}


def same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def litter(path: str) -> List[str]:
    return sorted(os.path.basename(p) for p in glob.glob(glob.escape(path) + ".*"))


class Evil:
    """Unpickling this (weights_only=False) creates `marker`: proof that a
    checkpoint file ran code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class Custom:
    """A plain user object: fine for pickle, not for weights_only."""

    def __init__(self):
        self.x = 1


def _meta(path: str) -> dict:
    with open(os.path.join(path, "metadata.json")) as f:
        return json.load(f)


def _put_meta(path: str, meta: Any) -> None:
    """Writes crafted metadata as a deliberate forger would: sealed with the
    checksum load expects, so what is under test is the validation behind it."""
    if isinstance(meta, dict):
        meta = seal(meta)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(meta, f)


def _entry(file: str) -> dict:
    """A metadata files entry that agrees with `file` as it is now."""
    if not file.endswith(".pt"):
        return {"size": os.path.getsize(file), "checksum": None}
    with open(file, "rb") as f:
        return {"size": os.path.getsize(file), "checksum": digest(f.read())}


def _refresh_size(path: str, name: str) -> None:
    """After replacing a file, make the metadata's size record (where it keeps
    one) agree, so only the property under test is wrong."""
    meta = _meta(path)
    if name in meta.get("files", {}):
        meta["files"][name] = _entry(os.path.join(path, name))
        _put_meta(path, meta)


def _piece(meta: dict, name: str, kind: str = "param") -> dict:
    return next(p for p in meta["pieces"] if p["kind"] == kind and p["name"] == name)


# --- world 1, first: crafted files and metadata, strictness, mixing ---------

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


def _secret(where: str, size: int = 4096) -> str:
    """A file beside the checkpoint made of SECRET_VALUE floats."""
    secret = os.path.join(where, "secret.bin")
    torch.full((size // 4,), SECRET_VALUE).numpy().tofile(secret)
    return secret


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


def _strict(root: str) -> Dict[str, Any]:
    out = {}
    model, opt = make(0, buffer_len=1)
    zero_ext.save(os.path.join(root, "buf1"), model, opt)
    model, opt = make(0)
    step(model, opt)
    path = os.path.join(root, "strict")
    zero_ext.save(path, model, opt)
    saved = params_of(model)

    m, o = make(0, seed=3)  # a saved (1,) buffer must not broadcast into a (4,) one
    out["buffer-shape"] = attempt(lambda: zero_ext.load(os.path.join(root, "buf1"), m, o))
    out["buffer-shape-nonstrict"] = attempt(lambda: zero_ext.load(os.path.join(root, "buf1"), m, o, strict=False))

    m, o = make(0, seed=3)
    m.register_buffer("count", torch.zeros(2))  # missing from the checkpoint
    out["buffer-missing"] = attempt(lambda: zero_ext.load(path, m, o))
    m, o = make(0, seed=3)
    m.register_buffer("count", torch.full((2,), 7.0))
    out["buffer-missing-nonstrict"] = attempt(lambda: zero_ext.load(path, m, o, strict=False))
    out["buffer-missing-nonstrict-kept"] = bool(torch.equal(m.count, torch.full((2,), 7.0)))
    out["buffer-missing-nonstrict-loaded"] = same(params_of(m), dict(saved, count=m.count))

    m, o = make(0, seed=3, buffer_len=None)  # the checkpoint's buffer is unexpected
    out["buffer-unexpected"] = attempt(lambda: zero_ext.load(path, m, o))
    m, o = make(0, seed=3, buffer_len=None)
    out["buffer-unexpected-nonstrict"] = attempt(lambda: zero_ext.load(path, m, o, strict=False))

    m, o = make(0, seed=3, more=True)  # parameters missing from the checkpoint
    more = {k: v.clone() for k, v in m.more.state_dict().items()}
    out["param-missing"] = attempt(lambda: zero_ext.load(path, m, o))
    m, o = make(0, seed=3, more=True)
    out["param-missing-nonstrict"] = attempt(lambda: zero_ext.load(path, m, o, strict=False))
    got = params_of(m)
    out["param-missing-nonstrict-loaded"] = (all(torch.equal(got[k], v) for k, v in saved.items())
                                             and all(torch.equal(got[f"more.{k}"], v) for k, v in more.items()))

    m2, o2 = make(0, more=True)
    more_path = os.path.join(root, "strict-more")
    zero_ext.save(more_path, m2, o2)
    m, o = make(0, seed=3)  # the checkpoint's extra parameters are unexpected
    out["param-unexpected"] = attempt(lambda: zero_ext.load(more_path, m, o))
    m, o = make(0, seed=3)
    out["param-unexpected-nonstrict"] = attempt(lambda: zero_ext.load(more_path, m, o, strict=False))

    m = Tiny(3)
    m.lin = nn.Linear(4, 2)  # a mis-shaped parameter is refused even when not strict
    o = torch.optim.AdamW(m.parameters())
    zero_ext.wrap(m, o, stage=0, timeout=TIMEOUT)
    out["param-shape-nonstrict"] = attempt(lambda: zero_ext.load(path, m, o, strict=False))

    missing = os.path.join(root, "no-extra")
    shutil.copytree(path, missing)
    os.remove(os.path.join(missing, "extra-rank0.pt"))
    m, o = make(0, seed=3)
    out["extra-missing"] = attempt(lambda: zero_ext.load(missing, m, o))
    return out


def _groups(opt) -> List[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _state_keys(opt) -> List[List[str]]:
    return sorted(sorted(st) for st in opt.state.values())


def _sgd(stage: int = 0, rank: int = 0):
    """Tiny with SGD (momentum), stepped once: it has momentum buffers of its own."""
    model = Tiny(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=0.0001, timeout=TIMEOUT)
    step(model, opt, rank)
    return model, opt


def _into_sgd(path: str, saved: Dict[str, torch.Tensor], stage: int = 0, rank: int = 0) -> Dict[str, Any]:
    """An AdamW checkpoint into SGD: refused by default (nothing changes), with
    "fresh" the model loads and SGD starts without state, its own groups kept,
    and trains on; with "load" AdamW's state and hyperparameters load."""
    out = {}
    model, opt = _sgd(stage, rank)
    before, groups, keys = params_of(model), _groups(opt), _state_keys(opt)
    out["refused"] = attempt(lambda: zero_ext.load(path, model, opt))
    out["refused-unchanged"] = (same(before, params_of(model)) and _groups(opt) == groups
                                and _state_keys(opt) == keys and keys and keys[0] == ["momentum_buffer"])
    model, opt = _sgd(stage, rank)
    groups = _groups(opt)
    out["fresh"] = attempt(lambda: zero_ext.load(path, model, opt, optimizer_class_mismatch="fresh"))
    out["fresh-loaded"] = same(params_of(model), saved)
    out["fresh-groups-kept"] = _groups(opt) == groups
    out["fresh-state"] = _state_keys(opt)
    out["fresh-trains"] = attempt(lambda: step(model, opt, rank))
    out["fresh-state-after-step"] = _state_keys(opt)
    model, opt = _sgd(stage, rank)
    out["load"] = attempt(lambda: zero_ext.load(path, model, opt, optimizer_class_mismatch="load"))
    out["load-loaded"] = same(params_of(model), saved)
    out["load-state"] = _state_keys(opt)
    out["load-betas"] = opt.param_groups[0].get("betas")
    return out


def _step_all(model, opts) -> None:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(7))
    model(x).pow(2).mean().backward()
    for o in opts:
        o.step()
        o.zero_grad()


def _pair(first, second):
    """Tiny with one optimizer for `lin` and another for `one`."""
    model = Tiny(seed=3)
    opts = [first(model.lin.parameters(), lr=0.05), second([model.one], lr=0.05)]
    return zero_ext.wrap(model, opts, stage=0, timeout=TIMEOUT)


def _optimizer_class(root: str) -> Dict[str, Any]:
    """Each optimizer's class is recorded at save and compared at load; a
    checkpoint saved before classes were recorded (version 3) loads into any."""
    model, opt = make(0)
    step(model, opt)
    path = os.path.join(root, "optimizer-class")
    zero_ext.save(path, model, opt)
    saved = params_of(model)
    out = {"recorded": _meta(path).get("optimizer_classes"), "into-sgd": _into_sgd(path, saved)}
    model, opt = _sgd()
    out["bad-option"] = attempt(lambda: zero_ext.load(path, model, opt, optimizer_class_mismatch="allow"))
    model, opt = make(0, seed=3)
    out["same-class"] = attempt(lambda: zero_ext.load(path, model, opt))
    out["same-class-state"] = _state_keys(opt)

    # Version 3, exactly as saved before classes were recorded: that field absent.
    old = os.path.join(root, "optimizer-class-v3")
    shutil.copytree(path, old)
    meta = _meta(old)
    meta.pop("optimizer_classes", None)
    meta["version"] = 3
    _put_meta(old, meta)
    model, opt = _sgd()
    out["v3-into-sgd"] = attempt(lambda: zero_ext.load(old, model, opt))  # accepted, as it was
    out["v3-into-sgd-state"] = _state_keys(opt)
    model, opt = make(0, seed=3)
    out["v3"] = attempt(lambda: zero_ext.load(old, model, opt))
    out["v3-loaded"] = same(params_of(model), saved)
    out["v3-state"] = _state_keys(opt)

    def converted(src):
        convert(src, src + ".plain.pt")
        fresh = Tiny(seed=8)
        fresh.load_state_dict(torch.load(src + ".plain.pt", weights_only=True))
        return same({k: v for k, v in fresh.state_dict().items() if k != "scale"},
                    {k: v for k, v in saved.items() if k != "scale"})
    out["convert"] = attempt(lambda: converted(path))
    out["v3-convert"] = attempt(lambda: converted(old))

    # Several optimizers: each one's class, in order.
    model, opts = _pair(torch.optim.AdamW, torch.optim.SGD)
    _step_all(model, opts)
    pair = os.path.join(root, "optimizer-class-pair")
    zero_ext.save(pair, model, opts)
    out["pair-recorded"] = _meta(pair).get("optimizer_classes")
    model, opts = _pair(torch.optim.AdamW, torch.optim.Adam)
    out["pair-refused"] = attempt(lambda: zero_ext.load(pair, model, opts))
    model, opts = _pair(torch.optim.AdamW, torch.optim.SGD)
    out["pair"] = attempt(lambda: zero_ext.load(pair, model, opts))
    return out


def _two_saves(root: str, case: str):
    """Checkpoints A (extra 'A', lr 0.05, buffer 1s) and B (one more step,
    extra 'B', lr 0.5, buffer 2s) of one model, and what each holds."""
    model, opt = make(0)
    step(model, opt)
    model.scale.fill_(1.0)
    a = os.path.join(root, case, "A")
    zero_ext.save(a, model, opt, extra="A")
    want_a = params_of(model)
    step(model, opt)
    model.scale.fill_(2.0)
    for g in opt.param_groups:
        g["lr"] = 0.5
    b = os.path.join(root, case, "B")
    zero_ext.save(b, model, opt, extra="B")
    want_b = params_of(model)
    return a, b, model, opt, want_a, want_b


def _which(model, opt, extra, want_a, want_b) -> List[str]:
    """Which checkpoint each part of a loaded model came from."""
    def of(match_a, match_b):
        return "A" if match_a else "B" if match_b else "?"
    got = params_of(model)
    weights = {k: v for k, v in got.items() if k != "scale"}
    return [
        of(same(weights, {k: v for k, v in want_a.items() if k != "scale"}),
           same(weights, {k: v for k, v in want_b.items() if k != "scale"})),
        of(bool((model.scale == 1.0).all()), bool((model.scale == 2.0).all())),
        of(opt.param_groups[0]["lr"] == 0.05, opt.param_groups[0]["lr"] == 0.5),
        of(extra == "A", extra == "B"),
    ]


def _mixed(root: str, name: str) -> Dict[str, Any]:
    """One file of A replaced by B's: the directory now mixes two saves."""
    a, b, model, opt, want_a, want_b = _two_saves(root, f"mixed-{name}")
    shutil.copyfile(os.path.join(b, name), os.path.join(a, name))
    _refresh_size(a, name)
    m, o = make(0, seed=9)
    outcome = attempt(lambda: zero_ext.load(a, m, o))
    outcome["parts"] = _which(m, o, outcome["value"], want_a, want_b) if outcome["error"] is None else None
    return outcome


def _race(root: str, when: int) -> Dict[str, Any]:
    """A save of B to the same path lands during a load of A: just before
    the load's `when`-th torch.load call."""
    a, b, model, opt, want_a, want_b = _two_saves(root, f"race-{when}")
    real = torch.load
    calls = [0]

    def racing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == when:
            torch.load = real
            zero_ext.save(a, model, opt, extra="B")  # model and opt hold B
        return real(*args, **kwargs)

    m, o = make(0, seed=9)
    torch.load = racing
    try:
        outcome = attempt(lambda: zero_ext.load(a, m, o))
    finally:
        torch.load = real
    outcome["saved_during"] = calls[0] >= when
    outcome["parts"] = _which(m, o, outcome["value"], want_a, want_b) if outcome["error"] is None else None
    return outcome


def _zero_size_save(root: str, world: int, rank: int) -> Dict[str, Any]:
    """Saves Tiny at every stage at this world size, with the full state to compare."""
    out = {}
    for stage in range(4):
        path = os.path.join(root, f"zs-w{world}-s{stage}")

        def save():
            model, opt = make(stage, zero_size=True)
            step(model, opt, rank, n=2)
            zero_ext.save(path, model, opt, extra={"rank": rank})
            want = params_of(model)  # collective
            if rank == 0:
                torch.save(want, path + ".want")
        out[stage] = attempt(save)
    return out


def _zero_size_load(root: str, world: int, rank: int, saved_world: int) -> Dict[str, Any]:
    """Every stage's checkpoint from `saved_world` into every stage here: the
    same full state; then one more step works."""
    out = {}
    for saved in range(4):
        path = os.path.join(root, f"zs-w{saved_world}-s{saved}")
        for stage in range(4):
            def load():
                model, opt = make(stage, seed=5, zero_size=True)
                extra = zero_ext.load(path, model, opt)
                want = torch.load(path + ".want", weights_only=True)
                if not same(params_of(model), want):
                    raise AssertionError("the loaded state differs from the saved one")
                step(model, opt, rank)
                return extra["rank"]
            out[f"{saved}->{stage}"] = attempt(load)
    return out


def _zero_size_convert(root: str) -> Dict[str, Any]:
    out = {}
    for world in (1, 2):
        for stage in range(4):
            path = os.path.join(root, f"zs-w{world}-s{stage}")

            def check():
                convert(path, path + ".plain.pt")
                plain = torch.load(path + ".plain.pt", weights_only=True)
                fresh = Tiny(seed=8, zero_size=True)
                fresh.load_state_dict(plain)
                if not same(dict(fresh.state_dict()), torch.load(path + ".want", weights_only=True)):
                    raise AssertionError("the converted state differs from the saved one")
            out[f"w{world}-s{stage}"] = attempt(check)
    return out


def first_world1(rank: int, world: int, item) -> Any:
    case, root = item
    if case.startswith("dcp:"):
        import dcp_trust_scenarios
        return dcp_trust_scenarios.world1(root, case[4:])
    if case.startswith("meta:"):
        path = _copy_base(root, case[5:])
        _mutate_meta(path, case[5:])
        return _load_and_convert(path)
    if case.startswith("evil:"):
        return _evil(root, case[5:])
    if case == "extra-kinds":
        return _extra_kinds(root)
    if case == "strict":
        return _strict(root)
    if case.startswith("mixed:"):
        return _mixed(root, case[6:])
    if case.startswith("race:"):
        return _race(root, int(case[5:]))
    if case == "zero-size-save":
        return _zero_size_save(root, world, rank)
    if case == "optimizer-class":
        return _optimizer_class(root)
    raise ValueError(case)


# --- world 2: collective decisions and error propagation --------------------

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


def _ranks_open_different_saves(root: str, rank: int, world: int) -> Dict[str, Any]:
    """Rank 0 opens checkpoint A; then B is renamed into its place; then rank
    1 opens the path: the ranks must notice they hold different saves."""
    model, opt = make(2)
    where = os.path.join(root, "ranks-differ")
    a, b = os.path.join(where, "ckpt"), os.path.join(where, "B")
    zero_ext.save(a, model, opt, extra="A")
    step(model, opt, rank)
    zero_ext.save(b, model, opt, extra="B")
    real = _load_module.Checkpoint

    def opened_in_turn(*args, **kwargs):
        if rank == 0:
            checkpoint = real(*args, **kwargs)
        dist.barrier()
        if rank == 1:
            os.rename(a, a + "-gone")
            os.rename(b, a)
            checkpoint = real(*args, **kwargs)
        dist.barrier()
        return checkpoint

    m, o = make(2, seed=4)
    before = params_of(m)
    _load_module.Checkpoint = opened_in_turn
    try:
        outcome = attempt(lambda: zero_ext.load(a, m, o))
    finally:
        _load_module.Checkpoint = real
    outcome["model_unchanged"] = same(before, params_of(m))
    return outcome


def _optimizer_class_world2(root: str, rank: int) -> Dict[str, Any]:
    """Stage 2 (sharded state): an AdamW checkpoint into SGD on every rank."""
    model, opt = make(2)
    step(model, opt, rank)
    path = os.path.join(root, "optimizer-class-w2")
    zero_ext.save(path, model, opt)
    out = _into_sgd(path, params_of(model), stage=2, rank=rank)
    model, opt = _sgd(2, rank)
    mode = "fresh" if rank == 0 else "load"
    out["modes-differ"] = attempt(lambda: zero_ext.load(path, model, opt, optimizer_class_mismatch=mode))
    return out


class SliceNormSGD(torch.optim.SGD):
    """Marked elementwise, but keeps a scalar that depends on the slice it
    steps (its gradient's norm): ranks holding parts of one parameter hold
    different values, which one checkpoint value per parameter cannot keep."""
    zero_ext_elementwise = True

    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["grad_norm"] = float(p.grad.norm())
        return loss


def _scalar_per_slice(root: str, rank: int) -> Dict[str, Any]:
    model = Tiny(seed=0)
    opt = SliceNormSGD(model.parameters(), lr=0.05)
    model, opt = zero_ext.wrap(model, opt, stage=2, bucket_mb=0.0001, timeout=TIMEOUT)
    step(model, opt, rank)
    path = os.path.join(root, "scalar-per-slice", "ckpt")
    outcome = attempt(lambda: zero_ext.save(path, model, opt))
    dist.barrier()
    outcome["published"] = os.path.exists(path)
    outcome["litter"] = litter(path)
    return outcome


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


def world2(rank: int, world: int, item) -> Any:
    case, root = item
    if case == "loose-inputs-rank1":
        return _loose_inputs_rank1(root, rank, world)
    if case.startswith("dcp:"):
        import dcp_trust_scenarios
        return dcp_trust_scenarios.world2(root, case[4:], rank, world)
    if case.startswith("fail-") or case.startswith("file-vanishes"):
        return _save_fails(root, case, rank, world)
    if case == "extra-rule":
        return _extra_rule(root, rank, world)
    if case == "ranks-open-different-saves":
        return _ranks_open_different_saves(root, rank, world)
    if case == "zero-size-save":
        return _zero_size_save(root, world, rank)
    if case.startswith("zero-size-load-from-w"):
        return _zero_size_load(root, world, rank, int(case[-1]))
    if case == "optimizer-class":
        return _optimizer_class_world2(root, rank)
    if case == "scalar-per-slice":
        return _scalar_per_slice(root, rank)
    return _bad_target(root, case, rank, world)


# --- world 1, last: world-2 checkpoints loaded and every one converted ------

def last_world1(rank: int, world: int, item) -> Any:
    case, root = item
    if case.startswith("zero-size-load-from-w"):
        return _zero_size_load(root, world, rank, int(case[-1]))
    if case == "zero-size-convert":
        return _zero_size_convert(root)
    raise ValueError(case)
