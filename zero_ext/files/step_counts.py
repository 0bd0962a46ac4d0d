"""Optimizer state that counts steps (Adam's "step", ...): whatever the
format, a saved count must be a non-negative integer, checked when a save
writes it and when a load reads it (float tensors such as Adam's "step"
hold one). Other scalars may be any number, as a tensor's elements may."""
from __future__ import annotations

import math
import re
from typing import Any, Optional

_COUNTS = re.compile(r"(step|steps|.*_step|.*_steps|n_iter|func_evals)\Z")
_MAX = 1 << 62


def count_problem(key: str, value: Any) -> Optional[str]:
    """Why a scalar of optimizer state cannot be what it is, or None."""
    if _COUNTS.match(key) and (type(value) is bool or not math.isfinite(value) or value < 0
                               or value != math.floor(value) or abs(value) >= _MAX):
        return f"counts steps, so it must be a non-negative integer, not {value!r}"
    return None
