"""A chat answer as a person reads it in `edgeinfer run` and the TUI: the text to show, streamed.

Both show the model's text as it comes, reasoning included: for Qwen 3 that is its
`<think>...</think>` block, then the answer. A harmony answer (gpt-oss) is channels with
special tokens between them, and so is Gemma 4's (`<|channel>thought ... <channel|>`): each is
shown in that same shape, the reasoning as a `<think>` block, then the answer (anything else
as written). The shown text is what the front ends keep as the assistant's turn;
edgeinfer.prompt.tool_calls.template_history reads the block back as the template's
reasoning. Any other model's text passes through unchanged.
"""

from __future__ import annotations

from edgeinfer.prompt.tool_calls import CHANNEL_FORMATS, answer_stream, detect_format

THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"


class ShownAnswer:
    """`push(text)` each streamed piece and `finish()` at the end; both return what to show."""

    def __init__(self, template_source: str | None) -> None:
        fmt = detect_format(template_source or "")
        self._channels = answer_stream(fmt, tools=False) if fmt in CHANNEL_FORMATS else None
        self._thinking = False  # inside the shown <think> block

    @classmethod
    def for_model(cls, model) -> "ShownAnswer":
        return cls(getattr(getattr(model, "template", None), "source", None))

    def push(self, text: str) -> str:
        if self._channels is None:
            return text
        return self._show(self._channels.push(text)) if text else ""

    def finish(self) -> str:
        if self._channels is None:
            return ""
        shown = self._show(self._channels.flush())
        if self._thinking:  # cut off while reasoning: close the block all the same
            self._thinking = False
            shown += THINK_CLOSE.rstrip("\n")
        return shown

    def _show(self, events: list) -> str:
        out = []
        for kind, value in events:  # tools=False: only reasoning and content come
            if kind == "reasoning" and not self._thinking:
                out.append(THINK_OPEN)
                self._thinking = True
            elif kind != "reasoning" and self._thinking:
                out.append(THINK_CLOSE)
                self._thinking = False
            out.append(value)
        return "".join(out)
