"""Converts a checkpoint into a plain PyTorch state_dict file, or into
safetensors (one file, or Hugging Face's sharded layout): zero_ext's own
format (checkpoint/convert.py) or any torch.distributed.checkpoint
directory (dcp/convert.py: FSDP2's, torchtitan's, zero_ext's at any
pp x dp x tp layout).

    python -m zero_ext.convert CHECKPOINT OUT.pt [--dtype fp32|bf16|fp16]
    python -m zero_ext.convert CHECKPOINT OUT_DIR --format safetensors [--max-shard-size 5GB]
    python -m zero_ext.convert --verify CHECKPOINT

--verify checks a checkpoint without a model (for a job that copies
checkpoints between stores). zero_ext's own format: the metadata's own
checksum and every field, each file's size and writer (save and rank),
every .pt file's checksum and every byte of every piece against its
checksums. A DCP directory: every item read whole, against zero_ext's
checksums where zero_ext wrote it (other writers record none: the structure
is checked, not the values). It prints "ok" and exits 0, or names each
damaged file and piece and exits 1.

The result loads with `model.load_state_dict(torch.load("OUT.pt"))` where
zero_ext is not installed. Peak memory stays near the largest parameter, not
the model: each parameter is assembled, written into its place and dropped
before the next (state_dict_file.py; safetensors the same way, each tied
parameter once, under its first name, as Hugging Face writes them).

Uses only torch, xxhash and the files modules (no C++ extension).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Tuple

import torch

from .checkpoint import convert as own
from .checkpoint.publish import resolve
from .dcp import convert as dcp
from .dcp.index import METADATA as DCP_INDEX
from .weights import safetensors as st

_DTYPE_ARGS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def holds_dcp(directory: str) -> bool:
    """A DCP directory (its `.metadata`), not a zero_ext checkpoint."""
    return (os.path.isfile(os.path.join(directory, DCP_INDEX))
            and not os.path.lexists(os.path.join(directory, own.OWN_INDEX)))


def convert(checkpoint: str, out: str, dtype: Optional[torch.dtype] = None, format: str = "pt",
            max_shard_size="5GB") -> None:
    """Writes the checkpointed model's weights to `out`: a torch.save
    state_dict (format="pt"), or safetensors (a file if `out` ends in
    .safetensors, else a directory in Hugging Face's layout). zero_ext's own
    format: parameters as fp32 masters (or cast to `dtype`), buffers as
    saved, the checkpoint validated first as zero_ext.load does. A DCP
    directory: the model's tensors as stored (or floating ones cast to
    `dtype`), under their names without get_state_dict's "model." prefix."""
    if not isinstance(format, str):
        raise TypeError(f"zero_ext.convert: format must be a str, 'pt' or 'safetensors', got {format!r}")
    if format not in ("pt", "safetensors"):
        raise ValueError(f"zero_ext.convert: format must be 'pt' or 'safetensors', got {format!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"zero_ext.convert: dtype must be a floating torch.dtype or None (the fp32 masters as "
                        f"saved), got {dtype!r}; e.g. dtype=torch.bfloat16")
    max_bytes = st.parse_size(max_shard_size, "zero_ext.convert")
    where = resolve(os.path.abspath(os.fspath(checkpoint)), "zero_ext.convert")
    if holds_dcp(where):
        dcp.convert_dcp(where, out, dtype, format, max_bytes)
    else:
        own.convert_own(where, out, dtype, format, max_bytes)


def verify(checkpoint: str) -> Tuple[List[str], str]:
    """(problems, summary) of checking a checkpoint whole, without a model."""
    where = os.path.abspath(os.fspath(checkpoint))
    return dcp.verify_dcp(where) if holds_dcp(where) else own.verify(where)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero_ext.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a directory written by zero_ext.save, or any DCP directory")
    parser.add_argument("out", nargs="?", help="the file to write (torch.save format), or with --format safetensors "
                                    "a .safetensors file or a directory (Hugging Face's layout)")
    parser.add_argument("--dtype", choices=sorted(_DTYPE_ARGS), default=None,
                        help="cast floating parameters to this dtype (default: as saved; fp32 masters for zero_ext's)")
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
