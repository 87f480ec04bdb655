"""Structured output through the server: OpenAI response_format, Ollama format, llama-server
grammar / json_schema, with the official clients; answers of a tiny random-weight model,
sampled at temperature 1, always validate."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

import edgeinfer
from gguf_factory import TinyShape, bpe_vocab, write_tiny_model
from test_server import MODEL, start_server

SMALL = TinyShape(n_embd=64, n_layer=1, n_head=2, n_head_kv=1, head_dim=32, n_ff=128, n_ctx=1024)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "role": {"enum": ["admin", "user", "guest"]},
                   "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
SAMPLED = {"temperature": 1.0, "top_p": 1.0}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("srv-structured") / "qwen.gguf", "qwen2", "F32",
                            vocab=bpe_vocab("qwen2"), shape=SMALL, seed=3)
    srv = start_server(edgeinfer.load(str(path), n_ctx=1024, threads=1, download=False))
    yield srv
    srv.stop()


@pytest.fixture()
def oai(live):
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_json_schema(oai, stream):
    for seed in range(3):
        kw = dict(model=MODEL, messages=ASK, response_format=SCHEMA_FORMAT, seed=seed, max_tokens=300, **SAMPLED)
        if stream:
            chunks = list(oai.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            c = oai.chat.completions.create(**kw).choices[0]
            text, finish = c.message.content, c.finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def _whitespace_runs(text: str) -> list[str]:
    """Runs of two or more whitespace characters in `text` outside JSON strings."""
    return re.findall(r"\s{2,}", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text))


def test_strict_json_schema_is_compact(oai):
    """Strict json_schema output (response_format's json_schema.strict, the Responses API's
    text.format.strict) compiles to the compact layout: at most one space or newline between
    JSON tokens, so a model sampling at temperature 1 writes no whitespace runs. Without
    strict the schema keeps the pretty-printing layout."""
    from edgeinfer.prompt import grammar
    from edgeinfer.server.constraints import response_format
    from edgeinfer.server.responses_api import _text_format
    from edgeinfer.server.responses_schemas import TextFormat

    compact, loose = grammar.json_schema(PERSON, compact=True).grammar, grammar.json_schema(PERSON).grammar
    assert compact != loose
    for strict, want in ((True, compact), (False, loose), (None, loose)):
        spec = {"name": "person", "schema": PERSON, **({} if strict is None else {"strict": strict})}
        assert response_format({"type": "json_schema", "json_schema": spec}).grammar == want, strict
        fmt = TextFormat.model_validate({"type": "json_schema", **spec})
        assert _text_format(fmt).grammar == want, strict
    for seed in range(4):
        c = oai.chat.completions.create(model=MODEL, messages=ASK, response_format=SCHEMA_FORMAT, seed=seed,
                                        max_tokens=300, **SAMPLED).choices[0]
        assert c.finish_reason == "stop" and _whitespace_runs(c.message.content) == [], c.message.content
        r = oai.responses.create(model=MODEL, input="Describe a person as JSON.", max_output_tokens=300,
                                 temperature=1.0, top_p=1.0,
                                 text={"format": {"type": "json_schema", **SCHEMA_FORMAT["json_schema"]}})
        assert r.status == "completed" and _whitespace_runs(r.output_text) == [], r.output_text
        jsonschema.validate(json.loads(r.output_text), PERSON)


def test_openai_client_parse_helper(oai):
    class Person(BaseModel):
        name: str
        age: int
        admin: bool

    r = oai.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person, seed=1, max_tokens=400,
                                   **SAMPLED)
    msg = r.choices[0].message
    if r.choices[0].finish_reason == "stop":  # free-length strings may run past max_tokens
        assert isinstance(msg.parsed, Person)
    else:
        assert msg.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_openai_json_object(oai, stream):
    for seed in range(3):
        kw = dict(model=MODEL, messages=ASK, response_format={"type": "json_object"}, seed=seed, max_tokens=300,
                  **SAMPLED)
        if stream:
            chunks = list(oai.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            c = oai.chat.completions.create(**kw).choices[0]
            text, finish = c.message.content, c.finish_reason
        if finish == "length":  # any JSON object may run long: it is still one being written
            assert text.lstrip().startswith("{")
            continue
        assert isinstance(json.loads(text), dict)


def test_openai_bad_schemas_are_400s(oai):
    import openai

    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}, "then": {}}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, response_format=bad)
    assert e.value.body["param"] == "response_format.json_schema" and "if" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_schema",
                                                                                "json_schema": {"name": "x"}})
    assert "schema" in e.value.body["message"]
    loop = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}  # admits nothing: a 400, not ""
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": loop}})
    assert "admits no output" in e.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_format(live, stream):
    import ollama

    client = ollama.Client(host=live.url, timeout=120)
    for fmt, check in (("json", lambda v: isinstance(v, dict)), (PERSON, lambda v: jsonschema.validate(v, PERSON)
                                                                  is None)):
        for seed in range(2):
            opts = {"seed": seed, "temperature": 1.0, "num_predict": 300}
            if stream:
                parts = list(client.chat(model=MODEL, messages=ASK, format=fmt, options=opts, stream=True))
                text, reason = "".join(p.message.content for p in parts), parts[-1].done_reason
            else:
                r = client.chat(model=MODEL, messages=ASK, format=fmt, options=opts)
                text, reason = r.message.content, r.done_reason
            if reason == "length" and fmt == "json":
                continue
            assert reason == "stop" and check(json.loads(text)), text
        r = client.generate(model=MODEL, prompt="person:", format=PERSON, options={"seed": 5, "num_predict": 300,
                                                                                   "temperature": 1.0})
        jsonschema.validate(json.loads(r.response), PERSON)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=ASK, format={"type": "object", "properties": {"a": {"type": "nope"}}})
    assert e.value.status_code == 400 and "'format'" in e.value.error


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_llama_server_grammar_and_json_schema(live, stream):
    gbnf = 'root ::= "move " dir (", move " dir)?\ndir ::= "north" | "south" | "east" | "west"'
    bodies = [({"grammar": gbnf}, lambda t: __import__("re").fullmatch(
                   r"move (north|south|east|west)(, move (north|south|east|west))?", t)),
              ({"json_schema": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
              ({"response_format": SCHEMA_FORMAT}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
              ({"response_format": {"type": "json_schema", "json_schema": PERSON}},   # llama-server's short form
               lambda t: jsonschema.validate(json.loads(t), PERSON) is None)]
    with httpx.Client(base_url=live.url, timeout=120) as http:
        for extra, check in bodies:
            for seed in range(2):
                body = {"prompt": "go:", "n_predict": 300, "seed": seed, "temperature": 1.0, "stream": stream, **extra}
                r = http.post("/completion", json=body)
                assert r.status_code == 200, r.text
                if stream:
                    events = _sse(r.text)
                    text, stop_type = "".join(e["content"] for e in events), events[-1]["stop_type"]
                else:
                    text, stop_type = r.json()["content"], r.json()["stop_type"]
                assert stop_type == "eos" and check(text), (extra, text)
        r = http.post("/completion", json={"prompt": "x", "grammar": "root ::= undefined_rule"})
        assert r.status_code == 400 and "grammar" in r.json()["error"]["message"]
        r = http.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "json_schema": {"type": "integer"},
                                       "n_predict": 8})
        assert r.status_code in (200, 400)  # constrained infill, or a model without FIM tokens: never a 500
