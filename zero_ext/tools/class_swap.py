"""The one way zero_ext changes a user object's class: to a subclass that
puts a zero_ext mixin in front (ZeroExtModule, ZeroExtOptimizer,
ZeroExtParameter), so isinstance() checks, attributes and the object's
identity stay the user's.
One subclass per (mixin, class), made once: every wrapped GPT shares
ZeroExtGPT."""
from __future__ import annotations

from typing import Dict, Tuple

_subclasses: Dict[Tuple[type, type], type] = {}


def swap_class(obj: object, mixin: type) -> None:
    cls = type(obj)
    key = (mixin, cls)
    if key not in _subclasses:
        _subclasses[key] = type(f"ZeroExt{cls.__name__}", (mixin, cls), {})
    obj.__class__ = _subclasses[key]


def original_class(cls: type) -> type:
    """The user's class behind a subclass swap_class made, else `cls` itself."""
    return cls.__bases__[-1] if cls in _subclasses.values() else cls
