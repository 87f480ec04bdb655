"""Widgets of the chat screen: the prompt box, chat messages, the status bar."""

from __future__ import annotations

import re
from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea

# Keys that put a line break in the prompt instead of sending it. Ctrl+J works in every
# terminal (it is the LF byte); Shift+Enter only where the terminal reports it (kitty protocol).
NEWLINE_KEYS = ("ctrl+j", "shift+enter", "newline")
_FENCE = re.compile(r"^ {0,3}(```|~~~)[^\n]*\n(.*?)^ {0,3}\1[ \t]*$", re.MULTILINE | re.DOTALL)


class PromptInput(TextArea):
    """Multi-line prompt: Enter sends, Ctrl+J (or Shift+Enter) inserts a newline."""

    class Submitted(Message):
        def __init__(self, prompt: "PromptInput", text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        await super()._on_key(event)


class UserMessage(Static):
    """A message the user sent (shown as plain text: no markup is interpreted)."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="message user")
        self.border_title = "You"
        self.text = text


class AssistantMessage(Markdown):
    """An answer, rendered as Markdown; `text` is the raw answer as streamed."""

    def __init__(self, text: str = "", model: str = "") -> None:
        super().__init__(text, classes="message assistant")
        self.text = text
        self.border_title = model or "Assistant"


def code_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of a Markdown text, in order (an unclosed last fence counts)."""
    blocks = [m.group(2).rstrip("\n") for m in _FENCE.finditer(markdown)]
    last_fence = list(re.finditer(r"^ {0,3}(```|~~~)[^\n]*\n", markdown, re.MULTILINE))
    if len(last_fence) % 2 == 1:  # still streaming, or the model never closed it
        blocks.append(markdown[last_fence[-1].end():].rstrip("\n"))
    return blocks


@dataclass
class Stats:
    """What the status bar shows about the model and the last answer."""

    model: str = "no model"
    quant: str = ""
    n_ctx: int = 0
    ctx_used: int = 0
    ttft_s: float | None = None
    gen_tps: float | None = None
    cached: int | None = None
    state: str = ""

    def render(self) -> str:
        parts = [f"{self.model}" + (f" · {self.quant}" if self.quant else ""),
                 f"ctx {self.ctx_used}/{self.n_ctx}"]
        if self.ttft_s is not None:
            parts.append(f"TTFT {self.ttft_s * 1000:.0f} ms")
        if self.gen_tps is not None:
            parts.append(f"{self.gen_tps:.1f} tok/s")
        if self.cached is not None:
            parts.append(f"cached {self.cached}")
        if self.state:
            parts.append(self.state)
        return " │ ".join(parts)


class StatusBar(Static):
    """One line: model · quantization │ context used/size │ TTFT │ tokens/s │ cached tokens."""

    def show(self, stats: Stats) -> None:
        self.update(stats.render())
