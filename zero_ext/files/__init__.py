"""What zero_ext reads and writes on disk. Above: entry.py, zero_ext.save
and zero_ext.load, the one entry that picks a checkpoint format. The formats
side by side, never importing each other: checkpoint/ (zero_ext's own sharded
format: save, load, convert, and how reading distrusts a file), dcp/
(torch.distributed.checkpoint directories) and weights/ (a model's weights
in and out: safetensors, load_weights, save_weights; checkpoint/'s convert
writes safetensors through it, and it never imports checkpoint/). Below
them all, what they share: plan.py (which ranges of which tensors a rank
holds), safe_read.py (opening a file a checkpoint names, trusting nothing),
load_phases.py (the steps both loads take), sealing.py, checksum.py,
step_counts.py, weights_only.py, bytes_io.py, asynchronous.py.
README.md beside this follows one checkpoint from save to load."""
from __future__ import annotations

import importlib
from typing import Any

# The door opens lazily (PEP 562): `python -m zero_ext.convert` reads a
# checkpoint with torch alone, so importing this room must not load the
# compiled core that saving and loading a live model need.
_OFFERED = {  # name -> the module that defines it
    "Checkpoint": ".checkpoint.reader",
    "checkpoint_exists": ".checkpoint.publish",
    "convert": ".convert",
    "convert_main": ".convert",
    "describe_pretrained_config": ".weights.save_weights",
    "export_state_dict": ".weights.save_weights",
    "install_pretrained_export": ".weights.save_weights",
    "load": ".entry",
    "load_weights": ".weights.load_weights",
    "local_views": ".plan",
    "recover_from_peer": ".peer_state",
    "save": ".entry",
    "save_weights": ".weights.save_weights",
    "weights_only_loadable": ".weights_only",
}
_RENAMED = {"convert_main": "main"}

__all__ = sorted(_OFFERED)


def __getattr__(name: str) -> Any:
    if name not in _OFFERED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_OFFERED[name], __name__), _RENAMED.get(name, name))
    globals()[name] = value
    return value
