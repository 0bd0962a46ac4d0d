"""metadata.json as typed, frozen values: parsed once, validated by
construction, and sealed with a checksum over its own content.

`CheckpointMeta.parse` is the only reader of the JSON: every field is
checked for type and range as it is built (fields.py: a bool is never an
int, a float scalar is finite, a step count a non-negative integer), then
the pieces (pieces.py) are checked against each other and the files
(metadata_checks.py: exact tiling of every tensor and every shard file).
Code past parse reads attributes, never string keys.

Version 4 records the qualified class of each optimizer the state was saved
from (`optimizer_classes`, so load can refuse another optimizer); version 3
(saved before that) is read with `optimizer_classes` None: nothing to compare.
Version 5 is a version 4 document whose parameters may carry `tensor_parallel`
(a tensor-parallel model's split: ParamMeta); save writes 5 only then, so
whatever an older zero_ext reads it reads right, and it refuses the rest.

The document is sealed (sealing.py): a flipped byte anywhere in the metadata
(a digit of a step count, an offset) is refused even where the result would
still be valid.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ..checksum import ALGORITHM, MAX
from ..sealing import is_sealed, seal
from .fields import DTYPES, Fields, numel
from .metadata_checks import check_consistent
from .pieces import (HEADER, KINDS, ParamPiece, Piece, PieceKind, Scalar, ScalarsPiece, StatePiece, StoredPiece,
                     WholeStatePiece)

# The metadata's vocabulary, named here for every reader of a checkpoint:
# the document's types and the pieces' (defined in pieces.py and fields.py).
__all__ = [
    "CHUNK_BYTES", "CheckpointMeta", "DTYPES", "FORMAT", "FileMeta", "HEADER", "KINDS", "LossScaler", "METADATA",
    "ParamMeta", "ParamPiece", "Piece", "PieceKind", "READABLE_VERSIONS", "Scalar", "ScalarsPiece", "StatePiece",
    "StoredPiece", "VERSION", "WholeStatePiece", "file_names", "numel", "rank_of_file", "seal",
]

FORMAT = "zero_ext-checkpoint"
VERSION = 5  # what save writes
READABLE_VERSIONS = (3, 4, 5)  # 3: no optimizer_classes; 5: parameters may be stored split over tensor parallel
METADATA = "metadata.json"
CHUNK_BYTES = 8 << 20  # a piece's bytes are checksummed in chunks of this size
_TOKEN = re.compile(r"[0-9a-f]{32}\Z")
_MAX_RANKS = 1 << 20
_CLASS_NAME = re.compile(r"[\w.<>]{1,512}\Z")  # module.qualname ("<locals>" in a function's class)


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
        f.get(doc, "checksum", "")  # the seal: present, and checked below once the algorithm is known
        algorithm = f.get(doc, "checksum_algorithm", "")
        if algorithm != ALGORITHM:
            f.fail("checksum_algorithm", f"is {algorithm!r}; this zero_ext checks {ALGORITHM!r}")
        if not is_sealed(doc):
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
        check_consistent(meta, f)
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

