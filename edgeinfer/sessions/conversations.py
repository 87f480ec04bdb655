"""Chat conversations of `edgeinfer chat`, stored as saved sessions (edgeinfer.sessions.session_file).

A conversation IS a saved session: `<data dir>/sessions/<id>.npz`, the file that
`edgeinfer run NAME --session <id>` resumes (and writes), so a chat started in the TUI goes
on in `edgeinfer run` and the other way round. The session format holds the messages (the
system prompt as a leading "system" message, as `run` keeps it), the sampling settings, the
identity of the model file, optionally the K/V of its tokens; the TUI's own fields (title,
the name or path the model was loaded by, the context size and other settings, creation
time) ride in the header's "meta", which `run` carries over untouched. Files are written
atomically (temp file + fsync + os.replace): a crash or kill leaves the old or the new
version, never half. Ids are session names made here (`chat-` + random hex), never derived
from user text, so no title or message can steer a file path.

The first store (one JSON file per conversation in `<data dir>/conversations`) is migrated:
each readable file becomes a saved session and then moves to `conversations/migrated/`, so
nothing is lost and nothing is migrated twice; a file that cannot be read stays where it is.

Every file here is read through safe_open (only regular files inside the folder: a FIFO,
device or link out is skipped with one line, never blocks a listing); creating the store
removes the temp files of saves that were killed (atomic_file.remove_stale_temps).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from edgeinfer.atomic_file import remove_stale_temps
from edgeinfer.errors import EdgeInferError
from edgeinfer.kv.saved import SavedKV
from edgeinfer.sessions.safe_open import RefusedFile, open_regular
from edgeinfer.sampling import SamplingParams
from edgeinfer.sessions.session_file import (SavedSession, SessionFileError, check_name, load_session,
                                     read_session_info, save_session, sessions_dir)

FORMAT_VERSION = 1  # of the first store's JSON files (read for migration only)
MAX_LEGACY_BYTES = 16 << 20  # one first-store JSON file
TITLE_CHARS = 48
_LEGACY_ID = re.compile(r"^[0-9a-f]{32}$")
MIGRATED = "migrated"
SAMPLING_KEYS = frozenset(f.name for f in fields(SamplingParams))  # settings that are sampling parameters


class ConversationError(EdgeInferError):
    """A conversation file that cannot be read or written."""


def default_dir() -> Path:
    """Where conversations live: the saved-session folder (`$EDGEINFER_HOME/sessions` or
    ~/.local/share/edgeinfer/sessions), shared with `edgeinfer run --session`."""
    return sessions_dir()


def legacy_dir() -> Path:
    """The first store's folder: `$EDGEINFER_HOME/conversations` (read to migrate it)."""
    return sessions_dir().parent / "conversations"


def new_id() -> str:
    """A fresh session name: `chat-` + 12 random hex digits (short enough to type after --session)."""
    return f"chat-{secrets.token_hex(6)}"


def default_title(messages: list[dict]) -> str:
    """The first user message, on one line and shortened; "New chat" before there is one."""
    for m in messages:
        if m.get("role") == "user" and m.get("content", "").strip():
            line = " ".join(m["content"].split())
            return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"
    return "New chat"


def same_model(a: dict | None, b: dict | None) -> bool:
    """Two model identities (session_file.model_identity) name the same file."""
    return bool(a and b and a.get("digest") and a.get("digest") == b.get("digest")
                and a.get("size") == b.get("size"))


@dataclass
class Conversation:
    """One chat: the model it used, its system prompt and settings, and the messages."""

    id: str = field(default_factory=new_id)
    title: str = ""  # empty = derived from the first user message
    model: str = ""  # the name or path the model was loaded by
    system: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    identity: dict[str, Any] = field(default_factory=dict)  # of the model file (empty = unknown)
    model_path: str = ""  # that file's path when it was last used
    n_kv: int = 0  # tokens whose K/V its file holds

    @property
    def display_title(self) -> str:
        return self.title or default_title(self.messages)

    @property
    def model_label(self) -> str:
        """The model as a person knows it: the name it was loaded by, else the file's general.name."""
        name = self.model or self.identity.get("name") or ""
        if not name:
            return "an unknown model"
        return Path(name).name if name.endswith(".gguf") and not name.startswith("hf.co/") else name

    def chat_messages(self) -> list[dict]:
        """The messages to send to the model: the system prompt first when there is one."""
        head = [{"role": "system", "content": self.system}] if self.system.strip() else []
        return head + [{"role": m["role"], "content": m["content"]} for m in self.messages]


class ConversationStore:
    """The folder of saved sessions, seen as conversations."""

    def __init__(self, root: str | os.PathLike[str] | None = None,
                 legacy: str | os.PathLike[str] | None = None) -> None:
        """`root`: the sessions folder (default session_file.sessions_dir()). `legacy`: where
        first-store JSON files are looked for (default: `root` itself when given, as
        `edgeinfer chat --data-dir` used to hold them, else legacy_dir())."""
        self.root = Path(root) if root is not None else default_dir()
        self.legacy = Path(legacy) if legacy is not None else (self.root if root is not None else legacy_dir())
        remove_stale_temps(self.root)  # what saves killed mid-write left (never a save under way)

    def path_of(self, conv_id: str) -> Path:
        try:
            return self.root / f"{check_name(conv_id)}.npz"
        except SessionFileError:
            raise ConversationError(f"bad conversation id {conv_id!r}") from None

    def new_id(self) -> str:
        while True:
            cid = new_id()
            if not self.path_of(cid).exists():
                return cid

    # -- reading -----------------------------------------------------------------------------
    def list(self) -> tuple[list[Conversation], list[str]]:
        """All readable conversations, most recently written first, and one line per file skipped."""
        problems = self.migrate()
        convs: list[Conversation] = []
        if self.root.is_dir():
            for path in self.root.glob("*.npz"):
                try:
                    convs.append(self._read(path))
                except EdgeInferError as exc:
                    problems.append(f"skipped {path.name}: {_reason(exc, path)}")
        convs.sort(key=lambda c: c.updated, reverse=True)
        return convs, problems

    def load(self, conv_id: str) -> Conversation:
        """The conversation (its header: no tokens or K/V read, no model check)."""
        return self._read(self.path_of(conv_id))

    def load_kv(self, conv: Conversation, identity: dict, n_layer: int, *, config=None,
                n_ctx: int | None = None) -> SavedSession | None:
        """The saved K/V of `conv` for the model `identity` (None when the file holds none);
        SessionFileError when the file is of another model or corrupt, or its K/V were refused
        (NaN or Inf, positions out of range: the message says which). `config` and `n_ctx` (the
        model's) make the size checks exact (session_file.load_session)."""
        saved = load_session(self.path_of(conv.id), identity, n_layer, config=config, n_ctx=n_ctx,
                             warn=_quiet)
        if saved.kv_refused:
            raise SessionFileError(saved.kv_refused)
        return saved if saved.n_kv else None

    def _read(self, path: Path) -> Conversation:
        try:
            info = read_session_info(path)
        except SessionFileError as exc:
            raise ConversationError(str(exc)) from None
        messages = [dict(m) for m in info.messages]
        system = ""
        if messages and messages[0]["role"] == "system":
            system = messages.pop(0)["content"]
        meta = info.meta
        settings = meta.get("settings") if isinstance(meta.get("settings"), dict) else {}
        # The sampling record is the truth for sampling values (`run` may have changed them);
        # meta keeps the rest (context size, whether to save the K/V).
        settings = {**settings, **info.sampling}
        try:
            return Conversation(
                id=info.name, title=str(meta.get("title") or ""), model=str(meta.get("model") or ""),
                system=system, settings=settings, messages=messages,
                created=float(meta.get("created") or info.mtime), updated=info.mtime,
                identity=dict(info.model), model_path=str(meta.get("model_path") or ""), n_kv=info.n_kv)
        except (TypeError, ValueError) as exc:
            raise ConversationError(f"bad field: {exc}") from None

    # -- writing -----------------------------------------------------------------------------
    def save(self, conv: Conversation, *, sampling: dict | None = None, kv: tuple | None = None,
             keep_kv: bool = False) -> Path:
        """Write `conv` as a saved session, atomically.

        `sampling`: the sampling parameters to record for `edgeinfer run` (default: the
        conversation's settings that are sampling parameters). `kv`: (tokens, k, v, pos) as
        SessionManager.export_kv returns, saved so resuming prefills nothing. `keep_kv`: with
        no `kv`, keep the K/V the file already holds when it is of the same model.
        """
        path = self.path_of(conv.id)
        if sampling is None:
            sampling = {k: v for k, v in conv.settings.items() if k in SAMPLING_KEYS}
        if kv is None and keep_kv and conv.n_kv:
            try:
                old = load_session(path, conv.identity, warn=_quiet)  # refused K/V: not kept
                if old.n_kv:
                    kv = old.saved_kv()
            except SessionFileError:
                pass  # another model's or unreadable: the K/V were only a cache
        conv.updated = time.time()
        meta = {"app": "edgeinfer chat", "title": conv.title, "model": conv.model,
                "model_path": conv.model_path, "settings": dict(conv.settings), "created": conv.created}
        session = SavedSession(messages=_file_messages(conv), sampling=dict(sampling), meta=meta)
        if kv is not None:
            session.set_kv(SavedKV(*kv))
        save_session(path, session, conv.identity)
        conv.n_kv = session.n_kv
        return path

    def delete(self, conv_id: str) -> None:
        try:
            self.path_of(conv_id).unlink()
        except FileNotFoundError:
            pass

    # -- the first store ---------------------------------------------------------------------------
    def migrate(self) -> list[str]:
        """Turn the first store's JSON files into saved sessions; returns one line per file kept back."""
        problems: list[str] = []
        if not self.legacy.is_dir():
            return problems
        identities: dict[str, dict] = {}
        for path in sorted(self.legacy.glob("*.json")):
            try:
                conv = _read_legacy(path)
            except ConversationError as exc:
                problems.append(f"skipped {path.name}: {exc}")
                continue
            try:
                if not self.path_of(conv.id).exists():
                    if conv.model not in identities:
                        identities[conv.model] = identify(conv.model) or {}
                    conv.identity = identities[conv.model]
                    updated = conv.updated
                    self.save(conv)
                    if updated > 0:
                        os.utime(self.path_of(conv.id), (updated, updated))  # keep the list's order
                done = self.legacy / MIGRATED
                done.mkdir(exist_ok=True)
                os.replace(path, done / path.name)
            except (OSError, EdgeInferError) as exc:
                problems.append(f"could not migrate {path.name}: {exc}")
        return problems


def _quiet(message: str) -> None:
    """Refused K/V are only a lost cache: the caller reports them (kv_refused) or not at all."""


def _file_messages(conv: Conversation) -> list[dict]:
    """What the session file holds: the system prompt first (as `run` keeps it), then the
    messages with their extra keys (finish_reason)."""
    head = [{"role": "system", "content": conv.system}] if conv.system.strip() else []
    return head + [dict(m) for m in conv.messages]


def identify(name: str, size: int | None = None) -> dict | None:
    """The identity of the local model file that `name` (alias, hf.co/…, path) means, or None when
    it is not on this machine (or, with `size`, when the file has another size). Never downloads."""
    if not name:
        return None
    from edgeinfer.store.registry import resolve
    from edgeinfer.sessions.session_file import model_identity

    try:
        path = resolve(name, download=False, progress=False)
        if size is not None and path.stat().st_size != size:
            return None
        return model_identity(path)
    except (EdgeInferError, OSError):
        return None


def _reason(exc: Exception, path: Path) -> str:
    """An error's text without the 'session file NAME' prefix the listing line already says."""
    text = str(exc)
    prefix = f"session file {path.name} "
    return text[len(prefix):] if text.startswith(prefix) else text


def _read_legacy(path: Path) -> Conversation:
    """Parse and check one of the first store's JSON files."""
    try:
        with open_regular(path, path.parent, MAX_LEGACY_BYTES) as f:
            data = json.loads(f.read().decode("utf-8"))
    except RefusedFile as exc:
        raise ConversationError(str(exc)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ConversationError(f"unreadable ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise ConversationError("not a JSON object")
    if data.get("version") != FORMAT_VERSION:
        raise ConversationError(f"unsupported format version {data.get('version')!r}")
    cid = data.get("id")
    if not isinstance(cid, str) or not _LEGACY_ID.match(cid):
        raise ConversationError("bad conversation id")
    if path.stem != cid:
        raise ConversationError("file name does not match its id")
    messages = data.get("messages", [])
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant")
            and isinstance(m.get("content"), str) for m in messages):
        raise ConversationError("bad messages list")
    settings = data.get("settings", {})
    if not isinstance(settings, dict):
        raise ConversationError("bad settings")
    try:
        return Conversation(id=cid, title=str(data.get("title", "")), model=str(data.get("model", "")),
                            system=str(data.get("system", "")), settings=settings,
                            messages=[dict(m) for m in messages],
                            created=float(data.get("created", 0.0)), updated=float(data.get("updated", 0.0)))
    except (TypeError, ValueError) as exc:
        raise ConversationError(f"bad field: {exc}") from None
