"""What runs while a wrapped model trains: the module hooks (gather, release,
backward bookkeeping), the wrapped module's methods, the per-model state and
its modes, and the user's calls on a wrapped model (full_params, full state
dicts, the memory report)."""
from __future__ import annotations

from . import compiled_units
from .forward_methods import register_forward_method
from .full_params import full_params
from .hooks import install_forward_hooks
from .memory_report import memory_report
from .module import ZeroExtModule, swap_module_class
from .replica_status import replica_status
from .prefetch import set_modules_to_backward_prefetch, set_modules_to_forward_prefetch
from .state import ZeroState
from .state_dict import full_grads, full_state_dict, load_full_state_dict
from .traffic import traffic

__all__ = [
    "ZeroExtModule",
    "ZeroState",
    "compiled_units",
    "full_grads",
    "full_params",
    "full_state_dict",
    "install_forward_hooks",
    "load_full_state_dict",
    "memory_report",
    "register_forward_method",
    "replica_status",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "swap_module_class",
    "traffic",
]
