"""Which ranges of which tensors a rank writes at save and reads at load:
the layout arithmetic, apart from file I/O.

Each rank writes only the elements it owns: for every bucket, the r-th equal
slice of its flat parameters (in stages 1-3 exactly the rank's shard; in
stage 0, where every rank holds everything, the same split, so ranks share
the writing). Values are the fp32 masters where they exist. Pieces are
indexed by parameter name and element range, not by rank or bucket, so a
loading rank reads the ranges of each parameter its own layout needs,
whatever world size, stage or bucket size wrote them.

A tensor-parallel model (groups/tensor_parallel.py) stores each parameter
full: a parameter split over tp tp rank by tp rank (each rank's part
flattened, metadata ParamMeta.tensor_parallel), so a rank's ranges of its
local leaf shift by where its part starts (stored_offset); a parameter every
tp rank holds alike is written by tp rank 0 and read by all. Experts on
their own mesh dimension (groups/experts.py) are stored the same way: split
along dim 0 over ep, each ep rank's experts at their place.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch


def owned_ranges(state, rank: int) -> List[Tuple[int, int, int]]:
    """(param index, start, end) this rank writes: its equal slice of each
    bucket (the core's layout knows the arithmetic)."""
    raw = state.handles.checkpoint.owned_ranges(rank)
    return [tuple(raw[k:k + 3]) for k in range(0, len(raw), 3)]


def local_views(state) -> List[Tuple[int, int, torch.Tensor]]:
    """(param index, start in param, flat view) of every bucketed value this
    rank holds: fp32 masters or its parameter shard; in stage 0 without
    masters the parameters themselves."""
    if not state.sharded_optimizer:
        return [(i, 0, p.detach().view(-1)) for i, p in enumerate(state.bucketed)]
    shards = state.handles.checkpoint.local_value_shards()
    raw = state.handles.checkpoint.local_pieces()  # (param, start in param, bucket, start in its shard, length)
    return [(i, start, shards[b][at:at + length])
            for i, start, b, at, length in (raw[k:k + 5] for k in range(0, len(raw), 5))]


def optimizer_pieces(state, optimizer) -> List[Tuple[torch.Tensor, int, int]]:
    """(optimizer tensor, param index, start in param) for each tensor the
    optimizer steps: this rank's segments, or whole parameters in stage 0.
    Once each: a parameter listed twice in a group has one state."""
    listed = list({id(p): p for g in optimizer.param_groups for p in g["params"]}.values())
    if not state.sharded_optimizer:
        index = {id(p): i for i, p in enumerate(state.bucketed)}
        return [(p, index[id(p)], 0) for p in listed if id(p) in index]
    segments = state.handles.optimizer.segments()
    owners = state.handles.optimizer.segment_param_indices()
    starts = state.handles.checkpoint.segment_param_starts()
    by_id = {id(s): (i, st) for s, i, st in zip(segments, owners, starts)}
    return [(p, *by_id[id(p)]) for p in listed]


def persistent_buffers(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def optimizer_pieces_by_group(state, optimizer) -> List[List[int]]:
    pieces = optimizer_pieces(state, optimizer)
    owner = {id(t): i for t, i, _ in pieces}
    return [[owner[id(p)] for p in g["params"] if id(p) in owner] for g in optimizer.param_groups]


def replica_part(state, lo: int, hi: int) -> Tuple[int, int]:
    """Hybrid sharding: the replicas of a shard each write 1/R of what it
    owns, so the rows share the writing (flat: the whole range)."""
    step = -(-(hi - lo) // state.replicas)
    a = min(hi, lo + state.replica_rank * step)
    return a, min(hi, a + step)


def wanted_ranges(state, model: torch.nn.Module, optimizer) -> Dict[str, List[Tuple[int, int]]]:
    """(start, length) of each parameter's elements this rank loads: its
    values (bucketed shards, or whole unbucketed parameters) and its
    optimizer state."""
    wanted: Dict[str, List[Tuple[int, int]]] = {}
    names = state.bucketed_names
    shift = [stored_offset(state, p, writing=False) for p in state.bucketed]
    for i, start, view in local_views(state):
        wanted.setdefault(names[i], []).append((shift[i] + start, view.numel()))
    bucketed = {id(p) for p in state.bucketed}
    for n, p in model.named_parameters():
        if id(p) not in bucketed:
            wanted.setdefault(n, []).append((stored_offset(state, p, writing=False), p.numel()))
    for tensor, i, start in optimizer_pieces(state, optimizer):
        wanted.setdefault(names[i], []).append((shift[i] + start, tensor.numel()))
    return wanted


def _split_numels(spec) -> List[int]:
    """Each tp rank's element count of a split parameter."""
    dim, shape = spec.shard_dim, list(spec.shape)
    out = []
    for size in spec.local_sizes():
        shape[dim] = size
        n = 1
        for s in shape:
            n *= s
        out.append(n)
    return out


def split_of(state, p: torch.Tensor):
    """(spec, this rank's place along it) of a local leaf: a tensor-parallel
    one's over tp, an expert's over ep; (None, 0) for any other parameter."""
    for dimension in (state.tensor_parallel, state.experts):
        spec = dimension.spec_of(p) if dimension is not None else None
        if spec is not None:
            return spec, dimension.rank
    return None, 0


def stored_offset(state, p: torch.Tensor, writing: bool) -> Optional[int]:
    """Where this rank's local values of parameter `p` start among the stored
    elements of the full parameter: 0 without tensor parallelism; None when
    writing a part another tp rank writes (a parameter every tp rank holds
    alike: tp rank 0 writes it)."""
    spec, rank = split_of(state, p)
    if spec is not None and spec.shard_dim is not None:
        return sum(_split_numels(spec)[:rank])
    tp = state.tensor_parallel
    if tp is None:
        return 0
    return None if writing and tp.rank != 0 else 0


def full_shape(state, p: torch.Tensor) -> Tuple[int, ...]:
    """The parameter's full shape (a tensor-parallel leaf's or an expert's: the full tensor's)."""
    spec, _ = split_of(state, p)
    return tuple(spec.shape) if spec is not None else tuple(p.shape)


def tensor_parallel_split(state, p: torch.Tensor) -> Optional[Tuple[int, Tuple[int, ...]]]:
    """(dim, each rank's extent) of a parameter split over tp (or ep), else None."""
    spec, _ = split_of(state, p)
    if spec is None or spec.shard_dim is None:
        return None
    return spec.shard_dim, tuple(spec.local_sizes())


def split_offset(state, p: torch.Tensor) -> Tuple[Optional[int], int]:
    """(dim, where this rank's part starts along it) of a split parameter, (None, 0) otherwise."""
    split = tensor_parallel_split(state, p)
    if split is None:
        return None, 0
    return split[0], sum(split[1][:split_of(state, p)[1]])


def check_split_readable(state, model: torch.nn.Module, saved_splits: Dict[str, Optional[tuple]], where: str) -> None:
    """Refuses (ValueError) a checkpoint whose stored order of some parameter
    is not the one this model's ranks read: a split along a dimension other
    than 0 read at another tp layout (along dim 0, or not split, the stored
    order is the full tensor's own, which any split reads)."""
    for name, p in model.named_parameters():
        if name not in saved_splits:
            continue  # strict=False: not loaded
        saved = saved_splits[name]
        mine = tensor_parallel_split(state, p)
        if saved == mine:
            continue
        if (saved is None or saved[0] == 0) and (mine is None or mine[0] == 0):
            continue
        raise ValueError(
            f"zero_ext.load: {where} stores '{name}' "
            + (f"split over tensor parallel along dim {saved[0]} into {list(saved[1])}" if saved else "whole")
            + ", and this model "
            + (f"splits it along dim {mine[0]} into {list(mine[1])}" if mine else "holds it whole")
            + ". Load it with the tensor-parallel layout it was saved with, or convert it to full tensors "
              "(python -m zero_ext.convert) and load those with zero_ext.load_full_state_dict.")
