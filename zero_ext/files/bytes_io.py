"""Tensors as raw bytes, and files made durable: what zero_ext's checkpoint
format and its safetensors reader and writer both need. Host memory only."""
from __future__ import annotations

import ctypes
import os
from typing import Any

import torch


# Opening a file a checkpoint names: never through a link, never inherited, and
# never blocking (a FIFO planted in a checkpoint would block a plain open
# forever; the regular-file check after the open refuses it).
READ_NOFOLLOW = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_NONBLOCK", 0))


def bytes_view(t: torch.Tensor):
    """The tensor's memory as a ctypes buffer, without a copy. Only host
    memory: a device pointer handed to file I/O would crash the process."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise RuntimeError(f"zero_ext internal: file I/O needs a contiguous CPU tensor, got one on "
                           f"{t.device} (contiguous: {t.is_contiguous()})")
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def close_opened(owner: Any) -> None:
    """Closes a reader's open files (owner.files) and its directory (owner.dir_fd)."""
    for f in owner.files.values():
        f.close()
    owner.files.clear()
    if owner.dir_fd is not None:
        os.close(owner.dir_fd)
        owner.dir_fd = None
