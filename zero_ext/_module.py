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
from torch.utils._pytree import tree_iter, tree_map_only


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
        buckets = self._zero_ext.buckets
        previous = buckets.sync()
        buckets.set_sync(False)
        try:
            yield
        finally:
            buckets.set_sync(previous)

    def zero_grad(self, set_to_none: bool = True) -> None:
        state = self._zero_ext
        state.buckets.zero_grad(set_to_none)
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
        buckets = self._zero_ext.buckets
        buckets.gather_all()
        try:
            sd = super().state_dict(*args, **kwargs)  # type: ignore[misc]
            return type(sd)((k, v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items())
        finally:
            buckets.release_all()

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        if self._zero_ext.stage != 3:
            result = super().load_state_dict(state_dict, *args, **kwargs)  # type: ignore[misc]
            self._load_masters(state_dict)
            return result
        buckets = self._zero_ext.buckets
        buckets.gather_all()
        try:
            result = super().load_state_dict(state_dict, *args, **kwargs)  # type: ignore[misc]
            buckets.write_back_shards()
        finally:
            buckets.release_all()
        self._load_masters(state_dict)
        return result

    def _load_masters(self, state_dict: Any) -> None:
        """Mixed precision: fp32 values from the state_dict become the master
        weights (the parameters hold them rounded to the compute dtype)."""
        state = self._zero_ext
        if not state.buckets.has_masters():
            return
        missing = [n for n in state.bucketed_names if n not in state_dict]
        # strict=False: a parameter the state_dict lacks keeps its master.
        kept = state.buckets.full_masters() if missing else [None] * len(state.bucketed)
        full = [state_dict[n].detach().to(p.device, torch.float32) if n in state_dict else kept[i]
                for i, (n, p) in enumerate(zip(state.bucketed_names, state.bucketed))]
        state.buckets.load_masters(full)


_wrapped_classes: Dict[type, type] = {}


def swap_module_class(module: torch.nn.Module) -> None:
    cls = type(module)
    if cls not in _wrapped_classes:
        _wrapped_classes[cls] = type(f"ZeroExt{cls.__name__}", (ZeroExtModule, cls), {})
    module.__class__ = _wrapped_classes[cls]


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


class _LossScaleBoundary(torch.autograd.Function):
    """fp16 loss scaling: a node between the model and what it returns. Its
    backward multiplies the gradient entering the model by the loss scale
    (in fp32, before the cast back to fp16, where small gradients would
    already have underflowed), so every gradient inside carries it once.
    Being a node of its own, it scales only what comes from outside: a
    returned tensor that other returned tensors were computed from (logits
    and a loss of them) is not scaled twice."""

    @staticmethod
    def forward(ctx, buckets, tensor):  # type: ignore[override]
        ctx.buckets, ctx.dtype = buckets, tensor.dtype
        return tensor.to(torch.float32, copy=True) if tensor.dtype == torch.float16 else tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        scale = ctx.buckets.on_output_grad()
        if scale != 1.0:
            grad = grad.float() * scale
        return None, grad.to(ctx.dtype)


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


def _track_unit_inputs(buckets, unit: int, args: tuple, kwargs: dict, spent: List[Any]) -> None:
    """Reports when this use's backward is over: a multi-grad hook fires once
    the gradients of all the unit's inputs are computed (see the note at
    GradBuckets::unit_backward_done). If the graph is dropped without a
    backward (a forward for logging, a non-reentrant checkpoint's recompute),
    the hook dies with it and the use is reported over all the same.

    torch's multi-grad hook keeps the graph's nodes in its closures while the
    nodes hold the hook: a reference cycle that only the cyclic garbage
    collector frees, ~70 objects per stage 3 step. Once reported, the hook is
    of no further use: it is removed when the backward ends (a callback queued
    on the engine: not from inside the hook, while the engine runs it), or
    else at the next forward."""
    inputs = _tensors((args, kwargs))
    if not inputs:
        buckets.note_untracked_use(unit)
        return
    buckets.add_pending_use(unit)
    use, reported, handle = _UnitUse(), [False], []

    def report(*_: Any) -> None:
        if not reported[0]:
            reported[0] = True
            buckets.post_backward_use(unit)
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


def install_forward_hooks(module: torch.nn.Module, unit_modules: List[torch.nn.Module]) -> None:
    """A C++ call or two per forward of the model and of each stage 3 unit.

    The root's post hook hooks the model outputs, so the epilogue is owned by
    the outermost backward through them; in stage 3 each unit is gathered
    before its forward, released after it, and its outputs are hooked to
    gather it again before its backward.
    """
    sharded = bool(unit_modules)
    buckets = module._zero_ext.buckets

    cast_to = module._zero_ext.compute_dtype if module._zero_ext.cast_inputs else None

    def inner(t: torch.Tensor) -> torch.Tensor:
        # The model's own output fed back in (model(model(x))): use the
        # tensor from before its scaling boundary, or the gradient would be
        # scaled once per pass through it.
        unscaled = getattr(t, "_zero_ext_unscaled", None)
        if unscaled is not None and unscaled[0] is buckets:
            t = unscaled[1]
        if cast_to is not None and t.is_floating_point():
            t = t.to(cast_to)  # mixed precision: floating inputs compute in it too
        return t

    spent: List[Any] = []  # multi-grad hook handles whose use was reported

    def before_forward(mod: torch.nn.Module, args: tuple, kwargs: dict):
        buckets.reset_if_stale()
        buckets.check_param_shapes()
        _remove_spent(spent)
        if sharded:
            buckets.pre_forward(0)
        if cast_to is not None or buckets.loss_scaling():
            return tree_map_only(torch.Tensor, inner, (args, kwargs))
        return None

    def scale_boundary(t: torch.Tensor) -> torch.Tensor:
        out = _LossScaleBoundary.apply(buckets, t)
        out._zero_ext_unscaled = (buckets, t)
        return out

    def after_forward(mod: torch.nn.Module, args: Any, output: Any) -> Any:
        replaced = None
        if torch.is_grad_enabled() and buckets.loss_scaling():
            output = replaced = _map_outputs(output, scale_boundary)
        outputs = _tensors(output) if torch.is_grad_enabled() else []
        for t in outputs:
            buckets.attach_output_hook(t)
        if sharded:
            buckets.post_forward(0, outputs)
        return replaced

    module.register_forward_pre_hook(before_forward, with_kwargs=True)
    module.register_forward_hook(after_forward)

    for index, unit in enumerate(unit_modules[1:], start=1):

        def before_unit(mod: torch.nn.Module, args: tuple, kwargs: dict, u: int = index) -> None:
            buckets.pre_forward(u)
            _remove_spent(spent)  # units may run without the root (called directly)
            if torch.is_grad_enabled():
                _track_unit_inputs(buckets, u, args, kwargs, spent)

        def after_unit(mod: torch.nn.Module, args: Any, output: Any, u: int = index) -> None:
            buckets.post_forward(u, _tensors(output) if torch.is_grad_enabled() else [])

        unit.register_forward_pre_hook(before_unit, with_kwargs=True)
        unit.register_forward_hook(after_unit)
