"""Modal screens: help, settings, model picker, rename and delete confirmation."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Markdown, OptionList, TextArea
from textual.widgets.option_list import Option

HELP = """\
# edgeinfer chat

Type a message and press **Enter** to send it. **Ctrl+J** inserts a line break
(**Shift+Enter** too, in terminals that report it). The answer streams in as Markdown;
the prompt box stays usable while the model writes.

| key | action |
|-----|--------|
| Enter | send the message |
| Ctrl+J / Shift+Enter | new line in the message |
| Esc | stop the current answer |
| Ctrl+N | new conversation |
| Ctrl+R | regenerate the last answer |
| Ctrl+L | edit the last message (puts it back in the prompt box) |
| F3 | copy the last answer to the clipboard |
| F4 | copy the last code block of the last answer |
| Ctrl+C | copy the selected text |
| Ctrl+S | settings: system prompt, temperature, top-p, top-k, max tokens, context size |
| Ctrl+O | pick another local model |
| Ctrl+B | show / hide the conversation list |
| F2 | rename the conversation |
| F8 | delete the conversation |
| Ctrl+T | light / dark theme |
| F1 | this help |
| Ctrl+Q | quit |

Conversations are saved after every message, atomically, as saved sessions under
`$EDGEINFER_HOME/sessions` (default `~/.local/share/edgeinfer/sessions`): the same files
`edgeinfer run NAME --session ID` resumes, so a chat goes on in either (F2 shows its ID).
Select one in the side panel to resume it; if it was made with another model file, that
model is loaded (or, when it is not on this machine, a notice says so and the messages are
still shown). The setting *Save the KV cache* also stores the conversation's K/V, so
resuming it prefills nothing (bigger files; off by default). The status bar shows the model
and its quantization, context used / context size, time to first token, tokens per second
and how many prompt tokens came from the prefix cache.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,f1", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body", classes="dialog"):
            yield Markdown(HELP)


# Settings fields: key, label, parser, and a hint shown as the input placeholder.
SETTING_FIELDS: list[tuple[str, str, type]] = [
    ("temperature", "Temperature (0 = greedy)", float),
    ("top_p", "Top-p (1 = off)", float),
    ("top_k", "Top-k (0 = off)", int),
    ("max_tokens", "Max tokens (-1 = no limit)", int),
    ("n_ctx", "Context size (tokens)", int),
]


class SettingsScreen(ModalScreen[dict | None]):
    """Edit the conversation's system prompt and sampling settings; returns the new values."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, system: str, settings: dict[str, Any]) -> None:
        super().__init__()
        self.system = system
        self.settings = settings

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-body", classes="dialog"):
            yield Label("System prompt")
            yield TextArea(self.system, id="system", classes="system-prompt")
            with Grid(id="settings-grid"):
                for key, label, _ in SETTING_FIELDS:
                    yield Label(label)
                    yield Input(str(self.settings.get(key, "")), id=key)
            yield Checkbox("Save the KV cache with the conversation (bigger file; resuming prefills nothing)",
                           bool(self.settings.get("save_kv")), id="save_kv")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_save(self) -> None:
        values: dict[str, Any] = {"system": self.query_one("#system", TextArea).text,
                                  "save_kv": self.query_one("#save_kv", Checkbox).value}
        for key, label, kind in SETTING_FIELDS:
            raw = self.query_one(f"#{key}", Input).value.strip()
            try:
                values[key] = kind(raw)
            except ValueError:
                self.notify(f"{label}: expected a {'whole number' if kind is int else 'number'}, got {raw!r}",
                            severity="error")
                return
        self.dismiss(values)


class ModelPickerScreen(ModalScreen[str | None]):
    """Pick one of the local models; returns the value paired with its label (a name or path)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, models: list[tuple[str, str]]) -> None:
        """`models`: (label, value) pairs."""
        super().__init__()
        self.models = models

    def compose(self) -> ComposeResult:
        with Vertical(id="picker-body", classes="dialog"):
            yield Label("Local models (edgeinfer list) — Enter loads, Esc cancels")
            if self.models:
                yield OptionList(*[Option(label, id=str(i)) for i, (label, _) in enumerate(self.models)],
                                 id="models")
            else:
                yield Label("No local models. Get one with `edgeinfer pull NAME`.")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(self.models[int(event.option.id)][1])

    def action_cancel(self) -> None:
        self.dismiss(None)


class RenameScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, hint: str = "") -> None:
        """`hint`: a line under the title box (the session id and how to resume it elsewhere)."""
        super().__init__()
        self.title_text = title
        self.hint = hint

    def compose(self) -> ComposeResult:
        with Vertical(id="rename-body", classes="dialog"):
            yield Label("Conversation title (Enter saves, Esc cancels)")
            yield Input(self.title_text, id="title")
            if self.hint:
                yield Label(self.hint, id="session-hint", markup=False)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("escape,n", "answer(False)", "No"), Binding("y", "answer(True)", "Yes")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-body", classes="dialog"):
            yield Label(self.question)
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
