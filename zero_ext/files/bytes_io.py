"""Tensors as raw bytes, and files made durable: what every format's
writers and readers need. Host memory only. (Opening a file a checkpoint
names, without trusting it, is safe_read.py.)"""
from __future__ import annotations

import ctypes
import os

import torch


def bytes_view(t: torch.Tensor):
    """The tensor's memory as a ctypes buffer, without a copy. Only host
    memory: a device pointer handed to file I/O would crash the process."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise RuntimeError(f"zero_ext internal: file I/O needs a contiguous CPU tensor, got one on "
                           f"{t.device} (contiguous: {t.is_contiguous()})")
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


def write_file(path: str, data: bytes) -> None:
    """`data` at `path`, on disk before this returns."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
