"""The checks of a parsed metadata.json that relate its parts to each other
(CheckpointMeta.parse runs them after building each part): every name known
and unique, every piece in a listed shard file, the pieces of each tensor
and of each shard file tiling it exactly (no gap, no overlap, so a dtype
that lies about its element size, or two pieces claiming the same elements,
are refused), and one value of each scalar per parameter."""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

from .fields import Fields, numel
from .pieces import (HEADER, ParamPiece, Piece, PieceKind, ScalarsPiece, StoredPiece, WholeStatePiece,
                     describe_scalar, scalars_disagreement)


def check_consistent(meta, f: Fields) -> None:
    """Raises (through `f`) where the parts of `meta`, a CheckpointMeta
    (metadata.py, which runs this as the last step of its parse), disagree."""
    _check_names(meta, f)
    _check_tiling(meta, f)
    _check_scalars(meta.pieces, f)


def _check_scalars(pieces: Tuple[Piece, ...], f: Fields) -> None:
    found = scalars_disagreement(pieces)
    if found is not None:
        seen, piece, key = found
        f.fail(f"pieces[{piece.index}].values[{key!r}]",
               f"is {describe_scalar(piece, key)}, but pieces[{seen.index}] holds {describe_scalar(seen, key)}: the "
               f"scalar optimizer state {key!r} of parameter {piece.name!r} must agree in all its pieces (its "
               "optimizer keeps one value, whichever ranks wrote its elements)")


def _check_names(meta, f: Fields) -> None:
    names, aliases = set(), set()
    for i, param in enumerate(meta.params):
        if param.name in names:
            f.fail(f"params[{i}].name", f"{param.name!r} appears twice")
        names.add(param.name)
        for j, alias in enumerate(param.aliases):
            if alias in aliases:
                f.fail(f"params[{i}].aliases[{j}]", f"{alias!r} names two parameters")
            aliases.add(alias)
    for piece in meta.pieces:
        field = f"pieces[{piece.index}]"
        if piece.name not in names:
            f.fail(f"{field}.name", f"{piece.name!r} is not a parameter listed in params")
        if isinstance(piece, StoredPiece) and (piece.file not in meta.files or not piece.file.endswith(".bin")):
            f.fail(f"{field}.file", f"{piece.file!r} is not one of the checkpoint's shard files (rank<N>.bin)")


def _check_tiling(meta, f: Fields) -> None:
    """The pieces of each tensor tile it, and those of each shard file tile
    the file after its header."""
    tensors: Dict[Tuple[PieceKind, str, str], List[Tuple[int, int, int]]] = defaultdict(list)
    spans: Dict[str, List[Tuple[int, int, int]]] = defaultdict(list)
    wholes = set()
    for piece in meta.pieces:
        field = f"pieces[{piece.index}]"
        param = meta.param(piece.name)
        if isinstance(piece, WholeStatePiece):
            if piece.start != 0 or piece.length != numel(piece.shape):
                f.fail(field, f"covers [{piece.start}, {piece.start + piece.length}) of {piece.key!r} of "
                       f"{piece.name!r}, whose shape {list(piece.shape)} has {numel(piece.shape)} elements: start "
                       "or length is wrong")
            if (piece.name, piece.key) in wholes:
                f.fail(field, f"repeats the whole state {piece.key!r} of {piece.name!r} (overlap)")
            wholes.add((piece.name, piece.key))
        elif piece.start + piece.length > param.numel:
            f.fail(f"{field}.length", f"{piece.length} from start {piece.start} runs past the {param.numel} "
                   f"elements of {piece.name!r} (shape {list(param.shape)})")
        if isinstance(piece, ScalarsPiece):
            tensors[piece.tensor_id].append((piece.start, piece.length, piece.index))
            continue
        if isinstance(piece, ParamPiece) and piece.dtype != param.dtype:
            f.fail(f"{field}.dtype", f"is {piece.dtype} but {piece.name!r} is stored as {param.dtype}")
        end = piece.offset + piece.nbytes
        size = meta.files[piece.file].size
        if end > size:
            f.fail(f"{field}.offset/length", f"bytes [{piece.offset}, {end}) ({piece.length} x {piece.itemsize}-byte "
                   f"{piece.dtype}) run past the end of {piece.file} ({size} bytes)")
        if not isinstance(piece, WholeStatePiece):
            tensors[piece.tensor_id].append((piece.start, piece.length, piece.index))
        if piece.length:
            spans[piece.file].append((piece.offset, end, piece.index))

    for param in meta.params:
        if param.numel and (PieceKind.PARAM, param.name, "") not in tensors:
            f.fail("pieces", f"hold nothing of parameter {param.name!r} ({param.numel} elements): a gap")
    for (kind, name, key), ranges in tensors.items():
        what = f"{kind.value} {key + ' of ' if key else ''}{name!r}"
        _tile(f, sorted(ranges), meta.param(name).numel, f"the pieces of {what}", "elements")
    for file, ranges in spans.items():
        _tile(f, [(a, b - a, i) for a, b, i in sorted(ranges)], meta.files[file].size - HEADER,
              f"the pieces in {file}", "bytes", base=HEADER)
    for file, entry in meta.files.items():
        if file.endswith(".bin") and file not in spans and entry.size != HEADER:
            f.fail(f"files[{file!r}]", f"is {entry.size} bytes, but no piece is in it")


def _tile(f: Fields, ranges: List[Tuple[int, int, int]], total: int, what: str, unit: str, base: int = 0) -> None:
    at = 0
    for start, length, i in ranges:
        if length == 0:
            continue
        start -= base
        if start < at:
            f.fail(f"pieces[{i}]", f"overlaps another piece: {what} overlap at {start + base} ({unit})")
        if start > at:
            f.fail(f"pieces[{i}]", f"leaves a gap: {what} leave [{at + base}, {start + base}) uncovered ({unit})")
        at = start + length
    if at != total:
        f.fail("pieces", f"leave a gap: {what} leave [{at + base}, {total + base}) uncovered ({unit})")
