"""llama-server's dialect as llama.cpp's own server tests exercise it (issue 37): unprefixed
routes, its fields on the OpenAI routes, logit_bias, `serve -n`, /apply-template prefill,
batched prompts, stream tokens, context errors, embeddings' inputs and pooling, input_extra."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from test_server import fim_model_path, load_tiny, start_server  # noqa: F401 - a fixture

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(fim_model_path):
    return load_tiny(fim_model_path)


@pytest.fixture(scope="module")
def live(model):
    srv = start_server(model)   # greedy, serve -n 8
    yield srv
    srv.stop()


@pytest.fixture()
def http(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def greedy(http, prompt="hello", **body) -> dict:
    return http.post("/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0, **body}).json()


# -- routes and fields ------------------------------------------------------------------------

def test_unprefixed_routes_answer_as_the_v1_ones(http):
    a = http.post("/chat/completions", json={"messages": MSG, "max_tokens": 2, "seed": 1}).json()
    b = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, "seed": 1}).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert http.get("/models").json()["data"][0]["id"] == http.get("/v1/models").json()["data"][0]["id"]
    assert http.post("/chat/completions", json={"messages": MSG, "bogus": 1}).status_code == 400  # still strict


def test_llama_server_fields_on_the_openai_routes(http):
    r = http.post("/v1/completions", json={"prompt": "hello", "n_predict": 3}).json()
    assert r["usage"]["completion_tokens"] == 3
    chat = {"messages": MSG, "max_tokens": 8, "id_slot": 0}
    r = http.post("/v1/chat/completions", json={**chat, "grammar": 'root ::= "yes"'}).json()
    assert r["choices"][0]["message"]["content"] == "yes"
    r = http.post("/v1/chat/completions", json={**chat, "json_schema": {"enum": ["ok"]}}).json()
    assert r["choices"][0]["message"]["content"] == '"ok"'
    rf = {"type": "json_object", "schema": {"enum": [7]}}
    assert http.post("/v1/chat/completions", json={**chat, "response_format": rf}).json()[
        "choices"][0]["message"]["content"] == "7"
    r = http.post("/v1/chat/completions", json={**chat, "stream": True, "timings_per_token": True,
                                                "return_progress": True})
    chunks = events(r)
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    answer = [c for c in chunks if c["choices"]]
    assert all("timings" in c for c in answer) and chunks.index(answer[0]) == len(progress)  # progress first
    assert progress[0]["processed"] == progress[0]["cache"] and progress[-1]["processed"] == progress[-1]["total"]
    assert progress[-1]["total"] == answer[-1]["timings"]["prompt_n"] + answer[-1]["timings"]["cache_n"]
    bad = http.post("/v1/chat/completions", json={**chat, "id_slot": 2})
    assert bad.status_code == 400 and "id_slot" in bad.json()["error"]["message"]


def test_continue_final_message_and_apply_template(http, model):
    msgs = MSG + [{"role": "assistant", "content": "Whill"}]
    prompt = http.post("/apply-template", json={"messages": msgs, "tools": None}).json()["prompt"]
    assert prompt.endswith("Whill") and prompt.startswith(model.apply_chat_template(MSG, add_generation_prompt=True)
                                                          .rstrip()[:10])
    closed = http.post("/apply-template", json={"messages": msgs, "continue_final_message": False}).json()
    assert not closed["prompt"].endswith("Whill")
    no_gen = http.post("/apply-template", json={"messages": MSG, "add_generation_prompt": False}).json()["prompt"]
    assert no_gen == model.apply_chat_template(MSG, add_generation_prompt=False)
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "add_generation_prompt": False,
                                                "continue_final_message": True})
    assert r.status_code == 200
    both = http.post("/chat/completions", json={"messages": msgs, "add_generation_prompt": True,
                                                "continue_final_message": True})
    assert both.status_code == 400


# -- logit_bias ---------------------------------------------------------------------------------

def test_logit_bias_in_every_form_bans_and_pushes(http, model):
    plain = greedy(http, return_tokens=True)
    first = plain["tokens"][0]
    text = model.detokenize([first])
    for bias in ({str(first): -100}, [[first, False]], {str(first): False}):
        r = greedy(http, logit_bias=bias, return_tokens=True)
        assert r["tokens"][0] != first, bias
    body = {"prompt": "hello", "n_predict": 4, "temperature": 0, "return_tokens": True,
            "logit_bias": [[first, -math.inf]]}   # -Infinity, as Python's json writes it
    r = http.post("/completion", content=json.dumps(body), headers={"content-type": "application/json"}).json()
    assert r["tokens"][0] != first
    if text.strip():
        r = greedy(http, logit_bias=[[text, False]], return_tokens=True)   # by text, as llama-server
        assert first not in r["tokens"][:1]
    pushed = greedy(http, logit_bias={"300": 100}, return_tokens=True)
    assert pushed["tokens"] == [300] * 4
    r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "logit_bias": {"300": 100}}).json()
    assert r["choices"][0]["text"].strip() == model.detokenize([300, 300]).strip()
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, "logit_bias": [[300, 100]]})
    assert r.json()["choices"][0]["message"]["content"].strip() == model.detokenize([300, 300]).strip()


# -- n_predict from serve -n ----------------------------------------------------------------------

def test_serve_n_is_the_default_n_predict(http):
    assert http.post("/completion", json={"prompt": "hello", "ignore": 1}).status_code == 400
    r = http.post("/completion", json={"prompt": "hello", "logit_bias": {"300": 100}}).json()
    assert r["tokens_predicted"] == 8 and r["generation_settings"]["n_predict"] == 8
    r = http.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "logit_bias": {"300": 100}}).json()
    assert r["tokens_predicted"] == 8


# -- batches, tokens ----------------------------------------------------------------------------------

def test_batched_prompts_answer_each(http, model):
    one = [greedy(http, p)["content"] for p in ("hello", "world")]
    r = http.post("/v1/completions", json={"prompt": ["hello", "world"], "max_tokens": 4, "temperature": 0}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["text"] for c in r["choices"]] == one
    ids = model.tokenize("hello", add_special=True)
    r = http.post("/completion", json={"prompt": [ids, "hello", {"prompt_string": "hello"}], "n_predict": 4,
                                       "temperature": 0}).json()
    assert isinstance(r, list) and [b["index"] for b in r] == [0, 1, 2]
    assert {b["content"] for b in r} == {one[0]}
    mixed = http.post("/completion", json={"prompt": [*ids, " world"], "n_predict": 2, "temperature": 0}).json()
    assert isinstance(mixed, dict) and mixed["tokens_evaluated"] > len(ids)
    s = http.post("/completion", json={"prompt": [ids, ids], "n_predict": 2, "temperature": 0, "stream": True})
    assert {e["index"] for e in events(s)} == {0, 1}


def test_stream_chunks_carry_their_tokens(http):
    whole = greedy(http, return_tokens=True)
    assert len(whole["tokens"]) == whole["tokens_predicted"] == 4
    chunks = events(http.post("/completion", json={"prompt": "hello", "n_predict": 4, "temperature": 0,
                                                   "stream": True}))
    streamed = [t for c in chunks if not c["stop"] for t in c["tokens"]]
    assert streamed and all(isinstance(t, int) for t in streamed)
    assert streamed == whole["tokens"][:len(streamed)]


# -- errors --------------------------------------------------------------------------------------------

def test_context_overflow_is_llama_servers_error(http, model):
    for path, body in (("/completion", {"prompt": "hello " * 300}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": "hello " * 300}]}),
                       ("/v1/completions", {"prompt": "hello " * 300})):
        r = http.post(path, json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "exceed_context_size_error", err
        assert err["n_ctx"] == model.n_ctx and err["n_prompt_tokens"] > model.n_ctx
        assert "exceeds the available context size" in err["message"]


def test_truncated_when_the_window_fills(http, model):
    n = len(model.tokenize("hello " * 50, add_special=True))
    assert n < model.n_ctx - 8
    r = http.post("/completion", json={"prompt": "hello " * 50, "n_predict": model.n_ctx,
                                       "logit_bias": {"300": 100}}).json()
    assert r["truncated"] is True and r["tokens_evaluated"] == n
    assert greedy(http)["truncated"] is False


def test_truncated_after_a_context_shift():
    from types import SimpleNamespace

    from edgeinfer.server.llama_api import truncated

    shifted = SimpleNamespace(finish_reason="length", usage=SimpleNamespace(prompt_tokens=226, completion_tokens=96))
    assert truncated(shifted, 256) is True
    assert truncated(SimpleNamespace(finish_reason="length", usage=shifted.usage), 512) is False


# -- embeddings, infill --------------------------------------------------------------------------------

def test_embeddings_take_mixed_inputs(http, model):
    ids = model.tokenize("hello", add_special=True)
    r = http.post("/v1/embeddings", json={"input": ["hello", ids, {"prompt_string": "hello"},
                                                    {"content": [{"type": "text", "text": "hel"},
                                                                 {"type": "text", "text": "lo"}]}]}).json()
    vectors = [d["embedding"] for d in r["data"]]
    assert len(vectors) == 4 and all(v == vectors[0] for v in vectors)
    assert len(http.post("/v1/embeddings", json={"input": [*ids, " world"]}).json()["data"]) == 1
    for bad in ({"content": "x"}, {"content": [{"type": "image_url", "image_url": {"url": "data:"}}]}):
        assert http.post("/v1/embeddings", json={"input": bad}).status_code == 400


def test_pooling_none_gives_a_vector_per_token(model):
    srv = start_server(model, pooling="none")
    try:
        n = len(model.tokenize("hello world", add_special=True))
        r = httpx.post(srv.url + "/embeddings", json={"input": "hello world"}, timeout=60)
        vectors = r.json()[0]["embedding"]
        assert len(vectors) == n and len(vectors[0]) == model.config.n_embd
        assert abs(sum(x * x for x in vectors[0]) - 1) > 1e-3   # not normalised
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": "hello world"}, timeout=60)
        assert r.status_code == 400 and "none" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_serve_takes_pooling_and_alias():
    from edgeinfer.cli import build_parser

    args = build_parser().parse_args(["serve", "m.gguf", "--pooling", "mean", "--alias", "tinyllama-2"])
    assert args.pooling == "mean" and args.alias == [["tinyllama-2"]]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m.gguf", "--pooling", "max"])


@pytest.mark.parametrize("chunk", [{}, {"filename": "ok"}, {"text": 1}])
def test_infill_refuses_malformed_extra_chunks(http, chunk):
    r = http.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 1, "input_extra": [chunk]})
    assert r.status_code == 400 and "input_extra" in r.json()["error"]["message"]


def test_x_api_key_is_an_alternative_to_bearer(model):
    srv = start_server(model, api_key="sekrit")
    try:
        url = srv.url + "/tokenize"
        assert httpx.post(url, json={"content": "hi"}, headers={"X-Api-Key": "sekrit"}).status_code == 200
        assert httpx.post(url, json={"content": "hi"}, headers={"X-Api-Key": "nope"}).status_code == 401
        assert httpx.post(url, json={"content": "hi"}).status_code == 401
    finally:
        srv.stop()


def test_completion_result_shows_its_prompt_and_response_fields_pick_it(http, model):
    r = greedy(http)
    want = model.tokenizer.detokenize(model.tokenize("hello"), as_pieces=True)
    assert r["prompt"] == want and want.endswith("hello")
    r = greedy(http, response_fields=["content", "prompt", "generation_settings/n_predict"])
    assert set(r) == {"content", "prompt", "generation_settings/n_predict"}
    assert r["prompt"] == want and r["generation_settings/n_predict"] == 4


def test_verbose_echoes_the_prompt_the_model_saw(http, model):
    chat = {"messages": [{"role": "system", "content": "Book"}, *MSG], "max_tokens": 2}
    plain = http.post("/chat/completions", json=chat).json()
    assert "__verbose" not in plain
    r = http.post("/chat/completions", json={**chat, "verbose": True}).json()
    seen = r["__verbose"]
    assert "Book" in seen["prompt"] and seen["content"] == r["choices"][0]["message"]["content"]
    assert seen["tokens_evaluated"] == r["usage"]["prompt_tokens"]
    s = http.post("/chat/completions", json={**chat, "verbose": True, "stream": True})
    closing = [e for e in events(s) if e["choices"] and e["choices"][0]["finish_reason"]]
    assert "Book" in closing[-1]["__verbose"]["prompt"]
    r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "verbose": True}).json()
    assert r["__verbose"]["prompt"].endswith("hello")
    assert http.post("/v1/completions", json={"prompt": "a", "suffix": "b", "verbose": True}).status_code == 400
    assert greedy(http, verbose=True)["__verbose"]["content"] == greedy(http)["content"]


def test_backend_sampling_is_accepted_and_changes_nothing(http):
    assert greedy(http, backend_sampling=True)["content"] == greedy(http)["content"]
    assert http.post("/completion", json={"prompt": "a", "backend_sampling": "yes"}).status_code == 400


def test_two_assistant_messages_at_the_end_are_refused(http):
    msgs = [*MSG, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    r = http.post("/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 400 and "two assistant messages" in r.json()["error"]["message"]
    ok = http.post("/chat/completions", json={"messages": msgs[:-1], "max_tokens": 2})
    assert ok.status_code == 200  # one final assistant message: llama-server's prefill


def test_prompt_progress_is_reported_after_each_prefill_chunk(fim_model_path):
    import edgeinfer

    m = edgeinfer.load(str(fim_model_path), backend="reference", n_ctx=256, prefill_chunk=16)
    prompt = list(range(5, 75))  # 70 tokens: chunks of 16, the last 6 joining the one before
    for round_ in range(2):
        chunks = list(m.generate(prompt + [round_ + 3], stream=True, max_tokens=2, temperature=0,
                                 prompt_progress=True))
        steps = [c.prompt_progress for c in chunks if c.prompt_progress is not None]
        assert all(c.token is None and c.text == "" for c in chunks if c.prompt_progress is not None)
        assert chunks.index(next(c for c in chunks if c.token is not None)) == len(steps)  # all before the answer
        first, last = steps[0], steps[-1]
        assert first.processed == first.cache and last.processed == last.total == len(prompt) + 1
        assert all(b.processed > a.processed for a, b in zip(steps, steps[1:]))
        assert first.cache == (0 if round_ == 0 else len(prompt))  # the second reuses the first's prompt
    plain = list(m.generate(prompt, stream=True, max_tokens=1))
    assert all(c.prompt_progress is None for c in plain)


def test_serve_verbose_makes_every_answer_carry_it(model):
    from starlette.testclient import TestClient

    from edgeinfer.server import ServerConfig, create_app

    app = create_app(ServerConfig(model_name="tiny", verbose=True), model)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        chat = {"messages": MSG, "max_tokens": 2}
        assert "__verbose" in c.post("/chat/completions", json=chat).json()
        assert "__verbose" not in c.post("/chat/completions", json={**chat, "verbose": False}).json()
        assert "__verbose" in c.post("/completion", json={"prompt": "hi", "n_predict": 2}).json()
        batch = c.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
        assert batch.status_code == 200  # the server's default leaves batches alone


def test_text_parts_are_joined_by_a_blank_line(http):
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    r = http.post("/chat/completions", json={"messages": [*MSG, {"role": "assistant", "content": parts}],
                                             "max_tokens": 1, "verbose": True}).json()
    assert r["__verbose"]["prompt"].endswith("Wh\n\nill")  # the open assistant message, as llama-server's
