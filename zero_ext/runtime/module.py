"""What wrap() adds to the user's module: its methods (no_sync(), DDP's
require_backward_grad_sync, state_dict() ...). The module hooks are in
zero_ext/runtime/hooks.py.

The module's class is swapped for a subclass (as FSDP2 does), so the object,
its parameter names and its state_dict keys stay the same.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, Optional

import torch

from ..groups import Ranks
from ..tools import GradLayout, require_bool, state_of, swap_class, wait_for_snapshot


_NO_COPY = (
    "zero_ext: {what} a wrapped model is not supported: its parameters are views of zero_ext's "
    "flat buffers (in stage 3 they hold no data between uses) and it is tied to the optimizer and "
    "process groups. For weights, use zero_ext.full_state_dict(model) (load it into a fresh, "
    "unwrapped model for an EMA copy, or read values in place inside `with "
    "zero_ext.full_params(model):`); for checkpoints, zero_ext.save(path, model, optimizer).")


class UnshardHandle:
    """What model.unshard(async_op=True) returns: wait() until the gathers
    it started are done (as FSDP2's UnshardHandle)."""

    def __init__(self, units: Any) -> None:
        self._units = units

    def wait(self) -> None:
        self._units.wait_unshard()


class ZeroExtModule:
    """Mixin placed in front of the user's module class by wrap()."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ itself, from a frame in zero_ext: torch.compile(model)
        # and torch._dynamo.explain(model) start their trace here, not in
        # torch.nn's (which Dynamo does not trace from: it would run the
        # hooks outside and trace each hook and the forward as graphs of
        # their own), so zero_ext's hooks and the forward are one graph, as
        # model.compile() makes them.
        return super().__call__(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward calls inside accumulate gradients locally, with no
        communication; the next backward outside reduces them all."""
        handles = state_of(self).handles
        previous = handles.reduction.sync()
        handles.reduction.set_sync(False)
        try:
            yield
        finally:
            handles.reduction.set_sync(previous)

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's knob, as nanoGPT and other DDP loops set it on micro-steps:
        False means the same as being inside no_sync() (the backward passes
        that follow accumulate locally), True reduces again."""
        return bool(state_of(self).handles.reduction.sync())

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        require_bool(value, "zero_ext", "model.require_backward_grad_sync",
                     "set it False for the micro-steps that accumulate, True for the one that reduces")
        state_of(self).handles.reduction.set_sync(value)

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
        require_bool(requires_all_reduce, "zero_ext: model.set_requires_all_reduce", "requires_all_reduce",
                     "False defers the sum across replicas, True carries it with the next backward")
        state_of(self).handles.reduction.set_replica_sync(requires_all_reduce)

    def unshard(self, async_op: bool = False) -> Optional["UnshardHandle"]:
        """Stage 3: gathers every unit now (collective: every rank calls it),
        as FSDP2's unshard(): ahead of a forward, whose units then find
        themselves gathered and release as usual after it, or to keep the
        whole model gathered until reshard(). With async_op=True the gathers
        run in the background and a handle is returned: its wait(), or the
        first forward, waits for them. Stages 0-2 hold whole parameters
        already: nothing to do."""
        require_bool(async_op, "zero_ext: model.unshard", "async_op",
                     "pass async_op=True for a handle whose wait() waits for the gathers, or False to gather now")
        handles = state_of(self).handles
        handles.units.unshard(async_op)
        return UnshardHandle(handles.units) if async_op else None

    def reshard(self) -> None:
        """Stage 3: releases every gathered unit (after unshard(), or
        reshard_after_forward=False units after a forward whose backward will
        not come). It sends nothing, but it decides what later forwards and
        backwards gather: every rank calls it at the same point."""
        state_of(self).handles.units.release_all()

    def set_gradient_divide_factor(self, factor: Optional[float]) -> None:
        """FSDP2's: the reduced gradient is the sum over every rank divided
        by `factor` instead of the number of ranks (None: the mean again),
        for losses normalized by hand (a sum over tokens, divided by the
        global token count: factor 1.0). Applies to every reduction from
        here on, in every stage; gradients accumulated under no_sync() take
        the factor in force when they are reduced. Collective: every rank
        calls it with the same factor, or every rank raises."""

        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))):
            raise TypeError(f"zero_ext: set_gradient_divide_factor takes a number or None, got "
                            f"{type(factor).__name__} {factor!r}")
        value = 0.0 if factor is None else float(factor)
        if factor is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"zero_ext: the gradient divide factor must be a finite number > 0, got {factor!r}")
        state = state_of(self)
        seen = Ranks(state, "set_gradient_divide_factor").gather(value)
        if len(set(seen)) > 1:
            raise RuntimeError(
                "zero_ext: set_gradient_divide_factor was called with different factors on the ranks "
                f"({', '.join(f'rank {r}: {v or None}' for r, v in enumerate(seen))}); every rank must pass "
                "the same one")
        state.handles.reduction.set_gradient_divide_factor(value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        require_bool(set_to_none, "zero_ext: model.zero_grad", "set_to_none")
        state = state_of(self)
        state.handles.reduction.zero_grad(set_to_none)
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
        if not state_of(self).params_sharded:
            return super().state_dict(*args, **kwargs)  # type: ignore[misc]
        handles = state_of(self).handles
        handles.units.gather_all()
        try:
            sd = super().state_dict(*args, **kwargs)  # type: ignore[misc]
            return type(sd)((k, v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items())
        finally:
            handles.units.release_all()

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        wait_for_snapshot(state_of(self))  # [Note: the snapshot of an asynchronous save]
        if not state_of(self).params_sharded:
            result = super().load_state_dict(state_dict, *args, **kwargs)  # type: ignore[misc]
            self._load_masters(state_dict)
            return result
        handles = state_of(self).handles
        handles.units.gather_all()
        try:
            result = super().load_state_dict(state_dict, *args, **kwargs)  # type: ignore[misc]
            handles.units.write_back_shards()
        finally:
            handles.units.release_all()
        self._load_masters(state_dict)
        return result

    def _load_masters(self, state_dict: Any) -> None:
        """Mixed precision: fp32 values from the state_dict become the master
        weights (the parameters hold them rounded to the compute dtype)."""
        state = state_of(self)
        if not state.handles.optimizer.has_masters():
            return
        missing = [n for n in state.bucketed_names if n not in state_dict]
        # strict=False: a parameter the state_dict lacks keeps its master.
        kept = state.handles.optimizer.full_masters() if missing else [None] * len(state.bucketed)
        full = [state_dict[n].detach().to(p.device, torch.float32) if n in state_dict else kept[i]
                for i, (n, p) in enumerate(zip(state.bucketed_names, state.bucketed))]
        state.handles.optimizer.load_masters(full)


# [Note: parameters under torch's Python tracer]
# torch.profiler's Python tracer (with_stack=True) records, on entering each
# module's __call__ (before any hook), the data pointer of every parameter of
# that module and of its .grad: only for tensors whose type is exactly Tensor
# or Parameter. That pointer read raises on zero_ext's unreadable tensors: a
# stage 3 parameter outside its unit's use ([Note: unreadable released
# parameters] in csrc/storage_release.h) and the stand-in a sharded gradient
# leaves in .grad (every grad layout but stage 0's "ddp_in_place"). So there
# each parameter zero_ext manages gets a subclass of its class, which the
# tracer passes by (as it does FSDP2's DTensor parameters): isinstance,
# identity and attributes stay; its ops stay plain tensor ops (Parameter's
# __torch_function__ is disabled) on the same tensor, for ~0.3 us more per
# op call in Python that takes one (a subclass misses torch's fast paths),
# which DDP-like stage 0, never unreadable, does not pay.


class ZeroExtParameter:
    """Mixin placed in front of the class of the parameters zero_ext manages
    wherever they may hold unreadable tensors (see [Note: parameters under
    torch's Python tracer])."""

    def __repr__(self) -> str:
        # As the user's class prints (torch's text would name the subclass).
        # A detached alias: a released parameter raises as it did.
        original = type(self).__bases__[1]
        return repr(torch.Tensor._make_subclass(original, self.detach(), self.requires_grad))


def swap_module_class(module: torch.nn.Module) -> None:
    """The module's class and, where they may hold unreadable tensors, that of
    the parameters zero_ext manages (those wrap() marked with _zero_ext_owner)."""
    swap_class(module, ZeroExtModule)
    owned = [p for p in module.parameters() if getattr(p, "_zero_ext_owner", None) is not None]
    if owned and owned[0]._zero_ext_owner().handles.reduction.grad_layout() is not GradLayout.DDP_IN_PLACE:
        for p in owned:
            if not isinstance(p, ZeroExtParameter):  # a copy of one (deepcopy keeps the class)
                swap_class(p, ZeroExtParameter)
