"""The chat screens as pictures (pytest-textual-snapshot) at 80×24 and 120×40, and what a new user meets.

A scripted model object stands in for a real one, so every picture is the same on every run:
no timings (its figures are fixed), no dates, no paths, no random ids. `pytest
--snapshot-update tests/test_tui_snapshots.py` writes the pictures again after a deliberate
change to the screen; look at them (tests/__snapshots__/) before committing.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("textual")
pytest.importorskip("pytest_textual_snapshot")

from edgeinfer.sessions.conversations import ConversationStore  # noqa: E402
from edgeinfer.results import GenerationChunk, Timings, Usage  # noqa: E402
from edgeinfer.tui import app as app_module  # noqa: E402
from edgeinfer.tui.app import ChatApp  # noqa: E402
from edgeinfer.tui.widgets import AssistantMessage, PromptInput  # noqa: E402

SIZES = [(80, 24), (120, 40)]
QUESTION = "What is the capital of France?"
ANSWERS = ["The capital of France is **Paris**.",
           "Paris. It has been the capital since the 10th century.\n\n```python\nprint(\"Paris\")\n```"]


class ScriptedModel:
    """Enough of edgeinfer.api.Model for the chat screen: answers come from a list, in turn."""

    def __init__(self, n_ctx: int, answers=ANSWERS) -> None:
        self.name = "tiny-chat"
        self.n_ctx = n_ctx
        self.path = Path("tiny-chat.gguf")
        self.identity = {"name": "tiny-chat", "size": 1234, "digest": "ab" * 32}
        self.config = SimpleNamespace(n_layer=1, arch="scripted")
        self.sessions = SimpleNamespace(export_kv=lambda: None, import_kv=lambda *a: 0)
        self.answers = list(answers)
        self.calls = 0
        self.gate: threading.Event | None = None  # when set: pause after the first piece until it is set

    def tokenize(self, text: str, parse_special: bool = False) -> list[int]:
        return list(range(len(text.split())))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return " ".join(m["content"] for m in messages)

    def generate(self, *args, **kwargs):
        return None

    def reset(self) -> None:
        pass

    def chat(self, messages, stream=True, cancel=None, **params):
        answer = self.answers[self.calls % len(self.answers)]
        self.calls += 1
        pieces = [w + " " for w in answer.split(" ")]
        pieces[-1] = pieces[-1].rstrip(" ")
        prompt = len(self.tokenize(self.apply_chat_template(messages)))
        for i, piece in enumerate(pieces):
            if i == 1 and self.gate is not None:
                self.gate.wait(30)
            yield GenerationChunk(text=piece, token=i)
        yield GenerationChunk(text="", token=None, finish_reason="stop",
                              usage=Usage(prompt, len(pieces), 0),
                              timings=Timings(0.05, 400.0, 42.0, 0.05, 0.5, 0.024))


class FixedIdStore(ConversationStore):
    """Conversation ids in order (chat-000000000001, …) instead of random ones."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.n = 0

    def new_id(self) -> str:
        self.n += 1
        return f"chat-{self.n:012d}"


@pytest.fixture(autouse=True)
def fixed_quant(monkeypatch):
    monkeypatch.setattr(app_module, "quantization_of", lambda path: "Q4_K_M")


def make_app(tmp_path, loader=None, name: str | None = "tiny-chat", **kw) -> ChatApp:
    models: list[ScriptedModel] = []

    def load(n, n_ctx):
        models.append(ScriptedModel(n_ctx))
        return models[-1]

    app = ChatApp(name, load_model=loader or load, store=FixedIdStore(tmp_path / "sessions"),
                  sampling=dict(temperature=0.0), n_ctx=2048, warm_up=False,
                  list_models=lambda: [("tiny-chat  (1.2 KB)", "tiny-chat")], pull=None, **kw)
    app.models = models
    return app


async def settle(pilot) -> None:
    app = pilot.app
    for _ in range(500):
        await pilot.pause()
        await app.workers.wait_for_complete()
        await pilot.pause()
        if not (app.generating or app.loading):
            break
    app.clear_notifications()
    steady(app)
    await pilot.pause()


def steady(app) -> None:
    """No blinking cursors: a picture must not depend on when it is taken."""
    for screen in app.screen_stack:
        for widget in screen.query("Input, TextArea"):
            widget.cursor_blink = False


async def send(pilot, text: str) -> None:
    prompt = pilot.app.query_one(PromptInput)
    prompt.text = text
    prompt.focus()
    await pilot.press("enter")
    await settle(pilot)


# -- pictures --------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_welcome_screen(snap_compare, tmp_path, size):
    assert snap_compare(make_app(tmp_path), terminal_size=size, run_before=settle)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_conversation_with_system_prompt_and_two_answers(snap_compare, tmp_path, size):
    async def chat(pilot):
        await settle(pilot)
        pilot.app.conv.system = "You are a concise geography tutor."
        await pilot.app._show_conversation()
        await send(pilot, QUESTION)
        await pilot.press("ctrl+r")
        await settle(pilot)

    assert snap_compare(make_app(tmp_path), terminal_size=size, run_before=chat)


@pytest.mark.parametrize("key", ["f1", "ctrl+s", "ctrl+o", "f2"])
def test_dialogs_fit_80x24(snap_compare, tmp_path, key):
    async def open_dialog(pilot):
        await settle(pilot)
        await send(pilot, QUESTION)
        await pilot.press(key)
        await pilot.pause()
        steady(pilot.app)
        await pilot.pause()

    assert snap_compare(make_app(tmp_path), terminal_size=(80, 24), run_before=open_dialog)


def test_no_model_shows_the_welcome_under_the_picker(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path, name=None), terminal_size=(80, 24), run_before=settle)


def test_loading_shows_its_stage_on_a_progress_bar(snap_compare, tmp_path):
    gate = threading.Event()

    def slow(name, n_ctx, progress):
        progress("read", 1.0)
        progress("compile", 0.5)
        gate.wait(30)
        return ScriptedModel(n_ctx)

    async def loading(pilot):
        for _ in range(50):
            await pilot.pause(0.02)
            if "compiling" in str(pilot.app.query_one("#loading-label").render()):
                break

    try:
        assert snap_compare(make_app(tmp_path, loader=slow), terminal_size=(80, 24), run_before=loading)
    finally:
        gate.set()


# -- behaviour a new user counts on ----------------------------------------------------------------


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_stats_update_while_the_answer_streams(tmp_path):
    gate = threading.Event()
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        app.models[-1].gate = gate
        prompt = app.query_one(PromptInput)
        prompt.text = QUESTION
        await pilot.press("enter")
        for _ in range(200):
            await pilot.pause(0.01)
            if app.stats.ctx_used > 0 and app.query(AssistantMessage) and app.query(AssistantMessage).last().text:
                break
        shown = str(app.query_one("#status").render())
        assert app.generating and app.stats.ttft_s is not None
        assert f"ctx {app.stats.ctx_used}/2048" in shown and app.stats.ctx_used > 0
        before = app.stats.ctx_used
        gate.set()
        await settle(pilot)
        assert app.stats.ctx_used > before and app.stats.gen_tps == 42.0
        assert "42.0 tok/s" in str(app.query_one("#status").render())


@pytest.mark.anyio
async def test_alternatives_step_with_arrows_in_an_empty_prompt_and_survive_a_reload(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await send(pilot, QUESTION)
        await pilot.press("ctrl+r")
        await settle(pilot)
        last = app.conv.messages[-1]
        assert last["content"] == ANSWERS[1] and last["alternatives"] == ANSWERS
        assert "2/2" in app.query(AssistantMessage).last().border_subtitle
        app.query_one(PromptInput).focus()
        await pilot.press("left")
        await settle(pilot)
        assert app.conv.messages[-1]["content"] == ANSWERS[0]
        assert app.query(AssistantMessage).last().text == ANSWERS[0]
        assert "1/2" in app.query(AssistantMessage).last().border_subtitle
        assert len(app.query(AssistantMessage)) == 1
        # With text in the prompt box the arrows move the cursor instead.
        app.query_one(PromptInput).text = "draft"
        await pilot.press("right")
        await settle(pilot)
        assert app.conv.messages[-1]["content"] == ANSWERS[0]
        cid = app.conv.id
    saved = FixedIdStore(tmp_path / "sessions").load(cid)
    assert saved.messages[-1]["content"] == ANSWERS[0] and saved.messages[-1]["alternatives"] == ANSWERS
    again = make_app(tmp_path)
    async with again.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await again.open_conversation(cid)
        await settle(pilot)
        assert "1/2" in again.query(AssistantMessage).last().border_subtitle
        await pilot.press("ctrl+right")
        await settle(pilot)
        assert again.conv.messages[-1]["content"] == ANSWERS[1]


@pytest.mark.anyio
async def test_new_chat_says_what_carries_over_and_system_prompt_is_shown(tmp_path):
    app = make_app(tmp_path)
    notes: list[str] = []
    real_notify = app.notify
    app.notify = lambda message, **kw: (notes.append(str(message)), real_notify(message, **kw))[1]
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        app.conv.system = "Answer in French."
        await app._show_conversation()
        await send(pilot, QUESTION)
        assert app.query_one(".message.system").text == "Answer in French."
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert any(n.startswith("New chat: keeps the system prompt") for n in notes)
        assert app.query_one(".message.system").text == "Answer in French."  # a new chat shows it too


@pytest.mark.anyio
async def test_copy_chat_export_and_search(tmp_path):
    app = make_app(tmp_path, export_dir=tmp_path / "out")
    copied: list[str] = []
    app.copy_to_clipboard = copied.append
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await send(pilot, QUESTION)
        first = app.conv.id
        await pilot.press("f5")
        assert copied and copied[0].startswith("# What is the capital of France?") and ANSWERS[0] in copied[0]
        await pilot.press("f9")
        await pilot.pause()
        files = list((tmp_path / "out").glob("*.md"))
        assert len(files) == 1 and files[0].read_text(encoding="utf-8") == copied[0]
        await pilot.press("ctrl+n")
        await send(pilot, "Tell me about Rome")
        assert app.conv.id != first
        await pilot.press("ctrl+f")
        await pilot.pause()
        await pilot.press(*"france")
        await pilot.pause()
        assert [h.conv_id for h in app.screen.hits] == [first]
        await pilot.press("enter")
        await settle(pilot)
        assert app.conv.id == first


@pytest.mark.anyio
async def test_bad_new_settings_are_one_line_and_good_ones_reach_the_model(tmp_path):
    app = make_app(tmp_path)
    seen: list[dict] = []
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        model = app.models[-1]
        real_chat = model.chat
        model.chat = lambda messages, **kw: (seen.append(kw), real_chat(messages, **kw))[1]
        await pilot.press("ctrl+s")
        await pilot.pause()
        app.screen.query_one("#seed").value = "-3"
        await pilot.click("#save")
        await pilot.pause()
        assert type(app.screen).__name__ == "SettingsScreen"  # still open: fix the value there
        app.screen.query_one("#seed").value = "7"
        app.screen.query_one("#min_p").value = "0.1"
        app.screen.query_one("#repeat_penalty").value = "1.2"
        app.screen.query_one("#stop").value = "User:, \\n\\n"
        await pilot.press("ctrl+s")  # the first error's notice may cover the Save button
        await pilot.pause()
        assert type(app.screen).__name__ != "SettingsScreen", [n.message for n in app._notifications]
        await send(pilot, QUESTION)
    assert seen[-1]["seed"] == 7 and seen[-1]["min_p"] == 0.1 and seen[-1]["repeat_penalty"] == 1.2
    assert seen[-1]["stop"] == ["User:", "\n\n"]
