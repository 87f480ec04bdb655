"""Modal screens: help, settings, model picker (and pull), search, image path, rename and delete confirmation."""

from __future__ import annotations

from typing import Any, Callable

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Markdown, OptionList, ProgressBar, TextArea
from textual.widgets.option_list import Option

from edgeinfer.tui.controller import SETTING_FIELDS, SettingsError, format_setting, parse_settings, search

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
| Ctrl+R | regenerate the last answer (the earlier answers are kept) |
| ← / → | in an empty prompt box: previous / next answer of the last turn ("2/3") |
| Ctrl+L | edit the last message (puts it back in the prompt box) |
| F3 | copy the last answer to the clipboard |
| F4 | copy the last code block of the last answer |
| F5 | copy the whole conversation (Markdown) |
| F9 | export the conversation to a Markdown file |
| Ctrl+F | search all conversations (titles and text) |
| Ctrl+C | copy the selected text |
| Ctrl+S | settings: system prompt, temperature, top-p, top-k, min-p, repeat penalty, seed, stop strings, max tokens, context size |
| Ctrl+O | pick another local model, or pull one by name |
| Ctrl+G | attach an image to the next message (or type `/image PATH`; needs `--mmproj`) |
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


STOP_HINT = "e.g. User:, \\n\\n"


class SettingsScreen(ModalScreen[dict | None]):
    """Edit the conversation's system prompt and sampling settings; returns the checked values
    (controller.parse_settings), or stays open with a one-line notice on a bad one."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, system: str, settings: dict[str, Any], base: dict | None = None) -> None:
        """`base`: the sampling values the settings override (checked together with them)."""
        super().__init__()
        self.system = system
        self.settings = settings
        self.base = base or {}

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-body", classes="dialog"):
            with VerticalScroll(id="settings-fields"):
                yield Label("System prompt (shown at the top of the conversation)")
                yield TextArea(self.system, id="system", classes="system-prompt")
                with Grid(id="settings-grid"):
                    for key, label, _ in SETTING_FIELDS:
                        yield Label(label)
                        yield Input(format_setting(key, self.settings.get(key)), id=key,
                                    placeholder=STOP_HINT if key == "stop" else "")
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
        raw: dict[str, Any] = {key: self.query_one(f"#{key}", Input).value for key, _, _ in SETTING_FIELDS}
        raw["save_kv"] = self.query_one("#save_kv", Checkbox).value
        try:
            values = parse_settings(raw, self.base)
        except SettingsError as exc:
            self.notify(str(exc), title="settings not saved", severity="error")
            return
        values["system"] = self.query_one("#system", TextArea).text
        self.dismiss(values)


class ModelPickerScreen(ModalScreen[str | None]):
    """Pick one of the local models, or pull one by name (alias or hf.co/…) with a progress bar;
    returns the value to load (a name or path)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, models: list[tuple[str, str]], pull=None) -> None:
        """`models`: (label, value) pairs. `pull(name, report)`: downloads `name` (in a worker
        thread), calling report(done_bytes, total_bytes or None); None when pulling is off."""
        super().__init__()
        self.models = models
        self.pull = pull
        self.pulling = False

    def compose(self) -> ComposeResult:
        with Vertical(id="picker-body", classes="dialog"):
            yield Label("Local models (edgeinfer list) — Enter loads, Esc cancels")
            if self.models:
                yield OptionList(*[Option(label, id=str(i)) for i, (label, _) in enumerate(self.models)],
                                 id="models")
            else:
                yield Label("No local models yet: pull one below (gemma3-270m is small and quick).",
                            id="no-models")
            if self.pull is not None:
                yield Label("Pull a model: an alias (e.g. gemma3-270m) or hf.co/OWNER/REPO[:QUANT], then Enter")
                yield Input(placeholder="model name to download", id="pull-name")
                yield ProgressBar(id="pull-progress", show_eta=False)
                yield Label("", id="pull-status", markup=False)

    def on_mount(self) -> None:
        if self.pull is not None:
            self.query_one("#pull-progress").display = False
            if not self.models:
                self.query_one("#pull-name", Input).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if not self.pulling:
            self.dismiss(self.models[int(event.option.id)][1])

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        name = event.value.strip()
        if not name or self.pulling:
            return
        self.pulling = True
        bar = self.query_one("#pull-progress", ProgressBar)
        bar.display = True
        bar.update(total=None, progress=0)
        self.query_one("#pull-status", Label).update(f"pulling {name}…")
        self._pull_worker(name)

    @work(thread=True, group="pull", exit_on_error=False)
    def _pull_worker(self, name: str) -> None:
        from edgeinfer.errors import EdgeInferError

        def report(done: int, total: int | None) -> None:
            self.app.call_from_thread(self._show_progress, name, done, total)

        try:
            self.pull(name, report)
        except EdgeInferError as exc:
            self.app.call_from_thread(self._pull_failed, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - one line, never a traceback on the screen
            self.app.call_from_thread(self._pull_failed, f"internal error: {type(exc).__name__}: {exc}")
            return
        self.app.call_from_thread(self._pulled, name)

    def _show_progress(self, name: str, done: int, total: int | None) -> None:
        from edgeinfer.tui.controller import human_size

        bar = self.query_one("#pull-progress", ProgressBar)
        bar.update(total=total or None, progress=done)
        of = f" of {human_size(total)}" if total else ""
        self.query_one("#pull-status", Label).update(f"pulling {name}: {human_size(done)}{of}")

    def _pull_failed(self, message: str) -> None:
        self.pulling = False
        self.query_one("#pull-progress").display = False
        self.query_one("#pull-status", Label).update(message)
        self.notify(message, title="pull failed", severity="error")

    def _pulled(self, name: str) -> None:
        self.pulling = False
        self.dismiss(name)

    def action_cancel(self) -> None:
        if self.pulling:
            self.notify("still pulling: wait for it to finish", severity="warning")
            return
        self.dismiss(None)


class SearchScreen(ModalScreen[str | None]):
    """Search every conversation (titles and text); returns the id of the one picked."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, conversations: list) -> None:
        super().__init__()
        self.conversations = conversations
        self.hits: list = []

    def compose(self) -> ComposeResult:
        with Vertical(id="search-body", classes="dialog"):
            yield Label("Search conversations — type words, ↓ and Enter opens one, Esc closes")
            yield Input(placeholder="words to find in titles and messages", id="query")
            yield OptionList(id="hits")
            yield Label("", id="search-count")

    def on_mount(self) -> None:
        self.query_one("#query", Input).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.hits = search(self.conversations, event.value)
        hits = self.query_one("#hits", OptionList)
        hits.clear_options()
        hits.add_options([Option(f"{h.title}" + (f"\n  {h.snippet}" if h.snippet else ""), id=h.conv_id)
                          for h in self.hits])
        count = len(self.hits)
        self.query_one("#search-count", Label).update(
            "" if not event.value.strip() else f"{count} conversation{'s' if count != 1 else ''}")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if self.hits:
            self.dismiss(self.hits[0].conv_id)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ImagePathScreen(ModalScreen[None]):
    """Ctrl+G: an image file's path for the next message. `attach(path)` checks and keeps it,
    raising EdgeInferError for a bad one: then a notice says why and the path stays to fix."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, attach: Callable[[str], Any]) -> None:
        super().__init__()
        self.attach = attach

    def compose(self) -> ComposeResult:
        with Vertical(id="image-body", classes="dialog"):
            yield Label("Image for the next message: a PNG, JPEG, WebP or GIF file (Enter attaches, Esc cancels)")
            yield Input(placeholder="path/to/image.png", id="image-path")

    def on_mount(self) -> None:
        self.query_one("#image-path", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        from edgeinfer.errors import EdgeInferError

        event.stop()
        try:
            self.attach(event.value.strip())
        except EdgeInferError as exc:
            self.notify(str(exc), severity="error")
            return
        self.dismiss(None)

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
