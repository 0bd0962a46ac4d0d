"""zero_ext: ZeRO-style sharded data parallelism for PyTorch.

    model, optimizer = zero_ext.wrap(model, optimizer, stage=2)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

The gradient path (hooks, buckets, reductions, the once-per-backward epilogue)
runs in C++ inside the autograd engine; this package is the wiring.
"""
from .tools import __version__

try:
    from .files import checkpoint_exists, load, load_weights, save, save_weights
    from .optim import clip_grad_norm_, clip_grad_value_
    from .groups import Replicas
    from .runtime import (full_grads, full_params, full_state_dict, load_full_state_dict, memory_report,
                          register_forward_method, replica_status, set_modules_to_backward_prefetch,
                          set_modules_to_forward_prefetch, traffic)
    from .wrapping import DynamicLossScale, MixedPrecision, empty_init, skip_init, wrap
except ImportError as _error:
    import sys as _sys

    # While `python -m zero_ext.env` (or .selfcheck) locates its module,
    # argv[0] is "-m" (Python's documented behaviour). A report must run when
    # the compiled core does not load, so then the package imports without
    # its API, and using any of it raises the error.
    if _sys.argv[:1] != ["-m"]:
        raise
    _core_error = _error

    def __getattr__(name: str):
        raise ImportError(f"zero_ext.{name} is unavailable: {_core_error}") from _core_error

__all__ = [
    "DynamicLossScale",
    "MixedPrecision",
    "Replicas",
    "checkpoint_exists",
    "clip_grad_norm_",
    "clip_grad_value_",
    "empty_init",
    "full_grads",
    "full_params",
    "full_state_dict",
    "load",
    "load_full_state_dict",
    "load_weights",
    "memory_report",
    "register_forward_method",
    "replica_status",
    "save",
    "save_weights",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "skip_init",
    "traffic",
    "wrap",
]
