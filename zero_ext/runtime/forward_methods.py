"""zero_ext.register_forward_method: another method of a module (a generate
loop, a ViT's forward_features) gathers and releases as its forward does.

A stage 3 unit is gathered by forward hooks, which run only around
`module(...)`. The registered method runs the very hooks zero_ext installed on
the module (runtime/hooks.py, hook_forward) around itself, in the order
nn.Module runs them around forward: its parameters are gathered before it,
released after, and its outputs hooked to gather them again for backward.
On the model itself the same holds for the model's own hooks (mixed
precision's input cast, the step's bookkeeping), in every stage.

Calls nest: a registered method that calls the module's forward (generate
calling self(...)), or a forward that calls a registered method (forward
returning self.forward_features(x) + ...), runs zero_ext's hooks once, for
the outermost call. A depth counter on the module says which call that is;
only modules with a registered method carry it (their zero_ext hooks are
replaced by ones that look at it), so other modules' hooks cost nothing more.
"""
from __future__ import annotations

import functools

import torch

from ..tools import described, owner_state, require_module

_DEPTH = "_zero_ext_method_depth"


def _outermost_only(hook):
    def hook_unless_nested(module, *args):
        if module.__dict__.get(_DEPTH, 0):
            return None
        return hook(module, *args)
    return hook_unless_nested


def _enter(module, *_):
    module.__dict__[_DEPTH] = module.__dict__.get(_DEPTH, 0) + 1


def _leave(module, *_):
    module.__dict__[_DEPTH] = module.__dict__.get(_DEPTH, 0) - 1


def _count_depth(module: torch.nn.Module, hooks: list) -> None:
    """zero_ext's hooks on `module` act only at depth 0; the depth counts the
    module's forwards and registered methods in progress (entered after
    zero_ext's pre hooks, left before its post hooks)."""
    for kind, hook, handle_id in hooks:
        table = module._forward_pre_hooks if kind == "pre" else module._forward_hooks
        table[handle_id] = _outermost_only(hook)
    module.register_forward_pre_hook(_enter)
    module.register_forward_hook(_leave, prepend=True, always_call=True)


def register_forward_method(module: torch.nn.Module, name: str) -> None:
    """Makes `module.<name>(...)` gather and release like `module(...)`.

    `module` is a model wrapped by zero_ext or a submodule of it. At stage 3
    it must be the model or a unit (its parameters gather together); at
    stages 0-2, where parameters are always present, a submodule without
    hooks of its own needs nothing (the method runs as it is). Registering
    twice is harmless."""
    call = "zero_ext.register_forward_method(model, \"generate\")"
    require_module(module, "zero_ext.register_forward_method", call, "the wrapped model or one of its submodules")
    if not isinstance(name, str):
        raise TypeError(f"zero_ext.register_forward_method: name must be a str, the method's name, got "
                        f"{described(name)}: {call}")
    state = owner_state(module)
    method = getattr(module, name, None)
    if method is None or not callable(method):
        raise ValueError(f"zero_ext.register_forward_method: {type(module).__name__} has no method {name!r}")
    if getattr(method, "_zero_ext_forward_method", False):
        return
    hooks = list(module.__dict__.get("_zero_ext_forward_hooks", ()))
    if not hooks:
        if state.params_sharded:
            raise ValueError(
                f"zero_ext.register_forward_method: {type(module).__name__} is neither the wrapped model nor a "
                "stage 3 unit, so no gathering belongs to it alone; register the method on the unit that holds "
                "its parameters, or make the module a unit of its own (wrap's `units=`)")
        return
    if _DEPTH not in module.__dict__:
        _count_depth(module, hooks)
        module.__dict__[_DEPTH] = 0

    @functools.wraps(method)
    def gathered(*args, **kwargs):
        if module.__dict__[_DEPTH]:
            return method(*args, **kwargs)  # inside the module's own forward or method: gathered already
        for kind, hook, _ in hooks:
            if kind == "pre":
                replaced = hook(module, args, kwargs)
                if replaced is not None:
                    args, kwargs = replaced
        _enter(module)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            _leave(module)
            for kind, hook, _ in hooks:
                if kind == "always":
                    hook(module, args, None)
            raise
        _leave(module)
        for kind, hook, _ in hooks:
            if kind in ("post", "always"):
                replaced = hook(module, args, output)
                if replaced is not None:
                    output = replaced
        return output

    gathered._zero_ext_forward_method = True
    object.__setattr__(module, name, gathered)  # on this instance only, as FSDP2 does
