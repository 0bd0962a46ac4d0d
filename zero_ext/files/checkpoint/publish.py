"""Publishing a save and finding the last one: the only code that renames
checkpoint directories or decides which directory `path` means.

A save stages its files in `PATH.tmp-<token12>`, then rank 0 publishes the
staged directory at PATH in one step (publish):
- nothing at PATH yet: a plain rename;
- a checkpoint at PATH: renameat2(RENAME_EXCHANGE) swaps the two directories
  atomically, so PATH names the previous save, then the new one, and never
  nothing; the previous one, now under the staging name, is removed after;
- where the OS or the filesystem cannot exchange: two renames (the previous
  save aside to `PATH.old-<token12>`, the new one in place). A crash between
  them leaves no PATH, and resolve finds the previous save aside.
Then rank 0 removes what crashed saves to PATH left behind (remove_stale),
only directories that are recognisably zero_ext's own.
Readers find the checkpoint with resolve; checkpoint_exists asks the same
question without loading.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import glob
import json
import os
import re
import shutil
import stat
import sys
from typing import List, Optional, Tuple

from ...tools import faults
from ..bytes_io import fsync_dir, write_file
from ..safe_read import open_regular, read_to_end
from .format import STAGING_MARKER, is_checkpoint_entry
from .metadata import FORMAT, METADATA

INDEX_FILES = (METADATA, ".metadata")  # what a save writes last: zero_ext's format, DCP's


def staging_path(target: str, token: str) -> str:
    """Where a save stages its files before publishing them at `target`."""
    return f"{target}.tmp-{token[:12]}"


def make_staging(tmp: str, token: str, rank: int) -> None:
    """Creates the staging directory (every rank: one may see it first) with
    its marker, so that only zero_ext's own staging is ever cleaned up."""
    os.makedirs(tmp, exist_ok=True)
    if rank == 0:
        write_file(os.path.join(tmp, STAGING_MARKER), token.encode("ascii"))


def resolve(path: str, who: str = "zero_ext") -> str:
    """The checkpoint directory to read: `path`, or, where a save without
    exchange died between its two renames, the previous checkpoint, still
    complete under its `.old-` name."""
    if os.path.isdir(path):
        return path
    aside = sorted(glob.glob(glob.escape(path) + ".old-*"), key=os.path.getmtime)
    for candidate in reversed(aside):
        if any(os.path.isfile(os.path.join(candidate, index)) for index in INDEX_FILES):
            return candidate
    partial = glob.glob(glob.escape(path) + ".tmp-*")
    hint = f" (only unfinished saves: {partial}; a save died before completing)" if partial else ""
    raise FileNotFoundError(f"{who}: no checkpoint at {path}{hint}")


def checkpoint_exists(path) -> bool:
    """Whether `zero_ext.load(path, ...)` finds a save: the directory it
    would read (resolve) holds a regular metadata.json or DCP's `.metadata`
    (whoever wrote it), which a save writes last. Reads the filesystem only: not collective, usable before wrap() or
    init_process_group. Does not validate the save (load does, and raises if
    it is damaged), so a damaged save is not mistaken for none."""
    try:
        where = resolve(os.path.abspath(os.fspath(path)))
    except OSError:  # FileNotFoundError from resolve too
        return False
    for index in INDEX_FILES:
        try:
            if stat.S_ISREG(os.lstat(os.path.join(where, index)).st_mode):
                return True
        except OSError:
            continue
    return False


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
    strangers = sorted(n for n in os.listdir(path) if not is_checkpoint_entry(n))
    if strangers:
        raise ValueError(
            f"zero_ext.save: {path} exists and is not a zero_ext checkpoint (it holds {strangers[:3]}); save "
            "replaces only checkpoints, so pass a new path or remove the directory. Nothing was written")


# --- one atomic step -------------------------------------------------------------

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# renameat2's answers where the kernel or the filesystem cannot exchange.
_CANNOT_EXCHANGE = frozenset({errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


@functools.lru_cache(maxsize=None)
def _libc_renameat2():
    """libc's renameat2, or None (not Linux, or a libc without it: glibc < 2.28)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: str, b: str) -> bool:
    """Swaps the directories `a` and `b` in one step. False, with nothing
    changed, where the OS or the filesystem cannot; other failures raise."""
    if faults.armed("no_exchange"):  # tests: publishing as where exchange is missing
        return False
    fn = _libc_renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _CANNOT_EXCHANGE:
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE): {os.strerror(code)}", a, None, b)


def _rename_twice(target: str, tmp: str, token: str) -> str:
    """Without exchange: the previous checkpoint aside, the new one in place.
    Returns where the previous one is."""
    aside = f"{target}.old-{token[:12]}"
    os.rename(target, aside)
    faults.exit_if_armed("between_renames", 0)
    try:
        os.rename(tmp, target)
    except BaseException:
        if os.path.isdir(aside) and not os.path.lexists(target):
            os.rename(aside, target)  # the previous checkpoint back where it was
        raise
    return aside


def publish(target: str, tmp: str, token: str, meta, index_file: str = METADATA) -> Tuple[Optional[BaseException], str]:
    """Rank 0: metadata last (zero_ext's metadata.json document, or DCP's
    `.metadata` bytes with index_file=".metadata"), then the directory into
    place in one step; then the replaced checkpoint and crashed saves'
    leftovers are removed. Returns the error, if any, and what became of
    the directories."""
    old, placed = None, False  # old: where the replaced checkpoint is once the new one is placed
    try:
        staging = os.path.join(tmp, index_file + ".partial")
        write_file(staging, meta if isinstance(meta, bytes) else json.dumps(meta).encode())
        os.replace(staging, os.path.join(tmp, index_file))
        fsync_dir(tmp)
        faults.exit_if_armed("before_publish", 0)
        exchanged = False
        if not os.path.lexists(target):
            os.rename(tmp, target)
        elif _exchange(tmp, target):
            old, exchanged = tmp, True  # the previous checkpoint, now under the staging name
        else:
            old = _rename_twice(target, tmp, token)
        placed = True
        fsync_dir(os.path.dirname(target))
        if old is not None:
            faults.exit_if_armed("after_exchange" if exchanged else "after_renames", 0)
    except Exception as error:  # noqa: BLE001 - reported to every rank by the caller
        if placed:
            kept = f"; the previous one is still at {old}" if old else ""
            return error, f"The new checkpoint is at {target}, but it may not survive a crash{kept}"
        shutil.rmtree(tmp, ignore_errors=True)
        return error, f"Nothing was published: {tmp} was removed and the previous checkpoint, if any, is untouched"
    try:  # best effort: the new checkpoint is in place; leftovers are removed by a later save
        if old is not None:
            _remove_own(old, die_at="removing_old")
        remove_stale(target)
    except Exception:  # noqa: BLE001 - never fail (or leave peers waiting) over clean-up
        pass
    return None, ""


# --- leftovers of crashed saves ---------------------------------------------------

def _is_zero_ext_metadata(path: str) -> bool:
    try:
        with open_regular(path, None, path, "zero_ext", "a checkpoint's files are never links") as f:
            document = json.loads(read_to_end(f, path, "zero_ext"))
    except (OSError, ValueError, RecursionError):  # missing, a link, not a regular file, not JSON
        return False
    return isinstance(document, dict) and document.get("format") == FORMAT


def _is_own(path: str) -> bool:
    """A directory (not a link) holding zero_ext's staging marker or a
    zero_ext metadata.json. A checkpoint written before markers existed and
    exchanged out by a save that then died is recognised by the latter."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        if stat.S_ISREG(os.lstat(os.path.join(path, STAGING_MARKER)).st_mode):
            return True
    except OSError:
        pass
    return _is_zero_ext_metadata(os.path.join(path, METADATA))


def _remove_own(path: str, die_at: Optional[str] = None) -> None:
    """Removes a directory of zero_ext's own, best effort, in an order that
    leaves a part-removed one safe and still recognisable: metadata.json
    first (no longer a checkpoint resolve could pick), the marker last (the
    next save's clean-up still knows it)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return
    marker = os.path.join(path, STAGING_MARKER)
    try:
        if not os.path.lexists(marker):
            write_file(marker, b"")  # a checkpoint from before markers
    except OSError:
        pass
    try:
        names = sorted(os.listdir(path), key=lambda n: (n not in INDEX_FILES, n == STAGING_MARKER, n))
    except OSError:
        return
    for removed, name in enumerate(names, 1):
        full = os.path.join(path, name)
        try:
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.unlink(full)
        except OSError:
            pass
        if removed == 2 and die_at is not None:
            faults.exit_if_armed(die_at, 0)
    try:
        os.rmdir(path)
    except OSError:
        pass


def remove_stale(target: str) -> List[str]:
    """Rank 0, after publishing at `target`: removes what crashed saves to
    `target` left, and only what is recognisably zero_ext's own:
    `target.tmp-<12 hex>` and `target.old-<12 hex>` directories holding the
    staging marker or a zero_ext metadata.json. Returns what it removed."""
    parent, base = os.path.split(target)
    ours = re.compile(re.escape(base) + r"\.(?:tmp|old)-[0-9a-f]{12}")
    try:
        names = sorted(os.listdir(parent or "."))
    except OSError:
        return []
    removed = []
    for name in names:
        full = os.path.join(parent, name)
        if ours.fullmatch(name) and _is_own(full):
            _remove_own(full)
            removed.append(full)
    return removed
