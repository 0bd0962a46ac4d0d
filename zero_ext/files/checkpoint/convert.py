"""Converts a zero_ext checkpoint into a plain PyTorch state_dict file, or
into safetensors (one file, or Hugging Face's sharded layout).

    python -m zero_ext.convert CHECKPOINT OUT.pt [--dtype fp32|bf16|fp16]
    python -m zero_ext.convert CHECKPOINT OUT_DIR --format safetensors [--max-shard-size 5GB]
    python -m zero_ext.convert --verify CHECKPOINT

--verify checks a checkpoint without a model (for a job that copies
checkpoints between stores): the metadata's own checksum and every field,
each file's size and writer (save and rank), every .pt file's checksum and
every byte of every piece against its checksums. It prints "ok" and exits 0,
or names each damaged file and piece and exits 1.

The result loads with `model.load_state_dict(torch.load("OUT.pt"))` where
zero_ext is not installed. Peak memory stays near the largest parameter, not
the model: the output file is first written with its tensor bytes left out
(torch.serialization.skip_data), then each parameter is assembled from the
shard files, one at a time, and written into its place in the file. The
safetensors output is written parameter by parameter too (each tied
parameter once, under its first name, as Hugging Face writes them).

Uses only torch, xxhash and the files modules (no C++ extension).
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
import zipfile
from typing import Dict, List, Optional, Tuple

import torch

from ..bytes_io import bytes_view
from ..weights import safetensors as st
from .format import dtype_of
from .metadata import PieceKind, StoredPiece
from .reader import Checkpoint, PieceReader

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
    if not isinstance(format, str):
        raise TypeError(f"zero_ext.convert: format must be a str, 'pt' or 'safetensors', got {format!r}")
    if format not in ("pt", "safetensors"):
        raise ValueError(f"zero_ext.convert: format must be 'pt' or 'safetensors', got {format!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"zero_ext.convert: dtype must be a floating torch.dtype or None (the fp32 masters as "
                        f"saved), got {dtype!r}; e.g. dtype=torch.bfloat16")
    max_bytes = st.parse_size(max_shard_size, "zero_ext.convert")
    ckpt = Checkpoint(os.path.abspath(checkpoint), "zero_ext.convert")
    try:
        if format == "pt":
            _convert(ckpt, out, dtype)
        else:
            _convert_safetensors(ckpt, out, dtype, max_bytes)
    finally:
        ckpt.close()


def verify(checkpoint: str) -> Tuple[List[str], str]:
    """(problems, summary) of checking a checkpoint whole, without a model.
    Metadata that does not parse raises; each damaged file or piece after
    that is one problem, so a copy job learns everything that is wrong."""
    ckpt = Checkpoint(os.path.abspath(checkpoint), "zero_ext.convert --verify")
    problems: List[str] = []
    try:
        meta = ckpt.meta
        for name in sorted(meta.files):
            try:
                if name.endswith(".pt"):
                    ckpt.load_pt(name)
                else:
                    ckpt.open(name)
            except (OSError, RuntimeError, ValueError) as error:
                problems.append(str(error))
        reader = PieceReader(ckpt)
        buffer = torch.empty(meta.chunk_bytes, dtype=torch.uint8, device="cpu")
        verified = 0
        for piece in meta.pieces:
            if not isinstance(piece, StoredPiece) or not piece.length or piece.file not in ckpt.files:
                continue  # scalars live in the (checked) metadata; a file refused above is reported once
            try:
                reader.verify_piece(piece, buffer)
                verified += piece.nbytes
            except (OSError, RuntimeError, ValueError) as error:
                problems.append(str(error))
        summary = (f"{ckpt.where}: {len(meta.files)} files, {len(meta.pieces)} pieces, {verified} bytes of pieces "
                   f"verified (save {meta.token}, world size {meta.world_size}, stage {meta.stage})")
    finally:
        ckpt.close()
    return problems, summary


def _convert_safetensors(ckpt: "Checkpoint", out: str, dtype: Optional[torch.dtype], max_bytes: int) -> None:
    reader = PieceReader(ckpt)
    buffers = ckpt.load_buffers()

    def cast(stored: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and stored.is_floating_point else stored

    entries, params = [], ckpt.meta.params
    for param in params:
        entries.append((param.aliases[0], cast(dtype_of(param.dtype)), tuple(param.shape)))
    for name, buf in buffers.items():
        entries.append((name, cast(buf.dtype), tuple(buf.shape)))
    writer = st.ModelWriter(out, entries, max_bytes)
    try:
        for i, param in enumerate(params):
            writer.put(i, param.full_from_stored(reader.read(PieceKind.PARAM, param.name, 0, param.numel)))
        for k, buf in enumerate(buffers.values()):
            writer.put(len(params) + k, buf)
        writer.finish()
    finally:
        writer.abort()


def _convert(ckpt: "Checkpoint", out: str, dtype: Optional[torch.dtype]) -> None:
    meta = ckpt.meta
    reader = PieceReader(ckpt)
    buffers = ckpt.load_buffers()

    # Skeleton: uninitialized tensors (never touched, so never resident);
    # tied names share one tensor, as in the model's own state_dict.
    skeleton: Dict[str, torch.Tensor] = {}
    fill = []  # (tensor, how to produce its bytes), in first-appearance order
    for param in meta.params:
        stored = dtype_of(param.dtype)
        target = dtype if dtype is not None and stored.is_floating_point else stored
        tensor = torch.empty(param.shape, dtype=target, device="cpu")
        for alias in param.aliases:
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


def _write(skeleton: Dict[str, torch.Tensor], fill: list, reader: "PieceReader", partial: str) -> None:
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
                flat = reader.read(PieceKind.PARAM, param.name, 0, tensor.numel())
                value = param.full_from_stored(flat.to(tensor.dtype))
            if value.numel() * value.element_size() != size:
                raise RuntimeError(f"zero_ext.convert: record size mismatch for {param and param.name}")
            os.pwrite(f.fileno(), bytes_view(value), offset)
            del value
        f.flush()
        os.fsync(f.fileno())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero_ext.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a directory written by zero_ext.save")
    parser.add_argument("out", nargs="?", help="the file to write (torch.save format), or with --format safetensors "
                                    "a .safetensors file or a directory (Hugging Face's layout)")
    parser.add_argument("--dtype", choices=sorted(_DTYPE_ARGS), default=None,
                        help="cast floating parameters to this dtype (default: fp32 masters as saved)")
    parser.add_argument("--format", choices=("pt", "safetensors"), default="pt")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="safetensors into a directory: the most bytes per file (default: 5GB)")
    parser.add_argument("--verify", action="store_true",
                        help="check every checksum, size and writer of CHECKPOINT; write nothing")
    args = parser.parse_args(argv)
    if args.verify:
        if args.out is not None:
            parser.error("--verify takes the checkpoint only")
        try:
            problems, summary = verify(args.checkpoint)
        except (OSError, RuntimeError, ValueError) as error:
            problems, summary = [str(error)], ""
        if problems:
            for problem in problems:
                print(f"damaged: {problem}", file=sys.stderr)
            sys.exit(1)
        print(f"ok: {summary}")
        return
    if args.out is None:
        parser.error("OUT is required (or pass --verify)")
    convert(args.checkpoint, args.out, _DTYPE_ARGS[args.dtype] if args.dtype else None, args.format,
            args.max_shard_size)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
