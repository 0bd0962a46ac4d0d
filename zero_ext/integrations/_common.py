"""What every integration does the same way: wrap once, refuse a second
sharding system, and name the mixed precision zero_ext should run."""
from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

import torch

from ..tools import state_or_none
from ..wrapping import wrap

# zero_ext.wrap's keyword options, taken from its signature so the
# integrations accept exactly what wrap does.
WRAP_OPTIONS = tuple(name for name in inspect.signature(wrap).parameters if name not in ("model", "optimizer"))


def check_wrap_options(options: Dict[str, Any], where: str) -> Dict[str, Any]:
    unknown = sorted(set(options) - set(WRAP_OPTIONS))
    if unknown:
        raise TypeError(f"{where}: unknown zero_ext option(s) {unknown}; zero_ext.wrap takes {list(WRAP_OPTIONS)}")
    return dict(options)


def is_wrapped(obj: Any) -> bool:
    """Whether zero_ext.wrap took this model or optimizer (None: no)."""
    return state_or_none(obj) is not None


def wrap_once(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              options: Dict[str, Any]) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """zero_ext.wrap, unless this model and optimizer already are (a second
    train() call, or a model the user wrapped before handing it over)."""
    model_wrapped = is_wrapped(model)
    optimizer_wrapped = is_wrapped(optimizer)
    if model_wrapped and optimizer_wrapped:
        return model, optimizer
    if model_wrapped or optimizer_wrapped:
        raise ValueError("zero_ext: the model and the optimizer must be wrapped together: one of them already is "
                         "and the other is not. Pass both unwrapped, or both as zero_ext.wrap returned them.")
    return wrap(model, optimizer, **options)


def library_mixed_precision(requested: Optional[str], options: Dict[str, Any], where: str) -> Dict[str, Any]:
    """The library's own mixed precision flag ("bf16"/"fp16"/"no") becomes
    zero_ext's, which casts parameters and scales losses itself; the library
    must then do neither (its autocast would recast what zero_ext cast, its
    GradScaler would scale gradients no one unscales)."""
    requested = None if requested in (None, "no", "32", "32-true") else requested
    if requested is None:
        return options
    if requested not in ("bf16", "fp16"):
        raise ValueError(f"{where}: mixed precision {requested!r} is not one zero_ext runs; use 'bf16' or 'fp16' "
                         "(zero_ext steps fp32 masters either way)")
    given = options.get("mixed_precision")
    if given is not None and given != requested:
        raise ValueError(f"{where}: the library asks for {requested!r} mixed precision but zero_ext's options say "
                         f"mixed_precision={given!r}; set one of them only")
    return {**options, "mixed_precision": requested}
