"""zero_ext.save: a sharded checkpoint, written atomically, each byte
checksummed as it is written.

Phases, each ended on every rank by Ranks.settle (a failure anywhere raises
everywhere at once): (0) inputs: the path is rank 0's and every rank must
have passed the same; `extra` must be something torch.load(weights_only=True)
reads back; nothing is written before all ranks agree. (1) every rank writes
its files into the staging directory (publish.staging_path). (2) rank 0
checks every rank's files are there with their sizes, writes metadata.json
(which makes a directory a checkpoint) and publishes the directory in one
step (publish.py). A failure removes the staging directory; a crash at any
point leaves either the previous or the new checkpoint complete.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import format as files
from .. import plan
from . import publish
from .. import asynchronous
from ...optim import as_one, class_name, offload_in_memory, qualified_class_names
from ...tools import require_bool, require_module, require_optimizer, state_of, state_or_none
from .checksum import digest
from ...groups import Ranks, group_timeout, refuse_different_paths
from .metadata import (CHUNK_BYTES, CheckpointMeta, FileMeta, LossScaler, ParamMeta, ParamPiece, Piece, Scalar,
                       ScalarsPiece, StatePiece, WholeStatePiece, count_problem,
                       describe_scalar, file_names, scalars_disagreement)


def _scalar(name: str, key: Any, value: Any) -> Optional[Scalar]:
    """Scalar optimizer state as the metadata holds it, refused here (not at
    load) when a load would refuse it."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0:
        if not files.storable(value.dtype) or value.dtype.is_complex:
            raise TypeError(f"zero_ext.save: cannot store scalar optimizer state of dtype {value.dtype}")
        scalar = Scalar(value.item(), True, files.dtype_name(value.dtype))
    elif isinstance(value, (int, float, bool)):
        scalar = Scalar(value, False, None)
    else:
        return None
    if not isinstance(key, str):
        raise TypeError(f"zero_ext.save: optimizer state of '{name}' has the key {key!r}, not a string; "
                        "checkpoints keep state by name (torch's optimizers use strings)")
    problem = count_problem(key, scalar.value)
    if problem:
        raise ValueError(f"zero_ext.save: optimizer state {key!r} of '{name}' {problem}: the optimizer's "
                         "state is broken, so this save would not load. Nothing was published")
    return scalar


def weights_only_loadable(value: Any) -> bool:
    try:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)
        return True
    except Exception:  # noqa: BLE001 - unpicklable, or refused by weights_only
        return False


def _first_unsafe(value: Any, where: str) -> Tuple[str, Any]:
    """The innermost entry of `value` that weights_only cannot read back."""
    if isinstance(value, dict):
        children = [(f"{where}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        children = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    else:
        children = []
    for at, child in children:
        if not weights_only_loadable(child):
            return _first_unsafe(child, at)
    return where, value  # a leaf, or a container type weights_only refuses


def _checked_file(token: str, rank: int, value: Any, label: str) -> bytes:
    """The bytes of a .pt file holding `value`, once torch.load(weights_only=True)
    has read them back: load reads nothing else, so this is checked at save."""
    try:
        blob = files.packed(token, rank, value)
        torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        return blob
    except Exception:  # noqa: BLE001 - named precisely below
        pass
    where, bad = _first_unsafe(value, label)
    raise TypeError(
        f"zero_ext.save: {where} is a {type(bad).__module__}.{type(bad).__qualname__}, which "
        "torch.load(weights_only=True) cannot read back, and zero_ext.load reads checkpoints only that way "
        "(anything else could run code when loaded). It may hold tensors, numbers, strings, bools, None and "
        "lists, tuples and dicts of them (e.g. scheduler.state_dict(), torch.get_rng_state()): store the "
        "object's state_dict() or plain values instead. Nothing was written")


def _rank_ops(model, optimizer, state, ranks: Ranks) -> list:
    """What this rank writes, in order: ("put", name, start, tensor, key,
    shape) for a range of a parameter's values (no key), of its elementwise
    state (key) or a whole state that is not elementwise (key, shape), and
    ScalarsPieces. Tensors are views of the live state (staged copies for
    an asynchronous save)."""
    rank = ranks.rank
    ops: list = []

    def put(param_name: str, start: int, tensor: torch.Tensor, key: str = "", shape=None) -> None:
        ops.append(("put", param_name, start, tensor, key, shape))

    names = state.bucketed_names
    # Where each parameter's local values start among its stored elements
    # (tensor parallel: this tp rank's part; None: another tp rank writes it).
    shift = [plan.stored_offset(state, p, writing=True) for p in state.bucketed]
    owned: Dict[int, List[Tuple[int, int]]] = {}
    for i, start, end in plan.owned_ranges(state, state.shard_rank):
        owned.setdefault(i, []).append(plan.replica_part(state, start, end))
    for i, start, view in plan.local_views(state):
        for lo, hi in owned.get(i, []):
            a, b = max(lo, start), min(hi, start + view.numel())
            if a < b and shift[i] is not None:
                put(names[i], shift[i] + a, view[a - start:b - start])
    if rank % ranks.mesh_size == 0:  # parameters not bucketed (frozen, stages 0-2 without mixed precision): full on every rank
        bucketed = {id(p) for p in state.bucketed}
        for n, p in model.named_parameters():
            at = plan.stored_offset(state, p, writing=True)
            if id(p) not in bucketed and p.numel() and at is not None:
                put(n, at, p.detach().reshape(-1))

    for tensor, i, start in plan.optimizer_pieces(state, optimizer):
        st = optimizer.state.get(tensor)
        if not st or shift[i] is None:
            continue
        length = tensor.numel()
        # Sharded, a rank's state is its own; replicated (stage 0), every
        # rank has all of it and writes its owned ranges only.
        sharded = state.grads_sharded
        ranges = [plan.replica_part(state, start, start + length)] if sharded else owned.get(i, [])
        scalars = {k: _scalar(names[i], k, v) for k, v in st.items()}
        scalars = {k: v for k, v in scalars.items() if v is not None}
        flat = {k: v.detach().reshape(-1) for k, v in st.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == length}
        # State that is not elementwise (Adafactor's factors, ...) belongs to a
        # whole parameter: its owner writes it (replicated: rank 0).
        writes_whole = state.whole_params or rank == 0
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() != length and writes_whole:
                put(names[i], 0, v.reshape(-1), key=k, shape=tuple(v.shape))
        for lo, hi in ranges:
            a, b = max(lo, start), min(hi, start + length)
            if a >= b:
                continue
            ops.append(ScalarsPiece(-1, names[i], shift[i] + a, b - a, scalars))
            for k, v in flat.items():
                put(names[i], shift[i] + a, v[a - start:b - start], key=k)
    return ops


def _write_rank_files(tmp: str, ops: list, ranks: Ranks, token: str,
                      blobs: Dict[str, bytes]) -> Tuple[List[Piece], Dict[str, FileMeta]]:
    """This rank's files in `tmp`; returns its pieces (indices assigned
    later) and {file: size and checksum}."""
    rank = ranks.rank
    name = f"rank{rank}.bin"
    writer = files.ShardWriter(os.path.join(tmp, name), token, rank, ranks.world)
    pieces: List[Piece] = []
    try:
        for op in ops:
            if not isinstance(op, tuple):
                pieces.append(op)
                continue
            _, param_name, start, tensor, key, shape = op
            offset, dtype, crcs = writer.write(tensor)
            stored = (-1, param_name, start, tensor.numel(), name, offset, dtype, tuple(crcs))
            pieces.append(ParamPiece(*stored) if not key else StatePiece(*stored, key) if shape is None
                          else WholeStatePiece(*stored, key, shape))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    written = {name: FileMeta(writer.offset, None)}
    for file, blob in blobs.items():
        files.write_file(os.path.join(tmp, file), blob)
        written[file] = FileMeta(len(blob), digest(blob))
    return pieces, written


def _stored_dtypes(model, state, pieces: List[Piece]) -> Dict[str, str]:
    """Each parameter's dtype in the shard files: its pieces'; for a zero-size
    one (no pieces), what a piece of it would have been."""
    out = {p.name: p.dtype for p in pieces if isinstance(p, ParamPiece)}
    bucketed = {id(p) for p in state.bucketed}
    masters = state.handles.optimizer.has_masters()
    for n, p in model.named_parameters():
        if n not in out:
            out[n] = files.dtype_name(torch.float32 if masters and id(p) in bucketed else p.dtype)
    return out


def _metadata(model, optimizer, state, token: str, pieces: List[Piece], sizes: Dict[str, FileMeta],
              world: int) -> CheckpointMeta:
    group_of = {}
    index = {id(p): i for i, p in enumerate(state.bucketed)}
    for g_index, members in enumerate(plan.optimizer_pieces_by_group(state, optimizer)):
        for i in members:
            group_of[i] = g_index
    aliases: Dict[int, List[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    dtypes = _stored_dtypes(model, state, pieces)
    params = []
    for n, p in model.named_parameters():
        i = index.get(id(p))
        params.append(ParamMeta(n, tuple(aliases[id(p)]), plan.full_shape(state, p), dtypes[n], p.requires_grad,
                                group_of.get(i) if i is not None else None, plan.tensor_parallel_split(state, p)))
    scale, clean, skipped = state.handles.checkpoint.loss_scaler_state()
    return CheckpointMeta(
        token=token, world_size=world, stage=state.stage,
        compute_dtype=None if state.compute_dtype is None else files.dtype_name(state.compute_dtype),
        offload=state.offload, loss_scaler=LossScaler(scale, int(clean), int(skipped)),
        chunk_bytes=CHUNK_BYTES, params=tuple(params), files=sizes,
        pieces=tuple(dataclasses.replace(p, index=k) for k, p in enumerate(pieces)),
        optimizer_classes=tuple(qualified_class_names(optimizer)))


def _check_scalars_agree(gathered) -> None:
    """Rank 0: each parameter's scalar optimizer state is the same in every
    rank's pieces of it, as load requires (metadata.scalars_disagreement)."""
    writer, pieces = {}, []
    for rank, (written, _) in enumerate(gathered):
        for piece in written:
            writer[id(piece)] = rank
            pieces.append(piece)
    found = scalars_disagreement(pieces)
    if found is not None:
        seen, piece, key = found
        raise ValueError(
            f"zero_ext.save: optimizer state {key!r} of '{piece.name}' is {describe_scalar(seen, key)} on rank "
            f"{writer[id(seen)]} and {describe_scalar(piece, key)} on rank {writer[id(piece)]}, which hold parts of "
            "that parameter: a checkpoint keeps one value of each scalar per parameter, so this save would not "
            "load. An optimizer marked zero_ext_elementwise must keep scalar state that does not depend on the "
            "slice it steps (or leave the mark off, so zero_ext steps whole parameters)")


def _check_written(tmp: str, world: int, gathered) -> Dict[str, FileMeta]:
    """Rank 0: every rank's files are in `tmp` with the sizes that rank wrote
    (ranks writing to different filesystems, or a file lost, end here)."""
    reported = {}
    for rank, (_, written) in enumerate(gathered):
        for name, entry in written.items():
            reported[name] = (rank, entry)
    sizes = {}
    for name in file_names(world):
        if name not in reported:
            raise RuntimeError(f"zero_ext.save: no rank reported writing {name} (zero_ext bug)")
        rank, entry = reported[name]
        full = os.path.join(tmp, name)
        actual = os.path.getsize(full) if os.path.isfile(full) else None
        if actual != entry.size:
            seen = "is missing" if actual is None else f"has {actual} bytes, not {entry.size}"
            raise RuntimeError(
                f"zero_ext.save: {name}, written by rank {rank}, {seen} in {tmp} as rank 0 sees it: every rank "
                "must write to the same shared filesystem at this path")
        sizes[name] = entry
    return sizes


def _reads_back(document: dict, target: str) -> None:
    """What load will parse, parsed now: a save never publishes metadata
    that its load would refuse."""
    try:
        CheckpointMeta.parse(json.dumps(document).encode(), "zero_ext.save", os.path.join(target, "metadata.json"))
    except ValueError as error:
        raise RuntimeError(f"zero_ext.save: the metadata it built does not read back, so nothing was published "
                           f"(a zero_ext bug; please report it): {error}") from None


FORMATS = ("zero_ext", "dcp")
DEFAULT_DCP_LAYOUT = "get_state_dict"
CALL = "zero_ext.save(path, model, optimizer, extra=None)"


def check_options(format: Any, async_save: Any, dcp_layout: Any) -> None:
    """save's options as they are passed, refused (phase 0, so on every rank)
    unless each means what it says: a format's name, async_save a bool
    (bool("False") would be True), a dcp_layout only where it applies."""
    if not isinstance(format, str):
        raise TypeError(f"zero_ext.save: format must be a str, one of {list(FORMATS)}, not {format!r}")
    if format not in FORMATS:
        raise ValueError(f"zero_ext.save: format must be one of {list(FORMATS)}, not {format!r}")
    require_bool(async_save, "zero_ext.save", "async_save",
                 "pass async_save=True to write in the background (save returns a handle at once) or False (the "
                 "default) to return once the checkpoint is in place. Nothing was written")
    if format != "dcp" and not (isinstance(dcp_layout, str) and dcp_layout == DEFAULT_DCP_LAYOUT):
        raise ValueError(f"zero_ext.save: dcp_layout applies to format=\"dcp\" only, and this save's format is "
                         f"{format!r}: pass format=\"dcp\" with dcp_layout={dcp_layout!r}, or leave dcp_layout out "
                         f"for format=\"zero_ext\" (zero_ext's own checkpoints have one layout). Nothing was written")


def save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Any = None, *,
         format: str = "zero_ext", async_save: bool = False, dcp_layout: str = DEFAULT_DCP_LAYOUT):
    """Writes a sharded checkpoint directory at `path`, atomically: every rank
    writes its own shards; the directory appears (replacing an older
    checkpoint) only once all ranks have finished. Collective: call on every
    rank with the same path. `extra` (per rank) may hold what
    torch.load(weights_only=True) reads: tensors, numbers, strings, None,
    lists, tuples and dicts of them.

    format="dcp" writes a torch.distributed.checkpoint directory instead
    (files/dcp/): `{"model": ..., "optim": ...}` in get_state_dict's layout,
    or torchtitan's with dcp_layout="torchtitan" (`extra` then holds its
    other entries: {"lr_scheduler": ..., "dataloader": ..., "train_state": ...}).

    async_save=True returns an AsyncSave at once (`wait()`, `done()`): the
    state at the call is copied to host buffers, written and published in
    the background (files/asynchronous.py); otherwise returns None when the
    checkpoint is in place. async_save takes True or False only, and
    dcp_layout applies to format="dcp" only: anything else is refused on
    every rank before anything is written."""
    require_module(model, "zero_ext.save", CALL)
    state = state_of(model)
    asynchronous.wait_for_previous(state)  # one save at a time per model: the last one's error surfaces here
    # offload_*="nvme": the values, gradients and optimizer state this rank
    # holds in its offload files are in memory for the checkpoint's duration
    # (an asynchronous save's snapshot is taken inside).
    with offload_in_memory([state_or_none(model)], values_changed=False):
        return _save(path, model, optimizer, extra, format, async_save, dcp_layout)


def _save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Any, format: str,
          async_save: bool, dcp_layout: str):
    """save() with the offloaded state in memory."""
    state = state_of(model)
    original, optimizer = optimizer, as_one(optimizer)  # a list or tuple of the model's optimizers: one view
    ranks = Ranks(state, "zero_ext.save")
    token = ranks.from_rank0(uuid.uuid4().hex)

    # Phase 0: every input checked on every rank; nothing written yet.
    error, target, blobs, layout = None, None, {}, None
    try:
        check_options(format, async_save, dcp_layout)
        require_optimizer(original, "zero_ext.save", CALL)
        if state_or_none(optimizer) is not state:
            raise ValueError("zero_ext.save: this optimizer was not wrapped together with this model")
        target = os.path.abspath(os.fspath(path))
        if format == "dcp":
            from ..dcp.layout import layout_named
            layout = layout_named(dcp_layout)
            if layout.name == "torchtitan" and extra is not None and not isinstance(extra, dict):
                raise TypeError("zero_ext.save: with dcp_layout=\"torchtitan\", extra holds the checkpoint's other "
                                "top-level entries, a dict such as {\"lr_scheduler\": ..., \"train_state\": ...}, "
                                f"not a {type(extra).__name__}. Nothing was written")
            _checked_file(token, ranks.rank, extra, "extra")  # what the reader's weights_only load accepts
        else:
            blobs[f"extra-rank{ranks.rank}.pt"] = _checked_file(token, ranks.rank, extra, "extra")
        if ranks.rank == 0:
            publish.check_target(target)
            if format != "dcp":
                groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
                blobs["optimizer.pt"] = _checked_file(
                    token, 0, {"class": class_name(optimizer), "param_groups": groups}, "optimizer")
    except Exception as e:  # noqa: BLE001 - raised on every rank by settle
        error = e
    # The options travel only once checked here (a refused one may not even pickle).
    asked = ranks.settle(error, None if error is not None else
                         (target, format, async_save, dcp_layout if format == "dcp" else None))
    refuse_different_paths([a[0] for a in asked], "zero_ext.save",
                           "a save writes one checkpoint at rank 0's path", "Nothing was written")
    if any(a[1:] != asked[0][1:] for a in asked):
        listed = ", ".join(f"rank {r}: format={a[1]!r}, async_save={a[2]}, dcp_layout={a[3]!r}"
                           for r, a in enumerate(asked))
        raise ValueError(f"zero_ext.save: ranks passed different options ({listed}); pass the same on every rank. "
                         "Nothing was written")

    tmp = publish.staging_path(target, token)
    if format == "dcp":
        members = group_members(state, optimizer, ranks)
    error, job = None, None
    try:  # what this rank writes (a snapshot of it, asynchronous)
        if format == "dcp":
            job = _dcp_job(model, optimizer, state, ranks, token, target, tmp, layout, extra, members, async_save)
        else:
            job = _own_job(model, optimizer, state, ranks, token, target, tmp, blobs, async_save)
    except Exception as e:  # noqa: BLE001 - raised on every rank by settle
        error = e
    ranks.settle(error, action=f"zero_ext.save: preparing {target}", note="Nothing was written")
    if async_save:
        timeout = group_timeout(state.process_group) if state.process_group is not None else None
        return asynchronous.AsyncSave(job, asynchronous.Exchange(ranks, token, timeout), state)
    asynchronous.run_now(job, ranks)
    return None


def _staged(state, tensors: List[torch.Tensor]):
    """A copy function over a snapshot of `tensors` in the model's reusable host buffers."""
    return asynchronous.stager_of(state).stage(tensors)


def _own_job(model, optimizer, state, ranks: Ranks, token: str, target: str, tmp: str, blobs: Dict[str, bytes],
             async_save: bool) -> "asynchronous.Job":
    ops = _rank_ops(model, optimizer, state, ranks)
    if ranks.rank == 0:  # buffers are tensors: always weights_only-safe
        values = {k: v.detach().cpu().clone() for k, v in plan.persistent_buffers(model).items()}
        blobs["buffers.pt"] = files.packed(token, 0, values)
    if async_save:
        copy = _staged(state, [op[3] for op in ops if isinstance(op, tuple)])
        ops = [op if not isinstance(op, tuple) else op[:3] + (copy(op[3]),) + op[4:] for op in ops]

    def write():
        publish.make_staging(tmp, token, ranks.rank)
        return _write_rank_files(tmp, ops, ranks, token, blobs)

    def publish_all(gathered):
        try:
            sizes = _check_written(tmp, ranks.world, gathered)
            _check_scalars_agree(gathered)
            meta = _metadata(model, optimizer, state, token, [p for ps, _ in gathered for p in ps], sizes,
                             ranks.world)
            document = meta.to_json()
            _reads_back(document, target)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the caller
            shutil.rmtree(tmp, ignore_errors=True)
            return e, f"Nothing was published: {tmp} was removed and the previous checkpoint, if any, is untouched"
        return publish.publish(target, tmp, token, document)

    return asynchronous.Job(ranks.rank, write, publish_all, lambda: shutil.rmtree(tmp, ignore_errors=True),
                            f"zero_ext.save: writing {target}",
                            f"The unfinished {tmp} was removed and the previous checkpoint, if any, is untouched")


def group_members(state, optimizer, ranks: Ranks) -> List[List[int]]:
    """Each param group's parameters (bucketed indices) over every rank: a
    rank's optimizer holds its own segments only. Collective; an optimizer
    not wrapped with this model raises on every rank."""
    error, mine = None, None
    try:
        if state_or_none(optimizer) is not state:
            raise ValueError("zero_ext: this optimizer was not wrapped together with this model")
        mine = plan.optimizer_pieces_by_group(state, optimizer)
    except Exception as e:  # noqa: BLE001 - raised on every rank by settle
        error = e
    every = ranks.settle(error, mine)
    return [sorted(set().union(*(r[g] for r in every))) for g in range(len(mine))]


def _dcp_job(model, optimizer, state, ranks: Ranks, token: str, target: str, tmp: str, layout, extra: Any,
             members: List[List[int]], async_save: bool) -> "asynchronous.Job":
    from ..dcp import save as dcp_save

    items = dcp_save.contents(model, optimizer, state, ranks.rank, ranks.mesh_size, layout, extra, members)
    if async_save:
        items = items.staged(_staged(state, [t.data for t in items.tensors]))

    def write():
        publish.make_staging(tmp, token, ranks.rank)
        return dcp_save.write_rank_file(tmp, ranks.rank, items)

    def publish_all(reports):
        try:
            meta, sidecar = dcp_save.index_files(reports, token, target)
            files.write_file(os.path.join(tmp, dcp_save.SIDECAR), sidecar)
        except Exception as e:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            return e, f"Nothing was published: {tmp} was removed and the previous checkpoint, if any, is untouched"
        return publish.publish(target, tmp, token, meta, index_file=dcp_save.METADATA)

    return asynchronous.Job(ranks.rank, write, publish_all, lambda: shutil.rmtree(tmp, ignore_errors=True),
                            f"zero_ext.save: writing {target}",
                            f"The unfinished {tmp} was removed and the previous checkpoint, if any, is untouched")
