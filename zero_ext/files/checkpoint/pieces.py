"""The pieces of a checkpoint, as metadata.json lists them: each a range of
one flattened tensor of a parameter, one frozen dataclass per PieceKind with
only its kind's fields (ParamPiece, StatePiece, WholeStatePiece: bytes in a
shard file; ScalarsPiece: the scalar optimizer state of a range, values
only). `Piece.parse` builds the right one from its JSON, checking each field;
scalars_disagreement finds a parameter whose pieces hold different scalars."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple

from ..checksum import MAX
from ..step_counts import count_problem
from .fields import DTYPES, Fields

HEADER = 64  # bytes of a shard file before its first piece


@dataclass(frozen=True)
class Scalar:
    """One scalar of optimizer state: a Python number, or a 0-d tensor's."""
    value: Any
    tensor: bool
    dtype: Optional[str]  # the tensor's

    @classmethod
    def parse(cls, key: str, obj: Any, f: Fields, field: str) -> "Scalar":
        f.dict(obj, field)
        tensor = f.bool(f.get(obj, "tensor", field), f"{field}.tensor")
        dtype = f.dtype(f.get(obj, "dtype", field), f"{field}.dtype") if tensor else None
        if dtype is not None and DTYPES[dtype].is_complex:
            f.fail(f"{field}.dtype", f"{dtype} is not a scalar dtype zero_ext.save writes")
        value = f.get(obj, "value", field)
        if type(value) not in (bool, int, float):
            f.fail(f"{field}.value", f"must be a number or a bool, not {value!r}")
        problem = count_problem(key, value)
        if problem:
            f.fail(f"{field}.value", problem)
        return cls(value, tensor, dtype)

    def to_json(self) -> dict:
        out = {"value": self.value, "tensor": self.tensor}
        if self.tensor:
            out["dtype"] = self.dtype
        return out

    def same_as(self, other: "Scalar") -> bool:
        """The same value of the same kind (NaN equals NaN: a state may hold one)."""
        a, b = self.value, other.value
        if (self.tensor, self.dtype, type(a) is bool) != (other.tensor, other.dtype, type(b) is bool):
            return False
        return a == b or (type(a) is float and type(b) is float and math.isnan(a) and math.isnan(b))


class PieceKind(enum.Enum):
    """What one piece of a checkpoint holds."""

    PARAM = "param"      # a parameter's values, a range of its flattened elements
    STATE = "state"      # one key of its elementwise optimizer state, over the same range
    WHOLE = "whole"      # optimizer state that is not elementwise (Adafactor's factors): all of it, with its shape
    SCALARS = "scalars"  # the scalar optimizer state (step, ...) of a range: values, no bytes


KINDS = tuple(k.value for k in PieceKind)


@dataclass(frozen=True)
class Piece:
    """A contiguous range [start, start + length) of one flattened tensor of
    parameter `name`; one subclass per PieceKind, each with the fields its
    kind has (Piece.parse picks it from the JSON's "kind")."""

    index: int  # in the metadata's list: how errors name it, pieces[index]
    name: str
    start: int
    length: int
    kind: ClassVar[PieceKind]

    @property
    def tensor_id(self) -> Tuple[PieceKind, str, str]:
        """Which tensor the range is of: (kind, parameter, optimizer state key or "")."""
        return self.kind, self.name, ""

    def describe(self) -> str:
        kind, name, key = self.tensor_id
        what = f"{kind.value} {key!r} of {name!r}" if key else f"{kind.value} of {name!r}"
        return f"pieces[{self.index}] ({what}, elements [{self.start}, {self.start + self.length}))"

    @staticmethod
    def parse(index: int, obj: Any, f: Fields, chunk_bytes: int) -> "Piece":
        field = f"pieces[{index}]"
        f.dict(obj, field)
        raw = f.get(obj, "kind", field)
        if raw not in KINDS:
            f.fail(f"{field}.kind", f"{raw!r} is not one of {list(KINDS)}")
        kind = PieceKind(raw)
        name = f.str(f.get(obj, "name", field), f"{field}.name")
        start = f.int(f.get(obj, "start", field), f"{field}.start")
        length = f.int(f.get(obj, "length", field), f"{field}.length")
        if kind is PieceKind.SCALARS:
            values = f.dict(f.get(obj, "values", field), f"{field}.values")
            return ScalarsPiece(index, name, start, length, {
                k: Scalar.parse(k, v, f, f"{field}.values[{k!r}]") for k, v in values.items()})
        key = f.str(f.get(obj, "key", field), f"{field}.key")
        if (kind is PieceKind.PARAM) == bool(key):
            f.fail(f"{field}.key", f"{key!r} is wrong for a {raw} piece (param pieces have none, state pieces one)")
        stored = (index, name, start, length, f.str(f.get(obj, "file", field), f"{field}.file"),
                  f.int(f.get(obj, "offset", field), f"{field}.offset", HEADER),
                  f.dtype(f.get(obj, "dtype", field), f"{field}.dtype"),
                  tuple(f.int(c, f"{field}.checksums[{j}]", 0, MAX)
                        for j, c in enumerate(f.list(f.get(obj, "checksums", field), f"{field}.checksums"))))
        if kind is PieceKind.PARAM:
            piece: StoredPiece = ParamPiece(*stored)
        elif kind is PieceKind.STATE:
            piece = StatePiece(*stored, key)
        else:
            piece = WholeStatePiece(*stored, key, f.shape(f.get(obj, "shape", field), f"{field}.shape"))
        chunks = -(-piece.nbytes // chunk_bytes)
        if len(piece.checksums) != chunks:
            f.fail(f"{field}.checksums", f"has {len(piece.checksums)} checksums for {piece.nbytes} bytes in chunks of "
                   f"{chunk_bytes} ({chunks} expected)")
        return piece

    def to_json(self) -> dict:
        return {"kind": self.kind.value, "name": self.name, "start": self.start, "length": self.length}


@dataclass(frozen=True)
class StoredPiece(Piece):
    """A piece whose elements are bytes in a shard file."""

    file: str
    offset: int
    dtype: str
    checksums: Tuple[int, ...]  # of each chunk_bytes chunk of the piece's bytes

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return self.length * self.itemsize

    def to_json(self) -> dict:
        kind, name, key = self.tensor_id
        return {"kind": kind.value, "name": name, "key": key, "start": self.start, "length": self.length,
                "file": self.file, "offset": self.offset, "dtype": self.dtype, "checksums": list(self.checksums)}


@dataclass(frozen=True)
class ParamPiece(StoredPiece):
    kind: ClassVar[PieceKind] = PieceKind.PARAM


@dataclass(frozen=True)
class StatePiece(StoredPiece):
    key: str  # the optimizer state's key (exp_avg, ...)
    kind: ClassVar[PieceKind] = PieceKind.STATE

    @property
    def tensor_id(self) -> Tuple[PieceKind, str, str]:
        return self.kind, self.name, self.key


@dataclass(frozen=True)
class WholeStatePiece(StatePiece):
    shape: Tuple[int, ...]  # the state tensor's own shape (start 0, length its numel)
    kind: ClassVar[PieceKind] = PieceKind.WHOLE

    def to_json(self) -> dict:
        return {**super().to_json(), "shape": list(self.shape)}


@dataclass(frozen=True)
class ScalarsPiece(Piece):
    values: Mapping[str, Scalar]
    kind: ClassVar[PieceKind] = PieceKind.SCALARS

    def to_json(self) -> dict:
        return {**super().to_json(), "values": {k: v.to_json() for k, v in self.values.items()}}


def scalars_disagreement(pieces) -> Optional[Tuple[Piece, Piece, str]]:
    """(first piece, a piece that differs from it, the key) where two
    scalars pieces of one parameter hold different scalar optimizer state
    (a key only one of them has, or another value); None where they agree.
    A parameter's optimizer has one step count (and one of every scalar),
    however many ranks wrote its elements."""
    first: Dict[str, Piece] = {}
    for piece in pieces:
        if not isinstance(piece, ScalarsPiece):
            continue
        seen = first.setdefault(piece.name, piece)
        for key in sorted(set(seen.values) | set(piece.values)):
            a, b = seen.values.get(key), piece.values.get(key)
            if a is None or b is None or not a.same_as(b):
                return seen, piece, key
    return None



def describe_scalar(piece: "ScalarsPiece", key: str) -> str:
    scalar = piece.values.get(key)
    if scalar is None:
        return "absent"
    return f"{scalar.value!r} ({scalar.dtype} tensor)" if scalar.tensor else repr(scalar.value)

