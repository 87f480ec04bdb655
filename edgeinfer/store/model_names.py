"""Names made in the local store (`/api/copy`, `/api/create`): a name -> GGUF file table with a template, system prompt and parameters.

The table is one JSON file, `$EDGEINFER_HOME/models.json` (default ~/.local/share/edgeinfer):
names are keys in it and never become file paths (Ollama's CVE-2024-37032 built paths from
request text). A name points at a file already on this machine (a store file or one the user
chose with `/api/create`); deleting a name never deletes that file.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgeinfer.atomic_file import write_atomically
from edgeinfer.errors import EdgeInferError, ModelNotFoundError

MAX_NAME = 128
# Ollama-style: a name, an optional tag; letters, digits, '_', '.', '-'; no '/', no leading '.'/'-'.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?")
_lock = threading.Lock()


class BadModelName(EdgeInferError):
    """A model name that is not a plain name (a path, NUL, too long, ...)."""


@dataclass
class NamedModel:
    """One row of the table."""

    name: str
    path: str                       # the GGUF file (absolute)
    source: str = ""                # what it was made from: a model name or the file chosen
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    license: str | None = None
    modified: float = field(default_factory=time.time)


def data_dir() -> Path:
    home = os.environ.get("EDGEINFER_HOME")
    return Path(home).expanduser() if home else Path.home() / ".local" / "share" / "edgeinfer"


def table_path() -> Path:
    return data_dir() / "models.json"


def check_name(name: Any) -> str:
    """The canonical form of a name a request gives (`:latest` dropped); BadModelName otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        shown = repr(name)[:80]
        raise BadModelName(f"invalid model name {shown}: use letters, digits, '_', '.' and '-', with an "
                           f"optional ':tag' (at most {MAX_NAME} characters each, no '/' and no '..')")
    return canonical(name)


def canonical(name: str) -> str:
    return name[: -len(":latest")] if name.endswith(":latest") else name


def _read() -> dict[str, dict]:
    path = table_path()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise EdgeInferError(f"{path}: cannot read the model name table ({exc})") from None
    models = raw.get("models") if isinstance(raw, dict) else None
    return {k: v for k, v in models.items() if isinstance(v, dict)} if isinstance(models, dict) else {}


def _write(rows: dict[str, dict]) -> None:
    data = json.dumps({"models": rows}, indent=1, sort_keys=True).encode()
    write_atomically(table_path(), lambda f: f.write(data))


def _row(name: str, row: dict) -> NamedModel | None:
    try:
        return NamedModel(**{**row, "name": name})
    except TypeError:  # a row written by hand with unknown keys: ignore it
        return None


def lookup(name: str) -> NamedModel | None:
    """The row for `name` (any spelling check_name accepts), None if absent or not a plain name."""
    try:
        key = check_name(name)
    except BadModelName:
        return None
    row = _read().get(key)
    return _row(key, row) if row is not None else None


def all_names() -> list[NamedModel]:
    return [m for k, row in sorted(_read().items()) if (m := _row(k, row)) is not None]


def save(entry: NamedModel) -> NamedModel:
    """Add or replace a row (the name is checked again here)."""
    entry.name = check_name(entry.name)
    row = asdict(entry)
    del row["name"]
    with _lock:
        rows = _read()
        rows[entry.name] = row
        _write(rows)
    return entry


def delete(name: str) -> NamedModel:
    """Forget a name (its file stays); ModelNotFoundError if absent."""
    key = check_name(name)
    with _lock:
        rows = _read()
        row = rows.pop(key, None)
        if row is None:
            raise ModelNotFoundError(f"model {name!r} not found")
        _write(rows)
    return _row(key, row) or NamedModel(key, "")
