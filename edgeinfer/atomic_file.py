"""Write a file so that a crash or kill leaves either the old or the new version, never half.

Temp file `.<stem>.<random>.tmp` in the same folder -> write -> fsync -> os.replace -> fsync
of the folder. The writer holds an flock on its temp file while it writes, so
`remove_stale_temps` (run when a folder is first used) can tell a save that was killed (its
temp file is unlocked and old) from one still under way (locked, or younger than a grace
period), and removes only the former.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Callable

try:
    import fcntl
except ImportError:  # no flock (Windows): the grace period alone protects a save under way
    fcntl = None

TEMP_GRACE_S = 30.0  # a temp file younger than this may belong to a save that has not locked it yet
_TEMP_NAME = re.compile(r"\.[A-Za-z0-9][A-Za-z0-9._-]*\.[A-Za-z0-9_]{6,}\.tmp")  # mkstemp's names


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Create or replace `path` with what `write(binary_file)` writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # "a save is under way": see remove_stale_temps
            write(f)
            f.flush()
            os.fsync(f.fileno())
            if fcntl is not None:
                os.replace(tmp, path)  # while still locked: a sweep never sees an unlocked live temp
        if fcntl is None:
            os.replace(tmp, path)  # where an open file cannot be renamed
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def is_temp_name(name: str) -> bool:
    """Whether `name` is one write_atomically gives its temp files."""
    return bool(_TEMP_NAME.fullmatch(name))


def remove_stale_temps(folder: str | os.PathLike[str], grace_s: float = TEMP_GRACE_S) -> list[str]:
    """Remove the temp files that killed saves left in `folder` (not below it): names as
    write_atomically makes them, regular files only (never a link), older than `grace_s` and not
    locked by a writer. Returns the names removed; never raises for a file it cannot handle."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not is_temp_name(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < grace_s:
                continue
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue
        try:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                continue
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # a writer holds it: a save under way
            now_st = os.stat(entry.path, follow_symlinks=False)
            if (now_st.st_dev, now_st.st_ino) == (st.st_dev, st.st_ino):  # still the file checked
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
