"""Image input in every REST dialect (edgeinfer.server.images): what each dialect's image shape
hands the model, the 400s for bad images (each naming the field, the server staying up),
remote URLs refused by default and fetched under --allow-image-urls from a local stand-in
server (never the internet), and a model without an mmproj saying so.

The tiny random llama stands in for a vision model: `Seeing` records the images each call
gets (bytes, in order, at the marker's place in the text) and answers from the text alone.
"""

from __future__ import annotations

import base64
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import struct
import threading
import time
import zlib

import httpx
import pytest

import edgeinfer
from edgeinfer.server.images import MARKER, MAX_IMAGES
from gguf_factory import write_tiny_model
from test_server import start_server
from test_server import fim_vocab

MODEL = "tiny"


def png(width: int = 2, height: int = 2, rgb: tuple[int, int, int] = (200, 30, 30), rows: bytes | None = None
        ) -> bytes:
    """A real PNG (RGB, 8 bits), made by hand: no image library needed (`rows`: other pixel data)."""
    if rows is None:
        rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


RED, BLUE = png(), png(3, 1, (0, 0, 250))
B64_RED, B64_BLUE = base64.b64encode(RED).decode(), base64.b64encode(BLUE).decode()
URI_RED, URI_BLUE = "data:image/png;base64," + B64_RED, "data:image/png;base64," + B64_BLUE


class Seeing:
    """The tiny text model dressed as a vision model: `images` is set (as an mmproj sets it),
    and generate / chat record the images they get before answering from the text."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.images = "stand-in encoder"
        self.calls: list[tuple[str, object, list[bytes]]] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, prompt, *, images=None, **kw):
        self.calls.append(("generate", prompt, list(images or [])))
        assert all(isinstance(i, bytes) for i in images or []), "the server hands the model bytes, never paths"
        return self._inner.generate(prompt, **kw)

    def chat(self, messages, **kw):
        flat, seen = [], []
        for m in messages:
            if isinstance(m.get("content"), list):
                text = ""
                for p in m["content"]:
                    if p["type"] == "image_url":
                        head, _, data = p["image_url"]["url"].partition(",")
                        assert head.startswith("data:image/") and head.endswith(";base64")
                        seen.append(base64.b64decode(data, validate=True))
                        text += MARKER
                    else:
                        text += p["text"]
                m = {**m, "content": text}
            flat.append(m)
        self.calls.append(("chat", flat, seen))
        return self._inner.chat(flat, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 512 positions: a template without tools gets tool turns as JSON text (the polyfill), and
    # this vocabulary spells most of it a character at a time
    path = write_tiny_model(tmp_path_factory.mktemp("img") / "tiny.gguf", "llama", "F32", vocab=fim_vocab())
    return edgeinfer.load(str(path), backend="reference", n_ctx=512)


@pytest.fixture(scope="module")
def seeing(tiny):
    return Seeing(tiny)


@pytest.fixture(scope="module")
def live(seeing):
    srv = start_server(seeing, max_image_bytes=4096)
    yield srv
    srv.stop()


@pytest.fixture()
def http(live, seeing):
    seeing.calls.clear()
    with httpx.Client(base_url=live.url, timeout=30) as c:
        yield c


def only_call(model) -> tuple[str, object, list[bytes]]:
    assert len(model.calls) == 1, model.calls
    return model.calls[0]


# -- each dialect's image shape reaches the model ------------------------------------------------

def user_content(call) -> str:
    kind, messages, _ = call
    assert kind == "chat"
    return [m for m in messages if m["role"] == "user"][-1]["content"]


def test_openai_image_url_parts(http, seeing):
    for path in ("/v1/chat/completions", "/chat/completions"):  # llama-server's unprefixed route too
        seeing.calls.clear()
        r = http.post(path, json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "first"}, {"type": "image_url", "image_url": {"url": URI_RED}},
            {"type": "text", "text": "then"},
            {"type": "image_url", "image_url": {"url": URI_BLUE, "detail": "auto"}}]}]})
        assert r.status_code == 200, r.text
        call = only_call(seeing)
        assert call[2] == [RED, BLUE]
        assert user_content(call) == f"first{MARKER}then{MARKER}"


def test_openai_client_sends_an_image(live, seeing):
    openai = pytest.importorskip("openai")
    seeing.calls.clear()
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": URI_BLUE}}, {"type": "text", "text": "what is it?"}]}])
    assert r.choices[0].message.role == "assistant"
    assert only_call(seeing)[2] == [BLUE]


def test_ollama_chat_and_generate_images(http, seeing):
    r = http.post("/api/chat", json={"stream": False, "messages": [
        {"role": "user", "content": "what is it?", "images": [B64_RED, B64_BLUE]}]})
    assert r.status_code == 200, r.text
    call = only_call(seeing)
    assert call[2] == [RED, BLUE] and user_content(call) == f"{MARKER}{MARKER}what is it?"  # images first

    seeing.calls.clear()
    r = http.post("/api/generate", json={"prompt": "describe", "images": [B64_BLUE], "stream": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "context" not in body  # the images' positions have no token ids to hand back
    call = only_call(seeing)
    assert call[2] == [BLUE] and user_content(call) == f"{MARKER}describe"

    seeing.calls.clear()  # raw: Model.generate places the images (at markers, else before the text)
    r = http.post("/api/generate", json={"prompt": f"a {MARKER} b", "images": [B64_RED], "raw": True,
                                         "stream": False})
    assert r.status_code == 200, r.text
    assert only_call(seeing) == ("generate", f"a {MARKER} b", [RED])


def test_ollama_python_client_sends_images(live, seeing):
    ollama = pytest.importorskip("ollama")
    seeing.calls.clear()
    c = ollama.Client(host=live.url)
    c.chat(model=MODEL, messages=[{"role": "user", "content": "hi", "images": [RED]}], stream=False,
           options={"num_predict": 2})
    assert only_call(seeing)[2] == [RED]


def test_llama_server_multimodal_data(http, seeing):
    r = http.post("/completion", json={"n_predict": 2, "prompt": {
        "prompt_string": f"see {MARKER} and {MARKER}:", "multimodal_data": [B64_BLUE, B64_RED]}})
    assert r.status_code == 200, r.text
    assert only_call(seeing) == ("generate", f"see {MARKER} and {MARKER}:", [BLUE, RED])
    assert r.json()["prompt"] == f"see {MARKER} and {MARKER}:"

    seeing.calls.clear()  # a batch: each prompt with its own images
    r = http.post("/completion", json={"n_predict": 1, "prompt": [
        {"prompt_string": f"{MARKER} one", "multimodal_data": [B64_RED]}, "plain text",
        {"prompt_string": f"{MARKER} two", "multimodal_data": [B64_BLUE]}]})
    assert r.status_code == 200, r.text
    assert [(c[1], c[2]) for c in seeing.calls] == [(f"{MARKER} one", [RED]), (seeing.calls[1][1], []),
                                                    (f"{MARKER} two", [BLUE])]


def test_anthropic_image_blocks(http, seeing):
    r = http.post("/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64_RED}},
        {"type": "text", "text": "and say"}]}]})
    assert r.status_code == 200, r.text
    call = only_call(seeing)
    assert call[2] == [RED] and user_content(call) == f"look{MARKER}and say"


def test_streamed_answers_take_images_too(http, seeing):
    for path, body in (
            ("/v1/messages", {"max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64_RED}}]}]}),
            ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": [B64_RED]}]}),  # streams by default
            ("/v1/chat/completions", {"stream": True, **chat_image(URI_RED)}),
            ("/v1/responses", {"stream": True, "max_output_tokens": 2, "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": URI_RED}]}]})):
        seeing.calls.clear()
        r = http.post(path, json=body)
        failed = ("event: error", "response.failed", '"error":{', '"error": {', '"error":"', '"error": "')
        assert r.status_code == 200 and not any(f in r.text for f in failed), (path, r.text)
        assert only_call(seeing)[2] == [RED], path


def test_anthropic_tool_result_with_an_image(http, seeing):
    calls = [{"role": "user", "content": "take a screenshot"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]}]
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64_BLUE}}
    for is_error, content, want in ((False, [{"type": "text", "text": "here:"}, shot], f"here:{MARKER}"),
                                    (True, [shot], f"Error: {MARKER}")):
        seeing.calls.clear()
        r = http.post("/v1/messages", json={"max_tokens": 2, "messages": [*calls, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": content, "is_error": is_error}]}]})
        assert r.status_code == 200, r.text
        kind, messages, seen = only_call(seeing)
        assert seen == [BLUE] and messages[-1]["role"] == "tool" and messages[-1]["content"] == want
    r = http.post("/v1/messages/count_tokens", json={"messages": [*calls, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [shot]}]}]})
    assert r.status_code == 400 and "messages.2.content.0.content.0" in r.text and "not counted" in r.text


def test_responses_input_image(http, seeing):
    r = http.post("/v1/responses", json={"max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what"}, {"type": "input_image", "image_url": URI_BLUE, "detail": "auto"}]}]})
    assert r.status_code == 200, r.text
    call = only_call(seeing)
    assert call[2] == [BLUE] and user_content(call) == f"what{MARKER}"
    seeing.calls.clear()  # the stored conversation keeps its image for the next turn
    r = http.post("/v1/responses", json={"max_output_tokens": 2, "input": "and now?",
                                         "previous_response_id": r.json()["id"]})
    assert r.status_code == 200, r.text
    assert only_call(seeing)[2] == [BLUE]


def test_verbose_shows_the_prompt_with_a_marker_per_image(http, seeing):
    r = http.post("/v1/chat/completions", json={"verbose": True, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": URI_RED}}]}]})
    assert r.status_code == 200, r.text
    assert f"hi{MARKER}" in r.json()["__verbose"]["prompt"]
    assert only_call(seeing)[2] == [RED]


def test_apply_template_shows_a_marker_per_image(http, seeing):
    r = http.post("/apply-template", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": URI_RED}}, {"type": "text", "text": "what?"}]}]})
    assert r.status_code == 200, r.text
    assert f"{MARKER}what?" in r.json()["prompt"]
    r = http.post("/apply-template", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@"}}]}]})
    assert r.status_code == 400 and "messages.0.content.0.image_url.url" in r.text
    assert seeing.calls == []


def test_the_marker_is_the_model_side_one():
    from edgeinfer.vision.prompt_images import MARKER as model_marker

    assert MARKER == model_marker


def test_capabilities_say_images_are_taken(http):
    assert http.get("/props").json()["modalities"]["vision"] is True
    assert http.get("/props").json()["media_marker"] == MARKER
    assert "vision" in http.post("/api/show", json={"model": MODEL}).json()["capabilities"]
    assert "multimodal" in http.get("/v1/models").json()["data"][0]["capabilities"]


# -- bad images: a 400 naming the field, and the server stays up -----------------------------------

def chat_image(url: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, **extra}}]}]}


def anthropic_image(source: dict) -> dict:
    return {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}]}


TOO_BIG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 5000).decode()   # over the fixture's 4096 bytes
BOMB = base64.b64encode(png(60000, 60000, rows=b"")).decode()   # a header claiming 3.6 gigapixels
TORN = base64.b64encode(RED[:12]).decode()   # the PNG signature, then half a header


@pytest.mark.parametrize("path,body,field,needle", [
    ("/v1/chat/completions", chat_image("data:image/png;base64,!!notbase64"), "messages.0.content.0.image_url.url",
     "not valid base64"),
    ("/v1/chat/completions", chat_image("data:image/png;base64,"), "messages.0.content.0.image_url.url", "empty"),
    ("/v1/chat/completions", chat_image("data:text/html;base64,aGVsbG8="), "messages.0.content.0.image_url.url",
     "media type"),
    ("/v1/chat/completions", chat_image("data:image/png,rawtext"), "messages.0.content.0.image_url.url", "base64"),
    ("/v1/chat/completions", chat_image("data:image/png;base64," + base64.b64encode(b"hello").decode()),
     "messages.0.content.0.image_url.url", "not an image"),
    ("/v1/chat/completions", chat_image("data:image/png;base64," + TOO_BIG), "messages.0.content.0.image_url.url",
     "4096-byte limit"),
    ("/v1/chat/completions", chat_image("https://example.invalid/cat.png"), "messages.0.content.0.image_url.url",
     "--allow-image-urls"),
    ("/v1/chat/completions", chat_image("file:///etc/passwd"), "messages.0.content.0.image_url.url", "'file' URLs"),
    ("/v1/chat/completions", chat_image(URI_RED, detail="high"), "messages.0.content.0.image_url.detail", "auto"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": URI_RED}}] * (MAX_IMAGES + 1)}]},
     f"messages.0.content.{MAX_IMAGES}.image_url.url", f"at most {MAX_IMAGES} images"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": URI_RED}}]}]}, "messages.1.content", "user messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0", "content part"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "image_url": {"url": URI_RED}}]}]}, "messages", "holds no image_url"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": URI_RED}}]}, {"role": "assistant", "content": "It is"}]},
     "messages", "not supported with images"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["%%%"]}]}, "messages.0.images.0",
     "not valid base64"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": [""]}]}, "messages.0.images.0", "empty"),
    ("/api/chat", {"messages": [{"role": "assistant", "content": "x", "images": [B64_RED]}]}, "messages.0.images",
     "user messages"),
    ("/api/generate", {"prompt": "x", "images": [TOO_BIG]}, "images.0", "4096-byte limit"),
    ("/api/generate", {"prompt": "x", "images": [B64_RED], "suffix": "y"}, "images", "suffix"),
    ("/api/generate", {"prompt": "x", "images": [B64_RED], "context": [1, 2]}, "context", "images"),
    ("/api/generate", {"prompt": "x", "images": [base64.b64encode(b"GIF8").decode()]}, "images.0", "not an image"),
    ("/api/generate", {"prompt": "x", "images": [BOMB]}, "images.0", "megapixel limit"),
    ("/api/generate", {"prompt": "x", "images": [TORN]}, "images.0", "header cannot be read"),
    ("/completion", {"prompt": {"prompt_string": "no marker", "multimodal_data": [B64_RED]}},
     "prompt.multimodal_data", "one image per marker"),
    ("/completion", {"prompt": {"prompt_string": f"{MARKER}", "multimodal_data": ["@@"]}},
     "prompt.multimodal_data.0", "not valid base64"),
    ("/completion", {"prompt": {"prompt_string": f"{MARKER}", "multimodal_data": B64_RED}},
     "prompt.multimodal_data", "list"),
    ("/completion", {"prompt": {"prompt_string": [1, 2], "multimodal_data": [B64_RED]}},
     "prompt.prompt_string", "text"),
    ("/v1/messages", anthropic_image({"type": "base64", "media_type": "text/plain", "data": B64_RED}),
     "messages.0.content.0.source.media_type", "media type"),
    ("/v1/messages", anthropic_image({"type": "base64", "media_type": "image/png", "data": "%"}),
     "messages.0.content.0.source.data", "not valid base64"),
    ("/v1/messages", anthropic_image({"type": "file", "file_id": "f_1"}), "messages.0.content.0.source.type",
     "not supported"),
    ("/v1/messages", anthropic_image({"type": "url", "url": "http://127.0.0.1:1/x.png"}),
     "messages.0.content.0.source.url", "--allow-image-urls"),
    ("/v1/messages", anthropic_image({"type": "base64", "media_type": "image/png", "data": B64_RED, "x": 1}),
     "messages.0.content.0.source.x", "unsupported field"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0].image_url", "base64"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0].file_id", "files"),
    ("/v1/responses", {"truncation": "auto", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": URI_RED}]}]}, "truncation", "images"),
])
def test_bad_images_are_400s_naming_the_field(http, seeing, path, body, field, needle):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    text = r.text
    assert repr(field) in text or f'"{field}"' in text, text
    assert needle in text, text
    assert seeing.calls == []  # refused before any work reached the model
    assert http.get("/health").status_code == 200


def test_the_server_answers_after_bad_images(http, seeing):
    for _ in range(3):
        assert http.post("/api/chat", json={"messages": [{"role": "user", "content": "x", "images": ["!"]}]}
                         ).status_code == 400
    r = http.post("/api/chat", json={"stream": False, "messages": [{"role": "user", "content": "x",
                                                                     "images": [B64_RED]}]})
    assert r.status_code == 200 and only_call(seeing)[2] == [RED]


def test_base64_with_line_breaks_is_read(http, seeing):
    wrapped = "\n".join(B64_RED[i:i + 16] for i in range(0, len(B64_RED), 16))
    r = http.post("/api/generate", json={"prompt": "x", "images": [wrapped], "stream": False})
    assert r.status_code == 200, r.text
    assert only_call(seeing)[2] == [RED]


# -- a model without an mmproj ------------------------------------------------------------------

@pytest.fixture(scope="module")
def blind(tiny):
    srv = start_server(tiny)
    yield srv
    srv.stop()


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", chat_image(URI_RED), "messages.0.content.0.image_url.url"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": [B64_RED]}]}, "messages.0.images.0"),
    ("/api/generate", {"prompt": "x", "images": [B64_RED]}, "images.0"),
    ("/completion", {"prompt": {"prompt_string": MARKER, "multimodal_data": [B64_RED]}}, "prompt.multimodal_data"),
    ("/v1/messages", anthropic_image({"type": "base64", "media_type": "image/png", "data": B64_RED}),
     "messages.0.content.0.source"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": URI_RED}]}]},
     "input[0].content[0].image_url"),
])
def test_a_model_without_mmproj_says_so(blind, path, body, field):
    r = httpx.post(blind.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "has no image input" in r.text and "--mmproj" in r.text and field in r.text, r.text


def test_why_an_image_cannot_be_taken_is_said(tiny, monkeypatch):
    """An mmproj found beside the model that did not load: the model's own line, naming the field."""
    broken = Seeing(tiny)
    broken.images, broken.mmproj_problem = None, "mmproj-x.gguf: the file is truncated"
    srv = start_server(broken)
    try:
        r = httpx.post(srv.url + "/api/generate", json={"prompt": "x", "images": [B64_RED]}, timeout=30)
        assert r.status_code == 400, r.text
        assert "its mmproj did not load: mmproj-x.gguf: the file is truncated" in r.text and "'images.0'" in r.text
        assert broken.calls == []
    finally:
        srv.stop()


def test_capabilities_without_mmproj(blind):
    assert httpx.get(blind.url + "/props").json()["modalities"]["vision"] is False
    assert "vision" not in httpx.post(blind.url + "/api/show", json={"model": MODEL}).json()["capabilities"]
    assert httpx.get(blind.url + "/v1/models").json()["data"][0]["capabilities"] == ["completion"]


# -- remote URLs: refused by default, fetched with --allow-image-urls ----------------------------

class _Images(BaseHTTPRequestHandler):
    """A local stand-in for a web server with images."""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/red.png":
            self._send(200, RED)
        elif self.path == "/big.png":  # over the 4096-byte limit, announced
            self._send(200, RED + b"\0" * 5000)
        elif self.path == "/big-unannounced.png":  # over the limit, no Content-Length
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                self.wfile.write(RED + b"\0" * 5000)
            except OSError:
                pass
        elif self.path == "/slow.png":  # no answer for a second
            time.sleep(1.0)
            self._send(200, RED)
        elif self.path in ("/drip.png", "/long-drip.png"):  # an image a few bytes at a time
            body = RED if self.path == "/drip.png" else RED + b"\0" * 4000
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                for i in range(0, len(body), 8):
                    self.wfile.write(body[i:i + 8])
                    self.wfile.flush()
                    time.sleep(0.02)
            except OSError:  # the client gave up
                pass
        elif self.path == "/page":
            self._send(200, b"<html>not an image</html>")
        elif self.path == "/to-ftp":
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1/red.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/to-red":
            self.send_response(302)
            self.send_header("Location", "/red.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:  # the client stopped reading (a body over its limit)
            pass

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def web():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def fetching(seeing):
    srv = start_server(seeing, max_image_bytes=4096, allow_image_urls=True)
    yield srv
    srv.stop()


def test_urls_are_refused_by_default(http, seeing, web):
    r = http.post("/v1/chat/completions", json=chat_image(web + "/red.png"))
    assert r.status_code == 400 and "--allow-image-urls" in r.text
    assert seeing.calls == []


def test_allowed_urls_are_fetched_within_the_limit(fetching, seeing, web):
    def post(path, body):
        seeing.calls.clear()
        return httpx.post(fetching.url + path, json=body, timeout=30)

    for url in (web + "/red.png", web + "/to-red"):
        r = post("/v1/chat/completions", chat_image(url))
        assert r.status_code == 200, r.text
        assert only_call(seeing)[2] == [RED]
    r = post("/v1/messages", anthropic_image({"type": "url", "url": web + "/red.png"}))
    assert r.status_code == 200 and only_call(seeing)[2] == [RED]
    r = post("/v1/responses", {"max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": web + "/red.png"}]}]})
    assert r.status_code == 200 and only_call(seeing)[2] == [RED]
    for path, needle in (("/big.png", "4096-byte limit"), ("/big-unannounced.png", "4096-byte limit"),
                         ("/missing.png", "HTTP 404"), ("/page", "not an image"), ("/to-ftp", "ftp")):
        r = post("/v1/chat/completions", chat_image(web + path))
        assert r.status_code == 400, (path, r.text)
        assert needle in r.text and "messages.0.content.0.image_url.url" in r.text, (path, r.text)
        assert seeing.calls == []
    # data URIs still work, and a closed port is a 400, not a hang
    assert post("/v1/chat/completions", chat_image(URI_BLUE)).status_code == 200
    r = post("/v1/chat/completions", chat_image("http://127.0.0.1:1/x.png"))
    assert r.status_code == 400 and "cannot fetch" in r.text


# -- the real pieces: a tiny Gemma 3 and its tiny mmproj ----------------------------------------

def _vision_api_landed() -> bool:
    import inspect

    from edgeinfer.api import load

    return "mmproj" in inspect.signature(load).parameters


@pytest.fixture(scope="module")
def gemma_vision(tmp_path_factory):
    if not _vision_api_landed():
        pytest.skip("edgeinfer.load(..., mmproj=) has not landed")
    import edgeinfer
    from image_fixtures import write_gemma3
    from mmproj_factory import write_gemma3_mmproj

    root = tmp_path_factory.mktemp("gemma-vision")
    text = write_gemma3(root / "text.gguf", n_embd=64, seed=3)   # seed 3: its chat answer turns on the image
    mmproj = write_gemma3_mmproj(root / "mmproj.gguf", n_embd_text=64, qtype="F32")
    return edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=256, backend="reference", threads=1)


def test_one_image_through_every_dialect_gives_the_same_greedy_tokens(gemma_vision):
    """The same image and question through OpenAI, llama-server's chat route, Ollama, Anthropic
    and Responses: Model.chat's own answer; through llama-server's /completion and Ollama's raw
    generate: Model.generate's."""
    model, n = gemma_vision, 6
    picture = png(40, 24, (10, 200, 90))
    b64 = base64.b64encode(picture).decode()
    model.reset()
    chat_want = model.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}},
        {"type": "text", "text": "What is this?"}]}], max_tokens=n, temperature=0).text
    model.reset()
    gen_want = model.generate(f"Look: {MARKER} says", images=[picture], max_tokens=n, temperature=0).text
    model.reset()
    other = model.generate(f"Look: {MARKER} says", images=[png(40, 24, (250, 250, 0))], max_tokens=n,
                           temperature=0).text
    model.reset()
    blind_chat = model.chat([{"role": "user", "content": "What is this?"}], max_tokens=n, temperature=0).text
    model.reset()
    assert chat_want != blind_chat and gen_want != other  # the image is what the answers turn on
    srv = start_server(model, sampling={"temperature": 0.0, "max_tokens": n})
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            chats = {
                "openai": c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}},
                    {"type": "text", "text": "What is this?"}]}]}).json()["choices"][0]["message"]["content"],
                "llama-server": c.post("/chat/completions", json={"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": b64}},   # raw base64, as llama-server takes it
                    {"type": "text", "text": "What is this?"}]}]}).json()["choices"][0]["message"]["content"],
                "ollama": c.post("/api/chat", json={"stream": False, "messages": [
                    {"role": "user", "content": "What is this?", "images": [b64]}]}).json()["message"]["content"],
                "anthropic": c.post("/v1/messages", json={"max_tokens": n, "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                    {"type": "text", "text": "What is this?"}]}]}).json()["content"],
                "responses": c.post("/v1/responses", json={"input": [{"role": "user", "content": [
                    {"type": "input_image", "image_url": "data:image/png;base64," + b64},
                    {"type": "input_text", "text": "What is this?"}]}]}).json()["output"],
            }
            chats["anthropic"] = "".join(b.get("text", "") for b in chats["anthropic"])
            chats["responses"] = "".join(p["text"] for item in chats["responses"] for p in item.get("content", [])
                                         if p.get("type") == "output_text")
            assert chats == {k: chat_want for k in chats}
            gens = {
                "completion": c.post("/completion", json={"n_predict": n, "prompt": {
                    "prompt_string": f"Look: {MARKER} says", "multimodal_data": [b64]}}).json()["content"],
                "ollama-raw": c.post("/api/generate", json={"prompt": f"Look: {MARKER} says", "images": [b64],
                                                            "raw": True, "stream": False}).json()["response"],
            }
            assert gens == {k: gen_want for k in gens}
            assert c.get("/props").json()["modalities"]["vision"] is True
    finally:
        srv.stop()


def test_fetch_is_bounded_in_time(web):
    from edgeinfer.server.image_fetch import FetchError, fetch

    assert fetch(web + "/drip.png", 4096) == RED
    with pytest.raises(FetchError, match="timed out"):
        fetch(web + "/slow.png", 4096, timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(FetchError, match="longer than 0.3s"):  # (the whole body takes 10 s)
        fetch(web + "/long-drip.png", 8192, total_s=0.3)
    assert time.monotonic() - t0 < 5
    with pytest.raises(FetchError, match="only http and https"):
        fetch("file:///etc/hostname", 4096)


def test_serve_mmproj_flag(tmp_path, capsys, monkeypatch):
    """serve --mmproj: a missing file is one line and exit 1, before anything loads; given, the
    served model is loaded with it, other local models without it, and bodies may be 32 MiB; a
    model named from the store brings the mmproj beside it ("auto"), unless --no-mmproj."""
    from edgeinfer.cli import main
    from edgeinfer.commands import serve as serve_command

    assert main(["serve", str(tmp_path / "x.gguf"), "--mmproj", str(tmp_path / "nope.gguf")]) == 1
    err = capsys.readouterr().err
    assert "--mmproj: no such file" in err and len(err.strip().splitlines()) == 1

    mmproj = tmp_path / "mmproj.gguf"
    mmproj.write_bytes(b"GGUF")
    seen: dict = {}

    def fake_app(config, loader):
        seen["config"], seen["load"] = config, loader
        raise SystemExit(0)  # stop before uvicorn starts

    monkeypatch.setattr("edgeinfer.server.create_app", fake_app)
    monkeypatch.setattr("edgeinfer.load", lambda name, **kw: kw)
    with pytest.raises(SystemExit):
        serve_command.serve(_serve_args(tmp_path, "--mmproj", str(mmproj), "--allow-image-urls"))
    config = seen["config"]
    assert seen["load"]()["mmproj"] == str(mmproj) and "mmproj" not in config.model_options
    assert config.max_body_bytes == 32 << 20 and config.allow_image_urls
    with pytest.raises(SystemExit):  # a store name: the mmproj beside it, if there is one
        serve_command.serve(_serve_args(tmp_path, name="gemma3:4b"))
    assert seen["load"]()["mmproj"] == "auto" and seen["config"].max_body_bytes == 32 << 20
    assert not seen["config"].allow_image_urls
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    for flags in ((), ("--no-mmproj",)):  # a model file, or --no-mmproj: text only
        with pytest.raises(SystemExit):
            serve_command.serve(_serve_args(tmp_path, *flags, name="gemma3:4b" if flags else None))
        assert "mmproj" not in seen["load"]() and seen["config"].max_body_bytes == 2 << 20
    assert main(["serve", "gemma3:4b", "--no-mmproj", "--mmproj", str(mmproj)]) == 1
    assert "cannot go with --mmproj" in capsys.readouterr().err


def _serve_args(tmp_path, *flags: str, name: str | None = None):
    import argparse

    from edgeinfer.commands import serve as serve_command

    parser = argparse.ArgumentParser()
    serve_command.register(parser.add_subparsers())
    return parser.parse_args(["serve", name or str(tmp_path / "x.gguf"), *flags])


def test_an_image_that_fails_to_decode_is_a_400_and_the_server_goes_on(gemma_vision):
    """A readable header over broken pixel data passes the server's checks and fails where the
    model decodes it: a 400 before any answer, streamed or not, and the next request is served."""
    torn = base64.b64encode(png(8, 8, rows=b"\x00" * 5)).decode()   # too few rows for its header
    srv = start_server(gemma_vision, sampling={"temperature": 0.0, "max_tokens": 2})
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            for stream in (False, True):
                r = c.post("/api/chat", json={"stream": stream, "messages": [
                    {"role": "user", "content": "x", "images": [torn]}]})
                assert r.status_code == 400 and "image" in r.json()["error"], r.text
            r = c.post("/api/chat", json={"stream": False, "messages": [
                {"role": "user", "content": "x", "images": [B64_RED]}]})
            assert r.status_code == 200, r.text
            r = c.post("/v1/messages", json={"max_tokens": 2, "messages": [  # a tool's screenshot
                {"role": "user", "content": "look"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64_RED}}]}]}]})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()
