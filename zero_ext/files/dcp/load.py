"""zero_ext.load of a DCP directory, whoever wrote it (FSDP2, DDP,
torchtitan, zero_ext), at any world size, stage and tensor-parallel layout.

The phases are those of zero_ext's own format (checkpoint/load.py; the steps
both take are load_phases.py), ended on every rank by Ranks.settle:
(A) open and check: the layout (layout.recognise), the model's names and
shapes (strictly by default, the same error as zero_ext's own format), the
param groups; (B) every range this rank holds, of each parameter and of its
optimizer state, read into host memory: each range is boxes of the full
tensor (boxes.py), each box filled from the stored chunks it meets, which
must cover it; (C) copied in, then the parameters refreshed from their
shards. A failure before (C) leaves the model and optimizer as they were.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import plan
from ..load_phases import check_same_names, install, refresh
from ..step_counts import count_problem
from .boxes import boxes_of_range, flat_index, intersect, narrow, shifted, volume
from .index import BytesEntry, TensorEntry
from .layout import Layout, recognise, unflatten
from .param_groups import group_members
from .reader import DcpCheckpoint

_TRAINER_ENTRIES = ("optimizer", "optim", "lr_scheduler", "dataloader", "train_state", "extra")


def _place(state, p: torch.Tensor) -> Tuple[Optional[int], int]:
    return plan.split_offset(state, p)


class _Filler:
    """Fills ranges of local tensors from the chunks of one checkpoint."""

    def __init__(self, checkpoint: DcpCheckpoint):
        self.checkpoint = checkpoint

    def fill(self, key: str, p: torch.Tensor, place, lo: int, hi: int, out: torch.Tensor) -> None:
        """out (flat, elements [lo, hi) of p's local tensor) from entry `key`."""
        entry = self.checkpoint.index.entries[key]
        where = self.checkpoint.where
        full = tuple(entry.shape)
        cache: Dict[Tuple[int, ...], torch.Tensor] = {}
        for box in boxes_of_range(tuple(p.shape), lo, hi):
            at = flat_index(tuple(p.shape), box[0]) - lo
            dest = out[at:at + volume(box[1])].view(box[1])
            want = shifted(box, *place)
            covered = 0
            for chunk in entry.chunks:
                part = intersect(want, chunk.box) if full else want
                if part is None:
                    continue
                src = cache.get(chunk.box[0])
                if src is None:
                    src = cache[chunk.box[0]] = self.checkpoint.chunk(key, chunk.box, chunk.stored, entry.dtype)
                narrow(dest, want, part).copy_(narrow(src, chunk.box, part))
                covered += volume(part[1])
            if covered != volume(box[1]):
                raise ValueError(f"zero_ext.load: {where} holds {covered} of the {volume(box[1])} elements of "
                                 f"'{key}' at {list(want[0])} (size {list(want[1])}) that this rank loads: its "
                                 "chunks do not cover the tensor. Restore the checkpoint from a good copy")


def _model_entries(checkpoint: DcpCheckpoint, layout: Layout) -> Dict[str, str]:
    """{model entry name: key} of the checkpoint's tensors."""
    index = checkpoint.index
    out = {}
    for key, entry in index.entries.items():
        if not isinstance(entry, TensorEntry):
            continue
        if layout.model:
            if key.startswith(layout.model):
                out[key[len(layout.model):]] = key
            continue
        path = index.paths.get(key) if index.paths else None
        if path is not None:
            if len(path) == 1:
                out[key] = key
        elif key.split(".", 1)[0] not in _TRAINER_ENTRIES:
            out[key] = key
    return out


def _split_name(rest: str, names) -> Optional[Tuple[str, str]]:
    """(parameter name, what follows) of 'name.key' for a known parameter name."""
    at = len(rest)
    while True:
        at = rest.rfind(".", 0, at)
        if at <= 0:
            return None
        if rest[:at] in names:
            return rest[:at], rest[at + 1:]


def _state_entries(checkpoint: DcpCheckpoint, layout: Layout, names) -> Dict[str, Dict[str, str]]:
    prefix = layout.optimizer + "state."
    out: Dict[str, Dict[str, str]] = {}
    for key in checkpoint.index.entries:
        if key.startswith(prefix):
            found = _split_name(key[len(prefix):], names)
            if found is not None:
                out.setdefault(found[0], {})[found[1]] = key
    return out


def _saved_hyper(checkpoint: DcpCheckpoint, layout: Layout, names) -> Dict[str, Dict[str, Any]]:
    """Each parameter's saved hyperparameters, from either form of param
    groups: per group with its 'params' list, or per parameter (flattened)."""
    prefix = layout.optimizer + "param_groups."
    keys = [k for k in checkpoint.index.entries if k.startswith(prefix)]
    groups: Dict[str, Dict[str, Any]] = {}
    by_param: Dict[str, Dict[str, Any]] = {}
    for key in keys:
        rest = key[len(prefix):]
        head, _, hyper = rest.partition(".")
        if head.isdigit() and f"{prefix}{head}.params" in checkpoint.index.entries:
            groups.setdefault(head, {})[hyper] = checkpoint.value(key)
            continue
        found = _split_name(rest, names)
        if found is not None:
            by_param.setdefault(found[0], {})[found[1]] = checkpoint.value(key)
    for g, hyper in groups.items():
        members = hyper.pop("params", None)
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            raise ValueError(f"zero_ext.load: {checkpoint.where}: param group {g}'s 'params' is not a list of "
                             "parameter names. Restore the checkpoint from a good copy")
        for m in members:
            by_param[m] = hyper
    return by_param


def _scalar(where: str, key: str, name: str, value: Any) -> Any:
    plain = value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value
    if isinstance(plain, bool) or not isinstance(plain, (int, float)):
        raise ValueError(f"zero_ext.load: optimizer state {key!r} of '{name}' in {where} is a "
                         f"{type(value).__name__}, not a number or a tensor. Restore the checkpoint from a good copy")
    problem = count_problem(key, plain)
    if problem:
        raise ValueError(f"zero_ext.load: optimizer state {key!r} of '{name}' in {where} {problem}. Restore the "
                         "checkpoint from a good copy")
    return value


class Plan:
    """Phase A's findings: what this rank reads, and from where."""

    def __init__(self, checkpoint: DcpCheckpoint, state, model, strict: bool, with_optimizer: bool,
                 rank: int, group_members: List[List[int]]):
        where = checkpoint.where
        self.checkpoint = checkpoint
        names = [n for n, _ in model.named_parameters()]
        self.layout = recognise(checkpoint.index.entries, names, where)
        self.model_keys = _model_entries(checkpoint, self.layout)
        saved = {n: checkpoint.index.entries[k].shape for n, k in self.model_keys.items()}
        check_same_names(where, saved, model, strict)
        name_set = set(names)
        self.state_keys = _state_entries(checkpoint, self.layout, name_set)
        self.with_optimizer = with_optimizer
        if with_optimizer and not self.state_keys and not any(
                k.startswith(self.layout.optimizer) for k in checkpoint.index.entries):
            raise RuntimeError(
                f"zero_ext.load: {where} holds no optimizer state (a model-only checkpoint); pass "
                "optimizer_class_mismatch=\"fresh\" to load the model and start this optimizer fresh. Nothing "
                "was loaded")
        self.hyper = _saved_hyper(checkpoint, self.layout, name_set) if with_optimizer else {}
        self.groups = self._groups(state, group_members) if with_optimizer else []
        self.extra = self._extra(rank)

    def _groups(self, state, members_by_group: List[List[int]]) -> List[Optional[Dict[str, Any]]]:
        names = state.bucketed_names
        out = []
        for members in members_by_group:
            saved = [self.hyper.get(names[i]) for i in members]
            if not saved or saved[0] is None:
                out.append(None)
                continue
            if any(s != saved[0] for s in saved):
                raise RuntimeError(
                    f"zero_ext.load: {self.checkpoint.where} puts the parameters of one of this optimizer's param "
                    "groups in groups with different hyperparameters; build the optimizer with the groups it was "
                    "saved with")
            out.append(saved[0])
        return out

    def _extra(self, rank: int) -> Any:
        checkpoint, entries = self.checkpoint, self.checkpoint.index.entries
        if self.layout.name != "torchtitan":
            for key in (f"extra.rank{rank}", "extra.rank0"):
                if key in entries:
                    return checkpoint.value(key)
            return None
        model = set(self.model_keys.values())
        rest = {k: checkpoint.value(k) for k in entries
                if k not in model and not k.startswith(self.layout.optimizer)}
        return unflatten(rest, checkpoint.index.paths) if rest else None


def read_values(p_plan: Plan, state, model) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(destination, verified host copy) of every parameter range this rank holds."""
    filler = _Filler(p_plan.checkpoint)
    names, out = state.bucketed_names, []
    for i, start, view in plan.local_views(state):
        key = p_plan.model_keys.get(names[i])
        if key is None:
            continue
        p = state.bucketed[i]
        host = torch.empty(view.numel(), dtype=view.dtype)
        filler.fill(key, p, _place(state, p), start, start + view.numel(), host)
        out.append((view, host))
    bucketed = {id(p) for p in state.bucketed}
    for n, p in model.named_parameters():
        key = p_plan.model_keys.get(n)
        if id(p) in bucketed or key is None:
            continue
        host = torch.empty(p.numel(), dtype=p.dtype)
        filler.fill(key, p, _place(state, p), 0, p.numel(), host)
        out.append((p.detach().view(-1), host))
    return out


def read_buffers(p_plan: Plan, model) -> Dict[str, torch.Tensor]:
    return {n: p_plan.checkpoint.whole(p_plan.model_keys[n]) for n in plan.persistent_buffers(model)
            if n in p_plan.model_keys}


def read_optimizer(p_plan: Plan, state, optimizer) -> Dict[torch.Tensor, Dict[str, Any]]:
    """The optimizer state this rank steps (elementwise state as flat host
    copies of its segment, whole state and scalars as they are)."""
    checkpoint, where = p_plan.checkpoint, p_plan.checkpoint.where
    filler = _Filler(checkpoint)
    names, out = state.bucketed_names, {}
    for tensor, i, start in plan.optimizer_pieces(state, optimizer):
        name, p = names[i], state.bucketed[i]
        keys = p_plan.state_keys.get(name)
        if not keys:
            continue  # never stepped, or not in the checkpoint: starts fresh
        st: Dict[str, Any] = {}
        full = plan.full_shape(state, p)
        for k, key in keys.items():
            entry = checkpoint.index.entries[key]
            # Elementwise state has the parameter's shape: for a 0-d parameter
            # that is a scalar's shape too, told apart by the key (step counts).
            elementwise = isinstance(entry, TensorEntry) and tuple(entry.shape) == tuple(full) and not (
                full == () and count_problem(k, -1) is not None)
            if isinstance(entry, BytesEntry):
                st[k] = _scalar(where, k, name, checkpoint.value(key))
            elif elementwise:
                host = torch.empty(tensor.numel(), dtype=entry.dtype)
                if tensor.numel():
                    filler.fill(key, p, _place(state, p), start, start + tensor.numel(), host)
                st[k] = host
            elif entry.shape == ():
                st[k] = _scalar(where, k, name, checkpoint.whole(key))
            else:
                if state.grads_sharded and not state.whole_params:
                    raise RuntimeError(
                        f"zero_ext.load: optimizer state '{k}' of '{name}' in {where} is not elementwise "
                        f"(shape {list(entry.shape)}, the parameter's {list(full)}) and cannot be sharded; load "
                        "it at stage 0")
                st[k] = (checkpoint.whole(key), tuple(entry.shape))
        out[tensor] = st
    return out


@torch.no_grad()
def load_dcp(where: str, model, optimizer, state, ranks, strict: bool, mismatch: str, stage_ranks=None) -> Any:
    """zero_ext.load's phases over a DCP directory (the caller checked the
    ranks agree on it). Returns this rank's extra. A pipeline stage:
    `ranks` span every stage, `stage_ranks` this stage's model."""
    checkpoint = None
    try:
        error, found, members = None, None, None
        try:  # collective within the stage: a rank's optimizer holds its own segments
            members = group_members(state, optimizer, stage_ranks if stage_ranks is not None else ranks)
        except Exception as e:  # noqa: BLE001 - raised on every rank by settle
            error = e
        try:
            if error is not None:
                raise error
            checkpoint = DcpCheckpoint(where, "zero_ext.load")
            found = Plan(checkpoint, state, model, strict, mismatch != "fresh", ranks.rank, members)
        except Exception as e:  # noqa: BLE001 - raised on every rank by settle
            error = e
        saves = ranks.settle(error, checkpoint.index.save_id if checkpoint is not None else None)
        if any(s != saves[0] for s in saves):
            raise RuntimeError(f"zero_ext.load: ranks opened different saves at {where}: it was replaced during "
                               "this load. Nothing was loaded; load again")

        error, values, buffers, opt_state = None, [], {}, {}
        try:
            values = read_values(found, state, model)
            buffers = read_buffers(found, model)
            if found.with_optimizer:
                opt_state = read_optimizer(found, state, optimizer)
        except Exception as e:  # noqa: BLE001
            error = e
        ranks.settle(error, action=f"zero_ext.load: reading {where}",
                     note="Nothing was loaded: the model and optimizer are as they were")

        error = None
        try:
            for view, host in values:
                view.copy_(host)
            del values
            install(model, optimizer, found.groups, opt_state, buffers, _restored)
        except Exception as e:  # noqa: BLE001
            error = e
        ranks.settle(error, action=f"zero_ext.load: copying {where} into the model",
                     note="The model and optimizer are partly loaded; load a good checkpoint before training")
    finally:
        if checkpoint is not None:
            checkpoint.close()
    refresh(state)
    return found.extra


def _restored(value: Any, tensor: torch.Tensor) -> Any:
    """Elementwise state shaped and placed like its parameter tensor, whole
    state in its own shape, scalars as they were."""
    if isinstance(value, tuple):
        return value[0].view(value[1]).to(tensor.device)
    if isinstance(value, torch.Tensor) and value.dim():
        return value.view(tensor.shape).to(tensor.device)
    return value
