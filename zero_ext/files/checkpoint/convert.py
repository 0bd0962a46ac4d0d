"""zero_ext's own checkpoint format into a plain PyTorch state_dict file or
safetensors, and --verify over it (files/convert.py is the command line and
picks this or dcp/convert.py): the metadata's own checksum and every
field, each file's size and writer (save and rank), every .pt file's
checksum and every byte of every piece against its checksums. Each
parameter is assembled from the shard files, one at a time, and written
into its place (files/state_dict_file.py), so peak memory stays near the
largest parameter.

Uses only torch, xxhash and the files modules (no C++ extension).
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from ..state_dict_file import write_state_dict_file
from ..weights import safetensors as st
from .format import dtype_of
from .metadata import METADATA as OWN_INDEX, PieceKind, StoredPiece
from .reader import Checkpoint, PieceReader

__all__ = ["OWN_INDEX", "convert_own", "verify"]


def convert_own(where: str, out: str, dtype: Optional[torch.dtype], format: str, max_bytes: int) -> None:
    """Writes the checkpointed model's weights to `out` (parameters as fp32
    masters, or cast to `dtype`; buffers as saved), the checkpoint validated
    first, exactly as zero_ext.load does. files/convert.py checked the
    arguments."""
    ckpt = Checkpoint(where, "zero_ext.convert")
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
    write_state_dict_file(skeleton, [(tensor, _producer(tensor, param, reader)) for tensor, param in fill], out,
                          "zero_ext.convert")


def _producer(tensor: torch.Tensor, param, reader: "PieceReader"):
    """What gives `tensor` its values: a parameter read from its pieces, or a buffer as loaded."""
    if param is None:
        return lambda: tensor
    return lambda: param.full_from_stored(reader.read(PieceKind.PARAM, param.name, 0, tensor.numel()).to(tensor.dtype))


