"""Reading metadata.json's JSON fields, each checked for type and range as
it is read (a bool is never an int, a number is finite), a failure naming
the metadata file and the field at fault; and the dtypes a checkpoint holds."""
from __future__ import annotations

import math
from typing import Any, Mapping, Tuple

import torch

MAX_INT = 1 << 62  # the largest integer a field may hold
DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                              torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8, torch.bool,
                              torch.complex64, torch.complex128)}


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class Fields:
    """Reads one JSON object's fields, raising ValueError that names the
    metadata file and the field at fault."""

    def __init__(self, who: str, file: str):
        self.who, self.file = who, file

    def fail(self, field: str, problem: str) -> None:
        raise ValueError(
            f"{self.who}: {self.file}: {field} {problem}. The metadata is damaged or was not written by "
            "zero_ext.save, so nothing was read from this checkpoint; restore it from a good copy")

    def get(self, obj: Mapping, key: str, field: str) -> Any:
        if key not in obj:
            self.fail(f"{field}.{key}" if field else key, "is missing")
        return obj[key]

    def dict(self, value: Any, field: str) -> dict:
        if not isinstance(value, dict):
            self.fail(field, f"must be a JSON object, not {type(value).__name__}")
        return value

    def list(self, value: Any, field: str) -> list:
        if not isinstance(value, list):
            self.fail(field, f"must be a JSON array, not {type(value).__name__}")
        return value

    def str(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            self.fail(field, f"must be a string, not {value!r}")
        return value

    def bool(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            self.fail(field, f"must be true or false, not {value!r}")
        return value

    def int(self, value: Any, field: str, low: int = 0, high: int = MAX_INT) -> int:
        if type(value) is not int or value < low or value > high:  # bool is an int to Python, not here
            self.fail(field, f"must be an integer in [{low}, {high}], not {value!r}")
        return value

    def number(self, value: Any, field: str, positive: bool = False) -> float:
        if type(value) not in (int, float) or not math.isfinite(value) or (positive and value <= 0):
            self.fail(field, f"must be a finite{' positive' if positive else ''} number, not {value!r}")
        return value

    def dtype(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or value not in DTYPES:
            self.fail(field, f"{value!r} is not one of the dtypes a checkpoint holds ({', '.join(sorted(DTYPES))})")
        return value

    def shape(self, value: Any, field: str) -> Tuple[int, ...]:
        shape = tuple(self.int(s, f"{field}[{j}]") for j, s in enumerate(self.list(value, field)))
        if numel(shape) >= MAX_INT:
            self.fail(field, f"{list(shape)} has too many elements")
        return shape
