"""The model picker pulls a model by name with a progress bar, against the local hub stand-in (no network)."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

pytest.importorskip("textual")

sys.path.insert(0, str(Path(__file__).parent))
from hub_standin import HubStandin, use_standin  # noqa: E402

from edgeinfer.store import download  # noqa: E402
from edgeinfer.sessions.conversations import ConversationStore  # noqa: E402
from edgeinfer.tui.app import ChatApp, pull_model  # noqa: E402
from edgeinfer.tui.screens import ModelPickerScreen  # noqa: E402

REPO = "acme/Tiny-GGUF"
FILE = "tiny-Q4_K_M.gguf"
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    writer = gguf.GGUFWriter(str(tmp_path / FILE), "llama")
    writer.add_tensor("token_embd.weight", np.arange(50_000, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    server = HubStandin().start()
    server.add_file(REPO, FILE, (tmp_path / FILE).read_bytes())
    use_standin(monkeypatch, server, tmp_path)
    yield server
    server.stop()


@pytest.fixture
def slow_link(monkeypatch):
    """The download arrives in 8 pieces 0.15 s apart, so its progress can be watched."""
    real = download.http_get

    def slow(url, temp_file, **kwargs):
        buf = io.BytesIO()
        real(url, buf, **kwargs)
        data = buf.getvalue()
        step = len(data) // 8 + 1
        for i in range(0, len(data), step):
            temp_file.write(data[i:i + step])
            temp_file.flush()
            time.sleep(0.15)

    monkeypatch.setattr(download, "http_get", slow)


def test_pull_model_reports_growing_byte_counts(hub, slow_link):
    seen: list[int] = []
    pull_model(f"hf.co/{REPO}", lambda done, total: seen.append(done))
    assert len(seen) >= 2 and seen == sorted(seen) and seen[-1] > 0
    assert download.cached_file(REPO, FILE) is not None


async def test_picker_pulls_then_loads_the_pulled_model(hub, slow_link, tmp_path):
    loaded: list[str] = []

    def load(name, n_ctx):
        loaded.append(name)
        raise download.DownloadError("stand-in: not loading in this test")

    app = ChatApp(None, load_model=load, store=ConversationStore(tmp_path / "sessions"),
                  list_models=lambda: [], warm_up=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, ModelPickerScreen)
        picker = app.screen
        picker.query_one("#pull-name").value = f"hf.co/{REPO}"
        await pilot.press("enter")
        shown = ""
        for _ in range(300):
            await pilot.pause(0.02)
            shown = str(picker.query_one("#pull-status").render())
            if "KB" in shown:
                break
        assert f"pulling hf.co/{REPO}: " in shown and "KB" in shown
        assert picker.query_one("#pull-progress").display
        for _ in range(300):
            await pilot.pause(0.02)
            if loaded:
                break
        assert loaded == [f"hf.co/{REPO}"]
    assert download.cached_file(REPO, FILE) is not None


async def test_pulling_an_unknown_name_is_one_line_and_keeps_the_picker(hub, tmp_path):
    app = ChatApp(None, load_model=lambda n, c: None, store=ConversationStore(tmp_path / "sessions"),
                  list_models=lambda: [], warm_up=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        picker = app.screen
        picker.query_one("#pull-name").value = "hf.co/acme/Missing-GGUF"
        await pilot.press("enter")
        for _ in range(300):
            await pilot.pause(0.02)
            if not picker.pulling:
                break
        status = str(picker.query_one("#pull-status").render())
        assert app.screen is picker and status and "\n" not in status and "Traceback" not in status
        assert "Missing-GGUF" in status
