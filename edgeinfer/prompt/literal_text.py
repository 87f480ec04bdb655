"""Message text stays text in a chat prompt: only the template's own markup becomes control
tokens.

The rendered template is tokenized with special tokens parsed (its `<start_of_turn>`,
`<|im_start|>`, ... are control tokens), so a message holding such text verbatim could
close its turn and forge another role's. Before rendering, every control-token text inside
the caller's strings (message contents and parts, tool calls, tool definitions) is swapped
for a placeholder no one can guess (private-use characters around a per-render nonce);
after rendering, the placeholders are put back as parts tokenized without special tokens.
The template sees strings of the same shape (the placeholders are not whitespace, so trims
and splits behave as before), and text with no control-token text is untouched.

    literal = LiteralText(tokenizer)
    text = template.render(literal.protect(messages), tools=literal.protect(tools))
    ids = literal.tokenize(text, add_special=True)
"""

from __future__ import annotations

import re
import secrets
import threading
from typing import Any

OPEN, CLOSE = "\U000F0000", "\U000F0001"  # Unicode plane 15 private use: no vocabulary gives them meaning


class LiteralText:
    """One render's placeholders: `protect` the inputs, then `tokenize` the rendered text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._nonce = secrets.token_hex(8)
        self._texts: list[str] = []  # placeholder i -> the control-token text it stands for
        self._pattern = re.compile(re.escape(OPEN + self._nonce) + r"(\d+)" + re.escape(CLOSE))

    def protect(self, value: Any) -> Any:
        """A copy of `value` (dicts, lists, strings, as JSON) with control-token text in every
        string, keys excepted, replaced by placeholders."""
        if isinstance(value, str):
            return self._protect_str(value)
        if isinstance(value, dict):
            return {k: self.protect(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.protect(v) for v in value]
        if hasattr(value, "items"):  # a Mapping that is not a dict
            return {k: self.protect(v) for k, v in value.items()}
        return value

    def _protect_str(self, text: str) -> str:
        spans = self._tok.control_text_spans(text)
        if not spans:
            return text
        out, pos = [], 0
        for a, b in spans:
            out.append(text[pos:a])
            out.append(f"{OPEN}{self._nonce}{len(self._texts)}{CLOSE}")
            self._texts.append(text[a:b])
            pos = b
        out.append(text[pos:])
        return "".join(out)

    def parts(self, rendered: str) -> list[tuple[str, bool]]:
        """The rendered prompt as (text, parse_special) parts: the template's text with
        special tokens parsed, each put-back message text without."""
        parts: list[tuple[str, bool]] = []
        pos = 0
        for m in self._pattern.finditer(rendered):
            i = int(m.group(1))
            if i >= len(self._texts):  # not ours (cannot happen without the nonce): leave it as text
                continue
            parts.append((rendered[pos:m.start()], True))
            parts.append((self._texts[i], False))
            pos = m.end()
        parts.append((rendered[pos:], True))
        return [p for p in parts if p[0]]

    def tokenize(self, rendered: str, add_special: bool = True,
                 cancel: threading.Event | None = None) -> list[int]:
        return self._tok.tokenize_parts(self.parts(rendered), add_special, cancel)
