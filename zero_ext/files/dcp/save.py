"""zero_ext.save(..., format="dcp"): a torch.distributed.checkpoint
directory, each rank writing only what it owns.

What a rank writes (`contents`) follows the same plan as zero_ext's own
format (plan.py: each rank its owned ranges of each parameter and of its
optimizer state, fp32 masters where they exist); each range becomes DCP
chunks by boxes.py, in the full tensor's coordinates (a tensor-parallel
part shifted to where it sits). Scalars (Adam's step) are written once per
parameter, by the rank holding its first element; param groups, buffers
and frozen parameters by rank 0; `extra` by every rank (get_state_dict
layout: `extra.rank<r>`; torchtitan layout: its entries at the top level).

`save_parts` gives files/entry.py the two halves of the save it runs and
publishes: `write_rank_file` writes one data file `__<rank>_0.distcp` as torch's
FileSystemWriter does (each item torch.save bytes) and returns where each
item went with its checksum; `index_files` builds, on rank 0, `.metadata`
(DCP's pickled Metadata, which every DCP reader needs) and
`zero_ext-dcp.json`, the checksum of every item (a tensor's of its
values), sealed, tied to the
metadata by the save's token (StorageMeta.save_id): zero_ext's load
verifies what it reads against it; other readers ignore the file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import asynchronous, plan
from ..bytes_io import bytes_view, write_file
from ..checksum import ALGORITHM, digest
from ..sealing import seal
from ..step_counts import count_problem
from ..weights_only import checked, serialized
from .boxes import Box, boxes_of_range, flat_index, shifted, volume
from .index import METADATA, SIDECAR, DcpIndex, Stored, metadata_bytes
from .layout import Layout, Path, flatten, layout_named

SIDECAR_FORMAT = "zero_ext-dcp-checksums"


@dataclass
class TensorItem:
    key: str
    path: Path
    shape: Tuple[int, ...]  # the full tensor's
    box: Box
    data: torch.Tensor  # laid out as the box
    shared: bool = False  # the same on every rank that has it (extra): the lowest rank's is kept
    # Training state a step changes (parameters, masters, optimizer state): an
    # asynchronous save copies it after its call, in the writer thread; the
    # rest (buffers, scalars, extra) at the call ([Note: the snapshot of an
    # asynchronous save]).
    live: bool = False


@dataclass
class Contents:
    """What this rank writes: tensor chunks and values (bytes items)."""
    tensors: List[TensorItem] = field(default_factory=list)
    values: Dict[str, Tuple[Path, bytes]] = field(default_factory=dict)  # serialized at the call: a snapshot

    def value(self, key: str, path: Path, value: Any) -> None:
        self.values[key] = (path, serialized(value))

    def staged(self, copy) -> "Contents":
        """The same contents with each tensor replaced by copy(tensor)."""
        return Contents([TensorItem(t.key, t.path, t.shape, t.box, copy(t.data), t.shared, t.live)
                         for t in self.tensors], dict(self.values))


def _tp_place(state, p: torch.Tensor) -> Tuple[Optional[int], int, bool]:
    """(dim, offset along it, whether this rank writes it): where this rank's
    local tensor of `p` sits in the full tensor. A part every tp rank holds
    alike is written by tp rank 0."""
    dim, offset = plan.split_offset(state, p)
    if dim is not None:
        return dim, offset, True
    return None, 0, plan.stored_offset(state, p, writing=True) is not None


def _chunks(key: str, path: Path, p: torch.Tensor, full: Tuple[int, ...], place, lo: int, hi: int,
            flat: torch.Tensor, out: List[TensorItem]) -> None:
    """The elements [lo, hi) of `p`'s local tensor, held in `flat` (starting
    at lo), as chunks of the full tensor."""
    dim, offset, _ = place
    for box in boxes_of_range(tuple(p.shape), lo, hi):
        at = flat_index(tuple(p.shape), box[0]) - lo
        out.append(TensorItem(key, path, full, shifted(box, dim, offset), flat[at:at + volume(box[1])].view(box[1]),
                              live=True))


def contents(model: torch.nn.Module, optimizer, state, rank: int, mesh_size: int, layout: Layout,
             extra: Any, group_names: List[List[str]], file_rank: Optional[int] = None) -> Contents:
    """What this rank writes. `group_names`: each param group's parameter
    names, over every rank (a rank's optimizer holds its own segments only;
    param_groups.group_names)."""
    out = Contents()
    owned: Dict[int, List[Tuple[int, int]]] = {}
    for i, start, end in plan.owned_ranges(state, state.shard_rank):
        owned.setdefault(i, []).append(plan.replica_part(state, start, end))
    places = [_tp_place(state, p) for p in state.bucketed]
    _add_parameters(out, model, state, rank, mesh_size, layout, owned, places)
    _add_optimizer_state(out, optimizer, state, rank, layout, owned, places)
    if rank == 0:
        _add_param_groups(out, optimizer, layout, group_names)
    # `rank` is within the model's (the stage's) ranks; a pipeline's stages
    # each write their own parameters alike, and `extra` by global rank.
    _add_extra(out, rank if file_rank is None else file_rank, layout, extra)
    return out


def _whole(out: Contents, key: str, path: Path, value: torch.Tensor, shared: bool = False, live: bool = False) -> None:
    """A tensor written whole, as one chunk."""
    out.tensors.append(TensorItem(key, path, tuple(value.shape), ((0,) * value.dim(), tuple(value.shape)),
                                  value.detach(), shared, live))


def _add_parameters(out: Contents, model, state, rank: int, mesh_size: int, layout: Layout,
                    owned: Dict[int, List[Tuple[int, int]]], places: list) -> None:
    """The owned ranges of each bucketed parameter; rank 0's share of the
    rest (zero-size parameters, buffers); the parameters not bucketed."""
    names = state.bucketed_names
    for i, start, view in plan.local_views(state):
        p = state.bucketed[i]
        key, path = layout.model_key(names[i])
        if not places[i][2]:
            continue
        for lo, hi in owned.get(i, []):
            a, b = max(lo, start), min(hi, start + view.numel())
            if a < b:
                _chunks(key, path, p, plan.full_shape(state, p), places[i], a, b, view[a - start:b - start],
                        out.tensors)
    if rank == 0:
        for i, p in enumerate(state.bucketed):  # a zero-size parameter: one empty chunk, so the key exists
            if p.numel() == 0:  # (never read: a stage 3 parameter holds no data here)
                _whole(out, *layout.model_key(names[i]), torch.empty(plan.full_shape(state, p), dtype=p.dtype))
    if rank % mesh_size == 0:  # not bucketed (frozen, ...): whole on every rank of the data-parallel group
        bucketed = {id(p) for p in state.bucketed}
        for n, p in model.named_parameters():
            place = _tp_place(state, p)
            if id(p) not in bucketed and place[2]:
                key, path = layout.model_key(n)
                if p.numel():
                    _chunks(key, path, p, plan.full_shape(state, p), place, 0, p.numel(), p.detach().reshape(-1),
                            out.tensors)
                else:
                    _whole(out, key, path, p.detach())
    if rank == 0:  # (of each pipeline stage: a root buffer every stage keeps, torchtitan's freqs_cis, is
        # written by each stage's first rank alike, and the lowest rank's is kept)
        for n, buf in plan.persistent_buffers(model).items():
            _whole(out, *layout.model_key(n), buf.detach().cpu(), shared=True)


def _add_optimizer_state(out: Contents, optimizer, state, rank: int, layout: Layout,
                         owned: Dict[int, List[Tuple[int, int]]], places: list) -> None:
    """Each parameter's optimizer state this rank writes: elementwise state
    over its ranges, state that is not elementwise whole by its owner,
    scalars once per parameter (by the rank holding its first element)."""
    names = state.bucketed_names
    for tensor, i, start in plan.optimizer_pieces(state, optimizer):
        st = optimizer.state.get(tensor)
        p = state.bucketed[i]
        if not st or not places[i][2]:
            continue
        length = tensor.numel()
        ranges = [plan.replica_part(state, start, start + length)] if state.grads_sharded else owned.get(i, [])
        writes_first = places[i][1] == 0 and any(max(lo, start) == 0 < min(hi, start + length)
                                                 for lo, hi in ranges)
        for k, v in st.items():
            key, path = layout.state_key(names[i], str(k))
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == length == 0:
                if rank == 0:  # a zero-size parameter's state: one empty chunk, so the key exists
                    _whole(out, key, path, torch.empty(plan.full_shape(state, p), dtype=v.dtype))
            elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == length:
                flat = v.detach().reshape(-1)
                for lo, hi in ranges:
                    a, b = max(lo, start), min(hi, start + length)
                    if a < b:
                        _chunks(key, path, p, plan.full_shape(state, p), places[i], a, b,
                                flat[a - start:b - start], out.tensors)
            elif isinstance(v, torch.Tensor) and v.dim() > 0:  # not elementwise: its owner writes it whole
                if (state.whole_params and state.replica_rank == 0) or rank == 0:  # hybrid: the first row's owner
                    _whole(out, key, path, v.detach(), live=True)
            elif writes_first or (length == 0 and rank == 0):  # a scalar: once per parameter
                _add_scalar(out, key, path, names[i], k, v)


def _add_scalar(out: Contents, key: str, path: Path, name: str, k: Any, v: Any) -> None:
    """Scalar optimizer state (a 0-d tensor or a number), refused here (not
    at load) when a load would refuse it."""
    plain = v.item() if isinstance(v, torch.Tensor) else v
    problem = count_problem(str(k), plain) if isinstance(plain, (int, float)) else None
    if problem:
        raise ValueError(f"zero_ext.save: optimizer state {k!r} of '{name}' {problem}: the "
                         "optimizer's state is broken, so this save would not load. Nothing was written")
    if isinstance(v, torch.Tensor):
        _whole(out, key, path, v.detach().cpu())
    else:
        out.value(key, path, v)


def _add_param_groups(out: Contents, optimizer, layout: Layout, group_names: List[List[str]]) -> None:
    """Rank 0 (of each pipeline stage): each param group's hyperparameters
    (and, outside torchtitan's layout, its parameters' names: every stage's,
    param_groups.group_names)."""
    for g, group in enumerate(optimizer.param_groups):
        params = group_names[g]
        hyper = {k: v for k, v in group.items() if k != "params"}
        if layout.name != "torchtitan":
            hyper["params"] = params
        for k, v in hyper.items():
            for key, path in layout.group_keys(g, params, k):
                out.value(key, path, v)


def _add_extra(out: Contents, rank: int, layout: Layout, extra: Any) -> None:
    """`extra`: torchtitan's layout puts its entries at the top level (the
    same on every rank: the lowest rank's is kept), get_state_dict's keeps
    each rank's under `extra.rank<r>`."""
    if layout.name != "torchtitan":
        out.value(f"extra.rank{rank}", ("extra", f"rank{rank}"), extra)
        return
    flat: Dict[str, Tuple[Path, Any]] = {}
    flatten(extra if extra is not None else {}, (), flat)
    for key, (path, value) in flat.items():
        if isinstance(value, torch.Tensor):
            _whole(out, key, path, value.detach().cpu(), shared=True)
        else:
            out.value(key, path, value)


@dataclass
class RankReport:
    """Where this rank put each item: tensors (key -> [(box, dtype name,
    shape, stored, checksum, shared)]) and values (key -> (path, stored,
    checksum))."""
    tensors: Dict[str, List[tuple]]
    values: Dict[str, tuple]
    paths: Dict[str, Path]


def write_rank_file(directory: str, rank: int, items: Contents) -> RankReport:
    """This rank's data file, each item's torch.save bytes one after the
    other (torch's FileSystemWriter's format). A tensor's checksum is of its
    values (XXH3 over its bytes, what load compares after reading it); a
    value's, of its serialized bytes."""
    name = f"__{rank}_0.distcp"
    tensors: Dict[str, List[tuple]] = {}
    values: Dict[str, tuple] = {}
    paths: Dict[str, Path] = {}
    with open(os.path.join(directory, name), "wb") as f:
        for item in items.tensors:
            data = item.data.detach().cpu()
            if data.untyped_storage().nbytes() != data.numel() * data.element_size() or not data.is_contiguous():
                data = data.clone(memory_format=torch.contiguous_format)  # torch.save writes a view's whole storage
            at = f.tell()
            torch.save(data, f)
            check = digest(bytes_view(data)) if data.numel() else digest(b"")
            stored = Stored(name, at, f.tell() - at)
            tensors.setdefault(item.key, []).append((item.box, str(data.dtype), item.shape, stored, check,
                                                     item.shared))
            paths[item.key] = item.path
        for key, (path, blob) in items.values.items():
            at = f.tell()
            f.write(blob)
            values[key] = (path, Stored(name, at, len(blob)), digest(blob))
            paths[key] = path
        f.flush()
        os.fsync(f.fileno())
    return RankReport(tensors, values, paths)


def index_files(reports: List[RankReport], token: str, target: str) -> Tuple[bytes, bytes]:
    """Rank 0: `.metadata` and the checksum sidecar from every rank's
    report; a key written by several ranks alike (extra's shared entries,
    param groups) is taken from the lowest rank."""
    tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...], List[Tuple[Box, Stored]]]] = {}
    values: Dict[str, Stored] = {}
    paths: Dict[str, Path] = {}
    sums: Dict[str, list] = {}
    for report in reports:
        for key, chunks in report.tensors.items():
            for box, dtype, shape, stored, check, shared in chunks:
                entry = tensors.setdefault(key, (getattr(torch, dtype.split(".")[-1]), tuple(shape), []))
                if shared and entry[2]:
                    continue
                if entry[1] != tuple(shape) or str(entry[0]) != dtype:
                    raise RuntimeError(f"zero_ext.save: ranks disagree about '{key}': {dtype} {list(shape)} vs "
                                       f"{entry[0]} {list(entry[1])} (a zero_ext bug; please report it)")
                entry[2].append((box, stored))
                sums[f"{key}|{','.join(map(str, box[0]))}"] = [stored.file, stored.offset, stored.length, check]
        for key, (path, stored, check) in report.values.items():
            if key not in values:
                values[key] = stored
                sums[key] = [stored.file, stored.offset, stored.length, check]
        for key, path in report.paths.items():
            paths.setdefault(key, path)
    for key, (dtype, shape, chunks) in tensors.items():
        if sum(volume(b[1]) for b, _ in chunks) != volume(shape):
            raise RuntimeError(f"zero_ext.save: the ranks' chunks of '{key}' cover {sum(volume(b[1]) for b, _ in chunks)}"
                               f" of its {volume(shape)} elements (a zero_ext bug; please report it)")
    meta = metadata_bytes(tensors, values, paths, target, f"zero_ext-{token}")
    DcpIndex.parse(meta, f"zero_ext.save: {target}")  # what load will read, read now: never publish what it refuses
    sidecar = json.dumps(seal({"format": SIDECAR_FORMAT, "version": 1, "token": token, "algorithm": ALGORITHM,
                               "items": sums}), sort_keys=True).encode()
    return meta, sidecar


def checked_layout(dcp_layout: str, extra: Any) -> Layout:
    """Phase 0 of a DCP save, on every rank: the layout named, and an
    `extra` it takes (torchtitan's: a dict of the checkpoint's other
    top-level entries) that torch.load(weights_only=True) reads back."""
    layout = layout_named(dcp_layout)
    if layout.name == "torchtitan" and extra is not None and not isinstance(extra, dict):
        raise TypeError("zero_ext.save: with dcp_layout=\"torchtitan\", extra holds the checkpoint's other "
                        "top-level entries, a dict such as {\"lr_scheduler\": ..., \"train_state\": ...}, "
                        f"not a {type(extra).__name__}. Nothing was written")
    checked(extra, "extra")
    return layout


def save_parts(model, optimizer, state, ranks, token: str, target: str, tmp: str, layout: Layout, extra: Any,
               group_names: List[List[str]], async_save: bool):
    """(write, index, take) of a DCP save into the staging directory `tmp`:
    write() writes this rank's data file and returns its report; index(every
    rank's reports), on rank 0, writes the checksum sidecar and returns
    `.metadata`'s bytes, which publishing writes last. What is written is the
    state now: read now, or for an asynchronous save a snapshot whose live
    items take() copies in the writer thread before write() ([Note: the
    snapshot of an asynchronous save]; None for a save at once)."""
    items = contents(model, optimizer, state, ranks.stage_rank, ranks.mesh_size, layout, extra, group_names,
                     file_rank=ranks.rank)
    snapshot = None
    if async_save:
        snapshot = asynchronous.stager_of(state).snapshot(
            [(t.data, f"'{t.key}'", t.live) for t in items.tensors], asynchronous.watched_parameters(model, state),
            asynchronous.may_defer(state))

    def write() -> RankReport:
        staged = items if snapshot is None else items.staged(snapshot.copy)
        return write_rank_file(tmp, ranks.rank, staged)  # looked up at the call: tests plant a failing one

    def index(reports: List[RankReport]) -> bytes:
        meta, sidecar = index_files(reports, token, target)
        write_file(os.path.join(tmp, SIDECAR), sidecar)
        return meta

    return write, index, (snapshot.take if snapshot is not None and snapshot.deferred else None)


__all__ = ["Contents", "RankReport", "checked_layout", "contents", "index_files", "save_parts", "write_rank_file",
           "SIDECAR", "METADATA"]
