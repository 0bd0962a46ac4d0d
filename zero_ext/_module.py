"""What wrap() adds to the user's module: hooks and the no_sync() knob.

The module's class is swapped for a subclass (as FSDP2 does), so the object,
its parameter names and its state_dict keys stay the same.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Dict, Iterator, List

import torch
from torch.utils._pytree import tree_flatten, tree_iter, tree_map_only, tree_unflatten

from ._class_swap import swap_class
from ._torch_compat import outside_compile


_NO_COPY = (
    "zero_ext: {what} a wrapped model is not supported: its parameters are views of zero_ext's "
    "flat buffers (in stage 3 they hold no data between uses) and it is tied to the optimizer and "
    "process groups. For weights, use zero_ext.full_state_dict(model) (load it into a fresh, "
    "unwrapped model for an EMA copy, or read values in place inside `with "
    "zero_ext.full_params(model):`); for checkpoints, zero_ext.save(path, model, optimizer).")


class ZeroExtModule:
    """Mixin placed in front of the user's module class by wrap()."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward calls inside accumulate gradients locally, with no
        communication; the next backward outside reduces them all."""
        core = self._zero_ext.core
        previous = core.sync()
        core.set_sync(False)
        try:
            yield
        finally:
            core.set_sync(previous)

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's knob, as nanoGPT and other DDP loops set it on micro-steps:
        False means the same as being inside no_sync() (the backward passes
        that follow accumulate locally), True reduces again."""
        return bool(self._zero_ext.core.sync())

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._zero_ext.core.set_sync(bool(value))

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """Hybrid sharding (a 2-D mesh), as FSDP2's: with False, the backward
        passes that follow still reduce their gradients within the shard
        group, so they stay sharded, but keep the sum across replicas back.
        Set it True again before the last backward of the step: its
        all-reduce across replicas then carries every deferred backward's
        share, overlapped with that backward. Whatever is still deferred
        when gradients are read (optimizer.step(), clip_grad_norm_,
        full_grads) goes across then, so results never depend on it, with
        one exception: torch.amp.GradScaler's unscale_ reads gradients by
        itself, so with a GradScaler set it True before the step's last
        backward, as FSDP2 requires of every use. Costs
        one fp32 gradient shard while anything is deferred. Every rank must
        set it alike. No effect on a flat group, nor in stage 0, which
        reduces whole gradients: use no_sync() there."""
        self._zero_ext.core.set_replica_sync(bool(requires_all_reduce))

    def zero_grad(self, set_to_none: bool = True) -> None:
        state = self._zero_ext
        state.core.zero_grad(set_to_none)
        # zero_ext's parameters are done; the rest (frozen ones that got a
        # gradient anyway) as nn.Module.zero_grad would.
        for p in self.parameters():
            if id(p) in state.param_ids or p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """model.to(), .double(), .half(), .cuda() ... after wrap(): zero_ext's
        buffers, masters and process groups are fixed to the parameters'
        dtype and device at wrap(), so a change is refused before anything
        moves; a call that changes nothing (model.to(its own device)) passes."""
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            if probe.dtype != t.dtype or probe.device != t.device:
                raise RuntimeError(
                    f"zero_ext: changing the model's dtype or device after zero_ext.wrap() is not "
                    f"supported ('{name}' would go from {t.dtype} on {t.device} to {probe.dtype} on "
                    f"{probe.device}). Move or cast the model before wrap(); for lower-precision "
                    f"compute pass mixed_precision='bf16' (or 'fp16') to wrap().")
        return super()._apply(fn, *args, **kwargs)  # type: ignore[misc]

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(_NO_COPY.format(what="copy.deepcopy() of"))

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NO_COPY.format(what="pickling (torch.save) of"))

    # Stage 3 parameters hold no memory between uses (param_storage.h), so
    # state_dict() returns gathered copies and load_state_dict() writes the
    # shards; in stages 0-2 both are PyTorch's own.
    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        if self._zero_ext.stage != 3:
            return super().state_dict(*args, **kwargs)  # type: ignore[misc]
        core = self._zero_ext.core
        core.gather_all()
        try:
            sd = super().state_dict(*args, **kwargs)  # type: ignore[misc]
            return type(sd)((k, v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items())
        finally:
            core.release_all()

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        if self._zero_ext.stage != 3:
            result = super().load_state_dict(state_dict, *args, **kwargs)  # type: ignore[misc]
            self._load_masters(state_dict)
            return result
        core = self._zero_ext.core
        core.gather_all()
        try:
            result = super().load_state_dict(state_dict, *args, **kwargs)  # type: ignore[misc]
            core.write_back_shards()
        finally:
            core.release_all()
        self._load_masters(state_dict)
        return result

    def _load_masters(self, state_dict: Any) -> None:
        """Mixed precision: fp32 values from the state_dict become the master
        weights (the parameters hold them rounded to the compute dtype)."""
        state = self._zero_ext
        if not state.core.has_masters():
            return
        missing = [n for n in state.bucketed_names if n not in state_dict]
        # strict=False: a parameter the state_dict lacks keeps its master.
        kept = state.core.full_masters() if missing else [None] * len(state.bucketed)
        full = [state_dict[n].detach().to(p.device, torch.float32) if n in state_dict else kept[i]
                for i, (n, p) in enumerate(zip(state.bucketed_names, state.bucketed))]
        state.core.load_masters(full)


def swap_module_class(module: torch.nn.Module) -> None:
    swap_class(module, ZeroExtModule)


def _tensors(output: Any) -> List[torch.Tensor]:
    """Tensors requiring grad anywhere in a forward's output: pytrees, and
    dataclasses (e.g. model outputs) that pytree does not look into."""
    found: List[torch.Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        else:
            leaves = list(tree_iter(item))  # tree_flatten's recursive closure is garbage per call
            if len(leaves) == 1 and leaves[0] is item:
                continue  # a leaf that is no tensor
            stack.extend(leaves)
    return found


def _map_outputs(output: Any, fn) -> Any:
    """`output` with `fn` applied to its floating tensors that require grad,
    dataclasses included."""
    if isinstance(output, torch.Tensor):
        return fn(output) if output.requires_grad and output.is_floating_point() else output
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        changes = {f.name: _map_outputs(getattr(output, f.name), fn) for f in dataclasses.fields(output) if f.init}
        return dataclasses.replace(output, **changes)
    leaves = list(tree_iter(output))
    if len(leaves) == 1 and leaves[0] is output:
        return output
    return tree_map_only(torch.Tensor, lambda t: _map_outputs(t, fn), output)


class _UnitUse:
    """One grad-enabled forward of a stage 3 unit whose inputs require grad."""

    __slots__ = ("__weakref__",)


def _enter_use(core, u: int, args: tuple, kwargs: dict, spent: List[Any], gather: bool) -> Any:
    """One use of stage 3 unit `u` begins: gathers it (`gather`) and, with
    grad enabled, passes its inputs that require grad through a C++ boundary
    node whose backward reports the use over (autograd_boundaries.h; [Note:
    when a unit's backward is over] in csrc/units.cpp), so the backward runs
    no Python. Returns the (args, kwargs) to call the module with, or None.
    Tensors that pytree cannot rebuild (inside a dataclass) fall back to a
    Python multi-grad hook."""
    if not torch.is_grad_enabled():
        if gather:
            core.pre_forward(u)
        return None
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # the usual call: plain tensors, positional
        positions = [k for k, a in enumerate(args) if a.requires_grad]
        tensors = [args[k] for k in positions]
        passed = core.enter_unit(u, tensors) if gather else core.track_unit_inputs(u, tensors)
        if not positions:
            return None
        replaced = list(args)
        for k, t in zip(positions, passed):
            replaced[k] = t
        return tuple(replaced), kwargs
    flat, spec = tree_flatten((args, kwargs))
    positions = [k for k, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    tensors = [flat[k] for k in positions]
    opaque = [x for x in flat if dataclasses.is_dataclass(x) and not isinstance(x, type)]
    hidden = _tensors(opaque) if opaque else []
    if hidden:
        if gather:
            core.pre_forward(u)
        _track_unit_inputs(core, u, tensors + hidden, spent)
        return None
    passed = core.enter_unit(u, tensors) if gather else core.track_unit_inputs(u, tensors)
    if not positions:
        return None
    for k, t in zip(positions, passed):
        flat[k] = t
    return tree_unflatten(flat, spec)


def _track_unit_inputs(core, unit: int, inputs: List[torch.Tensor], spent: List[Any]) -> None:
    """The fallback of _enter_use. Reports when this use's backward is over: a multi-grad hook fires once
    the gradients of all the unit's inputs are computed (see the note at
    [Note: when a unit's backward is over] in csrc/units.cpp). If the graph is dropped without a
    backward (a forward for logging, a non-reentrant checkpoint's recompute),
    the hook dies with it and the use is reported over all the same.

    torch's multi-grad hook keeps the graph's nodes in its closures while the
    nodes hold the hook: a reference cycle that only the cyclic garbage
    collector frees, ~70 objects per stage 3 step. Once reported, the hook is
    of no further use: it is removed when the backward ends (a callback queued
    on the engine: not from inside the hook, while the engine runs it), or
    else at the next forward. `inputs`: the use's inputs that require grad."""
    if not inputs:
        core.note_untracked_use(unit)
        return
    core.add_pending_use(unit)
    use, reported, handle = _UnitUse(), [False], []

    def report(*_: Any) -> None:
        if not reported[0]:
            reported[0] = True
            core.post_backward_use(unit)
            spent.extend(handle)
            if torch._C._current_graph_task_id() != -1:
                torch.autograd.Variable._execution_engine.queue_callback(lambda: _remove_spent(spent))

    def on_input_grads(grads: Any, use: _UnitUse = use) -> None:  # holds `use` alive with the graph
        report()

    handle.append(torch.autograd.graph.register_multi_grad_hook(inputs, on_input_grads, mode="all"))
    weakref.finalize(use, report)


def _remove_spent(spent: List[Any]) -> None:
    while spent:
        spent.pop().remove()


# [Note: merged units]
# The default policy merges consecutive small sibling blocks m_a..m_b into one
# unit u (see _units.default_policy); the C++ core knows only u, and these
# hooks decide when it hears of it. Inside the model's forward:
# - The first member that runs gathers u (pre_forward(u), which also
#   prefetches the next unit); a later member only checks that u is still
#   gathered (a backward or state_dict() in between may have released it) and
#   gathers it again if not.
# - A member's use is tracked as a unit's use is (see _track_unit_inputs)
#   unless every input of it that requires grad is an output of the member
#   that ran just before it: then its backward ends before that member's does,
#   and the run's first tracked use covers it. `h = block(h)` loops and
#   nn.Sequential track one use per run; a member fed from elsewhere (a
#   cross-attention input, a block applied to an earlier hidden state) tracks
#   its own.
# - Every output that requires grad gathers u before its gradient flows into
#   the member that made it: the last member's through post_forward(u,
#   outputs), which also releases u; the others' through hook_regather (a C++
#   tensor hook calling pre_forward(u), which inside a backward only gathers,
#   if released), since such an output can reach the loss without passing the
#   last member (hidden states kept for a loss of their own). In the usual
#   chain, u is gathered already when they fire. They are hooked in one call
#   when the run closes (a call into the core costs ~10-40 us).
# - If the last member does not run (skipped, or an early return), the
#   model's post-forward hook releases u.
# Outside the model's forward (a member called on its own, a checkpoint's
# recompute during backward) each member call is one use, gathered before and
# released after, exactly as a unit of one module.


class _Run:
    """A merged unit's progress through one forward of the model: open from
    the first member's forward (which gathered it) until the last member's
    forward ends, or the model's does."""

    __slots__ = ("open", "outputs", "grad", "hold", "to_hook")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.open = False
        self.outputs: List[torch.Tensor] = []  # the previous member's outputs that require grad
        self.grad = False  # whether that member ran with grad enabled
        self.hold = False  # a member returned nothing zero_ext can hook: keep it until the epilogue
        self.to_hook: List[torch.Tensor] = []  # earlier members' outputs, hooked when the run closes


class _ModelForward:
    """Whether the model's forward is running, and the merged units' runs it opened."""

    __slots__ = ("depth", "runs")

    def __init__(self) -> None:
        self.depth = 0
        self.runs: List[Any] = []  # (unit, _Run), in the order opened


def _close_run(core, u: int, run: _Run, outputs: List[torch.Tensor]) -> None:
    """Hooks the run's outputs for backward (one call for all of them; each
    is kept alive until then, as the next member's saved input mostly is
    anyway) and releases the unit."""
    to_hook, hold = run.to_hook, run.hold
    run.reset()
    if to_hook:
        core.hook_regather(to_hook, u)
    core.post_forward(u, [] if hold else outputs)  # grad enabled, no outputs: C++ keeps a trainable unit


def _grad_inputs(args: tuple, kwargs: dict) -> List[torch.Tensor]:
    """_tensors((args, kwargs)), fast for the usual call: tensors only, positional."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        return [a for a in args if a.requires_grad]
    return _tensors((args, kwargs))


def _fed_by(inputs: List[torch.Tensor], previous: List[torch.Tensor]) -> bool:
    """Whether there are inputs and every one is among `previous` (by identity)."""
    for t in inputs:
        for o in previous:
            if t is o:
                break
        else:
            return False
    return bool(inputs)


def _hook_merged_unit(core, u: int, members: tuple, probe: Any, model_forward: _ModelForward,
                      spent: List[Any]) -> None:
    """Hooks the members of merged unit `u`; see [Note: merged units]."""
    run = _Run()
    last = len(members) - 1

    def before_member(mod: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if spent:
            _remove_spent(spent)
        if model_forward.depth == 0:  # called on its own: a use like any unit's
            return _enter_use(core, u, args, kwargs, spent, gather=True)
        # Still gathered: a released parameter points at an unreadable storage,
        # never resizable ([Note: unreadable released parameters]).
        if run.open and probe is not None and probe.untyped_storage().resizable():
            if torch.is_grad_enabled() and not _fed_by(_grad_inputs(args, kwargs), run.outputs):
                return _enter_use(core, u, args, kwargs, spent, gather=False)
            return None
        core.pre_forward(u)
        if not run.open:
            run.open = True
            model_forward.runs.append((u, run))
        return _enter_use(core, u, args, kwargs, spent, gather=False)

    def make_after_member(is_last: bool):
        def after_member(mod: torch.nn.Module, args: Any, output: Any) -> None:
            grad = torch.is_grad_enabled()
            outputs = _tensors(output) if grad else []
            if model_forward.depth == 0 or not run.open:
                core.post_forward(u, outputs)
                return
            if is_last:
                _close_run(core, u, run, outputs)
                return
            if outputs:
                run.to_hook.extend(outputs)
            elif grad:
                run.hold = True
            run.outputs, run.grad = outputs, grad
        return after_member

    for position, member in enumerate(members):
        member.register_forward_pre_hook(outside_compile(before_member), with_kwargs=True)
        member.register_forward_hook(outside_compile(make_after_member(position == last)))


def install_forward_hooks(module: torch.nn.Module, units: List[tuple]) -> None:
    """A C++ call or two per forward of the model and of each stage 3 unit.

    The root's post hook hooks the model outputs, so the epilogue is owned by
    the outermost backward through them; in stage 3 each unit is gathered
    before its forward, released after it, and its outputs are hooked to
    gather it again before its backward. `units`: root first, each a tuple of
    its member modules (several for a merged unit; see [Note: merged units]).
    """
    core = module._zero_ext.core

    cast_to = module._zero_ext.compute_dtype if module._zero_ext.cast_inputs else None

    def inner(t: torch.Tensor) -> torch.Tensor:
        # The model's own output fed back in (model(model(x))): use the
        # tensor from before its scaling boundary, or the gradient would be
        # scaled once per pass through it.
        unscaled = getattr(t, "_zero_ext_unscaled", None)
        if unscaled is not None and unscaled[0] is core:
            t = unscaled[1]
        if cast_to is not None and t.is_floating_point():
            t = t.to(cast_to)  # mixed precision: floating inputs compute in it too
        return t

    spent: List[Any] = []  # multi-grad hook handles whose use was reported
    merged = any(len(members) > 1 for members in units[1:])
    model_forward = _ModelForward()

    def before_forward(mod: torch.nn.Module, args: tuple, kwargs: dict):
        core.begin_forward()  # stale round dropped, shapes checked, root unit gathered
        _remove_spent(spent)
        if merged:
            if model_forward.runs:
                # A forward nested in this model's own forward: the outer
                # one's runs are forgotten, their outputs hooked. A unit left
                # gathered is released by its next run or the epilogue.
                for u, run in model_forward.runs:
                    if run.to_hook:
                        core.hook_regather(run.to_hook, u)
                    run.reset()
                model_forward.runs.clear()
            model_forward.depth += 1
        if cast_to is not None or core.loss_scaling():
            return tree_map_only(torch.Tensor, inner, (args, kwargs))
        return None

    def scale_boundary(t: torch.Tensor) -> torch.Tensor:
        # fp16: a C++ node whose backward applies the loss scale (see
        # csrc/autograd_boundaries.h); fp16 outputs come out in fp32.
        out = core.scale_outputs([t])[0]
        out._zero_ext_unscaled = (core, t)
        return out

    def after_forward(mod: torch.nn.Module, args: Any, output: Any) -> Any:
        if merged:
            for u, run in model_forward.runs:
                if run.open:  # its last member did not run
                    with torch.set_grad_enabled(run.grad):
                        _close_run(core, u, run, run.outputs)
            model_forward.runs.clear()
        replaced = None
        if torch.is_grad_enabled() and core.loss_scaling():
            output = replaced = _map_outputs(output, scale_boundary)
        core.end_forward(_tensors(output) if torch.is_grad_enabled() else [])
        return replaced

    def end_forward(mod: torch.nn.Module, args: Any, output: Any) -> None:
        # After after_forward, and also when the forward raised (always_call):
        # then the runs it left open are forgotten (see before_forward).
        for _, run in model_forward.runs:
            run.reset()
        model_forward.runs.clear()
        model_forward.depth = max(model_forward.depth - 1, 0)

    module.register_forward_pre_hook(outside_compile(before_forward), with_kwargs=True)
    module.register_forward_hook(outside_compile(after_forward))
    if merged:
        module.register_forward_hook(outside_compile(end_forward), always_call=True)

    if merged:
        from ._units import assign_parameters

        owner = assign_parameters(module, units)
        probes: Dict[int, torch.Tensor] = {}
        for p in module.parameters():
            if p.numel() > 0:
                probes.setdefault(owner[id(p)], p)

    for index, members in enumerate(units[1:], start=1):
        if len(members) > 1:
            _hook_merged_unit(core, index, members, probes.get(index), model_forward, spent)
            continue

        def before_unit(mod: torch.nn.Module, args: tuple, kwargs: dict, u: int = index) -> Any:
            _remove_spent(spent)  # units may run without the root (called directly)
            return _enter_use(core, u, args, kwargs, spent, gather=True)

        def after_unit(mod: torch.nn.Module, args: Any, output: Any, u: int = index) -> None:
            core.post_forward(u, _tensors(output) if torch.is_grad_enabled() else [])

        members[0].register_forward_pre_hook(outside_compile(before_unit), with_kwargs=True)
        members[0].register_forward_hook(outside_compile(after_unit))
