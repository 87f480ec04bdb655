"""The chat screen's conversation, model and K/V policy without Textual: what is loaded, restored and saved.

tui/app.py holds one ChatSession: the open conversation, the settings a new one starts
from, and which conversation the loaded model's K/V hold. The app asks it what to do
(follow_model, restore_kv, context_to_load) and tells it what happened (begin_answer,
answered, kv_restored); it renders and runs workers. Models are duck-typed: `identity`,
`path`, `n_ctx`, `config.n_layer`, `sessions.export_kv()/import_kv()`, `tokenize`,
`apply_chat_template`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from edgeinfer.sessions.conversations import (SAMPLING_KEYS, Conversation, ConversationStore, identify,
                                     same_model)
from edgeinfer.errors import EdgeInferError
from edgeinfer.tui.controller import MIN_CONTEXT, SETTING_KEYS, new_answer

# Sampling before any flag or setting (the per-conversation settings are controller.SETTING_FIELDS;
# the rest of the sampling flags come from the command line, or from the saved session when
# `edgeinfer run` made it).
DEFAULT_SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, seed=None,
                        stop=[], max_tokens=-1)


def sampling_params(base: dict, settings: dict) -> dict:
    """The sampling an answer uses: the command line's (`base`) under the conversation's settings."""
    return {**base, **{k: v for k, v in settings.items() if k in SAMPLING_KEYS}}


def checked_settings(saved: dict, n_kv: int, defaults: dict, base: dict) -> tuple[dict, bool]:
    """(settings, valid): a saved conversation's settings over the defaults. A conversation that
    `edgeinfer run` made (no save_kv setting) keeps its K/V when its file holds some (`n_kv`);
    invalid values give the defaults and valid=False."""
    from edgeinfer.sampling import SamplingParams

    settings = {**defaults, **saved}
    if "save_kv" not in saved:
        settings["save_kv"] = bool(n_kv) or defaults["save_kv"]
    valid = True
    try:
        SamplingParams(**sampling_params(base, settings)).validate()
        if not isinstance(settings["n_ctx"], int) or settings["n_ctx"] < MIN_CONTEXT:
            raise ValueError("n_ctx")
    except (EdgeInferError, TypeError, ValueError):
        valid = False
        settings = {**defaults, "save_kv": settings.get("save_kv") is True}
    settings["save_kv"] = settings.get("save_kv") is True
    return settings, valid


def wanted_identity(conv: Conversation) -> dict | None:
    """The identity of the model file the conversation was made with: the saved one, else the
    file its model name means on this machine (None: unknown or not here)."""
    return conv.identity if conv.identity.get("digest") else identify(conv.model)


def locate(conv: Conversation, want: dict, candidates: Callable[[], Iterable[str]]) -> str | None:
    """A local model name (or path) whose file is the one `want` identifies, or None. Tried in
    order: the name it was loaded by, its file's last path, then `candidates()` (the local models)."""
    seen: set[str] = set()
    for name in [conv.model, conv.model_path, *candidates()]:
        if not name or name in seen:
            continue
        seen.add(name)
        if same_model(identify(name, size=want.get("size")), want):
            return name
    return None


@dataclass(frozen=True)
class Follow:
    """What opening a conversation does about the model.

    keep     the loaded model (or none) stays
    missing  its model is not on this machine: say so; the loaded model stays
    restore  it is the loaded model: restore its K/V
    wait     it is the model loading now: its K/V are restored once loaded
    load     load `target`, the local file of its model
    """

    action: str
    target: str | None = None


def follow_model(conv: Conversation, *, loaded: dict | None, loading: str | None, model_name: str | None,
                 candidates: Callable[[], Iterable[str]]) -> Follow:
    """Whether opening `conv` keeps, waits for, or loads a model. `loaded`: the loaded model's
    identity (None: none loaded); `loading`: the name loading now (None: nothing loading);
    `model_name`: the name the app's model was (or is being) loaded by."""
    want = wanted_identity(conv)
    if not conv.messages or (want is None and not conv.model):
        return Follow("keep")  # nothing to follow
    if want is None:  # known only by a name that is not on this machine (an early conversation)
        return Follow("missing" if conv.model != model_name else "keep")
    if loaded is not None and same_model(loaded, want):
        return Follow("restore")
    if loaded is None and loading is not None and same_model(identify(loading), want):
        return Follow("wait")
    target = locate(conv, want, candidates)
    return Follow("load", target) if target is not None else Follow("missing")


@dataclass(frozen=True)
class AnswerEnd:
    """How an answer ended for the conversation: "answer" (`message` appended), "previous" (the
    regenerated `message` is back), "question" (`question` taken back) or "nothing"."""

    kind: str
    message: dict | None = None
    question: str | None = None


class ChatSession:
    """The open conversation, the settings new ones start from, and the model's K/V for it."""

    def __init__(self, store: ConversationStore, *, sampling: dict | None = None, system: str = "",
                 n_ctx: int = 4096, save_kv: bool = False) -> None:
        self.store = store
        # Sampling flags from the command line; the per-conversation settings override them.
        self.base_params = {**DEFAULT_SAMPLING, **(sampling or {})}
        self.default_settings = {k: self.base_params[k] for k in SETTING_KEYS if k in SAMPLING_KEYS}
        self.default_settings.update(n_ctx=n_ctx, save_kv=bool(save_kv))
        self.initial_settings = dict(self.default_settings)  # the command line's, for Ctrl+N's notice
        self.default_system = system or ""
        self.resident: str | None = None  # the conversation whose tokens the loaded model's K/V hold
        self.kv: tuple | None = None  # SavedKV fields last exported for conv: saved with it (save_kv)
        self.conv = self.fresh(None, "")

    # -- which conversation ----------------------------------------------------------------------
    def fresh(self, model: Any, model_name: str | None, like: Conversation | None = None) -> Conversation:
        """A new, empty conversation: `like`'s system prompt and settings (else the defaults),
        the loaded model's name and identity."""
        settings = dict(like.settings) if like else dict(self.default_settings)
        system = like.system if like else self.default_system
        conv = Conversation(id=self.store.new_id(), model=model_name or "", system=system, settings=settings)
        if model is not None:
            conv.identity, conv.model_path = dict(model.identity), str(model.path)
        return conv

    def start_new(self, model: Any, model_name: str | None) -> Conversation:
        """Open a new conversation like the current one (Ctrl+N, or after a delete); returns the old one."""
        old = self.conv
        self.conv = self.fresh(model, model_name, like=old)
        self.kv = None
        return old

    def open(self, conv_id: str) -> bool:
        """Open a saved conversation (EdgeInferError when it cannot be read); False when its saved
        settings were invalid and the defaults apply."""
        conv = self.store.load(conv_id)
        conv.settings, valid = checked_settings(conv.settings, conv.n_kv, self.default_settings,
                                                self.base_params)
        self.conv = conv
        self.kv = None
        return valid

    def apply_settings(self, values: dict) -> bool:
        """The settings screen's values (checked by controller.parse_settings) for this conversation
        and the next new ones; True when the conversation should be saved (it has messages)."""
        self.conv.system = values["system"]
        self.conv.settings = {**self.conv.settings, **{k: values[k] for k in SETTING_KEYS}}
        self.default_settings = {k: values[k] for k in SETTING_KEYS}
        self.default_system = self.conv.system
        return bool(self.conv.messages)

    def params(self) -> dict:
        return sampling_params(self.base_params, self.conv.settings)

    # -- the model -------------------------------------------------------------------------------
    def follow_model(self, model: Any, model_name: str | None, loading: bool,
                     candidates: Callable[[], Iterable[str]]) -> Follow:
        return follow_model(self.conv, loaded=model.identity if model is not None else None,
                            loading=(model_name or "") if loading and model is None else None,
                            model_name=model_name, candidates=candidates)

    def context_to_load(self, model: Any) -> int | None:
        """The context size to load the model again with (the conversation asks for another one)."""
        n_ctx = self.conv.settings.get("n_ctx")
        if model is not None and n_ctx and n_ctx != model.n_ctx:
            return n_ctx
        return None

    def model_loading(self) -> None:
        """The model goes away: its K/V hold no conversation any more."""
        self.resident = None

    def count_context(self, model: Any) -> int:
        """Tokens the conversation would take now (for the status bar)."""
        if model is None or not self.conv.messages:
            return 0
        try:
            text = model.apply_chat_template(self.conv.chat_messages(), add_generation_prompt=False)
            return len(model.tokenize(text, parse_special=True))
        except EdgeInferError:
            return 0

    # -- K/V -------------------------------------------------------------------------------------
    def restore_kv(self, model: Any, loading: bool) -> bool:
        """Whether to import the conversation's saved K/V into `model`: its file holds some, they
        were made by this model file, and the model does not hold them already."""
        conv = self.conv
        return bool(model is not None and not loading and conv.n_kv and self.resident != conv.id
                    and same_model(model.identity, conv.identity))

    def import_kv(self, model: Any, conv: Conversation) -> tuple[Any, int]:
        """(saved K/V or None, tokens imported): reads `conv`'s K/V into `model` (runs in a worker)."""
        saved = self.store.load_kv(conv, model.identity, model.config.n_layer)
        return saved, (model.sessions.import_kv(*saved.saved_kv()) if saved else 0)

    def kv_restored(self, conv_id: str, saved: Any, n: int) -> bool:
        """After import_kv for the model still loaded: True when the open conversation (`conv_id`)
        now needs no prefill; its K/V are kept to be saved again when save_kv is on."""
        if not n or self.conv.id != conv_id:
            return False
        self.resident = conv_id
        if self.conv.settings.get("save_kv"):
            self.kv = (saved.tokens, saved.k, saved.v, saved.pos, saved.state)
        return True

    # -- answers and saving --------------------------------------------------------------------------
    def begin_answer(self, model: Any, model_name: str | None) -> None:
        """An answer starts with `model`: the conversation now belongs to it (K/V of another
        model's tokens are dropped)."""
        if not same_model(self.conv.identity, model.identity):
            self.kv = None
        self.conv.model = model_name or ""
        self.conv.identity = dict(model.identity)
        self.conv.model_path = str(model.path)

    def answered(self) -> None:
        """The loaded model's K/V now hold the open conversation."""
        self.resident = self.conv.id

    def end_answer(self, previous: dict | None, text: str, finish_reason: str | None) -> AnswerEnd:
        """Settle the conversation when an answer ends: a streamed text becomes the turn's answer
        (`previous`, the one it regenerates, kept as an alternative); with nothing streamed, a
        regenerated turn gets its earlier answer back, else the question is taken back (to the
        prompt box, to edit or send again)."""
        messages = self.conv.messages
        if text:
            message = new_answer(previous, text, finish_reason or "error")
            messages.append(message)
            return AnswerEnd("answer", message=message)
        if previous is not None:
            messages.append(previous)
            return AnswerEnd("previous", message=previous)
        if messages and messages[-1]["role"] == "user":
            return AnswerEnd("question", question=messages.pop()["content"])
        return AnswerEnd("nothing")

    def take_back_last_message(self) -> tuple[int, str | None]:
        """Ctrl+L: drop the last turn's answers and take its message back to edit; (answers
        dropped, the message's text or None when there is none)."""
        messages = self.conv.messages
        answers = 0
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
            answers += 1
        return answers, (messages.pop()["content"] if messages else None)

    def keep_partial(self, previous: dict | None, text: str) -> None:
        """Keep the part of an answer written so far (quitting mid-answer, as Esc would)."""
        self.conv.messages.append(new_answer(previous, text, "cancelled"))

    def kv_for_save(self, model: Any, generating: bool) -> tuple | None:
        """The K/V to write with the conversation: None when its save_kv setting is off; the model's
        own when it holds this conversation and is idle; else those last exported or restored."""
        if not self.conv.settings.get("save_kv"):
            return None
        if (model is not None and not generating and self.resident == self.conv.id
                and same_model(model.identity, self.conv.identity)):
            kv = model.sessions.export_kv()
            if kv is not None:
                self.kv = kv
        return self.kv

    def save(self, model: Any, generating: bool) -> None:
        """Write the conversation (atomically, with its K/V when save_kv is on; with it off, K/V
        saved before are dropped). Raises OSError or EdgeInferError."""
        self.store.save(self.conv, sampling=self.params(), kv=self.kv_for_save(model, generating),
                        keep_kv=bool(self.conv.settings.get("save_kv")))

    def last_answer(self) -> str | None:
        for m in reversed(self.conv.messages):
            if m["role"] == "assistant":
                return m["content"]
        return None
