"""Tool calls and reasoning through the server, driven by the official openai and ollama clients.

Tiny random-weight models carry real published templates (Qwen 2.5, Llama 3.1, Qwen 3):
with tool_choice "required" or a named function the call is constrained, so it validates
whatever the weights. A scripted model (a real Qwen 3 model whose `chat` replays a fixed
answer) pins the exact shapes: thinking, two parallel calls, streamed and not.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest

import edgeinfer
from edgeinfer.prompt import tool_calls
from gguf_factory import TinyShape, bpe_vocab, write_tiny_model
from scripted_chat import served
from test_server import MODEL, fim_model_path, load_tiny, start_server  # noqa: F401 - a fixture

DATA = Path(__file__).parent / "data"
TEMPLATES = {name: (DATA / "templates" / f"{name}.jinja").read_text()
             for name in ("qwen2.5-instruct", "llama-3.1-instruct", "qwen3")}
SMALL = TinyShape(n_embd=64, n_layer=1, n_head=2, n_head_kv=1, head_dim=32, n_ff=128, n_ctx=4096)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Web search",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20}},
                   "required": ["query"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 300}


def _vocab():
    vocab = bpe_vocab("qwen2")
    n = len(vocab["tokens"])
    extra = [("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4), ("</tool_call>", 4),
             ("<|python_tag|>", 3), ("<think>", 4), ("</think>", 4)]
    vocab["tokens"] = vocab["tokens"] + [t for t, _ in extra]
    vocab["types"] = vocab["types"] + [k for _, k in extra]
    return vocab, n


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv-tools")
    vocab, n = _vocab()
    eos = {"tokenizer.ggml.eos_token_id": n + 1}
    return {
        "hermes": write_tiny_model(root / "qwen25.gguf", "qwen2", "F32", vocab=vocab, shape=SMALL, seed=5,
                                   chat_template=TEMPLATES["qwen2.5-instruct"], extra_metadata=eos),
        "llama3": write_tiny_model(root / "llama31.gguf", "llama", "F32", vocab=vocab, shape=SMALL, seed=6,
                                   chat_template=TEMPLATES["llama-3.1-instruct"]),
        "qwen3": write_tiny_model(root / "qwen3.gguf", "qwen2", "F32", vocab=vocab, shape=SMALL, seed=7,
                                  chat_template=TEMPLATES["qwen3"], extra_metadata=eos),
        # a mixture of experts (Qwen3-30B-A3B's family) with the Qwen 3 template it ships with
        "qwen3moe": write_tiny_model(root / "qwen3moe.gguf", "qwen3moe", "F32", vocab=vocab, shape=SMALL, seed=8,
                                     chat_template=TEMPLATES["qwen3"], extra_metadata=eos),
    }


def _load(path):
    return edgeinfer.load(str(path), n_ctx=4096, threads=1, download=False)


@pytest.fixture(scope="module")
def servers(paths):
    live = {name: start_server(_load(p)) for name, p in paths.items()}
    yield live
    for srv in live.values():
        srv.stop()


def openai_client(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    if name is not None:
        assert call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- a round trip on real templates ----------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["hermes", "llama3", "qwen3", "qwen3moe"])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_round_trip(servers, fmt, stream):
    client = openai_client(servers[fmt])
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL, tools=[WEATHER, SEARCH], seed=3, parallel_tool_calls=False, **SAMPLED)
    if stream:
        with client.chat.completions.stream(messages=ASK, tool_choice=named, stream_options={"include_usage": True},
                                            **kw) as s:
            first = s.get_final_completion()
    else:
        first = client.chat.completions.create(messages=ASK, tool_choice=named, **kw)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content in (None, "") and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _check_call(call, "get_weather")
    # the same request streamed and not gives the same call (seeded)
    again = client.chat.completions.create(messages=ASK, tool_choice=named, **kw).choices[0].message.tool_calls[0]
    assert (again.function.name, json.loads(again.function.arguments)) == \
        (call.function.name, json.loads(call.function.arguments))
    # the tool's result goes back; the model answers (tool_choice "none": free text)
    history = ASK + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 18}'}]
    final = client.chat.completions.create(messages=history, tool_choice="none", **{**kw, "max_tokens": 6})
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens > first.usage.prompt_tokens


CITY = {"type": "function", "function": {"name": "get_city_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}}


def test_forced_call_completes_within_120_tokens(servers):
    """A forced call completes within 120 tokens in at least 19 of 20 tries, on a random-weight
    tiny model at temperature 1: between its JSON tokens the grammar takes at most one space or
    newline, so the budget is not spent on whitespace. (The string is bounded: over a byte
    vocabulary a random model writes unbounded strings for hundreds of tokens, whatever the layout.)"""
    client = openai_client(servers["hermes"])
    named = {"type": "function", "function": {"name": "get_city_weather"}}
    done = 0
    for seed in range(20):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[CITY], seed=seed,
                                           tool_choice=named if seed % 2 else "required", parallel_tool_calls=False,
                                           temperature=1.0, top_p=1.0, max_tokens=120)
        c = r.choices[0]
        if c.finish_reason == "tool_calls":
            assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].function.name == "get_city_weather"
            jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), CITY["function"]["parameters"])
            assert r.usage.completion_tokens <= 120
            done += 1
    assert done >= 19, done


def test_tool_result_reaches_the_template(servers):
    """The echoed call and the tool message are rendered through the model's template."""
    srv = servers["hermes"]
    model = srv.state.model
    seen = []
    real_chat = model.chat

    def chat(messages, **kw):
        seen.append((messages, kw.get("tools")))
        return real_chat(messages, **kw)

    model.chat = chat
    try:
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'}]
        openai_client(srv).chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=2)
    finally:
        del model.chat
    messages, tools = seen[-1]
    text = tool_calls.render_with_tools(
        model.template, messages, tools, add_bos=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\n{\"temp\": 18}\n</tool_response>" in text


def test_required_parallel_calls_validate(servers):
    """parallel_tool_calls true: several calls may follow one another, each valid."""
    client = openai_client(servers["hermes"])
    found = None
    for seed in range(16):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, SEARCH], tool_choice="required",
                                           seed=seed, parallel_tool_calls=True, **{**SAMPLED, "max_tokens": 600})
        c = r.choices[0]
        assert c.finish_reason in ("tool_calls", "length")
        if c.finish_reason == "tool_calls":
            for call in c.message.tool_calls:
                _check_call(call)
            if len(c.message.tool_calls) >= 2:
                found = (seed, c.message.tool_calls)
                break
    assert found is not None, "no seed made two calls"
    seed, calls = found
    # streamed: the same calls, indexed 0, 1, ... as the client accumulates them
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER, SEARCH], tool_choice="required",
                                        seed=seed, parallel_tool_calls=True, **{**SAMPLED, "max_tokens": 600}) as s:
        final = s.get_final_completion()
    got = final.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("fmt", ["hermes", "qwen3moe"])
def test_ollama_tools_round_trip(servers, fmt):
    import ollama

    client = ollama.Client(host=servers[fmt].url, timeout=120)

    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city.

        Args:
          city: the city
          unit: celsius or fahrenheit
        """
        return "18"

    r = client.chat(model=MODEL, messages=ASK, tools=[get_weather], options={"num_predict": 8, "seed": 1})
    assert r.done and r.message.role == "assistant"
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "18"}]
    r = client.chat(model=MODEL, messages=history, tools=[get_weather], options={"num_predict": 4})
    assert r.done and not r.message.tool_calls
    parts = list(client.chat(model=MODEL, messages=history, tools=[get_weather], stream=True,
                             options={"num_predict": 4}))
    assert parts[-1].done and "".join(p.message.content or "" for p in parts) == r.message.content


def test_a_template_without_tools_gets_them_as_text(fim_model_path):  # noqa: F811
    """As llama-server's polyfill: the tools in the system prompt, a forced call the generic
    JSON call; a bad tool is still a 400 naming the field."""
    import ollama
    import openai

    model = edgeinfer.load(str(fim_model_path), backend="reference", n_ctx=2048)
    assert not model.supports_tools
    srv = start_server(model)
    try:
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=named,
                                                       parallel_tool_calls=False, max_tokens=200)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        _check_call(r.choices[0].message.tool_calls[0], "get_weather")
        prompt = tool_calls.render_with_tools(model.template, ASK, [WEATHER], add_bos=False)
        assert "following tools" in prompt and '"name": "get_weather"' in prompt
        r2 = ollama.Client(host=srv.url).chat(model=MODEL, messages=ASK, tools=[WEATHER], options={"num_predict": 2})
        assert r2.done
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "tools": [
            {"type": "function", "function": {"name": "bad name"}}]})
        assert r.status_code == 400 and "'tools'" in r.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError):
            openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, tool_choice="required")
    finally:
        srv.stop()


# -- exact shapes, from a scripted answer ----------------------------------------------------------

SCRIPT = ("<think>\nThe user wants weather and news.\n</think>\n\n"
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "search", "arguments": {"query": "Paris news"}}\n</tool_call>')
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("search", {"query": "Paris news"})]


@pytest.fixture(scope="module")
def scripted(paths):
    yield from served(_load(paths["qwen3"]), SCRIPT, piece=5)


def test_openai_reasoning_and_parallel_calls_whole(scripted):
    srv, fake = scripted
    r = openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, SEARCH])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.model_extra["reasoning_content"] == "The user wants weather and news."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == CALLS
    assert fake.calls[-1]["tools"][0]["function"]["name"] == "get_weather"


def test_openai_streamed_tool_call_deltas(scripted):
    srv, _ = scripted
    stream = openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, SEARCH],
                                                        stream=True)
    chunks = list(stream)
    deltas = [ch.choices[0].delta for ch in chunks]
    assert deltas[0].role == "assistant"
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning.strip() == "The user wants weather and news."
    assert all(not d.content for d in deltas)
    tool_deltas = [tc for d in deltas for tc in (d.tool_calls or [])]
    heads = [t for t in tool_deltas if t.id is not None]
    assert [(t.index, t.type, t.function.name, t.function.arguments) for t in heads] == \
        [(0, "function", "get_weather", ""), (1, "function", "search", "")]
    for i, (_, args) in enumerate(CALLS):
        frags = "".join(t.function.arguments for t in tool_deltas if t.index == i)
        assert json.loads(frags) == args
        assert all(t.function.name is None for t in tool_deltas if t.index == i and t.id is None)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    # the client's own accumulator reads the same
    with openai_client(srv).chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER, SEARCH]) as s:
        final = s.get_final_completion()
    assert [(t.function.name, json.loads(t.function.arguments)) for t in final.choices[0].message.tool_calls] == CALLS


def test_ollama_thinking_and_calls(scripted):
    import ollama

    srv, fake = scripted
    client = ollama.Client(host=srv.url)
    r = client.chat(model=MODEL, messages=ASK, tools=[WEATHER, SEARCH], think=True)
    assert r.message.thinking == "The user wants weather and news." and r.message.content == ""
    assert [(t.function.name, dict(t.function.arguments)) for t in r.message.tool_calls] == CALLS
    assert fake.calls[-1]["enable_thinking"] is True
    parts = list(client.chat(model=MODEL, messages=ASK, tools=[WEATHER, SEARCH], stream=True))
    assert "".join(p.message.thinking or "" for p in parts).strip() == "The user wants weather and news."
    got = [(t.function.name, dict(t.function.arguments)) for p in parts for t in (p.message.tool_calls or [])]
    assert got == CALLS and parts[-1].done
    assert "enable_thinking" not in fake.calls[-1]


def test_thinking_switches(scripted):
    import ollama

    srv, fake = scripted
    client = ollama.Client(host=srv.url)
    with fake.answering("<think>\nhm\n</think>\n\nHello!"):
        r = client.chat(model=MODEL, messages=ASK, think=False)
        assert fake.calls[-1]["enable_thinking"] is False
        client.chat(model=MODEL, messages=[{"role": "user", "content": "Hi /no_think"}])
        assert fake.calls[-1]["enable_thinking"] is False
        r = client.chat(model=MODEL, messages=ASK)
        assert r.message.thinking == "hm" and r.message.content == "Hello!"
        assert "enable_thinking" not in fake.calls[-1]
        r = client.generate(model=MODEL, prompt="hi", think=True)
        assert r.thinking == "hm" and r.response == "Hello!" and fake.calls[-1]["enable_thinking"] is True
        o = openai_client(srv).chat.completions.create(model=MODEL, messages=ASK)
        assert o.choices[0].message.content == "Hello!" and o.choices[0].finish_reason == "stop"
        assert o.choices[0].message.model_extra["reasoning_content"] == "hm"
        openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, extra_body={
            "chat_template_kwargs": {"enable_thinking": False}})
        assert fake.calls[-1]["enable_thinking"] is False
        # the echoed reasoning goes back to the template
        back = ASK + [{"role": "assistant", "content": "Hello!", "reasoning_content": "hm"}, ASK[0]]
        openai_client(srv).chat.completions.create(model=MODEL, messages=back)
        assert fake.calls[-1]["messages"][1]["reasoning_content"] == "hm"
        assert client.show(MODEL).capabilities == ["completion", "tools", "thinking"]
