"""What zero_ext reads and writes on disk, in two parts over one plan:
checkpoint/ (zero_ext's own sharded format: save, load, convert, and how
reading distrusts a file) and weights/ (a model's weights in and out:
safetensors, load_weights, save_weights). plan.py says which ranges of which
tensors a rank holds (one planner for every format), bytes_io.py moves
tensors' bytes to and from files. Inside the room: weights/ never imports
checkpoint/; checkpoint/'s convert writes safetensors through weights/.
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
    "convert": ".checkpoint.convert",
    "convert_main": ".checkpoint.convert",
    "describe_pretrained_config": ".weights.save_weights",
    "export_state_dict": ".weights.save_weights",
    "install_pretrained_export": ".weights.save_weights",
    "load": ".checkpoint.load",
    "load_weights": ".weights.load_weights",
    "local_views": ".plan",
    "save": ".checkpoint.save",
    "save_weights": ".weights.save_weights",
    "weights_only_loadable": ".checkpoint.save",
}
_RENAMED = {"convert_main": "main"}

__all__ = sorted(_OFFERED)


def __getattr__(name: str) -> Any:
    if name not in _OFFERED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_OFFERED[name], __name__), _RENAMED.get(name, name))
    globals()[name] = value
    return value
