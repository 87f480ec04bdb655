"""Images in the chat TUI: `/image PATH` and Ctrl+G attach one to the next message, the transcript
names it with its size, the model gets it as an image part (a tiny Gemma 3 with a stand-in
projector), and a model without an mmproj or a bad image is one notice with nothing lost."""

from __future__ import annotations

import struct
import zlib

import pytest

pytest.importorskip("textual")
pytest.importorskip("PIL")

from image_fixtures import FakeProjector, write_gemma3  # noqa: E402

from edgeinfer.api import Model  # noqa: E402
from edgeinfer.engine import EngineOptions  # noqa: E402
from edgeinfer.sessions.conversations import ConversationStore  # noqa: E402
from edgeinfer.sessions.session_file import read_session_info  # noqa: E402
from edgeinfer.tui.app import ChatApp  # noqa: E402
from edgeinfer.tui.attachments import Attachments, image_command  # noqa: E402
from edgeinfer.tui.screens import ImagePathScreen  # noqa: E402
from edgeinfer.tui.widgets import PromptInput, UserMessage  # noqa: E402
from edgeinfer.vision.media_ids import image_runs  # noqa: E402

pytestmark = pytest.mark.anyio

N_EMBD = 64
SIZE = (110, 36)
GREEDY = dict(temperature=0.0, max_tokens=2)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    return write_gemma3(tmp_path_factory.mktemp("tuiimg") / "gemma3-img.gguf", n_embd=N_EMBD)


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width×height (no pixel data: only the header is read)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"")


@pytest.fixture
def pics(tmp_path):
    from PIL import Image

    red = tmp_path / "red.png"
    Image.new("RGB", (8, 6), (200, 10, 10)).save(red)
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    huge = tmp_path / "huge.png"
    huge.write_bytes(_png_header(10000, 6000))  # 60 MP
    return {"red": str(red), "text": str(text), "huge": str(huge), "missing": str(tmp_path / "gone.png")}


class RecordingApp(ChatApp):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.notes: list[tuple[str, str]] = []

    def notify(self, message, *, title="", severity="information", timeout=None, markup=True):
        self.notes.append((str(message), severity))
        return super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)


def make_app(gemma_path, store, images: bool, sent: list, prompts: list) -> RecordingApp:
    """The app over the tiny Gemma 3 (a stand-in projector when `images`); `sent` gets the messages
    of every model.chat call, `prompts` the token ids each prompt became."""
    def load(name, n_ctx):
        model = Model("tiny-gemma3", gemma_path, EngineOptions(n_ctx=n_ctx, backend="reference"))
        if images:
            model.use_projector(FakeProjector(N_EMBD))
        real = model.chat

        def chat(messages, **kw):
            sent.append(messages)
            return real(messages, on_prompt=prompts.append, **kw)

        model.chat = chat
        return model

    return RecordingApp(str(gemma_path), load_model=load, store=store, sampling=dict(GREEDY), n_ctx=256,
                        warm_up=False)


async def settle(app, pilot) -> None:
    for _ in range(3000):
        await pilot.pause()
        await app.workers.wait_for_complete()
        await pilot.pause()
        if not (app.generating or app.loading):
            return
        await pilot.pause(0.01)
    raise AssertionError("the app did not settle")


async def submit(app, pilot, text: str) -> None:
    prompt = app.query_one(PromptInput)
    prompt.text = text
    prompt.focus()
    await pilot.press("enter")
    await settle(app, pilot)


def errors(app) -> list[str]:
    return [m for m, sev in app.notes if sev == "error"]


async def test_image_command_goes_with_the_next_message_and_is_resent(gemma_path, pics, tmp_path):
    store = ConversationStore(tmp_path / "sessions")
    sent, prompts = [], []
    app = make_app(gemma_path, store, True, sent, prompts)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await submit(app, pilot, f"/image {pics['red']}")
        prompt = app.query_one(PromptInput)
        assert prompt.text == "" and prompt.border_title == "+ image: red.png 8×6" and not sent
        await submit(app, pilot, "the of")
        assert not errors(app) and prompt.border_title == ""
        parts = sent[0][-1]["content"]
        assert [p["type"] for p in parts] == ["image_url", "text"] and parts[1]["text"] == "the of"
        assert len(image_runs(prompts[0])) == 1
        shown = app.query(UserMessage).last()
        assert shown.text == "the of" and shown.images == ["image: red.png 8×6"]
        await submit(app, pilot, "and to")  # a later answer gets the image again
        assert [p["type"] for p in sent[1][0]["content"]] == ["image_url", "text"]
        assert sent[1][-1] == {"role": "user", "content": "and to"}
    saved = read_session_info(store.path_of(app.conv.id))  # text and the image's record, no bytes
    assert saved.messages[0]["content"] == "the of"
    assert saved.messages[0]["images"] == [{"path": pics["red"], "name": "red.png", "width": 8, "height": 6}]
    sent.clear()
    again = make_app(gemma_path, store, True, sent, prompts)
    async with again.run_test(size=SIZE) as pilot:
        await settle(again, pilot)
        await again.open_conversation(app.conv.id)
        await settle(again, pilot)
        assert again.query(UserMessage).first().images == ["image: red.png 8×6"]
        await submit(again, pilot, "of the")  # the file is read again for the resumed chat
        assert [p["type"] for p in sent[-1][0]["content"]] == ["image_url", "text"] and not errors(again)


async def test_a_model_without_mmproj_says_so_in_one_line(gemma_path, pics, tmp_path):
    sent, prompts = [], []
    app = make_app(gemma_path, ConversationStore(tmp_path / "s"), False, sent, prompts)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await submit(app, pilot, f"/image {pics['red']}")
        assert len(errors(app)) == 1 and "--mmproj" in errors(app)[0] and "\n" not in errors(app)[0]
        assert app.query_one(PromptInput).text == f"/image {pics['red']}"  # nothing lost
        app.query_one(PromptInput).text = "my question"
        await pilot.press("ctrl+g")
        await pilot.pause()
        assert not isinstance(app.screen, ImagePathScreen) and len(errors(app)) == 2
        assert app.query_one(PromptInput).text == "my question" and not sent


@pytest.mark.parametrize("which, says", [("text", "not an image"), ("huge", "megapixel"),
                                         ("missing", "cannot read")])
async def test_a_bad_image_is_one_notice_and_the_message_stays(gemma_path, pics, tmp_path, which, says):
    sent, prompts = [], []
    app = make_app(gemma_path, ConversationStore(tmp_path / "s"), True, sent, prompts)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await submit(app, pilot, f"/image {pics[which]}")
        assert len(errors(app)) == 1 and says in errors(app)[0] and "\n" not in errors(app)[0]
        assert app.query_one(PromptInput).text == f"/image {pics[which]}"
        assert app.attachments.pending == [] and not sent


async def test_ctrl_g_asks_for_a_path_and_keeps_the_typed_message(gemma_path, pics, tmp_path):
    sent, prompts = [], []
    app = make_app(gemma_path, ConversationStore(tmp_path / "s"), True, sent, prompts)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.query_one(PromptInput).text = "describe it"
        await pilot.press("ctrl+g")
        await pilot.pause()
        assert isinstance(app.screen, ImagePathScreen)
        app.screen.query_one("#image-path").value = pics["text"]
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ImagePathScreen) and len(errors(app)) == 1  # stays open to fix the path
        app.screen.query_one("#image-path").value = pics["red"]
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, ImagePathScreen)
        prompt = app.query_one(PromptInput)
        assert prompt.text == "describe it" and prompt.border_title == "+ image: red.png 8×6"
        prompt.focus()
        await pilot.press("enter")
        await settle(app, pilot)
        assert [p["type"] for p in sent[0][-1]["content"]] == ["image_url", "text"]


async def test_edit_last_gives_the_message_back_with_its_images(gemma_path, pics, tmp_path):
    sent, prompts = [], []
    app = make_app(gemma_path, ConversationStore(tmp_path / "s"), True, sent, prompts)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await submit(app, pilot, f"/image {pics['red']}")
        await submit(app, pilot, "the of")
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert app.query_one(PromptInput).text == "the of"
        assert [r["name"] for r in app.attachments.pending] == ["red.png"]


def test_image_command_and_left_out_images(pics):
    assert image_command("/image  'my cat.png' ") == "my cat.png"
    assert image_command("/image") == "" and image_command("/imagex a") is None
    assert image_command("what is /image a.png") is None

    class Takes:
        images = object()

    att = Attachments()
    conv = [{"role": "user", "content": "hi", "images": [{"path": pics["missing"], "name": "gone.png"}]},
            {"role": "assistant", "content": "yes"}]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yes"}]
    out, problems = att.chat_messages(conv, messages, Takes(), "m")
    assert out == messages and len(problems) == 1 and "gone.png" in problems[0]  # the text still goes
    out, problems = att.chat_messages(conv, messages, object(), "m")
    assert out == messages and "--mmproj" in problems[0]


@pytest.mark.parametrize("flags, says", [(["--no-mmproj", "--mmproj", "x.gguf"], "--no-mmproj"),
                                         (["--mmproj", "/nonexistent/mmproj.gguf"], "no such file")])
def test_chat_mmproj_flags_fail_before_the_screen(gemma_path, flags, says, capsys):
    from edgeinfer.cli import main

    code = main(["chat", str(gemma_path), *flags, "--backend", "reference", "-c", "64"])
    err = capsys.readouterr().err
    assert code == 1 and says in err and err.count("\n") == 1, err


def test_chat_loads_the_named_model_with_its_mmproj_and_others_with_theirs(tmp_path):
    from edgeinfer.cli import build_parser
    from edgeinfer.commands.chat import mmproj_loader

    mmproj = tmp_path / "mmproj.gguf"
    mmproj.write_bytes(b"")
    args = build_parser().parse_args(["chat", "a.gguf", "--mmproj", str(mmproj)])
    assert mmproj_loader(args)("a.gguf") == str(mmproj) and mmproj_loader(args)("other") == "auto"
    args = build_parser().parse_args(["chat", "a.gguf", "--no-mmproj"])
    assert mmproj_loader(args)("a.gguf") is None


def test_edgeinfer_chat_loads_the_model_with_its_mmproj(gemma_path, tmp_path, monkeypatch):
    pytest.importorskip("edgeinfer.vision.gemma3")
    from mmproj_factory import write_gemma3_mmproj

    from edgeinfer.cli import main

    mmproj = write_gemma3_mmproj(tmp_path / "mmproj-tiny.gguf", n_embd_text=N_EMBD)
    seen = {}

    def run(app):  # instead of the screen: what its loader gives
        model = app.load_model(app.model_name, 64)
        seen["images"] = model.images is not None

    monkeypatch.setattr(ChatApp, "run", run)
    code = main(["chat", str(gemma_path), "--mmproj", str(mmproj), "--backend", "reference", "-c", "64",
                 "--data-dir", str(tmp_path / "s")])
    assert code == 0 and seen == {"images": True}
    code = main(["chat", str(gemma_path), "--backend", "reference", "-c", "64", "--data-dir", str(tmp_path / "s")])
    assert code == 0 and seen == {"images": False}  # a model given as a file: images with --mmproj only
