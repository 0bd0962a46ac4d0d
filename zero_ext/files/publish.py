"""Publishing a save and finding the last one: the only code that renames
checkpoint directories or decides which directory `path` means.

A save stages its files in `PATH.tmp-<token>`, then rank 0 moves the staged
directory into place (publish); readers find the checkpoint with resolve.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Optional, Tuple

from . import format as files

# Tests make one rank exit at a named point of a save (fault injection).
FAULT_ENV = "ZERO_EXT_TEST_SAVE_EXIT"


def maybe_die(point: str, rank: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec == f"{point}:{rank}":
        os._exit(17)


def resolve(path: str, who: str = "zero_ext") -> str:
    """The checkpoint directory to read. A save replaces an existing
    checkpoint with two renames (old aside, new in place); if it died between
    them, the previous checkpoint is still complete under its `.old-` name."""
    if os.path.isdir(path):
        return path
    aside = sorted(glob.glob(glob.escape(path) + ".old-*"), key=os.path.getmtime)
    for candidate in reversed(aside):
        if os.path.isfile(os.path.join(candidate, files.METADATA)):
            return candidate
    partial = glob.glob(glob.escape(path) + ".tmp-*")
    hint = f" (only unfinished saves: {partial}; a save died before completing)" if partial else ""
    raise FileNotFoundError(f"{who}: no checkpoint at {path}{hint}")


def check_target(path: str) -> None:
    """Rank 0, before anything is written: `path` must be new, or a checkpoint to replace."""
    if os.path.islink(path):
        raise ValueError(
            f"zero_ext.save: {path} is a symbolic link (to {os.readlink(path)}); replacing the link would leave "
            "what it points to behind. Save to the directory it points to, or remove the link. Nothing was written")
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        kind = "a regular file" if os.path.isfile(path) else "not a directory"
        raise ValueError(f"zero_ext.save: {path} exists and is {kind}, not a checkpoint directory; pass another "
                         "path or remove it. Nothing was written")
    strangers = sorted(n for n in os.listdir(path) if not files.is_checkpoint_entry(n))
    if strangers:
        raise ValueError(
            f"zero_ext.save: {path} exists and is not a zero_ext checkpoint (it holds {strangers[:3]}); save "
            "replaces only checkpoints, so pass a new path or remove the directory. Nothing was written")


def publish(target: str, tmp: str, token: str, meta: dict) -> Tuple[Optional[BaseException], str]:
    """Rank 0: metadata last, then the directory into place. Returns the
    error, if any, and what became of the directories."""
    aside, placed = None, False
    try:
        staging = os.path.join(tmp, files.METADATA + ".partial")
        files.write_file(staging, json.dumps(meta).encode())
        os.replace(staging, os.path.join(tmp, files.METADATA))
        files.fsync_dir(tmp)
        maybe_die("before_publish", 0)
        if os.path.lexists(target):
            aside = f"{target}.old-{token[:12]}"
            os.rename(target, aside)
        maybe_die("between_renames", 0)
        try:
            os.rename(tmp, target)
        except BaseException:
            if aside is not None and os.path.isdir(aside) and not os.path.lexists(target):
                os.rename(aside, target)  # the previous checkpoint back where it was
            raise
        placed = True
        files.fsync_dir(os.path.dirname(target))
    except Exception as error:  # noqa: BLE001 - reported to every rank by the caller
        if placed:
            return error, (f"The new checkpoint is at {target}, but it may not survive a crash; the previous "
                           f"one is kept at {aside}" if aside else
                           f"The new checkpoint is at {target}, but it may not survive a crash")
        shutil.rmtree(tmp, ignore_errors=True)
        return error, f"Nothing was published: {tmp} was removed and the previous checkpoint, if any, is untouched"
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return None, ""
