"""What torch.load(weights_only=True) reads back, checked when a save takes
a value. zero_ext's loads unpickle only that way, whatever the format
(anything else could run code when loaded), so a value they would refuse is
refused by the save, naming its innermost entry, before anything is written."""
from __future__ import annotations

import io
from typing import Any, Callable, Tuple

import torch


def serialized(value: Any) -> bytes:
    """torch.save's bytes of `value`."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def weights_only_loadable(value: Any) -> bool:
    try:
        torch.load(io.BytesIO(serialized(value)), map_location="cpu", weights_only=True)
        return True
    except Exception:  # noqa: BLE001 - unpicklable, or refused by weights_only
        return False


def _first_unsafe(value: Any, where: str) -> Tuple[str, Any]:
    """The innermost entry of `value` that weights_only cannot read back."""
    if isinstance(value, dict):
        children = [(f"{where}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        children = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    else:
        children = []
    for at, child in children:
        if not weights_only_loadable(child):
            return _first_unsafe(child, at)
    return where, value  # a leaf, or a container type weights_only refuses


def checked(value: Any, label: str, pack: Callable[[Any], bytes] = serialized) -> bytes:
    """pack(value), the bytes of a file holding `value`, once
    torch.load(weights_only=True) has read them back; otherwise a TypeError
    naming the entry of `value` (called `label`) it cannot read."""
    try:
        blob = pack(value)
        torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        return blob
    except Exception:  # noqa: BLE001 - named precisely below
        pass
    where, bad = _first_unsafe(value, label)
    raise TypeError(
        f"zero_ext.save: {where} is a {type(bad).__module__}.{type(bad).__qualname__}, which "
        "torch.load(weights_only=True) cannot read back, and zero_ext.load reads checkpoints only that way "
        "(anything else could run code when loaded). It may hold tensors, numbers, strings, bools, None and "
        "lists, tuples and dicts of them (e.g. scheduler.state_dict(), torch.get_rng_state()): store the "
        "object's state_dict() or plain values instead. Nothing was written")
