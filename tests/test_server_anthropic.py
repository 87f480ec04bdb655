"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), driven by the official
`anthropic` client: the client is the test of the dialect (its types, its stream accumulator,
its errors).

A tiny random-weight model with the real Qwen 2.5 template (tool-capable) answers the text,
stop-sequence, tool and error tests; greedy, so a streamed answer equals the whole one. A
scripted Qwen 3 model pins the exact shapes of thinking and tool_use blocks, whole and
streamed. The real Gemma 3 270M serves one round trip.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

import edgeinfer
from edgeinfer.server.anthropic_api import conversation
from edgeinfer.server.anthropic_schemas import AnthropicMessagesRequest
from gguf_factory import write_tiny_model
from scripted_chat import served
from test_server import MODEL, start_server
from test_server_tools import SCRIPT, SMALL, TEMPLATES, _vocab

anthropic = pytest.importorskip("anthropic")

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
SEARCH = {"name": "search", "description": "Web search",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20}},
                           "required": ["query"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ONE_CALL = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv-anthropic")
    vocab, n = _vocab()
    eos = {"tokenizer.ggml.eos_token_id": n + 1}
    return {name: write_tiny_model(root / f"{name}.gguf", "qwen2", "F32", vocab=vocab, shape=SMALL, seed=seed,
                                   chat_template=TEMPLATES[template], extra_metadata=eos)
            for name, template, seed in (("qwen25", "qwen2.5-instruct", 5), ("qwen3", "qwen3", 7))}


def _load(path):
    return edgeinfer.load(str(path), n_ctx=4096, threads=1, download=False)


@pytest.fixture(scope="module")
def srv(paths):
    live = start_server(_load(paths["qwen25"]))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def scripted(paths):
    yield from served(_load(paths["qwen3"]), SCRIPT, piece=5)


def client(live, **kw) -> "anthropic.Anthropic":
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=live.url, max_retries=0, timeout=120, **kw)


def events(live, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a raw streamed answer."""
    out = []
    with httpx.stream("POST", live.url + "/v1/messages", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                out.append((name, data))
    return out


# -- text ------------------------------------------------------------------------------------------

def test_text_whole_streamed_and_counted(srv):
    c = client(srv)
    kw = dict(model=MODEL, max_tokens=6, system=[{"type": "text", "text": "Be brief."}], messages=ASK,
              metadata={"user_id": "u1"}, extra_headers={"anthropic-version": "2023-06-01"})
    whole = c.messages.create(**kw)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL and whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert [b.type for b in whole.content] in ([], ["text"]) and whole.usage.output_tokens == 6
    counted = c.messages.count_tokens(model=MODEL, system=kw["system"], messages=ASK).input_tokens
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == counted
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    # the same prompt again: the prefix cache served it
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted
    # Anthropic's event sequence
    seen = events(srv, {k: v for k, v in kw.items() if k != "extra_headers"})
    names = [n for n, _ in seen]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = seen[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == counted
    pings = names.index("content_block_start") if whole.content else len(names) - 2
    assert set(names[1:pings]) == {"ping"}   # one at the start, one a prefill chunk
    if whole.content:
        assert names[-3] == "content_block_stop" and set(names[pings + 1:-3]) == {"content_block_delta"}
    delta = seen[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6


def test_stop_sequence(srv):
    c = client(srv)
    text = c.messages.create(model=MODEL, max_tokens=8, messages=ASK).content[0].text
    stop = next(ch for ch in text[1:] if ch.isprintable() and not ch.isspace() and ch != "\ufffd")
    r = c.messages.create(model=MODEL, max_tokens=8, messages=ASK, stop_sequences=[stop, "never-seen"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    prefix = text[:text.index(stop)]
    assert "".join(b.text for b in r.content) == (prefix if prefix.strip() else "")
    with c.messages.stream(model=MODEL, max_tokens=8, messages=ASK, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


# -- tools -----------------------------------------------------------------------------------------

def test_forced_tool_call_whole_and_streamed(srv):
    c = client(srv)
    kw = dict(model=MODEL, max_tokens=300, messages=ASK, tools=[WEATHER, SEARCH], tool_choice=ONE_CALL)
    r = c.messages.create(**kw)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    call = r.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", call.input)]
    seen = events(srv, kw)
    blocks = [d for n, d in seen if n.startswith("content_block")]
    assert blocks[0]["content_block"] == {"type": "tool_use", "id": blocks[0]["content_block"]["id"],
                                          "name": "get_weather", "input": {}}
    assert json.loads(blocks[1]["delta"]["partial_json"]) == call.input
    assert blocks[1]["delta"]["type"] == "input_json_delta" and blocks[2]["type"] == "content_block_stop"
    # tool_choice "any" forces a call too
    r = c.messages.create(**{**kw, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert r.stop_reason == "tool_use" and len(r.content) == 1 and r.content[0].type == "tool_use"


def test_tool_result_turn_reaches_the_template(srv):
    """The echoed tool_use and the tool_result are the template's call and tool response."""
    model = srv.state.model
    seen = []
    real_chat = model.chat

    def chat(messages, **kw):
        seen.append((messages, kw.get("tools")))
        return real_chat(messages, **kw)

    model.chat = chat
    history = ASK + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": '{"temp": 18}'}],
             "cache_control": {"type": "ephemeral"}}]}]
    try:
        r = client(srv).messages.create(model=MODEL, max_tokens=4, messages=history, tools=[WEATHER],
                                        tool_choice={"type": "none"})
    finally:
        del model.chat
    assert r.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in r.content)
    messages, tools = seen[-1]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                        "arguments": {"city": "Paris", "unit": "celsius"}}
    assert messages[2] == {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": '{"temp": 18}'}
    from edgeinfer.prompt import tool_calls

    text = tool_calls.render_with_tools(model.template, messages, tools, add_bos=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert '<tool_response>\n{"temp": 18}\n</tool_response>' in text
    # a tool_result for a call nobody made
    bad = history[:1] + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                                       "content": "x", "is_error": True}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client(srv).messages.create(model=MODEL, max_tokens=4, messages=bad)
    assert "messages.1.content.0.tool_use_id" in e.value.message and "toolu_9" in e.value.message


# -- thinking, exact shapes ------------------------------------------------------------------------

def test_thinking_and_calls_scripted(scripted):
    live, fake = scripted
    c = client(live)
    kw = dict(model=MODEL, max_tokens=1024 + 64, messages=ASK, tools=[WEATHER, SEARCH],
              thinking={"type": "enabled", "budget_tokens": 1024})
    r = c.messages.create(**kw)
    assert fake.calls[-1]["enable_thinking"] is True
    assert [b.type for b in r.content] == ["thinking", "tool_use", "tool_use"] and r.stop_reason == "tool_use"
    assert r.content[0].thinking == "The user wants weather and news."
    assert [(b.name, b.input) for b in r.content[1:]] == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                                          ("search", {"query": "Paris news"})]
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use", "tool_use"]
    assert final.content[0].thinking.strip() == "The user wants weather and news."
    assert [(b.name, b.input) for b in final.content[1:]] == [(b.name, b.input) for b in r.content[1:]]
    assert final.stop_reason == "tool_use"
    seen = events(live, kw)
    starts = [(d["index"], d["content_block"]["type"]) for n, d in seen if n == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "tool_use"), (2, "tool_use")]
    assert {d["delta"]["type"] for n, d in seen if n == "content_block_delta"} == {"thinking_delta", "input_json_delta"}
    # the answer's thinking goes back to the template; thinking disabled and display omitted
    back = ASK + [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                                     {"type": "text", "text": "Hello!"}]},
                  {"role": "user", "content": "And tomorrow?"}]
    with fake.answering("Hello!"):
        r = c.messages.create(model=MODEL, max_tokens=8, messages=back, thinking={"type": "disabled"})
        assert fake.calls[-1]["enable_thinking"] is False
        assert fake.calls[-1]["messages"][1] == {"role": "assistant", "content": "Hello!", "reasoning_content": "hm"}
        assert [(b.type, b.text) for b in r.content] == [("text", "Hello!")] and r.stop_reason == "end_turn"
    with fake.answering("<think>\nhm\n</think>\n\nHello!"):
        omitted = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
        r = c.messages.create(model=MODEL, max_tokens=2048, messages=ASK, thinking=omitted)
        assert r.content[0].type == "thinking" and r.content[0].thinking == ""
        with c.messages.stream(model=MODEL, max_tokens=2048, messages=ASK, thinking=omitted) as s:
            assert [(b.type, getattr(b, "thinking", None)) for b in s.get_final_message().content] == \
                [("thinking", ""), ("text", None)]


# -- errors and keys -------------------------------------------------------------------------------

def test_errors_in_anthropics_shape(srv):
    r = httpx.post(srv.url + "/v1/messages", json={"model": MODEL, "messages": ASK}, timeout=30)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    c = client(srv)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    cases = [
        (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]),
         "'messages.0.content.1.source': this model has no image input"),
        (dict(messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
         "'messages.0.content.0': unknown content block type"),
        (dict(messages=ASK, max_tokens="5"), "'max_tokens'"),
        # sampling fields: the newest SDK no longer has them, older clients and Claude Code send them
        (dict(messages=ASK, extra_body={"top_k": -1}), "'top_k'"),
        (dict(messages=ASK, extra_body={"temperature": 1.5}), "'temperature'"),
        (dict(messages=ASK, extra_body={"speed": "fast"}), "'speed'"),
        (dict(messages=ASK, tools=[{"type": "web_search_20250305", "name": "web_search"}]), "server tool"),
        (dict(messages=ASK, extra_body={"container": "c1"}), "unsupported field 'container'"),
        (dict(messages=ASK, tool_choice={"type": "tool"}, tools=[WEATHER]), "'tool_choice.name'"),
        (dict(messages=ASK, thinking={"type": "enabled", "budget_tokens": 2048}),
         "'thinking.budget_tokens': it must be less than max_tokens"),
        (dict(messages=ASK, max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 2048}),
         "'thinking': this model does not support thinking"),
        (dict(messages=ASK, tool_choice={"type": "any"}), "'tool_choice': it needs tools"),
    ]
    for extra, words in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(**{"model": MODEL, "max_tokens": 4, **extra})
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert words in e.value.message, (extra, e.value.message)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-opus-9", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [image]}])
    # the server is still fine; the sampling fields in range are taken
    r = c.messages.create(model=MODEL, max_tokens=1, messages=ASK, extra_body={
        "speed": "standard", "service_tier": "auto", "temperature": 0.7, "top_p": 0.9, "top_k": 40})
    assert r.usage.output_tokens == 1


def test_api_key_by_x_api_key_or_bearer(paths):
    live = start_server(_load(paths["qwen25"]), api_key="sekret")
    try:
        assert client(live, api_key="sekret").messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
        assert client(live, api_key=None, auth_token="sekret").messages.count_tokens(
            model=MODEL, messages=ASK).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(live, api_key="wrong").messages.create(model=MODEL, max_tokens=1, messages=ASK)
        assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": e.value.body["error"]["message"]}}
    finally:
        live.stop()


def test_openapi_documents_the_messages_routes(srv):
    doc = httpx.get(srv.url + "/openapi.json", timeout=30).json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert "requestBody" in doc["paths"][path]["post"], path
    assert "max_tokens" in doc["components"]["schemas"]["AnthropicMessagesRequest"]["required"]


def test_a_prompt_past_the_window_is_too_long(srv):
    """Worded as Anthropic words it: Claude Code reads "prompt is too long" to compact."""
    long = [{"role": "user", "content": "word " * 5000}]
    for stream in (False, True):
        r = httpx.post(srv.url + "/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": long,
                                                       "stream": stream}, timeout=60)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith("prompt is too long: ") and error["message"].endswith(" > 4096 maximum")


# -- the request read, without a model -------------------------------------------------------------

def test_conversation_mapping():
    req = AnthropicMessagesRequest.model_validate({
        "max_tokens": 1,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=a5145; You are X."},
                   {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "Hi"},
                     {"role": "user", "content": [{"type": "text", "text": "there"}]},
                     {"role": "assistant", "content": [
                         {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                         {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                         {"type": "tool_result", "tool_use_id": "t2", "content": "bad", "is_error": True},
                         {"type": "text", "text": "go on"}]},
                     {"role": "assistant", "content": "Sure"}]})
    assert conversation(req) == [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1; cch=fffff; You are X.\n\nBe brief."},
        {"role": "user", "content": "Hi\n\nthere"},   # consecutive turns of one role merged
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
            {"id": "t2", "type": "function", "function": {"name": "g", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "t1", "name": "f", "content": "one"},
        {"role": "tool", "tool_call_id": "t2", "name": "g", "content": "Error: bad"},
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": "Sure"}]


# -- the real Gemma 3 270M -------------------------------------------------------------------------

def test_gemma_round_trip(gemma_path):
    live = start_server(edgeinfer.load(gemma_path, n_ctx=512, threads=2), model_name="gemma3")
    try:
        c = client(live)
        kw = dict(model="gemma3", max_tokens=8, system="Answer in one short sentence.",
                  messages=[{"role": "user", "content": "What is the capital of France?"}])
        whole = c.messages.create(**kw)
        assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].type == "text"
        counted = c.messages.count_tokens(**{k: v for k, v in kw.items() if k != "max_tokens"}).input_tokens
        assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == counted
        with c.messages.stream(**kw) as s:
            final = s.get_final_message()
        assert final.content[0].text == whole.content[0].text and final.usage.cache_read_input_tokens > 0
        # Gemma 3's template renders no tools: they are written into its prompt as text
        # (edgeinfer.prompt.tool_polyfill), a forced call is the generic JSON call
        tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}]
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        call = c.messages.create(model="gemma3", max_tokens=60, messages=ask, tools=tools,
                                 tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
        assert call.stop_reason == "tool_use" and [b.type for b in call.content] == ["tool_use"]
        use = call.content[0]
        assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
        with c.messages.stream(model="gemma3", max_tokens=60, messages=ask, tools=tools,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}) as s:
            streamed = s.get_final_message()
        assert streamed.stop_reason == "tool_use" and [(b.name, b.input) for b in streamed.content] == \
            [(use.name, use.input)]
        # the tool's result goes back: the turn renders (Gemma's turns alternate) and is answered
        turn = ask + [{"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
        answer = c.messages.create(model="gemma3", max_tokens=8, messages=turn, tools=tools)
        assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
        counted = c.messages.count_tokens(model="gemma3", messages=turn, tools=tools).input_tokens
        assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted
        assert answer.usage.cache_read_input_tokens > 0   # the call's prompt came from the cache
        # and an error
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="gemma3", max_tokens=8, messages=turn[:1] + turn[2:])
        assert e.value.body["error"]["type"] == "invalid_request_error" and use.id in e.value.message
    finally:
        live.stop()

