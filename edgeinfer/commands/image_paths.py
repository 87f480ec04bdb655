"""Image files named in a typed REPL message, found and taken out of its text as `ollama run` does."""

from __future__ import annotations

import re
from pathlib import Path

_EXT = r"\.(?:png|jpe?g|webp|gif)"
# A path as Ollama takes one: it starts with / ./ ../ or ~/ (a bare "cat.png" is left as words).
# Quoted (what a terminal pastes for a dropped file: 'My Cat.png') or unquoted with backslash
# escapes ("My\ Cat.png"); it ends at whitespace, the line's end or trailing punctuation.
_START = r"(?:~|\.{1,2})?/"
_CANDIDATE = re.compile(
    rf"(?<!\S)(?:'(?P<single>{_START}[^']*?{_EXT})'|\"(?P<double>{_START}[^\"]*?{_EXT})\""
    rf"|(?P<bare>{_START}(?:\\.|[^\s\\])*?{_EXT}))(?=$|\s|[,;:!?)\]]|\.(?:\s|$))",
    re.IGNORECASE)
_ESCAPE = re.compile(r"\\(.)")


def _path_of(m: re.Match) -> str:
    quoted = m.group("single") or m.group("double")
    return quoted if quoted is not None else _ESCAPE.sub(r"\1", m.group("bare"))


def image_paths(line: str) -> tuple[str, list[str]]:
    """(the line without the image paths that exist as files, those paths in order). A path
    that names no file stays in the text as typed, as in Ollama (it may be just words)."""
    found: list[str] = []
    kept: list[str] = []
    end = 0
    for m in _CANDIDATE.finditer(line):
        path = _path_of(m)
        if not Path(path).expanduser().is_file():
            continue
        found.append(path)
        kept.append(line[end:m.start()])
        end = m.end()
    if not found:
        return line, []
    kept.append(line[end:])
    # Join the pieces around each path with one space, so "see /a.png please" reads "see please".
    text = kept[0].rstrip(" \t")
    for i, piece in enumerate(kept[1:], 1):
        piece = piece.strip(" \t") if i < len(kept) - 1 else piece.lstrip(" \t")
        spaced = text and piece and not text.endswith("\n") and piece[0] not in ",;:!?.)]"
        text = f"{text} {piece}" if spaced else text + piece
    return text.strip(), found


def starts_with_image_path(line: str) -> bool:
    """Whether the line opens with an existing image file's path: a message, not a slash command
    (Ollama's rule for a line that starts with "/")."""
    m = _CANDIDATE.match(line.lstrip())
    return m is not None and Path(_path_of(m)).expanduser().is_file()
