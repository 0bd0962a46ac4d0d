"""The on-disk format of zero_ext checkpoints: raw shard files, the metadata
that indexes them, and range reads. Needs only torch (convert.py uses it
without zero_ext's C++ runtime).

A checkpoint is a directory:
    metadata.json      written last; lists every piece of every file
    rank{r}.bin        raw little-endian tensor bytes rank r wrote
    optimizer.pt       param groups' hyperparameters (rank 0)
    buffers.pt         persistent buffers (rank 0)
    extra-rank{r}.pt   the `extra` object each rank passed to save()

A piece is a contiguous range [start, start + length) of one tensor,
flattened: a parameter's fp32 value ("param"), or one key of its optimizer
state ("state"); "whole" pieces hold state that is not elementwise. Loading
reads only the byte ranges of the pieces a rank needs.
"""
from __future__ import annotations

import ctypes
import glob
import json
import os
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch

FORMAT = "zero_ext-checkpoint"
VERSION = 1
METADATA = "metadata.json"

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                               torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]


def _bytes_view(t: torch.Tensor):
    """The tensor's memory as a ctypes buffer, without a copy. Only host
    memory: a device pointer handed to file I/O would crash the process."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise RuntimeError(f"zero_ext internal: file I/O needs a contiguous CPU tensor, got one on "
                           f"{t.device} (contiguous: {t.is_contiguous()})")
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


class ShardWriter:
    """Appends tensors to one raw file and records where each went."""

    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "wb")
        self.offset = 0

    def write(self, tensor: torch.Tensor) -> Tuple[int, str]:
        t = tensor.detach().to("cpu").contiguous()
        self.file.write(_bytes_view(t))
        at = self.offset
        self.offset += t.numel() * t.element_size()
        return at, dtype_name(t.dtype)

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: str) -> str:
    """The checkpoint directory to read. A save replaces an existing
    checkpoint with two renames (old aside, new in place); if it died between
    them, the previous checkpoint is still complete under its `.old-` name."""
    if os.path.isdir(path):
        return path
    aside = sorted(glob.glob(glob.escape(path) + ".old-*"), key=os.path.getmtime)
    for candidate in reversed(aside):
        if os.path.isfile(os.path.join(candidate, METADATA)):
            return candidate
    partial = glob.glob(glob.escape(path) + ".tmp-*")
    hint = f" (only unfinished saves: {partial}; a save died before completing)" if partial else ""
    raise FileNotFoundError(f"zero_ext: no checkpoint at {path}{hint}")


def read_metadata(path: str) -> dict:
    file = os.path.join(path, METADATA)
    if not os.path.isfile(file):
        raise RuntimeError(
            f"zero_ext: {file} is missing: {path} is not a complete zero_ext checkpoint "
            "(metadata is written last, so a save that died leaves none)")
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as error:
        raise RuntimeError(f"zero_ext: {file} is unreadable or truncated: {error}") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise RuntimeError(
            f"zero_ext: {file} is not a zero_ext checkpoint of version {VERSION} "
            f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
    for name, size in meta["files"].items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise RuntimeError(f"zero_ext: checkpoint file {full} is missing")
        actual = os.path.getsize(full)
        if actual != size:
            raise RuntimeError(
                f"zero_ext: checkpoint file {full} has {actual} bytes, the metadata says {size} "
                "(truncated or overwritten)")
    return meta


class PieceReader:
    """Reads ranges of checkpointed tensors from the shard files."""

    def __init__(self, path: str, meta: dict):
        self.path = path
        self.pieces: Dict[Tuple[str, str, str], List[dict]] = defaultdict(list)
        for piece in meta["pieces"]:
            self.pieces[(piece["kind"], piece["name"], piece.get("key", ""))].append(piece)
        for found in self.pieces.values():
            found.sort(key=lambda p: p["start"])
        self.files: Dict[str, object] = {}

    def keys(self, kind: str, name: str) -> List[str]:
        return sorted({k for (kd, n, k) in self.pieces if kd == kind and n == name})

    def scalars(self, name: str, start: int, length: int) -> dict:
        """Scalar optimizer state of the first piece overlapping the range."""
        for piece in self.pieces.get(("scalars", name, ""), []):
            if piece["start"] < start + length and start < piece["start"] + piece["length"]:
                return piece["values"]
        return {}

    def _file(self, name: str):
        if name not in self.files:
            self.files[name] = open(os.path.join(self.path, name), "rb")
        return self.files[name]

    def read(self, kind: str, name: str, start: int, length: int, key: str = "",
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Elements [start, start + length) of a flattened tensor."""
        found = self.pieces.get((kind, name, key))
        if not found:
            raise RuntimeError(f"zero_ext: checkpoint {self.path} holds no {kind} {key} for '{name}'")
        out = torch.empty(length, dtype=dtype or dtype_of(found[0]["dtype"]), device="cpu")
        covered = 0
        for piece in found:
            lo = max(start, piece["start"])
            hi = min(start + length, piece["start"] + piece["length"])
            if lo >= hi:
                continue
            stored = dtype_of(piece["dtype"])
            # Straight into the result when the dtype matches: no second copy.
            chunk = out[lo - start:hi - start] if stored == out.dtype else torch.empty(hi - lo, dtype=stored, device="cpu")
            f = self._file(piece["file"])
            f.seek(piece["offset"] + (lo - piece["start"]) * chunk.element_size())
            want = chunk.numel() * chunk.element_size()
            got = f.readinto(_bytes_view(chunk))
            if got != want:
                raise RuntimeError(f"zero_ext: checkpoint file {os.path.join(self.path, piece['file'])} "
                                   f"ended early reading '{name}' (truncated?)")
            if chunk.data_ptr() != out[lo - start:hi - start].data_ptr():
                out[lo - start:hi - start].copy_(chunk)
            covered += hi - lo
        if covered != length:
            raise RuntimeError(
                f"zero_ext: checkpoint {self.path} covers {covered} of elements [{start}, {start + length}) "
                f"of {kind} {key} '{name}' (a shard file's pieces are missing from the metadata?)")
        return out

    def read_whole(self, name: str, key: str) -> torch.Tensor:
        piece = self.pieces[("whole", name, key)][0]
        out = self.read("whole", name, 0, piece["length"], key)
        return out.view(piece["shape"])

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()
