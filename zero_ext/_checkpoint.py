"""zero_ext.save / zero_ext.load: sharded, atomic, loadable at any world size
and stage (the format is in _checkpoint_files.py).

Each rank writes only the elements it owns: for every bucket, the r-th equal
slice of its flat parameters (in stages 1-3 exactly the rank's shard; in
stage 0, where every rank holds everything, the same split, so ranks share
the writing). Values are the fp32 masters where they exist. Pieces are
indexed by parameter name and element range, not by rank or bucket, so a
loading rank reads the ranges of each parameter its own layout needs,
whatever world size, stage or bucket size wrote them.

Atomicity: every rank writes into `PATH.tmp-<token>`; when all ranks report
success, rank 0 writes metadata.json (which makes a directory a checkpoint)
and renames the directory into place, moving an existing checkpoint aside
first and deleting it after. A crash at any point leaves either the old or
the new checkpoint complete (see _checkpoint_files.resolve).
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _checkpoint_files as files
from ._state_dict import _state

# Tests make one rank exit at a named point of a save (fault injection).
_FAULT_ENV = "ZERO_EXT_TEST_SAVE_EXIT"


def _maybe_die(point: str, rank: int) -> None:
    spec = os.environ.get(_FAULT_ENV, "")
    if spec == f"{point}:{rank}":
        os._exit(17)


class _Ranks:
    """Collectives of a save or load on the model's own group (which carries
    wrap()'s timeout), or nothing for a single process."""

    def __init__(self, state):
        self.group = state.process_group
        self.distributed = self.group is not None and state.world_size > 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.world = state.world_size

    def gather(self, obj: Any) -> List[Any]:
        if not self.distributed:
            return [obj]
        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def from_rank0(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]


def _layout(state) -> List[Tuple[int, int, int]]:
    raw = state.buckets.bucket_layout()
    return [tuple(raw[i:i + 3]) for i in range(0, len(raw), 3)]


def _param_places(state) -> List[Tuple[int, int]]:
    """(bucket, element offset in it) of each bucketed parameter."""
    places = []
    for b, (first, count, _) in enumerate(_layout(state)):
        offset = 0
        for i in range(first, first + count):
            places.append((b, offset))
            offset += state.bucketed[i].numel()
    return places


def _owned_ranges(state, rank: int) -> List[Tuple[int, int, int]]:
    """(param index, start, end) this rank writes: its equal slice of each bucket."""
    out = []
    places = _param_places(state)
    layout = _layout(state)
    for i, p in enumerate(state.bucketed):
        b, offset = places[i]
        own = layout[b][2] // state.world_size
        lo, hi = rank * own, (rank + 1) * own
        start, end = max(lo, offset), min(hi, offset + p.numel())
        if start < end:
            out.append((i, start - offset, end - offset))
    return out


def _local_views(state) -> List[Tuple[int, int, torch.Tensor]]:
    """(param index, start in param, flat view) of every bucketed value this
    rank holds: fp32 masters or its parameter shard; in stage 0 without
    masters the parameters themselves."""
    if not state.sharded_optimizer:
        return [(i, 0, p.detach().view(-1)) for i, p in enumerate(state.bucketed)]
    shards = state.buckets.local_value_shards()
    starts = state.buckets.local_value_starts()
    places = _param_places(state)
    out = []
    for i, p in enumerate(state.bucketed):
        b, offset = places[i]
        lo, hi = starts[b], starts[b] + shards[b].numel()
        start, end = max(lo, offset), min(hi, offset + p.numel())
        if start < end:
            out.append((i, start - offset, shards[b][start - lo:end - lo]))
    return out


def _optimizer_pieces(state, optimizer) -> List[Tuple[torch.Tensor, int, int]]:
    """(optimizer tensor, param index, start in param) for each tensor the
    optimizer steps: this rank's segments, or whole parameters in stage 0."""
    if not state.sharded_optimizer:
        index = {id(p): i for i, p in enumerate(state.bucketed)}
        return [(p, index[id(p)], 0) for g in optimizer.param_groups for p in g["params"] if id(p) in index]
    segments = state.buckets.segments()
    owners = state.buckets.segment_param_indices()
    starts = state.buckets.segment_param_starts()
    by_id = {id(s): (i, st) for s, i, st in zip(segments, owners, starts)}
    return [(p, *by_id[id(p)]) for g in optimizer.param_groups for p in g["params"]]


def _persistent_buffers(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def _scalar(value: Any) -> Optional[dict]:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0:
        return {"value": value.item(), "tensor": True, "dtype": files.dtype_name(value.dtype)}
    if isinstance(value, (int, float, bool)):
        return {"value": value, "tensor": False}
    return None


def _unscalar(spec: dict) -> Any:
    if spec["tensor"]:
        return torch.tensor(spec["value"], dtype=files.dtype_of(spec["dtype"]), device="cpu")
    return spec["value"]


def _write_rank_files(tmp: str, model, optimizer, state, ranks: _Ranks, extra) -> Tuple[List[dict], int]:
    rank = ranks.rank
    name = f"rank{rank}.bin"
    writer = files.ShardWriter(os.path.join(tmp, name))
    pieces: List[dict] = []

    def put(kind: str, param_name: str, start: int, tensor: torch.Tensor, key: str = "", **more) -> None:
        offset, dtype = writer.write(tensor)
        pieces.append(dict(kind=kind, name=param_name, key=key, start=start, length=tensor.numel(),
                           file=name, offset=offset, dtype=dtype, **more))

    names = state.bucketed_names
    owned = {}
    for i, start, end in _owned_ranges(state, rank):
        owned.setdefault(i, []).append((start, end))
    for i, start, view in _local_views(state):
        for lo, hi in owned.get(i, []):
            a, b = max(lo, start), min(hi, start + view.numel())
            if a < b:
                put("param", names[i], a, view[a - start:b - start])
    if rank == 0:  # parameters zero_ext does not bucket (frozen, stages 0-2): full on every rank
        bucketed = {id(p) for p in state.bucketed}
        for n, p in model.named_parameters():
            if id(p) not in bucketed:
                put("param", n, 0, p.detach().reshape(-1))

    for tensor, i, start in _optimizer_pieces(state, optimizer):
        st = optimizer.state.get(tensor)
        if not st:
            continue
        length = tensor.numel()
        # Sharded, a rank's state is its own; replicated (stage 0), every
        # rank has all of it and writes its owned ranges only.
        sharded = state.sharded_optimizer and not state.buckets.replicated()
        ranges = [(start, start + length)] if sharded else owned.get(i, [])
        scalars = {k: _scalar(v) for k, v in st.items()}
        scalars = {k: v for k, v in scalars.items() if v is not None}
        flat = {k: v.detach().reshape(-1) for k, v in st.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == length}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() != length and rank == 0:
                put("whole", names[i], 0, v.reshape(-1), key=k, shape=list(v.shape))
        for lo, hi in ranges:
            a, b = max(lo, start), min(hi, start + length)
            if a >= b:
                continue
            pieces.append(dict(kind="scalars", name=names[i], start=a, length=b - a, values=scalars))
            for k, v in flat.items():
                put("state", names[i], a, v[a - start:b - start], key=k)
    writer.close()
    torch.save(extra, os.path.join(tmp, f"extra-rank{rank}.pt"))
    if rank == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        torch.save({"class": type(optimizer).__mro__[1].__name__, "param_groups": groups},
                   os.path.join(tmp, "optimizer.pt"))
        torch.save({k: v.detach().cpu() for k, v in _persistent_buffers(model).items()},
                   os.path.join(tmp, "buffers.pt"))
    return pieces, writer.offset


def _metadata(model, optimizer, state, gathered) -> dict:
    group_of = {}
    index = {id(p): i for i, p in enumerate(state.bucketed)}
    for g_index, pieces in enumerate(_optimizer_pieces_by_group(state, optimizer)):
        for i in pieces:
            group_of[i] = g_index
    params = []
    aliases: Dict[int, List[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    for n, p in model.named_parameters():
        i = index.get(id(p))
        params.append({
            "name": n, "aliases": aliases[id(p)], "shape": list(p.shape),
            "trainable": p.requires_grad, "group": group_of.get(i) if i is not None else None,
        })
    scaler = state.buckets.loss_scaler_state()
    return {
        "format": files.FORMAT, "version": files.VERSION,
        "world_size": state.world_size, "stage": state.stage,
        "compute_dtype": None if state.compute_dtype is None else files.dtype_name(state.compute_dtype),
        "offload": state.offload,
        "loss_scaler": {"scale": scaler[0], "clean_steps": int(scaler[1]), "skipped_steps": int(scaler[2])},
        "params": params,
        "files": {f"rank{r}.bin": size for r, (_, size, _) in enumerate(gathered)},
        "pieces": [piece for pieces, _, _ in gathered for piece in pieces],
    }


def _optimizer_pieces_by_group(state, optimizer) -> List[List[int]]:
    pieces = _optimizer_pieces(state, optimizer)
    owner = {id(t): i for t, i, _ in pieces}
    return [[owner[id(p)] for p in g["params"] if id(p) in owner] for g in optimizer.param_groups]


def save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Any = None) -> None:
    """Writes a sharded checkpoint directory at `path`, atomically: every rank
    writes its own shards; the directory appears (replacing an older one)
    only once all ranks have finished. Collective: call on every rank."""
    state = _state(model)
    if getattr(optimizer, "_zero_ext", None) is not state:
        raise ValueError("zero_ext.save: this optimizer was not wrapped together with this model")
    ranks = _Ranks(state)
    path = os.path.abspath(path)
    token = ranks.from_rank0(uuid.uuid4().hex[:12])
    tmp = f"{path}.tmp-{token}"
    error = None
    pieces, size = [], 0
    try:
        os.makedirs(tmp, exist_ok=True)
        pieces, size = _write_rank_files(tmp, model, optimizer, state, ranks, extra)
    except Exception as e:  # reported to every rank below, so none waits forever
        error = f"{type(e).__name__}: {e}"
    _maybe_die("after_shards", ranks.rank)
    gathered = ranks.gather((pieces, size, error))
    failed = [(r, err) for r, (_, _, err) in enumerate(gathered) if err]
    if failed:
        if ranks.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"zero_ext.save: writing {path} failed on rank(s) {failed}; the previous "
                           "checkpoint, if any, is untouched")
    if ranks.rank == 0:
        meta = _metadata(model, optimizer, state, gathered)
        staging = os.path.join(tmp, files.METADATA + ".partial")
        with open(staging, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, os.path.join(tmp, files.METADATA))
        files.fsync_dir(tmp)
        _maybe_die("before_publish", 0)
        aside = None
        if os.path.exists(path):
            aside = f"{path}.old-{token}"
            os.rename(path, aside)
        _maybe_die("between_renames", 0)
        os.rename(tmp, path)
        files.fsync_dir(os.path.dirname(path))
        if aside:
            shutil.rmtree(aside, ignore_errors=True)
    ranks.gather(None)  # nobody returns before the checkpoint is in place


@torch.no_grad()
def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """Loads a checkpoint written by zero_ext.save at any world size and
    stage into a wrapped model and optimizer; returns this rank's `extra`
    (rank 0's when the writer had fewer ranks). Collective."""
    state = _state(model)
    if getattr(optimizer, "_zero_ext", None) is not state:
        raise ValueError("zero_ext.load: this optimizer was not wrapped together with this model")
    ranks = _Ranks(state)
    where = files.resolve(os.path.abspath(path))
    meta = files.read_metadata(where)
    _check_same_model(where, meta, model)
    reader = files.PieceReader(where, meta)
    try:
        names = state.bucketed_names
        for i, start, view in _local_views(state):
            view.copy_(reader.read("param", names[i], start, view.numel(), dtype=view.dtype))
        bucketed = {id(p) for p in state.bucketed}
        for n, p in model.named_parameters():
            if id(p) not in bucketed:
                p.detach().view(-1).copy_(reader.read("param", n, 0, p.numel(), dtype=p.dtype))
        state.buckets.zero_grad(True)
        state.buckets.refresh_params_from_shards()
        _load_optimizer(where, meta, reader, state, optimizer)
        scaler = meta["loss_scaler"]
        state.buckets.restore_loss_scaler(float(scaler["scale"]), int(scaler["clean_steps"]),
                                          int(scaler["skipped_steps"]))
        buffers = torch.load(os.path.join(where, "buffers.pt"), map_location="cpu", weights_only=True)
        for n, buf in _persistent_buffers(model).items():
            if n in buffers:
                buf.copy_(buffers[n])
    finally:
        reader.close()
    extra_file = os.path.join(where, f"extra-rank{ranks.rank}.pt")
    if not os.path.isfile(extra_file):
        extra_file = os.path.join(where, "extra-rank0.pt")
    return torch.load(extra_file, weights_only=False)


def _check_same_model(where: str, meta: dict, model: torch.nn.Module) -> None:
    saved = {p["name"]: tuple(p["shape"]) for p in meta["params"]}
    mine = {n: tuple(p.shape) for n, p in model.named_parameters()}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    shapes = sorted(n for n in set(mine) & set(saved) if mine[n] != saved[n])
    if missing or unexpected or shapes:
        raise RuntimeError(
            f"zero_ext.load: {where} was saved from a different model: parameters missing from the "
            f"checkpoint {missing[:5]}, unexpected in it {unexpected[:5]}, shapes differ for "
            f"{[(n, saved[n], mine[n]) for n in shapes[:5]]}")


def _load_optimizer(where: str, meta: dict, reader, state, optimizer) -> None:
    saved = torch.load(os.path.join(where, "optimizer.pt"), map_location="cpu", weights_only=True)
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeError(
            f"zero_ext.load: {where} has {len(groups)} optimizer param groups, this optimizer "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups")
    for mine, theirs in zip(optimizer.param_groups, groups):
        mine.update(theirs)
    optimizer.state.clear()
    names = state.bucketed_names
    for tensor, i, start in _optimizer_pieces(state, optimizer):
        name, length = names[i], tensor.numel()
        scalars = reader.scalars(name, start, length)
        keys = reader.keys("state", name)
        if not scalars and not keys:
            continue  # never stepped
        st = {}
        for key, spec in scalars.items():
            st[key] = _unscalar(spec)
        for key in keys:
            st[key] = reader.read("state", name, start, length, key=key).view(tensor.shape).to(tensor.device)
        for key in reader.keys("whole", name):
            if state.sharded_optimizer and not state.buckets.replicated():
                raise RuntimeError(
                    f"zero_ext.load: optimizer state '{key}' of '{name}' in {where} is not "
                    "elementwise and cannot be sharded; load it at stage 0")
            st[key] = reader.read_whole(name, key).to(tensor.device)
        optimizer.state[tensor] = st
