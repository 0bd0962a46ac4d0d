"""What zero_ext reads and writes on disk: sharded checkpoints (save, load,
the format and how reading distrusts it, convert), safetensors, and a
model's weights in and out (load_weights, save_weights). README.md beside
this follows one checkpoint from save to load."""
from __future__ import annotations

from .checkpoint import load, save
from .convert import convert
from .convert import main as convert_main
from .load_weights import load_weights
from .plan import local_views
from .publish import checkpoint_exists
from .reader import Checkpoint
from .save import weights_only_loadable
from .save_weights import describe_pretrained_config, export_state_dict, install_pretrained_export, save_weights

__all__ = [
    "Checkpoint",
    "checkpoint_exists",
    "convert",
    "convert_main",
    "describe_pretrained_config",
    "export_state_dict",
    "install_pretrained_export",
    "load",
    "load_weights",
    "local_views",
    "save",
    "save_weights",
    "weights_only_loadable",
]
