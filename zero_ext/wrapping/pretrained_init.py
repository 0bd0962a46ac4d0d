"""Deferred initialization of a transformers model (a PreTrainedModel built
under ``zero_ext.empty_init()`` or on the meta device) when wrap() is given
no param_init_fn: wrap() replays what constructing the model normally runs,
so the same seed gives the same values.

Normal construction draws twice. Each module's own initializer runs as the
module is built (nn.Linear's reset_parameters, ...); then each
PreTrainedModel's post_init() calls its ``_init_weights(module)`` on every
module of its subtree not initialized yet, children first (a sub-model, as
LlamaModel in LlamaForCausalLM, runs its own post_init when it is built,
before the modules built after it); tied weights are tied last. On meta
parameters both drew nothing.

wrap() opens one unit at a time (stage 3), so it cannot sweep the model
twice in that order. Instead it traces the calls first, in construction
order on scratch tensors (memory: what one call writes): the random
generator's state before each call, and the parameters each call writes
(an _init_weights may write a descendant's, as GPT-2's attention re-draws
its c_proj). It then walks the modules children first, runs each module's
calls into its open unit from their traced states, and leaves the generator
where normal construction leaves it. A unit stays open until the last call
that writes it. A tied parameter keeps what its first owner in that walk
writes (the input embedding: the one transformers ties to).

A module that draws in ``__init__`` without a reset_parameters() to replay
(GPT-2's Conv1D) shifts the stream: post_init's draws then start elsewhere,
so values have the same distribution, not the same numbers.
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch

# A place a tensor is registered: (module, "_parameters" or "_buffers", name).
# A tied parameter has one slot per module that holds it.
Slot = Tuple[torch.nn.Module, str, str]


def is_pretrained_model(module: torch.nn.Module) -> bool:
    """Whether `module` is a transformers PreTrainedModel (looked up in
    sys.modules: a model of the library means it is imported)."""
    library = sys.modules.get("transformers")
    cls = getattr(library, "PreTrainedModel", None) if library is not None else None
    return isinstance(cls, type) and isinstance(module, cls)


def replays_construction(model: torch.nn.Module, param_init_fn) -> bool:
    """wrap() replays construction for a transformers model given no
    param_init_fn, or its own _init_weights (the same, explicitly)."""
    if not is_pretrained_model(model):
        return False
    return param_init_fn is None or param_init_fn == getattr(model, "_init_weights", None)


@dataclass
class InitCall:
    """One initializer call of normal construction."""

    module: torch.nn.Module
    owner: Optional[torch.nn.Module]  # the PreTrainedModel whose _init_weights runs; None: reset_parameters()
    rng_state: Optional[torch.Tensor] = None  # the generator's state before the call
    writes: FrozenSet[Slot] = frozenset()  # the slots it writes (its module's and descendants')

    def run(self) -> None:
        if self.owner is None:
            self.module.reset_parameters()
        else:
            self.owner._init_weights(self.module)  # post_init flagged every module: not _initialize_weights

    def describe(self) -> str:
        if self.owner is None:
            return f"{type(self.module).__name__}.reset_parameters()"
        return f"{type(self.owner).__name__}._init_weights"


@dataclass
class ConstructionReplay:
    """The traced calls and the walk that replays them unit by unit."""

    device: torch.device
    walk: List[torch.nn.Module]  # every module once, children first
    calls_of: Dict[int, List[InitCall]]  # id(module) -> its calls, in construction order
    first_slot: Dict[int, Slot]  # id(parameter) -> the slot whose writes it keeps
    final_state: Optional[torch.Tensor] = None  # the generator after the last call

    def written_parameters(self, module: torch.nn.Module) -> List[torch.nn.Parameter]:
        """The parameters `module`'s calls give their values (their units
        must be open when it runs)."""
        out = []
        for call in self.calls_of.get(id(module), []):
            for slot in call.writes:
                tensor = _get(slot)
                if slot[1] == "_parameters" and self.first_slot.get(id(tensor)) == slot:
                    out.append(tensor)
        return out

    def run(self, module: torch.nn.Module) -> None:
        """`module`'s calls, each from its traced generator state: what a call
        wrote in the trace it writes into the parameters (a tied parameter's
        later slot: into scratch); other descendants' parameters it meets as
        meta tensors, so nothing lands in a closed unit."""
        for call in self.calls_of.get(id(module), []):
            _set_generator_state(self.device, call.rng_state)
            shown: Dict[Slot, torch.Tensor] = {}
            for slot, tensor in _slots(call.module, "_parameters"):
                if slot in call.writes:
                    if self.first_slot.get(id(tensor)) != slot:
                        shown[slot] = _like(tensor, torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device))
                elif slot[0] is not call.module:
                    shown[slot] = _like(tensor, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
            with _shown(shown), torch.no_grad(), _guard(call):
                call.run()

    def finish(self) -> None:
        _set_generator_state(self.device, self.final_state)


def trace(model: torch.nn.Module, device: torch.device, names: Dict[int, str]) -> ConstructionReplay:
    """Runs construction's initializer calls on scratch tensors and returns
    what replaying them needs; the generator is left as it was. Raises
    ValueError, before any communication, naming a parameter no call
    initializes or a call that writes outside its module."""
    walk = _children_first(model)
    first_slot: Dict[int, Slot] = {}
    for module in walk:
        for slot, tensor in _slots(module, "_parameters", recurse=False):
            first_slot.setdefault(id(tensor), slot)
    versions = {id(p): p._version for p in model.parameters()}
    calls = _construction_calls(model)
    start = _generator_state(device)
    try:
        for call in calls:
            call.rng_state = _generator_state(device)
            try:
                call.writes = _trace_call(call, device)
            except Exception as error:  # noqa: BLE001 - named and raised
                raise _named(error, names, call) from error
        final = _generator_state(device)
    finally:
        _set_generator_state(device, start)
    outside = [names.get(id(p), "?") for p in model.parameters() if p._version != versions[id(p)]]
    if outside:
        raise ValueError(
            f"zero_ext.wrap: an initializer of this transformers model writes parameters outside the module it is "
            f"called on ({outside[:5]}), which wrap() cannot replay unit by unit. Pass param_init_fn=fn "
            "(called as fn(module) on every module with meta state, in model.named_modules() order)")
    written = {slot for call in calls for slot in call.writes}
    missing = []
    for module in walk:
        for slot, tensor in _slots(module, "_parameters", recurse=False):
            if first_slot[id(tensor)] == slot and slot not in written:
                missing.append(f"{_name(names, slot)} ({type(module).__name__})")
    if missing:
        raise ValueError(
            f"zero_ext.wrap: {len(missing)} parameters of this transformers model are initialized neither by a "
            f"reset_parameters() nor by its _init_weights: {', '.join(missing[:5])}. Cover them in the model's "
            "_init_weights, or pass param_init_fn=fn (called as fn(module) on every module with meta state, in "
            "model.named_modules() order)")
    calls_of: Dict[int, List[InitCall]] = {}
    for call in calls:
        calls_of.setdefault(id(call.module), []).append(call)
    return ConstructionReplay(device, walk, calls_of, first_slot, final)


def _construction_calls(model: torch.nn.Module) -> List[InitCall]:
    """The calls normal construction makes, in its order: each module's
    reset_parameters() as it is built (registration order, parents first,
    as for any module zero_ext initializes), then each PreTrainedModel's
    post_init over its subtree, children first, skipping what an inner
    post_init initialized."""
    calls: List[InitCall] = []
    built: set = set()
    initialized: set = set()

    def build(module: torch.nn.Module) -> None:
        built.add(id(module))
        if _has_own_meta_state(module) and callable(getattr(module, "reset_parameters", None)):
            calls.append(InitCall(module, None))
        for child in module.children():
            if id(child) not in built:
                build(child)
        if is_pretrained_model(module):
            for sub in _children_first(module):
                if id(sub) not in initialized:
                    initialized.add(id(sub))
                    calls.append(InitCall(sub, module))

    build(model)
    return calls


def _trace_call(call: InitCall, device: torch.device) -> FrozenSet[Slot]:
    """The slots `call` writes, found on scratch tensors: its module's own
    meta state real (filled with NaN), its descendants' meta tensors
    meta (free). A write that lands on meta drew nothing, so the call runs
    again from the same state with those slots real."""
    state = _generator_state(device)
    meta = [(slot, t) for kind in ("_parameters", "_buffers") for slot, t in _slots(call.module, kind) if t.is_meta]
    real = {slot for slot, _ in meta if slot[0] is call.module}
    while True:
        shown = {slot: _scratch(t, device) if slot in real else _like(t, torch.empty_like(t, device="meta"))
                 for slot, t in meta}
        versions = {slot: t._version for slot, t in shown.items()}
        with _shown(shown), torch.no_grad(), _guard(call):
            call.run()
        writes = {slot for slot, t in shown.items()
                  if t._version != versions[slot] or (slot in real and _filled(t))}
        missed = writes - real
        if not missed:
            return frozenset(writes)
        real |= missed
        _set_generator_state(device, state)


# --- helpers ----------------------------------------------------------------------
def _children_first(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Every module once, each after its children (post_init's order)."""
    out: List[torch.nn.Module] = []
    seen = {id(model)}

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if id(child) not in seen:
                seen.add(id(child))
                visit(child)
        out.append(module)

    visit(model)
    return out


def _slots(module: torch.nn.Module, kind: str, recurse: bool = True) -> Iterator[Tuple[Slot, torch.Tensor]]:
    modules = module.modules() if recurse else [module]
    for m in modules:
        for name, tensor in getattr(m, kind).items():
            if tensor is not None:
                yield (m, kind, name), tensor


def _get(slot: Slot) -> torch.Tensor:
    return getattr(slot[0], slot[1])[slot[2]]


def _has_own_meta_state(module: torch.nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in list(module._parameters.values()) + list(module._buffers.values()))


def _like(original: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as the same kind of object as `original` (a Parameter
    subclass keeps its class and attributes, as the initializer may read them)."""
    if not isinstance(original, torch.nn.Parameter):
        return tensor
    out = torch.Tensor._make_subclass(type(original), tensor, original.requires_grad)
    out.__dict__.update(original.__dict__)
    return out


def _scratch(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    fill = math.nan if tensor.dtype.is_floating_point or tensor.dtype.is_complex else 0
    return _like(tensor, torch.full(tensor.shape, fill, dtype=tensor.dtype, device=device))


def _filled(tensor: torch.Tensor) -> bool:
    """Whether a NaN scratch tensor was written (also through .data, which
    bumps no version)."""
    if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex) or tensor.numel() == 0:
        return False
    return not bool(torch.isnan(tensor.detach()).all())


@contextlib.contextmanager
def _shown(tensors: Dict[Slot, torch.Tensor]) -> Iterator[None]:
    """The slots hold `tensors` inside, their own tensors again after."""
    saved = {slot: _get(slot) for slot in tensors}
    try:
        for slot, tensor in tensors.items():
            getattr(slot[0], slot[1])[slot[2]] = tensor
        yield
    finally:
        for slot, tensor in saved.items():
            getattr(slot[0], slot[1])[slot[2]] = tensor


def _guard(call: InitCall):
    """post_init runs _init_weights with torch's init functions guarded
    (transformers 5: they skip tensors flagged as loaded); the same here."""
    if call.owner is None:
        return contextlib.nullcontext()
    guard = getattr(sys.modules.get("transformers.initialization"), "guard_torch_init_functions", None)
    return guard() if guard is not None else contextlib.nullcontext()


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _name(names: Dict[int, str], slot: Slot) -> str:
    prefix = names.get(id(slot[0]), "?")
    return f"{prefix}.{slot[2]}" if prefix else slot[2]


def _named(error: Exception, names: Dict[int, str], call: InitCall) -> Exception:
    message = (f"zero_ext.wrap: initializing module '{names.get(id(call.module)) or '<root>'}' "
               f"({call.describe()}) failed: {error}")
    try:
        return type(error)(message)
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        return RuntimeError(message)

