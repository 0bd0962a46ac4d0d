"""One rank's offload file for offload_*="nvme": named regions of a file
under offload_path, written and read asynchronously by the C++ I/O threads
of csrc/swap_file.h ([Note: offload files]: space reserved up front, the
file unlinked once open so nothing outlives the process, O_DIRECT where the
file system takes it, a fixed buffer per I/O thread).

    regions = {"master/0": 4 * n0, "exp_avg/0": 4 * n0, ...}
    f = OffloadFile(offload_path, rank, regions)
    done = f.write("master/0", tensor)     # returns at once
    ...                                    # compute meanwhile
    done.wait()                            # raises naming the file if the write failed
    f.read("master/0", out).wait()
"""
from __future__ import annotations

import itertools
import os
from typing import Dict, Mapping, Optional, Tuple

import torch

from . import core_loader  # noqa: F401  (registers torch.classes.zero_ext.SwapFile)

ALIGN = 4096  # SwapFile::kAlign: O_DIRECT's offset, length and buffer alignment
IO_THREADS = 4  # the queue depth one NVMe drive needs to stream (DeepNVMe uses 4-8 per drive)
CHUNK_BYTES = 1 << 20  # per system call, and each I/O thread's aligned buffer
WRITE_BEHIND_BYTES = 32 << 20  # a model's writes in flight before the next one waits for the oldest
_FILES = itertools.count()


def file_path(directory: str, rank: int) -> str:
    """A new offload file's path for this rank and process under `directory`."""
    return os.path.join(directory, f"zero_ext-rank{rank}-pid{os.getpid()}-{next(_FILES)}.swap")


def check_offload_path(path: object, who: str = "zero_ext.wrap") -> str:
    """The directory offload files go in, created if missing; raises what a
    user can act on before anything is written."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{who}: offload_path must be a directory path (str or os.PathLike), got "
                        f"{type(path).__name__} {path!r}; \"nvme\" offload needs one, on a local drive")
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{who}: offload_path {path!r} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{who}: offload_path {path!r} cannot be created: {e.strerror}; point it at a "
                         "writable local directory") from e
    if not os.path.isdir(path):
        raise ValueError(f"{who}: offload_path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{who}: offload_path {path!r} is not writable by this process; point it at a "
                         "writable local directory")
    return path


def plan_regions(sizes: Mapping[str, int]) -> Tuple[Dict[str, int], int]:
    """Offsets of regions of the given byte sizes, each starting at a
    multiple of ALIGN (a region's O_DIRECT padding stays its own), and the
    file's size."""
    offsets, end = {}, 0
    for key, size in sizes.items():
        if size < 0:
            raise ValueError(f"zero_ext internal: region {key!r} has a negative size {size}")
        offsets[key] = end
        end += -(-max(size, 1) // ALIGN) * ALIGN
    return offsets, end


class Transfer:
    """A read or write in flight. Holds its tensor until waited on: the I/O
    threads use the tensor's memory, never the tensor object."""

    def __init__(self, file: "OffloadFile", ticket: int, tensor: torch.Tensor):
        self._file, self._ticket, self._tensor = file, ticket, tensor

    def wait(self) -> torch.Tensor:
        """Blocks until done (the GIL released); the tensor. Raises the
        I/O error, naming the file and region, if it failed."""
        if self._ticket is not None:
            ticket, self._ticket = self._ticket, None
            self._file.native.wait(ticket)
        return self._tensor

    def __del__(self) -> None:
        # Never free memory an I/O thread may still be using; a failure
        # nobody waited for has nobody to tell.
        if self._ticket is not None:
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - see above
                pass


class OffloadFile:
    """Named regions in one rank's offload file under `directory`."""

    def __init__(self, directory: str, rank: int, sizes: Mapping[str, int], threads: int = IO_THREADS,
                 chunk_bytes: int = CHUNK_BYTES):
        directory = check_offload_path(directory)
        self.sizes = dict(sizes)
        self.offsets, total = plan_regions(self.sizes)
        self.native = torch.classes.zero_ext.SwapFile(file_path(directory, rank), total, threads, chunk_bytes)

    @property
    def path(self) -> str:
        """Where the file was made (it is unlinked: nothing is there now)."""
        return self.native.path()

    @property
    def direct(self) -> bool:
        """Whether the file bypasses the page cache (O_DIRECT)."""
        return self.native.direct()

    @property
    def bytes(self) -> int:
        return self.native.bytes()

    def _region(self, key: str, tensor: torch.Tensor) -> int:
        if key not in self.offsets:
            raise KeyError(f"zero_ext internal: no offload region {key!r}")
        if not (tensor.device.type == "cpu" and tensor.is_contiguous()):
            raise ValueError("zero_ext internal: offload regions move contiguous CPU tensors")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.sizes[key]:
            raise ValueError(f"zero_ext internal: {nbytes} bytes do not fit offload region {key!r} "
                             f"({self.sizes[key]} bytes)")
        return self.offsets[key]

    def write(self, key: str, tensor: torch.Tensor) -> Transfer:
        """Starts writing `tensor` into region `key`; keep it unchanged until waited on."""
        return Transfer(self, self.native.write(self._region(key, tensor), tensor), tensor)

    def read(self, key: str, out: Optional[torch.Tensor] = None, *, like: Optional[torch.Tensor] = None) -> Transfer:
        """Starts reading region `key` into `out` (or a new tensor shaped like `like`)."""
        if out is None:
            if like is None:
                raise ValueError("zero_ext internal: read() needs out= or like=")
            out = torch.empty_like(like, memory_format=torch.contiguous_format, device="cpu")
        return Transfer(self, self.native.read(self._region(key, out), out), out)

    def idle(self) -> bool:
        return self.native.idle()

    def bytes_moved(self) -> Tuple[int, int]:
        """(written, read) bytes so far."""
        return self.native.bytes_written(), self.native.bytes_read()
