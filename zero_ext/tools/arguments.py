"""Checks of the arguments of zero_ext's public calls that every room
shares, so that a loose input gets zero_ext's own error instead of a silent
meaning or Python's error deep inside: a bool option is a bool
(bool("False") is True), the model is a module and the optimizer an
optimizer. A wrapped model and its optimizers carry the same state, so the
state alone would take either for the other.

The checks read the arguments only: ranks that pass the same arguments raise
alike. A collective call whose ranks could pass different values checks them
inside its first phase, so Ranks.settle raises the error on every rank."""
from __future__ import annotations

import reprlib
from typing import Any

import torch

from .class_swap import original_class

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60


def described(value: Any) -> str:
    """What an error says was passed: "an optimizer (AdamW)", "a module
    (Linear)", "a list [...]", "str 'yes'"."""
    name = original_class(type(value)).__name__
    if isinstance(value, torch.optim.Optimizer):
        return f"an optimizer ({name})"
    if isinstance(value, torch.nn.Module):
        return f"a module ({name})"
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        inside = ", ".join(described(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"a {name} [{inside}]"
    return f"{name} {_short.repr(value)}"


def require_bool(value: Any, who: str, name: str, to_pass: str = "") -> None:
    """TypeError unless `value` is True or False: `to_pass` says what each means."""
    if not isinstance(value, bool):
        raise TypeError(f"{who}: {name} must be True or False, got {_short.repr(value)}"
                        + (f"; {to_pass}" if to_pass else ""))


def require_module(value: Any, who: str, call: str,
                   what: str = "the wrapped model (the torch.nn.Module zero_ext.wrap returned)") -> None:
    """TypeError unless `value` is a torch.nn.Module (an optimizer, a list, None ... are named)."""
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{who}: got {described(value)} where the model goes; pass {what}: {call}")


def require_optimizer(value: Any, who: str, call: str,
                      what: str = "the optimizer zero_ext.wrap returned with this model, or the list of them") -> None:
    """TypeError unless `value` is a torch.optim.Optimizer or a non-empty
    list or tuple of them (several optimizers of one model)."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    bad = [v for v in items if not isinstance(v, torch.optim.Optimizer)]
    if not items or bad:
        given = described(value) if not items or bad[0] is value else \
            f"{described(bad[0])} in a {type(value).__name__}"
        raise TypeError(f"{who}: got {given} where the optimizer goes; pass {what}: {call}")
