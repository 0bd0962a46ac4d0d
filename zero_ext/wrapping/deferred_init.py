"""Deferred initialization: a model built with its parameters on the meta
device (``zero_ext.empty_init()`` or ``torch.device("meta")``) is
materialized by wrap() module by module, each rank keeping only what its
stage keeps ([Note: deferred initialization],
csrc/param_store_materialize.cpp).

The order is ``model.named_modules()``: each module with meta state is
initialized by ``param_init_fn(module)`` or its own ``reset_parameters()``,
as ``Module.__init__`` runs it for ordinary modules, so the same seed gives
the values an unsharded model built normally gets. A bucket (stage 3: a unit)
is opened when the first module holding one of its parameters comes and
closed after the last such module (tied parameters: the last owner), so in
stage 3 only the root unit and the current one exist whole.

A transformers model given no param_init_fn (or its own _init_weights) is
initialized as its normal construction does it instead (pretrained_init.py):
its modules walked children first, each running the calls construction made
on it (reset_parameters(), then post_init's _init_weights) from the random
state construction had there; a bucket stays open until the last module whose
calls write it."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Set

import torch

from ..tools import core_loader  # noqa: F401  registers torch.ops.zero_ext
from .pretrained_init import ConstructionReplay, replays_construction, trace


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Parameters registered inside are created on the meta device (no
    memory); buffers stay real. ``zero_ext.wrap`` then materializes and
    initializes the model shard by shard. Build the optimizer over the meta
    parameters as usual."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: Optional[torch.nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = torch.Tensor._make_subclass(type(param), param.detach().to("meta"), param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def skip_init(module: torch.nn.Module) -> None:
    """``wrap(..., param_init_fn=zero_ext.skip_init)``: initialize nothing,
    because ``zero_ext.load_weights`` fills every weight next. No unit is
    ever whole and nothing is broadcast; until loaded, floating parameters
    are NaN, so a forgotten load is loud (a NaN loss), never silent."""


def has_meta_parameters(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _owned_state(module: torch.nn.Module):
    params = [(n, p) for n, p in module._parameters.items() if p is not None]
    buffers = [(n, b) for n, b in module._buffers.items() if b is not None]
    return params, buffers


def _check_available(device: torch.device) -> None:
    """device= names a device this rank has (the ranks may differ: a node
    with fewer GPUs), checked before the ranks agree rather than failing at
    the first tensor made there."""
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if callable(available) and not available():
        raise ValueError(f"zero_ext.wrap: device={str(device)!r}: this rank has no {device.type} device "
                         "(torch sees none); pass the device every rank has, e.g. device=f'cuda:{local_rank}'")
    count = getattr(backend, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise ValueError(f"zero_ext.wrap: device={str(device)!r}: this rank sees {count()} {device.type} "
                         f"device(s) (indices 0-{count() - 1}); pass this rank's own, e.g. "
                         "device=f'cuda:{local_rank}'")


@dataclass
class DeferredPlan:
    """What wrap() materializes: the device and, per module in the order
    they are initialized (named_modules(), or children first for a replayed
    transformers model), whether it is initialized."""

    device: torch.device
    param_init_fn: Optional[Callable[[torch.nn.Module], None]]
    modules: List[torch.nn.Module]
    names: List[str]
    initialized: List[bool]
    replay: Optional[ConstructionReplay] = None  # a transformers model's construction, traced


def plan_deferred(model: torch.nn.Module, device, param_init_fn) -> Optional[DeferredPlan]:
    """None for a model whose parameters are real (device and param_init_fn
    must then be None). Raises ValueError, before any communication, for a
    model wrap() cannot materialize: real parameters beside meta ones, or
    modules with meta state that nothing initializes."""
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"zero_ext.wrap: param_init_fn must be a callable taking a module, "
                        f"got {type(param_init_fn).__name__}")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"zero_ext.wrap: device must name a torch device ('cuda:0', 'cpu'), "
                             f"got {device!r}") from e
        if device.type == "meta":
            raise ValueError("zero_ext.wrap: device is where a meta model is materialized; it cannot be 'meta'")
    if not has_meta_parameters(model):
        if device is not None or param_init_fn is not None:
            raise ValueError(
                "zero_ext.wrap: device and param_init_fn apply to a model whose parameters are on the "
                "meta device (built under zero_ext.empty_init()); this model's are real. Move it with "
                "model.to(device) and initialize it before wrap(), or build it under empty_init()")
        return None
    real = [n for n, p in model.named_parameters() if not p.is_meta]
    if real:
        raise ValueError(
            f"zero_ext.wrap: the model mixes meta and real parameters (real: {real[:3]}); build it "
            "whole under zero_ext.empty_init() (or torch.device('meta')) so wrap() materializes "
            "every parameter, or materialize it yourself before wrap()")
    if device is None:
        device = default_device()
    else:
        _check_available(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if replays_construction(model, param_init_fn):
        names_of = {id(m): n for n, m in model.named_modules()}
        replay = trace(model, device, names_of)
        return DeferredPlan(device, None, replay.walk, [names_of[id(m)] for m in replay.walk],
                            [True] * len(replay.walk), replay)
    names, modules, initialized, orphans = [], [], [], []
    for name, module in model.named_modules():
        params, buffers = _owned_state(module)
        meta = any(p.is_meta for _, p in params) or any(b.is_meta for _, b in buffers)
        if meta and param_init_fn is None and not callable(getattr(module, "reset_parameters", None)):
            held = [n for n, t in params + buffers if t.is_meta]
            orphans.append(f"{name or '<root>'} ({type(module).__name__}: {', '.join(held)})")
        names.append(name)
        modules.append(module)
        initialized.append(meta)
    if orphans:
        raise ValueError(
            f"zero_ext.wrap: {len(orphans)} modules hold meta parameters or buffers but have no "
            f"reset_parameters() to initialize them: {orphans[:5]}. Pass param_init_fn=fn (called "
            "as fn(module) on every module with meta state, in model.named_modules() order; it "
            "initializes that module's own parameters and buffers), or give those modules a "
            "reset_parameters()")
    return DeferredPlan(device, param_init_fn, modules, names, initialized)


def _stand_in(param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.nn.Parameter:
    out = torch.Tensor._make_subclass(type(param), tensor, param.requires_grad)
    out.__dict__.update(param.__dict__)
    return out


def move_to_device(plan: DeferredPlan, bucketed: List[torch.nn.Parameter], names: List[str]) -> None:
    """Each bucketed meta parameter becomes (the same Python object, which the
    optimizer holds) a tensor on the device without memory, which the core
    then points at its bucket; reading it before that raises."""
    for p, name in zip(bucketed, names):
        empty = torch.ops.zero_ext.unreadable_tensor(
            list(p.shape), p.dtype, plan.device,
            f"zero_ext: parameter '{name}' is being materialized by zero_ext.wrap() and holds no data yet")
        torch.utils.swap_tensors(p, _stand_in(p, empty))


def materialize(plan: DeferredPlan, handles, ranks, bucketed: List[torch.nn.Parameter], counts: List[int],
                groups_of_bucket: List[int], local_views: Callable[[], list], params_sharded: bool) -> None:
    """Initializes the wrapped model in named_modules() order, opening and
    closing buckets by group (a unit in stage 3, a bucket otherwise).
    Collective; an initializer that raises on one rank raises on all."""
    bucket_index = [b for b, count in enumerate(counts) for _ in range(count)]  # bucketed is in bucket order
    bucket_of: Dict[int, int] = {id(p): b for p, b in zip(bucketed, bucket_index)}
    if plan.param_init_fn is skip_init:
        _fill_for_loading(plan, handles, ranks, bucketed, bucket_of, local_views, params_sharded)
        return
    buckets_of_group: Dict[int, List[int]] = {}
    for b, g in enumerate(groups_of_bucket):
        buckets_of_group.setdefault(g, []).append(b)
    touches: List[Set[int]] = []
    last_touch: Dict[int, int] = {}
    for k, module in enumerate(plan.modules):
        params = [p for _, p in _owned_state(module)[0]]
        if plan.replay is not None:
            params += plan.replay.written_parameters(module)  # also descendants' (GPT-2's c_proj)
        groups = {groups_of_bucket[bucket_of[id(p)]] for p in params if id(p) in bucket_of}
        touches.append(groups)
        for g in groups:
            last_touch[g] = k
    frozen: List[torch.Tensor] = []
    done: Set[int] = set()  # parameters an earlier module initialized
    opened: Set[int] = set()
    born_on_meta: List[tuple] = []  # replayed: an ancestor's call may fill a module's buffers
    error: Optional[BaseException] = None
    for k, module in enumerate(plan.modules):
        newly = sorted(touches[k] - opened)
        handles.checkpoint.begin_materialize([b for g in newly for b in buckets_of_group[g]])
        opened.update(newly)
        if error is None:
            # A failure here is kept, not raised: this rank goes on opening and
            # closing buckets with the others (no rank is left in a broadcast)
            # and every rank raises it at the settle below.
            try:
                params_made, buffers_made = _materialize_unbucketed(plan, module, bucket_of)
                frozen += params_made
                if plan.replay is not None:
                    plan.replay.run(module)
                    born_on_meta.append((module, buffers_made))
                else:
                    if plan.initialized[k]:
                        _initialize(plan, module, done)
                    _check_buffers_filled(module, buffers_made)
            except Exception as e:  # noqa: BLE001 - raised on every rank by settle
                error = _named(e, plan.names[k], module, plan.param_init_fn is not None, plan.replay is not None)
        closing = sorted(g for g in touches[k] if last_touch[g] == k)
        handles.checkpoint.end_materialize([b for g in closing for b in buckets_of_group[g]])
    if plan.replay is not None:
        plan.replay.finish()  # the random stream where normal construction leaves it
        if error is None:
            try:
                for module, buffers_made in born_on_meta:
                    _check_buffers_filled(module, buffers_made)
            except Exception as e:  # noqa: BLE001 - raised on every rank by settle
                error = e
    ranks.settle(error)
    with torch.no_grad():
        for p in frozen:
            handles.collectives.mesh_broadcast_from_rank0(p.detach(),
                                                          "wrap(): broadcasting an initialized frozen parameter")


def _fill_for_loading(plan: DeferredPlan, handles, ranks, bucketed, bucket_of, local_views,
                      params_sharded: bool) -> None:
    """skip_init: this rank's values NaN (masters or shards, the replicated
    compute copies, frozen parameters outside the buckets), buffers on the
    device: no unit whole, no broadcast, no gather. Buffers born on meta
    follow the NaN rule."""
    error: Optional[BaseException] = None
    try:
        with torch.no_grad():
            for _, _, view in local_views():
                if view.dtype.is_floating_point:
                    view.fill_(float("nan"))
            for p in bucketed:  # stages 0-2: the full compute copy each rank holds
                if p.dtype.is_floating_point and p.untyped_storage().resizable():  # not released
                    p.detach().fill_(float("nan"))
            for module in plan.modules:
                params_made, buffers_made = _materialize_unbucketed(plan, module, bucket_of)
                for p in params_made:
                    if p.dtype.is_floating_point:
                        p.detach().fill_(float("nan"))
                _check_buffers_filled(module, buffers_made)
    except Exception as e:  # noqa: BLE001 - raised on every rank by settle
        error = e
    ranks.settle(error)
    if params_sharded:
        # offload's device shards from the masters; no collective in stage 3
        handles.checkpoint.refresh_params_from_shards()


def _materialize_unbucketed(plan: DeferredPlan, module: torch.nn.Module, bucket_of):
    """The module's buffers on the device, and its frozen parameters outside
    the buckets (stages 0-2 without mixed precision), returned for the
    broadcast, with the names of the buffers born on meta: they start as NaN
    (floating) or zero, for the initializer to fill."""
    frozen, born_on_meta = [], []
    params, buffers = _owned_state(module)
    for _, p in params:
        if id(p) not in bucket_of and p.is_meta:
            torch.utils.swap_tensors(p, _stand_in(p, torch.zeros(p.shape, dtype=p.dtype, device=plan.device)))
            frozen.append(p)
    for name, b in buffers:
        if b.is_meta:
            fill = float("nan") if b.dtype.is_floating_point or b.dtype.is_complex else 0
            module._buffers[name] = torch.full(b.shape, fill, dtype=b.dtype, device=plan.device)
            born_on_meta.append(name)
        elif b.device != plan.device:
            module._buffers[name] = b.to(plan.device)
    return frozen, born_on_meta


def _check_buffers_filled(module: torch.nn.Module, born_on_meta: List[str]) -> None:
    """A non-persistent buffer born on meta that its module's initializer
    left NaN is an error: no checkpoint or load_weights can fill it (a
    rotary embedding's inv_freq, say), and the model would compute NaN. A
    persistent one may still come from load_weights; NaN makes a forgotten
    load loud."""
    for name in born_on_meta:
        b = module._buffers.get(name)
        if b is None or not b.dtype.is_floating_point:
            continue
        if name in module._non_persistent_buffers_set and b.numel() and torch.isnan(b).all():
            raise ValueError(
                f"zero_ext.wrap: the non-persistent buffer '{name}' ({type(module).__name__}) was built on the "
                "meta device and its initializer did not fill it, and no checkpoint holds it. Fill it in "
                "param_init_fn, or build the model under zero_ext.empty_init() (buffers stay real there)")


def _initialize(plan: DeferredPlan, module: torch.nn.Module, done: Set[int]) -> None:
    """Runs the module's initializer. A tied parameter keeps its first
    owner's values, as tying after construction keeps them; a later owner
    initializes a scratch copy, so the random stream advances as it does
    when the model is constructed normally."""
    tied = {name: p for name, p in module._parameters.items() if p is not None and id(p) in done}
    for name, p in tied.items():
        module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=plan.device),
                                                      requires_grad=p.requires_grad)
    try:
        with torch.no_grad():
            if plan.param_init_fn is not None:
                plan.param_init_fn(module)
            else:
                module.reset_parameters()
    finally:
        module._parameters.update(tied)
    done.update(id(p) for p in module._parameters.values() if p is not None)


def _named(error: Exception, name: str, module: torch.nn.Module, custom: bool, replayed: bool = False) -> Exception:
    if replayed:
        what = "its construction's reset_parameters() and _init_weights, replayed"
    else:
        what = "param_init_fn" if custom else f"{type(module).__name__}.reset_parameters()"
    message = f"zero_ext.wrap: initializing module '{name or '<root>'}' ({what}) failed: {error}"
    try:
        out = type(error)(message)
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        out = RuntimeError(message)
    out.__cause__ = error
    return out
