"""A torch.save state_dict file written one tensor at a time, for a
converter whose whole model would not fit in memory: the file is first
written with its tensor bytes left out (torch.serialization.skip_data), then
each tensor is produced, one at a time, and written into its record's place.
torch.load reads the result as any torch.save file. Peak memory: the largest
tensor. Used by both formats' converters (checkpoint/convert.py,
dcp/convert.py)."""
from __future__ import annotations

import os
import struct
import zipfile
from typing import Callable, Dict, List, Tuple

import torch

from .bytes_io import bytes_view

# (a tensor of the skeleton, what produces its values: a tensor of its shape)
Fill = Tuple[torch.Tensor, Callable[[], torch.Tensor]]


def _record_offsets(path: str, who: str) -> Dict[str, tuple]:
    """Storage key -> (byte offset of its data in the zip, size)."""
    offsets = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data":
                if info.compress_type != zipfile.ZIP_STORED:
                    raise RuntimeError(f"{who}: torch.save compressed a record; cannot fill it in place")
                raw.seek(info.header_offset)
                header = raw.read(30)
                name_len, extra_len = struct.unpack("<HH", header[26:30])
                offsets[parts[2]] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return offsets


def write_state_dict_file(skeleton: Dict[str, torch.Tensor], fill: List[Fill], out: str, who: str) -> None:
    """Writes `skeleton` (uninitialized tensors: never touched, so never
    resident; tied names share one tensor) to `out` as torch.save would, each
    tensor's values from its producer in `fill`. Atomic: `out` appears whole
    or not at all (a half-written `.partial` is removed)."""
    partial = out + ".partial"
    try:
        with torch.serialization.skip_data():
            torch.save(skeleton, partial)
        offsets = _record_offsets(partial, who)
        # torch.save numbers storages in the order it first meets them.
        storage_keys: Dict[int, str] = {}
        keys = {}
        for tensor in skeleton.values():
            storage = tensor.untyped_storage()._cdata
            keys[id(tensor)] = storage_keys.setdefault(storage, str(len(storage_keys)))
        with open(partial, "r+b") as f:
            for tensor, produce in fill:
                if tensor.numel() == 0:
                    continue  # no bytes to fill in
                offset, size = offsets[keys[id(tensor)]]
                value = produce().to(tensor.dtype).contiguous()
                if tuple(value.shape) != tuple(tensor.shape) or value.numel() * value.element_size() != size:
                    raise RuntimeError(f"{who}: a record's size does not match its tensor {list(tensor.shape)}")
                os.pwrite(f.fileno(), bytes_view(value), offset)
                del value
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)  # never leave a half-filled file behind
        raise
    os.replace(partial, out)
