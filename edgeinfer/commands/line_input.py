"""Reading the interactive `run`'s input: line editing and a persistent, bounded history on a
terminal (the standard library's `readline`), plain lines otherwise; `\"\"\"` multi-line messages."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HISTORY_LENGTH = 1000  # lines kept in the history file
PROMPT, CONTINUATION = ">>> ", "... "


def history_path() -> Path:
    """`history` in the edgeinfer data folder ($EDGEINFER_HOME or ~/.local/share/edgeinfer)."""
    from edgeinfer.sessions.session_file import sessions_dir

    return sessions_dir().parent / "history"  # sessions_dir() is <data folder>/sessions


class LineReader:
    """One message at a time. With `terminal` (default: stdin is a tty) lines come through
    readline, so arrow keys, Ctrl-R and the saved history work; otherwise from `stdin`."""

    def __init__(self, stdin=None, stdout=None, terminal: bool | None = None,
                 history_file: Path | None = None) -> None:
        self.stdin = stdin if stdin is not None else sys.stdin
        self.stdout = stdout if stdout is not None else sys.stdout
        if terminal is None:
            terminal = self.stdin.isatty()
        self.history_file = history_file if history_file is not None else history_path()
        self.history_enabled = True
        self._readline = _load_readline() if terminal else None
        if self._readline is not None:
            load_history(self._readline, self.history_file)

    @property
    def editing(self) -> bool:
        """Whether lines come through readline (arrow keys, Ctrl-R, history)."""
        return self._readline is not None

    def _line(self, prompt: str) -> str:
        """One line; EOFError at end of input (Ctrl-D), KeyboardInterrupt on Ctrl-C."""
        if self._readline is not None:
            line = input(prompt)
            if not self.history_enabled and line:
                _forget_last(self._readline)
            return line
        self.stdout.write(prompt)
        self.stdout.flush()
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    def read_message(self) -> str:
        """One message: a line, or the lines between two `\"\"\"` (a line may also open with
        `/set system \"\"\"`, as in Ollama). Saves the history afterwards."""
        line = self._line(PROMPT)
        head, quotes, rest = line.partition('"""')
        if quotes and head.strip() in ("", "/set system"):
            if '"""' in rest:  # opened and closed on one line
                body = rest.split('"""', 1)[0]
            else:
                lines = [rest] if rest else []
                while True:
                    more = self._line(CONTINUATION)
                    if '"""' in more:
                        lines.append(more.split('"""', 1)[0])
                        break
                    lines.append(more)
                body = "\n".join(lines).strip("\n")
            line = f"{head.strip()} {body}" if head.strip() else body
        self.save_history()
        return line

    def save_history(self) -> None:
        if self._readline is not None and self.history_enabled:
            save_history(self._readline, self.history_file)


def _load_readline():
    """The readline module, set up for this REPL, or None where Python has none."""
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline
        return None
    if "libedit" in (readline.__doc__ or ""):  # macOS: give Ctrl-R the search GNU readline has
        readline.parse_and_bind("bind ^R em-inc-search-prev")
    readline.set_auto_history(True)
    return readline


def load_history(readline, path: Path) -> None:
    """Read the saved history (if any) into readline, bounded to HISTORY_LENGTH lines."""
    readline.clear_history()
    readline.set_history_length(HISTORY_LENGTH)
    try:
        readline.read_history_file(str(path))
    except (FileNotFoundError, PermissionError, OSError):
        pass  # no history yet, or unreadable: start empty


def save_history(readline, path: Path) -> None:
    """Write readline's history to `path` (its last HISTORY_LENGTH lines); an unwritable
    folder only loses the history, never the session."""
    readline.set_history_length(HISTORY_LENGTH)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(str(path))
        os.chmod(path, 0o600)  # typed prompts are private
    except OSError:
        pass


def _forget_last(readline) -> None:
    n = readline.get_current_history_length()
    if n:
        readline.remove_history_item(n - 1)
