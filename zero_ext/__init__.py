"""zero_ext: ZeRO-style sharded data parallelism for PyTorch.

    model, optimizer = zero_ext.wrap(model, optimizer, stage=2)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

The gradient path (hooks, buckets, reductions, the once-per-backward epilogue)
runs in C++ inside the autograd engine; this package is the wiring.
"""
from ._api import DynamicLossScale, MixedPrecision
from ._checkpoint import load, save
from ._clip import clip_grad_norm_
from ._deferred_init import empty_init, skip_init
from ._full_params import full_params
from ._report import memory_report
from ._save_weights import save_weights
from ._state_dict import full_grads, full_state_dict, load_full_state_dict
from ._load_weights import load_weights
from ._wrap import wrap

__all__ = [
    "DynamicLossScale",
    "MixedPrecision",
    "clip_grad_norm_",
    "empty_init",
    "full_grads",
    "full_params",
    "full_state_dict",
    "load",
    "load_full_state_dict",
    "load_weights",
    "memory_report",
    "save",
    "save_weights",
    "skip_init",
    "wrap",
]
__version__ = "0.1.0"
