"""zero_ext.save and zero_ext.load: the one entry over both checkpoint
formats, and the only module that knows both. It checks the options, has
the ranks agree on the path and the options (nothing is written or read
before they do), picks the format (save: `format=`; load: what the directory
holds) and hands over to that format's package: checkpoint/ (zero_ext's
own) or dcp/ (torch.distributed.checkpoint). A save is then one job for
either format: every rank writes into the staging directory, rank 0 builds
the index and publishes it (checkpoint/publish.py), now or in the background
(asynchronous.py). The formats never import each other; what both use lies
below them (load_phases.py, safe_read.py, sealing.py, step_counts.py,
weights_only.py, checksum.py, plan.py)."""
from __future__ import annotations

import os
import shutil
import uuid
from typing import Any, Callable, Optional, Tuple

import torch

from . import asynchronous
from ..groups import Ranks, group_timeout, refuse_different_paths
from ..optim import as_one, offload_in_memory
from ..tools import require_bool, require_module, require_optimizer, state_of, state_or_none
from .checkpoint import publish
from .checkpoint import save as own_save
from .checkpoint.load import load_checkpoint
from .checkpoint.metadata import METADATA as OWN_INDEX
from .dcp import save as dcp_save
from .dcp.index import METADATA as DCP_INDEX
from .dcp.load import load_dcp
from .dcp.param_groups import group_members, group_names

FORMATS = ("zero_ext", "dcp")
DEFAULT_DCP_LAYOUT = "get_state_dict"
CLASS_MISMATCH = ("error", "fresh", "load")  # what load does when the saved optimizer class is not this one's
SAVE_CALL = "zero_ext.save(path, model, optimizer, extra=None)"
LOAD_CALL = "zero_ext.load(path, model, optimizer)"


# --- save --------------------------------------------------------------------

def save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Any = None, *,
         format: str = "zero_ext", async_save: bool = False, dcp_layout: str = DEFAULT_DCP_LAYOUT):
    """Writes a sharded checkpoint directory at `path`, atomically: every rank
    writes its own shards; the directory appears (replacing an older
    checkpoint) only once all ranks have finished. Collective: call on every
    rank with the same path. `extra` (per rank) may hold what
    torch.load(weights_only=True) reads: tensors, numbers, strings, None,
    lists, tuples and dicts of them.

    format="dcp" writes a torch.distributed.checkpoint directory instead
    (files/dcp/): `{"model": ..., "optim": ...}` in get_state_dict's layout,
    or torchtitan's with dcp_layout="torchtitan" (`extra` then holds its
    other entries: {"lr_scheduler": ..., "dataloader": ..., "train_state": ...}).

    async_save=True returns an AsyncSave at once (`wait()`, `done()`,
    `wait_for_snapshot()`): the state at the call is written and published
    in the background (files/asynchronous.py), its large tensors copied to
    host buffers by the writer thread first, which whatever zero_ext call
    changes them waits for ([Note: the snapshot of an asynchronous save] in
    tools/snapshot_gate.py); otherwise returns None when the checkpoint is
    in place. async_save takes True or False only, and
    dcp_layout applies to format="dcp" only: anything else is refused on
    every rank before anything is written."""
    require_module(model, "zero_ext.save", SAVE_CALL)
    state = state_of(model)
    asynchronous.wait_for_previous(state)  # one save at a time per model: the last one's error surfaces here
    # offload_*="nvme": the values, gradients and optimizer state this rank
    # holds in its offload files are in memory for the checkpoint's duration
    # (an asynchronous save's whole snapshot is taken inside: asynchronous.may_defer).
    with offload_in_memory([state_or_none(model)], values_changed=False):
        return _save(path, model, optimizer, extra, format, async_save, dcp_layout)


def check_save_options(format: Any, async_save: Any, dcp_layout: Any) -> None:
    """save's options as they are passed, refused (phase 0, so on every rank)
    unless each means what it says: a format's name, async_save a bool
    (bool("False") would be True), a dcp_layout only where it applies."""
    if not isinstance(format, str):
        raise TypeError(f"zero_ext.save: format must be a str, one of {list(FORMATS)}, not {format!r}")
    if format not in FORMATS:
        raise ValueError(f"zero_ext.save: format must be one of {list(FORMATS)}, not {format!r}")
    require_bool(async_save, "zero_ext.save", "async_save",
                 "pass async_save=True to write in the background (save returns a handle at once) or False (the "
                 "default) to return once the checkpoint is in place. Nothing was written")
    if format != "dcp" and not (isinstance(dcp_layout, str) and dcp_layout == DEFAULT_DCP_LAYOUT):
        raise ValueError(f"zero_ext.save: dcp_layout applies to format=\"dcp\" only, and this save's format is "
                         f"{format!r}: pass format=\"dcp\" with dcp_layout={dcp_layout!r}, or leave dcp_layout out "
                         f"for format=\"zero_ext\" (zero_ext's own checkpoints have one layout). Nothing was written")


def _save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Any, format: str,
          async_save: bool, dcp_layout: str):
    """save() with the offloaded state in memory."""
    state = state_of(model)
    original, optimizer = optimizer, as_one(optimizer)  # a list or tuple of the model's optimizers: one view
    # A pipeline stage's save is every stage's: one checkpoint of the whole model.
    ranks = Ranks(state, "zero_ext.save", across_pipeline=True)
    token = ranks.from_rank0(uuid.uuid4().hex)
    target, prepared = _agree_to_save(ranks, token, path, model, original, optimizer, extra, format, async_save,
                                      dcp_layout)
    tmp = publish.staging_path(target, token)
    error, job, members, names = None, None, None, None
    try:  # collective within the stage (its parameters' indices); its error settles across every stage below
        stage_ranks = Ranks(state, "zero_ext.save") if ranks.pp is not None else ranks
        members = group_members(state, optimizer, stage_ranks) if format == "dcp" else None
    except Exception as e:  # noqa: BLE001 - raised on every rank by settle
        error = e
    if format == "dcp":
        try:  # collective across every stage of a pipeline, whether or not members came
            names = group_names(state, optimizer, members, ranks)
        except Exception as e:  # noqa: BLE001 - raised on every rank by settle
            error = e
    if error is None and (format != "dcp" or names is not None):  # names None: a peer failed, settle raises it
        try:  # what this rank writes (a snapshot of it, asynchronous)
            if format == "dcp":
                parts = dcp_save.save_parts(model, optimizer, state, ranks, token, target, tmp, prepared, extra,
                                            names, async_save)
            else:
                parts = own_save.save_parts(model, optimizer, state, ranks, token, target, tmp, prepared, async_save)
            job = _job(ranks, token, target, tmp, *parts, index_file=DCP_INDEX if format == "dcp" else OWN_INDEX)
        except Exception as e:  # noqa: BLE001 - raised on every rank by settle
            error = e
    ranks.settle(error, action=f"zero_ext.save: preparing {target}", note="Nothing was written")
    if async_save:
        timeout = group_timeout(state.process_group) if state.process_group is not None else None
        return asynchronous.AsyncSave(job, asynchronous.Exchange(ranks, token, timeout), state)
    asynchronous.run_now(job, ranks)
    return None


def _agree_to_save(ranks: Ranks, token: str, path, model, original, optimizer, extra: Any, format: Any,
                   async_save: Any, dcp_layout: Any) -> Tuple[str, Any]:
    """Phase 0: every input checked on every rank, nothing written yet; the
    ranks agree on the path and the options. Returns the target and what the
    format prepared: the DCP layout, or zero_ext's small files' bytes."""
    error, target, prepared = None, None, None
    try:
        check_save_options(format, async_save, dcp_layout)
        require_optimizer(original, "zero_ext.save", SAVE_CALL)
        if state_or_none(optimizer) is not state_of(model):
            raise ValueError("zero_ext.save: this optimizer was not wrapped together with this model")
        target = os.path.abspath(os.fspath(path))
        if format == "dcp":
            prepared = dcp_save.checked_layout(dcp_layout, extra)
        else:
            prepared = own_save.extra_file(token, ranks.rank, extra)
        if ranks.rank == 0:
            publish.check_target(target)
            if format != "dcp":
                prepared.update(own_save.optimizer_file(token, optimizer))
    except Exception as e:  # noqa: BLE001 - raised on every rank by settle
        error = e
    # The options travel only once checked here (a refused one may not even pickle).
    asked = ranks.settle(error, None if error is not None else
                         (target, format, async_save, dcp_layout if format == "dcp" else None))
    refuse_different_paths([a[0] for a in asked], "zero_ext.save",
                           "a save writes one checkpoint at rank 0's path", "Nothing was written")
    if any(a[1:] != asked[0][1:] for a in asked):
        listed = ", ".join(f"rank {r}: format={a[1]!r}, async_save={a[2]}, dcp_layout={a[3]!r}"
                           for r, a in enumerate(asked))
        raise ValueError(f"zero_ext.save: ranks passed different options ({listed}); pass the same on every rank. "
                         "Nothing was written")
    return target, prepared


def _job(ranks: Ranks, token: str, target: str, tmp: str, write: Callable[[], Any], index: Callable[[list], Any],
         take: Optional[Callable[[], None]], index_file: str) -> asynchronous.Job:
    """Either format's save as one job: (asynchronous) this rank's snapshot
    taken, then every rank writes its part into the staging directory
    `tmp`; rank 0 builds the index from every rank's report and publishes
    `tmp` at `target` with it, written last."""
    def write_staged():
        publish.make_staging(tmp, token, ranks.rank)
        return write()

    def publish_all(reports):
        try:
            built = index(reports)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the caller
            shutil.rmtree(tmp, ignore_errors=True)
            return e, f"Nothing was published: {tmp} was removed and the previous checkpoint, if any, is untouched"
        return publish.publish(target, tmp, token, built, index_file=index_file)

    return asynchronous.Job(ranks.rank, write_staged, publish_all, lambda: shutil.rmtree(tmp, ignore_errors=True),
                            f"zero_ext.save: writing {target}",
                            f"The unfinished {tmp} was removed and the previous checkpoint, if any, is untouched",
                            take=take)


# --- load --------------------------------------------------------------------

@torch.no_grad()
def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, strict: bool = True,
         optimizer_class_mismatch: str = "error", format: None = None) -> Any:
    """Loads a checkpoint written by zero_ext.save at any world size and
    stage into a wrapped model and optimizer; returns this rank's `extra`
    (rank 0's for a rank the writer did not have). Strict like
    nn.Module.load_state_dict: with strict=False, parameters and buffers
    missing on either side are skipped (shapes must still match). A
    checkpoint saved from another optimizer class raises, unless
    optimizer_class_mismatch is "fresh" (load the model; the optimizer
    starts fresh) or "load" (its state and hyperparameters are loaded
    anyway). Every byte is checked against the checksum zero_ext.save wrote
    before any is copied. Reads nothing outside the checkpoint and unpickles
    only with weights_only=True. Collective.

    load takes no `format`: it reads zero_ext's own checkpoints and DCP
    directories alike, whichever `path` holds (format=... is refused, as
    strict and optimizer_class_mismatch of another kind are, on every
    rank before anything is read)."""
    require_module(model, "zero_ext.load", LOAD_CALL)
    asynchronous.wait_for_previous(state_of(model))  # a save in flight finishes first (its error raised here)
    # offload_*="nvme": the values, gradients and optimizer state this rank
    # holds in its offload files are in memory for the checkpoint's duration.
    try:
        with offload_in_memory([state_or_none(model)], values_changed=True):
            return _load(path, model, optimizer, strict, optimizer_class_mismatch, format)
    finally:
        # Loading is not a step: its buffers' sizes are not the step's
        # ([Note: reusable host blocks] in csrc/reusable_blocks.h).
        torch.ops.zero_ext.release_idle_host_blocks()


def check_load_options(strict: Any, optimizer_class_mismatch: Any, format: Any) -> None:
    """load's options as they are passed, refused (its first phase, so on
    every rank) unless each means what it says."""
    if format is not None:
        raise TypeError(
            f"zero_ext.load takes no format (got format={format!r}): it detects the format itself, zero_ext's own "
            "or a DCP directory (whoever wrote it), and reads either; drop format=... from the call. Nothing was "
            "loaded")
    require_bool(strict, "zero_ext.load", "strict",
                 "pass strict=True (the default: the checkpoint and the model must hold the same names) or "
                 "strict=False (load the entries both have). Nothing was loaded")
    if not isinstance(optimizer_class_mismatch, str) or optimizer_class_mismatch not in CLASS_MISMATCH:
        raise ValueError(f"zero_ext.load: optimizer_class_mismatch must be one of {list(CLASS_MISMATCH)}, not "
                         f"{optimizer_class_mismatch!r}")


def _load(path: str, model: torch.nn.Module, optimizer, strict: bool, mismatch: str, format: Any) -> Any:
    """load() with the offloaded state in memory."""
    state = state_of(model)
    original, optimizer = optimizer, as_one(optimizer)  # a list or tuple of the model's optimizers: one view
    # A pipeline stage's load is every stage's (each reads its part), so an
    # error on one stage ends every stage; within a stage, what the ranks of
    # one model exchange.
    ranks = Ranks(state, "zero_ext.load", across_pipeline=True)
    stage_ranks = Ranks(state, "zero_ext.load") if ranks.pp is not None else ranks
    target = _agree_to_load(ranks, path, original, strict, mismatch, format)
    dcp_dir = _agree_on_format(ranks, target, path)
    if dcp_dir is not None:
        return load_dcp(dcp_dir, model, optimizer, state, ranks, strict, mismatch, stage_ranks)
    return load_checkpoint(target, path, model, optimizer, state, stage_ranks, strict, mismatch)


def _agree_to_load(ranks: Ranks, path, original, strict: Any, mismatch: Any, format: Any) -> str:
    """The options checked on every rank; the ranks agree on the path and
    on optimizer_class_mismatch. Returns the path, absolute."""
    error, target = None, None
    try:
        check_load_options(strict, mismatch, format)
        require_optimizer(original, "zero_ext.load", LOAD_CALL)
        target = os.path.abspath(os.fspath(path))
    except Exception as e:  # noqa: BLE001 - a bad path or option on one rank raises on every rank
        error = e
    # The options travel only once checked here (a refused one may not even pickle).
    asked = ranks.settle(error, None if error is not None else (target, mismatch))
    refuse_different_paths([p for p, _ in asked], "zero_ext.load", "a load reads one checkpoint", "Nothing was loaded")
    if any(m != asked[0][1] for _, m in asked):
        listed = ", ".join(f"rank {r}: {m!r}" for r, (_, m) in enumerate(asked))
        raise ValueError(f"zero_ext.load: ranks passed different optimizer_class_mismatch ({listed}); pass the same "
                         "on every rank. Nothing was loaded")
    return target


def _agree_on_format(ranks: Ranks, target: str, path) -> Any:
    """The DCP directory at `target` (publish.resolve: or the save aside),
    or None where it holds zero_ext's own format; every rank must see the same."""
    error, dcp_dir = None, None
    try:
        where = publish.resolve(target, "zero_ext.load")
        dcp_dir = where if _holds_dcp(where) else None
    except Exception as e:  # noqa: BLE001 - a missing checkpoint raises on every rank
        error = e
    kinds = ranks.settle(error, dcp_dir is not None)
    if any(k != kinds[0] for k in kinds):
        raise RuntimeError(f"zero_ext.load: ranks see different checkpoints at {path} (one a DCP directory): it "
                           "was replaced during this load. Nothing was loaded; load again")
    return dcp_dir


def _holds_dcp(directory: str) -> bool:
    """A DCP directory (its `.metadata`), not a zero_ext checkpoint."""
    return (os.path.isfile(os.path.join(directory, DCP_INDEX))
            and not os.path.lexists(os.path.join(directory, OWN_INDEX)))
