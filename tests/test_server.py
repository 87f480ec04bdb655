"""The REST server against a real uvicorn on loopback, driven by the official clients.

One tiny random-weight llama (reference backend, n_ctx 256) with FIM tokens serves every
test; outputs are random text, so tests check protocol shapes, counts and behaviour, and
compare against the model's own direct output where the text matters.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

import edgeinfer
from gguf_factory import spm_vocab, write_tiny_model

from edgeinfer.server import ServerConfig, create_app

MODEL = "tiny"
FIM_PIECES = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def fim_vocab() -> dict:
    """spm_vocab plus the three FIM control tokens (found by text, as llama.cpp does)."""
    v = spm_vocab()
    v["tokens"] = v["tokens"] + list(FIM_PIECES)
    v["types"] = v["types"] + [3] * len(FIM_PIECES)
    v["scores"] = v["scores"] + [0.0] * len(FIM_PIECES)
    return v


@pytest.fixture(scope="session")
def fim_model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("srv") / "tiny-fim.gguf", "llama", "F32", vocab=fim_vocab())


def load_tiny(path):
    return edgeinfer.load(str(path), backend="reference", n_ctx=256)


@dataclass
class LiveServer:
    app: object
    server: object
    thread: threading.Thread
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self):
        return self.app.state.server

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve(app, uvicorn_config) -> LiveServer:
    """uvicorn in a thread on a free loopback port; returns once it accepts connections."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    return LiveServer(app, server, thread, port)


def start_server(model, **config) -> LiveServer:
    """The app for `model` (greedy, 8 tokens by default), served by `serve`."""
    import uvicorn

    config.setdefault("model_name", MODEL)
    config.setdefault("sampling", {"temperature": 0.0, "max_tokens": 8})
    app = create_app(ServerConfig(**config), model)
    return serve(app, uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))


@pytest.fixture(scope="module")
def model(fim_model_path):
    return load_tiny(fim_model_path)


@pytest.fixture(scope="module")
def live(model):
    srv = start_server(model)
    yield srv
    srv.stop()


@pytest.fixture()
def http(live):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        yield c


def completion_oracle(model, prompt, **params) -> str:
    """The model's own answer, from an empty cache (the server call that follows starts
    from an empty cache too, so both run exactly the same computation)."""
    model.reset()
    text = model.generate(prompt, temperature=0.0, **params).text
    model.reset()
    return text


# -- ops and metadata -----------------------------------------------------------------------

def test_health_metadata_and_metrics(live, http):
    assert http.get("/health").json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    tags = http.get("/api/tags").json()["models"]
    assert tags[0]["name"] == MODEL and tags[0]["details"]["family"] == "llama"
    assert tags[0]["size"] == live.state.model.path.stat().st_size
    assert http.get("/api/ps").json()["models"][0]["context_length"] == 256
    show = http.post("/api/show", json={"model": MODEL}).json()
    assert "insert" in show["capabilities"] and show["model_info"]["general.architecture"] == "llama"
    assert http.get("/api/version").json()["version"] == edgeinfer.__version__
    assert http.get("/props").json()["default_generation_settings"]["n_ctx"] == 256
    http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    text = http.get("/metrics").text
    assert 'edgeinfer_requests_total{endpoint="/v1/completions",status="200"}' in text
    for name in ("edgeinfer_ttft_seconds_bucket", "edgeinfer_tpot_seconds_bucket", "edgeinfer_queue_depth",
                 "edgeinfer_kv_used_tokens", "edgeinfer_prefix_cache_hit_ratio", "edgeinfer_prompt_tokens_total"):
        assert name in text


def test_health_is_503_while_loading(model):
    srv = start_server(None)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            r = c.get("/health")
            assert (r.status_code, r.json()) == (503, {"status": "loading"})
            r = c.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
            srv.state.set_model(model)
            assert c.get("/health").json() == {"status": "ok"}
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    finally:
        srv.stop()


# -- the official OpenAI client ---------------------------------------------------------------

@pytest.fixture()
def openai_client(live):
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_openai_completion_matches_the_model(model, openai_client):
    expected = completion_oracle(model, "hello world", max_tokens=6)
    r = openai_client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == len(model.tokenize("hello world"))
    # the same prompt again: everything but the last prompt token comes from the cache
    r2 = openai_client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0)
    assert r2.choices[0].text == expected
    assert r2.usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens - 1


def test_openai_completion_stream_equals_non_stream(model, openai_client):
    expected = completion_oracle(model, "the water", max_tokens=7)
    stream = openai_client.completions.create(model=MODEL, prompt="the water", max_tokens=7, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for ev in stream:
        if ev.choices:
            pieces.append(ev.choices[0].text)
            finish = ev.choices[0].finish_reason or finish
        if ev.usage is not None:
            usage = ev.usage
    assert "".join(pieces) == expected and finish == "length"
    assert usage.completion_tokens == 7


def test_openai_chat_and_chat_stream(model, openai_client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    model.reset()
    expected = model.chat(messages, temperature=0.0, max_tokens=5).text
    model.reset()
    r = openai_client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5,
                                              temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected
    stream = openai_client.chat.completions.create(model="default", messages=messages, max_tokens=5,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True})
    text, roles, usage = "", set(), None
    for ev in stream:
        for ch in ev.choices:
            roles.add(ch.delta.role)
            text += ch.delta.content or ""
        usage = ev.usage or usage
    assert text == expected and "assistant" in roles
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # same prompt again


def test_openai_client_sees_errors(openai_client):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        openai_client.completions.create(model="gpt-4o", prompt="x")
    assert "gpt-4o" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model=MODEL, prompt="x", n=17)


# -- the official Ollama client -------------------------------------------------------------------

@pytest.fixture()
def ollama_client(live):
    import ollama

    return ollama.Client(host=live.url)


def test_ollama_generate_raw_matches_the_model(model, ollama_client):
    expected = completion_oracle(model, "hello world", max_tokens=5)
    r = ollama_client.generate(model=MODEL, prompt="hello world", raw=True, stream=False,
                               options={"temperature": 0, "num_predict": 5})
    assert r.response == expected and r.done and r.done_reason == "length"
    assert r.eval_count == 5 and r.prompt_eval_count == len(model.tokenize("hello world"))
    assert r.total_duration >= r.eval_duration > 0 and r.prompt_eval_duration > 0
    parts = list(ollama_client.generate(model=MODEL, prompt="hello world", raw=True, stream=True,
                                        options={"temperature": 0, "num_predict": 5}))
    assert "".join(p.response for p in parts) == expected
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done and parts[-1].eval_count == 5


def test_ollama_chat(model, ollama_client):
    messages = [{"role": "user", "content": "hello"}]
    model.reset()
    expected = model.chat(messages, temperature=0.0, max_tokens=4).text
    model.reset()
    r = ollama_client.chat(model=MODEL + ":latest", messages=messages, options={"temperature": 0, "num_predict": 4})
    assert r.message.content == expected and r.message.role == "assistant" and r.done
    parts = list(ollama_client.chat(model=MODEL, messages=messages, stream=True,
                                    options={"temperature": 0, "num_predict": 4}))
    assert "".join(p.message.content for p in parts) == expected and parts[-1].done


def test_ollama_suffix_is_fill_in_the_middle(model, ollama_client):
    from edgeinfer.server.fim import infill_tokens

    ids = infill_tokens(model.tokenizer, "def add(a, b):\n    return ", "\n", n_ctx=model.n_ctx, n_predict=4)
    expected = completion_oracle(model, ids, max_tokens=4)
    r = ollama_client.generate(model=MODEL, prompt="def add(a, b):\n    return ", suffix="\n", stream=False,
                               options={"temperature": 0, "num_predict": 4})
    assert r.response == expected and r.prompt_eval_count == len(ids)


def test_ollama_client_sees_errors(ollama_client):
    import ollama

    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.generate(model="llama3:8b", prompt="hi")
    assert e.value.status_code == 404 and "llama3:8b" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.generate(model=MODEL, prompt="hi", options={"num_ctx": 100000})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error


# -- llama-server endpoints ------------------------------------------------------------------------

def vscode_infill(prefix: str, suffix: str, extra: list[dict]) -> dict:
    """What llama.vscode sends on a keystroke (its request shape, our tiny sizes)."""
    return {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": "",
            "n_predict": 4, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 500,
            "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "timings/cache_n",
                                "tokens_cached", "truncated"]}


def test_infill_like_llama_vscode_reuses_the_cache(model, http):
    from edgeinfer.server.fim import infill_tokens

    prefix = "def add(a, b):\n    return a + b\n\nprint(add("
    suffix = "))\n"
    extra = [{"filename": "util.py", "text": "import os\n"}]
    # a generous time budget: at 500 ms a loaded CI machine stops at the first newline (that
    # budget has its own test in test_server_fields.py); here all 4 tokens must come, so the
    # sampling is seeded (unseeded, the tiny model's first token was sometimes its end token)
    r = http.post("/infill", json={**vscode_infill(prefix, suffix, extra), "t_max_predict_ms": 60_000, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"content", "timings/prompt_n", "timings/predicted_n", "timings/cache_n",
                         "tokens_cached", "truncated"}
    assert body["timings/predicted_n"] == 4
    ids = infill_tokens(model.tokenizer, prefix + "1", suffix, extra=[("util.py", "import os\n")],
                        n_ctx=model.n_ctx, n_predict=4)
    # the next keystroke: only the tail after the edit is evaluated again
    r = http.post("/infill", json=vscode_infill(prefix + "1", suffix, extra)).json()
    assert r["timings/cache_n"] >= len(model.tokenize(prefix, add_special=False)) - 1
    assert r["timings/prompt_n"] + r["timings/cache_n"] == len(ids)
    assert r["timings/prompt_n"] < 10


def test_infill_without_fim_tokens_is_a_clear_400(tiny_models):
    srv = start_server(load_tiny(tiny_models["llama"]))
    try:
        r = httpx.post(srv.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 400 and "FIM" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_completion_tokenize_detokenize_template(model, http):
    expected = completion_oracle(model, "hello", max_tokens=3)
    r = http.post("/completion", json={"prompt": "hello", "n_predict": 3, "temperature": 0}).json()
    assert r["content"] == expected and r["stop"] is True and r["timings"]["predicted_n"] == 3
    r = http.post("/completion", json={"prompt": "hello", "n_predict": 3, "temperature": 0, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == expected
    assert events[-1]["stop"] is True and "timings" in events[-1]
    toks = http.post("/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert toks == model.tokenize("hello world", add_special=False, parse_special=True)
    pieces = http.post("/tokenize", json={"content": "hello", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces).strip() == "hello"
    assert http.post("/detokenize", json={"tokens": toks}).json()["content"] == model.detokenize(toks)
    msgs = [{"role": "user", "content": "hi"}]
    assert http.post("/apply-template", json={"messages": msgs}).json()["prompt"] == model.apply_chat_template(msgs)


# -- bad input: the right 4xx, in the caller's error shape, and the server keeps serving ------

BIG = "x" * (3 << 20)
BAD_REQUESTS = [
    # (path, raw body, status, text the message must contain)
    ("/v1/chat/completions", b'{"messages": [', 400, "malformed JSON"),
    ("/v1/chat/completions", b"", 400, "empty"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "'n'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 10**6}, 400, "'n'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 7}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": -0.1}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hello " * 300}, 400, "context"),
    ("/v1/completions", {"prompt": [2**40]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5000]}, 400, "out of range"),
    ("/v1/completions", {"prompt": BIG}, 413, "larger than"),
    ("/api/generate", b"{not json", 400, "malformed JSON"),
    ("/api/generate", {"model": "mistral", "prompt": "hi"}, 404, "mistral"),
    ("/api/generate", {"prompt": "hi", "options": {"top_k": -1}}, 400, "top_k"),
    ("/api/generate", {"prompt": "hi", "options": {"num_predict": -3}}, 400, "num_predict"),
    ("/api/generate", {"prompt": "hi", "options": {"temperature": "warm"}}, 400, "temperature"),
    ("/api/generate", {"prompt": "hi", "format": "yaml"}, 400, "format"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["abc"]}]}, 400, "images"),
    ("/api/show", {"model": "../../etc/passwd"}, 404, "not found"),
    ("/completion", {"prompt": "hi", "n_keep": -5}, 400, "n_keep"),
    ("/completion", {"prompt": "hi", "n_keep": -1}, 400, "n_keep"),
    ("/completion", {"prompt": "hi", "top_k": -1}, 400, "top_k"),
    ("/completion", {"prompt": "hi", "n_predict": -2}, 400, "n_predict"),
    ("/infill", {"input_prefix": 5}, 400, "input_prefix"),
    ("/infill", {"input_prefix": "a", "input_extra": [{"filename": "x", "text": 3}]}, 400, "input_extra"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, 400, "out of range"),
    ("/tokenize", {"content": None}, 400, "content"),
]


def error_message(path: str, body: dict) -> str:
    if path.startswith("/api/"):
        assert isinstance(body["error"], str)  # Ollama's shape
        return body["error"]
    err = body["error"]
    assert {"message", "type"} <= set(err)
    if path.startswith("/v1/"):
        assert {"param", "code"} <= set(err)  # OpenAI's shape
    return err["message"]


@pytest.mark.parametrize("path,body,status,needle", BAD_REQUESTS,
                         ids=[f"{p}-{s}-{n}" for p, _, s, n in BAD_REQUESTS])
def test_bad_input_gets_the_right_4xx(http, path, body, status, needle):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    message = error_message(path, r.json())
    assert needle in message and "\n" not in message and "Traceback" not in message
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_chunked_body_over_the_limit_is_413(http):
    def chunks():
        for _ in range(4):
            yield b" " * (1 << 20)

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("host,status", [("localhost:11434", 200), ("127.0.0.1", 200), ("[::1]:8080", 200),
                                         ("evil.example", 403), ("evil.example:11434", 403),
                                         ("localhost.evil.example", 403), ("127.0.0.1.nip.io", 403)])
def test_host_allow_list(http, host, status):
    r = http.get("/v1/models", headers={"host": host})
    assert r.status_code == status
    if status == 403:
        assert "not allowed" in r.json()["error"]["message"]


def test_foreign_origin_is_refused_and_a_loopback_page_gets_cors(http):
    r = http.post("/api/generate", json={"prompt": "hi"}, headers={"origin": "https://evil.example"})
    assert r.status_code == 403 and "origin" in r.json()["error"]
    r = http.get("/v1/models", headers={"origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_api_key_cors_and_configured_host(model):
    import openai

    srv = start_server(model, api_key="s3cret", cors_origins=["https://chat.example"],
                       allowed_hosts=["box.lan"])
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert c.get("/health").status_code == 200  # open without the key
            r = c.get("/v1/models")
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert c.get("/api/tags", headers={"authorization": "Bearer wrong"}).status_code == 401
            assert c.get("/metrics").status_code == 401
            ok = {"authorization": "Bearer s3cret"}
            assert c.get("/api/tags", headers=ok).status_code == 200
            assert c.get("/api/tags", headers={**ok, "host": "box.lan:11434"}).status_code == 200
            pre = c.options("/v1/chat/completions", headers={
                "origin": "https://chat.example", "access-control-request-method": "POST",
                "access-control-request-headers": "authorization,content-type"})
            assert pre.status_code == 200
            assert pre.headers["access-control-allow-origin"] == "https://chat.example"
            r = c.get("/v1/models", headers={**ok, "origin": "https://chat.example"})
            assert r.headers["access-control-allow-origin"] == "https://chat.example"
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        srv.stop()


# -- timeouts and disconnects ---------------------------------------------------------------------

def test_timeout_gives_504_and_the_server_recovers(model):
    srv = start_server(model, timeout_s=0.15, sampling={"temperature": 0.0})
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5000})
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
            r = c.post("/api/generate", json={"prompt": "hello", "raw": True, "options": {"num_predict": 5000}})
            lines = [json.loads(x) for x in r.text.splitlines()]
            assert lines[-1] == {"error": "the request timed out"}
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    finally:
        srv.stop()


def metric(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_disconnect_cancels_the_generation(live, http):
    cancelled = metric(http, "edgeinfer_generations_cancelled_total")
    generated = metric(http, "edgeinfer_generated_tokens_total")
    with httpx.Client(base_url=live.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 200,
                                                       "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 3:
                    break
    deadline = time.monotonic() + 5
    while metric(http, "edgeinfer_generations_cancelled_total") == cancelled:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.02)
    # it stopped long before its 200 tokens
    assert metric(http, "edgeinfer_generated_tokens_total") - generated < 100
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_stop_seed_and_ollama_extras_pass_through(model, openai_client, ollama_client):
    expected = completion_oracle(model, "hello world", max_tokens=8)
    k = next((i for i in range(1, len(expected)) if expected[i].isalpha() and expected[i] not in expected[:i]), None)
    if k is not None:  # stop at a letter that first appears at position k: the text ends before it
        r = openai_client.completions.create(model=MODEL, prompt="hello world", max_tokens=8, temperature=0,
                                             stop=[expected[k]])
        assert (r.choices[0].text, r.choices[0].finish_reason) == (expected[:k], "stop")
    sampled = [openai_client.completions.create(model=MODEL, prompt="the", max_tokens=8, temperature=1.0,
                                                seed=1234, top_p=0.9).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    r = ollama_client.generate(model=MODEL, prompt="hello", keep_alive="5m", options={"num_predict": 2})
    assert r.done and r.eval_count == 2
    r = ollama_client.generate(model=MODEL, prompt="")  # Ollama's "load the model" call
    assert r.done and r.done_reason == "load"
    r = ollama_client.generate(model=MODEL, prompt="", keep_alive=0)  # `ollama stop`
    assert r.done and r.done_reason == "unload"


def test_prefix_cache_hit_ratio_moves_with_requests_sharing_a_prefix(model, live, http):
    """Two requests sharing a long prefix: the second reuses the first's blocks, and /metrics and
    the pools' own lookup counts (the session stats) both show it."""
    sessions = model.sessions
    before = sessions.stats()
    shared = "one two three four five six seven eight nine ten " * 2
    for tail in ("eleven", "twelve"):
        r = http.post("/v1/completions", json={"prompt": shared + tail, "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert metric(http, "edgeinfer_prefix_cache_hit_ratio") > 0
    after = sessions.stats()
    assert after["hits"] > before["hits"] and after["queries"] > before["queries"]
    assert 0 < after["hit_rate"] <= 1
    assert all(g.pool.hits > 0 for g in sessions.cache.groups)  # each pool counts its own lookups
