"""Saved sessions: a conversation (messages, tokens, sampling settings, optionally its K/V)
on disk, so `edgeinfer run NAME --session S` resumes it.

File: `<data dir>/sessions/<S>.npz` (data dir = `$EDGEINFER_HOME` or ~/.local/share/edgeinfer),
a numpy .npz archive:
- `header`: UTF-8 JSON {"format": "edgeinfer-session", "version": 3, "model": identity,
  "messages": [...], "sampling": {...}, "n_kv": tokens with saved K/V (0 = none),
  "n_state": tokens the saved recurrent state summarizes (0 = none; a hybrid model's), and
  optionally "meta": {...}, what a front end keeps beside the chat (the TUI: title, model
  reference, settings such as the context size, creation time); readers ignore it
- `tokens`: int64 token ids of the conversation so far
- `pos`, `k<i>`, `v<i>` (layer i): positions and K/V of tokens[:n_kv], when saved, as the
  cache stores them: f16 values, or (version 3) a quantized cache type's raw ggml blocks
  (uint8), the header's "kv_types" (CacheTypes.key, "k=q8_0,v=q8_0"; absent: f16) saying
  which. Rows a sliding window dropped carry CacheTypes.blank_rows' marker (NaN values, or
  NaN block scales). K/V are resumed only under the same cache types (refused in one line).
- `conv.<i>`, `ssm.<i>` (recurrent layer i, version 2): float32 recurrent state after
  tokens[:n_state], n_state = n_kv (edgeinfer.kv.recurrent.RecurrentState.export).
Version 1 files (no state) still load.

The model identity (file size + sha256 of its first and last MiB + general.name) is cheap
to compute and catches a different or re-quantized file; a mismatch is refused. Writes are
atomic (temp file in the same folder, fsync, os.replace, fsync of the folder): a crash
mid-save leaves the previous file intact; the temp files of a save that was killed are
removed the first time a process uses the folder (atomic_file.remove_stale_temps).

Every file is someone else's input (docs/architecture.md, "Hostile input"). Only a regular
file inside the sessions folder is opened (safe_open: no FIFO, device or link out). The zip directory is
bounded before it is parsed; each member's .npy header is checked against the member's real
size, its dtype and caps (16 MiB of JSON header, 4M tokens, compressed K/V that expand at
most 32x, K/V of the model's shape when the caller gives it) before its data are read, in
bounded chunks. A file that fails to parse or check is reported as an EdgeInferError, never
loaded half-way; K/V that fail theirs (NaN or Inf, positions out of range) are dropped with
a one-line warning and the messages still load. Reading never writes the file.

`read_session_info` reads only the header (no arrays, no model check): for listings, and for
finding the model a session was made with.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import struct
import sys
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np

from edgeinfer.atomic_file import remove_stale_temps, write_atomically
from edgeinfer.errors import EdgeInferError
from edgeinfer.kv.cache_types import F16, CacheTypeError, CacheTypes, from_key
from edgeinfer.kv.saved import F16_KEY, SavedKV
from edgeinfer.sessions.safe_open import RefusedFile, open_regular

FORMAT = "edgeinfer-session"
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # 1: before recurrent states; 2: before quantized K/V (kv_types)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_EDGE = 1 << 20  # bytes hashed at each end of the model file

# Bounds on what a session file may make us read (docs/architecture.md, "Hostile input").
MAX_FILE_BYTES = 1 << 40
MAX_HEADER_BYTES = 16 << 20  # the JSON header: messages, sampling, meta
MAX_TOKENS = 1 << 22
MAX_LAYERS = 1024
MAX_MEMBERS = 2 * MAX_LAYERS + 8
MAX_ROW = 1 << 16  # elements of one K/V row (n_head_kv * head_dim)
MAX_EXPANSION = 32  # a compressed K/V member may expand this much (+1 MiB); f16 K/V barely compress
_NPY_HEADER_MAX = 10000  # numpy's own limit on an .npy header
_CHUNK = 16 << 20


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
    # A hybrid model's recurrent state after the K/V's tokens (RecurrentState.export's arrays).
    state: dict[str, np.ndarray] | None = None
    # Set by load_session when the file held K/V it refused (the one line saying why).
    kv_refused: str | None = None
    # The cache types the K/V are stored as (CacheTypes.key).
    kv_types: str = F16_KEY

    @property
    def n_kv(self) -> int:
        return 0 if self.pos is None else len(self.pos)

    def set_kv(self, kv: SavedKV) -> None:
        """Take a sequence's saved K/V (SessionManager.export_kv) with their tokens."""
        self.tokens, self.k, self.v, self.pos, self.state, self.kv_types = \
            list(kv.tokens), kv.k, kv.v, kv.pos, kv.state, kv.kv_types

    def saved_kv(self) -> SavedKV | None:
        """The K/V to import (SessionManager.import_kv(*saved_kv)), or None when it has none."""
        if not self.n_kv:
            return None
        return SavedKV(self.tokens, self.k, self.v, self.pos, self.state, self.kv_types)


def save_session(path: str | os.PathLike[str], session: SavedSession, model: dict) -> Path:
    """Write `session` for model identity `model` atomically to `path`."""
    path = Path(path)
    _first_use(path.parent)
    header = {"format": FORMAT, "version": VERSION, "model": model, "messages": session.messages,
              "sampling": session.sampling, "n_kv": session.n_kv,
              "n_state": session.n_kv if session.n_kv and session.state else 0}
    if session.n_kv:
        header["kv_types"] = session.kv_types
    meta = session.meta if session.meta is not None else _existing_meta(path)
    if meta:
        header["meta"] = meta
    arrays: dict[str, np.ndarray] = {
        "header": np.frombuffer(json.dumps(header, ensure_ascii=False).encode(), dtype=np.uint8),
        "tokens": np.asarray(session.tokens, dtype=np.int64),
    }
    if session.n_kv:
        arrays["pos"] = np.asarray(session.pos, dtype=np.int64)
        types = CacheTypes(*from_key(session.kv_types))
        for i, (k, v) in enumerate(zip(session.k, session.v)):
            arrays[f"k{i}"] = np.asarray(k, dtype=types.dtype("k"))
            arrays[f"v{i}"] = np.asarray(v, dtype=types.dtype("v"))
        for name, a in (session.state or {}).items():
            arrays[name] = np.asarray(a, dtype=np.float32)
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


def load_session(path: str | os.PathLike[str], model: dict, n_layer: int | None = None, *,
                 config: Any = None, n_ctx: int | None = None,
                 warn: Callable[[str], None] | None = None) -> SavedSession:
    """Read and check a saved session; refuses another model's session and corrupt files.

    `config` (the model's config: n_layer, n_head_kv, head_dim, head_dim_v) and `n_ctx` make
    the K/V checks exact: each K/V member must have the model's shape, so no more is ever read
    than the model's real K/V size. K/V that fail a check (NaN or Inf values, positions out of
    range, sizes that do not fit) are dropped: the messages load, `kv_refused` says why and
    `warn` (default: one line on stderr) is told; the file is left as it is.
    """
    path = Path(path)
    where = f"session file {path.name}"
    if config is not None and n_layer is None:
        n_layer = int(config.n_layer)
    with _Archive(path, where) as archive:
        header = archive.header()
        saved = header.get("model") or {}
        if not isinstance(saved, dict) or saved.get("size") != model.get("size") \
                or saved.get("digest") != model.get("digest"):
            saved = saved if isinstance(saved, dict) else {}
            raise SessionFileError(
                f"{where} was saved with another model ({saved.get('name') or '?'}, {saved.get('size')} bytes), "
                f"not the loaded {model.get('name') or '?'} ({model.get('size')} bytes); "
                f"load that model or pick another session name")
        try:
            messages, sampling, meta = _header_fields(header)
            tokens_array = archive.read(archive.probe("tokens", np.int64, 1, MAX_TOKENS * 8))
        except (_Bad, ValueError, TypeError) as exc:
            raise SessionFileError(f"{where} is corrupt ({exc}); not loaded") from None
        tokens = tokens_array.tolist()
        session = SavedSession(messages=messages, tokens=tokens, sampling=sampling, meta=meta)
        try:
            n_kv = header.get("n_kv") or 0
            if not isinstance(n_kv, int) or isinstance(n_kv, bool):
                raise _Bad(f"n_kv is {n_kv!r}")
            if n_kv:
                types = _kv_types(header)
                kv = _read_kv(archive, n_kv, tokens_array, n_layer, config, n_ctx, types)
                state = _read_state(archive, header, n_kv, config)
                (session.k, session.v, session.pos), session.state = kv, state  # all or nothing
                session.kv_types = types.key
        except _Bad as exc:
            session.kv_refused = f"{where}: its saved K/V were not loaded ({exc}); the conversation is read again"
            (warn or _warn_stderr)(session.kv_refused)
    return session


def _kv_types(header: dict) -> CacheTypes:
    """The cache types the file's K/V are stored as (f16 for files before them)."""
    key = header.get("kv_types", F16_KEY)
    try:
        return CacheTypes(*from_key(key))
    except CacheTypeError:
        raise _Bad(f"kv_types is {key!r}") from None


def _saved_rows(config: Any, layer: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, size) of layer's saved K and V rows (ModelConfig.saved_kv_shapes; plain
    (n_head_kv, head_dim[_v]) for a config without it)."""
    shapes = getattr(config, "saved_kv_shapes", None)
    if shapes is not None:
        return shapes(layer)
    return (int(config.n_head_kv), int(config.head_dim)), (int(config.n_head_kv), int(config.head_dim_v))


def _warn_stderr(message: str) -> None:
    print(f"edgeinfer: warning: {message}", file=sys.stderr)


def _read_kv(archive: "_Archive", n_kv: int, tokens: np.ndarray, n_layer: int | None, config: Any,
             n_ctx: int | None, types: CacheTypes = F16) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """The K/V members, every size checked before a byte of them is read and every value after;
    _Bad names the first problem."""
    if n_kv < 0 or n_kv > len(tokens):
        raise _Bad(f"{n_kv} K/V rows for {len(tokens)} tokens")
    if n_ctx is not None and n_kv >= n_ctx:
        raise _Bad(f"{n_kv} K/V rows do not fit a context of {n_ctx}")
    pos_member = archive.probe("pos", np.int64, 1, n_kv * 8)
    if pos_member.shape != (n_kv,):
        raise _Bad(f"pos has shape {pos_member.shape}, not ({n_kv},)")
    layers = n_layer if n_layer is not None else archive.count_layers()
    if not 0 < layers <= MAX_LAYERS:
        raise _Bad(f"{layers} layers")
    members = []
    for i in range(layers):
        want = None
        if config is not None:  # per layer: head sizes may differ, a shared K/V has none (gemma4)
            rows = _saved_rows(config, i)
            want = {kind: (n_kv, heads, types.width(kind, size) if size else 0)
                    for kind, (heads, size) in zip(("k", "v"), rows)}
        for kind in ("k", "v"):
            member = archive.probe(f"{kind}{i}", types.dtype(kind), 3, n_kv * MAX_ROW * 2, kv=True)
            if want is not None and member.shape != want[kind]:
                raise _Bad(f"{kind}{i} has shape {member.shape}; this model's is {want[kind]}")
            if member.shape[0] != n_kv or member.shape[1] * member.shape[2] > MAX_ROW:
                raise _Bad(f"{kind}{i} has shape {member.shape} for {n_kv} rows")
            members.append(member)
    total = sum(m.nbytes for m in members)
    if total > _memory_cap():
        raise _Bad(f"{total} bytes of K/V, more than this machine can hold")

    pos = archive.read(pos_member)
    if n_kv and int(pos[0]) < 0:
        raise _Bad("negative positions")
    if np.any(np.diff(pos) <= 0):
        raise _Bad("positions not increasing")
    if n_kv and int(pos[-1]) >= len(tokens):
        raise _Bad(f"position {int(pos[-1])} past the {len(tokens)} tokens")
    if n_ctx is not None and n_kv and int(pos[-1]) >= n_ctx:
        raise _Bad(f"position {int(pos[-1])} outside the context of {n_ctx}")
    if np.any(tokens[:n_kv] < 0):
        raise _Bad("negative token ids")
    n_vocab = int(getattr(config, "n_vocab", 0) or 0)
    if n_vocab and n_kv and int(tokens[:n_kv].max()) >= n_vocab:
        raise _Bad(f"token id {int(tokens[:n_kv].max())} outside the vocabulary of {n_vocab}")
    k, v = [], []
    for i in range(layers):
        ka, va = archive.read(members[2 * i]), archive.read(members[2 * i + 1])
        _check_values(ka, va, i, types)
        k.append(ka)
        v.append(va)
    return k, v, pos


def _read_state(archive: "_Archive", header: dict, n_kv: int, config: Any) -> dict[str, np.ndarray] | None:
    """A hybrid model's saved recurrent state (conv.<i>, ssm.<i>), each member of exactly the
    model's shape and finite; None when the file has none. Without the model's config (a
    listing) nothing is read."""
    n_state = header.get("n_state") or 0
    if not isinstance(n_state, int) or isinstance(n_state, bool) or n_state not in (0, n_kv):
        raise _Bad(f"n_state is {n_state!r} for {n_kv} K/V rows")
    dn = getattr(config, "delta_net", None)
    if config is None or not n_state:
        return None
    if dn is None:
        raise _Bad("a recurrent state for a model that has none")
    state = {}
    for i in range(int(config.n_layer)):
        if not config.is_recurrent(i):
            continue
        for name, shape in ((f"conv.{i}", tuple(dn.conv_state_shape)), (f"ssm.{i}", tuple(dn.ssm_state_shape))):
            member = archive.probe(name, np.float32, len(shape), int(np.prod(shape)) * 4)
            if member.shape != shape:
                raise _Bad(f"{name} has shape {member.shape}; this model's is {shape}")
            a = archive.read(member)
            if not np.isfinite(a).all():
                raise _Bad(f"{name} holds NaN or Inf")
            state[name] = a
    return state


def _check_values(k: np.ndarray, v: np.ndarray, layer: int, types: CacheTypes = F16) -> None:
    """No Inf anywhere; NaN only as whole rows, the same in K and V: how export_kv marks the rows
    a sliding-window layer no longer holds. Quantized rows: the same of their block scales
    (whole 32-value blocks, or the row is refused)."""
    n = len(k)
    rows = []
    for which, a in (("k", k), ("v", v)):
        try:
            flat = a.reshape(n, -1) if types.of(which) == "f16" else types.block_scales(which, a)
        except ValueError:
            raise _Bad(f"{which}{layer} rows are not whole {types.of(which)} blocks") from None
        if np.isinf(flat).any():
            raise _Bad(f"Inf in layer {layer}")
        nan = np.isnan(flat)
        whole = nan.all(axis=1) if flat.shape[1] else np.zeros(n, dtype=bool)
        if (nan.any(axis=1) & ~whole).any():
            raise _Bad(f"NaN in layer {layer}")
        rows.append(whole)
    if not np.array_equal(rows[0], rows[1]):
        raise _Bad(f"NaN in layer {layer}")


def _memory_cap() -> int:
    """Half the machine's memory: no saved K/V may ask for more."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (AttributeError, ValueError, OSError):
        return 32 << 30


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
    with _Archive(path, where) as archive:
        header = archive.header()
        mtime = archive.mtime
    try:
        messages, sampling, meta = _header_fields(header)
        model = header.get("model") or {}
        if not isinstance(model, dict):
            raise ValueError("model")
        n_kv = int(header.get("n_kv") or 0)
    except (KeyError, ValueError, TypeError, OverflowError) as exc:
        raise SessionFileError(f"{where} is corrupt ({exc}); not loaded") from None
    return SessionInfo(name=path.stem, model=model, messages=messages, sampling=sampling,
                       meta=meta or {}, n_kv=n_kv, mtime=mtime)


class _Bad(Exception):
    """A member that fails a check; the text names the problem."""


@dataclass
class _Member:
    info: zipfile.ZipInfo
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int  # bytes of .npy header before the data

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Archive:
    """An opened session file: a regular file inside its folder (safe_open), its zip directory
    bounded, and members read only after their .npy header agrees with their size and caps."""

    def __init__(self, path: Path, where: str) -> None:
        self.where = where
        _first_use(path.parent)
        try:
            self.file = open_regular(path, path.parent, MAX_FILE_BYTES)
        except RefusedFile as exc:
            raise SessionFileError(f"{where} {exc}") from None
        try:
            st = os.fstat(self.file.fileno())
            self.mtime, self.size = st.st_mtime, st.st_size
            _check_directory(self.file)
            self.zip = zipfile.ZipFile(self.file)
            infos = self.zip.infolist()
            if len(infos) > MAX_MEMBERS:
                raise _Bad(f"{len(infos)} members")
            self.members: dict[str, zipfile.ZipInfo] = {}
            for info in infos:
                name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                if name in self.members:
                    raise _Bad(f"two members named {name}")
                self.members[name] = info
        except (_Bad, zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError,
                struct.error, NotImplementedError, MemoryError) as exc:
            self.file.close()
            reason = str(exc) if isinstance(exc, _Bad) else type(exc).__name__
            raise SessionFileError(f"{where} is corrupt ({reason}); not loaded") from None

    def __enter__(self) -> "_Archive":
        return self

    def __exit__(self, *exc: object) -> None:
        self.zip.close()
        self.file.close()

    def header(self) -> dict:
        """The JSON header, checked for format and version; SessionFileError otherwise."""
        try:
            raw = self.read(self.probe("header", np.uint8, 1, MAX_HEADER_BYTES))
            header = json.loads(raw.tobytes().decode("utf-8"))
        except (_Bad, ValueError, UnicodeDecodeError, RecursionError) as exc:
            reason = str(exc) if isinstance(exc, _Bad) else type(exc).__name__
            raise SessionFileError(f"{self.where} is corrupt ({reason}); not loaded") from None
        _check_header(header, self.where)
        return header

    def count_layers(self) -> int:
        n = 0
        while f"k{n}" in self.members and n <= MAX_LAYERS:
            n += 1
        return n

    def probe(self, name: str, dtype: Any, ndim: int, max_bytes: int, kv: bool = False) -> _Member:
        """Member `name`'s .npy header, checked: dtype, dimensions, data size = what the member
        holds, at most `max_bytes`; for a compressed K/V member, an expansion a real K/V can have."""
        info = self.members.get(name)
        if info is None:
            raise _Bad(f"no {name} member")
        if info.compress_type == zipfile.ZIP_STORED:
            if info.file_size != info.compress_size:
                raise _Bad(f"{name} claims {info.file_size} bytes but holds {info.compress_size}")
        elif kv and info.file_size > MAX_EXPANSION * info.compress_size + (1 << 20):
            raise _Bad(f"{name} expands from {info.compress_size} to {info.file_size} bytes (a zip bomb)")
        if info.file_size > max_bytes + _NPY_HEADER_MAX:
            raise _Bad(f"{name} expands to {info.file_size} bytes, more than the {max_bytes} it may hold")
        try:
            with self.zip.open(info) as f:
                magic = _read_exact(f, 8)
                if magic[:6] != b"\x93NUMPY" or magic[6] not in (1, 2):
                    raise _Bad(f"{name} is not a .npy array")
                length = _read_exact(f, 2 if magic[6] == 1 else 4)
                size = int.from_bytes(length, "little")
                if size > _NPY_HEADER_MAX:
                    raise _Bad(f"{name} has a {size}-byte array header")
                text = _read_exact(f, size)
            reader = np.lib.format.read_array_header_1_0 if magic[6] == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, found = reader(io.BytesIO(length + text), max_header_size=_NPY_HEADER_MAX)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, SyntaxError, TypeError) as exc:
            raise _Bad(f"{name} has a bad array header ({type(exc).__name__})") from None
        if found != np.dtype(dtype) or len(shape) != ndim or (fortran and ndim > 1) \
                or any(not isinstance(d, int) or d < 0 for d in shape):
            raise _Bad(f"{name} is {found} {shape}, not a {ndim}-d {np.dtype(dtype)} array")
        member = _Member(info, tuple(shape), found, 8 + len(length) + size)
        if member.offset + member.nbytes != info.file_size:
            raise _Bad(f"{name} declares {shape} {found} ({member.nbytes} bytes) but holds "
                       f"{info.file_size - member.offset}")
        if member.nbytes > max_bytes:
            raise _Bad(f"{name} holds {member.nbytes} bytes, more than the {max_bytes} it may")
        return member

    def read(self, member: _Member) -> np.ndarray:
        """The data of a probed member, read in bounded chunks into an array of its declared size."""
        try:
            out = np.empty(member.shape, dtype=member.dtype)
        except MemoryError:
            raise _Bad(f"no memory for {member.info.filename} ({member.nbytes} bytes)") from None
        view = memoryview(out.reshape(-1).view(np.uint8))
        try:
            with self.zip.open(member.info) as f:
                _read_exact(f, member.offset)
                done = 0
                while done < member.nbytes:
                    chunk = f.read(min(_CHUNK, member.nbytes - done))
                    if not chunk:
                        raise EOFError
                    view[done:done + len(chunk)] = chunk
                    done += len(chunk)
                if f.read(1):  # also where zipfile checks the CRC
                    raise _Bad(f"{member.info.filename} holds more than it declares")
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as exc:
            raise _Bad(f"{member.info.filename} is damaged ({type(exc).__name__})") from None
        except MemoryError:
            raise _Bad(f"no memory for {member.info.filename}") from None
        return out


def _read_exact(f: Any, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError
    return data


def _check_directory(f: BinaryIO) -> None:
    """Refuse a zip directory of more entries than a session has before zipfile parses it (a
    directory of millions of entries would become millions of objects)."""
    end = getattr(zipfile, "_EndRecData", None)
    record = end(f) if end is not None else None
    if record is None:
        return  # zipfile itself says what is wrong
    entries, size = record[4], record[5]
    if entries > MAX_MEMBERS or size > MAX_MEMBERS * 1024:
        raise _Bad(f"{entries} members in a {size}-byte directory")


_swept: set[str] = set()


def _first_use(folder: Path) -> None:
    """The first time this process uses a sessions folder: remove the temp files killed saves left."""
    key = os.path.realpath(folder)
    if key not in _swept:
        _swept.add(key)
        remove_stale_temps(folder)


def _check_header(header: Any, where: str) -> None:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SessionFileError(f"{where} is not an edgeinfer session")
    if header.get("version") not in READABLE_VERSIONS:
        raise SessionFileError(f"{where} has format version {header.get('version')!r}; "
                               f"this edgeinfer reads versions {', '.join(map(str, READABLE_VERSIONS))}")


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
