"""metadata.json as typed, frozen values: parsed once, validated by
construction, and sealed with a checksum over its own content.

`CheckpointMeta.parse` is the only reader of the JSON: every field is
checked for type and range as it is built (a bool is never an int, a float
scalar is finite, a step count a non-negative integer), then the pieces are
checked against each other and the files (exact tiling of every tensor and
every shard file). Code past parse reads attributes, never string keys.

Version 4 records the qualified class of each optimizer the state was saved
from (`optimizer_classes`, so load can refuse another optimizer); version 3
(saved before that) is read with `optimizer_classes` None: nothing to compare.
Version 5 is a version 4 document whose parameters may carry `tensor_parallel`
(a tensor-parallel model's split: ParamMeta); save writes 5 only then, so
whatever an older zero_ext reads it reads right, and it refuses the rest.

`seal` adds "checksum": the checksum (checksum.py) of the document's canonical encoding
(sorted keys, no spaces) without that field. A flipped byte anywhere in the
metadata (a digit of a step count, an offset) is refused even where the
result would still be valid.
"""
from __future__ import annotations

import enum
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple

import torch

from .checksum import ALGORITHM, MAX, digest

FORMAT = "zero_ext-checkpoint"
VERSION = 5  # what save writes
READABLE_VERSIONS = (3, 4, 5)  # 3: no optimizer_classes; 5: parameters may be stored split over tensor parallel
METADATA = "metadata.json"
HEADER = 64  # bytes before the first piece of a shard file
CHUNK_BYTES = 8 << 20  # a piece's bytes are checksummed in chunks of this size
_TOKEN = re.compile(r"[0-9a-f]{32}\Z")
_MAX_RANKS = 1 << 20
_MAX = 1 << 62
_CLASS_NAME = re.compile(r"[\w.<>]{1,512}\Z")  # module.qualname ("<locals>" in a function's class)
DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                              torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8, torch.bool,
                              torch.complex64, torch.complex128)}
# Optimizer state that counts steps: a non-negative integer (float tensors such as Adam's "step" hold one).
_COUNTS = re.compile(r"(step|steps|.*_step|.*_steps|n_iter|func_evals)\Z")


def count_problem(key: str, value: Any) -> Optional[str]:
    """Why a scalar of optimizer state cannot be what it is, or None: a step
    count must be a non-negative integer (other scalars may be any number,
    as a tensor's elements may)."""
    if _COUNTS.match(key) and (type(value) is bool or not math.isfinite(value) or value < 0
                               or value != math.floor(value) or abs(value) >= _MAX):
        return f"counts steps, so it must be a non-negative integer, not {value!r}"
    return None


def file_names(world_size: int) -> List[str]:
    """Every file a checkpoint written by `world_size` ranks has, besides metadata.json."""
    names = ["optimizer.pt", "buffers.pt"]
    for r in range(world_size):
        names += [f"rank{r}.bin", f"extra-rank{r}.pt"]
    return names


def rank_of_file(name: str) -> int:
    """The rank that writes a checkpoint file (rank 0 writes the shared ones)."""
    found = re.fullmatch(r"(?:rank|extra-rank)(\d+)\.(?:bin|pt)", name)
    return int(found.group(1)) if found else 0


def _canonical(document: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in document.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(document: Dict[str, Any]) -> Dict[str, Any]:
    """`document` with its "checksum" set to the checksum of the rest."""
    document["checksum"] = digest(_canonical(document))
    return document


class Fields:
    """Reads one JSON object's fields, raising ValueError that names the
    metadata file and the field at fault."""

    def __init__(self, who: str, file: str):
        self.who, self.file = who, file

    def fail(self, field: str, problem: str) -> None:
        raise ValueError(
            f"{self.who}: {self.file}: {field} {problem}. The metadata is damaged or was not written by "
            "zero_ext.save, so nothing was read from this checkpoint; restore it from a good copy")

    def get(self, obj: Mapping, key: str, field: str) -> Any:
        if key not in obj:
            self.fail(f"{field}.{key}" if field else key, "is missing")
        return obj[key]

    def dict(self, value: Any, field: str) -> dict:
        if not isinstance(value, dict):
            self.fail(field, f"must be a JSON object, not {type(value).__name__}")
        return value

    def list(self, value: Any, field: str) -> list:
        if not isinstance(value, list):
            self.fail(field, f"must be a JSON array, not {type(value).__name__}")
        return value

    def str(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            self.fail(field, f"must be a string, not {value!r}")
        return value

    def bool(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            self.fail(field, f"must be true or false, not {value!r}")
        return value

    def int(self, value: Any, field: str, low: int = 0, high: int = _MAX) -> int:
        if type(value) is not int or value < low or value > high:  # bool is an int to Python, not here
            self.fail(field, f"must be an integer in [{low}, {high}], not {value!r}")
        return value

    def number(self, value: Any, field: str, positive: bool = False) -> float:
        if type(value) not in (int, float) or not math.isfinite(value) or (positive and value <= 0):
            self.fail(field, f"must be a finite{' positive' if positive else ''} number, not {value!r}")
        return value

    def dtype(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or value not in DTYPES:
            self.fail(field, f"{value!r} is not one of the dtypes a checkpoint holds ({', '.join(sorted(DTYPES))})")
        return value

    def shape(self, value: Any, field: str) -> Tuple[int, ...]:
        shape = tuple(self.int(s, f"{field}[{j}]") for j, s in enumerate(self.list(value, field)))
        if numel(shape) >= _MAX:
            self.fail(field, f"{list(shape)} has too many elements")
        return shape


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class ParamMeta:
    name: str
    aliases: Tuple[str, ...]  # every name the parameter has in the model (tied ones), its own first
    shape: Tuple[int, ...]
    dtype: str  # of its values in the shard files
    trainable: bool
    group: Optional[int]  # optimizer param group
    # Saved from a tensor-parallel model with the parameter split over tp:
    # (dim, each tp rank's extent along it). Its elements are then stored
    # tp rank by tp rank, each rank's part flattened (split along dim 0, that
    # is the full tensor's own order); None: the full tensor's order.
    tensor_parallel: Optional[Tuple[int, Tuple[int, ...]]] = None

    @property
    def numel(self) -> int:
        return numel(self.shape)

    def full_from_stored(self, flat: torch.Tensor) -> torch.Tensor:
        """The full tensor, in its shape, from its elements in stored order."""
        if self.tensor_parallel is None or self.tensor_parallel[0] == 0:
            return flat.view(self.shape)
        dim, sizes = self.tensor_parallel
        parts, at = [], 0
        for size in sizes:
            shape = list(self.shape)
            shape[dim] = size
            n = numel(shape)
            parts.append(flat[at:at + n].view(shape))
            at += n
        return torch.cat(parts, dim=dim)

    @classmethod
    def parse(cls, obj: Any, f: Fields, field: str) -> "ParamMeta":
        f.dict(obj, field)
        name = f.str(f.get(obj, "name", field), f"{field}.name")
        aliases = tuple(f.str(a, f"{field}.aliases[{j}]")
                        for j, a in enumerate(f.list(f.get(obj, "aliases", field), f"{field}.aliases")))
        if name not in aliases:
            f.fail(f"{field}.aliases", f"must include the parameter's own name {name!r}")
        group = f.get(obj, "group", field)
        shape = f.shape(f.get(obj, "shape", field), f"{field}.shape")
        split = None
        if "tensor_parallel" in obj:
            tp = f.dict(obj["tensor_parallel"], f"{field}.tensor_parallel")
            dim = f.int(f.get(tp, "dim", f"{field}.tensor_parallel"), f"{field}.tensor_parallel.dim", 0,
                        max(len(shape) - 1, 0))
            sizes = tuple(f.int(v, f"{field}.tensor_parallel.sizes[{j}]") for j, v in enumerate(
                f.list(f.get(tp, "sizes", f"{field}.tensor_parallel"), f"{field}.tensor_parallel.sizes")))
            if not shape or not sizes or len(sizes) > _MAX_RANKS or sum(sizes) != shape[dim]:
                f.fail(f"{field}.tensor_parallel.sizes", f"{list(sizes)} do not split dim {dim} of shape "
                       f"{list(shape)}")
            split = (dim, sizes)
        return cls(name, aliases, shape, f.dtype(f.get(obj, "dtype", field), f"{field}.dtype"),
                   f.bool(f.get(obj, "trainable", field), f"{field}.trainable"),
                   None if group is None else f.int(group, f"{field}.group"), split)

    def to_json(self) -> dict:
        out = {"name": self.name, "aliases": list(self.aliases), "shape": list(self.shape), "dtype": self.dtype,
               "trainable": self.trainable, "group": self.group}
        if self.tensor_parallel is not None:
            out["tensor_parallel"] = {"dim": self.tensor_parallel[0], "sizes": list(self.tensor_parallel[1])}
        return out


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


@dataclass(frozen=True)
class FileMeta:
    size: int
    checksum: Optional[int]  # of the whole file (.pt files); shard files' pieces carry their own


@dataclass(frozen=True)
class LossScaler:
    scale: float
    clean_steps: int
    skipped_steps: int


@dataclass(frozen=True)
class CheckpointMeta:
    token: str  # random per save; in every file of the save
    world_size: int
    stage: int
    compute_dtype: Optional[str]
    offload: bool
    loss_scaler: LossScaler
    chunk_bytes: int
    params: Tuple[ParamMeta, ...]
    files: Mapping[str, FileMeta]
    pieces: Tuple[Piece, ...]
    # module.qualname of each optimizer (several: the list passed to save, in order); None: a
    # version-3 checkpoint, which did not record them
    optimizer_classes: Optional[Tuple[str, ...]]

    def param(self, name: str) -> ParamMeta:
        return self._by_name[name]

    def __post_init__(self):
        object.__setattr__(self, "_by_name", {p.name: p for p in self.params})

    def to_json(self) -> dict:
        """The sealed document save writes."""
        if not self.optimizer_classes:
            raise RuntimeError("zero_ext internal: a checkpoint of this version records its optimizer classes")
        return seal({
            "format": FORMAT, "version": VERSION if any(p.tensor_parallel for p in self.params) else 4,
            "checksum_algorithm": ALGORITHM, "token": self.token, "world_size": self.world_size,
            "stage": self.stage, "compute_dtype": self.compute_dtype, "offload": self.offload,
            "loss_scaler": {"scale": self.loss_scaler.scale, "clean_steps": self.loss_scaler.clean_steps,
                            "skipped_steps": self.loss_scaler.skipped_steps},
            "chunk_bytes": self.chunk_bytes,
            "params": [p.to_json() for p in self.params],
            "files": {n: {"size": m.size, "checksum": m.checksum} for n, m in self.files.items()},
            "pieces": [p.to_json() for p in self.pieces],
            "optimizer_classes": list(self.optimizer_classes),
        })

    @classmethod
    def parse(cls, raw: bytes, who: str, file: str) -> "CheckpointMeta":
        f = Fields(who, file)
        try:
            doc = json.loads(raw)
        except RecursionError:
            f.fail("the document", "is not valid JSON for a checkpoint (nested too deeply)")
        except ValueError as error:  # also bad UTF-8
            f.fail("the document", f"is not valid JSON (truncated?): {error}")
        f.dict(doc, "the top level")
        fmt, version = f.get(doc, "format", ""), f.get(doc, "version", "")
        if fmt == FORMAT and type(version) is int and version > VERSION:
            raise ValueError(
                f"{who}: {file}: this checkpoint has format version {version}, written by a newer zero_ext; "
                f"this one reads versions {READABLE_VERSIONS[0]} to {VERSION}. Load it with a zero_ext at least "
                "as new as the one that wrote it")
        if fmt == FORMAT and type(version) is int and version not in READABLE_VERSIONS:
            raise ValueError(
                f"{who}: {file}: this checkpoint has format version {version}; this zero_ext reads versions "
                f"{READABLE_VERSIONS[0]} to {VERSION} (which checksum every piece and record each file's writer). "
                "Load it with the zero_ext that wrote it and save it again, or convert it to a state_dict with "
                "that version")
        if fmt != FORMAT or type(version) is not int or version not in READABLE_VERSIONS:
            f.fail("format/version", f"are {fmt!r}/{version!r}, not a zero_ext checkpoint of version "
                   f"{READABLE_VERSIONS[0]} to {VERSION} ({FORMAT!r})")
        checksum = f.get(doc, "checksum", "")
        algorithm = f.get(doc, "checksum_algorithm", "")
        if algorithm != ALGORITHM:
            f.fail("checksum_algorithm", f"is {algorithm!r}; this zero_ext checks {ALGORITHM!r}")
        if checksum != digest(_canonical(doc)):
            raise ValueError(
                f"{who}: {file}: its checksum does not match its content: the metadata was damaged (a flipped "
                "bit, an edit) after zero_ext.save wrote it. Nothing was read from this checkpoint; restore it "
                "from a good copy")
        token = f.str(f.get(doc, "token", ""), "token")
        if not _TOKEN.match(token):
            f.fail("token", f"{token!r} is not 32 lowercase hex digits")
        world = f.int(f.get(doc, "world_size", ""), "world_size", 1, _MAX_RANKS)
        compute = f.get(doc, "compute_dtype", "")
        scaler = f.dict(f.get(doc, "loss_scaler", ""), "loss_scaler")
        chunk = f.int(f.get(doc, "chunk_bytes", ""), "chunk_bytes", 16, 1 << 40)
        if chunk % 16:
            f.fail("chunk_bytes", "must be a multiple of 16 (every dtype's size divides it)")
        params = tuple(ParamMeta.parse(p, f, f"params[{i}]")
                       for i, p in enumerate(f.list(f.get(doc, "params", ""), "params")))
        if version < 5 and any(p.tensor_parallel for p in params):
            f.fail("params", f"split over tensor parallel in a version {version} document (only 5 has them)")
        meta = cls(
            token=token, world_size=world, stage=f.int(f.get(doc, "stage", ""), "stage", 0, 3),
            compute_dtype=None if compute is None else f.dtype(compute, "compute_dtype"),
            offload=f.bool(f.get(doc, "offload", ""), "offload"),
            loss_scaler=LossScaler(
                f.number(f.get(scaler, "scale", "loss_scaler"), "loss_scaler.scale", positive=True),
                f.int(f.get(scaler, "clean_steps", "loss_scaler"), "loss_scaler.clean_steps"),
                f.int(f.get(scaler, "skipped_steps", "loss_scaler"), "loss_scaler.skipped_steps")),
            chunk_bytes=chunk, params=params,
            files=_parse_files(f.dict(f.get(doc, "files", ""), "files"), world, f),
            pieces=tuple(Piece.parse(i, p, f, chunk)
                         for i, p in enumerate(f.list(f.get(doc, "pieces", ""), "pieces"))),
            optimizer_classes=_parse_classes(f.get(doc, "optimizer_classes", ""), f) if version >= 4 else None)
        _check_names(meta, f)
        _check_tiling(meta, f)
        _check_scalars(meta.pieces, f)
        return meta


def _parse_files(files: dict, world: int, f: Fields) -> Dict[str, FileMeta]:
    expected = file_names(world)
    known = set(expected)
    out = {}
    for name, entry in files.items():
        if name not in known:
            f.fail("files", f"lists {name!r}, which is not a file a checkpoint of {world} rank(s) has "
                   "(rank<N>.bin, extra-rank<N>.pt, optimizer.pt, buffers.pt)")
        field = f"files[{name!r}]"
        f.dict(entry, field)
        crc = f.get(entry, "checksum", field)
        if name.endswith(".pt"):
            crc = f.int(crc, f"{field}.checksum", 0, MAX)
        elif crc is not None:
            f.fail(f"{field}.checksum", "must be null for a shard file (its pieces carry checksums)")
        out[name] = FileMeta(f.int(f.get(entry, "size", field), f"{field}.size"), crc)
    for name in expected:
        if name not in out:
            f.fail("files", f"does not list {name!r}, which a checkpoint of {world} rank(s) has")
    return out


def _parse_classes(value: Any, f: Fields) -> Tuple[str, ...]:
    classes = tuple(f.str(c, f"optimizer_classes[{j}]")
                    for j, c in enumerate(f.list(value, "optimizer_classes")))
    if not classes:
        f.fail("optimizer_classes", "is empty: a checkpoint holds the state of at least one optimizer")
    for j, name in enumerate(classes):
        if not _CLASS_NAME.match(name):
            f.fail(f"optimizer_classes[{j}]", f"{name[:80]!r} is not a qualified class name (module.Class)")
    return classes


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


def _check_scalars(pieces: Tuple[Piece, ...], f: Fields) -> None:
    found = scalars_disagreement(pieces)
    if found is not None:
        seen, piece, key = found
        f.fail(f"pieces[{piece.index}].values[{key!r}]",
               f"is {describe_scalar(piece, key)}, but pieces[{seen.index}] holds {describe_scalar(seen, key)}: the "
               f"scalar optimizer state {key!r} of parameter {piece.name!r} must agree in all its pieces (its "
               "optimizer keeps one value, whichever ranks wrote its elements)")


def describe_scalar(piece: "ScalarsPiece", key: str) -> str:
    scalar = piece.values.get(key)
    if scalar is None:
        return "absent"
    return f"{scalar.value!r} ({scalar.dtype} tensor)" if scalar.tensor else repr(scalar.value)


def _check_names(meta: CheckpointMeta, f: Fields) -> None:
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


def _check_tiling(meta: CheckpointMeta, f: Fields) -> None:
    """The pieces of each tensor tile it, and those of each shard file tile
    the file after its header: no gap, no overlap (so a dtype that lies about
    its element size, or two pieces claiming the same elements, are refused)."""
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
