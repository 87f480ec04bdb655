"""The chat screen's policy without Textual: answers per turn, search, settings, layout and texts.

tui/app.py is the view: it calls these functions and shows what they return. Everything
here is plain Python over plain data (conversation messages are dicts), so it is tested
without a terminal.

Alternatives of a turn: an assistant message may carry `"alternatives"` (every answer the
turn got, oldest first) and `"choice"` (the index of the one shown); `"content"` is always the
chosen answer, so the model, `edgeinfer run` and files written before alternatives existed
see an ordinary message. A message without the fields has one answer: its content.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

from edgeinfer.errors import EdgeInferError

# -- alternatives of a turn --------------------------------------------------------------------


def answers_of(message: dict) -> list[str]:
    """Every answer of the turn, oldest first (just the content when there are no valid alternatives)."""
    alts = message.get("alternatives")
    content = message.get("content", "")
    if isinstance(alts, list) and alts and all(isinstance(a, str) for a in alts) and content in alts:
        return list(alts)
    return [content]


def choice_of(message: dict) -> int:
    """The index of the answer shown (the content's), within answers_of(message)."""
    answers = answers_of(message)
    choice = message.get("choice")
    if isinstance(choice, int) and not isinstance(choice, bool) and 0 <= choice < len(answers) \
            and answers[choice] == message.get("content", ""):
        return choice
    return answers.index(message.get("content", ""))


def new_answer(previous: dict | None, text: str, finish_reason: str) -> dict:
    """The assistant message for a fresh answer; `previous` (the answer it regenerates) keeps its
    answers as alternatives before the new one, which becomes the shown one."""
    answers = answers_of(previous) if previous is not None else []
    answers.append(text)
    message = {"role": "assistant", "content": text, "finish_reason": finish_reason}
    if len(answers) > 1:
        message.update(alternatives=answers, choice=len(answers) - 1)
    return message


def step_answer(message: dict, delta: int) -> bool:
    """Show the previous (-1) or next (+1) answer of the turn; False when there is none that way."""
    answers = answers_of(message)
    target = choice_of(message) + delta
    if len(answers) < 2 or not 0 <= target < len(answers):
        return False
    message.update(content=answers[target], alternatives=answers, choice=target)
    message.pop("finish_reason", None)  # it described the answer shown before
    return True


def answer_position(message: dict) -> str:
    """"2/3" for the second of three answers; "" for a turn with one answer."""
    answers = answers_of(message)
    return f"{choice_of(message) + 1}/{len(answers)}" if len(answers) > 1 else ""


# -- search ------------------------------------------------------------------------------------

SNIPPET_CHARS = 60


@dataclass
class SearchHit:
    conv_id: str
    title: str
    snippet: str  # one line around the first match in the text ("" for a title-only match)
    in_title: bool


def search(conversations: Iterable[Any], query: str) -> list[SearchHit]:
    """Conversations whose title or messages hold every word of `query` (case-insensitive);
    title matches first, then the given order (most recent first). `conversations` need
    `id`, `display_title`, `system` and `messages`."""
    words = query.lower().split()
    if not words:
        return []
    title_hits: list[SearchHit] = []
    text_hits: list[SearchHit] = []
    for conv in conversations:
        title = conv.display_title
        texts = [conv.system, *(t for m in conv.messages for t in answers_of(m)
                                if m.get("role") == "assistant"),
                 *(m.get("content", "") for m in conv.messages if m.get("role") != "assistant")]
        body = "\n".join(texts).lower()
        in_title = all(w in title.lower() for w in words)
        if not in_title and not all(w in body or w in title.lower() for w in words):
            continue
        snippet = _snippet(texts, words)
        (title_hits if in_title else text_hits).append(SearchHit(conv.id, title, snippet, in_title))
    return title_hits + text_hits


def _snippet(texts: list[str], words: list[str]) -> str:
    for text in texts:
        low = text.lower()
        at = min((low.find(w) for w in words if w in low), default=-1)
        if at < 0:
            continue
        start = max(0, at - SNIPPET_CHARS // 3)
        piece = " ".join(text[start:start + SNIPPET_CHARS].split())
        return ("…" if start else "") + piece + ("…" if start + SNIPPET_CHARS < len(text) else "")
    return ""


# -- settings ----------------------------------------------------------------------------------

# Settings edited per conversation, in the settings screen's order: key, label, kind.
SETTING_FIELDS: list[tuple[str, str, str]] = [
    ("temperature", "Temperature (0 = greedy)", "float"),
    ("top_p", "Top-p (1 = off)", "float"),
    ("top_k", "Top-k (0 = off)", "int"),
    ("min_p", "Min-p (0 = off)", "float"),
    ("repeat_penalty", "Repeat penalty (1 = off)", "float"),
    ("seed", "Seed (empty = random)", "seed"),
    ("stop", "Stop strings (comma-separated)", "stop"),
    ("max_tokens", "Max tokens (-1 = no limit)", "int"),
    ("n_ctx", "Context size (tokens)", "int"),
]
SETTING_KEYS = tuple(k for k, _, _ in SETTING_FIELDS) + ("save_kv",)
MIN_CONTEXT = 16


class SettingsError(EdgeInferError):
    """A settings value that cannot be used; its text is the one line shown."""


def format_setting(key: str, value: Any) -> str:
    """A setting's value as its input box shows it."""
    kind = {k: kind for k, _, kind in SETTING_FIELDS}.get(key)
    if kind == "seed":
        return "" if value is None or value == -1 else str(value)
    if kind == "stop":
        return ", ".join(_escape_stop(s) for s in (value or []))
    return "" if value is None else str(value)


def _escape_stop(text: str) -> str:
    return text.replace("\\", "\\\\").replace(",", "\\,").replace("\n", "\\n").replace("\t", "\\t")


def parse_stop(raw: str) -> list[str]:
    """`a, b\\, c, \\n\\n` -> ["a", "b, c", "\\n\\n"]: commas split, backslash escapes \\n \\t \\, \\\\."""
    out: list[str] = []
    cur: list[str] = []
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\\" and i + 1 < len(raw):
            nxt = raw[i + 1]
            cur.append({"n": "\n", "t": "\t"}.get(nxt, nxt))
            i += 2
            continue
        if ch == ",":
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
        i += 1
    out.append("".join(cur))
    # Spaces around the commas separate; a stop string of only whitespace keeps it (e.g. "\n").
    cleaned = [s.strip(" ") if s.strip(" ") else s for s in out]
    return [s for s in cleaned if s != ""]


def parse_settings(raw: dict[str, str], base: dict | None = None) -> dict:
    """The typed settings from the settings screen's boxes (and `save_kv`), checked the way a
    request is (edgeinfer.sampling); SettingsError with one line for the first bad value."""
    from edgeinfer.sampling import SamplingParams

    values: dict[str, Any] = {}
    for key, label, kind in SETTING_FIELDS:
        text = str(raw.get(key, "")).strip() if kind != "stop" else str(raw.get(key, ""))
        name = label.split(" (")[0]
        if kind == "float":
            try:
                values[key] = float(text)
            except ValueError:
                raise SettingsError(f"{name}: expected a number, got {text!r}") from None
            if not math.isfinite(values[key]):
                raise SettingsError(f"{name}: expected a finite number, got {text!r}")
        elif kind == "int":
            if not re.fullmatch(r"[+-]?\d+", text):
                raise SettingsError(f"{name}: expected a whole number, got {text!r}")
            values[key] = int(text)
        elif kind == "seed":
            if text in ("", "-1"):
                values[key] = None
            elif re.fullmatch(r"\d+", text):
                values[key] = int(text)
            else:
                raise SettingsError(f"{name}: expected a whole number ≥ 0 (empty = random), got {text!r}")
        else:
            values[key] = parse_stop(text)
    values["save_kv"] = bool(raw.get("save_kv"))
    if values["n_ctx"] < MIN_CONTEXT:
        raise SettingsError(f"Context size: must be at least {MIN_CONTEXT}, got {values['n_ctx']}")
    sampling_keys = {f for f in SamplingParams.__dataclass_fields__}
    try:
        SamplingParams(**{**(base or {}), **{k: v for k, v in values.items() if k in sampling_keys}}).validate()
    except EdgeInferError as exc:
        raise SettingsError(str(exc)) from None
    return values


# -- layout ------------------------------------------------------------------------------------

def sidebar_width(columns: int) -> int:
    """The conversation list's width for a terminal `columns` wide (30 at 120, 22 at 80)."""
    return max(18, min(30, columns // 4 + 2))


@dataclass(frozen=True)
class Key:
    key: str  # as the footer shows it: "F1", "^N"
    label: str


HELP_KEY = Key("F1", "help")


def footer_text(keys: list[Key], columns: int) -> str:
    """The key line for `columns`: every key when they all fit, else the first ones that fit
    followed by "F1 help" (always shown, always within `columns`)."""
    parts = [f"{k.key} {k.label}" for k in keys]
    sep = "  "
    full = sep.join(parts)
    if len(full) <= columns - 2:
        return full
    tail = f"{HELP_KEY.key} {HELP_KEY.label}"
    shown: list[str] = []
    for k, part in zip(keys, parts):
        if k.key == HELP_KEY.key:
            continue
        if len(sep.join([*shown, part, tail])) > columns - 2:
            break
        shown.append(part)
    line = sep.join([*shown, tail])
    return line if len(line) <= columns else tail[:columns]


# -- texts -------------------------------------------------------------------------------------

def welcome_text(model: str | None) -> str:
    """The Markdown shown in an empty conversation."""
    if model:
        start = (f"You are chatting with **{model}**, running on this machine. Type a message below "
                 "and press **Enter**; **Ctrl+J** starts a new line.")
    else:
        start = ("No model is loaded yet. Press **Ctrl+O** to pick a local model, or type a name "
                 "there (for example `gemma3-270m`) to download it.")
    return (f"## Welcome to edgeinfer chat\n\n{start}\n\n"
            "**F1** lists every key · **Ctrl+S** settings and system prompt · "
            "**Ctrl+O** another model · **Ctrl+F** search your chats")


def new_chat_notice(system: str, settings: dict, defaults: dict) -> str:
    """What Ctrl+N says about the settings the new conversation starts with."""
    changed = sorted(k for k in settings if k in defaults and settings[k] != defaults[k])
    parts = []
    parts.append("the system prompt" if system.strip() else "no system prompt")
    parts.append(f"changed settings ({', '.join(changed)})" if changed else "the default settings")
    return f"New chat: keeps {parts[0]} and {parts[1]} (Ctrl+S changes them)"


# Stages of opening a model, in order, with the share of the bar each one ends at.
LOAD_STAGES = {"resolve": (0.05, "finding the model file"),
               "read": (0.45, "reading the weights"),
               "prepare": (0.7, "preparing the weights"),
               "compile": (0.95, "compiling kernels (first start only)"),
               "ready": (1.0, "ready")}


def load_progress(stage: str, fraction: float | None = None,
                  count: tuple[int, int] | None = None) -> tuple[float, str]:
    """(overall fraction 0..1, label) for a stage of loading, `fraction` done within it;
    `count` (done, total) ends the label ("compiling kernels (first start only) 3/12")."""
    names = list(LOAD_STAGES)
    end, label = LOAD_STAGES.get(stage, (None, stage))
    if count is not None:
        label = f"{label} {count[0]}/{count[1]}"
    if end is None:
        return 0.0, label
    start = LOAD_STAGES[names[names.index(stage) - 1]][0] if names.index(stage) else 0.0
    inside = 0.0 if fraction is None else min(1.0, max(0.0, fraction))
    return start + (end - start) * inside, label


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


class LiveRate:
    """Time to the first piece, pieces per second and context used while an answer streams
    (each streamed piece is about a token); the final chunk's usage and timings replace them."""

    def __init__(self, prompt_tokens: int, start: float) -> None:
        self.prompt_tokens, self.start = prompt_tokens, start
        self.first: float | None = None  # when the first piece came
        self.pieces = 0
        self.ttft_s: float | None = None
        self.gen_tps: float | None = None

    def piece(self, now: float) -> None:
        self.pieces += 1
        if self.first is None:
            self.first = now
            self.ttft_s = now - self.start
        elif now > self.first:
            self.gen_tps = (self.pieces - 1) / (now - self.first)

    @property
    def ctx_used(self) -> int:
        return self.prompt_tokens + self.pieces
