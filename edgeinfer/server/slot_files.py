"""The slot's state on disk: llama-server's /slots save, restore and erase for edgeinfer's one
slot (the resident sequence of the model's SessionManager: the tokens it holds and their K/V).

Files are saved sessions (edgeinfer.sessions.session_file): the model identity is checked on
restore, writes are atomic, reads bounded, and only a regular file directly inside the
--slot-save-path folder is read (safe_open). Names are checked as llama-server's
fs_validate_filename does, and besides refuse a leading '.' (hidden files, and the names the
atomic writer gives its temp files). Everything here runs on the worker thread, between
generations, so a running generation never sees its slot change.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from edgeinfer.server.errors import APIError

MAX_NAME_BYTES = 255
# llama-server's forbidden characters: ASCII ones no file name should hold, and Unicode look-alikes
# of '.', '/' and '\' (fullwidth full stop, division slash, set minus), replacement char, BOM
_FORBIDDEN = set(':*?"<>|/\\') | {"\uff0e", "\u2215", "\u2216", "\ufffd", "\ufeff"}


def check_filename(name: str) -> str:
    """`name` if it is a plain file name; a 400 naming the field otherwise."""
    reason = _name_problem(name)
    if reason:
        raise APIError(400, f"invalid field 'filename': Invalid filename {name[:80]!r}: {reason}", param="filename")
    return name


def _name_problem(name: str) -> str | None:
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "not valid UTF-8"
    if size == 0 or size > MAX_NAME_BYTES:
        return f"a file name has 1 to {MAX_NAME_BYTES} bytes"
    for c in name:
        o = ord(c)
        if o <= 0x1F or 0x7F <= o <= 0x9F or 0xD800 <= o <= 0xDFFF or c in _FORBIDDEN:
            return f"it holds {c!r}; give a plain file name in the slot save folder, not a path"
    if name[0] == " " or name[-1] in " .":
        return "no leading or trailing space, no trailing '.'"
    if ".." in name or name.startswith("."):
        return "no '..' and no leading '.'"
    return None


def _entry_problem(path: Path) -> str | None:
    """Why the existing entry at `path` may not be replaced (anything but a regular file)."""
    from edgeinfer.sessions.safe_open import kind_of

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    return f"is {kind_of(st.st_mode)}, not a regular file; not written"


def save(model, folder: str, name: str) -> dict:
    """Write the slot's tokens and K/V to `folder`/`name`; llama-server's save answer."""
    from edgeinfer.sessions.session_file import SavedSession, SessionFileError, save_session

    t0 = time.perf_counter()
    path = Path(folder) / check_filename(name)
    problem = _entry_problem(path)
    if problem:
        raise APIError(400, f"invalid field 'filename': {name!r} {problem}", param="filename")
    sessions = model.sessions
    saved = SavedSession(meta={"kind": "llama-server slot", "id_slot": 0})  # meta given: the old file is not read
    kv = sessions.export_kv()
    if kv is not None:
        saved.set_kv(kv)
    try:
        save_session(path, saved, model.identity)
        n_written = os.stat(path).st_size
    except (SessionFileError, OSError) as exc:
        raise APIError(500, f"cannot save slot 0 to {name!r}: {exc}") from None
    return {"id_slot": 0, "filename": name, "n_saved": saved.n_kv, "n_written": n_written,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}


def restore(model, folder: str, name: str) -> dict:
    """Make `folder`/`name`'s tokens and K/V the slot's; llama-server's restore answer. A file
    that is missing, corrupt or another model's is a 400 and the slot keeps what it had."""
    from edgeinfer.errors import EdgeInferError
    from edgeinfer.sessions.session_file import load_session

    t0 = time.perf_counter()
    path = Path(folder) / check_filename(name)
    refused: list[str] = []
    try:
        saved = load_session(path, model.identity, config=model.config, n_ctx=model.n_ctx, warn=refused.append)
        if refused:  # its K/V failed a check: nothing half-restored
            raise EdgeInferError(refused[0])
        n_read = os.stat(path).st_size
        if saved.n_kv:
            n = model.sessions.import_kv(*saved.saved_kv())
        else:  # an empty slot was saved: the slot becomes empty
            model.reset()
            n = 0
    except (EdgeInferError, OSError) as exc:
        # "invalid slot save file": the words llama-server's clients look for
        raise APIError(400, f"Unable to restore slot 0: invalid slot save file {name!r} ({_one_line(exc)}); "
                            "the slot is unchanged") from None
    return {"id_slot": 0, "filename": name, "n_restored": n, "n_read": n_read,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


def erase(model) -> dict:
    """Forget the slot's tokens and K/V, and the prefix cache with them (one slot: its cache is
    the slot's), so the next request prefills its whole prompt as llama-server's does."""
    n = len(model.sessions.resident_tokens())
    model.reset()
    return {"id_slot": 0, "n_erased": n}


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())
