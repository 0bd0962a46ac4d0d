"""Reading a DCP directory without trusting it: its files opened through
safe_read.py (the directory once, no links followed, nothing outside it),
`.metadata` through index.py's allowlist, every item's bytes inside its
file, loaded with torch.load(weights_only=True), a tensor chunk checked to
be the dtype and shape the metadata says. Where zero_ext
wrote the checkpoint, its checksum sidecar (save.py) is checked first and
each item's bytes against it: a flipped byte is refused, not loaded. A DCP
written by other tools carries no checksums; what can be checked then is
the structure, never the values."""
from __future__ import annotations

import io
import json
import os
from typing import Any, Dict, Optional

import torch

from ..bytes_io import bytes_view
from ..checksum import digest
from ..safe_read import close_opened, open_directory, open_regular, read_range, read_to_end
from ..sealing import is_sealed
from .boxes import Box, intersect, narrow, volume
from .index import METADATA, SIDECAR, BytesEntry, DcpIndex, Stored, TensorEntry

_RESTORE = "restore the checkpoint from a good copy"
_NEVER_LINKS = f"a checkpoint's files are never links; {_RESTORE}"


class DcpCheckpoint:
    def __init__(self, where: str, who: str):
        self.who, self.where = who, where
        self.files: Dict[str, Any] = {}
        self.dir_fd = open_directory(where)
        try:
            self.meta_file = os.path.join(where, METADATA)
            self.index = DcpIndex.parse(self._read(METADATA), f"{who}: {self.meta_file}")
            self.sums = self._sidecar()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        close_opened(self)

    def _read(self, name: str) -> bytes:
        """A small file of the directory, whole (FileNotFoundError where missing)."""
        shown = os.path.join(self.where, name)
        with open_regular(name, self.dir_fd, shown, self.who, _NEVER_LINKS) as f:
            return read_to_end(f, shown, self.who)

    def _sidecar(self) -> Optional[Dict[str, list]]:
        """zero_ext's checksums of this save's items, or None (another tool's DCP)."""
        path = os.path.join(self.where, SIDECAR)
        try:
            raw = self._read(SIDECAR)
        except FileNotFoundError:
            if self.index.save_id is not None and self.index.save_id.startswith("zero_ext-"):
                raise ValueError(f"{self.who}: {self.where} was written by zero_ext but its {SIDECAR} (the "
                                 f"checksums of its items) is missing; {_RESTORE}") from None
            return None
        try:
            document = json.loads(raw)
        except ValueError as error:
            raise ValueError(f"{self.who}: {path} is damaged ({error}); {_RESTORE}") from None
        items = document.get("items") if isinstance(document, dict) else None
        if not isinstance(items, dict) or not is_sealed(document):
            raise ValueError(f"{self.who}: {path} is damaged (its seal does not match its content); {_RESTORE}")
        if f"zero_ext-{document.get('token')}" != self.index.save_id:
            raise ValueError(f"{self.who}: {path} belongs to another save than {self.meta_file} (a directory "
                             f"mixing two saves); {_RESTORE}")
        return items

    def _file(self, name: str):
        """A data file the metadata names, opened once."""
        f = self.files.get(name)
        if f is None:
            shown = os.path.join(self.where, name)
            try:
                f = open_regular(name, self.dir_fd, f"{shown} (named by the metadata)", self.who, _NEVER_LINKS)
            except FileNotFoundError:
                raise ValueError(f"{self.who}: {shown} (named by the metadata) is missing; {_RESTORE}") from None
            self.files[name] = f
        return f

    def _expected(self, key: str, sum_key: str, at: Stored) -> Optional[int]:
        """The checksum zero_ext recorded for this item, or None (no sidecar)."""
        if self.sums is None:
            return None
        expected = self.sums.get(sum_key)
        if not isinstance(expected, list) or len(expected) != 4 or expected[:3] != [at.file, at.offset, at.length] \
                or type(expected[3]) is not int:
            raise ValueError(f"{self.who}: '{key}' has no checksum in {SIDECAR} matching the metadata; {_RESTORE}")
        return expected[3]

    def _mismatch(self, key: str, at: Stored) -> ValueError:
        return ValueError(f"{self.who}: '{key}' (bytes {at.offset}..{at.offset + at.length} of "
                          f"{os.path.join(self.where, at.file)}) does not match its checksum: the file is damaged; "
                          f"{_RESTORE}. Nothing was loaded")

    def _bytes(self, key: str, at: Stored) -> bytes:
        return read_range(self._file(at.file), at.offset, at.length, f"'{key}'", os.path.join(self.where, at.file),
                          self.who, _RESTORE)

    def value(self, key: str) -> Any:
        """A bytes item, read as torch.load(weights_only=True) reads it."""
        entry = self.index.entries[key]
        if isinstance(entry, TensorEntry):
            return self.whole(key)
        data = self._bytes(key, entry.stored)
        expected = self._expected(key, key, entry.stored)
        if expected is not None and digest(data) != expected:
            raise self._mismatch(key, entry.stored)
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - unreadable, or refused by weights_only
            raise ValueError(f"{self.who}: '{key}' in {self.where} does not load with weights_only=True "
                             f"({type(error).__name__}: {str(error)[:200]}); zero_ext never unpickles more") from None

    def chunk(self, key: str, box: Box, at: Stored, dtype: torch.dtype) -> torch.Tensor:
        expected = self._expected(key, f"{key}|{','.join(map(str, box[0]))}", at)
        data = self._bytes(key, at)
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001
            raise ValueError(f"{self.who}: a chunk of '{key}' in {self.where} does not load "
                             f"({type(error).__name__}: {str(error)[:200]}); {_RESTORE}") from None
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(box[1]) or tensor.dtype != dtype:
            got = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{self.who}: the chunk of '{key}' at {list(box[0])} holds {got}, not the {dtype} "
                             f"{list(box[1])} the metadata says; {_RESTORE}")
        if expected is not None:
            values = tensor.contiguous()
            if (digest(bytes_view(values)) if values.numel() else digest(b"")) != expected:
                raise self._mismatch(key, at)
        return tensor

    def whole(self, key: str) -> torch.Tensor:
        """A tensor entry in full (buffers, scalars, extra's tensors)."""
        entry = self.index.entries[key]
        assert isinstance(entry, TensorEntry)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        full = ((0,) * len(entry.shape), tuple(entry.shape))
        covered = 0
        for c in entry.chunks:
            part = intersect(full, c.box) if entry.shape else full
            if part is None:
                continue
            narrow(out, full, part).copy_(self.chunk(key, c.box, c.stored, entry.dtype))
            covered += volume(part[1])
        if covered != volume(entry.shape):
            raise ValueError(f"{self.who}: {self.where} holds {covered} of the {volume(entry.shape)} elements of "
                             f"'{key}'; {_RESTORE}")
        return out


__all__ = ["DcpCheckpoint", "BytesEntry", "TensorEntry"]
