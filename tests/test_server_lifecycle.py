"""The server's lifecycle and connections: load failures, disconnects, Host parsing, the access
log, slow clients, and Ollama's keep_alive (unload, reload, expiry).

Servers are real uvicorn instances on a free 127.0.0.1 port with small limits, driven by
raw sockets where the timing of bytes matters; every wait is bounded.
"""

from __future__ import annotations

import gc
import io
import json
import logging
import socket
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest

from edgeinfer.results import GenerationChunk, Timings, Usage
from edgeinfer.server import ServerConfig, access_log, create_app
from edgeinfer.server.http_protocol import uvicorn_config
from edgeinfer.server.keep_alive import FOREVER, parse_duration
from edgeinfer.server.security import BadHost, SecurityMiddleware, parse_host
from test_server import LiveServer, fim_model_path, load_tiny, serve  # noqa: F401 - a fixture

MODEL = "tiny"


# -- a fast fake model: tokens flow every 2 ms until cancelled --------------------------------

class FakeTokenizer:
    vocab_size = 100

    def detokenize(self, ids, as_pieces=False):
        return "a" * len(ids)


class FakeModel:
    """Streams one token every 2 ms (up to `limit`), stopping at once when cancelled; records
    when it stopped and how many tokens it made."""

    n_ctx = 256
    template = None

    def __init__(self, limit: int = 2500) -> None:
        self.limit = limit
        self.path = Path("fake.gguf")
        self.tokenizer = FakeTokenizer()
        self.runs: list[dict] = []

    def generate(self, prompt, stream=True, cancel=None, max_tokens=None, **_params):
        run = {"started": time.monotonic(), "stopped": None, "tokens": 0, "cancelled": False}
        self.runs.append(run)
        limit = self.limit if max_tokens in (None, -1) else max_tokens
        t0 = time.perf_counter()
        finish = "length"
        for _ in range(limit):
            if cancel is not None and cancel.is_set():
                finish, run["cancelled"] = "cancelled", True
                break
            time.sleep(0.002)
            run["tokens"] += 1
            yield GenerationChunk(text="a", token=1)
        run["stopped"] = time.monotonic()
        yield GenerationChunk(text="", token=None, finish_reason=finish,
                              usage=Usage(prompt_tokens=3, completion_tokens=run["tokens"]),
                              timings=Timings.from_clock(t0, t0, time.perf_counter(), 3, run["tokens"]))

    def chat(self, messages, **kw):
        return self.generate("", **kw)

    def tokenize(self, text, add_special=True, parse_special=False):
        return [1] * max(1, len(text))


# -- servers -------------------------------------------------------------------------------------

def serve_app(app, **limits) -> LiveServer:
    """uvicorn with edgeinfer's protocol on a free loopback port (log_config=None: uvicorn's
    records reach pytest's caplog)."""
    return serve(app, uvicorn_config(app, log_config=None, **limits))


def fake_app(model=None, **config):
    config.setdefault("model_name", MODEL)
    return create_app(ServerConfig(**config), model if model is not None else FakeModel())


@pytest.fixture()
def fake_live():
    srv = serve_app(fake_app())
    yield srv
    srv.stop()


def raw_request(method: str, path: str, body: dict | None = None, host: str = "localhost") -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n" \
           f"Content-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


def recv_all(sock: socket.socket, limit_s: float = 5.0) -> bytes:
    """Everything until the server closes (or limit_s passes)."""
    sock.settimeout(limit_s)
    out = b""
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline:
            part = sock.recv(65536)
            if not part:
                break
            out += part
    except (socket.timeout, ConnectionResetError):
        pass
    return out


# -- 1. any load failure ends `serve` with one line ---------------------------------------------

@pytest.fixture()
def restore_access_logger():
    logger = logging.getLogger("edgeinfer.access")
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    yield
    logger.handlers[:] = handlers
    logger.propagate, logger.level = propagate, level
    access_log._installed = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("exc", [ValueError("tensor blk.0.attn_q has a bad shape"),
                                 KeyError("llama.block_count"), MemoryError("out of memory")])
def test_serve_exits_1_with_one_line_on_any_load_failure(monkeypatch, capsys, tmp_path, exc,
                                                          restore_access_logger):
    import edgeinfer
    from edgeinfer.cli import main

    def fail(*_a, **_kw):
        raise exc

    monkeypatch.setattr(edgeinfer, "load", fail)
    name = str(tmp_path / "m.gguf")
    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(main(["serve", name, "--port", str(free_port())])),
                         daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(20)
    assert done, "serve kept running after the load failed"
    assert time.monotonic() - t0 < 20
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("edgeinfer: error:")]
    assert done[0] == 1 and lines == [f"edgeinfer: error: failed to load {name}: {type(exc).__name__}: {exc}"]
    assert "Traceback" not in err


# -- 2. a client that leaves stops its generation, streamed or not, in every dialect ----------------

DISCONNECT_CASES = [
    ("/v1/completions", {"prompt": "hi", "stream": False}),
    ("/v1/completions", {"prompt": "hi", "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": False}),
    ("/api/generate", {"prompt": "hi", "stream": False}),
    ("/api/generate", {"prompt": "hi", "stream": True}),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False}),
    ("/completion", {"prompt": "hi", "stream": False}),
    ("/completion", {"prompt": "hi", "stream": True}),
]


@pytest.mark.parametrize("path,body", DISCONNECT_CASES)
def test_disconnect_stops_the_generation_within_half_a_second(fake_live, path, body):
    model = fake_live.state.model
    with socket.create_connection(("127.0.0.1", fake_live.port), timeout=5) as s:
        s.sendall(raw_request("POST", path, body))
        deadline = time.monotonic() + 5
        while not model.runs or model.runs[-1]["tokens"] < 50:  # tokens are flowing fast
            assert time.monotonic() < deadline, "the generation did not start"
            time.sleep(0.01)
    closed = time.monotonic()
    run = model.runs[-1]
    deadline = closed + 3
    while run["stopped"] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run["cancelled"] and run["stopped"] is not None, "the generation ran on after the client left"
    assert run["stopped"] - closed < 0.5
    # the next request is served at once, not after the abandoned one
    r = httpx.post(fake_live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=5)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# -- 3. strict Host parsing -----------------------------------------------------------------------

@pytest.mark.parametrize("header,expected", [
    ("localhost", ("localhost", None)), ("localhost:11434", ("localhost", 11434)),
    ("LOCALHOST:80", ("localhost", 80)), ("127.0.0.1:8080", ("127.0.0.1", 8080)),
    ("[::1]:11434", ("::1", 11434)), ("[::1]", ("::1", None)), ("example.com.", ("example.com", None)),
    ("localhost:80@evil.example", BadHost), ("[::1]evil.example", BadHost), ("localhost:abc", BadHost),
    ("localhost:99999", BadHost), ("localhost:0", BadHost), ("localhost:", BadHost), ("[::1]:", BadHost),
    ("local host", BadHost), ("user@localhost", BadHost), ("localhost/path", BadHost),
    ("localhost:80/x", BadHost), ("", BadHost), (":80", BadHost), ("[evil.example]", BadHost),
    ("[::1", BadHost), ("localhost:+80", BadHost), ("localhost:1:2", BadHost), ("a..b", BadHost),
])
def test_parse_host(header, expected):
    if expected is BadHost:
        with pytest.raises(BadHost):
            parse_host(header)
    else:
        assert parse_host(header) == expected


@pytest.mark.parametrize("header,status", [
    ("localhost", None), ("localhost:11434", None), ("127.0.0.1:8080", None), ("[::1]:11434", None),
    ("[::1]", None), ("localhost:80@evil.example", 400), ("[::1]evil.example", 400),
    ("localhost:abc", 400), ("localhost:99999", 400), ("localhost:", 400), ("evil.example", 403),
    ("evil.example:11434", 403),
])
def test_host_check_refuses_with_one_line(header, status):
    refusal = SecurityMiddleware(None).check("GET", "/api/tags", {"host": header})
    if status is None:
        assert refusal is None
    else:
        assert refusal[0] == status and "\n" not in refusal[1] and "host" in refusal[1].lower()


def test_host_is_checked_on_the_wire(fake_live):
    with socket.create_connection(("127.0.0.1", fake_live.port), timeout=5) as s:
        s.sendall(raw_request("GET", "/api/version", host="localhost:80@evil.example"))
        reply = recv_all(s, 2)
    assert reply.startswith(b"HTTP/1.1 400") and b"malformed Host header" in reply


# -- 4. a body cut short is one log line ------------------------------------------------------------

def test_client_leaving_mid_body_logs_one_line(fake_live, caplog):
    caplog.set_level(logging.INFO)
    with socket.create_connection(("127.0.0.1", fake_live.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": \"he")
        time.sleep(0.2)
    deadline = time.monotonic() + 3
    while not any("disconnected while sending" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "nothing logged"
        time.sleep(0.02)
    time.sleep(0.2)  # anything else would follow now
    server_records = [r for r in caplog.records if not r.name.startswith("edgeinfer.access")]
    assert [r.getMessage() for r in server_records if "disconnected" in r.getMessage()] == \
        ["POST /v1/completions: the client disconnected while sending the request body"]
    assert not [r for r in server_records if r.exc_info or r.levelno >= logging.ERROR]


# -- 5. the access log ----------------------------------------------------------------------------

def access_records(caplog) -> list[dict]:
    return [r.access for r in caplog.records if r.name == "edgeinfer.access"]


def test_access_log_one_line_per_request(fake_live, caplog):
    caplog.set_level(logging.INFO, logger="edgeinfer.access")
    with httpx.Client(base_url=fake_live.url, timeout=10) as c:
        c.get("/health")
        c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        with c.stream("POST", "/api/generate", json={"prompt": "hi", "options": {"num_predict": 5}}) as r:
            assert len(list(r.iter_lines())) == 6  # 5 tokens and the final object
        c.get("/api/version", headers={"host": "evil.example"})
    deadline = time.monotonic() + 3
    while len(access_records(caplog)) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    health, whole, stream, refused = access_records(caplog)
    assert (health["method"], health["path"], health["status"], health["prompt_tokens"]) == \
        ("GET", "/health", 200, None)
    assert (whole["path"], whole["status"], whole["prompt_tokens"], whole["completion_tokens"]) == \
        ("/v1/completions", 200, 3, 4)
    assert (stream["path"], stream["status"], stream["completion_tokens"]) == ("/api/generate", 200, 5)
    assert stream["duration_s"] >= 5 * 0.002  # logged when the stream ended, not when it began
    assert (refused["status"], refused["completion_tokens"]) == (403, None)
    assert all(r["client"] == "127.0.0.1" and r["time"].endswith("Z") for r in (health, whole, stream))
    line = next(r.getMessage() for r in caplog.records if r.name == "edgeinfer.access" and
                "/v1/completions" in r.getMessage())
    assert "| 200 |" in line and 'POST    "/v1/completions"' in line and "prompt 3 | generated 4" in line


def test_access_log_json_format(fake_live, restore_access_logger):
    buf = io.StringIO()
    access_log.configure("json", buf)
    httpx.post(fake_live.url + "/api/generate", json={"prompt": "hi", "stream": False,
                                                      "options": {"num_predict": 2}}, timeout=10)
    deadline = time.monotonic() + 3
    while not buf.getvalue():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    obj = json.loads(buf.getvalue().splitlines()[0])
    assert {k: obj[k] for k in ("method", "path", "status", "prompt_tokens", "completion_tokens")} == \
        {"method": "POST", "path": "/api/generate", "status": 200, "prompt_tokens": 3, "completion_tokens": 2}
    assert set(obj) == {"time", "client", "method", "path", "status", "duration_s", "prompt_tokens",
                        "completion_tokens"}
    with pytest.raises(ValueError):
        access_log.configure("xml")


def test_uvicorn_access_log_is_off():
    assert uvicorn_config(fake_app()).access_log is False


# -- 6. slow clients ----------------------------------------------------------------------------------

@pytest.fixture()
def strict_live():
    srv = serve_app(fake_app(), read_timeout_s=1.0, idle_timeout_s=1.0)
    yield srv
    srv.stop()


def dribble(sock: socket.socket, data: bytes, every_s: float, limit_s: float) -> tuple[bytes, float]:
    """Send `data` a byte at a time; return (what came back, seconds until the server hung up)."""
    t0 = time.monotonic()
    sock.settimeout(every_s)
    reply = b""
    for i in range(len(data)):
        if time.monotonic() - t0 > limit_s:
            break
        try:
            sock.send(data[i:i + 1])
            part = sock.recv(65536)
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return reply, time.monotonic() - t0
        if not part:
            return reply, time.monotonic() - t0
        reply += part
    return reply + recv_all(sock, 0.5), time.monotonic() - t0


def test_headers_sent_byte_by_byte_are_cut_off(strict_live):
    head = b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", strict_live.port), timeout=5) as s:
        reply, took = dribble(s, head, 0.05, 5.0)
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 1s" in reply
    assert 0.8 < took < 3.0


def test_a_body_sent_too_slowly_is_cut_off(strict_live):
    with socket.create_connection(("127.0.0.1", strict_live.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 200\r\n\r\n")
        reply, took = dribble(s, b'{"prompt": "' + b"a" * 186 + b'"}', 0.05, 5.0)
    assert reply.startswith(b"HTTP/1.1 408")
    assert 0.8 < took < 3.0


def test_idle_and_silent_connections_are_closed(strict_live):
    with socket.create_connection(("127.0.0.1", strict_live.port), timeout=5) as s:
        s.sendall(raw_request("GET", "/health"))
        s.settimeout(5)
        first = b""
        while not first.endswith(b'"ok"}'):
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert recv_all(s, 5) == b""  # kept alive, then closed when idle
        assert 0.5 < time.monotonic() - t0 < 3.0
    with socket.create_connection(("127.0.0.1", strict_live.port), timeout=5) as s:
        t0 = time.monotonic()
        assert recv_all(s, 5) == b""  # connected, never said a word
        assert 0.5 < time.monotonic() - t0 < 3.0


def test_prompt_clients_are_unaffected_by_the_deadline(strict_live):
    with httpx.Client(base_url=strict_live.url, timeout=10) as c:
        # a generation longer than the read deadline: the deadline is for reading, not answering
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 700})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 700
        for _ in range(3):  # the same kept-alive connection, request after request
            assert c.get("/health").status_code == 200


# -- 7. keep_alive --------------------------------------------------------------------------------

@pytest.mark.parametrize("value,seconds", [
    ("5m", 300.0), ("1h30m", 5400.0), ("10s", 10.0), ("250ms", 0.25), ("1.5h", 5400.0), ("0", 0.0),
    (0, 0.0), (30, 30.0), (2.5, 2.5), ("300", 300.0), (-1, FOREVER), ("-1m", FOREVER), ("-5", FOREVER),
])
def test_parse_duration(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["", "forever", "5x", "m", "1h 30m", "--1s", "nan", "inf", "1e400",
                                   float("nan"), float("inf"), 1e300, True, None, [5]])
def test_parse_duration_refuses(value):
    with pytest.raises(ValueError):
        parse_duration(value)


class Loads:
    """A loader that loads the tiny model and remembers how often it ran."""

    def __init__(self, path) -> None:
        self.path, self.count = path, 0

    def __call__(self):
        self.count += 1
        return load_tiny(self.path)


@pytest.fixture()
def tiny_live(fim_model_path):
    loads = Loads(fim_model_path)
    app = create_app(ServerConfig(model_name=MODEL, sampling={"temperature": 0.0, "max_tokens": 2}), loader=loads)
    app.state.server.set_model(loads())
    srv = serve_app(app)
    srv.loads = loads
    yield srv
    srv.stop()


def ps(c) -> list[dict]:
    return c.get("/api/ps").json()["models"]


def test_keep_alive_0_unloads_frees_and_the_next_request_reloads(tiny_live):
    state, loads = tiny_live.state, tiny_live.loads
    first = weakref.ref(state.model)
    with httpx.Client(base_url=tiny_live.url, timeout=30) as c:
        assert ps(c)[0]["expires_at"] == "9999-12-31T23:59:59Z"  # the default: for ever
        r = c.post("/api/generate", json={"model": MODEL, "prompt": "hi", "raw": True, "stream": False,
                                          "keep_alive": 0, "options": {"num_predict": 2}})
        assert r.status_code == 200 and r.json()["eval_count"] == 2
        assert c.get("/api/ps").json() == {"models": []}
        gc.collect()
        assert first() is None, "the unloaded model is still referenced"
        assert c.get("/health").json() == {"status": "ok", "model": "unloaded"}
        r = c.post("/v1/completions", json={"prompt": "hi"})  # loads it again, then answers
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert loads.count == 2 and len(ps(c)) == 1
        assert c.get("/health").json() == {"status": "ok"}


def test_ollama_stop_unloads_without_loading(tiny_live):
    loads = tiny_live.loads
    with httpx.Client(base_url=tiny_live.url, timeout=30) as c:
        for _ in range(2):  # the second finds it unloaded and leaves it so
            r = c.post("/api/generate", json={"model": MODEL, "prompt": "", "keep_alive": 0})
            assert r.json()["done_reason"] == "unload"
            assert ps(c) == []
        assert loads.count == 1
        r = c.post("/api/chat", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "stream": False})
        assert r.status_code == 200 and loads.count == 2
        r = c.post("/api/chat", json={"model": MODEL, "messages": [], "keep_alive": "0s"})
        assert r.json()["done_reason"] == "unload" and ps(c) == []


def test_keep_alive_duration_expires_and_ps_says_when(tiny_live):
    with httpx.Client(base_url=tiny_live.url, timeout=30) as c:
        t0 = time.time()
        r = c.post("/api/generate", json={"model": MODEL, "prompt": "hi", "stream": False, "keep_alive": "1s"})
        assert r.status_code == 200
        from datetime import datetime

        expires = datetime.fromisoformat(ps(c)[0]["expires_at"].replace("Z", "+00:00")).timestamp()
        assert t0 + 0.5 < expires < time.time() + 1.01
        deadline = time.monotonic() + 5
        while ps(c):
            assert time.monotonic() < deadline, "the model was not unloaded after its keep_alive"
            time.sleep(0.05)
        assert time.time() - t0 > 0.9
        # a request without keep_alive gets the server default again (for ever)
        assert c.post("/api/generate", json={"prompt": "hi", "stream": False}).status_code == 200
        assert ps(c)[0]["expires_at"] == "9999-12-31T23:59:59Z"


def test_server_default_keep_alive(fim_model_path):
    loads = Loads(fim_model_path)
    app = create_app(ServerConfig(model_name=MODEL, sampling={"max_tokens": 1}, keep_alive_s=0.3), loader=loads)
    app.state.server.set_model(loads())
    srv = serve_app(app)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
            deadline = time.monotonic() + 5
            while ps(c):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
            assert loads.count == 2
    finally:
        srv.stop()


@pytest.mark.parametrize("raw", ['"garbage"', '"5x"', "1e300", "NaN", "Infinity", '"nan"', "true", "[1]"])
def test_bad_keep_alive_is_a_400_naming_it(fake_live, raw):
    for path, extra in (("/api/generate", '"prompt": "hi"'), ("/api/chat", '"messages": []')):
        r = httpx.post(fake_live.url + path, content=f'{{{extra}, "keep_alive": {raw}}}',
                       headers={"content-type": "application/json"}, timeout=5)
        assert r.status_code == 400 and "keep_alive" in r.json()["error"], (path, raw, r.text)


@pytest.mark.parametrize("flag,ok", [("5m", True), ("-1", True), ("0", True), ("soon", False), ("nan", False)])
def test_serve_keep_alive_flag(flag, ok, capsys):
    from edgeinfer.cli import build_parser

    if ok:
        build_parser().parse_args(["serve", "x.gguf", "--keep-alive", flag])
        return
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "x.gguf", "--keep-alive", flag])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--keep-alive" in err and len(err.strip().splitlines()) <= 2
