"""zero_ext.clip_grad_norm_ and clip_grad_value_: torch.nn.utils' clipping for
parameters whose gradients zero_ext shards (and for plain ones)."""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ..tools import described
from .streamed_step import gradient_chunks


def _parameters(parameters, who: str) -> List[torch.Tensor]:
    """torch's reading of `parameters` (a tensor or an iterable of them), with
    a model or an optimizer in their place refused by name: iterating a
    Sequential would give its submodules, an optimizer is not iterable."""
    if isinstance(parameters, (torch.nn.Module, torch.optim.Optimizer)):
        raise TypeError(f"zero_ext.{who}: got {described(parameters)} where the parameters go; pass "
                        f"model.parameters() (the wrapped model's): zero_ext.{who}(model.parameters(), ...)"
                        + (", or call optimizer.clip_grad_norm_(max_norm)" if who == "clip_grad_norm_" else ""))
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _local_norm(grads: List[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's part: max |g| (inf norm) or sum |g|^p, fp32, on `device`."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        return torch.stack([g.detach().abs().max().float().to(device) for g in grads if g.numel()]
                           or [torch.zeros((), dtype=torch.float32, device=device)]).max()
    norms = torch._foreach_norm([g.detach() for g in grads], norm_type)
    return torch.stack([n.float().to(device) for n in norms]).pow(norm_type).sum()


def _reduce(local: torch.Tensor, state, norm_type: float) -> torch.Tensor:
    """Over the model's ranks when each holds a part of the gradient."""
    sharded = state.grads_sharded and state.process_group is not None and state.world_size > 1
    if not sharded:
        return local
    on_device = local.to(state.device)  # NCCL reduces device tensors; offloaded grads are on the host
    state.handles.collectives.group_all_reduce(on_device, math.isinf(norm_type),
                                               "clip_grad_norm_: the gradient norm's all-reduce")
    return on_device.to(local.device)


# A part: (zero_ext state, this rank's gradient tensors of it, streamed, across).
# Streamed (offload_optimizer="nvme"): the tensors are the optimizer's segments,
# whose gradients are in the offload file and come in chunk by chunk
# (gradient_chunks). Across: None, or the dimension whose ranks hold the
# other parts of these gradients, over which their sums add up after the
# data-parallel group's: tp for a tensor-parallel model's parameters split
# over tp (the rest, which every tp rank holds alike, count once;
# groups/tensor_parallel.py); ep for experts on their own dimension at stage
# 0, where each rank of an expert group holds its experts' whole gradient
# (at stages 1-3 the sum over dp already holds every expert's shard once).
Part = Tuple[object, List[torch.Tensor], bool, Optional[object]]


def _part_norm(part: Part, norm_type: float, device: torch.device) -> torch.Tensor:
    state, tensors, streamed, _ = part
    if not streamed:
        return _local_norm(tensors, norm_type, device)
    chunks = [_local_norm(grads, norm_type, device) for grads in gradient_chunks(state, tensors, changed=False)]
    if not chunks:
        return _local_norm([], norm_type, device)
    return torch.stack(chunks).max() if math.isinf(norm_type) else torch.stack(chunks).sum()


def _in_place(parts: List[Part], plain: List[torch.Tensor], apply, identity: bool = False) -> None:
    """apply(list of same-device, same-dtype gradients) over every gradient,
    streamed parts chunk by chunk (written back) unless `identity` (apply
    would change nothing: no chunk is read and written again for it)."""
    every = [g for _, tensors, streamed, _ in parts if not streamed for g in tensors] + plain
    by_kind: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for g in every:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for grads in by_kind.values():
        apply(grads)
    for state, tensors, streamed, _ in parts:
        if streamed and not identity:
            for grads in gradient_chunks(state, tensors, changed=True):
                if grads:
                    apply(grads)


@torch.no_grad()
def clip_sharded(parts: List[Part], plain: List[torch.Tensor],
                 max_norm: float, norm_type: float, error_if_nonfinite: bool,
                 pipelines: Sequence = ()) -> torch.Tensor:
    """parts: see Part; plain: gradients every rank holds whole. Clips all
    in place; returns the total norm. `pipelines`: the pp dimensions
    (groups/pipeline.py) whose other stages hold the rest of the model: the
    sum (max) goes across them too, so every stage clips by the whole
    model's norm."""
    norm_type = float(norm_type)
    device = parts[0][0].device if parts else (plain[0].device if plain else torch.device("cpu"))
    totals = []
    for part in parts:
        total = _reduce(_part_norm(part, norm_type, device), part[0], norm_type).to(device)
        if part[3] is not None:  # summed over dp above, now over tp (or ep)
            total = total.to(part[0].device)
            part[3].all_reduce(total, math.isinf(norm_type))
            total = total.to(device)
        totals.append(total)
    totals.append(_local_norm(plain, norm_type, device))
    total = torch.stack(totals).max() if math.isinf(norm_type) else torch.stack(totals).sum()
    for pipeline in pipelines:
        pipeline.all_reduce(total, math.isinf(norm_type))
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"zero_ext.clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            f"non-finite, so it cannot be clipped. Pass error_if_nonfinite=False to clip anyway.")
    clip_coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    # Streamed gradients are not read and rewritten to be multiplied by 1 (the same values).
    unchanged = any(streamed for _, _, streamed, _ in parts) and bool(clip_coef == 1.0)
    _in_place(parts, plain, lambda grads: torch._foreach_mul_(
        grads, clip_coef.to(device=grads[0].device, dtype=grads[0].dtype)), identity=unchanged)
    return total


def _owners(params: List[torch.Tensor]) -> list:
    """The ZeroStates of the wrapped models among `params`, in the same order on every rank."""
    owners = {}
    for p in params:
        for attr in ("_zero_ext_owner", "_zero_ext_segment_of"):
            ref = getattr(p, attr, None)
            state = ref() if ref is not None else None
            if state is not None:
                owners[id(state)] = state
    return sorted(owners.values(), key=lambda s: s.names[0] if s.names else "")


def settle_owners(params: List[torch.Tensor]) -> None:
    """Finishes the gradients of every wrapped model among `params` before
    they are read (a late second round, .grad None where no rank had one;
    csrc/rank_agreement.h). In the same order on every rank: collective."""
    for state in _owners(params):
        state.handles.optimizer.settle()
        check_tensor_parallel_grads(state)


def check_tensor_parallel_grads(state) -> None:
    """A tensor-parallel model, once its gradients are settled: every tp
    rank has the same parameters with gradients (collective over tp;
    TensorParallel.check_grads_agree). Nothing without tensor parallelism."""
    tp = state.tensor_parallel
    if tp is not None and tp.size > 1:
        tp.check_grads_agree(state.bucketed_names, state.handles.reduction.has_grad(), state.device)


def parts_of(state, held: List[Tuple[torch.Tensor, torch.Tensor]]) -> List[Part]:
    """The Parts of one model's (tensor the optimizer steps, its parameter)
    pairs whose gradients this rank holds. A tensor-parallel model has a split
    part on every rank, maybe empty: its tp all-reduce is collective; so do
    experts on their own dimension at stage 0, over ep."""
    streamed = state.streams_optimizer  # the gradients are in the offload file
    tp = state.tensor_parallel
    ep = state.experts if state.experts is not None and not state.grads_sharded else None
    across = tp if tp is not None else ep

    def split(owner) -> bool:
        return tp.sums_over_tp(owner) if tp is not None else ep.spec_of(owner) is not None

    parts = []
    for over in ((False, True) if across is not None else (False,)):
        kept = [t for t, owner in held if across is None or split(owner) == over]
        parts.append((state, kept if streamed else [t.grad for t in kept], streamed, across if over else None))
    return parts


def _held_gradients(params: List[torch.Tensor]) -> Tuple[List[Part], List[torch.Tensor]]:
    """The gradients this rank holds for `params`: a Part per zero_ext state
    whose optimizer steps zero_ext's segments (this rank's shard in stages
    1-3), sorted the same on every rank; and the plain gradients (unwrapped
    parameters, stage 0 in fp32)."""
    sharded: Dict[int, Tuple[object, set, List[torch.Tensor]]] = {}
    plain: List[torch.Tensor] = []
    for p in params:
        ref = getattr(p, "_zero_ext_owner", None)
        state = ref() if ref is not None else None
        segment_ref = getattr(p, "_zero_ext_segment_of", None)  # a tensor of the sharded optimizer
        owner_of_segment = segment_ref() if segment_ref is not None else None
        if state is not None and (state.sharded_optimizer or state.tensor_parallel is not None
                                  or state.experts is not None):
            sharded.setdefault(id(state), (state, set(), []))[1].add(id(p))
        elif owner_of_segment is not None:
            entry = sharded.setdefault(id(owner_of_segment), (owner_of_segment, set(), []))
            if p.grad is not None:
                entry[2].append(p)
        elif p.grad is not None:
            plain.append(p.grad)
    parts = []
    for state, wanted, given in sharded.values():
        if state.sharded_optimizer:
            segments = state.handles.optimizer.segments()
            owners = [state.bucketed[i] for i in state.handles.optimizer.segment_param_indices()]
        else:  # stage 0 of a tensor-parallel model (or with experts): the parameters themselves
            segments = owners = state.bucketed
        owner_of = {id(seg): owner for seg, owner in zip(segments, owners)}
        chosen = [(seg, owner) for seg, owner in zip(segments, owners)
                  if id(owner) in wanted and seg.grad is not None] + [(seg, owner_of[id(seg)]) for seg in given]
        parts += parts_of(state, chosen)
    # Every state in a fixed order on every rank: the reductions are collective.
    parts.sort(key=lambda part: (part[0].names[0] if part[0].names else "", part[3] is not None))
    return parts, plain


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the global gradient: correct for
    parameters of models wrapped by zero_ext in every stage (their gradients'
    shards on every rank count), and for plain parameters. Returns the total
    norm before clipping. Collective when wrapped parameters in stages 1-3 are
    among `parameters`: every rank of their group calls it. `foreach` is
    accepted for compatibility (zero_ext always uses the foreach kernels)."""
    params = _parameters(parameters, "clip_grad_norm_")
    settle_owners(params)
    parts, plain = _held_gradients(params)
    return clip_sharded(parts, plain, max_norm, norm_type, error_if_nonfinite, pipelines_of(_owners(params)))


def pipelines_of(states: list) -> list:
    """The pp dimensions of these wrapped models, each once, in a fixed order."""
    found = {}
    for state in states:
        if state.pipeline is not None and state.pipeline.size > 1:
            found.setdefault(id(state.pipeline.group), state.pipeline)
    return list(found.values())


@torch.no_grad()
def clip_grad_value_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], clip_value: float,
                     foreach: Optional[bool] = None) -> None:
    """torch.nn.utils.clip_grad_value_ for parameters of models wrapped by
    zero_ext in every stage (and for plain ones): clamps every gradient
    element to [-clip_value, clip_value]. Elementwise, so each rank clamps
    the gradient it holds (its shard in stages 1-3, where torch's sees only
    param.grad stand-ins), once late reductions have settled: collective
    when wrapped parameters are among `parameters`, every rank calls it.
    `foreach` is accepted for compatibility."""
    params = _parameters(parameters, "clip_grad_value_")
    settle_owners(params)
    parts, plain = _held_gradients(params)
    clip_value = float(clip_value)

    def clamp(grads: List[torch.Tensor]) -> None:  # as torch's: clamp_min then clamp_max, per device and dtype
        torch._foreach_clamp_min_(grads, -clip_value)
        torch._foreach_clamp_max_(grads, clip_value)
    _in_place(parts, plain, clamp)
