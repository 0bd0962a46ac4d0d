"""The one way zero_ext changes a user object's class: to a subclass that
puts a zero_ext mixin in front (ZeroExtModule, ZeroExtOptimizer,
ZeroExtParameter), or that adds properties (extend_class), so isinstance()
checks, attributes and the object's identity stay the user's.
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


def extend_class(obj: object, label: str, key: tuple, namespace: dict) -> None:
    """`obj`'s class changed to a subclass with `namespace` (made once per
    (label, key, class)): stage 3's parameter properties
    (runtime/compiled_units.py)."""
    cls = type(obj)
    full_key = (label, key, cls)
    if full_key not in _subclasses:
        name = cls.__name__ if cls.__name__.startswith("ZeroExt") else f"ZeroExt{cls.__name__}"
        _subclasses[full_key] = type(name, (cls,), {"__module__": cls.__module__, **namespace})
    obj.__class__ = _subclasses[full_key]


def original_class(cls: type) -> type:
    """The user's class behind the subclasses swap_class and extend_class
    made, else `cls` itself."""
    made = set(_subclasses.values())
    while cls in made:
        cls = cls.__bases__[-1]
    return cls
