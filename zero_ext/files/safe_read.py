"""Opening and reading the files a checkpoint or a weights directory names,
trusting nothing about them: the one place where every format (checkpoint/,
dcp/, weights/) opens such a file.

- A directory is opened once (open_directory); its files are opened relative
  to that descriptor, so a path replaced meanwhile never redirects a read.
- A name inside it must be one plain component (no "/", not "." or "..", no
  NUL): nothing outside the directory is reachable, whatever a crafted index
  names. Each format also checks its names against its own pattern first.
- A file is opened with O_NOFOLLOW (a link is refused, never followed),
  O_NONBLOCK (a FIFO planted in a checkpoint cannot block the open) and
  O_CLOEXEC, and must then be a regular file.
- Reads are bounded: a whole file up to a stated limit, a range only inside
  the file and exactly its length.

A refusal raises ValueError, saying which file and why (callers and tests
know refusals by that type); a missing file raises FileNotFoundError, which
each format words its own way.
"""
from __future__ import annotations

import os
import stat
from typing import Any, BinaryIO, Optional

# Never through a link, never inherited, never blocking (the regular-file
# check after the open refuses a FIFO that O_NONBLOCK let through).
READ_NOFOLLOW = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_NONBLOCK", 0))
INDEX_LIMIT = 4 << 30  # bytes: more than any metadata file a checkpoint has
_SLICE = 16 << 20  # bytes per read() of a whole file


def open_directory(path: str) -> int:
    """A descriptor of the directory at `path`, for opening files inside it."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))


def is_plain_name(name: str) -> bool:
    """One path component naming an entry of its directory."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name
            and (os.altsep is None or os.altsep not in name))


def _refuse_leaving(name: str, dir_fd: Optional[int], shown: str, who: str) -> None:
    if dir_fd is not None and not is_plain_name(name):
        raise ValueError(f"{who}: {shown}: {name!r} is not a plain file name of its directory; nothing outside "
                         "it is read")


def open_regular(name: str, dir_fd: Optional[int], shown: str, who: str, hint: str) -> BinaryIO:
    """The regular file `name` of the directory `dir_fd` (None: a path the
    caller was given), opened without following a link, unbuffered. `shown`
    is how errors name it; `hint`, what they advise after a refused open."""
    _refuse_leaving(name, dir_fd, shown, who)
    try:
        fd = os.open(name, READ_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        raise FileNotFoundError(f"{who}: {shown} does not exist") from None
    except OSError as error:  # ELOOP: a symbolic link
        raise ValueError(f"{who}: {shown} cannot be opened as a regular file ({error}); {hint}") from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)  # before fdopen, which refuses a directory its own way
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise ValueError(f"{who}: {shown} is not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


def stat_regular(name: str, dir_fd: int, shown: str, who: str, hint: str) -> os.stat_result:
    """What `name` of the directory is, without opening it or following a
    link: a regular file's stat; a link (its message says `hint`) or another kind of file is refused."""
    _refuse_leaving(name, dir_fd, shown, who)
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"{who}: {shown} does not exist") from None
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(f"{who}: {shown} is a symbolic link; {hint}")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{who}: {shown} is not a regular file")
    return info


def read_to_end(f: BinaryIO, shown: str, who: str, limit: int = INDEX_LIMIT) -> bytes:
    """The rest of the file, refused past `limit` bytes. Read in slices: one
    read() allocates what it asks for, and returns at most ~2 GiB on Linux."""
    parts, total = [], 0
    while True:
        part = f.read(min(_SLICE, limit + 1 - total))
        if not part:
            return b"".join(parts)
        parts.append(part)
        total += len(part)
        if total > limit:
            raise ValueError(f"{who}: {shown} is larger than {limit} bytes, more than zero_ext reads of such a "
                             "file")


def read_range(f: BinaryIO, offset: int, length: int, what: str, shown: str, who: str, advice: str) -> bytes:
    """Exactly bytes [offset, offset + length) of the file, which must hold
    them: a range past its end is refused before anything is read."""
    size = os.fstat(f.fileno()).st_size
    if offset + length > size:
        raise ValueError(f"{who}: {what} lies at bytes {offset}..{offset + length} of {shown}, which has {size}: "
                         f"the file is truncated; {advice}")
    chunks, at = [], offset
    while at < offset + length:
        got = os.pread(f.fileno(), offset + length - at, at)  # at most ~2 GiB per call on Linux
        if not got:
            raise ValueError(f"{who}: {what} in {shown} is cut short; {advice}")
        chunks.append(got)
        at += len(got)
    return b"".join(chunks)


def close_opened(owner: Any) -> None:
    """Closes a reader's open files (owner.files) and its directory (owner.dir_fd)."""
    for f in owner.files.values():
        f.close()
    owner.files.clear()
    if owner.dir_fd is not None:
        os.close(owner.dir_fd)
        owner.dir_fd = None
