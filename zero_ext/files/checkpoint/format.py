"""The bytes of a zero_ext checkpoint's files, and how they are written.
Needs only torch and xxhash (convert.py uses it without zero_ext's C++ runtime).

A checkpoint is a directory:
    metadata.json      written last (metadata.py): every file with its size,
                       every piece of every shard file with its checksums
    rank{r}.bin        a 64-byte header (magic, the save's token, the writing
                       rank and world size), then raw little-endian tensor
                       bytes rank r wrote
    optimizer.pt       param groups' hyperparameters (rank 0)
    buffers.pt         persistent buffers (rank 0)
    extra-rank{r}.pt   the `extra` object each rank passed to save()
Every .pt file holds {"token": token, "rank": writer, "value": ...} and is
checksummed whole in the metadata. The token is random per save, so a
directory that mixes files of two saves is refused; the rank, so a file
swapped with another rank's is refused, even where the sizes agree.
"""
from __future__ import annotations

import os
import re
import struct
from typing import Any, List, Tuple

import torch

from ..bytes_io import bytes_view
from ..checksum import digest
from ..weights_only import serialized
from .fields import DTYPES
from .metadata import CHUNK_BYTES, METADATA
from .pieces import HEADER

_MAGIC = b"zero_ext shard\n\0"
STAGING_MARKER = ".zero_ext-save"  # in every staging directory: marks it as zero_ext's own


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)


def dtype_of(name: str) -> torch.dtype:
    return DTYPES[name]


def storable(dtype: torch.dtype) -> bool:
    return str(dtype) in DTYPES


def is_checkpoint_entry(name: str) -> bool:
    """A name that can appear in a checkpoint directory (or a save's staging)."""
    return (name in ("optimizer.pt", "buffers.pt", METADATA, METADATA + ".partial", STAGING_MARKER,
                     ".metadata", ".metadata.partial", ".metadata.tmp", "zero_ext-dcp.json")
            or re.fullmatch(r"(rank\d+\.bin|extra-rank\d+\.pt|__\d+_\d+\.distcp)", name) is not None)


def shard_header(token: str, rank: int, world_size: int) -> bytes:
    return (_MAGIC + token.encode("ascii") + struct.pack("<II", rank, world_size)).ljust(HEADER, b"\0")


def parse_shard_header(head: bytes) -> Tuple[str, int, int]:
    """(token, rank, world size) a shard file's header names; ("", -1, -1) if it is no header."""
    if len(head) != HEADER or not head.startswith(_MAGIC):
        return "", -1, -1
    at = len(_MAGIC)
    rank, world = struct.unpack("<II", head[at + 32:at + 40])
    return head[at:at + 32].decode("ascii", "replace"), rank, world


def packed(token: str, rank: int, value: Any) -> bytes:
    """The bytes of a .pt file: `value` with the save's token and its writer."""
    return serialized({"token": token, "rank": rank, "value": value})


class ShardWriter:
    """Appends tensors to one raw file (after its header) and records where
    each went and the checksums of its bytes, taken as they are written."""

    def __init__(self, path: str, token: str, rank: int, world_size: int):
        self.path = path
        self.file = open(path, "wb")
        self.file.write(shard_header(token, rank, world_size))
        self.offset = HEADER

    def write(self, tensor: torch.Tensor) -> Tuple[int, str, List[int]]:
        """(offset, dtype name, chunk checksums) of the tensor's bytes."""
        if not storable(tensor.dtype):
            raise TypeError(f"zero_ext.save: cannot store {tensor.dtype} tensors (supported: {sorted(DTYPES)})")
        t = tensor.detach().to("cpu").contiguous()
        at = self.offset
        crcs: List[int] = []
        if t.numel():
            view = memoryview(bytes_view(t)).cast("B")
            for start in range(0, len(view), CHUNK_BYTES):
                chunk = view[start:start + CHUNK_BYTES]
                self.file.write(chunk)
                crcs.append(digest(chunk))
            self.offset += len(view)
        return at, dtype_name(t.dtype), crcs

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def abort(self) -> None:
        """Closes without syncing: the save failed and its staging goes."""
        self.file.close()
