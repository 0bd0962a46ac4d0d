"""`python -m zero_ext.convert` over a torch.distributed.checkpoint
directory: any writer's (FSDP2's get_state_dict layout, torchtitan's, a
plain dcp.save of a state_dict, zero_ext's at any pp x dp x tp layout) into a
plain state_dict file or safetensors, parameter by parameter: each tensor
read whole from its chunks (reader.py: nothing outside the directory,
weights_only loads, each chunk checked against the metadata's dtype and
shape, and against zero_ext's checksums where its sidecar exists), written,
and dropped before the next. Peak memory: the largest tensor.

Which entries are the model's: under "model." where the checkpoint has
that prefix (get_state_dict's layout: {"model": ..., "optim": ...}), the
prefix dropped; otherwise (torchtitan's layout, a plain state_dict) every
tensor entry outside the optimizer, scheduler, data loader, training state
and zero_ext's `extra`."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from ..state_dict_file import write_state_dict_file
from ..weights import safetensors as st
from .index import SIDECAR, TensorEntry
from .reader import DcpCheckpoint

WHO = "zero_ext.convert"
# Top-level keys of what is not the model, by the writers that put them there.
NOT_MODEL = ("optim.", "optimizer.", "lr_scheduler.", "lr_schedulers.", "dataloader.", "train_state", "extra.")


def model_entries(checkpoint: DcpCheckpoint) -> Dict[str, str]:
    """Output name -> the checkpoint's key, for every tensor of the model, sorted."""
    tensors = {k for k, e in checkpoint.index.entries.items() if isinstance(e, TensorEntry)}
    prefixed = {k for k in tensors if k.startswith("model.")}
    if prefixed:
        found = {k[len("model."):]: k for k in prefixed}
    else:
        found = {k: k for k in tensors if not k.startswith(NOT_MODEL)}
    if not found:
        raise ValueError(f"{WHO}: {checkpoint.where} holds no model tensors (no 'model.' entries, and every tensor "
                         "is the optimizer's or training state's)")
    return dict(sorted(found.items()))


def convert_dcp(where: str, out: str, dtype: Optional[torch.dtype], format: str, max_bytes: int) -> int:
    """Writes the model of the DCP directory `where` to `out`; returns the
    number of tensors written."""
    checkpoint = DcpCheckpoint(where, WHO)
    try:
        entries = model_entries(checkpoint)

        def target(key: str) -> torch.dtype:
            stored = checkpoint.index.entries[key].dtype
            return dtype if dtype is not None and stored.is_floating_point else stored

        if format == "pt":
            skeleton = {name: torch.empty(checkpoint.index.entries[key].shape, dtype=target(key))
                        for name, key in entries.items()}
            fill = [(skeleton[name], lambda key=key: checkpoint.whole(key)) for name, key in entries.items()]
            write_state_dict_file(skeleton, fill, out, WHO)
        else:
            listed = [(name, target(key), tuple(checkpoint.index.entries[key].shape)) for name, key in entries.items()]
            writer = st.ModelWriter(out, listed, max_bytes)
            try:
                for i, key in enumerate(entries.values()):
                    writer.put(i, checkpoint.whole(key))
                writer.finish()
            finally:
                writer.abort()
        return len(entries)
    finally:
        checkpoint.close()


def verify_dcp(where: str) -> Tuple[List[str], str]:
    """(problems, summary) of reading every item of the DCP directory whole:
    each chunk against the metadata and, where zero_ext wrote it, against
    its checksum. Without zero_ext's sidecar only the structure is checked."""
    checkpoint = DcpCheckpoint(where, f"{WHO} --verify")
    problems: List[str] = []
    try:
        for key, entry in sorted(checkpoint.index.entries.items()):
            try:
                checkpoint.whole(key) if isinstance(entry, TensorEntry) else checkpoint.value(key)
            except (OSError, RuntimeError, ValueError) as error:
                problems.append(str(error))
        checked = ("every item against zero_ext's checksums" if checkpoint.sums is not None else
                   f"structure only: no {SIDECAR} (not written by zero_ext), so no checksums to check the values")
        summary = (f"{where}: a DCP directory, {len(checkpoint.index.entries)} items "
                   f"({len(model_entries(checkpoint)) if not problems else '?'} model tensors), {checked}")
    finally:
        checkpoint.close()
    return problems, summary
