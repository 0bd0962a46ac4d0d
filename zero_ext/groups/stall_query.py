"""Answers a stalled rank's question "where are you?" (see [Note: whereabouts]
in csrc/communicator.h).

A rank that waits in one of zero_ext's collectives past the stall interval
raises a query counter in the store. On every other rank a daemon thread,
started by wrap() and reading that one counter once a second, answers with
what the rank's main thread is doing: blocked in a torch.distributed
collective of the whole world, or running somewhere. A rank stalled while
every missing rank is blocked in such a collective knows they can never join
(`if rank == 0: model.generate(...)` then `dist.barrier()` on the others),
and raises at once instead of at the timeout. Nothing else runs on the
normal path: the thread sleeps, and its read is one store round trip a second.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import Optional, Tuple

import torch
import torch.distributed as dist

POLL_S = 1.0
# torch.distributed functions that wait for every rank of their group.
COLLECTIVES = frozenset({
    "barrier", "monitored_barrier", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
    "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
})
# Set at interpreter exit: the threads stop and are joined before Python
# finalizes, which would otherwise end a daemon thread inside a store call
# (C++ that cannot unwind: the process aborts).
_STOP = threading.Event()
_THREADS: "list[threading.Thread]" = []
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_C10D_FILE = os.path.join(_TORCH_DIR, "distributed", "distributed_c10d.py")


def _is_world(group: object) -> bool:
    if group is None or group is dist.GroupMember.WORLD:
        return True
    try:
        return dist.get_world_size(group) == dist.get_world_size()
    except (RuntimeError, ValueError, TypeError):
        return False


def describe(thread_id: int) -> Tuple[bool, str]:
    """(blocked in a world collective, where) for the thread's current stack."""
    frame = sys._current_frames().get(thread_id)
    collective = None
    caller = None
    while frame is not None:
        code = frame.f_code
        if collective is None and code.co_filename == _C10D_FILE and code.co_name in COLLECTIVES:
            collective = (code.co_name, frame.f_locals.get("group"))
        elif caller is None and not code.co_filename.startswith(_TORCH_DIR):
            caller = f"{code.co_filename}:{frame.f_lineno} ({code.co_name})"
        if collective is not None and caller is not None:
            break
        frame = frame.f_back
    caller = caller or "an unknown place"
    if collective is None:
        return False, f"running {caller}"
    name, group = collective
    if not _is_world(group):
        return False, f"in torch.distributed.{name}() of a subgroup, called from {caller}"
    return True, f"in torch.distributed.{name}() of the whole world, called from {caller}"


def start(model: torch.nn.Module, handles: object) -> Optional[threading.Thread]:
    """The answering thread for one wrapped model; it ends with the model."""
    if not hasattr(sys, "_current_frames"):
        return None
    model_ref = weakref.ref(model)
    main_thread = threading.get_ident()  # the thread that wraps is the one that trains
    # The thread holds the core (not the model) until it sees the model gone.

    def answer() -> None:
        seen = 0
        while not _STOP.wait(POLL_S):
            if model_ref() is None:
                return
            try:
                query = handles.diagnostics.stall_queries()
                if query > seen:
                    blocked, where = describe(main_thread)
                    handles.diagnostics.post_whereabouts(query, blocked, where)
                    seen = query
            except Exception:  # noqa: BLE001 - the store is gone (group destroyed): nothing left to answer
                return

    thread = threading.Thread(target=answer, name="zero_ext-whereabouts", daemon=True)
    thread.start()
    _THREADS[:] = [t for t in _THREADS if t.is_alive()] + [thread]
    return thread


@atexit.register
def _stop_all() -> None:
    _STOP.set()
    for thread in _THREADS:
        thread.join(timeout=5.0)  # a store call takes milliseconds; a dead store is not waited out
