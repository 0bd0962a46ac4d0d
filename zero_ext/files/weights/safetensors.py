"""Safetensors files, read by byte range and written tensor by tensor, with
raw file I/O only (no pickle, no dependency on the safetensors package).

The format (huggingface/safetensors): 8 bytes, a little-endian u64 N; N
bytes of UTF-8 JSON, {name: {"dtype", "shape", "data_offsets": [begin,
end]}, optionally "__metadata__": {str: str}}; then the data, offsets
relative to its start. A Hugging Face checkpoint directory may split the
tensors over several files listed in model.safetensors.index.json
({"metadata": {...}, "weight_map": {name: file}}).

Reading trusts nothing: the whole header is validated (types, dtypes,
bounds inside the file, sizes matching shapes, no two tensors sharing
bytes) before any tensor byte is read; files are opened without following
links, relative to their directory's descriptor (safe_read.py); an index may
name only plain file names in its own directory. A read fetches exactly the bytes of
the elements asked for (`bytes_read` counts them), so a rank can read its
shard of a tensor and nothing else.
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..bytes_io import bytes_view as _bytes_view, fsync_dir
from ..safe_read import close_opened, open_directory, open_regular, read_to_end

DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES: Dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors package's own limit
INDEX = "model.safetensors.index.json"
# Where a weight file cannot be opened (a link): what to do instead.
NEVER_LINKS = "weight files are never read through links. Copy the file the link points to in its place"
_PLAIN_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}\Z")


def _little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("zero_ext: safetensors data is little-endian; this host is big-endian")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class SafetensorsFile:
    """One .safetensors file, its header validated on open."""

    def __init__(self, path: str, who: str = "zero_ext", dir_fd: Optional[int] = None, shown: Optional[str] = None):
        _little_endian()
        self.who = who
        self.path = shown or path
        self.bytes_read = 0
        self.file = open_regular(path, dir_fd, self.path, who, NEVER_LINKS)
        try:
            self.size = os.fstat(self.file.fileno()).st_size
            self._read_header()
        except BaseException:
            self.file.close()
            raise

    def _fail(self, problem: str) -> None:
        raise ValueError(f"{self.who}: {self.path} is not a valid safetensors file: {problem}")

    def _read_header(self) -> None:
        head = self.file.read(8)
        if len(head) != 8:
            self._fail(f"{self.size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > self.size:
            self._fail(f"header length {n} exceeds the file ({self.size} bytes) or {MAX_HEADER} bytes")
        raw = self.file.read(n)
        self.bytes_read += 8 + n
        try:
            header = json.loads(raw.decode("utf-8"))
        except RecursionError:
            self._fail("its header is nested too deeply")
        except ValueError as error:  # bad JSON or bad UTF-8
            self._fail(f"its header is not JSON ({error})")
        if not isinstance(header, dict):
            self._fail("its header is not a JSON object")
        self.data_start = 8 + n
        data_size = self.size - self.data_start
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in metadata.items()):
            self._fail("__metadata__ is not an object of strings")
        self.metadata: Dict[str, str] = metadata
        self.entries: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]] = {}
        spans = []
        for name, entry in header.items():
            if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
                self._fail(f"entry {name!r} is not {{dtype, shape, data_offsets}}")
            dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
            if dtype is None:
                self._fail(f"entry {name!r} has dtype {entry['dtype']!r} (known: {sorted(DTYPES)})")
            shape, offsets = entry["shape"], entry["data_offsets"]
            if (not isinstance(shape, list) or len(shape) > 64
                    or not all(type(d) is int and d >= 0 for d in shape)):
                self._fail(f"entry {name!r} has shape {shape!r}")
            if (not isinstance(offsets, list) or len(offsets) != 2
                    or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1] <= data_size):
                self._fail(f"entry {name!r} has data_offsets {offsets!r} outside the {data_size} data bytes")
            nbytes = _numel(shape) * dtype.itemsize
            if offsets[1] - offsets[0] != nbytes:
                self._fail(f"entry {name!r} spans {offsets[1] - offsets[0]} bytes; shape {shape} of "
                           f"{entry['dtype']} needs {nbytes}")
            self.entries[name] = (dtype, tuple(shape), offsets[0], offsets[1])
            if nbytes:
                spans.append((offsets[0], offsets[1], name))
        spans.sort()
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                self._fail(f"entries {first!r} and {second!r} share bytes")

    def keys(self) -> List[str]:
        return list(self.entries)

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][0]

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.entries[name][1]

    def read(self, name: str, start: int = 0, length: Optional[int] = None) -> torch.Tensor:
        """Elements [start, start + length) of the flattened tensor, in its
        stored dtype: exactly those bytes are read."""
        dtype, shape, begin, _ = self.entries[name]
        numel = _numel(shape)
        length = numel - start if length is None else length
        if not (0 <= start and 0 <= length and start + length <= numel):
            raise IndexError(f"{self.who}: elements [{start}, {start + length}) of '{name}' in {self.path} "
                             f"(it has {numel})")
        out = torch.empty(length, dtype=dtype, device="cpu")  # file I/O lands in host memory, whatever the default device
        if length:
            want = length * out.element_size()
            got = os.preadv(self.file.fileno(), [_bytes_view(out)], self.data_start + begin + start * out.element_size())
            if got != want:
                raise RuntimeError(f"{self.who}: {self.path} ended early reading '{name}' (changed while reading?)")
            self.bytes_read += want
        return out

    def tensor(self, name: str) -> torch.Tensor:
        return self.read(name).view(self.shape(name))

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SafetensorsWriter:
    """Writes one file whose tensors are declared up front and then written
    one at a time, in that order (memory: one tensor). The file appears
    under its name only when complete (written aside, then renamed)."""

    def __init__(self, path: str, entries: Sequence[Tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Optional[Dict[str, str]] = None):
        _little_endian()
        header: Dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self.expected: List[Tuple[str, torch.dtype, Tuple[int, ...]]] = []
        for name, dtype, shape in entries:
            if dtype not in NAMES:
                raise TypeError(f"zero_ext: safetensors cannot hold {dtype} ('{name}'; supported: "
                                f"{sorted(str(d) for d in NAMES)})")
            if name in header or name == "__metadata__":
                raise ValueError(f"zero_ext: tensor name {name!r} twice (or reserved) in one safetensors file")
            nbytes = _numel(shape) * dtype.itemsize
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            self.expected.append((name, dtype, tuple(shape)))
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-aligned, as the package writes it
        self.path = path
        self.tmp = f"{path}.tmp-{os.getpid()}"
        self.file = open(self.tmp, "wb")
        self.file.write(len(raw).to_bytes(8, "little") + raw)
        self.next = 0
        self.size = 8 + len(raw) + offset

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, dtype, shape = self.expected[self.next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"zero_ext internal: safetensors writer expected {want_name} {dtype} {list(shape)}, "
                             f"got {name} {tensor.dtype} {list(tensor.shape)}")
        t = tensor.detach().to("cpu").contiguous()
        if t.numel():
            self.file.write(_bytes_view(t))
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.expected):
            self.abort()
            raise RuntimeError(f"zero_ext internal: safetensors writer closed after {self.next} of "
                               f"{len(self.expected)} tensors")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        self.file.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


def save_file(path: str, tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> None:
    writer = SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], metadata)
    try:
        for name, t in tensors.items():
            writer.write(name, t)
    except BaseException:
        writer.abort()
        raise
    writer.close()


def split_into_files(entries: Sequence[Tuple[str, torch.dtype, Sequence[int]]], max_bytes: int,
                     stem: str = "model") -> List[Tuple[str, List[int]]]:
    """Hugging Face's sharded layout: consecutive tensors grouped into files
    of at most max_bytes (a larger tensor gets a file of its own), named
    {stem}-00001-of-0000K.safetensors; one file is plain {stem}.safetensors."""
    groups: List[List[int]] = []
    size = 0
    for i, (_, dtype, shape) in enumerate(entries):
        nbytes = _numel(shape) * dtype.itemsize
        if not groups or (size + nbytes > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    if len(groups) <= 1:
        return [(f"{stem}.safetensors", groups[0] if groups else [])]
    k = len(groups)
    return [(f"{stem}-{g + 1:05d}-of-{k:05d}.safetensors", group) for g, group in enumerate(groups)]


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str], who: str = "zero_ext") -> int:
    """Bytes from an int or a string like "5GB" / "500MiB" (Hugging Face's convention: GB = 10^9)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|[KMGT]I?B)?\s*", size.upper()) if isinstance(size, str) else None
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{who}: max_shard_size must be a positive number of bytes or a "
                         f"string like '5GB' or '500MiB', got {size!r}")
    return max(1, int(float(match.group(1)) * _UNITS[match.group(2) or "B"]))


_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors\Z")


class ModelWriter:
    """A model's tensors, given one at a time in a declared order, written as
    one file (a path ending in .safetensors) or as a directory in Hugging
    Face's layout: model.safetensors, or past max_bytes the numbered files
    plus their index (written last). finish() removes weight files an
    earlier save left that this one does not list. Memory: one tensor."""

    def __init__(self, path: str, entries: Sequence[Tuple[str, torch.dtype, Sequence[int]]], max_bytes: int):
        self.entries = list(entries)
        self.single = path.endswith(".safetensors")
        if self.single:
            self.directory = os.path.dirname(os.path.abspath(path))
            self.plan = [(os.path.basename(path), list(range(len(self.entries))))]
        else:
            self.directory = path
            self.plan = split_into_files(self.entries, max_bytes)
        self.file_of = {i: k for k, (_, group) in enumerate(self.plan) for i in group}
        self.writers: Dict[int, SafetensorsWriter] = {}
        os.makedirs(self.directory, exist_ok=True)

    def put(self, i: int, tensor: torch.Tensor) -> None:
        name, dtype, _ = self.entries[i]
        k = self.file_of[i]
        if k not in self.writers:
            file, group = self.plan[k]
            self.writers[k] = SafetensorsWriter(os.path.join(self.directory, file),
                                                [self.entries[j] for j in group], {"format": "pt"})
        self.writers[k].write(name, tensor.to(dtype))
        if i == self.plan[k][1][-1]:
            self.writers.pop(k).close()

    def finish(self) -> None:
        if self.writers:
            raise RuntimeError("zero_ext internal: a weight file was left unfinished")
        if self.single:
            return
        if len(self.plan) > 1:
            total = sum(_numel(shape) * dtype.itemsize for _, dtype, shape in self.entries)
            write_index(self.directory, {self.entries[i][0]: f for f, group in self.plan for i in group}, total)
        elif os.path.lexists(os.path.join(self.directory, INDEX)):
            os.unlink(os.path.join(self.directory, INDEX))
        written = {f for f, _ in self.plan}
        for old in os.listdir(self.directory):
            if _WEIGHT_FILE.match(old) and old not in written:
                os.unlink(os.path.join(self.directory, old))

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()
        self.writers.clear()


def write_index(directory: str, weight_map: Dict[str, str], total_size: int) -> None:
    path = os.path.join(directory, INDEX)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class SafetensorsDirectory:
    """A directory of safetensors files: one model.safetensors, or Hugging
    Face's index and the shards it names (plain names in this directory only)."""

    def __init__(self, path: str, who: str = "zero_ext"):
        self.who = who
        self.path = path
        self.dir_fd = open_directory(path)
        self.files: Dict[str, SafetensorsFile] = {}
        try:
            self.weight_map = self._weight_map()
            for file in dict.fromkeys(self.weight_map.values()):
                self.files[file] = SafetensorsFile(file, who, dir_fd=self.dir_fd, shown=os.path.join(path, file))
            for name, file in self.weight_map.items():
                if name not in self.files[file].entries:
                    raise ValueError(f"{who}: {os.path.join(path, INDEX)} places '{name}' in {file}, "
                                     "which does not hold it")
        except BaseException:
            self.close()
            raise

    def _weight_map(self) -> Dict[str, str]:
        shown = os.path.join(self.path, INDEX)
        try:
            f = open_regular(INDEX, self.dir_fd, shown, self.who, NEVER_LINKS)
        except FileNotFoundError:
            only = "model.safetensors"
            with SafetensorsFile(only, self.who, dir_fd=self.dir_fd, shown=os.path.join(self.path, only)) as single:
                return {name: only for name in single.keys()}
        with f:
            raw = read_to_end(f, shown, self.who, limit=MAX_HEADER)
        try:
            index = json.loads(raw.decode("utf-8"))
        except (RecursionError, ValueError) as error:
            raise ValueError(f"{self.who}: {shown} is not valid JSON ({type(error).__name__})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{self.who}: {shown} has no weight_map object")
        for name, file in weight_map.items():
            if not isinstance(file, str) or not _PLAIN_FILE.match(file) or not file.endswith(".safetensors"):
                raise ValueError(f"{self.who}: {shown} maps '{name}' to {file!r}; an index may name only "
                                 ".safetensors files in its own directory (no paths)")
        return weight_map

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def file_of(self, name: str) -> SafetensorsFile:
        return self.files[self.weight_map[name]]

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files.values())

    def close(self) -> None:
        close_opened(self)

    def __enter__(self) -> "SafetensorsDirectory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

