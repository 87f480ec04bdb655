"""The Textual chat app behind `edgeinfer chat`.

All model work (loading, warm-up, generation, restoring saved K/V) runs in worker threads
and reports back with `call_from_thread`, so the screen keeps answering keys while the model
computes. Conversations are saved sessions (edgeinfer.conversations over
edgeinfer.saved_session), written atomically after each message and each answer, so
`edgeinfer run NAME --session ID` continues them; resuming one made with another model file
loads that model, or says it is not on this machine and shows the messages anyway.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Label, LoadingIndicator, Markdown, OptionList
from textual.widgets.option_list import Option

from edgeinfer.conversations import (SAMPLING_KEYS, Conversation, ConversationStore, identify,
                                     same_model)
from edgeinfer.errors import EdgeInferError
from edgeinfer.tui.screens import (ConfirmScreen, HelpScreen, ModelPickerScreen, RenameScreen,
                                   SettingsScreen)
from edgeinfer.tui.widgets import AssistantMessage, PromptInput, Stats, StatusBar, UserMessage, code_blocks

# Settings edited per conversation (the rest of the sampling flags come from the command line,
# or from the saved session when `edgeinfer run` made it). save_kv: also save the K/V cache.
SETTING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "n_ctx", "save_kv")
DEFAULT_SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, max_tokens=-1)

ModelLoader = Callable[[str, int], Any]  # (name or path, n_ctx) -> edgeinfer.api.Model


def default_loader(name: str, n_ctx: int):
    import edgeinfer

    return edgeinfer.load(name, n_ctx=n_ctx)


def local_models() -> list[tuple[str, str]]:
    """(label, name) for every model `edgeinfer list` shows; its names resolve offline."""
    from edgeinfer.model_info import human_bytes
    from edgeinfer.registry import list_local

    return [(f"{m.name}  ({human_bytes(m.size_bytes)})", m.name) for m in list_local()]


def quantization_of(path) -> str:
    from edgeinfer.loader import open_model
    from edgeinfer.model_info import describe

    try:
        return describe(open_model(path)).quantization
    except EdgeInferError:
        return ""


class ChatApp(App):
    """Chat with a local model; conversations in a side panel, settings per conversation."""

    TITLE = "edgeinfer chat"
    CSS = """
    #sidebar { width: 30; border-right: vkey $primary 50%; padding: 0 1; }
    #sidebar.hidden { display: none; }
    #sidebar-title { text-style: bold; color: $text-accent; padding: 0 0 1 0; }
    #conversations { height: 1fr; border: none; background: $surface; }
    #main { width: 1fr; }
    #chat { height: 1fr; padding: 0 1; scrollbar-gutter: stable; }
    .message { margin: 1 0 0 0; padding: 0 1; border: round $primary 40%; height: auto; }
    .message.user { border: round $secondary; }
    .message.assistant { border: round $primary; padding: 0 1 0 1; }
    .message.assistant > *:last-child { margin-bottom: 0; }
    #loading { height: 3; display: none; }
    #loading.visible { display: block; }
    #loading LoadingIndicator { width: 8; height: 3; }
    #loading-label { padding: 1 1; }
    #prompt { height: auto; min-height: 3; max-height: 12; border: tall $accent; }
    StatusBar { height: 1; background: $panel; color: $text; padding: 0 1; }
    .dialog { width: 80%; max-width: 100; height: auto; max-height: 90%; padding: 1 2;
              border: thick $primary; background: $surface; }
    ModalScreen { align: center middle; }
    #settings-grid { grid-size: 2; grid-columns: 28 1fr; grid-rows: 3; height: auto; }
    #settings-grid Label { padding: 1 0; }
    .system-prompt { height: 6; }
    .buttons { height: auto; align-horizontal: right; padding: 1 0 0 0; }
    .buttons Button { margin: 0 0 0 2; }
    #help-body { height: 90%; }
    #models { height: auto; max-height: 20; }
    """

    # Keys the focused prompt box (TextArea) already uses are avoided: Ctrl+E/K/Y/A/U/W/Z,
    # Ctrl+C/X/V, F5-F7.
    BINDINGS = [  # in footer order: the footer cuts off the tail on narrow terminals
        Binding("f1", "help", "Help"),
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_conversation", "New"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+l", "edit_last", "Edit last"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+o", "pick_model", "Model"),
        Binding("f3", "copy_answer", "Copy answer"),
        Binding("f4", "copy_code", "Copy code"),
        Binding("ctrl+b", "toggle_sidebar", "Chats"),
        Binding("f2", "rename", "Rename"),
        Binding("f8", "delete", "Delete"),
        Binding("ctrl+t", "toggle_dark", "Theme"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, model_name: str | None = None, *, load_model: ModelLoader | None = None,
                 store: ConversationStore | None = None, sampling: dict | None = None,
                 system: str = "", n_ctx: int = 4096, warm_up: bool = True, save_kv: bool = False,
                 list_models: Callable[[], list[tuple[str, str]]] | None = None) -> None:
        super().__init__()
        self.model_name = model_name
        self.load_model = load_model or default_loader
        self.store = store or ConversationStore()
        self.list_models = list_models or local_models
        self.warm_up = warm_up
        # Sampling flags from the command line; the per-conversation settings override them.
        self.base_params = {**DEFAULT_SAMPLING, **(sampling or {})}
        self.default_settings = {k: self.base_params[k] for k in SETTING_KEYS if k in SAMPLING_KEYS}
        self.default_settings.update(n_ctx=n_ctx, save_kv=bool(save_kv))
        self.default_system = system or ""
        self.conv = self._fresh_conversation()
        # (tokens, k, v, pos) last exported for self.conv: written with it when save_kv is on.
        self.kv: tuple | None = None
        self._resident_conv: str | None = None  # the conversation whose tokens the model's K/V hold
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

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal():
            with Vertical(id="sidebar"):
                yield Label("Conversations", id="sidebar-title")
                yield OptionList(id="conversations")
            with Vertical(id="main"):
                yield VerticalScroll(id="chat")
                with Horizontal(id="loading"):
                    yield LoadingIndicator()
                    yield Label("", id="loading-label")
                yield PromptInput(id="prompt", placeholder="Message (Enter sends, Ctrl+J new line)")
        yield StatusBar(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.conv.display_title
        self._refresh_conversations()
        self._show_stats()
        self.query_one("#prompt", PromptInput).focus()
        if self.model_name:
            self.start_loading(self.model_name, self.conv.settings["n_ctx"])
        else:
            self.action_pick_model()

    # -- model loading ---------------------------------------------------------------------------
    def start_loading(self, name: str, n_ctx: int) -> None:
        self._cancel.set()  # a running answer stops before the model goes away
        self.loading = True
        self.model = None
        self.model_name = name
        self._resident_conv = None
        self._load_seq += 1
        self.stats = Stats(model=_short(name), n_ctx=n_ctx, state="loading…")
        self._set_loading(f"loading {_short(name)}…")
        self._show_stats()
        self._load_worker(name, n_ctx, self._load_seq)

    @work(thread=True, group="model", exit_on_error=False)
    def _load_worker(self, name: str, n_ctx: int, seq: int) -> None:
        try:
            model = self.load_model(name, n_ctx)
            quant = quantization_of(model.path)
            if self.warm_up:
                # The first forward pass compiles (or loads cached) kernels: say so, not freeze.
                self._ui(self._set_loading, "compiling kernels… (slow only on the first start)")
                model.generate(model.tokenize("Hello"), max_tokens=1, temperature=0.0)
                model.reset()
        except EdgeInferError as exc:
            self._ui(self._load_failed, name, str(exc), seq)
            return
        except Exception as exc:  # noqa: BLE001 - a bug must not take the saved chats down with it
            self._ui(self._load_failed, name, f"internal error: {type(exc).__name__}: {exc}", seq)
            return
        self._ui(self._loaded, model, quant, seq)

    def _set_loading(self, text: str | None) -> None:
        box = self.query_one("#loading")
        box.set_class(text is not None, "visible")
        self.query_one("#loading-label", Label).update(text or "")

    def _loaded(self, model, quant: str, seq: int) -> None:
        if seq != self._load_seq:  # another model was asked for meanwhile
            return
        self.model = model
        self.loading = False
        self._set_loading(None)
        self.stats = Stats(model=_short(self.model_name or model.name), quant=quant, n_ctx=model.n_ctx)
        self.stats.ctx_used = self._count_context()
        self._show_stats()
        self.notify(f"{_short(self.model_name)} ready", timeout=2)
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
        if not text.strip():
            return
        if self.model is None:
            self.notify("the model is still loading" if self.loading else "no model loaded: Ctrl+O picks one",
                        severity="warning")
            return
        if self.generating:
            self.notify("still answering: Esc stops it", severity="warning")
            return
        event.prompt.clear()
        self.conv.messages.append({"role": "user", "content": text})
        await self.query_one("#chat").mount(UserMessage(text))
        await self._start_answer()

    async def _start_answer(self) -> None:
        chat = self.query_one("#chat", VerticalScroll)
        widget = AssistantMessage(model=_short(self.model_name))
        await chat.mount(widget)
        chat.scroll_end(animate=False)
        self._stream = Markdown.get_stream(widget)
        self._cancel = threading.Event()
        self.generating = True
        if not same_model(self.conv.identity, self.model.identity):
            self.kv = None  # K/V of another model's tokens: useless from now on
        self.conv.model = self.model_name or ""
        self.conv.identity = dict(self.model.identity)
        self.conv.model_path = str(self.model.path)
        self._gen_model = self.model
        self._answer_widget = widget
        self._save()  # the question survives a crash during the answer
        self.stats.ctx_used = self._count_context()
        self.stats.ttft_s = self.stats.gen_tps = self.stats.cached = None
        self.stats.state = "answering… (Esc stops)"
        self._show_stats()
        self._generate(self.model, self.conv.chat_messages(), self._params(), widget, self._cancel)

    def _params(self) -> dict:
        params = dict(self.base_params)
        params.update({k: v for k, v in self.conv.settings.items() if k in SAMPLING_KEYS})
        return params

    @work(thread=True, group="generate", exit_on_error=False)
    def _generate(self, model, messages: list[dict], params: dict, widget: AssistantMessage,
                  cancel: threading.Event) -> None:
        last, error = None, None
        try:
            for chunk in model.chat(messages, stream=True, cancel=cancel, **params):
                if chunk.text:
                    self._ui(self._on_text, widget, chunk.text)
                last = chunk
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
        self.last_chunk = last
        if last is not None and self.model is not None and self.model is self._gen_model:
            self._resident_conv = self.conv.id  # the model's K/V now hold this conversation
        self.stats.state = ""
        if error:
            self.notify(error, title="error", severity="error", timeout=10)
        if widget.text:
            reason = last.finish_reason if last is not None and last.finish_reason else "error"
            self.conv.messages.append({"role": "assistant", "content": widget.text, "finish_reason": reason})
            if reason == "cancelled":
                self.stats.state = "stopped"
        else:
            # Nothing was answered: take the question back into the prompt box to edit or resend.
            await widget.remove()
            if self.conv.messages and self.conv.messages[-1]["role"] == "user":
                question = self.conv.messages.pop()["content"]
                await self._remove_last_widget(UserMessage)
                prompt = self.query_one("#prompt", PromptInput)
                if not prompt.text:
                    prompt.text = question
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
        self.conv.messages.pop()
        await self._remove_last_widget(AssistantMessage)
        await self._start_answer()

    async def action_edit_last(self) -> None:
        if self.generating:
            self.notify("still answering: Esc stops it", severity="warning")
            return
        msgs = self.conv.messages
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
            await self._remove_last_widget(AssistantMessage)
        if not msgs:
            self.notify("no message to edit", severity="warning")
            return
        text = msgs.pop()["content"]
        await self._remove_last_widget(UserMessage)
        prompt = self.query_one("#prompt", PromptInput)
        prompt.text = text
        prompt.move_cursor(prompt.document.end)
        prompt.focus()
        self._save()

    def action_copy_answer(self) -> None:
        answer = self._last_answer()
        if answer is None:
            self.notify("no answer to copy yet", severity="warning")
            return
        self.copy_to_clipboard(answer)
        self.notify(f"copied the answer ({len(answer)} characters)", timeout=2)

    def action_copy_code(self) -> None:
        blocks = code_blocks(self._last_answer() or "")
        if not blocks:
            self.notify("the last answer has no code block", severity="warning")
            return
        self.copy_to_clipboard(blocks[-1])
        self.notify(f"copied a code block ({len(blocks[-1].splitlines())} lines)", timeout=2)

    async def action_new_conversation(self) -> None:
        if self.generating:
            self.notify("still answering: Esc stops it", severity="warning")
            return
        self.conv = self._fresh_conversation(like=self.conv)
        self.kv = None
        await self._show_conversation()

    @on(OptionList.OptionSelected, "#conversations")
    async def _on_pick_conversation(self, event: OptionList.OptionSelected) -> None:
        await self.open_conversation(event.option.id)

    async def open_conversation(self, conv_id: str) -> None:
        """Resume a saved conversation: show it, then make sure its model is the loaded one."""
        if self.generating:
            self.notify("still answering: Esc stops it", severity="warning")
            return
        try:
            conv = self.store.load(conv_id)
        except EdgeInferError as exc:
            self.notify(str(exc), title="cannot open conversation", severity="error")
            self._refresh_conversations()
            return
        conv.settings = self._checked_settings(conv)
        self.conv = conv
        self.kv = None
        await self._show_conversation()
        self._follow_model()
        self.query_one("#prompt", PromptInput).focus()

    def _checked_settings(self, conv: Conversation) -> dict:
        """The conversation's settings over the defaults; invalid saved values fall back to them."""
        settings = {**self.default_settings, **conv.settings}
        if "save_kv" not in conv.settings:  # made by `edgeinfer run`: keep its K/V if it saved them
            settings["save_kv"] = bool(conv.n_kv) or self.default_settings["save_kv"]
        from edgeinfer.sampling import SamplingParams

        try:
            SamplingParams(**{**self.base_params,
                              **{k: v for k, v in settings.items() if k in SAMPLING_KEYS}}).validate()
            if not isinstance(settings["n_ctx"], int) or settings["n_ctx"] < 16:
                raise ValueError("n_ctx")
        except (EdgeInferError, TypeError, ValueError):
            self.notify("its saved settings are invalid; the defaults apply", title=conv.display_title,
                        severity="warning")
            settings = {**self.default_settings, "save_kv": settings.get("save_kv") is True}
        settings["save_kv"] = settings.get("save_kv") is True
        return settings

    def _follow_model(self) -> None:
        """Load the model the conversation was made with (or say it is missing), and restore its K/V."""
        conv = self.conv
        want = conv.identity if conv.identity.get("digest") else identify(conv.model)
        if not conv.messages or (want is None and not conv.model):  # nothing to follow: keep the loaded one
            self._apply_context_size()
            return
        if want is None:  # known only by a name that is not on this machine (an early conversation)
            if conv.model != self.model_name:
                self._model_missing(conv)
            self._apply_context_size()
            return
        if self.model is not None and same_model(self.model.identity, want):
            self._apply_context_size()  # a reload restores the K/V when it is done
            self._restore_kv()
            return
        if self.model is None and self.loading and same_model(identify(self.model_name or ""), want):
            return  # on its way: the K/V are restored once it is loaded
        target = self._locate(conv, want)
        if target is None:
            self._model_missing(conv)
            self._apply_context_size()
            return
        self.notify(f"loading {_short(target)}, the model this conversation was made with", timeout=4)
        self.start_loading(target, conv.settings["n_ctx"])

    def _model_missing(self, conv: Conversation) -> None:
        now = f"continues it with {_short(self.model_name)}" if self.model_name else "needs a model (Ctrl+O)"
        self.notify(f"It was made with {conv.model_label}, which is not on this machine. Its messages "
                    f"are shown; a new message {now}.", title="model not available",
                    severity="warning", timeout=12)

    def _locate(self, conv: Conversation, want: dict) -> str | None:
        """A local model name (or path) whose file is the one `want` identifies, or None."""
        try:
            listed = [value for _, value in self.list_models()]
        except EdgeInferError:
            listed = []
        seen: set[str] = set()
        for name in [conv.model, conv.model_path, *listed]:
            if not name or name in seen:
                continue
            seen.add(name)
            if same_model(identify(name, size=want.get("size")), want):
                return name
        return None

    def _restore_kv(self) -> None:
        """Import the conversation's saved K/V into the loaded model, so nothing is prefilled again."""
        conv = self.conv
        if (self.model is None or self.loading or not conv.n_kv or self._resident_conv == conv.id
                or not same_model(self.model.identity, conv.identity)):
            return
        self._kv_worker(self.model, conv)

    @work(thread=True, group="kv", exit_on_error=False)
    def _kv_worker(self, model, conv: Conversation) -> None:
        try:
            saved = self.store.load_kv(conv, model.identity, model.config.n_layer)
            n = model.sessions.import_kv(saved.tokens, saved.k, saved.v, saved.pos) if saved else 0
        except Exception as exc:  # noqa: BLE001 - only a cache: say so and go on
            message = str(exc) if isinstance(exc, EdgeInferError) else f"{type(exc).__name__}: {exc}"
            self._ui(self._kv_failed, message)
            return
        self._ui(self._kv_restored, model, conv.id, saved, n)

    def _kv_restored(self, model, conv_id: str, saved, n: int) -> None:
        if not n or self.model is not model or self.conv.id != conv_id:
            return
        self._resident_conv = conv_id
        if self.conv.settings.get("save_kv"):
            self.kv = (saved.tokens, saved.k, saved.v, saved.pos)
        self.notify(f"restored the saved KV cache ({n} tokens): nothing to prefill again", timeout=3)

    def _kv_failed(self, message: str) -> None:
        self.notify(f"{message}; the next answer reads the conversation again",
                    title="KV cache not restored", severity="warning")

    def action_settings(self) -> None:
        if self.generating:
            self.notify("still answering: Esc stops it", severity="warning")
            return

        def apply(values: dict | None) -> None:
            if values is None:
                return
            from edgeinfer.sampling import SamplingParams

            settings = {k: values[k] for k in SETTING_KEYS}
            try:
                trial = {**self.base_params, **{k: v for k, v in self.conv.settings.items() if k in SAMPLING_KEYS},
                         **{k: v for k, v in settings.items() if k in SAMPLING_KEYS}}
                SamplingParams(**trial).validate()
                if settings["n_ctx"] < 16:
                    raise EdgeInferError(f"context size must be at least 16, got {settings['n_ctx']}")
            except EdgeInferError as exc:
                self.notify(str(exc), title="settings not saved", severity="error")
                return
            self.conv.system = values["system"]
            self.conv.settings = {**self.conv.settings, **settings}
            self.default_settings = dict(settings)  # a new chat starts from these
            self.default_system = self.conv.system
            if self.conv.messages:
                self._save()
            self.notify("settings saved", timeout=2)
            self._apply_context_size()

        self.push_screen(SettingsScreen(self.conv.system, self.conv.settings), apply)

    def action_pick_model(self) -> None:
        if self.generating:
            self.notify("still answering: Esc stops it", severity="warning")
            return
        try:
            models = self.list_models()
        except EdgeInferError as exc:
            self.notify(str(exc), severity="error")
            models = []

        def picked(value: str | None) -> None:
            if value:
                self.start_loading(value, self.conv.settings["n_ctx"])

        self.push_screen(ModelPickerScreen(models), picked)

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
        if self.generating:
            self.notify("still answering: Esc stops it", severity="warning")
            return

        async def answered(yes: bool | None) -> None:
            if not yes:
                return
            self.store.delete(self.conv.id)
            self.conv = self._fresh_conversation(like=self.conv)
            self.kv = None
            await self._show_conversation()
            self.notify("conversation deleted", timeout=2)

        self.push_screen(ConfirmScreen(f"Delete “{self.conv.display_title}”?"), answered)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        self._cancel.set()  # the worker stops at its next token
        if self.generating and self._answer_widget is not None and self._answer_widget.text:
            # Keep the part of the answer written so far, as Esc would.
            self.conv.messages.append({"role": "assistant", "content": self._answer_widget.text,
                                       "finish_reason": "cancelled"})
            self.generating = False
            self._save()
        self._answer_widget = None
        self.exit()

    # -- helpers -----------------------------------------------------------------------------------
    def _fresh_conversation(self, like: Conversation | None = None) -> Conversation:
        settings = dict(like.settings) if like else dict(self.default_settings)
        system = like.system if like else self.default_system
        conv = Conversation(id=self.store.new_id(), model=self.model_name or "", system=system, settings=settings)
        if getattr(self, "model", None) is not None:
            conv.identity, conv.model_path = dict(self.model.identity), str(self.model.path)
        return conv

    def _idle_with_model(self) -> bool:
        if self.generating:
            self.notify("still answering: Esc stops it", severity="warning")
            return False
        if self.model is None:
            self.notify("no model loaded", severity="warning")
            return False
        return True

    def _apply_context_size(self) -> None:
        """A different context size means the model is loaded again with it."""
        n_ctx = self.conv.settings.get("n_ctx")
        if self.model is not None and n_ctx and n_ctx != self.model.n_ctx and self.model_name:
            self.start_loading(self.model_name, n_ctx)
        elif self.model is None and not self.loading:
            self.stats.n_ctx = n_ctx or 0
            self._show_stats()

    async def _show_conversation(self) -> None:
        chat = self.query_one("#chat", VerticalScroll)
        await chat.remove_children()
        widgets = [UserMessage(m["content"]) if m["role"] == "user"
                   else AssistantMessage(m["content"], model=_short(self.conv.model) if self.conv.model else "")
                   for m in self.conv.messages]
        if widgets:
            await chat.mount_all(widgets)
        chat.scroll_end(animate=False)
        self.sub_title = self.conv.display_title
        self.stats.ctx_used = self._count_context()
        self.stats.ttft_s = self.stats.gen_tps = self.stats.cached = None
        self._show_stats()
        self._refresh_conversations()

    async def _remove_last_widget(self, kind: type) -> None:
        found = self.query_one("#chat").query(kind)
        if found:
            await found.last().remove()

    def _last_answer(self) -> str | None:
        for m in reversed(self.conv.messages):
            if m["role"] == "assistant":
                return m["content"]
        return None

    def _count_context(self) -> int:
        """Tokens the conversation would take now (for the status bar)."""
        if self.model is None or not self.conv.messages:
            return 0
        try:
            text = self.model.apply_chat_template(self.conv.chat_messages(), add_generation_prompt=False)
            return len(self.model.tokenize(text, parse_special=True))
        except EdgeInferError:
            return 0

    def _kv_for_save(self) -> tuple | None:
        """The K/V to write with the conversation (None when its save_kv setting is off)."""
        if not self.conv.settings.get("save_kv"):
            return None
        if (self.model is not None and not self.generating and self._resident_conv == self.conv.id
                and same_model(self.model.identity, self.conv.identity)):
            kv = self.model.sessions.export_kv()
            if kv is not None:
                self.kv = kv
        return self.kv

    def _save(self) -> None:
        try:
            save_kv = bool(self.conv.settings.get("save_kv"))
            self.store.save(self.conv, sampling=self._params(), kv=self._kv_for_save(), keep_kv=save_kv)
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


def _short(name: str | None) -> str:
    """A model path shown by its file name; a model name as is."""
    if not name:
        return "no model"
    from pathlib import Path

    return Path(name).name if ("/" in name or name.endswith(".gguf")) and not name.startswith("hf.co/") else name
