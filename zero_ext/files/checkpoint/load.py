"""zero_ext.load of zero_ext's own format: a checkpoint written at any world
size and stage, into a wrapped model and optimizer, verified before
anything is copied. (The entry, files/entry.py, checked the options, had
the ranks agree on the path and found this format there.)

Phases, each ended on every rank by Ranks.settle: (A) each rank opens and
validates the checkpoint (metadata.py, reader.py), checks it against the
model (strictly by default) and the optimizer (the class it was saved
from) and reads the small files; ranks agree that they opened the same save
(its token). (B) every range this rank loads is read into host memory,
each byte checked against its checksum; nothing in the model or optimizer
has changed yet, so a damaged file anywhere leaves every rank as it was.
(C) the verified values are copied into the model and optimizer. Then the
collective refresh of parameters (load_phases.py, as for DCP). The cost of
(B) is one host copy of this rank's shard of the model and optimizer state
while the load runs.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import torch

from .. import plan
from ..load_phases import check_same_names, install, refresh
from ...optim import qualified_class_names
from ...tools import state_or_none
from .format import dtype_of
from .metadata import CheckpointMeta
from .pieces import PieceKind, Scalar
from .reader import Checkpoint, PieceReader


def _unscalar(spec: Scalar) -> Any:
    if spec.tensor:
        return torch.tensor(spec.value, dtype=dtype_of(spec.dtype), device="cpu")
    return spec.value


def _check_same_model(where: str, meta: CheckpointMeta, model: torch.nn.Module, buffers: Dict[str, Any],
                      strict: bool) -> None:
    saved = {p.name: tuple(p.shape) for p in meta.params}
    saved.update({n: tuple(b.shape) for n, b in buffers.items()})
    check_same_names(where, saved, model, strict)


def _loads_optimizer(where: str, meta: CheckpointMeta, optimizer, mismatch: str) -> bool:
    """Whether the saved optimizer state and hyperparameters are loaded: yes
    when the checkpoint's optimizer classes are this optimizer's (or it
    predates recording them), else as `mismatch` says."""
    saved, mine = meta.optimizer_classes, qualified_class_names(optimizer)
    if saved is None or list(saved) == mine:
        return True
    if mismatch == "error":
        def named(classes) -> str:
            return classes[0] if len(classes) == 1 else "[" + ", ".join(classes) + "]"
        raise RuntimeError(
            f"zero_ext.load: {where} holds the state of optimizer {named(saved)}, but this optimizer is "
            f"{named(mine)}: its per-parameter state and hyperparameters belong to another update rule. Pass "
            "optimizer_class_mismatch=\"fresh\" to load the model and start this optimizer fresh (no state, "
            "your param groups), or optimizer_class_mismatch=\"load\" to load the saved state and "
            "hyperparameters anyway (as torch's load_state_dict would). Nothing was loaded")
    return mismatch == "load"


def _saved_groups(checkpoint: Checkpoint, optimizer) -> List[dict]:
    saved = checkpoint.load_pt("optimizer.pt")
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and all(isinstance(k, str) for k in g)
                                               for g in groups):
        raise ValueError(f"zero_ext.load: {checkpoint.path('optimizer.pt')} holds no list of param groups; "
                         "restore the checkpoint from a good copy")
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeError(
            f"zero_ext.load: {checkpoint.where} has {len(groups)} optimizer param groups, this optimizer "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups")
    return groups


def _wanted_files(reader: PieceReader, state, model, optimizer, loaded: Set[str], with_optimizer: bool) -> Set[str]:
    """The shard files holding any range this rank will read."""
    wanted = plan.wanted_ranges(state, model, optimizer)
    out = set()
    for (kind, name, key), pieces in reader.pieces.items():
        if kind is PieceKind.SCALARS or name not in loaded or (kind is not PieceKind.PARAM and not with_optimizer):
            continue
        for start, length in wanted.get(name, []):
            out.update(reader.files_for(kind, name, 0 if kind is PieceKind.WHOLE else start,
                                        pieces[0].length if kind is PieceKind.WHOLE else length, key))
    return out


class _Later:
    """A range verified in phase B and read (verified again) in phase C:
    data every rank holds whole, which staged would cost a whole model of
    host memory per rank."""

    def __init__(self, reader: PieceReader, scratch: torch.Tensor, kind: PieceKind, name: str, start: int, length: int,
                 key: str = "", dtype=None):
        reader.verify(kind, name, start, length, key, buffer=scratch)
        self.read = lambda: reader.read(kind, name, start, length, key, dtype=dtype)


def _fetch(stage: bool, reader: PieceReader, scratch: torch.Tensor, kind: PieceKind, name: str, start: int, length: int,
           key: str = "", dtype=None):
    """The verified range now (stage) or a _Later."""
    if stage:
        return reader.read(kind, name, start, length, key, dtype=dtype)
    return _Later(reader, scratch, kind, name, start, length, key, dtype)


def _value(v):
    return v.read() if isinstance(v, _Later) else v


def _read_values(reader: PieceReader, scratch: torch.Tensor, state, model, loaded: Set[str]) -> List[tuple]:
    """(destination, verified value or _Later) of every parameter range this
    rank holds: shards staged, whole parameters later."""
    out = []
    names = state.bucketed_names
    shift = [plan.stored_offset(state, p, writing=False) for p in state.bucketed]
    for i, start, view in plan.local_views(state):
        if names[i] in loaded:
            out.append((view, _fetch(state.sharded_optimizer, reader, scratch, PieceKind.PARAM, names[i],
                                     shift[i] + start, view.numel(), dtype=view.dtype)))
    bucketed = {id(p) for p in state.bucketed}
    for n, p in model.named_parameters():
        if id(p) not in bucketed and n in loaded:
            out.append((p.detach().view(-1), _fetch(False, reader, scratch, PieceKind.PARAM, n,
                                                    plan.stored_offset(state, p, writing=False), p.numel(),
                                                    dtype=p.dtype)))
    return out


def _read_optimizer(where: str, reader: PieceReader, scratch: torch.Tensor, state, optimizer,
                    loaded: Set[str]) -> Dict[torch.Tensor, dict]:
    """The optimizer state this rank steps, verified: its shards on the
    host, or (stage 0: every rank's whole state) _Later."""
    stage = state.grads_sharded
    out = {}
    names = state.bucketed_names
    for tensor, i, start in plan.optimizer_pieces(state, optimizer):
        name, length = names[i], tensor.numel()
        if name not in loaded:
            continue  # strict=False: a parameter the checkpoint lacks starts fresh
        start += plan.stored_offset(state, state.bucketed[i], writing=False)  # tensor parallel: this rank's part
        scalars = reader.scalars(name, start, length)
        keys = reader.keys(PieceKind.STATE, name)
        if not scalars and not keys and not reader.keys(PieceKind.WHOLE, name):
            continue  # never stepped (or zero-size: nothing to restore)
        st = {key: _unscalar(spec) for key, spec in scalars.items()}
        for key in keys:
            st[key] = _fetch(stage, reader, scratch, PieceKind.STATE, name, start, length, key=key)
        for key in reader.keys(PieceKind.WHOLE, name):
            if stage and not state.whole_params:
                raise RuntimeError(
                    f"zero_ext.load: optimizer state '{key}' of '{name}' in {where} is not "
                    "elementwise and cannot be sharded; load it at stage 0")
            piece = reader.pieces[(PieceKind.WHOLE, name, key)][0]
            st[key] = (_fetch(False, reader, scratch, PieceKind.WHOLE, name, 0, piece.length, key), piece.shape)
        out[tensor] = st
    return out


def _restored(value: Any, tensor: torch.Tensor) -> Any:
    """One optimizer state entry as the optimizer keeps it: elementwise state
    shaped and placed like its parameter tensor, whole state in its shape."""
    if isinstance(value, tuple):  # whole state: (value, shape)
        return _value(value[0]).view(value[1]).to(tensor.device)
    value = _value(value)
    if isinstance(value, torch.Tensor) and value.dim():
        return value.view(tensor.shape).to(tensor.device)
    return value  # a scalar (0-d tensors stay on the host, as before)


class _Opened:
    """What phase A opened and found; the checkpoint is closed after (C)."""

    def __init__(self):
        self.checkpoint: Optional[Checkpoint] = None
        self.reader: Optional[PieceReader] = None
        self.meta: Optional[CheckpointMeta] = None
        self.where = ""
        self.loaded: Set[str] = set()  # the parameters the checkpoint holds
        self.with_optimizer = False
        self.buffers: Dict[str, torch.Tensor] = {}
        self.groups: List[dict] = []
        self.extra: Any = None

    def close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.close()


@torch.no_grad()
def load_checkpoint(target: str, path: str, model: torch.nn.Module, optimizer, state, ranks, strict: bool,
                    mismatch: str) -> Any:
    """zero_ext.load's phases over zero_ext's own checkpoint at `target`
    (`path` as the caller passed it, for errors). Returns this rank's
    `extra` (rank 0's for a rank the writer did not have)."""
    opened = _Opened()
    try:
        _open(opened, target, path, model, optimizer, state, ranks, strict, mismatch)
        values, opt_state = _read(opened, state, model, optimizer, ranks)
        _copy_in(opened, values, opt_state, model, optimizer, ranks)
    finally:
        opened.close()
    refresh(state)
    scaler = opened.meta.loss_scaler
    state.handles.checkpoint.restore_loss_scaler(float(scaler.scale), scaler.clean_steps, scaler.skipped_steps)
    return opened.extra


def _open(opened: _Opened, target: str, path: str, model, optimizer, state, ranks, strict: bool,
          mismatch: str) -> None:
    """Phase A: open and validate; nothing in the model changes yet. Every
    rank must open the same save."""
    error = None
    try:
        if state_or_none(optimizer) is not state:
            raise ValueError("zero_ext.load: this optimizer was not wrapped together with this model")
        opened.checkpoint = Checkpoint(target, "zero_ext.load")
        _check_and_read_small_files(opened, model, optimizer, state, ranks.rank, strict, mismatch)
    except Exception as e:  # noqa: BLE001 - raised on every rank by settle
        error = e
    tokens = ranks.settle(error, opened.checkpoint.token if opened.checkpoint is not None else None)
    if any(t != tokens[0] for t in tokens):
        raise RuntimeError(f"zero_ext.load: ranks opened different saves at {path}: it was replaced during "
                           "this load. Nothing was loaded; load again")


def _check_and_read_small_files(opened: _Opened, model, optimizer, state, rank: int, strict: bool,
                                mismatch: str) -> None:
    """Phase A's reading: what the checkpoint holds checked against the
    model and optimizer, every file this rank reads opened, the small ones read."""
    checkpoint = opened.checkpoint
    meta = opened.meta = checkpoint.meta
    where = opened.where = checkpoint.where
    opened.reader = PieceReader(checkpoint)
    opened.loaded = {p.name for p in meta.params}
    opened.with_optimizer = _loads_optimizer(where, meta, optimizer, mismatch)
    # A reader rank the writer did not have gets rank 0's extra; one it had gets its own.
    extra_file = f"extra-rank{rank if rank < meta.world_size else 0}.pt"
    # Every file this rank reads is opened before any is read: a save
    # that replaces the path from now on cannot change what is read.
    for file in ["buffers.pt", "optimizer.pt", extra_file] + sorted(
            _wanted_files(opened.reader, state, model, optimizer, opened.loaded, opened.with_optimizer)):
        checkpoint.open(file)
    opened.buffers = checkpoint.load_buffers()
    _check_same_model(where, meta, model, opened.buffers, strict)
    plan.check_split_readable(state, model, {p.name: p.tensor_parallel for p in meta.params}, where)
    if opened.with_optimizer:
        opened.groups = _saved_groups(checkpoint, optimizer)
    else:  # "fresh": checked like every file, not used
        checkpoint.load_pt("optimizer.pt")
    opened.extra = checkpoint.load_pt(extra_file)


def _read(opened: _Opened, state, model, optimizer, ranks) -> tuple:
    """Phase B: read and verify this rank's ranges; the model is untouched.
    Returns (parameter values, optimizer state)."""
    error, values, opt_state = None, [], {}
    try:
        scratch = torch.empty(opened.meta.chunk_bytes, dtype=torch.uint8, device="cpu")  # never the default device
        values = _read_values(opened.reader, scratch, state, model, opened.loaded)
        if opened.with_optimizer:
            opt_state = _read_optimizer(opened.where, opened.reader, scratch, state, optimizer, opened.loaded)
    except Exception as e:  # noqa: BLE001
        error = e
    ranks.settle(error, action=f"zero_ext.load: reading {opened.where}",
                 note="Nothing was loaded: the model and optimizer are as they were")
    return values, opt_state


def _copy_in(opened: _Opened, values: List[tuple], opt_state: Dict[torch.Tensor, dict], model, optimizer,
             ranks) -> None:
    """Phase C: the verified values into the model and optimizer."""
    error = None
    try:
        for view, value in values:
            view.copy_(_value(value))
        values.clear()
        install(model, optimizer, opened.groups, opt_state, opened.buffers, _restored)
    except Exception as e:  # noqa: BLE001
        error = e
    ranks.settle(error, action=f"zero_ext.load: copying {opened.where} into the model",
                 note="The model and optimizer are partly loaded; load a good checkpoint before training")
