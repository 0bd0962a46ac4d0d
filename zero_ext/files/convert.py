"""Converts a zero_ext checkpoint into a plain PyTorch state_dict file, or
into safetensors (one file, or Hugging Face's sharded layout).

    python -m zero_ext.convert CHECKPOINT OUT.pt [--dtype fp32|bf16|fp16]
    python -m zero_ext.convert CHECKPOINT OUT_DIR --format safetensors [--max-shard-size 5GB]

The result loads with `model.load_state_dict(torch.load("OUT.pt"))` where
zero_ext is not installed. Peak memory stays near the largest parameter, not
the model: the output file is first written with its tensor bytes left out
(torch.serialization.skip_data), then each parameter is assembled from the
shard files, one at a time, and written into its place in the file. The
safetensors output is written parameter by parameter too (each tied
parameter once, under its first name, as Hugging Face writes them).

Uses only torch and the checkpoint format module (no C++ extension).
"""
from __future__ import annotations

import argparse
import os
import struct
import zipfile
from typing import Dict, Optional

import torch

from . import format as files
from . import safetensors as st

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


def convert(checkpoint: str, out: str, dtype: Optional[torch.dtype] = None, format: str = "pt",
            max_shard_size="5GB") -> None:
    """Writes the checkpointed model's weights to `out` (parameters as fp32
    masters, or cast to `dtype`; buffers as saved): a torch.save state_dict
    (format="pt"), or safetensors (a file if `out` ends in .safetensors, else
    a directory in Hugging Face's layout). The checkpoint is validated
    first, exactly as zero_ext.load does."""
    if format not in ("pt", "safetensors"):
        raise ValueError(f"zero_ext.convert: format must be 'pt' or 'safetensors', got {format!r}")
    max_bytes = st.parse_size(max_shard_size, "zero_ext.convert")
    ckpt = files.Checkpoint(os.path.abspath(checkpoint), "zero_ext.convert")
    try:
        if format == "pt":
            _convert(ckpt, out, dtype)
        else:
            _convert_safetensors(ckpt, out, dtype, max_bytes)
    finally:
        ckpt.close()


def _buffers(ckpt: "files.Checkpoint") -> Dict[str, torch.Tensor]:
    buffers = ckpt.load_pt("buffers.pt")
    if not isinstance(buffers, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in buffers.items()):
        raise ValueError(f"zero_ext.convert: {ckpt.path('buffers.pt')} is not a name -> tensor mapping; "
                         "restore the checkpoint from a good copy")
    return buffers


def _convert_safetensors(ckpt: "files.Checkpoint", out: str, dtype: Optional[torch.dtype], max_bytes: int) -> None:
    reader = files.PieceReader(ckpt)
    buffers = _buffers(ckpt)

    def cast(stored: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and stored.is_floating_point else stored

    entries, params = [], ckpt.meta["params"]
    for param in params:
        entries.append((param["aliases"][0], cast(files.dtype_of(param["dtype"])), tuple(param["shape"])))
    for name, buf in buffers.items():
        entries.append((name, cast(buf.dtype), tuple(buf.shape)))
    writer = st.ModelWriter(out, entries, max_bytes)
    try:
        for i, param in enumerate(params):
            numel = 1
            for d in param["shape"]:
                numel *= d
            writer.put(i, reader.read("param", param["name"], 0, numel).view(param["shape"]))
        for k, buf in enumerate(buffers.values()):
            writer.put(len(params) + k, buf)
        writer.finish()
    finally:
        writer.abort()


def _convert(ckpt: "files.Checkpoint", out: str, dtype: Optional[torch.dtype]) -> None:
    meta = ckpt.meta
    reader = files.PieceReader(ckpt)
    buffers = _buffers(ckpt)

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
    parser.add_argument("out", help="the file to write (torch.save format), or with --format safetensors "
                                    "a .safetensors file or a directory (Hugging Face's layout)")
    parser.add_argument("--dtype", choices=sorted(_DTYPE_ARGS), default=None,
                        help="cast floating parameters to this dtype (default: fp32 masters as saved)")
    parser.add_argument("--format", choices=("pt", "safetensors"), default="pt")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="safetensors into a directory: the most bytes per file (default: 5GB)")
    args = parser.parse_args(argv)
    convert(args.checkpoint, args.out, _DTYPE_ARGS[args.dtype] if args.dtype else None, args.format,
            args.max_shard_size)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
