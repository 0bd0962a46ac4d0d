"""DCP's `.metadata`, read without trusting it and written as torch writes it.

torch.distributed.checkpoint pickles its Metadata object, and torch's own
reader unpickles it in full: a crafted `.metadata` runs code in the reader.
zero_ext unpickles with an allowlist (DCP's metadata dataclasses, torch.Size,
dtypes, layouts, paths) and then checks every value as it copies it into
plain typed entries: names and shapes, every chunk inside its tensor, no
two chunks overlapping, each stored item a plain file name of the directory
with its offset and length inside that file. Code past `DcpIndex.parse`
reads these entries, never the unpickled objects.

Data files hold each item as torch.save bytes (a tensor chunk, or any
value: "bytes items"); the reader loads them with weights_only=True.
"""
from __future__ import annotations

import io
import pickle
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ...tools import torch_compat
from .boxes import Box, intersect, volume

METADATA = ".metadata"
SIDECAR = "zero_ext-dcp.json"  # zero_ext's checksums of a DCP save it wrote (save.py); other readers ignore it
DATA_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}\Z")  # a file of the directory, no path
_MAX_KEYS = 1 << 24
_MAX = 1 << 62


@dataclass(frozen=True)
class Stored:
    """Where one item's bytes are: (file, offset, length)."""
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    box: Box
    stored: Stored


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: Tuple[int, ...]
    chunks: Tuple[Chunk, ...]


@dataclass(frozen=True)
class BytesEntry:
    stored: Stored


Entry = Union[TensorEntry, BytesEntry]


def _allowed() -> Dict[Tuple[str, str], Any]:
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint import filesystem as fs

    allowed: Dict[Tuple[str, str], Any] = {("torch", "Size"): torch.Size}
    for name, cls in torch_compat.dcp_metadata_classes().items():
        allowed[(md.__name__, name)] = cls
    allowed[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    from torch.serialization import _get_layout
    allowed[("torch.serialization", "_get_layout")] = _get_layout
    import collections
    import pathlib
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
        allowed[("pathlib._local", name)] = getattr(pathlib, name)
    return allowed


def _buildable() -> Tuple[type, ...]:
    from torch.distributed.checkpoint import filesystem as fs

    return tuple(torch_compat.dcp_metadata_classes(stateful_only=True).values()) + (fs._StorageInfo,)


class _Unpickler(pickle._Unpickler):  # the Python implementation: its opcodes can be guarded one by one
    """Only DCP's metadata classes and torch's value types (anything else, a
    callable that would run code, is refused), and state set only on
    instances of DCP's dataclasses: BUILD on a class or a function would
    change it for the whole process (a refused file must leave no trace)."""
    allowed: Dict[Tuple[str, str], Any] = {}
    buildable: Tuple[type, ...] = ()
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refused to load {module}.{name}: not a part of DCP's metadata")
        return found

    def load_build(self) -> None:
        target = self.stack[-2]  # the object under its state
        if isinstance(target, type) or type(target) not in self.buildable:
            raise pickle.UnpicklingError(f"refused to set the state of {target!r}: only DCP's metadata objects "
                                         "take state")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build


def _fail(where: str, what: str) -> ValueError:
    return ValueError(f"{where} is not a valid torch.distributed.checkpoint metadata file: {what}. Restore "
                      "the checkpoint from a good copy")


def _int(value: Any, where: str, what: str, lo: int = 0) -> int:
    if type(value) is not int or not lo <= value < _MAX:
        raise _fail(where, f"{what} is {value!r}, not an integer >= {lo}")
    return value


def _ints(value: Any, where: str, what: str) -> Tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > 64:
        raise _fail(where, f"{what} is {type(value).__name__}, not a sequence of integers")
    return tuple(_int(v, where, what) for v in value)


def _stored(info: Any, where: str, key: str) -> Stored:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    if not isinstance(info, _StorageInfo):
        raise _fail(where, f"the storage of '{key}' is a {type(info).__name__}")
    path = getattr(info, "relative_path", None)
    if not isinstance(path, str) or not DATA_FILE.match(path) or path == METADATA:
        raise _fail(where, f"'{key}' is stored in {path!r}, which is not a plain file name of the checkpoint "
                           "directory (a checkpoint never reads outside its directory)")
    if getattr(info, "transform_descriptors", None):
        raise ValueError(f"{where}: '{key}' is stored through transforms {info.transform_descriptors!r} "
                         "(compression or encryption extensions), which zero_ext does not read; save without them")
    return Stored(path, _int(getattr(info, "offset", None), where, f"the offset of '{key}'"),
                  _int(getattr(info, "length", None), where, f"the length of '{key}'"))


@dataclass(frozen=True)
class DcpIndex:
    entries: Dict[str, Entry]
    paths: Optional[Dict[str, Tuple[Union[str, int], ...]]]  # planner_data: flat key -> path in the nested dict
    save_id: Optional[str]  # StorageMeta.save_id: zero_ext's saves put their token there

    @staticmethod
    def parse(data: bytes, where: str) -> "DcpIndex":
        from torch.distributed.checkpoint import metadata as md

        if not _Unpickler.allowed:
            _Unpickler.allowed, _Unpickler.buildable = _allowed(), _buildable()
        try:
            meta = _Unpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as error:
            raise _fail(where, str(error)) from None
        except Exception as error:  # noqa: BLE001 - truncated or garbled: a damaged file
            raise _fail(where, f"it does not unpickle ({type(error).__name__}: {error})") from None
        if not isinstance(meta, md.Metadata):
            raise _fail(where, f"it holds a {type(meta).__name__}, not DCP's Metadata")
        described = getattr(meta, "state_dict_metadata", None)
        storage = getattr(meta, "storage_data", None)
        if not isinstance(described, dict) or not isinstance(storage, dict) or len(described) > _MAX_KEYS:
            raise _fail(where, "it has no state_dict_metadata and storage_data dictionaries")
        stored: Dict[Tuple[str, Optional[Tuple[int, ...]]], Stored] = {}
        for index, info in storage.items():
            if not isinstance(index, md.MetadataIndex) or not isinstance(getattr(index, "fqn", None), str):
                raise _fail(where, f"a storage entry is keyed by a {type(index).__name__}")
            offset = getattr(index, "offset", None)
            offset = None if offset is None else _ints(offset, where, f"the offsets of '{index.fqn}'")
            stored[(index.fqn, offset)] = _stored(info, where, index.fqn)
        entries: Dict[str, Entry] = {}
        for key, entry in described.items():
            if not isinstance(key, str):
                raise _fail(where, f"a key is a {type(key).__name__}")
            if isinstance(entry, md.BytesStorageMetadata):
                if (key, None) not in stored:
                    raise _fail(where, f"'{key}' has no storage entry")
                entries[key] = BytesEntry(stored[(key, None)])
            elif isinstance(entry, md.TensorStorageMetadata):
                entries[key] = _tensor_entry(key, entry, stored, where)
            else:
                raise _fail(where, f"'{key}' is described by a {type(entry).__name__}")
        save_id = getattr(getattr(meta, "storage_meta", None), "save_id", None)
        return DcpIndex(entries, _paths(getattr(meta, "planner_data", None), entries),
                        save_id if isinstance(save_id, str) else None)


def _tensor_entry(key: str, entry: Any, stored, where: str) -> TensorEntry:
    props = getattr(entry, "properties", None)
    dtype = getattr(props, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise _fail(where, f"'{key}' has no dtype")
    shape = _ints(getattr(entry, "size", None), where, f"the size of '{key}'")
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list) or len(chunks) > _MAX_KEYS:
        raise _fail(where, f"'{key}' has no list of chunks")
    out: List[Chunk] = []
    for chunk in chunks:
        offsets = _ints(getattr(chunk, "offsets", None), where, f"a chunk offset of '{key}'")
        sizes = _ints(getattr(chunk, "sizes", None), where, f"a chunk size of '{key}'")
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise _fail(where, f"a chunk of '{key}' at {list(offsets)} of size {list(sizes)} lies outside its "
                               f"shape {list(shape)}")
        if (key, offsets) not in stored:
            raise _fail(where, f"the chunk of '{key}' at {list(offsets)} has no storage entry")
        out.append(Chunk((offsets, sizes), stored[(key, offsets)]))
    _check_disjoint(key, out, where)
    return TensorEntry(dtype, shape, tuple(out))


_MAX_CHUNKS = 1 << 18  # of one tensor: 3 boxes per range of 80k ranks; a bound on the overlap check's work


def _check_disjoint(key: str, chunks: List[Chunk], where: str) -> None:
    """No element is in two chunks (which one would a reader believe?). A
    sweep along the dimension where the chunks' offsets differ most: a chunk
    is compared only with those still open along it, so tensors split along
    any one dimension (every writer's layout) cost n log n."""
    boxes = [c for c in chunks if volume(c.box[1])]
    if len(boxes) < 2:
        return
    if len(boxes) > _MAX_CHUNKS:
        raise _fail(where, f"'{key}' has {len(boxes)} chunks, more than {_MAX_CHUNKS}")
    dims = len(boxes[0].box[0])
    dim = max(range(dims), key=lambda d: len({c.box[0][d] for c in boxes}))
    order = sorted(boxes, key=lambda c: c.box[0][dim])
    open_: List[Chunk] = []
    for b in order:
        start = b.box[0][dim]
        open_ = [a for a in open_ if a.box[0][dim] + a.box[1][dim] > start]
        for a in open_:
            if intersect(a.box, b.box) is not None:
                raise _fail(where, f"two chunks of '{key}' overlap (at {list(a.box[0])} and {list(b.box[0])})")
        open_.append(b)


def _paths(data: Any, entries: Dict[str, Entry]) -> Optional[Dict[str, Tuple[Union[str, int], ...]]]:
    """planner_data as {flat key: path} when it is that (what torch's
    DefaultSavePlanner stores), else None: it only shapes `extra`."""
    if not isinstance(data, dict):
        return None
    out = {}
    for key, path in data.items():
        if key not in entries or not isinstance(path, tuple) or not path or not all(
                type(p) in (str, int) for p in path):
            return None
        out[key] = path
    return out


def metadata_bytes(tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...], List[Tuple[Box, Stored]]]],
                   byte_items: Dict[str, Stored], paths: Dict[str, Tuple[Union[str, int], ...]],
                   checkpoint_id: str, save_id: str) -> bytes:
    """`.metadata` as torch.distributed.checkpoint writes it: its Metadata
    pickled, so any DCP reader (FSDP2, torchtitan, dcp_to_torch_save) reads it."""
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    described: Dict[str, Any] = {}
    storage: Dict[Any, Any] = {}
    for key, (dtype, shape, chunks) in tensors.items():
        listed = []
        for index, ((offsets, sizes), at) in enumerate(sorted(chunks, key=lambda c: c[0][0])):
            listed.append(md.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            storage[md.MetadataIndex(key, offsets, index)] = _StorageInfo(at.file, at.offset, at.length)
        described[key] = md.TensorStorageMetadata(
            properties=md.TensorProperties(dtype=dtype), size=torch.Size(shape), chunks=listed)
    for key, at in byte_items.items():
        described[key] = md.BytesStorageMetadata()
        storage[md.MetadataIndex(key)] = _StorageInfo(at.file, at.offset, at.length)
    meta = md.Metadata(state_dict_metadata=described, planner_data=dict(paths), storage_data=storage)
    torch_compat.stamp_dcp_metadata(meta, checkpoint_id, save_id)
    return pickle.dumps(meta)
