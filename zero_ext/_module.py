"""What wrap() adds to the user's module: hooks and the no_sync() knob.

The module's class is swapped for a subclass (as FSDP2 does), so the object,
its parameter names and its state_dict keys stay the same.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List

import torch
from torch.utils._pytree import tree_flatten


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
        self._zero_ext.buckets.zero_grad(set_to_none)
        super().zero_grad(set_to_none)  # type: ignore[misc]

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
            return super().load_state_dict(state_dict, *args, **kwargs)  # type: ignore[misc]
        buckets = self._zero_ext.buckets
        buckets.gather_all()
        try:
            result = super().load_state_dict(state_dict, *args, **kwargs)  # type: ignore[misc]
            buckets.write_back_shards()
            return result
        finally:
            buckets.release_all()


_wrapped_classes: Dict[type, type] = {}


def swap_module_class(module: torch.nn.Module) -> None:
    cls = type(module)
    if cls not in _wrapped_classes:
        _wrapped_classes[cls] = type(f"ZeroExt{cls.__name__}", (ZeroExtModule, cls), {})
    module.__class__ = _wrapped_classes[cls]


def _tensors(output: Any) -> List[torch.Tensor]:
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def install_forward_hooks(module: torch.nn.Module, unit_modules: List[torch.nn.Module]) -> None:
    """A C++ call or two per forward of the model and of each stage 3 unit.

    The root's post hook hooks the model outputs, so the epilogue is owned by
    the outermost backward through them; in stage 3 each unit is gathered
    before its forward, released after it, and its outputs are hooked to
    gather it again before its backward.
    """
    sharded = bool(unit_modules)

    def before_forward(mod: torch.nn.Module, args: Any) -> None:
        mod._zero_ext.buckets.reset_if_stale()
        if sharded:
            mod._zero_ext.buckets.pre_forward(0)

    def after_forward(mod: torch.nn.Module, args: Any, output: Any) -> None:
        buckets = mod._zero_ext.buckets
        outputs = _tensors(output) if torch.is_grad_enabled() else []
        for t in outputs:
            buckets.attach_output_hook(t)
        if sharded:
            buckets.post_forward(0, outputs)

    module.register_forward_pre_hook(before_forward)
    module.register_forward_hook(after_forward)

    buckets = module._zero_ext.buckets
    for index, unit in enumerate(unit_modules[1:], start=1):
        unit.register_forward_pre_hook(lambda mod, args, u=index: buckets.pre_forward(u))
        unit.register_forward_hook(
            lambda mod, args, output, u=index: buckets.post_forward(
                u, _tensors(output) if torch.is_grad_enabled() else []))
