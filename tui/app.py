"""The Textual chat app behind `edgeinfer chat`: the view over tui/session_policy.py and tui/controller.py.

All model work (loading, warm-up, generation, restoring saved K/V) runs in worker threads
and reports back with `call_from_thread`, so the screen keeps answering keys while the model
computes. What to load, restore and save is decided by the ChatSession (session_policy.py);
conversations are saved sessions (edgeinfer.sessions.conversations over edgeinfer.sessions.session_file),
written atomically after each message and each answer, so `edgeinfer run NAME --session ID`
continues them; resuming one made with another model file loads that model, or says it is not
on this machine and shows the messages anyway.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from textual import on, work
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual import events
from textual.widgets import Header, Label, Markdown, OptionList, ProgressBar
from textual.widgets.option_list import Option

from edgeinfer.sessions.conversations import Conversation, ConversationStore
from edgeinfer.errors import EdgeInferError
from edgeinfer.prompt.shown_answer import ShownAnswer
from edgeinfer.tui import controller, layout
from edgeinfer.tui.attachments import Attachments, image_command, images_of, label, last_user_images
from edgeinfer.tui.export import export_markdown, to_markdown
from edgeinfer.tui.image_actions import ImageActions
from edgeinfer.tui.loading import (ModelLoader, accepts_progress, default_loader, local_models,  # noqa: F401
                                   open_model, pull_model, quantization_of, short_name as _short)
from edgeinfer.tui.screens import (ConfirmScreen, HelpScreen, ModelPickerScreen, RenameScreen,
                                   SearchScreen, SettingsScreen)
from edgeinfer.tui.session_policy import DEFAULT_SAMPLING, ChatSession  # noqa: F401
from edgeinfer.tui.widgets import (AssistantMessage, KeyBar, PromptInput, Stats, StatusBar, SystemMessage,
                                   UserMessage, Welcome, code_blocks)


class ChatApp(ImageActions, App):
    """Chat with a local model; conversations in a side panel, settings per conversation."""

    TITLE = "edgeinfer chat"
    CSS = layout.CSS
    BINDINGS = layout.BINDINGS
    KEYS = layout.KEYS

    def __init__(self, model_name: str | None = None, *, load_model: ModelLoader | None = None,
                 store: ConversationStore | None = None, sampling: dict | None = None,
                 system: str = "", n_ctx: int = 4096, warm_up: bool = True, save_kv: bool = False,
                 list_models: Callable[[], list[tuple[str, str]]] | None = None,
                 pull: Callable[[str, Callable[[int, int | None], None]], None] | None = pull_model,
                 export_dir: str | Path | None = None) -> None:
        """`pull(name, report)`: downloads a model for the picker (None: no pulling).
        `export_dir`: where F9 writes Markdown files (default: the current folder)."""
        super().__init__()
        self.pull = pull
        self.export_dir = Path(export_dir) if export_dir is not None else None
        self.model_name = model_name
        self.load_model = load_model or default_loader
        self.store = store or ConversationStore()
        self.list_models = list_models or local_models
        self.warm_up = warm_up
        self.session = ChatSession(self.store, sampling=sampling, system=system, n_ctx=n_ctx, save_kv=save_kv)
        self._load_seq = 0  # the latest load; results of earlier ones are dropped
        self._gen_model = None  # the model the current (or last) answer came from
        self.model = None
        self.stats = Stats(model=model_name or "no model", n_ctx=n_ctx)
        self.loading = False
        self.generating = False
        self.last_chunk = None  # the final chunk of the last answer (usage, timings)
        self._cancel = threading.Event()
        self._stream = None
        self._answer_widget: AssistantMessage | None = None
        self._warned: set[str] = set()  # corrupt-file notices already shown
        self._previous_answer: dict | None = None  # the answer being regenerated
        self._live: controller.LiveRate | None = None  # the answer streaming now
        self.attachments = Attachments()  # images for the next message (/image PATH, Ctrl+G)

    @property
    def conv(self) -> Conversation:
        """The open conversation (the session's)."""
        return self.session.conv

    @conv.setter
    def conv(self, conv: Conversation) -> None:
        self.session.conv = conv

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal():
            with Vertical(id="sidebar"):
                yield Label("Conversations", id="sidebar-title")
                yield OptionList(id="conversations")
            with Vertical(id="main"):
                yield VerticalScroll(id="chat")
                with Vertical(id="loading"):
                    yield Label("", id="loading-label", markup=False)
                    yield ProgressBar(total=1.0, show_eta=False, id="load-progress")
                yield PromptInput(id="prompt", placeholder="Message (Enter sends, Ctrl+J new line)")
        yield StatusBar(id="status")
        yield KeyBar(self.KEYS, id="keys")

    async def on_mount(self) -> None:
        self.sub_title = self.conv.display_title
        self._refresh_conversations()
        self._show_stats()
        self._fit_sidebar(self.size.width)
        await self._show_conversation()
        self.query_one("#prompt", PromptInput).focus()
        if self.model_name:
            self.start_loading(self.model_name, self.conv.settings["n_ctx"])
        else:
            self.stats.state = "no model: Ctrl+O picks one"
            self._show_stats()
            self.action_pick_model()

    def on_resize(self, event: events.Resize) -> None:
        self._fit_sidebar(event.size.width)

    def _fit_sidebar(self, columns: int) -> None:
        self.query_one("#sidebar").styles.width = controller.sidebar_width(columns)

    # -- model loading ---------------------------------------------------------------------------
    def start_loading(self, name: str, n_ctx: int) -> None:
        self._cancel.set()  # a running answer stops before the model goes away
        self.loading = True
        self.model = None
        self.model_name = name
        self.session.model_loading()
        self._load_seq += 1
        self.stats = Stats(model=_short(name), n_ctx=n_ctx, state="loading…")
        self._set_loading(f"loading {_short(name)}…", 0.0)
        self._show_stats()
        self._load_worker(name, n_ctx, self._load_seq)

    @work(thread=True, group="model", exit_on_error=False)
    def _load_worker(self, name: str, n_ctx: int, seq: int) -> None:
        def progress(stage: str, fraction: float | None = None, count: tuple[int, int] | None = None) -> None:
            done, label = controller.load_progress(stage, fraction, count)
            self._ui(self._load_stage, seq, f"{_short(name)}: {label}…", done)

        try:
            model = open_model(self.load_model, name, n_ctx, progress, warm_up=self.warm_up)
            quant = quantization_of(model.path)
        except EdgeInferError as exc:
            self._ui(self._load_failed, name, str(exc), seq)
            return
        except Exception as exc:  # noqa: BLE001 - a bug must not take the saved chats down with it
            self._ui(self._load_failed, name, f"internal error: {type(exc).__name__}: {exc}", seq)
            return
        self._ui(self._loaded, model, quant, seq)

    def _set_loading(self, text: str | None, done: float | None = None) -> None:
        box = self.query_one("#loading")
        box.set_class(text is not None, "visible")
        self.query_one("#loading-label", Label).update(text or "")
        if done is not None:
            self.query_one("#load-progress", ProgressBar).update(total=1.0, progress=done)

    def _load_stage(self, seq: int, text: str, done: float) -> None:
        if seq == self._load_seq and self.loading:
            self._set_loading(text, done)

    def _loaded(self, model, quant: str, seq: int) -> None:
        if seq != self._load_seq:  # another model was asked for meanwhile
            return
        self.model = model
        self.loading = False
        self._set_loading(None)
        self.stats = Stats(model=_short(self.model_name or model.name), quant=quant, n_ctx=model.n_ctx)
        self.stats.ctx_used = self.session.count_context(self.model)
        self._show_stats()
        self.notify(f"{_short(self.model_name)} ready", timeout=2)
        self._refresh_welcome()
        self._restore_kv()

    def _load_failed(self, name: str, message: str, seq: int) -> None:
        if seq != self._load_seq:
            return
        self.loading = False
        self._set_loading(None)
        self.stats = Stats(model="no model", n_ctx=0, state="load failed: Ctrl+O picks a model")
        self._show_stats()
        self.notify(message, title=f"could not load {_short(name)}", severity="error", timeout=10)

    # -- sending and streaming ---------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def _on_submit(self, event: PromptInput.Submitted) -> None:
        text = event.text
        if not text.strip() and not self.attachments.pending:
            return
        if self.model is None:
            self._no_model()
            return
        path = image_command(text)
        if path is not None:  # `/image PATH`: the prompt box is cleared only once the image is kept
            if self._attach_noted(path):
                event.prompt.clear()
            return
        if self._busy():
            return
        event.prompt.clear()
        message = {"role": "user", "content": text}
        images = self.attachments.take()
        if images:
            message["images"] = images
        self._show_pending()
        self.conv.messages.append(message)
        await self.query("#welcome").remove()
        await self.query_one("#chat").mount(UserMessage(text, [label(r) for r in images]))
        await self._start_answer()

    def _no_model(self) -> None:
        self.notify("the model is still loading" if self.loading else "no model loaded: Ctrl+O picks one",
                    severity="warning")

    async def _start_answer(self, previous: dict | None = None) -> None:
        """Stream an answer to the conversation; `previous`: the answer it regenerates (kept as an
        alternative of the turn)."""
        self._previous_answer = previous
        chat = self.query_one("#chat", VerticalScroll)
        widget = AssistantMessage(model=_short(self.model_name))
        await chat.mount(widget)
        chat.scroll_end(animate=False)
        self._stream = Markdown.get_stream(widget)
        self._cancel = threading.Event()
        self.generating = True
        self.session.begin_answer(self.model, self.model_name)
        self._gen_model = self.model
        self._answer_widget = widget
        self._save()  # the question survives a crash during the answer
        self.stats.ctx_used = self.session.count_context(self.model)
        self.stats.ttft_s = self.stats.gen_tps = self.stats.cached = None
        self.stats.state = "answering… (Esc stops)"
        self._live = controller.LiveRate(self.stats.ctx_used, time.monotonic())
        self._show_stats()
        messages, problems = self.attachments.chat_messages(self.conv.messages, self.conv.chat_messages(),
                                                            self.model, _short(self.model_name))
        for problem in problems:
            self.notify(problem, severity="warning", timeout=8)
        self._generate(self.model, messages, self.session.params(), widget, self._cancel)

    @work(thread=True, group="generate", exit_on_error=False)
    def _generate(self, model, messages: list[dict], params: dict, widget: AssistantMessage,
                  cancel: threading.Event) -> None:
        last, error = None, None
        view = ShownAnswer.for_model(model)  # gpt-oss's channels shown as Qwen's <think> block
        try:
            for chunk in model.chat(messages, stream=True, cancel=cancel, **params):
                text = view.push(chunk.text)
                if text:
                    self._ui(self._on_text, widget, text)
                last = chunk
            text = view.finish()
            if text:
                self._ui(self._on_text, widget, text)
        except EdgeInferError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - keep the app (and the chat) alive, show it
            error = f"internal error: {type(exc).__name__}: {exc}"
        self._ui(self._on_done, widget, last, error)

    def _ui(self, callback, *args) -> None:
        """call_from_thread that tolerates the app having exited (then stop the worker's work)."""
        try:
            self.call_from_thread(callback, *args)
        except RuntimeError:
            self._cancel.set()

    async def _on_text(self, widget: AssistantMessage, text: str) -> None:
        if widget is not self._answer_widget:  # the app is quitting
            return
        widget.text += text
        self._live_stats()
        if self._stream is not None:
            await self._stream.write(text)
        chat = self.query_one("#chat", VerticalScroll)
        if chat.max_scroll_y - chat.scroll_y < 4:  # follow the answer unless the user scrolled up
            chat.scroll_end(animate=False)

    async def _on_done(self, widget: AssistantMessage, last, error: str | None) -> None:
        if widget is not self._answer_widget:  # already settled (the app is quitting)
            return
        self._answer_widget = None
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.generating = False
        self._live = None
        self.last_chunk = last
        if last is not None and self.model is not None and self.model is self._gen_model:
            self.session.answered()  # the model's K/V now hold this conversation
        self.stats.state = ""
        if error:
            self.notify(error, title="error", severity="error", timeout=10)
        asked = last_user_images(self.conv.messages[-1:])  # the question's images, if it is taken back
        end = self.session.end_answer(self._previous_answer, widget.text,
                                      last.finish_reason if last is not None else None)
        if end.kind == "answer":
            widget.set_position(controller.answer_position(end.message))
            if end.message["finish_reason"] == "cancelled":
                self.stats.state = "stopped"
        else:
            await widget.remove()
        if end.kind == "previous":
            await self._mount_answer(end.message)
        elif end.kind == "question":
            await self._remove_last_widget(UserMessage)
            prompt = self.query_one("#prompt", PromptInput)
            if not prompt.text:
                prompt.text = end.question
            self.attachments.give_back(asked)
            self._show_pending()
        if last is not None and last.usage is not None:
            u, t = last.usage, last.timings
            self.stats.ctx_used = u.prompt_tokens + u.completion_tokens
            self.stats.cached = u.cached_tokens
            if t is not None:
                self.stats.ttft_s, self.stats.gen_tps = t.ttft_s, t.gen_tps
        self._show_stats()
        if self.conv.messages:
            self._save()

    # -- actions -------------------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.generating:
            self._cancel.set()
            self.stats.state = "stopping…"
            self._show_stats()

    async def action_regenerate(self) -> None:
        if not self._idle_with_model():
            return
        if not self.conv.messages or self.conv.messages[-1]["role"] != "assistant":
            self.notify("no answer to regenerate", severity="warning")
            return
        previous = self.conv.messages.pop()
        await self._remove_last_widget(AssistantMessage)
        await self._start_answer(previous)

    async def action_step_answer(self, delta: int) -> None:
        """Show the previous or next answer of the last turn (kept by Ctrl+R)."""
        if self.generating:
            return
        last = self.conv.messages[-1] if self.conv.messages else None
        if last is None or last.get("role") != "assistant":
            return
        if not controller.step_answer(last, delta):
            if len(controller.answers_of(last)) < 2:
                self.notify("this answer has no alternatives: Ctrl+R makes one", timeout=3)
            return
        await self._remove_last_widget(AssistantMessage)
        await self._mount_answer(last)
        self.stats.ctx_used = self.session.count_context(self.model)
        self._show_stats()
        self._save()

    @on(PromptInput.StepAnswer)
    async def _on_step(self, event: PromptInput.StepAnswer) -> None:
        await self.action_step_answer(event.delta)

    async def _mount_answer(self, message: dict) -> None:
        chat = self.query_one("#chat", VerticalScroll)
        await chat.mount(self._answer_view(message))
        chat.scroll_end(animate=False)

    def _answer_view(self, message: dict) -> AssistantMessage:
        model = _short(self.conv.model) if self.conv.model else ""
        return AssistantMessage(message["content"], model=model, position=controller.answer_position(message))

    async def action_edit_last(self) -> None:
        if self._busy():
            return
        images = last_user_images(self.conv.messages)
        answers, text = self.session.take_back_last_message()
        for _ in range(answers):
            await self._remove_last_widget(AssistantMessage)
        if text is None:
            self.notify("no message to edit", severity="warning")
            return
        await self._remove_last_widget(UserMessage)
        self.attachments.give_back(images)  # the message keeps its images when sent again
        self._show_pending()
        prompt = self.query_one("#prompt", PromptInput)
        prompt.text = text
        prompt.move_cursor(prompt.document.end)
        prompt.focus()
        self._save()

    def action_copy_answer(self) -> None:
        answer = self.session.last_answer()
        if answer is None:
            self.notify("no answer to copy yet", severity="warning")
            return
        self.copy_to_clipboard(answer)
        self.notify(f"copied the answer ({len(answer)} characters)", timeout=2)

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.session.last_answer() or "")
        if not blocks:
            self.notify("the last answer has no code block", severity="warning")
            return
        self.copy_to_clipboard(blocks[-1])
        self.notify(f"copied a code block ({len(blocks[-1].splitlines())} lines)", timeout=2)

    async def action_new_conversation(self) -> None:
        if self._busy():
            return
        old = self.session.start_new(self.model, self.model_name)
        await self._show_conversation()
        self.notify(controller.new_chat_notice(old.system, old.settings, self.session.initial_settings), timeout=5)

    @on(OptionList.OptionSelected, "#conversations")
    async def _on_pick_conversation(self, event: OptionList.OptionSelected) -> None:
        await self.open_conversation(event.option.id)

    async def open_conversation(self, conv_id: str) -> None:
        """Resume a saved conversation: show it, then make sure its model is the loaded one."""
        if self._busy():
            return
        try:
            valid = self.session.open(conv_id)
        except EdgeInferError as exc:
            self.notify(str(exc), title="cannot open conversation", severity="error")
            self._refresh_conversations()
            return
        if not valid:
            self.notify("its saved settings are invalid; the defaults apply", title=self.conv.display_title,
                        severity="warning")
        await self._show_conversation()
        self._follow_model()
        self.query_one("#prompt", PromptInput).focus()

    def _follow_model(self) -> None:
        """Load the model the conversation was made with (or say it is missing), and restore its K/V."""
        follow = self.session.follow_model(self.model, self.model_name, self.loading, self._local_names)
        if follow.action == "wait":  # on its way: the K/V are restored once it is loaded
            return
        if follow.action == "load":
            self.notify(f"loading {_short(follow.target)}, the model this conversation was made with", timeout=4)
            self.start_loading(follow.target, self.conv.settings["n_ctx"])
            return
        if follow.action == "missing":
            self._model_missing(self.conv)
        self._apply_context_size()  # a reload restores the K/V when it is done
        if follow.action == "restore":
            self._restore_kv()

    def _local_names(self) -> list[str]:
        try:
            return [value for _, value in self.list_models()]
        except EdgeInferError:
            return []

    def _model_missing(self, conv: Conversation) -> None:
        now = f"continues it with {_short(self.model_name)}" if self.model_name else "needs a model (Ctrl+O)"
        self.notify(f"It was made with {conv.model_label}, which is not on this machine. Its messages "
                    f"are shown; a new message {now}.", title="model not available",
                    severity="warning", timeout=12)

    def _restore_kv(self) -> None:
        """Import the conversation's saved K/V into the loaded model, so nothing is prefilled again."""
        if self.session.restore_kv(self.model, self.loading):
            self._kv_worker(self.model, self.conv)

    @work(thread=True, group="kv", exit_on_error=False)
    def _kv_worker(self, model, conv: Conversation) -> None:
        try:
            saved, n = self.session.import_kv(model, conv)
        except Exception as exc:  # noqa: BLE001 - only a cache: say so and go on
            message = str(exc) if isinstance(exc, EdgeInferError) else f"{type(exc).__name__}: {exc}"
            self._ui(self._kv_failed, message)
            return
        self._ui(self._kv_restored, model, conv.id, saved, n)

    def _kv_restored(self, model, conv_id: str, saved, n: int) -> None:
        if self.model is model and self.session.kv_restored(conv_id, saved, n):
            self.notify(f"restored the saved KV cache ({n} tokens): nothing to prefill again", timeout=3)

    def _kv_failed(self, message: str) -> None:
        self.notify(f"{message}; the next answer reads the conversation again",
                    title="KV cache not restored", severity="warning")

    def action_settings(self) -> None:
        if self._busy():
            return

        async def apply(values: dict | None) -> None:
            if values is None:
                return
            if self.session.apply_settings(values):  # checked by the screen (controller.parse_settings)
                self._save()
            self.notify("settings saved", timeout=2)
            await self._show_conversation()  # the system prompt is part of it
            self._apply_context_size()

        self.push_screen(SettingsScreen(self.conv.system, self.conv.settings, self.session.params()), apply)

    def action_pick_model(self) -> None:
        if self._busy():
            return
        try:
            models = self.list_models()
        except EdgeInferError as exc:
            self.notify(str(exc), severity="error")
            models = []

        def picked(value: str | None) -> None:
            if value:
                self.start_loading(value, self.conv.settings["n_ctx"])

        self.push_screen(ModelPickerScreen(models, pull=self.pull), picked)

    def action_search(self) -> None:
        convs, _ = self.store.list()

        async def picked(conv_id: str | None) -> None:
            if conv_id and conv_id != self.conv.id:
                await self.open_conversation(conv_id)

        self.push_screen(SearchScreen(convs), picked)

    def action_copy_chat(self) -> None:
        if not self.conv.messages:
            self.notify("nothing to copy yet", severity="warning")
            return
        text = to_markdown(self.conv)
        self.copy_to_clipboard(text)  # OSC 52: reaches the clipboard of the terminal's machine
        self.notify(f"copied the conversation as Markdown ({len(text)} characters)", timeout=3)

    def action_export(self) -> None:
        if not self.conv.messages:
            self.notify("nothing to export yet", severity="warning")
            return
        try:
            path = export_markdown(self.conv, self.export_dir or Path.cwd())
        except OSError as exc:
            self.notify(f"could not export: {exc.strerror or exc}", severity="error")
            return
        self.notify(f"exported to {path}", timeout=6)

    def action_toggle_sidebar(self) -> None:
        self.query_one("#sidebar").toggle_class("hidden")

    def action_rename(self) -> None:
        def renamed(title: str | None) -> None:
            if title is None:
                return
            self.conv.title = title
            self._save()
            self.sub_title = self.conv.display_title
            self._refresh_conversations()

        model = self.conv.model or self.model_name or "MODEL"
        hint = f"Session {self.conv.id}: `edgeinfer run {model} --session {self.conv.id}` continues it."
        self.push_screen(RenameScreen(self.conv.display_title, hint), renamed)

    def action_delete(self) -> None:
        if self._busy():
            return

        async def answered(yes: bool | None) -> None:
            if not yes:
                return
            self.store.delete(self.conv.id)
            self.session.start_new(self.model, self.model_name)
            await self._show_conversation()
            self.notify("conversation deleted", timeout=2)

        self.push_screen(ConfirmScreen(f"Delete “{self.conv.display_title}”?"), answered)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        self._cancel.set()  # the worker stops at its next token
        if self.generating and self._answer_widget is not None and self._answer_widget.text:
            # Keep the part of the answer written so far, as Esc would.
            self.session.keep_partial(self._previous_answer, self._answer_widget.text)
            self.generating = False
            self._save()
        self._answer_widget = None
        self.exit()

    # -- helpers -----------------------------------------------------------------------------------
    def _busy(self) -> bool:
        """Whether an answer is streaming (then say so)."""
        if self.generating:
            self.notify("still answering: Esc stops it", severity="warning")
        return self.generating

    def _idle_with_model(self) -> bool:
        if self._busy():
            return False
        if self.model is None:
            self.notify("no model loaded", severity="warning")
            return False
        return True

    def _apply_context_size(self) -> None:
        """A different context size means the model is loaded again with it."""
        n_ctx = self.session.context_to_load(self.model)
        if n_ctx and self.model_name:
            self.start_loading(self.model_name, n_ctx)
        elif self.model is None and not self.loading:
            self.stats.n_ctx = self.conv.settings.get("n_ctx") or 0
            self._show_stats()

    async def _show_conversation(self) -> None:
        chat = self.query_one("#chat", VerticalScroll)
        await chat.remove_children()
        widgets: list = []
        if not self.conv.messages:
            widgets.append(Welcome(self._welcome()))
        if self.conv.system.strip():
            widgets.append(SystemMessage(self.conv.system))
        widgets += [UserMessage(m["content"], [label(r) for r in images_of(m)]) if m["role"] == "user"
                    else self._answer_view(m) for m in self.conv.messages]
        if widgets:
            await chat.mount_all(widgets)
        chat.scroll_end(animate=False)
        self.sub_title = self.conv.display_title
        self.stats.ctx_used = self.session.count_context(self.model)
        self.stats.ttft_s = self.stats.gen_tps = self.stats.cached = None
        self._show_stats()
        self._refresh_conversations()

    def _welcome(self) -> str:
        name = _short(self.model_name) if self.model_name else None
        return controller.welcome_text(name)

    def _refresh_welcome(self) -> None:
        for welcome in self.query(Welcome):
            welcome.update(self._welcome())

    def _live_stats(self) -> None:
        """Context used and tokens/s while the answer streams; the final chunk's replace them."""
        if self._live is None:
            return
        self._live.piece(time.monotonic())
        self.stats.ttft_s, self.stats.gen_tps = self._live.ttft_s, self._live.gen_tps
        self.stats.ctx_used = self._live.ctx_used
        self._show_stats()

    async def _remove_last_widget(self, kind: type) -> None:
        found = self.query_one("#chat").query(kind)
        if found:
            await found.last().remove()

    def _save(self) -> None:
        try:
            self.session.save(self.model, self.generating)
        except (OSError, EdgeInferError) as exc:
            self.notify(f"could not save the conversation: {exc}", severity="error")
            return
        self.sub_title = self.conv.display_title
        self._refresh_conversations()

    def _refresh_conversations(self) -> None:
        convs, problems = self.store.list()
        for problem in problems:
            if problem not in self._warned:
                self._warned.add(problem)
                self.notify(problem, title="conversation file", severity="warning", timeout=8)
        panel = self.query_one("#conversations", OptionList)
        panel.clear_options()
        panel.add_options([Option(c.display_title, id=c.id) for c in convs])
        for i, c in enumerate(convs):
            if c.id == self.conv.id:
                panel.highlighted = i

    def _show_stats(self) -> None:
        self.query_one("#status", StatusBar).show(self.stats)

