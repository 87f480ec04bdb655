"""A conversation as Markdown: the text copied with "copy chat" and the file "export" writes atomically."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from edgeinfer.atomic_file import write_atomically
from edgeinfer.tui.controller import answers_of, choice_of


def to_markdown(conv: Any, *, alternatives: bool = True) -> str:
    """The conversation (title, model, system prompt, messages) as Markdown. With `alternatives`,
    the other answers of a regenerated turn follow the shown one, marked as such."""
    lines = [f"# {conv.display_title}", ""]
    if conv.model:
        lines += [f"*Model: {conv.model_label}*", ""]
    if conv.system.strip():
        lines += ["## System", "", conv.system.strip(), ""]
    for m in conv.messages:
        if m.get("role") == "user":
            lines += ["## You", "", m["content"].rstrip(), ""]
        elif m.get("role") == "assistant":
            answers = answers_of(m)
            chosen = choice_of(m)
            head = "## Assistant" + (f" (answer {chosen + 1} of {len(answers)})" if len(answers) > 1 else "")
            lines += [head, "", m["content"].rstrip(), ""]
            if alternatives:
                for i, text in enumerate(answers):
                    if i != chosen:
                        lines += [f"### Other answer {i + 1} of {len(answers)}", "", text.rstrip(), ""]
        else:
            lines += [f"## {m.get('role', '?')}", "", str(m.get("content", "")).rstrip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def export_name(conv: Any) -> str:
    """A file name from the title: letters, digits and dashes only, never a path."""
    stem = re.sub(r"[^A-Za-z0-9]+", "-", conv.display_title).strip("-").lower()[:48].strip("-")
    return f"{stem or 'chat'}-{conv.id}.md"


def export_markdown(conv: Any, folder: str | Path) -> Path:
    """Write the conversation to `folder`/export_name(conv), atomically; returns the path."""
    path = Path(folder).expanduser() / export_name(conv)
    data = to_markdown(conv).encode("utf-8")
    write_atomically(path, lambda f: f.write(data))
    return path
