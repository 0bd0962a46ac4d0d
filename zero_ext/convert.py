"""Converts a zero_ext checkpoint into a plain PyTorch state_dict file.

    python -m zero_ext.convert CHECKPOINT OUT.pt [--dtype fp32|bf16|fp16]

The result loads with `model.load_state_dict(torch.load("OUT.pt"))` where
zero_ext is not installed. Peak memory stays near the largest parameter, not
the model: the output file is first written with its tensor bytes left out
(torch.serialization.skip_data), then each parameter is assembled from the
shard files, one at a time, and written into its place in the file.

Uses only torch and the checkpoint format module (no C++ extension).
"""
from __future__ import annotations

import argparse
import os
import struct
import zipfile
from typing import Dict, Optional

import torch

from . import _checkpoint_files as files

_DTYPE_ARGS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _record_offsets(out: str) -> Dict[str, tuple]:
    """Storage key -> (byte offset of its data in the zip, size)."""
    offsets = {}
    with zipfile.ZipFile(out) as archive, open(out, "rb") as raw:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data":
                if info.compress_type != zipfile.ZIP_STORED:
                    raise RuntimeError("zero_ext.convert: torch.save compressed a record; cannot fill it in place")
                raw.seek(info.header_offset)
                header = raw.read(30)
                name_len, extra_len = struct.unpack("<HH", header[26:30])
                offsets[parts[2]] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return offsets


def convert(checkpoint: str, out: str, dtype: Optional[torch.dtype] = None) -> None:
    """Writes a plain state_dict of the checkpointed model to `out`
    (parameters as fp32 masters, or cast to `dtype`; buffers as saved)."""
    where = files.resolve(os.path.abspath(checkpoint))
    meta = files.read_metadata(where)
    reader = files.PieceReader(where, meta)
    buffers = torch.load(os.path.join(where, "buffers.pt"), map_location="cpu", weights_only=True)

    # Skeleton: uninitialized tensors (never touched, so never resident);
    # tied names share one tensor, as in the model's own state_dict.
    skeleton: Dict[str, torch.Tensor] = {}
    fill = []  # (tensor, how to produce its bytes), in first-appearance order
    for param in meta["params"]:
        stored = reader.pieces[("param", param["name"], "")][0]["dtype"]
        target = dtype if dtype is not None and files.dtype_of(stored).is_floating_point else files.dtype_of(stored)
        tensor = torch.empty(param["shape"], dtype=target, device="cpu")
        for alias in param["aliases"]:
            skeleton[alias] = tensor
        fill.append((tensor, param))
    for name, buf in buffers.items():
        skeleton[name] = buf
        fill.append((buf, None))
    order = sorted(skeleton, key=lambda k: k)  # a stable, readable key order
    skeleton = {k: skeleton[k] for k in order}

    partial = out + ".partial"
    with torch.serialization.skip_data():
        torch.save(skeleton, partial)
    offsets = _record_offsets(partial)
    # torch.save numbers storages in the order it first meets them.
    storage_keys: Dict[int, str] = {}
    keys = {}
    for tensor in skeleton.values():
        storage = tensor.untyped_storage()._cdata
        keys[id(tensor)] = storage_keys.setdefault(storage, str(len(storage_keys)))
    with open(partial, "r+b") as f:
        for tensor, param in fill:
            offset, size = offsets[keys[id(tensor)]]
            if param is None:
                value = tensor.contiguous()
            else:
                flat = reader.read("param", param["name"], 0, tensor.numel(), dtype=torch.float32)
                value = flat.to(tensor.dtype).view(tensor.shape)
            if value.numel() * value.element_size() != size:
                raise RuntimeError(f"zero_ext.convert: record size mismatch for {param and param['name']}")
            os.pwrite(f.fileno(), files._bytes_view(value), offset)
            del value
        f.flush()
        os.fsync(f.fileno())
    reader.close()
    os.replace(partial, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero_ext.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a directory written by zero_ext.save")
    parser.add_argument("out", help="the state_dict file to write (torch.save format)")
    parser.add_argument("--dtype", choices=sorted(_DTYPE_ARGS), default=None,
                        help="cast floating parameters to this dtype (default: fp32 masters as saved)")
    args = parser.parse_args(argv)
    convert(args.checkpoint, args.out, _DTYPE_ARGS[args.dtype] if args.dtype else None)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
