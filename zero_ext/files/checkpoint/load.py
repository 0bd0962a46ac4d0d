"""zero_ext.load: a checkpoint written at any world size and stage, into a
wrapped model and optimizer, verified before anything is copied.

Phases, each ended on every rank by Ranks.settle: (A) ranks agree on the
path; each opens and validates the checkpoint (metadata.py, reader.py),
checks it against the model (strictly by default) and the optimizer (the
class it was saved from) and reads the small files; ranks agree that they
opened the same save (its token). (B) every
range this rank loads is read into host memory, each byte checked against
its checksum; nothing in the model or optimizer has changed yet, so a
damaged file anywhere leaves every rank as it was. (C) the verified values
are copied into the model and optimizer. Then the collective refresh of
parameters. The cost of (B) is one host copy of this rank's shard of the
model and optimizer state while the load runs.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Set

import torch

from .. import plan
from ...optim import as_one, offload_in_memory, qualified_class_names
from ...tools import require_bool, require_module, require_optimizer, state_of, state_or_none
from ...groups import Ranks, refuse_different_paths
from .. import asynchronous
from ..dcp.reader import is_dcp
from .publish import resolve

# What load does when the checkpoint's optimizer class is not the optimizer's.
CLASS_MISMATCH = ("error", "fresh", "load")
from .format import dtype_of
from .metadata import CheckpointMeta, PieceKind, Scalar
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


def check_same_names(where: str, saved: Dict[str, tuple], model: torch.nn.Module, strict: bool) -> None:
    """Like nn.Module.load_state_dict: names (parameters and persistent
    buffers) must match unless not strict; shapes always (a saved (1,)
    never broadcasts into a (4,)). Both formats' loads ask this."""
    saved = {n: tuple(s) for n, s in saved.items()}
    state = state_of(model)
    mine = {n: plan.full_shape(state, p) for n, p in model.named_parameters()}
    mine.update({n: tuple(b.shape) for n, b in plan.persistent_buffers(model).items()})
    missing = sorted(set(mine) - set(saved)) if strict else []
    unexpected = sorted(set(saved) - set(mine)) if strict else []
    shapes = sorted(n for n in set(mine) & set(saved) if mine[n] != saved[n])
    if not (missing or unexpected or shapes):
        return
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {missing[:8]}")
    if unexpected:
        problems.append(f"unexpected in it: {unexpected[:8]}")
    if shapes:
        problems.append("shapes differ: " + ", ".join(f"{n} saved {saved[n]} vs model {mine[n]}" for n in shapes[:8]))
    fix = ("; pass strict=False to load only the entries both have (shapes must still match)"
           if missing or unexpected else "; build the model with the shapes it was saved with")
    raise RuntimeError(f"zero_ext.load: {where} was saved from a different model: {'; '.join(problems)}{fix}")


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


def install(model, optimizer, groups: List[Optional[dict]], opt_state: Dict[torch.Tensor, dict],
            buffers: Dict[str, torch.Tensor], restored) -> None:
    """Phase C of either format's load: the saved hyperparameters into each
    param group (None: keep its own), the optimizer state (the old state
    goes before the new reaches the device; "fresh": none comes), buffers."""
    for mine, theirs in zip(optimizer.param_groups, groups):
        if theirs is not None:
            mine.update({k: v for k, v in theirs.items() if k != "params"})
    optimizer.state.clear()
    for tensor, st in opt_state.items():
        optimizer.state[tensor] = {k: restored(v, tensor) for k, v in st.items()}
    for n, buf in plan.persistent_buffers(model).items():
        if n in buffers:
            buf.copy_(buffers[n])


def refresh(state) -> None:
    """After a load (collective: every rank got here): no stale gradients,
    the parameters rebuilt from the loaded shards."""
    state.handles.reduction.zero_grad(True)
    state.handles.checkpoint.refresh_params_from_shards()


CALL = "zero_ext.load(path, model, optimizer)"


def check_options(strict: Any, optimizer_class_mismatch: Any, format: Any) -> None:
    """load's options as they are passed, refused (its first phase, so on
    every rank) unless each means what it says."""
    if format is not None:
        raise TypeError(
            f"zero_ext.load takes no format (got format={format!r}): it detects the format itself, zero_ext's own "
            "or a DCP directory (whoever wrote it), and reads either; drop format=... from the call. Nothing was "
            "loaded")
    require_bool(strict, "zero_ext.load", "strict",
                 "pass strict=True (the default: the checkpoint and the model must hold the same names) or "
                 "strict=False (load the entries both have). Nothing was loaded")
    if not isinstance(optimizer_class_mismatch, str) or optimizer_class_mismatch not in CLASS_MISMATCH:
        raise ValueError(f"zero_ext.load: optimizer_class_mismatch must be one of {list(CLASS_MISMATCH)}, not "
                         f"{optimizer_class_mismatch!r}")


@torch.no_grad()
def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, strict: bool = True,
         optimizer_class_mismatch: str = "error", format: None = None) -> Any:
    """Loads a checkpoint written by zero_ext.save at any world size and
    stage into a wrapped model and optimizer; returns this rank's `extra`
    (rank 0's for a rank the writer did not have). Strict like
    nn.Module.load_state_dict: with strict=False, parameters and buffers
    missing on either side are skipped (shapes must still match). A
    checkpoint saved from another optimizer class raises, unless
    optimizer_class_mismatch is "fresh" (load the model; the optimizer
    starts fresh) or "load" (its state and hyperparameters are loaded
    anyway). Every byte is checked against the checksum zero_ext.save wrote
    before any is copied. Reads nothing outside the checkpoint and unpickles
    only with weights_only=True. Collective.

    load takes no `format`: it reads zero_ext's own checkpoints and DCP
    directories alike, whichever `path` holds (format=... is refused, as
    strict and optimizer_class_mismatch of another kind are, on every
    rank before anything is read)."""
    require_module(model, "zero_ext.load", CALL)
    asynchronous.wait_for_previous(state_of(model))  # a save in flight finishes first (its error raised here)
    # offload_*="nvme": the values, gradients and optimizer state this rank
    # holds in its offload files are in memory for the checkpoint's duration.
    with offload_in_memory([state_or_none(model)], values_changed=True):
        return _load(path, model, optimizer, strict=strict, optimizer_class_mismatch=optimizer_class_mismatch,
                     format=format)


def _load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, strict: bool = True,
         optimizer_class_mismatch: str = "error", format: None = None) -> Any:
    """load() with the offloaded state in memory."""
    state = state_of(model)
    original, optimizer = optimizer, as_one(optimizer)  # a list or tuple of the model's optimizers: one view
    ranks = Ranks(state, "zero_ext.load")
    error, target = None, None
    try:
        check_options(strict, optimizer_class_mismatch, format)
        require_optimizer(original, "zero_ext.load", CALL)
        target = os.path.abspath(os.fspath(path))
    except Exception as e:  # noqa: BLE001 - a bad path or option on one rank raises on every rank
        error = e
    # The options travel only once checked here (a refused one may not even pickle).
    asked = ranks.settle(error, None if error is not None else (target, optimizer_class_mismatch))
    refuse_different_paths([p for p, _ in asked], "zero_ext.load", "a load reads one checkpoint", "Nothing was loaded")
    if any(m != asked[0][1] for _, m in asked):
        listed = ", ".join(f"rank {r}: {m!r}" for r, (_, m) in enumerate(asked))
        raise ValueError(f"zero_ext.load: ranks passed different optimizer_class_mismatch ({listed}); pass the same "
                         "on every rank. Nothing was loaded")
    error, dcp_dir = None, None
    try:
        where = resolve(target, "zero_ext.load")
        dcp_dir = where if is_dcp(where) else None
    except Exception as e:  # noqa: BLE001 - a missing checkpoint raises on every rank
        error = e
    kinds = ranks.settle(error, dcp_dir is not None)
    if any(k != kinds[0] for k in kinds):
        raise RuntimeError(f"zero_ext.load: ranks see different checkpoints at {path} (one a DCP directory): it "
                           "was replaced during this load. Nothing was loaded; load again")
    if dcp_dir is not None:
        from ..dcp.load import load_dcp
        return load_dcp(dcp_dir, model, optimizer, state, ranks, strict, optimizer_class_mismatch,
                        check_same_names)
    checkpoint = None
    try:
        # Phase A: open and validate; nothing in the model changes yet.
        error, token = None, None
        try:
            if state_or_none(optimizer) is not state:
                raise ValueError("zero_ext.load: this optimizer was not wrapped together with this model")
            checkpoint = Checkpoint(target, "zero_ext.load")
            token, meta, where = checkpoint.token, checkpoint.meta, checkpoint.where
            reader = PieceReader(checkpoint)
            loaded = {p.name for p in meta.params}
            with_optimizer = _loads_optimizer(where, meta, optimizer, optimizer_class_mismatch)
            # A reader rank the writer did not have gets rank 0's extra; one it had gets its own.
            extra_file = f"extra-rank{ranks.rank if ranks.rank < meta.world_size else 0}.pt"
            # Every file this rank reads is opened before any is read: a save
            # that replaces the path from now on cannot change what is read.
            for file in ["buffers.pt", "optimizer.pt", extra_file] + sorted(
                    _wanted_files(reader, state, model, optimizer, loaded, with_optimizer)):
                checkpoint.open(file)
            buffers = checkpoint.load_buffers()
            _check_same_model(where, meta, model, buffers, strict)
            plan.check_split_readable(state, model, {p.name: p.tensor_parallel for p in meta.params}, where)
            if with_optimizer:
                groups = _saved_groups(checkpoint, optimizer)
            else:  # "fresh": checked like every file, not used
                checkpoint.load_pt("optimizer.pt")
            extra = checkpoint.load_pt(extra_file)
        except Exception as e:  # noqa: BLE001 - raised on every rank by settle
            error = e
        tokens = ranks.settle(error, token)
        if any(t != tokens[0] for t in tokens):
            raise RuntimeError(f"zero_ext.load: ranks opened different saves at {path}: it was replaced during "
                               "this load. Nothing was loaded; load again")

        # Phase B: read and verify this rank's ranges; the model is untouched.
        error, values, opt_state = None, [], {}
        try:
            scratch = torch.empty(meta.chunk_bytes, dtype=torch.uint8, device="cpu")  # never the default device
            values = _read_values(reader, scratch, state, model, loaded)
            if with_optimizer:
                opt_state = _read_optimizer(where, reader, scratch, state, optimizer, loaded)
        except Exception as e:  # noqa: BLE001
            error = e
        ranks.settle(error, action=f"zero_ext.load: reading {where}",
                     note="Nothing was loaded: the model and optimizer are as they were")

        # Phase C: copy in.
        error = None
        try:
            for view, value in values:
                view.copy_(_value(value))
            del values
            install(model, optimizer, groups if with_optimizer else [], opt_state, buffers, _restored)
        except Exception as e:  # noqa: BLE001
            error = e
        ranks.settle(error, action=f"zero_ext.load: copying {where} into the model",
                     note="The model and optimizer are partly loaded; load a good checkpoint before training")
    finally:
        if checkpoint is not None:
            checkpoint.close()
    refresh(state)
    scaler = meta.loss_scaler
    state.handles.checkpoint.restore_loss_scaler(float(scaler.scale), scaler.clean_steps, scaler.skipped_steps)
    return extra
