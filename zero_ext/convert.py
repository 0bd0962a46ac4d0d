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
    (parameters as fp32 masters, or cast to `dtype`; buffers as saved).
    The checkpoint is validated first, exactly as zero_ext.load does."""
    ckpt = files.Checkpoint(os.path.abspath(checkpoint), "zero_ext.convert")
    try:
        _convert(ckpt, out, dtype)
    finally:
        ckpt.close()


def _convert(ckpt: "files.Checkpoint", out: str, dtype: Optional[torch.dtype]) -> None:
    meta = ckpt.meta
    reader = files.PieceReader(ckpt)
    buffers = ckpt.load_pt("buffers.pt")
    if not isinstance(buffers, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in buffers.items()):
        raise ValueError(f"zero_ext.convert: {ckpt.path('buffers.pt')} is not a name -> tensor mapping; "
                         "restore the checkpoint from a good copy")

    # Skeleton: uninitialized tensors (never touched, so never resident);
    # tied names share one tensor, as in the model's own state_dict.
    skeleton: Dict[str, torch.Tensor] = {}
    fill = []  # (tensor, how to produce its bytes), in first-appearance order
    for param in meta["params"]:
        stored = files.dtype_of(param["dtype"])
        target = dtype if dtype is not None and stored.is_floating_point else stored
        tensor = torch.empty(param["shape"], dtype=target, device="cpu")
        for alias in param["aliases"]:
            if alias in skeleton or alias in buffers:
                raise ValueError(f"zero_ext.convert: {ckpt.meta_file}: params: {alias!r} names two entries; "
                                 "restore the checkpoint from a good copy")
            skeleton[alias] = tensor
        fill.append((tensor, param))
    for name, buf in buffers.items():
        skeleton[name] = buf
        fill.append((buf, None))
    order = sorted(skeleton, key=lambda k: k)  # a stable, readable key order
    skeleton = {k: skeleton[k] for k in order}

    partial = out + ".partial"
    try:
        _write(skeleton, fill, reader, partial)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)  # never leave a half-filled file behind
        raise
    os.replace(partial, out)


def _write(skeleton: Dict[str, torch.Tensor], fill: list, reader: "files.PieceReader", partial: str) -> None:
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
            if tensor.numel() == 0:
                continue  # no bytes to fill in
            offset, size = offsets[keys[id(tensor)]]
            if param is None:
                value = tensor.contiguous()
            else:
                flat = reader.read("param", param["name"], 0, tensor.numel())
                value = flat.to(tensor.dtype).view(tensor.shape)
            if value.numel() * value.element_size() != size:
                raise RuntimeError(f"zero_ext.convert: record size mismatch for {param and param['name']}")
            os.pwrite(f.fileno(), files._bytes_view(value), offset)
            del value
        f.flush()
        os.fsync(f.fileno())


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
