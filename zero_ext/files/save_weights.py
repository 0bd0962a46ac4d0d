"""zero_ext.save_weights: a wrapped model's weights as safetensors that the
safetensors package and transformers' from_pretrained read, written one
bucket at a time (memory: one bucket's full values, at most a unit).

A path ending in .safetensors gets one file. Any other path is a directory
in Hugging Face's layout: model.safetensors, or, past max_shard_size,
model-0000k-of-0000K.safetensors plus model.safetensors.index.json. Each file
appears complete or not at all (written aside, then renamed); the index is
written last, and weight files of an earlier save that the new one does not
list are removed after it.

Collective: every rank takes part in the gathers; rank 0 writes. A write
error on rank 0 raises on every rank at the end, never leaving one waiting.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple, Union

import torch

from . import safetensors as st
from .collective import Ranks as _Ranks
from .plan import persistent_buffers as _persistent_buffers
from .._state_dict import _state

def _entries(model, state, dtype: Optional[torch.dtype]):
    """(name, dtype, shape, source) in the order they are written: the
    bucketed parameters bucket by bucket, then other parameters, then the
    persistent buffers; each tied parameter once, under its first name."""
    def cast(t_dtype: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and t_dtype.is_floating_point else t_dtype

    # Without mixed precision the model's own dtype; with it, the masters' (fp32).
    masters = state.core.has_masters()
    out: List[Tuple[str, torch.dtype, Tuple[int, ...], object]] = []
    for i, (name, p) in enumerate(zip(state.bucketed_names, state.bucketed)):
        out.append((name, cast(torch.float32 if masters else p.dtype), tuple(p.shape), ("bucketed", i)))
    bucketed = {id(p) for p in state.bucketed}
    seen = set(bucketed)
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, cast(p.dtype), tuple(p.shape), ("plain", p)))
    for name, buf in _persistent_buffers(model).items():
        out.append((name, cast(buf.dtype), tuple(buf.shape), ("plain", buf)))
    return out


@torch.no_grad()
def save_weights(model: torch.nn.Module, path, dtype: Optional[torch.dtype] = None,
                 max_shard_size: Union[int, str] = "5GB") -> None:
    """Writes the model's full weights (fp32 masters under mixed precision,
    or cast to `dtype`) as safetensors; see the module's docstring."""
    state = _state(model)
    ranks = _Ranks(state)
    path = os.fspath(path)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"zero_ext.save_weights: dtype must be a floating torch.dtype or None, got {dtype!r}")
    limit = st.parse_size(max_shard_size, "zero_ext.save_weights")
    entries = _entries(model, state, dtype)
    writer: Optional[st.ModelWriter] = None
    error: Optional[BaseException] = None

    def put(i: int, value: torch.Tensor) -> None:
        nonlocal error, writer
        if ranks.rank != 0 or error is not None:
            return  # rank 0 writes; after an error it only keeps up with the gathers
        try:
            if writer is None:
                writer = st.ModelWriter(path, [(name, d, shape) for name, d, shape, _ in entries], limit)
            writer.put(i, value)
        except BaseException as e:  # noqa: BLE001 - reported to every rank below
            error = e

    layout = state.core.bucket_layout()  # (first, count, padded) per bucket
    for b in range(len(layout) // 3):
        first, count = layout[3 * b], layout[3 * b + 1]
        values = state.core.full_masters_of([b])  # collective: every rank gathers this bucket
        for k in range(count):
            put(first + k, values[k])
        del values
    for i in range(len(state.bucketed), len(entries)):
        put(i, entries[i][3][1].detach())
    if writer is not None:
        try:
            if error is None:
                writer.finish()
        except BaseException as e:  # noqa: BLE001
            error = e
        writer.abort()  # files not finished go; complete ones stay
    ranks.settle(error, action=f"zero_ext.save_weights: writing {path}",
                 note="Files already complete are left in place; the index is written last")
