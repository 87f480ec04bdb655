"""Saved sessions: a conversation (messages, tokens, sampling settings, optionally its K/V)
on disk, so `edgeinfer run NAME --session S` resumes it.

File: `<data dir>/sessions/<S>.npz` (data dir = `$EDGEINFER_HOME` or ~/.local/share/edgeinfer),
a numpy .npz archive:
- `header`: UTF-8 JSON {"format": "edgeinfer-session", "version": 1, "model": identity,
  "messages": [...], "sampling": {...}, "n_kv": tokens with saved K/V (0 = none)}, and
  optionally "meta": {...}, what a front end keeps beside the chat (the TUI: title, model
  reference, settings such as the context size, creation time); readers ignore it
- `tokens`: int64 token ids of the conversation so far
- `pos`, `k<i>`, `v<i>` (layer i): positions and f16 K/V of tokens[:n_kv], when saved.

The model identity (file size + sha256 of its first and last MiB + general.name) is cheap
to compute and catches a different or re-quantized file; a mismatch is refused. Writes are
atomic (temp file in the same folder, fsync, os.replace, fsync of the folder): a crash
mid-save leaves the previous file intact. A file that fails to parse or check is reported
as an EdgeInferError, never loaded half-way.

`read_session_info` reads only the header (no arrays, no model check): for listings, and for
finding the model a session was made with.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.atomic_file import write_atomically
from edgeinfer.errors import EdgeInferError

FORMAT = "edgeinfer-session"
VERSION = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_EDGE = 1 << 20  # bytes hashed at each end of the model file


class SessionFileError(EdgeInferError):
    """A saved session that cannot be read, is corrupt, or belongs to another model."""


def sessions_dir() -> Path:
    home = os.environ.get("EDGEINFER_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".local" / "share" / "edgeinfer"
    return base / "sessions"


def check_name(name: str) -> str:
    """Session names are plain file names, never paths: [A-Za-z0-9._-], not starting with '.'."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise SessionFileError(f"invalid session name {name!r}: use letters, digits, '.', '_' and '-' "
                               f"(at most 128, not starting with '.' or '-')")
    return name


def session_path(name: str, root: str | os.PathLike[str] | None = None) -> Path:
    """The file of session `name` under `root` (default: sessions_dir())."""
    return (Path(root) if root is not None else sessions_dir()) / f"{check_name(name)}.npz"


def model_identity(path: str | os.PathLike[str], name: str = "") -> dict:
    """{"name", "size", "digest"}: digest = sha256 over the first and last MiB of the file."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(_EDGE))
        if size > _EDGE:
            f.seek(max(_EDGE, size - _EDGE))
            h.update(f.read(_EDGE))
    return {"name": name, "size": size, "digest": h.hexdigest()}


@dataclass
class SavedSession:
    messages: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    # Optional K/V of tokens[:len(pos)]: per layer (n, n_head_kv, hd) f16, and positions (n,).
    k: list[np.ndarray] | None = None
    v: list[np.ndarray] | None = None
    pos: np.ndarray | None = None
    # Front-end metadata kept in the header. None on save = keep what the file already has
    # (so `edgeinfer run --session` continuing a TUI conversation keeps its title).
    meta: dict[str, Any] | None = None

    @property
    def n_kv(self) -> int:
        return 0 if self.pos is None else len(self.pos)


def save_session(path: str | os.PathLike[str], session: SavedSession, model: dict) -> Path:
    """Write `session` for model identity `model` atomically to `path`."""
    path = Path(path)
    header = {"format": FORMAT, "version": VERSION, "model": model, "messages": session.messages,
              "sampling": session.sampling, "n_kv": session.n_kv}
    meta = session.meta if session.meta is not None else _existing_meta(path)
    if meta:
        header["meta"] = meta
    arrays: dict[str, np.ndarray] = {
        "header": np.frombuffer(json.dumps(header, ensure_ascii=False).encode(), dtype=np.uint8),
        "tokens": np.asarray(session.tokens, dtype=np.int64),
    }
    if session.n_kv:
        arrays["pos"] = np.asarray(session.pos, dtype=np.int64)
        for i, (k, v) in enumerate(zip(session.k, session.v)):
            arrays[f"k{i}"] = np.asarray(k, dtype=np.float16)
            arrays[f"v{i}"] = np.asarray(v, dtype=np.float16)
    try:
        _write_atomically(path, arrays)
    except OSError as exc:
        raise SessionFileError(f"cannot write session file {path.name} ({exc.strerror or exc})") from None
    return path


def _existing_meta(path: Path) -> dict | None:
    try:
        return read_session_info(path).meta or None
    except SessionFileError:
        return None


def _write_atomically(path: Path, arrays: dict[str, np.ndarray]) -> None:
    write_atomically(path, lambda f: np.savez(f, **arrays))


def load_session(path: str | os.PathLike[str], model: dict, n_layer: int | None = None) -> SavedSession:
    """Read and check a saved session; refuses another model's session and corrupt files."""
    path = Path(path)
    where = f"session file {path.name}"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SessionFileError(f"{where} does not exist") from None
    except OSError as exc:
        raise SessionFileError(f"{where} cannot be read ({exc.strerror})") from None
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {key: z[key] for key in z.files}
        header = json.loads(arrays["header"].tobytes().decode("utf-8"))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, UnicodeDecodeError) as exc:
        raise SessionFileError(f"{where} is corrupt ({type(exc).__name__}); not loaded") from None
    _check_header(header, where)
    saved = header.get("model") or {}
    if saved.get("size") != model.get("size") or saved.get("digest") != model.get("digest"):
        raise SessionFileError(
            f"{where} was saved with another model ({saved.get('name') or '?'}, {saved.get('size')} bytes), "
            f"not the loaded {model.get('name') or '?'} ({model.get('size')} bytes); "
            f"load that model or pick another session name")
    try:
        tokens = [int(t) for t in np.asarray(arrays["tokens"], dtype=np.int64)]
        messages, sampling, meta = _header_fields(header)
        session = SavedSession(messages=messages, tokens=tokens, sampling=sampling, meta=meta)
        n_kv = int(header.get("n_kv") or 0)
        if n_kv:
            pos = np.asarray(arrays["pos"], dtype=np.int64)
            layers = n_layer if n_layer is not None else sum(1 for key in arrays if key.startswith("k"))
            k = [arrays[f"k{i}"] for i in range(layers)]
            v = [arrays[f"v{i}"] for i in range(layers)]
            if len(pos) != n_kv or n_kv > len(tokens) or any(len(a) != n_kv for a in k + v):
                raise ValueError("K/V sizes")
            session.k, session.v, session.pos = k, v, pos
    except (KeyError, ValueError, TypeError) as exc:
        raise SessionFileError(f"{where} is corrupt ({exc}); not loaded") from None
    return session


@dataclass
class SessionInfo:
    """A saved session's header: what it holds, and the identity of the model that made it."""

    name: str
    model: dict[str, Any]
    messages: list[dict]
    sampling: dict[str, Any]
    meta: dict[str, Any]
    n_kv: int
    mtime: float  # when the file was last written


def read_session_info(path: str | os.PathLike[str]) -> SessionInfo:
    """The header of a saved session, checked like load_session's but without the model check
    and without reading the token and K/V arrays (the zip member `header` only)."""
    path = Path(path)
    where = f"session file {path.name}"
    try:
        mtime = path.stat().st_mtime
        with np.load(path, allow_pickle=False) as z:
            raw = z["header"]
        header = json.loads(raw.tobytes().decode("utf-8"))
    except FileNotFoundError:
        raise SessionFileError(f"{where} does not exist") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, UnicodeDecodeError) as exc:
        raise SessionFileError(f"{where} is corrupt ({type(exc).__name__}); not loaded") from None
    _check_header(header, where)
    try:
        messages, sampling, meta = _header_fields(header)
        model = header.get("model") or {}
        if not isinstance(model, dict):
            raise ValueError("model")
        n_kv = int(header.get("n_kv") or 0)
    except (KeyError, ValueError, TypeError) as exc:
        raise SessionFileError(f"{where} is corrupt ({exc}); not loaded") from None
    return SessionInfo(name=path.stem, model=model, messages=messages, sampling=sampling,
                       meta=meta or {}, n_kv=n_kv, mtime=mtime)


def _check_header(header: Any, where: str) -> None:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SessionFileError(f"{where} is not an edgeinfer session")
    if header.get("version") != VERSION:
        raise SessionFileError(f"{where} has format version {header.get('version')!r}; "
                               f"this edgeinfer reads version {VERSION}")


def _header_fields(header: dict) -> tuple[list[dict], dict, dict | None]:
    """(messages, sampling, meta) of a header; ValueError if one has the wrong shape."""
    messages = header.get("messages") or []
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError("messages")
    sampling = header.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise ValueError("sampling")
    meta = header.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError("meta")
    return messages, sampling, meta
