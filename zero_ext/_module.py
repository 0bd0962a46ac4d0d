"""What wrap() adds to the user's module: hooks and the no_sync() knob.

The module's class is swapped for a subclass (as FSDP2 does), so the object,
its parameter names and its state_dict keys stay the same.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Type

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


_wrapped_classes: Dict[type, type] = {}


def swap_module_class(module: torch.nn.Module) -> None:
    cls = type(module)
    if cls not in _wrapped_classes:
        _wrapped_classes[cls] = type(f"ZeroExt{cls.__name__}", (ZeroExtModule, cls), {})
    module.__class__ = _wrapped_classes[cls]


def install_forward_hooks(module: torch.nn.Module) -> None:
    """One C++ call per forward: reset after a failed backward, and hook the
    outputs so the epilogue is owned by the outermost backward through them."""

    def before_forward(mod: torch.nn.Module, args: Any) -> None:
        mod._zero_ext.buckets.reset_if_stale()

    def after_forward(mod: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        buckets = mod._zero_ext.buckets
        leaves, _ = tree_flatten(output)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                buckets.attach_output_hook(leaf)

    module.register_forward_pre_hook(before_forward)
    module.register_forward_hook(after_forward)
