"""Around the core: loading it after the torch-version and build checks,
every difference between supported torch versions, the environment report,
test-only fault injection, and the gate every room's writes of the state
pass before an asynchronous save has its snapshot (snapshot_gate)."""
from __future__ import annotations

from .arguments import described, require_bool, require_module, require_optimizer
from .class_swap import extend_class, swap_class
from .core_config import CoreConfig, dtype_name
from .core_handles import CoreHandles, CoreStats, GradLayout
from .module_state import attach_member, attach_state, member_of, owner_state, state_of, state_or_none
from .snapshot_gate import wait_for_snapshot
from .torch_compat import all_gather_into_tensor, outside_compile, traced_only_inline
from .version import __version__

# Also offered, as submodules imported where used (core_loader loads the
# compiled core, which `python -m zero_ext.env` must be able to do without):
# core_loader (ShardedModel), faults, env_report, build_check, torch_compat,
# offload_file (the "nvme" offload files).
__all__ = [
    "CoreConfig",
    "CoreHandles",
    "CoreStats",
    "GradLayout",
    "__version__",
    "all_gather_into_tensor",
    "attach_member",
    "attach_state",
    "build_check",
    "core_loader",
    "described",
    "dtype_name",
    "env_report",
    "extend_class",
    "faults",
    "member_of",
    "offload_file",
    "outside_compile",
    "owner_state",
    "require_bool",
    "require_module",
    "require_optimizer",
    "state_of",
    "state_or_none",
    "swap_class",
    "torch_compat",
    "traced_only_inline",
    "wait_for_snapshot",
]
