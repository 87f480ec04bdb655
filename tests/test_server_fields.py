"""Every field a client sends either works or gets a 400 naming it: unknown fields, known
ones we cannot honour, Ollama's `context` round trip, and the official clients unaffected."""

from __future__ import annotations

import json

import httpx
import pytest

from test_server import MODEL, completion_oracle, fim_model_path, load_tiny, start_server  # noqa: F401 - a fixture

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
CMPL = {"prompt": "hi", "max_tokens": 1}
GEN = {"prompt": "hi", "raw": True, "stream": False, "options": {"num_predict": 1}}
OCHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": False, "options": {"num_predict": 1}}
LCMPL = {"prompt": "hi", "n_predict": 1}
INFILL = {"input_prefix": "a", "input_suffix": "b", "n_predict": 1}
MSG = {"role": "user", "content": "hi"}


def with_(base: dict, **extra) -> dict:
    return {**base, **extra}


def opts(base: dict, **extra) -> dict:
    return {**base, "options": {**base.get("options", {}), **extra}}


# (path, body, the field the message must name)
REFUSED = [
    # unknown fields, top level, every dialect
    ("/v1/chat/completions", with_(CHAT, temprature=0.5), "temprature"),
    ("/v1/chat/completions", with_(CHAT, mirostat=1), "mirostat"),
    ("/v1/chat/completions", with_(CHAT, web_search_options={}), "web_search_options"),
    ("/v1/completions", with_(CMPL, typical_p=0.5), "typical_p"),
    ("/v1/completions", with_(CMPL, grammar="root ::= ("), "grammar"),   # llama-server's field: honoured, checked
    ("/api/generate", with_(GEN, num_gpu=1), "num_gpu"),
    ("/api/generate", with_(GEN, width=512), "width"),
    ("/api/chat", with_(OCHAT, temperature=0.1), "temperature"),
    ("/api/show", {"model": MODEL, "extra": 1}, "extra"),
    ("/completion", with_(LCMPL, mirostat=2), "mirostat"),
    ("/completion", with_(LCMPL, logit_bias=[[1, True]]), "logit_bias"),     # true is no bias (false bans)
    ("/completion", with_(LCMPL, logit_bias=[[10**6, -1]]), "logit_bias"),   # outside the vocabulary
    ("/completion", with_(LCMPL, ignore_eos=True), "ignore_eos"),
    ("/infill", with_(INFILL, grammar="x"), "grammar"),
    ("/tokenize", {"content": "hi", "add_bos": True}, "add_bos"),
    ("/detokenize", {"tokens": [1], "special": True}, "special"),
    ("/apply-template", {"messages": [MSG], "tool": []}, "tool"),
    # unknown fields in nested objects
    ("/api/generate", opts(GEN, temprature=0.1), "options.temprature"),
    ("/api/generate", opts(GEN, temprature=None, f16_kv=False), "options.f16_kv"),
    ("/api/generate", opts(GEN, vocab_only=True), "options.vocab_only"),
    ("/api/chat", with_(OCHAT, messages=[{**MSG, "tool_calls": [{"function": {"name": "f"}, "x": 1}]}]),
     "messages.0.tool_calls.0.x"),
    ("/v1/chat/completions", with_(CHAT, stream=True, stream_options={"include_usage": True, "x": 1}),
     "stream_options.x"),
    ("/v1/chat/completions", with_(CHAT, messages=[{**MSG, "tool_call_ids": "a"}]), "messages.0.tool_call_ids"),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]), "messages.0.content.0.cache_control"),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:"}}]}]), "messages.0.content.0.image_url"),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "user", "content": [
        {"type": "input_audio"}]}]), "input_audio"),
    ("/v1/chat/completions", with_(CHAT, response_format={"type": "text", "strict": True}), "response_format.strict"),
    ("/infill", with_(INFILL, input_extra=[{"filename": "a", "text": "b", "lang": "py"}]), "input_extra.0.lang"),
    ("/apply-template", {"messages": [{**MSG, "x": 1}]}, "messages.0.x"),
    # known fields we cannot honour
    # (tools on this tool-less template are no longer refused: they reach it as text, as
    # llama-server's polyfill writes them; tests/test_server_tools.py)
    ("/v1/chat/completions", with_(CHAT, tool_choice="auto"), "tool_choice"),
    ("/v1/chat/completions", with_(CHAT, tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", with_(CHAT, tool_choice="sometimes", tools=[{"type": "function", "function": {
        "name": "f"}}]), "tool_choice"),
    ("/v1/chat/completions", with_(CHAT, functions=[{"name": "f"}]), "functions"),
    ("/v1/chat/completions", with_(CHAT, function_call="auto"), "function_call"),
    ("/v1/chat/completions", with_(CHAT, logit_bias={"1": "x"}), "logit_bias"),
    ("/v1/chat/completions", with_(CHAT, id_slot=1), "id_slot"),
    ("/v1/chat/completions", with_(CHAT, continue_final_message=True), "continue_final_message"),  # last is user's
    ("/v1/chat/completions", with_(CHAT, logprobs=3), "logprobs"),
    ("/v1/chat/completions", with_(CHAT, top_logprobs=3), "top_logprobs"),      # without logprobs: true
    ("/v1/chat/completions", with_(CHAT, logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", with_(CHAT, n=17), "n"),
    ("/v1/chat/completions", with_(CHAT, store=True), "store"),
    ("/v1/chat/completions", with_(CHAT, service_tier="flex"), "service_tier"),
    ("/v1/chat/completions", with_(CHAT, reasoning_effort="low"), "reasoning_effort"),
    ("/v1/chat/completions", with_(CHAT, modalities=["text", "audio"]), "modalities"),
    ("/v1/chat/completions", with_(CHAT, audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("/v1/chat/completions", with_(CHAT, prediction={"type": "content", "content": "x"}), "prediction"),
    ("/v1/chat/completions", with_(CHAT, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}), "response_format.json_schema"),
    ("/v1/chat/completions", with_(CHAT, response_format={"type": "xml"}), "response_format"),
    ("/api/chat", with_(OCHAT, format={"type": "object", "if": {}, "then": {}}), "format"),
    ("/completion", with_(LCMPL, grammar="root ::= ("), "grammar"),
    ("/completion", with_(LCMPL, json_schema={"type": "string", "format": "weird"}), "json_schema"),
    ("/completion", with_(LCMPL, grammar='root ::= "a"', json_schema={}), "json_schema"),
    ("/v1/completions", with_(CMPL, echo=True, suffix="x"), "echo"),
    ("/v1/completions", with_(CMPL, best_of=2), "best_of"),
    ("/v1/completions", with_(CMPL, logprobs=21), "logprobs"),
    ("/v1/completions", with_(CMPL, logprobs=True), "logprobs"),
    ("/api/chat", with_(OCHAT, think=True), "think"),
    ("/api/generate", with_(GEN, think=True), "think"),
    ("/api/generate", with_(GEN, think="high"), "think"),
    ("/api/generate", with_(GEN, logprobs=1), "logprobs"),
    ("/api/generate", with_(GEN, top_logprobs=2), "top_logprobs"),
    ("/api/chat", with_(OCHAT, logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("/api/generate", opts(GEN, mirostat=1), "options.mirostat"),
    ("/api/generate", opts(GEN, typical_p=0.5), "options.typical_p"),
    ("/api/generate", opts(GEN, tfs_z=0.9), "options.tfs_z"),
    ("/api/generate", with_(GEN, context=[10**6]), "context"),
    ("/api/generate", with_(GEN, context=[-1]), "context"),
    ("/api/generate", with_(GEN, context=["a"]), "context"),
    ("/api/generate", with_(GEN, context=[1], suffix="x"), "context"),
    ("/completion", with_(LCMPL, n_probs=-1), "n_probs"),
    ("/completion", with_(LCMPL, post_sampling_probs=1), "post_sampling_probs"),
    ("/completion", with_(LCMPL, return_tokens=1), "return_tokens"),
    ("/completion", with_(LCMPL, id_slot=3), "id_slot"),
    ("/completion", with_(LCMPL, samplers=["mirostat"]), "samplers"),
    ("/completion", with_(LCMPL, samplers=["temperature", "top_k"]), "samplers"),
]


def error_message(path: str, body: dict) -> str:
    return body["error"] if path.startswith("/api/") else body["error"]["message"]


@pytest.fixture(scope="module")
def fields_live(fim_model_path):
    srv = start_server(load_tiny(fim_model_path))
    yield srv
    srv.stop()


@pytest.fixture()
def client(fields_live):
    with httpx.Client(base_url=fields_live.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("path,body,field", REFUSED, ids=[f"{p}-{f}-{i}" for i, (p, _, f) in enumerate(REFUSED)])
def test_a_field_we_cannot_honour_is_a_400_naming_it(client, path, body, field):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    message = error_message(path, r.json())
    assert any(f"'{field}{end}" in message for end in ("'", ".")), message
    assert "\n" not in message and "Traceback" not in message


def test_unknown_field_message_names_the_path(client):
    r = client.post("/api/generate", json=opts(GEN, mirostat_etta=0.1))
    assert r.json()["error"].startswith("unsupported field 'options.mirostat_etta'")
    r = client.post("/v1/chat/completions", json=with_(CHAT, functions=[{"name": "f"}])).json()
    assert r["error"]["param"] == "functions" and "tool calling" in r["error"]["message"]


# (path, body): fields that ask for nothing, or are metadata with no effect on the output
ACCEPTED = [
    ("/v1/chat/completions", with_(CHAT, user="u1", store=False, metadata={"app": "x"}, service_tier="auto",
                                   tools=[], tool_choice="none", logprobs=False, presence_penalty=0,
                                   logit_bias={}, modalities=["text"], n=1, cache_prompt=False)),
    ("/v1/chat/completions", with_(CHAT, stream=True, stream_options={"include_usage": False})),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "user", "content": "hi", "name": "bob"},
                                                   {"role": "assistant", "content": "yo", "tool_calls": [],
                                                    "refusal": None}, MSG])),
    ("/v1/completions", with_(CMPL, echo=False, best_of=1, logprobs=0, user="u", repeat_last_n=16)),
    ("/api/generate", with_(GEN, think=False, keep_alive="5m", logprobs=False, images=[])),
    ("/api/generate", opts(GEN, mirostat=0, typical_p=1.0, tfs_z=1, num_keep=4, num_ctx=128)),
    # null is "not set" (langchain-ollama sends every option); these change nothing here
    ("/api/generate", opts(GEN, mirostat=None, mirostat_eta=None, mirostat_tau=None, num_gpu=None,
                           num_thread=None, tfs_z=None, top_k=None, stop=None, temprature=None)),
    ("/api/generate", opts(GEN, mirostat_tau=5.0, mirostat_eta=0.1, use_mmap=False, use_mlock=True, numa=False,
                           low_vram=False, penalize_newline=True, main_gpu=0, logits_all=False, f16_kv=True)),
    ("/api/chat", with_(OCHAT, tools=[], think=False)),
    ("/v1/chat/completions", with_(CHAT, parallel_tool_calls=False, response_format={"type": "json_object"},
                                   messages=[{"role": "assistant", "content": None, "tool_calls": [
                                       {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                                       {"role": "tool", "tool_call_id": "1", "content": "42"}, MSG])),
    ("/api/chat", with_(OCHAT, format="json", messages=[
        {"role": "assistant", "content": "", "thinking": "hm", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "tool_name": "f", "content": "42"}, MSG])),
    ("/api/show", {"model": MODEL, "verbose": False}),
    ("/api/show", {"model": MODEL, "verbose": True}),
    # OpenAI's prompt-cache routing hint (Codex): the prefix cache reuses a prefix whatever the key
    ("/v1/chat/completions", with_(CHAT, prompt_cache_key="session-1")),
    ("/v1/completions", with_(CMPL, prompt_cache_key="session-1")),
    ("/completion", with_(LCMPL, n_probs=0, id_slot=-1, cache_prompt=False, n_keep=4, return_tokens=False,
                          samplers=["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"])),
    ("/infill", with_(INFILL, id_slot=0, n_indent=2, t_max_prompt_ms=500, t_max_predict_ms=500,
                      samplers=["top_k", "top_p", "infill"],
                      input_extra=[{"filename": "a.py", "text": "x = 1\n", "time": 12.5}])),
]


@pytest.mark.parametrize("path,body", ACCEPTED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(ACCEPTED)])
def test_fields_that_ask_for_nothing_are_accepted(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text


def test_show_verbose_has_every_key_of_the_file(client):
    """As Ollama's: `verbose` adds the file's keys, the vocabulary arrays whole, to model_info."""
    short = client.post("/api/show", json={"model": MODEL}).json()["model_info"]
    full = client.post("/api/show", json={"model": MODEL, "verbose": True}).json()
    info = full["model_info"]
    assert "tokenizer.ggml.tokens" not in short
    assert isinstance(info["tokenizer.ggml.tokens"], list) and len(info["tokenizer.ggml.tokens"]) > 100
    assert {k: info[k] for k in short} == short and "tokenizer.chat_template" not in info
    assert full["template"] and full["details"]
    r = client.post("/api/show", json={"model": MODEL, "verbose": "yes"})
    assert r.status_code == 400 and "'verbose'" in r.json()["error"]


def test_think_switches_a_thinking_template(fim_model_path):
    model = load_tiny(fim_model_path)
    model.template.source = "{% if enable_thinking %}<think>{% endif %}" + (model.template.source or "")
    srv = start_server(model)
    try:
        for think in (False, True):
            r = httpx.post(srv.url + "/api/chat", json=with_(OCHAT, think=think))
            assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/api/chat", json=with_(OCHAT, think="high"))
        assert r.status_code == 400 and "'think'" in r.json()["error"]
    finally:
        srv.stop()


# -- Ollama's context ---------------------------------------------------------------------------

def test_generate_context_round_trip_continues_the_conversation(fields_live, client):
    model = fields_live.state.model
    first = client.post("/api/generate", json={"prompt": "hello", "raw": True, "stream": False,
                                               "options": {"temperature": 0, "num_predict": 4}}).json()
    prompt_ids = model.tokenize("hello")
    assert first["context"][:len(prompt_ids)] == prompt_ids and len(first["context"]) == len(prompt_ids) + 4
    assert model.detokenize(first["context"][len(prompt_ids):]) == first["response"]
    second = client.post("/api/generate", json={"prompt": " world", "raw": True, "stream": False,
                                                "context": first["context"],
                                                "options": {"temperature": 0, "num_predict": 4}}).json()
    joined = first["context"] + model.tokenize(" world", add_special=False)
    assert second["response"] == completion_oracle(model, joined, max_tokens=4)
    assert second["prompt_eval_count"] == len(joined)
    assert second["context"][:len(joined)] == joined and len(second["context"]) == len(joined) + 4
    # streamed: the done line carries the same context
    lines = [json.loads(x) for x in client.post("/api/generate", json={
        "prompt": " world", "raw": True, "context": first["context"],
        "options": {"temperature": 0, "num_predict": 4}}).text.splitlines()]
    assert lines[-1]["done"] and lines[-1]["context"] == second["context"]
    assert all("context" not in x for x in lines[:-1])


def test_generate_context_through_the_chat_template(fields_live, client):
    model = fields_live.state.model
    first = client.post("/api/generate", json={"prompt": "hi", "stream": False,
                                               "options": {"temperature": 0, "num_predict": 3}}).json()
    text = model.template.render_prompt([{"role": "user", "content": "hi"}], add_bos=model.tokenizer.add_bos,
                                        add_generation_prompt=True)
    ids = model.tokenizer.tokenize(text, add_special=True, parse_special=True)
    assert first["context"][:len(ids)] == ids
    second = client.post("/api/generate", json={"prompt": "again", "stream": False, "context": first["context"],
                                                "options": {"temperature": 0, "num_predict": 3}}).json()
    turn = model.template.render_prompt([{"role": "user", "content": "again"}], add_bos=model.tokenizer.add_bos,
                                        add_generation_prompt=True)
    joined = first["context"] + model.tokenizer.tokenize(turn, add_special=False, parse_special=True)
    assert second["response"] == completion_oracle(model, joined, max_tokens=3)
    assert second["context"][:len(joined)] == joined


# -- llama-server limits that editor plugins send -------------------------------------------------

def test_n_indent_cuts_a_less_indented_line():
    from edgeinfer.results import GenerationChunk, Usage
    from edgeinfer.server.llama_api import limited

    pieces = ["    a = 1", "\n    b", " = 2\nret", "urn x", "\nmore"]

    def start(cancel):
        for i, p in enumerate(pieces):
            if cancel.is_set():
                break
            yield GenerationChunk(p, i)
        yield GenerationChunk("", None, "cancelled" if cancel.is_set() else "stop", Usage(1, 2), None)

    import threading

    out = list(limited(start, None, 4)(threading.Event()))
    assert "".join(c.text for c in out) == "    a = 1\n    b = 2\n"
    assert out[-1].finish_reason == "length"
    out = list(limited(start, None, 0)(threading.Event()))
    assert "".join(c.text for c in out) == "".join(pieces) and out[-1].finish_reason == "stop"


# -- the official clients, unchanged ---------------------------------------------------------------

def test_official_clients_still_work(fields_live):
    import ollama
    import openai

    oc = ollama.Client(host=fields_live.url)
    assert oc.chat(model=MODEL, messages=[MSG], options={"num_predict": 2}).done
    assert oc.generate(model=MODEL, prompt="hi", options={"num_predict": 2}, keep_alive="1m").done
    r = oc.generate(model=MODEL, prompt="hi", options=ollama.Options(num_predict=2, temperature=0))
    assert r.done and r.context
    assert oc.show(MODEL).capabilities
    client = openai.OpenAI(base_url=fields_live.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[MSG], max_tokens=2, user="me", store=False)
    assert r.choices[0].message.role == "assistant"
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:   # a field we cannot honour: the SDK sees the 400
        client.chat.completions.create(model=MODEL, messages=[MSG], max_tokens=2, tool_choice="required")
    assert "tool_choice" in e.value.body["message"]


@pytest.mark.parametrize("path,body,field", [
    ("/api/generate", with_(GEN, format="yaml"), "format"),
    ("/api/generate", with_(GEN, images=["aGk="]), "images.0"),   # (this model has no mmproj)
    ("/api/generate", with_(GEN, template="{{ .Prompt }}"), "template"),
    ("/api/chat", with_(OCHAT, messages=[MSG, {**MSG, "images": ["aGk="]}]), "messages.1.images.0"),
])
def test_ollama_refusals_name_the_field(client, path, body, field):
    r = client.post(path, json=body)
    assert r.status_code == 400 and f"'{field}'" in r.json()["error"]


def test_t_max_predict_ms_stops_after_a_newline_once_the_time_is_up():
    import threading
    import time as _time

    from edgeinfer.results import GenerationChunk, Usage
    from edgeinfer.server.llama_api import limited

    def start(cancel):
        n = 0
        for p in ["a", "b", "\n", "c", "d", "e", "f"]:
            if cancel.is_set():
                break
            _time.sleep(0.03)
            n += 1
            yield GenerationChunk(p, n)
        yield GenerationChunk("", None, "cancelled" if cancel.is_set() else "stop", Usage(1, n), None)

    out = list(limited(start, 50, 0)(threading.Event()))
    text = "".join(c.text for c in out)
    assert "\n" in text and len(text) < 7 and out[-1].finish_reason == "length"
    assert "".join(c.text for c in limited(start, None, 0)(threading.Event())) == "ab\ncdef"


def test_num_keep_and_samplers_reach_the_generation(fields_live):
    from edgeinfer.server import llama_api, ollama_api
    from edgeinfer.server.schemas import LlamaCompletionRequest, OllamaGenerateRequest

    state = fields_live.state
    req = OllamaGenerateRequest.model_validate({"prompt": "x", "options": {"num_keep": 5}})
    assert ollama_api.sampling_of(state, req, 256)["n_keep"] == 5
    req = LlamaCompletionRequest.model_validate({"prompt": "x", "n_keep": 7, "samplers": ["top_k"]})
    params = llama_api.sampling_of(state, req)
    assert params["n_keep"] == 7 and (params["top_p"], params["min_p"], params["temperature"]) == (1.0, 0.0, 1.0)
