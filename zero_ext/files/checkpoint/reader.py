"""Reading a checkpoint without trusting it.

Checkpoint opens the directory once (later opens are relative to that
descriptor, never following links), parses and validates the whole metadata
(metadata.py) before any other byte is read, checks every file's size, each
shard file's header (this save, the rank its name says) and each .pt file's
checksum and writer before torch.load(weights_only=True) sees it.

PieceReader reads element ranges of checkpointed tensors. Every byte it
returns was checked against its piece's chunk checksums first: a range that
starts or ends inside a chunk reads the whole chunk. A mismatch names the
file, the piece and the parameter.
"""
from __future__ import annotations

import io
import os
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..bytes_io import bytes_view
from ..checksum import digest
from ..safe_read import close_opened, open_directory, open_regular, read_to_end, stat_regular
from .format import dtype_of, parse_shard_header
from .metadata import METADATA, CheckpointMeta, rank_of_file
from .pieces import HEADER, Piece, PieceKind, StoredPiece

_RESTORE = "restore the checkpoint from a good copy"
_NEVER_LINKS = "a checkpoint's files are never links"
_LINKED = ("zero_ext.save writes regular files only and a link could make loading read any file. Copy the file it "
           "points to in its place")


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
            self.meta: CheckpointMeta = CheckpointMeta.parse(self._read_metadata(), who, self.meta_file)
            self._check_sizes()
        except BaseException:
            self.close()
            raise
        self.token = self.meta.token

    def _open_dir(self, path: str) -> Tuple[str, int]:
        from .publish import resolve  # publish reads metadata through this module

        for _ in range(3):  # a save renaming the path between resolve and open: look again
            where = resolve(path, self.who)
            try:
                return where, open_directory(where)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"{self.who}: no checkpoint at {path} (it kept being replaced while opening)")

    def path(self, name: str) -> str:
        return os.path.join(self.where, name)

    def _read_metadata(self) -> bytes:
        try:
            f = open_regular(METADATA, self.dir_fd, self.meta_file, self.who, _NEVER_LINKS)
        except FileNotFoundError:
            raise RuntimeError(
                f"{self.who}: {self.meta_file} is missing: {self.where} is not a complete zero_ext checkpoint "
                "(metadata is written last, so a save that died leaves none)") from None
        with f:
            return read_to_end(f, self.meta_file, self.who)

    def _check_sizes(self) -> None:
        """Every listed file is a regular file here (not a link) of the listed size."""
        for name, entry in self.meta.files.items():
            full = self.path(name)
            try:
                info = stat_regular(name, self.dir_fd, f"checkpoint file {full}", self.who, _LINKED)
            except FileNotFoundError:
                raise RuntimeError(f"{self.who}: checkpoint file {full} is missing") from None
            if info.st_size != entry.size:
                raise RuntimeError(
                    f"{self.who}: checkpoint file {full} has {info.st_size} bytes, the metadata says {entry.size} "
                    "(truncated or overwritten)")

    def open(self, name: str):
        """A validated file of this checkpoint; shard files' headers checked."""
        if name not in self.files:
            changed = RuntimeError(f"{self.who}: {self.path(name)} changed while loading (a save replaced it?); "
                                   "load again")
            try:
                f = open_regular(name, self.dir_fd, self.path(name), self.who, _NEVER_LINKS)
            except FileNotFoundError:
                raise RuntimeError(
                    f"{self.who}: {self.path(name)} vanished while loading: the checkpoint was replaced or "
                    "removed by a save during this load; load again") from None
            except ValueError:  # refused, though a regular file when its size was checked: replaced since
                raise changed from None
            if os.fstat(f.fileno()).st_size != self.meta.files[name].size:
                f.close()
                raise changed
            if name.endswith(".bin"):
                token, rank, world = parse_shard_header(f.read(HEADER))
                try:
                    self._check_writer(name, token or "none", rank, world)
                except BaseException:
                    f.close()
                    raise
            self.files[name] = f
        return self.files[name]

    def _check_writer(self, name: str, token: str, rank: int, world: Optional[int]) -> None:
        if token != self.token:
            raise RuntimeError(
                f"{self.who}: {self.path(name)} belongs to another save than {self.meta_file} (token {token!r}, "
                f"the metadata's is {self.token!r}): the directory mixes files of two checkpoints (copied "
                "together, or replaced during this load). Load again, or restore a complete checkpoint")
        expected = rank_of_file(name)
        if rank != expected or (world is not None and world != self.meta.world_size):
            raise RuntimeError(
                f"{self.who}: {self.path(name)} was written by rank {rank} of {world if world is not None else '?'} "
                f"in this save, but {name} is rank {expected}'s of {self.meta.world_size}: files of this checkpoint "
                f"were swapped or renamed; {_RESTORE}")

    def load_pt(self, name: str) -> Any:
        """A .pt file's value: its checksum and writer checked, then read
        with weights_only=True, on CPU."""
        f = self.open(name)
        f.seek(0)
        size = self.meta.files[name].size
        try:
            raw = read_to_end(f, self.path(name), self.who, limit=size)
        except ValueError:  # grew past its size
            raw = None
        if raw is None or len(raw) != size:
            raise RuntimeError(f"{self.who}: {self.path(name)} is no longer the {size} bytes the metadata says "
                               "(truncated or overwritten while loading?)")
        crc = digest(raw)
        if crc != self.meta.files[name].checksum:
            for other, entry in self.meta.files.items():
                if other != name and entry.checksum == crc and entry.size == len(raw):
                    raise RuntimeError(
                        f"{self.who}: {self.path(name)} holds the bytes of {other}, written by rank "
                        f"{rank_of_file(other)} of this save: files of this checkpoint were swapped or renamed; "
                        f"{_RESTORE}")
            raise RuntimeError(
                f"{self.who}: checksum mismatch in {self.path(name)} (the whole file): its bytes changed after "
                f"zero_ext.save wrote them (disk or transfer damage, an edit); nothing was loaded from it; {_RESTORE}")
        try:
            packed_value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - whatever the unpickler refused
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            reason = next((line for line in lines if "Unsupported" in line or "error:" in line),
                          lines[0] if lines else "")
            raise ValueError(
                f"{self.who}: {self.path(name)} was refused by torch.load(weights_only=True): it holds something "
                "other than tensors and plain data, so loading it could run code. zero_ext.save never writes "
                f"such a file; {_RESTORE} ({type(error).__name__}: {reason})") from None
        if not isinstance(packed_value, dict) or set(packed_value) != {"token", "rank", "value"}:
            raise ValueError(f"{self.who}: {self.path(name)} is not a file zero_ext.save wrote "
                             f"(no token and writer); {_RESTORE}")
        self._check_writer(name, str(packed_value["token"]), packed_value["rank"], None)
        return packed_value["value"]

    def load_buffers(self) -> Dict[str, torch.Tensor]:
        """buffers.pt: a name -> tensor mapping, or an error naming the file."""
        buffers = self.load_pt("buffers.pt")
        if not isinstance(buffers, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                    for k, v in buffers.items()):
            raise ValueError(f"{self.who}: {self.path('buffers.pt')} is not a name -> tensor mapping; {_RESTORE}")
        return buffers

    def close(self) -> None:
        close_opened(self)


def _read_exactly(f, into: torch.Tensor) -> bool:
    """Fills `into` from the file's position; False if the file ends first.
    A loop: one read returns at most about 2 GiB on Linux."""
    view = memoryview(bytes_view(into)).cast("B")
    at = 0
    while at < len(view):
        got = f.readinto(view[at:])
        if not got:
            return False
        at += got
    return True


class PieceReader:
    """Reads ranges of checkpointed tensors from a validated checkpoint's
    shard files, each byte checked against its piece's checksums."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.path = checkpoint.where
        self.chunk = checkpoint.meta.chunk_bytes
        # (kind, parameter, state key or ""): its pieces, by start
        self.pieces: Dict[Tuple[PieceKind, str, str], List[Piece]] = defaultdict(list)
        for piece in checkpoint.meta.pieces:
            self.pieces[piece.tensor_id].append(piece)
        for found in self.pieces.values():
            found.sort(key=lambda p: p.start)

    def keys(self, kind: PieceKind, name: str) -> List[str]:
        return sorted({k for (kd, n, k) in self.pieces if kd == kind and n == name})

    def scalars(self, name: str, start: int, length: int) -> dict:
        """Scalar optimizer state of the first piece overlapping the range."""
        for piece in self.pieces.get((PieceKind.SCALARS, name, ""), []):
            if piece.start < start + length and start < piece.start + piece.length:
                return piece.values
        return {}

    def _overlapping(self, kind: PieceKind, name: str, key: str, start: int, length: int) -> Iterable[StoredPiece]:
        for piece in self.pieces.get((kind, name, key), []):
            if max(start, piece.start) < min(start + length, piece.start + piece.length):
                yield piece

    def files_for(self, kind: PieceKind, name: str, start: int, length: int, key: str = "") -> List[str]:
        return [p.file for p in self._overlapping(kind, name, key, start, length)]

    def read(self, kind: PieceKind, name: str, start: int, length: int, key: str = "",
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Elements [start, start + length) of a flattened tensor, verified."""
        found = self.pieces.get((kind, name, key))
        if not found and length:
            raise RuntimeError(f"zero_ext: checkpoint {self.path} holds no {kind.value} {key} for '{name}'")
        stored = dtype_of(found[0].dtype) if found else dtype_of(self.checkpoint.meta.param(name).dtype)
        out = torch.empty(length, dtype=dtype or stored, device="cpu")
        covered = 0
        for piece in self._overlapping(kind, name, key, start, length):
            lo = max(start, piece.start)
            hi = min(start + length, piece.start + piece.length)
            self._read_verified(piece, lo - piece.start, hi - piece.start, out[lo - start:hi - start])
            covered += hi - lo
        if covered != length:
            raise RuntimeError(
                f"zero_ext: checkpoint {self.path} covers {covered} of elements [{start}, {start + length}) "
                f"of {kind.value} {key} '{name}' (a shard file's pieces are missing from the metadata?)")
        return out

    def _read_verified(self, piece: StoredPiece, lo: int, hi: int, into: torch.Tensor) -> None:
        """Elements [lo, hi) of the piece into `into`, after checking the
        chunks that hold them: whole chunks are read, then the range copied
        out (straight into `into` when it is exactly those chunks)."""
        size = piece.itemsize
        first, last = lo * size // self.chunk, -(-hi * size // self.chunk)
        begin, end = first * self.chunk, min(last * self.chunk, piece.nbytes)
        stored = dtype_of(piece.dtype)
        direct = stored == into.dtype and begin == lo * size and end == hi * size
        raw = into.view(torch.uint8) if direct else torch.empty(end - begin, dtype=torch.uint8, device="cpu")
        f = self.checkpoint.open(piece.file)
        f.seek(piece.offset + begin)
        if not _read_exactly(f, raw):
            raise RuntimeError(f"zero_ext: checkpoint file {os.path.join(self.path, piece.file)} "
                               f"ended early reading '{piece.name}' (truncated?)")
        view = memoryview(bytes_view(raw)).cast("B") if raw.numel() else memoryview(b"")
        for k, at in enumerate(range(0, len(view), self.chunk)):
            if digest(view[at:at + self.chunk]) != piece.checksums[first + k]:
                chunk_at = piece.offset + begin + at
                raise RuntimeError(
                    f"{self.checkpoint.who}: checksum mismatch in {os.path.join(self.path, piece.file)}: "
                    f"{piece.describe()}, bytes [{chunk_at}, {chunk_at + min(self.chunk, len(view) - at)}) of the "
                    "file changed after zero_ext.save wrote them (disk or transfer damage, an edit). Nothing "
                    f"read from this checkpoint was used; {_RESTORE}")
        if not direct:
            values = raw[lo * size - begin:hi * size - begin].view(stored)
            into.copy_(values)

    def verify_piece(self, piece: StoredPiece, buffer: torch.Tensor, lo: int = 0, hi: Optional[int] = None) -> None:
        """Checks the chunks holding elements [lo, hi) of one piece (all of
        it by default), a chunk at a time through `buffer` (uint8, at least
        one chunk): memory stays one chunk, nothing is kept."""
        hi = piece.length if hi is None else hi
        per_chunk = self.chunk // piece.itemsize
        for at in range(lo // per_chunk * per_chunk, hi, per_chunk):
            end = min(piece.length, at + per_chunk)
            into = buffer[:(end - at) * piece.itemsize].view(dtype_of(piece.dtype))
            self._read_verified(piece, at, end, into)

    def verify(self, kind: PieceKind, name: str, start: int, length: int, key: str = "",
               buffer: Optional[torch.Tensor] = None) -> None:
        """Checks every chunk that read() of the same range would use,
        keeping none of it (for data every rank holds whole, which would
        cost a whole model to stage)."""
        buffer = torch.empty(self.chunk, dtype=torch.uint8, device="cpu") if buffer is None else buffer
        for piece in self._overlapping(kind, name, key, start, length):
            lo = max(start, piece.start) - piece.start
            hi = min(start + length, piece.start + piece.length) - piece.start
            self.verify_piece(piece, buffer, lo, hi)

    def read_whole(self, name: str, key: str) -> torch.Tensor:
        piece = self.pieces[(PieceKind.WHOLE, name, key)][0]
        out = self.read(PieceKind.WHOLE, name, 0, piece.length, key)
        return out.view(piece.shape)
