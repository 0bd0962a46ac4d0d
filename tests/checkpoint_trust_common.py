"""What the checkpoint trust scenarios share: the Tiny model, wrapped and
stepped; attempt(), which reports what a call raised (type, message,
seconds) for the test to judge; and helpers that read a checkpoint's
metadata and forge it as a deliberate forger would (sealed, sizes and
checksums agreeing), so only the property under test is wrong."""
from __future__ import annotations

import glob
import json
import os
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

import zero_ext
from zero_ext.files.checkpoint.checksum import digest
from zero_ext.files.checkpoint.metadata import seal


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


def _secret(where: str, size: int = 4096) -> str:
    """A file beside the checkpoint made of SECRET_VALUE floats."""
    secret = os.path.join(where, "secret.bin")
    torch.full((size // 4,), SECRET_VALUE).numpy().tofile(secret)
    return secret
