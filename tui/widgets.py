"""Widgets of the chat screen: the prompt box, chat messages, the status bar and the key line."""

from __future__ import annotations

import re
from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea

# Keys that put a line break in the prompt instead of sending it. Ctrl+J works in every
# terminal (it is the LF byte); Shift+Enter only where the terminal reports it (kitty protocol).
NEWLINE_KEYS = ("ctrl+j", "shift+enter", "newline")
# In an empty prompt box (nothing to move the cursor over) these step through the answers of the last turn.
STEP_KEYS = {"left": -1, "right": 1, "ctrl+left": -1, "ctrl+right": 1}
_FENCE = re.compile(r"^ {0,3}(```|~~~)[^\n]*\n(.*?)^ {0,3}\1[ \t]*$", re.MULTILINE | re.DOTALL)


class PromptInput(TextArea):
    """Multi-line prompt: Enter sends, Ctrl+J (or Shift+Enter) inserts a newline."""

    class Submitted(Message):
        def __init__(self, prompt: "PromptInput", text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    class StepAnswer(Message):
        """←/→ in an empty prompt box: show the previous (-1) or next (+1) answer of the last turn."""

        def __init__(self, delta: int) -> None:
            super().__init__()
            self.delta = delta

    async def _on_key(self, event: events.Key) -> None:
        if not self.text and event.key in STEP_KEYS:
            event.stop()
            event.prevent_default()
            self.post_message(self.StepAnswer(STEP_KEYS[event.key]))
            return
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
    """A message the user sent (shown as plain text: no markup is interpreted); `images`: a line
    under it for each attached image ("image: cat.png 1024×768")."""

    def __init__(self, text: str, images: list[str] | None = None) -> None:
        shown = "\n".join([text, *images]) if images and text else "\n".join(images or [text])
        super().__init__(shown, markup=False, classes="message user")
        self.border_title = "You"
        self.text = text
        self.images = list(images or [])


class SystemMessage(Static):
    """The conversation's system prompt, shown first (plain text)."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="message system")
        self.border_title = "System prompt (Ctrl+S edits)"
        self.text = text


class Welcome(Markdown):
    """What an empty conversation shows: the model, how to start, where the keys are."""

    def __init__(self, text: str) -> None:
        super().__init__(text, id="welcome")


class AssistantMessage(Markdown):
    """An answer, rendered as Markdown; `text` is the raw answer as streamed. `position` ("2/3")
    shows, under the box, which of the turn's answers this is."""

    def __init__(self, text: str = "", model: str = "", position: str = "") -> None:
        super().__init__(text, classes="message assistant")
        self.text = text
        self.border_title = model or "Assistant"
        self.set_position(position)

    def set_position(self, position: str) -> None:
        self.border_subtitle = f"◀ {position} ▶ (←/→ in an empty prompt)" if position else ""


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
    """One line (wrapped when narrow): model · quantization │ context used/size │ TTFT │ tokens/s │ cached."""

    def show(self, stats: Stats) -> None:
        self.update(stats.render())


class KeyBar(Static):
    """The key line: every key when they fit, else the first ones and "F1 help" (controller.footer_text)."""

    def __init__(self, keys, **kwargs) -> None:
        super().__init__("", markup=False, **kwargs)
        self.keys = keys

    def on_resize(self, event: events.Resize) -> None:
        self.refresh_keys()

    def refresh_keys(self) -> None:
        from edgeinfer.tui.controller import footer_text

        self.update(footer_text(self.keys, self.size.width or 80))
