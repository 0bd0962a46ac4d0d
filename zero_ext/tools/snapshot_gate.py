"""The one gate between an asynchronous save's snapshot and what changes the
state it snapshots.

[Note: the snapshot of an asynchronous save]
`zero_ext.save(..., async_save=True)` returns once the ranks have agreed
and the save's bookkeeping is done: what it writes is listed then, but the
large tensors among it (this rank's parameter shards or fp32 masters, its
optimizer state) are not copied yet. The save's writer thread copies them
first, into host buffers kept from save to save (pinned where the state is
on a GPU), before it writes any file; then it sets the save's
`snapshot_taken` event. What a forward can change in place (buffers:
BatchNorm's running statistics), scalars and anything else small are copied
at the call. So the call costs the agreement, not a copy of the state, nor
the page faults of a first save's buffers.

The checkpoint must still be the state at the call. Whatever zero_ext does
that writes those tensors therefore calls wait_for_snapshot(state) first:
the wrapped optimizer's step (optim/sharded_optimizer.py, before the
optimizer runs) and its own load_state_dict (stage 0), model.load_state_dict
(runtime/module.py; and so load_full_state_dict), full_params(writeback=True)
at its entry (runtime/full_params.py), load_weights
(files/weights/load_weights.py); zero_ext.save and zero_ext.load wait for
the whole previous save anyway (files/asynchronous.py wait_for_previous).
A forward and a backward never write them (gradients live elsewhere), so
the copy overlaps the next forward and backward, and a step waits only for
what is left of it; the copy runs at the process's own CPU priority (a
step may be waiting for it), the writing after it at the lowest
(files/asynchronous.py _yield_to_training). What the metadata holds that a
step or the user change (the fp16 loss scale, which parameters train) is
read at the call (files/checkpoint/save.py _AtCall).

What the gate cannot see, a user's in-place edit of a parameter or of the
optimizer state between the call and the copy, is caught instead of saved
torn: the save records each deferred tensor's autograd version (and, where
parameters share storage with what is saved, theirs) at the call and
compares after the copy; a change fails that save on every rank with an
error that says so (an edit through `.data` bypasses versions and is not
seen; nor is one by a C++ kernel, such as offload_optimizer="cpu"'s Adam:
that one runs inside the step, behind the gate). offload_*="nvme" copies
everything at the call (files/asynchronous.py may_defer): the state is in
memory only inside the save's call (optim/streamed_step.py
offload_in_memory) and parked in its files again when the call returns,
so a copy after it would read memory that is gone. offload_optimizer="cpu"
(masters and state in host memory) defers as in memory.
"""
from __future__ import annotations


def wait_for_snapshot(state) -> None:
    """Blocks until the asynchronous save in flight on this model (if any)
    has taken its snapshot ([Note: the snapshot of an asynchronous save]).
    Call before anything that writes parameter shards, masters or optimizer
    state. Never raises the save's error: that surfaces at its wait()."""
    save = getattr(state, "async_save", None) if state is not None else None
    if save is not None:
        save.wait_for_snapshot()
