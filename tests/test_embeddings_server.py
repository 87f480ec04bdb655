"""The embeddings endpoints against a live server, through the official `openai` and `ollama`
clients (and plain HTTP for llama-server's forms): vectors equal the library's, strict
bodies, one-line 4xx answers."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from gguf_factory_embed import write_tiny_encoder
from test_server import MODEL, http, live  # noqa: F401 - the live server fixtures, over this module's model

import edgeinfer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_encoder(tmp_path_factory.mktemp("embsrv") / "nomic.gguf", "nomic-bert", pooling=1)
    return edgeinfer.load(str(path), backend="reference", n_ctx=32)


def test_openai_client(live, model):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
    texts = ["hello world", "def f(x): return x"]
    got = client.embeddings.create(model=MODEL, input=texts)
    want = model.embed(texts)
    assert [d.index for d in got.data] == [0, 1]
    np.testing.assert_allclose([d.embedding for d in got.data], want, atol=1e-6)
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(model.tokenize(t)) for t in texts)
    # (the client itself asks for base64 and decodes it: the first call above)
    b64 = client.embeddings.create(model=MODEL, input="hello world", encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(b64.data[0].embedding), "<f4")  # asked for: left encoded
    np.testing.assert_allclose(decoded, want[0], atol=1e-6)
    short = client.embeddings.create(model=MODEL, input="hello world", dimensions=16, encoding_format="float")
    assert len(short.data[0].embedding) == 16
    np.testing.assert_allclose(np.linalg.norm(short.data[0].embedding), 1.0, rtol=1e-5)
    ids = model.tokenize("hello world")
    by_ids = client.embeddings.create(model=MODEL, input=[ids])
    np.testing.assert_allclose(by_ids.data[0].embedding, want[0], atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="more than"):
        client.embeddings.create(model=MODEL, input="hello world " * 40)


def test_ollama_client(live, model):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=live.url)
    got = client.embed(model=MODEL, input=["hello world", "the code"])
    np.testing.assert_allclose(got.embeddings, model.embed(["hello world", "the code"]), atol=1e-6)
    assert got.prompt_eval_count == len(model.tokenize("hello world")) + len(model.tokenize("the code"))
    one = client.embed(model=MODEL, input="hello world", dimensions=8, keep_alive="5m", options={"num_ctx": 32})
    assert len(one.embeddings) == 1 and len(one.embeddings[0]) == 8
    long = client.embed(model=MODEL, input="hello world " * 40)   # truncated by default, as Ollama
    assert len(long.embeddings[0]) == model.config.n_embd
    with pytest.raises(ollama.ResponseError, match="more than"):
        client.embed(model=MODEL, input="hello world " * 40, truncate=False)
    legacy = client.embeddings(model=MODEL, prompt="hello world")
    raw = model.embed("hello world", normalize=False)[0]
    np.testing.assert_allclose(legacy.embedding, raw, atol=1e-5)


def test_llama_server_forms(http, model):
    want = model.embed("hello world")[0]
    for path in ("/embedding", "/embeddings"):
        r = http.post(path, json={"content": "hello world"})
        assert r.status_code == 200
        body = r.json()
        assert body[0]["index"] == 0
        np.testing.assert_allclose(body[0]["embedding"][0], want, atol=1e-6)
    raw = http.post("/embedding", json={"content": "hello world", "embd_normalize": -1}).json()
    np.testing.assert_allclose(raw[0]["embedding"][0], model.embed("hello world", normalize=False)[0], atol=1e-5)


@pytest.mark.parametrize("path,body,message", [
    ("/v1/embeddings", {"input": "hi", "bogus": 1}, "unsupported field 'bogus'"),
    ("/v1/embeddings", {"input": ""}, "empty"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 100000}, "dimensions"),
    ("/v1/embeddings", {"input": [[1, 2, 999999]]}, "out of range"),
    ("/api/embed", {"model": MODEL, "input": "hi", "options": {"num_ctx": 99999}}, "num_ctx"),
    ("/api/embed", {"model": "nope", "input": "hi"}, "not found"),
    ("/embedding", {}, "content"),
])
def test_bad_requests_are_one_line_4xx(http, path, body, message):
    r = http.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    line = error["message"] if isinstance(error, dict) else error   # OpenAI's object, Ollama's string
    assert message in line and "\n" not in line


def test_ollama_empty_input_embeds_nothing(http):
    r = http.post("/api/embed", json={"model": MODEL, "input": []})
    assert r.status_code == 200 and r.json()["embeddings"] == []
    assert http.post("/api/embeddings", json={"model": MODEL, "prompt": ""}).json() == {"embedding": []}
