"""Open a file that must be a regular file inside one folder: never block, never follow a link out.

Saved sessions and conversations are files someone else may have planted: a FIFO (an open
that waits for a writer for ever), a device (/dev/zero reads for ever), a symbolic link to
a file elsewhere. `open_regular` refuses all of them before reading a byte:
- the path, links resolved, must name an entry of `folder` (links within it are fine);
- the resolved file is opened with O_NOFOLLOW (swapped for a link since: refused) and
  O_NONBLOCK (a FIFO opens at once instead of waiting);
- the open descriptor must be a regular file (fstat, so no race with the name) of at most
  `max_bytes`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from edgeinfer.errors import EdgeInferError

_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
          | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


class RefusedFile(EdgeInferError):
    """A file that is not a regular file inside its folder, or too large; the text is the reason
    alone ("is a FIFO, not a regular file"), for the caller to prefix with the file's name."""


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a plain file"


def inside(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> str | None:
    """The real path of `path` when, links resolved, it is an entry of `folder`; else None."""
    real = os.path.realpath(path)
    return real if os.path.dirname(real) == os.path.realpath(folder) else None


def open_regular(path: str | os.PathLike[str], folder: str | os.PathLike[str], max_bytes: int) -> BinaryIO:
    """`path` opened for binary reading; RefusedFile when it is anything but a regular file of
    at most `max_bytes` directly inside `folder`."""
    path = Path(path)
    try:
        first = os.lstat(path)
    except FileNotFoundError:
        raise RefusedFile("does not exist") from None
    except OSError as exc:
        raise RefusedFile(f"cannot be read ({exc.strerror or exc})") from None
    real = inside(path, folder)
    if real is None:
        what = "a symbolic link pointing" if stat.S_ISLNK(first.st_mode) else "a file"
        raise RefusedFile(f"is {what} out of its folder {Path(folder).name}; not opened")
    try:
        st = os.stat(real, follow_symlinks=False)
    except FileNotFoundError:
        raise RefusedFile("is a symbolic link to a file that does not exist") from None
    except OSError as exc:
        raise RefusedFile(f"cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):  # checked before the open: opening a device can act on it
        raise RefusedFile(f"is {kind_of(st.st_mode)}, not a regular file; not opened")
    try:
        fd = os.open(real, _FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedFile("became a symbolic link while it was opened; not opened") from None
        raise RefusedFile(f"cannot be read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)  # the file actually opened, whatever the name points to now
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFile(f"is {kind_of(st.st_mode)}, not a regular file; not opened")
        if st.st_size > max_bytes:
            raise RefusedFile(f"is {st.st_size} bytes, more than the {max_bytes} such a file may hold; "
                              f"not opened")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
