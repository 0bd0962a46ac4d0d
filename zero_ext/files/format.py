"""The on-disk format of zero_ext checkpoints: raw shard files, the metadata
that indexes them, and reading them back without trusting them. Needs only
torch (convert.py uses it without zero_ext's C++ runtime).

A checkpoint is a directory:
    metadata.json      written last; lists every file (with its size) and
                       every piece of every shard file
    rank{r}.bin        a 64-byte header holding the save's token, then raw
                       little-endian tensor bytes rank r wrote
    optimizer.pt       param groups' hyperparameters (rank 0)
    buffers.pt         persistent buffers (rank 0)
    extra-rank{r}.pt   the `extra` object each rank passed to save()
Every .pt file holds {"token": token, "value": ...}; the token is random per
save and also in metadata.json, so a directory that mixes files of two saves
is refused instead of loaded.

A piece is a contiguous range [start, start + length) of one tensor,
flattened: a parameter's fp32 value ("param"), or one key of its optimizer
state ("state"); "whole" pieces hold state that is not elementwise and
"scalars" pieces the scalar state of a range (in the JSON, no bytes).

Reading trusts nothing: Checkpoint opens the directory once (later opens are
relative to that descriptor, never following links), validates the whole
metadata (names the format writes, types, dtypes, bounds, exact tiling of
every tensor and every shard file) before any other byte is read, and loads
.pt files with weights_only=True only.
"""
from __future__ import annotations

import ctypes
import io
import json
import math
import os
import re
import stat
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

FORMAT = "zero_ext-checkpoint"
VERSION = 2
METADATA = "metadata.json"
HEADER = 64  # bytes before the first piece of a shard file
_MAGIC = b"zero_ext shard\n\0"
_TOKEN = re.compile(r"[0-9a-f]{32}\Z")
_MAX_RANKS = 1 << 20

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                               torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8, torch.bool,
                               torch.complex64, torch.complex128)}
_KINDS = ("param", "state", "whole", "scalars")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]


def storable(dtype: torch.dtype) -> bool:
    return str(dtype) in _DTYPES


def file_names(world_size: int) -> List[str]:
    """Every file a checkpoint written by `world_size` ranks has, besides metadata.json."""
    names = ["optimizer.pt", "buffers.pt"]
    for r in range(world_size):
        names += [f"rank{r}.bin", f"extra-rank{r}.pt"]
    return names


def is_checkpoint_entry(name: str) -> bool:
    """A name that can appear in a checkpoint directory (or a save's staging)."""
    return (name in ("optimizer.pt", "buffers.pt", METADATA, METADATA + ".partial")
            or re.fullmatch(r"(rank\d+\.bin|extra-rank\d+\.pt)", name) is not None)


def shard_header(token: str) -> bytes:
    return (_MAGIC + token.encode("ascii")).ljust(HEADER, b"\0")


def packed(token: str, value: Any) -> bytes:
    """The bytes of a .pt file: `value` with the save's token."""
    buffer = io.BytesIO()
    torch.save({"token": token, "value": value}, buffer)
    return buffer.getvalue()


def _bytes_view(t: torch.Tensor):
    """The tensor's memory as a ctypes buffer, without a copy. Only host
    memory: a device pointer handed to file I/O would crash the process."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise RuntimeError(f"zero_ext internal: file I/O needs a contiguous CPU tensor, got one on "
                           f"{t.device} (contiguous: {t.is_contiguous()})")
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


class ShardWriter:
    """Appends tensors to one raw file (after its token header) and records where each went."""

    def __init__(self, path: str, token: str):
        self.path = path
        self.file = open(path, "wb")
        self.file.write(shard_header(token))
        self.offset = HEADER

    def write(self, tensor: torch.Tensor) -> Tuple[int, str]:
        if not storable(tensor.dtype):
            raise TypeError(f"zero_ext.save: cannot store {tensor.dtype} tensors (supported: {sorted(_DTYPES)})")
        t = tensor.detach().to("cpu").contiguous()
        at = self.offset
        if t.numel():
            self.file.write(_bytes_view(t))
            self.offset += t.numel() * t.element_size()
        return at, dtype_name(t.dtype)

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- metadata validation ------------------------------------------------------

class _Check:
    """Raises ValueError naming the metadata file and the field at fault."""

    def __init__(self, who: str, file: str):
        self.who, self.file = who, file

    def fail(self, field: str, problem: str) -> None:
        raise ValueError(
            f"{self.who}: {self.file}: {field} {problem}. The metadata is damaged or was not written by "
            "zero_ext.save, so nothing was read from this checkpoint; restore it from a good copy")

    def get(self, obj: dict, key: str, field: str) -> Any:
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

    def int(self, value: Any, field: str, low: int = 0, high: Optional[int] = None) -> int:
        # bool is an int to Python, never to the format
        if type(value) is not int or value < low or (high is not None and value > high):
            bound = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
            self.fail(field, f"must be {bound}, not {value!r}")
        return value

    def number(self, value: Any, field: str) -> float:
        if type(value) not in (int, float) or not math.isfinite(value):
            self.fail(field, f"must be a finite number, not {value!r}")
        return value

    def dtype(self, value: Any, field: str) -> torch.dtype:
        if not isinstance(value, str) or value not in _DTYPES:
            self.fail(field, f"{value!r} is not one of the dtypes a checkpoint holds ({', '.join(sorted(_DTYPES))})")
        return _DTYPES[value]


def _numel(shape: List[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def validate_structure(meta: Any, check: _Check) -> None:
    """Types and values of every field, and the exact set of file names;
    nothing that needs the files themselves."""
    meta = check.dict(meta, "the top level")
    fmt, version = check.get(meta, "format", ""), check.get(meta, "version", "")
    if fmt == FORMAT and type(version) is int and version != VERSION:
        raise ValueError(
            f"{check.who}: {check.file}: this checkpoint has format version {version}; this zero_ext reads "
            f"version {VERSION} (which records a token per save and every file's size). Load it with the "
            "zero_ext that wrote it and save it again, or convert it to a state_dict with that version")
    if fmt != FORMAT or version != VERSION:
        check.fail("format/version", f"are {fmt!r}/{version!r}, not a zero_ext checkpoint of version {VERSION} "
                   f"({FORMAT!r})")
    token = check.str(check.get(meta, "token", ""), "token")
    if not _TOKEN.match(token):
        check.fail("token", f"{token!r} is not 32 lowercase hex digits")
    world = check.int(check.get(meta, "world_size", ""), "world_size", 1, _MAX_RANKS)
    check.int(check.get(meta, "stage", ""), "stage", 0, 3)
    compute = check.get(meta, "compute_dtype", "")
    if compute is not None:
        check.dtype(compute, "compute_dtype")
    check.bool(check.get(meta, "offload", ""), "offload")
    scaler = check.dict(check.get(meta, "loss_scaler", ""), "loss_scaler")
    check.number(check.get(scaler, "scale", "loss_scaler"), "loss_scaler.scale")
    check.int(check.get(scaler, "clean_steps", "loss_scaler"), "loss_scaler.clean_steps")
    check.int(check.get(scaler, "skipped_steps", "loss_scaler"), "loss_scaler.skipped_steps")

    names, aliases = set(), set()
    for i, param in enumerate(check.list(check.get(meta, "params", ""), "params")):
        field = f"params[{i}]"
        check.dict(param, field)
        name = check.str(check.get(param, "name", field), f"{field}.name")
        if name in names:
            check.fail(f"{field}.name", f"{name!r} appears twice")
        names.add(name)
        own = check.list(check.get(param, "aliases", field), f"{field}.aliases")
        for j, alias in enumerate(own):
            check.str(alias, f"{field}.aliases[{j}]")
            if alias in aliases:
                check.fail(f"{field}.aliases[{j}]", f"{alias!r} names two parameters")
            aliases.add(alias)
        if name not in own:
            check.fail(f"{field}.aliases", f"must include the parameter's own name {name!r}")
        for j, size in enumerate(check.list(check.get(param, "shape", field), f"{field}.shape")):
            check.int(size, f"{field}.shape[{j}]", 0, 1 << 62)
        if _numel(param["shape"]) >= 1 << 62:
            check.fail(f"{field}.shape", f"{param['shape']} has too many elements")
        check.bool(check.get(param, "trainable", field), f"{field}.trainable")
        group = check.get(param, "group", field)
        if group is not None:
            check.int(group, f"{field}.group")
        check.dtype(check.get(param, "dtype", field), f"{field}.dtype")

    files = check.dict(check.get(meta, "files", ""), "files")
    expected = file_names(world)
    for name, size in files.items():
        if name not in expected:
            check.fail("files", f"lists {name!r}, which is not a file a checkpoint of {world} rank(s) has "
                       "(rank<N>.bin, extra-rank<N>.pt, optimizer.pt, buffers.pt)")
        check.int(size, f"files[{name!r}]")
    for name in expected:
        if name not in files:
            check.fail("files", f"does not list {name!r}, which a checkpoint of {world} rank(s) has")

    for i, piece in enumerate(check.list(check.get(meta, "pieces", ""), "pieces")):
        field = f"pieces[{i}]"
        check.dict(piece, field)
        kind = check.get(piece, "kind", field)
        if kind not in _KINDS:
            check.fail(f"{field}.kind", f"{kind!r} is not one of {list(_KINDS)}")
        name = check.str(check.get(piece, "name", field), f"{field}.name")
        if name not in names:
            check.fail(f"{field}.name", f"{name!r} is not a parameter listed in params")
        check.int(check.get(piece, "start", field), f"{field}.start", 0, 1 << 62)
        check.int(check.get(piece, "length", field), f"{field}.length", 0, 1 << 62)
        if kind == "scalars":
            values = check.dict(check.get(piece, "values", field), f"{field}.values")
            for key, spec in values.items():
                at = f"{field}.values[{key!r}]"
                check.dict(spec, at)
                tensor = check.bool(check.get(spec, "tensor", at), f"{at}.tensor")
                value = check.get(spec, "value", at)
                if type(value) not in (bool, int, float):
                    check.fail(f"{at}.value", f"must be a number or true/false, not {value!r}")
                if tensor:
                    check.dtype(check.get(spec, "dtype", at), f"{at}.dtype")
            continue
        key = check.str(check.get(piece, "key", field), f"{field}.key")
        if (kind == "param") != (key == ""):
            check.fail(f"{field}.key", f"{key!r} is wrong for a {kind} piece")
        file = check.str(check.get(piece, "file", field), f"{field}.file")
        if file not in files or not file.endswith(".bin"):
            check.fail(f"{field}.file", f"{file!r} is not one of the checkpoint's shard files (rank<N>.bin)")
        check.int(check.get(piece, "offset", field), f"{field}.offset", HEADER, 1 << 62)
        check.dtype(check.get(piece, "dtype", field), f"{field}.dtype")
        if kind == "whole":
            for j, size in enumerate(check.list(check.get(piece, "shape", field), f"{field}.shape")):
                check.int(size, f"{field}.shape[{j}]", 0, 1 << 62)


def validate_pieces(meta: dict, check: _Check) -> None:
    """Every piece inside its tensor and its file, with the tensor's dtype;
    the pieces of each tensor tile it, and those of each shard file tile the
    file after its header: no gap, no overlap (so a dtype that lies about its
    element size, or two pieces claiming the same elements, are refused)."""
    params = {p["name"]: p for p in meta["params"]}
    tensors: Dict[Tuple[str, str, str], List[Tuple[int, int, int]]] = defaultdict(list)
    spans: Dict[str, List[Tuple[int, int, int]]] = defaultdict(list)
    whole_shapes: Dict[Tuple[str, str], List[int]] = {}
    for i, piece in enumerate(meta["pieces"]):
        field = f"pieces[{i}]"
        kind, name, start, length = piece["kind"], piece["name"], piece["start"], piece["length"]
        key = piece.get("key", "") if kind != "scalars" else ""
        numel = _numel(params[name]["shape"])
        if kind == "whole":
            if start != 0 or length != _numel(piece["shape"]):
                check.fail(field, f"covers [{start}, {start + length}) of {key!r} of {name!r}, whose shape "
                           f"{piece['shape']} has {_numel(piece['shape'])} elements: start or length is wrong")
            if (name, key) in whole_shapes:
                check.fail(field, f"repeats the whole state {key!r} of {name!r} (overlap)")
            whole_shapes[(name, key)] = piece["shape"]
        elif start + length > numel:
            check.fail(f"{field}.length", f"{length} from start {start} runs past the {numel} elements of "
                       f"{name!r} (shape {params[name]['shape']})")
        if kind == "scalars":
            tensors[(kind, name, key)].append((start, length, i))
            continue
        dtype = _DTYPES[piece["dtype"]]
        if kind == "param" and piece["dtype"] != params[name]["dtype"]:
            check.fail(f"{field}.dtype", f"is {piece['dtype']} but {name!r} is stored as {params[name]['dtype']}")
        end = piece["offset"] + length * dtype.itemsize
        size = meta["files"][piece["file"]]
        if end > size:
            check.fail(f"{field}.offset/length", f"bytes [{piece['offset']}, {end}) ({length} x {dtype.itemsize}-byte "
                       f"{piece['dtype']}) run past the end of {piece['file']} ({size} bytes)")
        if kind != "whole":
            tensors[(kind, name, key)].append((start, length, i))
        if length:
            spans[piece["file"]].append((piece["offset"], end, i))

    for name, param in params.items():
        if _numel(param["shape"]) and ("param", name, "") not in tensors:
            check.fail("pieces", f"hold nothing of parameter {name!r} ({_numel(param['shape'])} elements): a gap")
    for (kind, name, key), ranges in tensors.items():
        what = f"{kind} {key + ' of ' if key else ''}{name!r}"
        _tile(check, sorted(ranges), _numel(params[name]["shape"]), f"the pieces of {what}", "elements")
    for file, ranges in spans.items():
        _tile(check, [(a, b - a, i) for a, b, i in sorted(ranges)], meta["files"][file] - HEADER,
              f"the pieces in {file}", "bytes", base=HEADER)
    for file in meta["files"]:
        if file.endswith(".bin") and file not in spans and meta["files"][file] != HEADER:
            check.fail(f"files[{file!r}]", f"is {meta['files'][file]} bytes, but no piece is in it")


def _tile(check: _Check, ranges: List[Tuple[int, int, int]], total: int, what: str, unit: str,
          base: int = 0) -> None:
    at = 0
    for start, length, i in ranges:
        if length == 0:
            continue
        start -= base
        if start < at:
            check.fail(f"pieces[{i}]", f"overlaps another piece: {what} overlap at {start + base} ({unit})")
        if start > at:
            check.fail(f"pieces[{i}]", f"leaves a gap: {what} leave [{at + base}, {start + base}) uncovered ({unit})")
        at = start + length
    if at != total:
        check.fail("pieces", f"leave a gap: {what} leave [{at + base}, {total + base}) uncovered ({unit})")


# --- reading ------------------------------------------------------------------

_NOFOLLOW = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class Checkpoint:
    """One checkpoint directory, opened once and validated before any byte
    but the metadata's is read. Files are opened relative to the directory's
    descriptor: if a save replaces the path meanwhile, this reader still sees
    the directory it validated (or an error, never files of the new one)."""

    def __init__(self, path: str, who: str):
        self.who = who
        self.where, self.dir_fd = self._open_dir(path)
        self.files: Dict[str, Any] = {}
        try:
            self.meta_file = os.path.join(self.where, METADATA)
            check = _Check(who, self.meta_file)
            self.meta = self._read_metadata(check)
            validate_structure(self.meta, check)
            self._check_sizes()
            validate_pieces(self.meta, check)
        except BaseException:
            self.close()
            raise
        self.token = self.meta["token"]

    def _open_dir(self, path: str) -> Tuple[str, int]:
        for _ in range(3):  # a save renaming the path between resolve and open: look again
            from .publish import resolve  # noqa: PLC0415 - publish imports this module
            where = resolve(path, self.who)
            try:
                return where, os.open(where, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"{self.who}: no checkpoint at {path} (it kept being replaced while opening)")

    def path(self, name: str) -> str:
        return os.path.join(self.where, name)

    def _read_metadata(self, check: _Check) -> Any:
        try:
            fd = os.open(METADATA, _NOFOLLOW, dir_fd=self.dir_fd)
        except FileNotFoundError:
            raise RuntimeError(
                f"{self.who}: {self.meta_file} is missing: {self.where} is not a complete zero_ext checkpoint "
                "(metadata is written last, so a save that died leaves none)") from None
        except OSError as error:
            raise ValueError(f"{self.who}: {self.meta_file} cannot be opened as a regular file "
                             f"({error}); a checkpoint's files are never links") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{self.who}: {self.meta_file} is not a regular file")
            raw = f.read()
        try:
            return json.loads(raw)
        except RecursionError:
            check.fail("the document", "is not valid JSON for a checkpoint (nested too deeply)")
        except ValueError as error:  # also bad UTF-8
            check.fail("the document", f"is not valid JSON (truncated?): {error}")

    def _check_sizes(self) -> None:
        """Every listed file is a regular file here (not a link) of the listed size."""
        for name, size in self.meta["files"].items():
            full = self.path(name)
            try:
                info = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise RuntimeError(f"{self.who}: checkpoint file {full} is missing") from None
            if stat.S_ISLNK(info.st_mode):
                raise ValueError(f"{self.who}: checkpoint file {full} is a symbolic link; zero_ext.save writes "
                                 "regular files only and a link could make loading read any file. Copy the "
                                 "file it points to in its place")
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{self.who}: checkpoint file {full} is not a regular file")
            if info.st_size != size:
                raise RuntimeError(
                    f"{self.who}: checkpoint file {full} has {info.st_size} bytes, the metadata says {size} "
                    "(truncated or overwritten)")

    def open(self, name: str):
        """A validated file of this checkpoint; shard files' tokens checked."""
        if name not in self.files:
            try:
                fd = os.open(name, _NOFOLLOW, dir_fd=self.dir_fd)
            except FileNotFoundError:
                raise RuntimeError(
                    f"{self.who}: {self.path(name)} vanished while loading: the checkpoint was replaced or "
                    "removed by a save during this load; load again") from None
            f = os.fdopen(fd, "rb", buffering=0)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != self.meta["files"][name]:
                f.close()
                raise RuntimeError(f"{self.who}: {self.path(name)} changed while loading (a save replaced it?); "
                                   "load again")
            if name.endswith(".bin"):
                head = f.read(HEADER)
                if head != shard_header(self.token):
                    f.close()
                    self._mixed(name, head[len(_MAGIC):len(_MAGIC) + 32].decode("ascii", "replace")
                                if head.startswith(_MAGIC) else "none")
            self.files[name] = f
        return self.files[name]

    def _mixed(self, name: str, found: str) -> None:
        raise RuntimeError(
            f"{self.who}: {self.path(name)} belongs to another save than {self.meta_file} (token {found!r}, "
            f"the metadata's is {self.token!r}): the directory mixes files of two checkpoints (copied "
            "together, or replaced during this load). Load again, or restore a complete checkpoint")

    def load_pt(self, name: str) -> Any:
        """A .pt file's value: weights_only, on CPU, with its token checked."""
        f = self.open(name)
        f.seek(0)
        try:
            packed_value = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - whatever the unpickler refused
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            reason = next((line for line in lines if "Unsupported" in line or "error:" in line),
                          lines[0] if lines else "")
            raise ValueError(
                f"{self.who}: {self.path(name)} was refused by torch.load(weights_only=True): it holds something "
                "other than tensors and plain data, so loading it could run code. zero_ext.save never writes "
                f"such a file; restore the checkpoint from a good copy ({type(error).__name__}: {reason})") from None
        if not isinstance(packed_value, dict) or set(packed_value) != {"token", "value"}:
            raise ValueError(f"{self.who}: {self.path(name)} is not a file zero_ext.save wrote "
                             "(no token); restore the checkpoint from a good copy")
        if packed_value["token"] != self.token:
            self._mixed(name, str(packed_value["token"]))
        return packed_value["value"]

    def close(self) -> None:
        close_opened(self)


def close_opened(owner: Any) -> None:
    """Closes a reader's open files (owner.files) and its directory (owner.dir_fd)."""
    for f in owner.files.values():
        f.close()
    owner.files.clear()
    if owner.dir_fd is not None:
        os.close(owner.dir_fd)
        owner.dir_fd = None


class PieceReader:
    """Reads ranges of checkpointed tensors from a validated checkpoint's shard files."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.path = checkpoint.where
        self.pieces: Dict[Tuple[str, str, str], List[dict]] = defaultdict(list)
        for piece in checkpoint.meta["pieces"]:
            self.pieces[(piece["kind"], piece["name"], piece.get("key", ""))].append(piece)
        for found in self.pieces.values():
            found.sort(key=lambda p: p["start"])
        self.stored = {p["name"]: dtype_of(p["dtype"]) for p in checkpoint.meta["params"]}

    def keys(self, kind: str, name: str) -> List[str]:
        return sorted({k for (kd, n, k) in self.pieces if kd == kind and n == name})

    def scalars(self, name: str, start: int, length: int) -> dict:
        """Scalar optimizer state of the first piece overlapping the range."""
        for piece in self.pieces.get(("scalars", name, ""), []):
            if piece["start"] < start + length and start < piece["start"] + piece["length"]:
                return piece["values"]
        return {}

    def _overlapping(self, kind: str, name: str, key: str, start: int, length: int) -> Iterable[dict]:
        for piece in self.pieces.get((kind, name, key), []):
            if max(start, piece["start"]) < min(start + length, piece["start"] + piece["length"]):
                yield piece

    def files_for(self, kind: str, name: str, start: int, length: int, key: str = "") -> List[str]:
        return [p["file"] for p in self._overlapping(kind, name, key, start, length)]

    def read(self, kind: str, name: str, start: int, length: int, key: str = "",
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Elements [start, start + length) of a flattened tensor."""
        found = self.pieces.get((kind, name, key))
        if not found and length:
            raise RuntimeError(f"zero_ext: checkpoint {self.path} holds no {kind} {key} for '{name}'")
        stored = dtype_of(found[0]["dtype"]) if found else self.stored[name]
        out = torch.empty(length, dtype=dtype or stored, device="cpu")
        covered = 0
        for piece in self._overlapping(kind, name, key, start, length):
            lo = max(start, piece["start"])
            hi = min(start + length, piece["start"] + piece["length"])
            stored = dtype_of(piece["dtype"])
            # Straight into the result when the dtype matches: no second copy.
            chunk = out[lo - start:hi - start] if stored == out.dtype else torch.empty(hi - lo, dtype=stored, device="cpu")
            f = self.checkpoint.open(piece["file"])
            f.seek(piece["offset"] + (lo - piece["start"]) * chunk.element_size())
            want = chunk.numel() * chunk.element_size()
            got = f.readinto(_bytes_view(chunk))
            if got != want:
                raise RuntimeError(f"zero_ext: checkpoint file {os.path.join(self.path, piece['file'])} "
                                   f"ended early reading '{name}' (truncated?)")
            if chunk.data_ptr() != out[lo - start:hi - start].data_ptr():
                out[lo - start:hi - start].copy_(chunk)
            covered += hi - lo
        if covered != length:
            raise RuntimeError(
                f"zero_ext: checkpoint {self.path} covers {covered} of elements [{start}, {start + length}) "
                f"of {kind} {key} '{name}' (a shard file's pieces are missing from the metadata?)")
        return out

    def read_whole(self, name: str, key: str) -> torch.Tensor:
        piece = self.pieces[("whole", name, key)][0]
        out = self.read("whole", name, 0, piece["length"], key)
        return out.view(piece["shape"])
