"""zero_ext.save of zero_ext's own format: a sharded checkpoint, each byte
checksummed as it is written. (The entry, files/entry.py, checks the
options, has the ranks agree and publishes; this module says what each rank
writes and what rank 0 publishes.)

Phases, each ended on every rank by Ranks.settle (a failure anywhere raises
everywhere at once): (0) inputs: `extra` must be something
torch.load(weights_only=True) reads back (extra_file, optimizer_file);
nothing is written before all ranks agree. (1) every rank writes its files
into the staging directory (save_parts' write). (2) rank 0 checks every
rank's files are there with their sizes and builds metadata.json (save_parts'
index), which publishing writes last: it makes a directory a checkpoint. A
failure removes the staging directory; a crash at any point leaves either
the previous or the new checkpoint complete.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import asynchronous, plan
from ..bytes_io import write_file
from ..checksum import digest
from ..step_counts import count_problem
from ..weights_only import checked
from ...optim import class_name, qualified_class_names
from . import format as files
from .metadata import CHUNK_BYTES, CheckpointMeta, FileMeta, LossScaler, ParamMeta, file_names
from .pieces import (ParamPiece, Piece, Scalar, ScalarsPiece, StatePiece, WholeStatePiece, describe_scalar,
                     scalars_disagreement)


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


def _rank_ops(model, optimizer, state, ranks) -> list:
    """What this rank writes, in order: ("put", name, start, tensor, key,
    shape) for a range of a parameter's values (no key), of its elementwise
    state (key) or a whole state that is not elementwise (key, shape), and
    ScalarsPieces. Tensors are views of the live state (staged copies for
    an asynchronous save)."""
    rank = ranks.stage_rank  # what it writes is decided within its model (a pipeline stage's own ranks)
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


def _write_rank_files(tmp: str, ops: list, ranks, token: str,
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
        write_file(os.path.join(tmp, file), blob)
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


def _param_metas(model, optimizer, state, pieces: List[Piece], at_call: "_AtCall") -> List[ParamMeta]:
    """Each parameter of this model as the metadata lists it (the dtype of
    its pieces: this rank's, else what a piece of it would be)."""
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
        params.append(ParamMeta(n, tuple(aliases[id(p)]), plan.full_shape(state, p), dtypes[n],
                                at_call.requires_grad[n], group_of.get(i) if i is not None else None,
                                plan.tensor_parallel_split(state, p)))
    return params


def _metadata(model, optimizer, state, token: str, pieces: List[Piece], sizes: Dict[str, FileMeta],
              world: int, at_call: "_AtCall", stages: Optional[List["_Stage"]] = None) -> CheckpointMeta:
    """rank 0: the metadata; a pipeline's (`stages`, by pp rank) lists every stage's parameters."""
    if stages is None:
        params = _param_metas(model, optimizer, state, pieces, at_call)
    else:
        params = [param for stage in stages for param in stage.params]
    scale, clean, skipped = at_call.loss_scaler
    return CheckpointMeta(
        token=token, world_size=world, stage=state.stage,
        compute_dtype=None if state.compute_dtype is None else files.dtype_name(state.compute_dtype),
        offload=state.offload, loss_scaler=LossScaler(scale, int(clean), int(skipped)),
        chunk_bytes=CHUNK_BYTES, params=tuple(params), files=sizes,
        pieces=tuple(dataclasses.replace(p, index=k) for k, p in enumerate(pieces)),
        optimizer_classes=tuple(qualified_class_names(optimizer)))


@dataclasses.dataclass(frozen=True)
class _AtCall:
    """What the metadata holds that training changes, read at the save's
    call (rank 0 builds the metadata at publishing, which an asynchronous
    save reaches steps later): the loss scaler, which parameters train."""
    loss_scaler: Tuple[float, int, int]
    requires_grad: Dict[str, bool]

    @staticmethod
    def read(model, state) -> "_AtCall":
        return _AtCall(tuple(state.handles.checkpoint.loss_scaler_state()),
                       {n: p.requires_grad for n, p in model.named_parameters()})


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


def extra_file(token: str, rank: int, extra: Any) -> Dict[str, bytes]:
    """Phase 0, every rank: its extra-rank<r>.pt, once it reads back."""
    return {f"extra-rank{rank}.pt": checked(extra, "extra", lambda v: files.packed(token, rank, v))}


def optimizer_file(token: str, optimizer) -> Dict[str, bytes]:
    """Phase 0, rank 0: optimizer.pt (the class and the param groups'
    hyperparameters), once it reads back."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    value = {"class": class_name(optimizer), "param_groups": groups}
    return {"optimizer.pt": checked(value, "optimizer", lambda v: files.packed(token, 0, v))}


@dataclasses.dataclass
class _Stage:
    """What a pipeline stage's first rank tells rank 0 for the metadata:
    its parameters, its persistent buffers, its optimizer's groups."""
    params: List[ParamMeta]
    buffers: Dict[str, torch.Tensor]
    groups: str  # the param groups' hyperparameters and the classes, as text to compare
    names: List[str]


def _stages(model, optimizer, state, ranks, at_call: "_AtCall", buffers: Dict[str, torch.Tensor]) -> List[_Stage]:
    """A pipeline (`ranks` across pp): every stage's _Stage, by pp rank,
    gathered on every rank (collective whether or not this rank's failed:
    then every rank raises). The stages' optimizers must have the same
    param groups: optimizer.pt holds one list of them for the whole model."""
    mine, error = None, None
    try:
        if ranks.stage_rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            mine = _Stage(_param_metas(model, optimizer, state, [], at_call), buffers,
                          repr((qualified_class_names(optimizer), groups)), [n for n, _ in model.named_parameters()])
    except Exception as e:  # noqa: BLE001 - raised below, after the others heard
        error = e
    every = ranks.gather((None if error is None else f"{type(error).__name__}: {error}", mine))
    if error is not None:
        raise error
    failed = [(r, text) for r, (text, _) in enumerate(every) if text is not None]
    if failed:
        raise RuntimeError(f"zero_ext.save: rank {failed[0][0]} failed to describe its pipeline stage: "
                           f"{failed[0][1]}. Nothing was written")
    stages = [stage for _, stage in every if stage is not None]
    if any(stage.groups != stages[0].groups for stage in stages):
        raise ValueError(
            "zero_ext.save: the pipeline stages' optimizers differ in their class or param groups (their number or "
            "a group's hyperparameters), and zero_ext's checkpoint keeps one list of param groups for the whole "
            "model: give every stage the same optimizer with the same groups, or save with format=\"dcp\" and "
            "dcp_layout=\"torchtitan\" (hyperparameters per parameter). Nothing was written")
    return stages


def save_parts(model, optimizer, state, ranks, token: str, target: str, tmp: str, blobs: Dict[str, bytes],
               async_save: bool):
    """(write, index, take) of a save into the staging directory `tmp`:
    write() writes this rank's files and returns its report; index(every
    rank's reports), on rank 0, checks them and returns metadata.json's
    document, which publishing writes last. What is written is the state
    now: read now, or for an asynchronous save a snapshot whose large
    tensors take() copies in the writer thread before write() ([Note: the
    snapshot of an asynchronous save]; None for a save at once)."""
    ops = _rank_ops(model, optimizer, state, ranks)
    at_call = _AtCall.read(model, state)
    stages = None
    if ranks.stage_rank == 0:  # buffers are tensors: always weights_only-safe (serialized now: a forward changes them)
        values = {k: v.detach().cpu().clone() for k, v in plan.persistent_buffers(model).items()}
    if getattr(ranks, "pp", None) is not None:  # every stage's parameters, buffers and groups, to rank 0
        stages = _stages(model, optimizer, state, ranks, at_call, values if ranks.stage_rank == 0 else {})
        values = {k: v for stage in reversed(stages) for k, v in stage.buffers.items()}  # pp rank 0's first
    if ranks.rank == 0:
        blobs["buffers.pt"] = files.packed(token, 0, values)
    snapshot = None
    if async_save:  # parameter shards, masters and optimizer state: all deferred
        snapshot = asynchronous.stager_of(state).snapshot(
            [(op[3], f"'{op[1]}'" + (f" (its optimizer state {op[4]!r})" if op[4] else ""), True)
             for op in ops if isinstance(op, tuple)],
            asynchronous.watched_parameters(model, state), asynchronous.may_defer(state))

    def write():
        staged = ops if snapshot is None else [
            op if not isinstance(op, tuple) else op[:3] + (snapshot.copy(op[3]),) + op[4:] for op in ops]
        return _write_rank_files(tmp, staged, ranks, token, blobs)

    def index(gathered) -> dict:
        sizes = _check_written(tmp, ranks.world, gathered)
        _check_scalars_agree(gathered)
        meta = _metadata(model, optimizer, state, token, [p for ps, _ in gathered for p in ps], sizes, ranks.world,
                         at_call, stages)
        document = meta.to_json()
        _reads_back(document, target)
        return document

    return write, index, (snapshot.take if snapshot is not None and snapshot.deferred else None)
