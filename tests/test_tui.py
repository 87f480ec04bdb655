"""The chat TUI driven through Textual's Pilot against a tiny generated model (reference backend).

Every expected answer comes from calling the model API directly (greedy, temperature 0),
never from the TUI itself.
"""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np

import pytest

pytest.importorskip("textual")

import edgeinfer  # noqa: E402
from edgeinfer.cli import main  # noqa: E402
from edgeinfer.sessions.conversations import Conversation, ConversationStore  # noqa: E402
from edgeinfer.sessions.session_file import load_session, model_identity, read_session_info  # noqa: E402
from edgeinfer.tui.app import ChatApp  # noqa: E402
from edgeinfer.tui.screens import HelpScreen, ModelPickerScreen, SettingsScreen  # noqa: E402
from edgeinfer.tui.widgets import AssistantMessage, PromptInput, UserMessage, code_blocks  # noqa: E402

pytestmark = pytest.mark.anyio  # async tests run on anyio's pytest plugin (asyncio backend)

SIZE = (110, 36)
GREEDY = dict(temperature=0.0, max_tokens=16)


def load_reference(name: str, n_ctx: int):
    return edgeinfer.load(name, n_ctx=n_ctx, backend="reference")


class RecordingApp(ChatApp):
    """ChatApp that remembers its notifications and how many pieces each answer streamed in."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.notes: list[tuple[str, str]] = []
        self.pieces = 0

    def notify(self, message, *, title="", severity="information", timeout=None, markup=True):
        self.notes.append((str(message), severity))
        return super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    async def _on_text(self, widget, text):
        self.pieces += 1
        await super()._on_text(widget, text)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def tiny(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "sessions")


def make_app(model, store, sampling=GREEDY, n_ctx=256, **kw) -> RecordingApp:
    return RecordingApp(model, load_model=load_reference, store=store, sampling=dict(sampling),
                        n_ctx=n_ctx, **kw)


async def settle(app, pilot) -> None:
    """Let queued keys run, then wait for model work (and its UI callbacks) to finish."""
    for _ in range(3000):  # up to ~30 s
        await pilot.pause()
        await app.workers.wait_for_complete()
        await pilot.pause()
        if not (app.generating or app.loading):
            return
        await pilot.pause(0.01)
    raise AssertionError("the app did not settle")


async def send(app, pilot, text: str) -> None:
    app.query_one(PromptInput).text = text
    app.query_one(PromptInput).focus()
    await pilot.press("enter")
    await settle(app, pilot)


def direct_answer(path: str, messages: list[dict], n_ctx: int = 256, **params) -> "edgeinfer.GenerationResult":
    model = load_reference(path, n_ctx)
    return model.chat(messages, **{**GREEDY, **params})


def gated_loader(gate: threading.Event):
    """A loader whose model pauses after the first streamed piece until `gate` is set."""
    def load(name, n_ctx):
        model = load_reference(name, n_ctx)
        real_chat = model.chat

        def chat(messages, **kw):
            for i, chunk in enumerate(real_chat(messages, **kw)):
                if i == 1:
                    gate.wait(30)
                yield chunk

        model.chat = chat
        return model
    return load


def errors(app) -> list[str]:
    return [m for m, sev in app.notes if sev == "error"]


async def test_send_streams_the_greedy_answer_and_saves_it(tiny, store):
    app = make_app(tiny, store)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.model is not None and "F32" in app.stats.render()
        await send(app, pilot, "hello there")
        expected = direct_answer(tiny, [{"role": "user", "content": "hello there"}])
        answer = app.conv.messages[-1]
        assert answer["role"] == "assistant" and answer["content"] == expected.text
        assert answer["finish_reason"] == expected.finish_reason
        widget = app.query_one(AssistantMessage)
        assert widget.text == expected.text and widget.source == expected.text
        assert app.pieces > 1  # it streamed, not one final paint
        u = expected.usage
        assert app.stats.ctx_used == u.prompt_tokens + u.completion_tokens
        assert f"ctx {u.prompt_tokens + u.completion_tokens}/256" in app.stats.render()
        assert app.stats.ttft_s is not None and app.stats.gen_tps is not None
        assert not errors(app)
    # Saved as a saved session (the file `edgeinfer run --session` reads), of this model, no K/V by default.
    saved = read_session_info(store.path_of(app.conv.id))
    assert [m["content"] for m in saved.messages] == ["hello there", expected.text]
    assert saved.meta["title"] == "" and app.conv.display_title == "hello there"
    assert saved.model == app.model.identity and saved.n_kv == 0
    assert saved.sampling["temperature"] == 0.0 and saved.sampling["max_tokens"] == 16


async def test_a_hybrid_model_chats_in_the_tui(tmp_path, store):
    """qwen35 (K/V and a recurrent state per sequence): two turns stream the greedy answers,
    the second resuming from the first's state."""
    from gguf_factory import TinyShape, bpe_vocab, write_tiny_model

    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = str(write_tiny_model(tmp_path / "q35.gguf", "qwen35", "F32", vocab=bpe_vocab("qwen35"),
                                shape=TinyShape(n_layer=4), chat_template=template))
    app = make_app(path, store)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await send(app, pilot, "hello there")
        first = direct_answer(path, [{"role": "user", "content": "hello there"}])
        assert app.conv.messages[-1]["content"] == first.text
        await send(app, pilot, "and then?")
        history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.text},
                   {"role": "user", "content": "and then?"}]
        assert app.conv.messages[-1]["content"] == direct_answer(path, history).text
        assert app.model.stats()["cached_tokens"] > 0
        assert not errors(app)


async def test_newline_key_and_input_usable_while_answering(tiny, store):
    gate = threading.Event()  # holds the answer after its first piece, so "while answering" is certain
    app = RecordingApp(tiny, load_model=gated_loader(gate), store=store, sampling=dict(GREEDY), n_ctx=256)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        prompt = app.query_one(PromptInput)
        prompt.focus()
        await pilot.press("a", "ctrl+j", "b")
        assert prompt.text == "a\nb"
        await pilot.press("enter")
        await pilot.pause()
        assert app.generating and prompt.text == ""
        await pilot.press("x", "y")  # typing while the model answers
        assert prompt.text == "xy"
        await pilot.press("enter")  # a second send while answering is refused, text kept
        assert prompt.text == "xy"
        assert any("still answering" in m for m, _ in app.notes)
        await pilot.press("f1")  # other keys work too
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        gate.set()
        await settle(app, pilot)
        assert not app.generating
        assert [m["content"] for m in app.conv.messages if m["role"] == "user"] == ["a\nb"]
        expected = direct_answer(tiny, [{"role": "user", "content": "a\nb"}])
        assert app.conv.messages[-1]["content"] == expected.text


async def test_quit_mid_answer_keeps_the_text_so_far(tiny, store):
    gate = threading.Event()
    app = RecordingApp(tiny, load_model=gated_loader(gate), store=store, sampling=dict(GREEDY), n_ctx=256)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.query_one(PromptInput).text = "hello"
        await pilot.press("enter")
        for _ in range(400):
            await pilot.pause(0.01)
            if app.query(AssistantMessage) and app.query(AssistantMessage).last().text:
                break
        partial = app.query(AssistantMessage).last().text
        assert partial and app.generating
        await pilot.press("ctrl+q")
    gate.set()
    saved = store.load(app.conv.id).messages
    assert [m["role"] for m in saved] == ["user", "assistant"]
    assert saved[-1]["content"] == partial and saved[-1]["finish_reason"] == "cancelled"
    full = direct_answer(tiny, [{"role": "user", "content": "hello"}]).text
    assert full.startswith(partial) and len(full) > len(partial)


async def test_escape_stops_the_answer_midway(tiny, store):
    limit = 40
    gate = threading.Event()  # the model waits after its first piece until Esc has been pressed
    app = RecordingApp(tiny, load_model=gated_loader(gate), store=store,
                       sampling=dict(temperature=0.0, max_tokens=limit), n_ctx=256)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.query_one(PromptInput).text = "tell me a long story"
        await pilot.press("enter")
        for _ in range(400):
            await pilot.pause(0.01)
            found = app.query(AssistantMessage)
            if found and found.last().text:
                break
        assert app.generating and app.query(AssistantMessage).last().text, "no text streamed"
        await pilot.press("escape")
        gate.set()
        await settle(app, pilot)
        assert not app.generating
        assert app.last_chunk.finish_reason == "cancelled"
        assert app.conv.messages[-1]["finish_reason"] == "cancelled"
        assert app.last_chunk.usage.completion_tokens < limit
        assert "stopped" in app.stats.render()
    full = direct_answer(tiny, [{"role": "user", "content": "tell me a long story"}], max_tokens=limit)
    assert full.finish_reason == "length"  # the uncancelled answer really is longer
    partial = app.conv.messages[-1]["content"]
    assert full.text.startswith(partial) and len(full.text) > len(partial)


async def test_regenerate_and_edit_reuse_the_prefix_cache(tiny, store):
    app = make_app(tiny, store)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await send(app, pilot, "hello")
        first = app.conv.messages[-1]["content"]
        prompt_tokens = app.last_chunk.usage.prompt_tokens
        await pilot.press("ctrl+r")
        await settle(app, pilot)
        assert [m["role"] for m in app.conv.messages] == ["user", "assistant"]
        assert app.conv.messages[-1]["content"] == first  # greedy: same answer again
        assert len(app.query(AssistantMessage)) == 1
        assert app.stats.cached == prompt_tokens - 1  # all but the last prompt token reused
        assert f"cached {prompt_tokens - 1}" in app.stats.render()

        await pilot.press("ctrl+l")
        prompt = app.query_one(PromptInput)
        assert prompt.text == "hello" and app.conv.messages == []
        assert not app.query(UserMessage) and not app.query(AssistantMessage)
        await pilot.press(*" world", "enter")
        await settle(app, pilot)
        expected = direct_answer(tiny, [{"role": "user", "content": "hello world"}])
        assert app.conv.messages[0]["content"] == "hello world"
        assert app.conv.messages[-1]["content"] == expected.text
        assert app.stats.cached > 0


async def test_new_conversation_then_resume_in_a_fresh_app(tiny, store):
    app = make_app(tiny, store)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await send(app, pilot, "first question")
        first_id, first_answer = app.conv.id, app.conv.messages[-1]["content"]
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.conv.id != first_id and not app.query(UserMessage)
        await send(app, pilot, "second question")
    assert len(list(store.root.glob("*.npz"))) == 2

    again = make_app(tiny, store)
    async with again.run_test(size=SIZE) as pilot:
        await settle(again, pilot)
        panel = again.query_one("#conversations")
        titles = [panel.get_option_at_index(i).prompt for i in range(panel.option_count)]
        assert titles == ["second question", "first question"]  # newest first
        panel.focus()
        panel.highlighted = 1
        await pilot.press("enter")
        await settle(again, pilot)
        assert again.conv.id == first_id
        assert [m["content"] for m in again.conv.messages] == ["first question", first_answer]
        assert again.query_one(AssistantMessage).source == first_answer
        # Continuing the resumed chat sends the whole history.
        await send(again, pilot, "and more")
        history = [{"role": "user", "content": "first question"},
                   {"role": "assistant", "content": first_answer},
                   {"role": "user", "content": "and more"}]
        assert again.conv.messages[-1]["content"] == direct_answer(tiny, history).text
    assert len(store.load(first_id).messages) == 4


async def test_settings_are_stored_with_the_conversation_and_resize_the_context(tiny, store):
    app = make_app(tiny, store)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await send(app, pilot, "hi")
        await pilot.press("ctrl+s")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#system").text = "You are terse."
        screen.query_one("#max_tokens").value = "5"
        screen.query_one("#n_ctx").value = "384"
        await pilot.click("#save")
        await settle(app, pilot)
        assert not isinstance(app.screen, SettingsScreen)
        assert app.model.n_ctx == 384 and app.stats.n_ctx == 384  # reloaded with the new size
        await pilot.press("ctrl+r")
        await settle(app, pilot)
        expected = direct_answer(tiny, [{"role": "system", "content": "You are terse."},
                                        {"role": "user", "content": "hi"}], n_ctx=384, max_tokens=5)
        assert app.conv.messages[-1]["content"] == expected.text
        assert app.last_chunk.usage.completion_tokens == 5
    saved = store.load(app.conv.id)
    assert saved.system == "You are terse."
    assert saved.settings["max_tokens"] == 5 and saved.settings["n_ctx"] == 384
    assert saved.settings["temperature"] == 0.0


async def test_bad_setting_is_refused_with_a_notification(tiny, store):
    app = make_app(tiny, store)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("ctrl+s")
        await pilot.pause()
        app.screen.query_one("#top_p").value = "7"
        await pilot.click("#save")
        await pilot.pause()
        assert any("top_p" in m for m in errors(app))
        assert app.conv.settings["top_p"] == 0.95


async def test_load_failure_and_context_overflow_are_notifications(tiny, store, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    app = make_app(str(bad), store)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.model is None and errors(app)
        await send(app, pilot, "anyone?")
        assert app.is_running and app.query_one(PromptInput).text == "anyone?"
        assert any("no model" in m for m, _ in app.notes)

    small = make_app(tiny, store, n_ctx=32)
    async with small.run_test(size=SIZE) as pilot:
        await settle(small, pilot)
        long_text = "hello " * 60
        await send(small, pilot, long_text)
        assert any("context" in m for m in errors(small))
        # The question is given back to edit, and nothing half-done is kept.
        assert small.query_one(PromptInput).text == long_text
        assert small.conv.messages == [] and not small.query(UserMessage)


async def test_copy_answer_and_code_block(tiny, store):
    code_answer = "Here:\n\n```python\nprint('hi')\nx = 1\n```\n\nand\n\n```sh\nls -l\n```\n"
    conv = Conversation(model=tiny, messages=[{"role": "user", "content": "code please"},
                                              {"role": "assistant", "content": code_answer}])
    store.save(conv)
    app = make_app(tiny, store)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("f3")
        assert any("no answer" in m for m, _ in app.notes)
        await send(app, pilot, "hello")
        await pilot.press("f3")
        assert app.clipboard == app.conv.messages[-1]["content"]
        panel = app.query_one("#conversations")
        panel.focus()
        panel.highlighted = [panel.get_option_at_index(i).id for i in range(panel.option_count)].index(conv.id)
        await pilot.press("enter")
        await settle(app, pilot)
        await pilot.press("f4")
        assert app.clipboard == "ls -l"


def test_code_blocks_finds_closed_and_unclosed_fences():
    assert code_blocks("a\n```py\nx=1\n```\nb\n~~~\ny\n~~~\n") == ["x=1", "y"]
    assert code_blocks("text\n```\nstill streaming") == ["still streaming"]
    assert code_blocks("no code") == []


async def test_corrupt_file_is_skipped_with_a_notification(tiny, store):
    store.root.mkdir(parents=True)
    (store.root / "0123.json").write_text("{oops")  # a first-store file: not migrated, kept, reported
    (store.root / "broken.npz").write_bytes(b"PK\x03\x04 not really")
    good = Conversation(messages=[{"role": "user", "content": "kept"}])
    store.save(good)
    app = make_app(tiny, store, warm_up=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.is_running
        assert any("0123.json" in m and sev == "warning" for m, sev in app.notes)
        assert any("broken.npz" in m and "corrupt" in m and sev == "warning" for m, sev in app.notes)
        assert (store.root / "0123.json").exists()
        assert app.query_one("#conversations").option_count == 1


async def test_rename_delete_help_theme_and_model_picker(tiny, store, tiny_models):
    other = str(tiny_models["qwen2"])
    app = make_app(tiny, store, list_models=lambda: [("tiny qwen2", other)])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await send(app, pilot, "hello")
        await pilot.press("f2")
        await pilot.pause()
        title = app.screen.query_one("#title")
        title.value = "My chat"
        await pilot.press("enter")
        await pilot.pause()
        assert store.load(app.conv.id).title == "My chat" and app.sub_title == "My chat"

        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)

        theme = app.theme
        await pilot.press("ctrl+t")
        assert app.theme != theme

        cid = app.conv.id
        await pilot.press("f8")
        await pilot.pause()
        await pilot.press("y")
        await settle(app, pilot)
        assert not store.path_of(cid).exists() and app.conv.messages == []

        await pilot.press("ctrl+o")
        await pilot.pause()
        assert isinstance(app.screen, ModelPickerScreen)
        await pilot.press("enter")
        await settle(app, pilot)
        assert app.model is not None and app.model.config.arch == "qwen2"
        assert "qwen2.gguf" in app.stats.render()


def test_chat_command_rejects_bad_flags_before_opening_the_screen(capsys):
    from edgeinfer.cli import main

    assert main(["chat", "gemma3-270m", "--top-p", "7"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgeinfer: error:") and "top_p" in err and "\n" not in err


# -- conversations are saved sessions ------------------------------------------------------------


def run_args(path: str, *extra: str, n_ctx: int = 256) -> list[str]:
    return ["run", path, *extra, "-n", "16", "--temp", "0", "--backend", "reference", "-c", str(n_ctx)]


async def test_conversation_goes_on_in_edgeinfer_run_and_back(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    store = ConversationStore()  # the default: $EDGEINFER_HOME/sessions, where `run --session` looks
    ctx = 1024  # the tiny model's tokenizer spends a token per character or so
    app = make_app(tiny, store, system="Be brief.", n_ctx=ctx)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await send(app, pilot, "first question")
        cid, first = app.conv.id, app.conv.messages[-1]["content"]
        await pilot.press("f2")  # the rename dialog names the session and the command that resumes it
        await pilot.pause()
        hint = str(app.screen.query_one("#session-hint").render())
        assert f"edgeinfer run {tiny} --session {cid}" in hint
        app.screen.query_one("#title").value = "Named in the TUI"
        await pilot.press("enter")
        await pilot.pause()
    assert store.path_of(cid) == tmp_path / "sessions" / f"{cid}.npz"

    # `edgeinfer run NAME --session ID` resumes it: system prompt, history and sampling restored.
    capsys.readouterr()
    assert main(run_args(tiny, "and more", "--session", cid, n_ctx=ctx)) == 0
    out, err = capsys.readouterr()
    assert f"Resumed session '{cid}' (1 turn(s))" in err
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first question"},
               {"role": "assistant", "content": first}, {"role": "user", "content": "and more"}]
    second = direct_answer(tiny, history, n_ctx=ctx).text
    assert out == second + "\n"

    # `run` wrote the file; the TUI's title (kept in the header's meta) survived it.
    made_by_run = main(run_args(tiny, "hello from run", "--session", "work", n_ctx=ctx))
    assert made_by_run == 0
    again = make_app(tiny, store, n_ctx=ctx)
    async with again.run_test(size=SIZE) as pilot:
        await settle(again, pilot)
        panel = again.query_one("#conversations")
        titles = {panel.get_option_at_index(i).id: panel.get_option_at_index(i).prompt
                  for i in range(panel.option_count)}
        assert titles == {cid: "Named in the TUI", "work": "hello from run"}
        await again.open_conversation(cid)
        await settle(again, pilot)
        assert again.conv.system == "Be brief."
        assert [m["content"] for m in again.conv.messages] == ["first question", first, "and more", second]
        assert not [m for m, sev in again.notes if sev != "information"]
        await send(again, pilot, "last one")
        expected = direct_answer(tiny, history + [{"role": "assistant", "content": second},
                                                  {"role": "user", "content": "last one"}], n_ctx=ctx).text
        assert again.conv.messages[-1]["content"] == expected

        await again.open_conversation("work")  # a session `run` made opens in the TUI too
        await settle(again, pilot)
        assert [m["content"] for m in again.conv.messages][0] == "hello from run"
        assert again.query_one(UserMessage).text == "hello from run"
    model = load_reference(tiny, ctx)
    final = load_session(store.path_of(cid), model.identity, model.config.n_layer)
    assert [m["role"] for m in final.messages] == ["system"] + ["user", "assistant"] * 3
    assert final.meta["title"] == "Named in the TUI"


async def test_a_failed_save_keeps_the_previous_file(tiny, store, monkeypatch):
    app = make_app(tiny, store, n_ctx=1024)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await send(app, pilot, "first")
        path = store.path_of(app.conv.id)
        before = path.read_bytes()
        real_savez = np.savez

        def disk_full(file, **arrays):  # the write dies half-way through, as a crash or a full disk would
            file.write(b"PK\x03\x04" + b"\0" * 100)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(np, "savez", disk_full)
        await send(app, pilot, "second")
        assert app.is_running and len(app.conv.messages) == 4  # the chat goes on in memory
        assert any("could not save" in m and "No space left" in m for m in errors(app))
        assert path.read_bytes() == before  # the previous version, whole
        assert sorted(p.name for p in store.root.iterdir()) == [path.name]  # no temp file left
        assert [m["content"] for m in read_session_info(path).messages][0] == "first"
        assert len(read_session_info(path).messages) == 2

        monkeypatch.setattr(np, "savez", real_savez)
        failures = len(errors(app))
        await send(app, pilot, "third")
        assert len(errors(app)) == failures and len(read_session_info(path).messages) == 6


async def test_saved_kv_cache_means_resuming_prefills_nothing(tiny, store):
    app = make_app(tiny, store)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await send(app, pilot, "no cache kept")
        without_kv = app.conv.id
        await pilot.press("ctrl+n")
        await pilot.press("ctrl+s")  # turn the setting on, as a person would
        await pilot.pause()
        box = app.screen.query_one("#save_kv")
        assert box.value is False  # off by default
        box.value = True
        await pilot.click("#save")
        await settle(app, pilot)
        await send(app, pilot, "hello")
        with_kv, prompt_tokens = app.conv.id, app.last_chunk.usage.prompt_tokens
    info = read_session_info(store.path_of(with_kv))
    assert info.n_kv >= prompt_tokens and info.meta["settings"]["save_kv"] is True
    assert read_session_info(store.path_of(without_kv)).n_kv == 0

    fresh = make_app(tiny, store)  # a new process: its prefix cache starts empty
    async with fresh.run_test(size=SIZE) as pilot:
        await settle(fresh, pilot)
        await fresh.open_conversation(with_kv)
        await settle(fresh, pilot)
        assert any("restored the saved KV cache" in m for m, _ in fresh.notes)
        await pilot.press("ctrl+r")
        await settle(fresh, pilot)
        assert fresh.last_chunk.usage.prompt_tokens == prompt_tokens
        assert fresh.stats.cached == prompt_tokens - 1  # all but the last prompt token came from disk
        assert read_session_info(store.path_of(with_kv)).n_kv > 0  # saved with it again

    control = make_app(tiny, store)
    async with control.run_test(size=SIZE) as pilot:
        await settle(control, pilot)
        await control.open_conversation(without_kv)
        await settle(control, pilot)
        await pilot.press("ctrl+r")
        await settle(control, pilot)
        assert control.stats.cached == 0  # without saved K/V the whole prompt is read again
        assert not any("restored" in m for m, _ in control.notes)


async def test_resuming_another_models_conversation_loads_that_model(tiny, tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    store = ConversationStore()
    qwen = str(tiny_models["qwen2"])
    maker = make_app(qwen, store, warm_up=False)
    async with maker.run_test(size=SIZE) as pilot:
        await settle(maker, pilot)
        await send(maker, pilot, "hi qwen")
        qwen_conv, qwen_answer = maker.conv.id, maker.conv.messages[-1]["content"]
    assert main(run_args(qwen, "hi from run", "--session", "qwen-run")) == 0  # no model name in its file

    app = make_app(tiny, store, warm_up=False, list_models=lambda: [("tiny qwen2", qwen), ("tiny llama", tiny)])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.model.config.arch == "llama"
        await app.open_conversation(qwen_conv)
        await settle(app, pilot)
        assert any("loading qwen2.gguf" in m for m, _ in app.notes)
        assert app.model.config.arch == "qwen2" and app.model_name == qwen
        assert "qwen2.gguf" in app.stats.render()
        await send(app, pilot, "and?")
        history = [{"role": "user", "content": "hi qwen"}, {"role": "assistant", "content": qwen_answer},
                   {"role": "user", "content": "and?"}]
        assert app.conv.messages[-1]["content"] == direct_answer(qwen, history).text

        await pilot.press("ctrl+o")  # back to llama, then open the session `run` made with qwen2:
        await pilot.pause()
        app.screen.query_one("#models").highlighted = 1
        await pilot.press("enter")
        await settle(app, pilot)
        assert app.model.config.arch == "llama"
        await app.open_conversation("qwen-run")  # found among the local models by its file identity
        await settle(app, pilot)
        assert app.model.config.arch == "qwen2" and not errors(app)


async def test_conversation_of_a_missing_model_stays_readable(tiny, tiny_models, store, tmp_path):
    gone = tmp_path / "elsewhere" / "gone-model.gguf"
    gone.parent.mkdir()
    shutil.copy(tiny_models["qwen2"], gone)
    maker = make_app(str(gone), store, warm_up=False)
    async with maker.run_test(size=SIZE) as pilot:
        await settle(maker, pilot)
        await send(maker, pilot, "remember this")
        cid, answer = maker.conv.id, maker.conv.messages[-1]["content"]
    os.remove(gone)

    app = make_app(tiny, store, warm_up=False, list_models=lambda: [("tiny llama", tiny)])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await app.open_conversation(cid)
        await settle(app, pilot)
        notice = [m for m, sev in app.notes if sev == "warning" and "not on this machine" in m]
        assert notice and "gone-model.gguf" in notice[0] and "\n" not in notice[0]
        assert app.model.config.arch == "llama" and app.is_running  # the loaded model stays
        assert app.query_one(UserMessage).text == "remember this"  # the messages are readable
        assert app.query_one(AssistantMessage).source == answer
        await send(app, pilot, "go on")  # continuing it uses the loaded model, and says so in the file
        assert len(app.conv.messages) == 4
    assert read_session_info(store.path_of(cid)).model["digest"] == model_identity(tiny)["digest"]


async def test_first_store_conversations_are_migrated(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    old = tmp_path / "conversations"
    old.mkdir()
    cid = "ab" * 16
    (old / f"{cid}.json").write_text(
        '{"version": 1, "id": "%s", "title": "Old chat", "model": "%s", "system": "sys", '
        '"settings": {"temperature": 0.0, "n_ctx": 256}, "created": 1.0, "updated": 2.0, '
        '"messages": [{"role": "user", "content": "old question"}, '
        '{"role": "assistant", "content": "old answer", "finish_reason": "stop"}]}' % (cid, tiny),
        encoding="utf-8")
    lost = "cd" * 16
    (old / f"{lost}.json").write_text(
        '{"version": 1, "id": "%s", "title": "", "model": "/nowhere/lost.gguf", "system": "", "settings": {}, '
        '"messages": [{"role": "user", "content": "lost question"}]}' % lost, encoding="utf-8")
    app = make_app(tiny, ConversationStore(), warm_up=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        panel = app.query_one("#conversations")
        assert sorted(panel.get_option_at_index(i).prompt for i in range(panel.option_count)) == [
            "Old chat", "lost question"]
        await app.open_conversation(cid)
        await settle(app, pilot)
        assert app.conv.system == "sys" and app.query_one(AssistantMessage).source == "old answer"
        assert not [m for m, sev in app.notes if sev != "information"]
        await app.open_conversation(lost)
        await settle(app, pilot)
        assert any("lost.gguf" in m and "not on this machine" in m for m, sev in app.notes if sev == "warning")
        assert app.query_one(UserMessage).text == "lost question" and app.model.config.arch == "llama"
    assert (old / "migrated" / f"{cid}.json").exists() and not (old / f"{cid}.json").exists()
    assert read_session_info(tmp_path / "sessions" / f"{cid}.npz").model["digest"] == model_identity(tiny)["digest"]
