"""Saved chat conversations: one versioned JSON file per conversation, written atomically.

Layout: `<data dir>/conversations/<id>.json`, where the data dir is `$EDGEINFER_HOME` or
`~/.local/share/edgeinfer`. Ids are random uuid hex, never derived from user text, so no
title or message can steer a file path. A file is replaced with temp file + fsync +
`os.replace`, so a crash or kill leaves either the old or the new version, never half.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgeinfer.atomic_file import write_atomically
from edgeinfer.errors import EdgeInferError

FORMAT_VERSION = 1
TITLE_CHARS = 48
_ID = re.compile(r"^[0-9a-f]{32}$")


class ConversationError(EdgeInferError):
    """A conversation file that cannot be read or written."""


def default_dir() -> Path:
    """Where conversations live: `$EDGEINFER_HOME/conversations` or ~/.local/share/edgeinfer/conversations."""
    home = os.environ.get("EDGEINFER_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".local" / "share" / "edgeinfer"
    return base / "conversations"


def default_title(messages: list[dict]) -> str:
    """The first user message, on one line and shortened; "New chat" before there is one."""
    for m in messages:
        if m.get("role") == "user" and m.get("content", "").strip():
            line = " ".join(m["content"].split())
            return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"
    return "New chat"


@dataclass
class Conversation:
    """One chat: the model it used, its system prompt and settings, and the messages."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    title: str = ""  # empty = derived from the first user message
    model: str = ""
    system: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    @property
    def display_title(self) -> str:
        return self.title or default_title(self.messages)

    def chat_messages(self) -> list[dict]:
        """The messages to send to the model: the system prompt first when there is one."""
        head = [{"role": "system", "content": self.system}] if self.system.strip() else []
        return head + [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def to_json(self) -> dict:
        return {"version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: Any) -> "Conversation":
        """Parse and check a stored conversation; raises ConversationError on anything odd."""
        if not isinstance(data, dict):
            raise ConversationError("not a JSON object")
        if data.get("version") != FORMAT_VERSION:
            raise ConversationError(f"unsupported format version {data.get('version')!r}")
        cid = data.get("id")
        if not isinstance(cid, str) or not _ID.match(cid):
            raise ConversationError("bad conversation id")
        messages = data.get("messages", [])
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in ("user", "assistant")
                and isinstance(m.get("content"), str) for m in messages):
            raise ConversationError("bad messages list")
        settings = data.get("settings", {})
        if not isinstance(settings, dict):
            raise ConversationError("bad settings")
        try:
            return cls(id=cid, title=str(data.get("title", "")), model=str(data.get("model", "")),
                       system=str(data.get("system", "")), settings=settings,
                       messages=[dict(m) for m in messages],
                       created=float(data.get("created", 0.0)), updated=float(data.get("updated", 0.0)))
        except (TypeError, ValueError) as exc:
            raise ConversationError(f"bad field: {exc}") from None


class ConversationStore:
    """The folder of saved conversations."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else default_dir()

    def path_of(self, conv_id: str) -> Path:
        if not _ID.match(conv_id):  # ids are ours (uuid hex); refuse anything else
            raise ConversationError(f"bad conversation id {conv_id!r}")
        return self.root / f"{conv_id}.json"

    def list(self) -> tuple[list[Conversation], list[str]]:
        """All readable conversations, newest first, and one line per file that was skipped."""
        convs: list[Conversation] = []
        problems: list[str] = []
        if not self.root.is_dir():
            return convs, problems
        for path in self.root.glob("*.json"):
            try:
                convs.append(self._read(path))
            except ConversationError as exc:
                problems.append(f"skipped {path.name}: {exc}")
        convs.sort(key=lambda c: c.updated, reverse=True)
        return convs, problems

    def load(self, conv_id: str) -> Conversation:
        return self._read(self.path_of(conv_id))

    def save(self, conv: Conversation, touch: bool = True) -> Path:
        """Write `conv` atomically (temp file in the same folder, fsync, os.replace)."""
        if touch:
            conv.updated = time.time()
        path = self.path_of(conv.id)
        self.root.mkdir(parents=True, exist_ok=True)
        data = json.dumps(conv.to_json(), ensure_ascii=False, indent=1)
        write_atomically(path, lambda f: f.write(data.encode("utf-8")))
        return path

    def delete(self, conv_id: str) -> None:
        try:
            self.path_of(conv_id).unlink()
        except FileNotFoundError:
            pass

    def _read(self, path: Path) -> Conversation:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConversationError(f"unreadable ({type(exc).__name__})") from None
        conv = Conversation.from_json(data)
        if path.stem != conv.id:
            raise ConversationError("file name does not match its id")
        return conv
