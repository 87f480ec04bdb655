"""What official clients expect of a forced call and a schema, on a tiny random-weight Qwen model.

At temperature 1, a model that knows nothing still answers as the clients need when the
grammar does its part (#59): a forced call is one call ending in "tool_calls" (parallel
calls only when asked for: llama-server's default), streamed without any `delta.content`;
an object schema with properties takes only those keys, an integer at most 16 digits. The
official openai SDK's `parse` and streamed tools, and instructor's TOOLS and JSON_SCHEMA
modes, then return their models instead of raising.
"""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

import edgeinfer
from gguf_factory import write_tiny_model
from test_server import MODEL, start_server
from test_server_tools import ASK, SMALL, TEMPLATES, _vocab

SEEDS = range(20)
CITY = {"type": "function", "function": {"name": "get_city_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}}
# no additionalProperties: closed all the same, as llama.cpp and Ollama read it
PLACE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                          "population": {"type": "integer"}},
         "required": ["name", "population"]}
SAMPLED = {"temperature": 1.0, "top_p": 1.0}


class City(BaseModel):
    name: str = Field(max_length=10)
    population: int


class GetWeather(BaseModel):
    city: str = Field(max_length=12)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    vocab, n = _vocab()
    path = write_tiny_model(tmp_path_factory.mktemp("sdk") / "qwen25.gguf", "qwen2", "F32", vocab=vocab,
                            shape=SMALL, seed=5, chat_template=TEMPLATES["qwen2.5-instruct"],
                            extra_metadata={"tokenizer.ggml.eos_token_id": n + 1})
    live = start_server(edgeinfer.load(str(path), n_ctx=4096, threads=1, download=False))
    yield live
    live.stop()


def _client(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _choice(seed: int) -> dict:
    return {"type": "function", "function": {"name": "get_city_weather"}} if seed % 2 else "required"


def test_a_forced_call_is_one_call_streamed_or_not(srv):
    """Without parallel_tool_calls the grammar ends after one call: "tool_calls" in at least 19
    of 20 seeds (max_tokens may still cut a call); streamed, no chunk has content, and the
    calls are the unstreamed ones."""
    client = _client(srv)
    one = 0
    for seed in SEEDS:
        kw = dict(model=MODEL, messages=ASK, tools=[CITY], tool_choice=_choice(seed), seed=seed, max_tokens=120,
                  **SAMPLED)
        c = client.chat.completions.create(**kw).choices[0]
        assert c.message.content is None
        if c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1:
            one += 1
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert all(not ch.choices[0].delta.content for ch in chunks if ch.choices), seed
        args = "".join(t.function.arguments or "" for ch in chunks if ch.choices
                       for t in (ch.choices[0].delta.tool_calls or []))
        assert [json.loads(args)] == [json.loads(t.function.arguments) for t in c.message.tool_calls or []] or \
            c.finish_reason == "length"
    assert one >= 19, one


@pytest.mark.parametrize("strict", [False, True])
def test_json_schema_keys_are_the_declared_ones_and_integers_short(srv, strict):
    client = _client(srv)
    for seed in SEEDS:
        r = client.chat.completions.create(model=MODEL, messages=ASK, seed=seed, max_tokens=200, **SAMPLED,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "place", "schema": PLACE, "strict": strict}})
        c = r.choices[0]
        assert c.finish_reason == "stop", (seed, c.message.content)
        obj = json.loads(c.message.content)
        assert set(obj) == {"name", "population"}, (seed, obj)
        assert len(str(abs(obj["population"]))) <= 16, (seed, obj)


def test_ollama_format_objects_are_closed_too(srv):
    import ollama

    client = ollama.Client(host=srv.url, timeout=120)
    for seed in range(5):
        r = client.chat(model=MODEL, messages=ASK, format=PLACE,
                        options={"seed": seed, "temperature": 1.0, "num_predict": 200})
        obj = json.loads(r.message.content)
        assert set(obj) == {"name", "population"} and len(str(abs(obj["population"]))) <= 16, obj


def test_openai_parse_a_model_and_a_forced_tool(srv):
    import openai

    client = _client(srv)
    r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=City, seed=0, max_tokens=200,
                                      **SAMPLED)
    assert isinstance(r.choices[0].message.parsed, City)
    tool = openai.pydantic_function_tool(GetWeather)
    r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[tool], seed=1, max_tokens=120,
                                      tool_choice={"type": "function", "function": {"name": "GetWeather"}},
                                      **SAMPLED)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    assert isinstance(c.message.tool_calls[0].function.parsed_arguments, GetWeather)


def test_openai_streamed_tools_give_no_content_events(srv):
    import openai

    client = _client(srv)
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
                                        tool_choice="required", seed=2, max_tokens=120, **SAMPLED) as s:
        kinds = {e.type for e in s}
        final = s.get_final_completion()
    assert "content.delta" not in kinds and "tool_calls.function.arguments.done" in kinds, kinds
    c = final.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert isinstance(c.message.tool_calls[0].function.parsed_arguments, GetWeather)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes_return_the_model(srv, mode):
    instructor = pytest.importorskip("instructor")

    client = instructor.from_openai(_client(srv), mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(model=MODEL, messages=ASK, response_model=City, max_retries=0,
                                          seed=3, max_tokens=200, **SAMPLED)
    assert isinstance(city, City)
