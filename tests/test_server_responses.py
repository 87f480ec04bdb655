"""OpenAI's Responses API (/v1/responses) through the official openai client: text, the typed
stream and the SDK's stream helper, function calls and their outputs, previous_response_id
with the prefix cache, json_schema output, reasoning items, truncation and errors.

Tiny random-weight models carry real published templates (Qwen 2.5 with tools, Qwen 3 with
thinking), greedy unless a test says otherwise; a scripted Qwen 3 model (a real model whose
`chat` replays a fixed answer) pins the exact shapes of reasoning and parallel calls.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field, StringConstraints

import edgeinfer
from gguf_factory import write_tiny_model
from scripted_chat import served
from test_server import MODEL, start_server
from test_server_tools import SCRIPT, SMALL, TEMPLATES, _vocab

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False},
           "strict": True}
SEARCH = {"type": "function", "name": "search", "description": "Web search",
          "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20}},
                         "required": ["query"], "additionalProperties": False}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, SEARCH)}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv-responses")
    vocab, n = _vocab()
    eos = {"tokenizer.ggml.eos_token_id": n + 1}
    return {
        "qwen25": write_tiny_model(root / "qwen25.gguf", "qwen2", "F32", vocab=vocab, shape=SMALL, seed=5,
                                   chat_template=TEMPLATES["qwen2.5-instruct"], extra_metadata=eos),
        "qwen3": write_tiny_model(root / "qwen3.gguf", "qwen2", "F32", vocab=vocab, shape=SMALL, seed=7,
                                  chat_template=TEMPLATES["qwen3"], extra_metadata=eos),
    }


def _load(path, n_ctx=4096):
    return edgeinfer.load(str(path), n_ctx=n_ctx, threads=1, download=False)


@pytest.fixture(scope="module")
def live(paths):
    srv = start_server(_load(paths["qwen25"]))
    yield srv
    srv.stop()


def client_of(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def client(live):
    return client_of(live)


class Recorder:
    """Wraps `model.chat` to record the messages (and keywords) each request renders."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []
        self._real = model.chat

    def __enter__(self):
        def chat(messages, **kw):
            self.calls.append((messages, kw))
            return self._real(messages, **kw)

        self.model.chat = chat
        return self

    def __exit__(self, *exc) -> None:
        del self.model.chat


# -- text ------------------------------------------------------------------------------------------

def test_text_whole_and_streamed(live, client):
    with Recorder(live.state.model) as rec:
        chat = client.chat.completions.create(model=MODEL, max_tokens=6, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}])
        r = client.responses.create(model=MODEL, instructions="Be brief.", input="hello there", max_output_tokens=6)
    assert rec.calls[0][0] == rec.calls[1][0]  # the same conversation, rendered the same
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.instructions == "Be brief." and r.max_output_tokens == 6 and r.tools == [] and r.tool_choice == "auto"
    assert r.output_text == chat.choices[0].message.content
    msg = r.output[0]
    assert (msg.type, msg.role, msg.content[0].type, msg.content[0].annotations) == \
        ("message", "assistant", "output_text", [])
    assert msg.id.startswith("msg_") and len(r.output) == 1
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == r.usage.input_tokens - 1  # the same prompt again
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    if r.usage.output_tokens == 6:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert msg.status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None and msg.status == "completed"

    # the typed stream: every event numbered in order, the same text
    events = list(client.responses.create(model=MODEL, instructions="Be brief.", input="hello there",
                                          max_output_tokens=6, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{r.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and deltas
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(d.delta for d in deltas) == r.output_text == events[-4].text
    assert events[-1].response.output_text == r.output_text and events[-1].response.id == events[0].response.id
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens

    # the SDK's stream helper reads the same events (a cut-off answer ends in response.incomplete,
    # which its get_final_response does not take: test_reasoning_goes_back_and_effort completes one)
    with client.responses.stream(model=MODEL, instructions="Be brief.", input="hello there",
                                 max_output_tokens=6) as stream:
        seen = list(stream)
    assert [e.type for e in seen] == kinds and seen[-1].response.output_text == r.output_text


def test_message_items_and_parts(live, client):
    """Input items as the SDK sends them: easy messages, typed messages with text parts,
    developer messages (system, for a template without that role), echoed assistant text."""
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                             {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Salut", "annotations": []}]},
             {"role": "user", "content": "Again"}]
    with Recorder(live.state.model) as rec:
        r = client.responses.create(model=MODEL, input=items, max_output_tokens=2)
    assert r.status in ("completed", "incomplete")
    assert rec.calls[0][0] == [{"role": "system", "content": "Answer in French."},
                               {"role": "user", "content": "Hi\n\nthere"},
                               {"role": "assistant", "content": "Salut"}, {"role": "user", "content": "Again"}]


# -- function calls --------------------------------------------------------------------------------

def test_function_call_and_its_output(live, client):
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, SEARCH], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=300)
    assert r.status == "completed" and r.tool_choice == "required" and r.parallel_tool_calls is False
    assert [t.name for t in r.tools] == ["get_weather", "search"] and r.tools[0].strict is True
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.output_text == ""
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # a named function, streamed: the same call (greedy), arguments as delta and done
    named = {"type": "function", "name": call.name}
    events = list(client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, SEARCH], tool_choice=named,
                                          parallel_tool_calls=False, max_output_tokens=300, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == json.loads(call.arguments)
    with client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER, SEARCH], tool_choice=named,
                                 parallel_tool_calls=False, max_output_tokens=300) as s:
        final = s.get_final_response()
    assert [(o.name, json.loads(o.arguments)) for o in final.output if o.type == "function_call"] == \
        [(call.name, json.loads(call.arguments))]

    # the call's output goes back with the call: the template renders both
    history = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True) for o in r.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 18}'}]
    with Recorder(live.state.model) as rec:
        second = client.responses.create(model=MODEL, input=history, tools=[WEATHER, SEARCH], tool_choice="none",
                                         max_output_tokens=4)
    assert all(o.type == "message" for o in second.output)
    messages, kw = rec.calls[-1]
    assert messages[1]["tool_calls"] == [{"id": call.call_id, "type": "function", "function": {
        "name": call.name, "arguments": call.arguments}}]
    assert messages[2] == {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": '{"temp": 18}'}
    assert kw["tool_choice"] == "none" and [t["function"]["name"] for t in kw["tools"]] == ["get_weather", "search"]
    assert second.usage.input_tokens > r.usage.input_tokens


# -- previous_response_id --------------------------------------------------------------------------

def test_previous_response_id_goes_on_with_cached_tokens(live, client):
    import openai

    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Tell me a story.",
                                    max_output_tokens=4, metadata={"run": "1"})
    assert first.store is True and first.metadata == {"run": "1"}
    with Recorder(live.state.model) as rec:
        second = client.responses.create(model=MODEL, instructions="Be brief.", input="And then?",
                                         previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id
    assert rec.calls[0][0] == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Tell me a story."},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "And then?"}]
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens > 0  # the first prompt (and some of its answer) from the cache
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 2
    # the chain goes on; instructions are not carried over
    with Recorder(live.state.model) as rec:
        third = client.responses.create(model=MODEL, input="The end.", previous_response_id=second.id,
                                        max_output_tokens=2)
    assert [m["role"] for m in rec.calls[0][0]] == ["user", "assistant", "user", "assistant", "user"]
    assert third.status in ("completed", "incomplete")

    # stored responses: GET, DELETE; store: false keeps nothing
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    loose = client.responses.create(model=MODEL, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="y", previous_response_id=loose.id, max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    # an item of a stored response, by reference
    with Recorder(live.state.model) as rec:
        client.responses.create(model=MODEL, max_output_tokens=1, input=[
            {"type": "item_reference", "id": second.output[0].id}, {"role": "user", "content": "ok"}])
    assert rec.calls[0][0][0] == {"role": "assistant", "content": second.output_text}


def test_previous_response_id_streamed(client):
    first = client.responses.create(model=MODEL, input="Count to three.", max_output_tokens=3)
    with client.responses.stream(model=MODEL, input="Go on.", previous_response_id=first.id,
                                 max_output_tokens=1) as s:
        events = list(s)
    final = events[-1].response
    assert final.previous_response_id == first.id
    assert final.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(final.id).id == final.id  # streamed responses are stored too


# -- structured output -----------------------------------------------------------------------------

def test_json_schema_output(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model=MODEL, input="Describe a person as JSON.", text={"format": fmt},
                                max_output_tokens=200)
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"

    class Person(BaseModel):  # bounded, so that the answer ends within max_output_tokens
        name: Annotated[str, StringConstraints(min_length=1, max_length=8)]
        age: Annotated[int, Field(ge=0, le=120)]
        role: Literal["admin", "user", "guest"]

    parsed = client.responses.parse(model=MODEL, input="Describe a person as JSON.", text_format=Person,
                                    max_output_tokens=200)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    with client.responses.stream(model=MODEL, input="Describe a person as JSON.", text={"format": fmt},
                                 max_output_tokens=200) as s:  # streamed: the same, through the SDK's helper
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    assert text == s.get_final_response().output_text == r.output_text
    anything = client.responses.create(model=MODEL, input="Any JSON object.", max_output_tokens=200,
                                       text={"format": {"type": "json_object"}})
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)
    else:
        assert anything.output_text.lstrip().startswith("{")


# -- reasoning and parallel calls, from a scripted answer --------------------------------------------

@pytest.fixture(scope="module")
def scripted(paths):
    yield from served(_load(paths["qwen3"]), SCRIPT, piece=5)


def test_reasoning_and_parallel_calls(scripted):
    srv, fake = scripted
    client = client_of(srv)
    tools = [WEATHER, SEARCH]
    r = client.responses.create(model=MODEL, input=ASK, tools=tools)
    assert [o.type for o in r.output] == ["reasoning", "function_call", "function_call"]
    thought = r.output[0]
    assert thought.id.startswith("rs_") and thought.summary == []
    assert [(c.type, c.text) for c in thought.content] == [("reasoning_text", "The user wants weather and news.")]
    assert [(o.name, json.loads(o.arguments)) for o in r.output[1:]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("search", {"query": "Paris news"})]
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert fake.calls[-1]["tools"][0]["function"]["name"] == "get_weather"
    assert "strict" not in fake.calls[-1]["tools"][0]["function"]
    # streamed: the same items, reasoning as reasoning_text events
    events = list(client.responses.create(model=MODEL, input=ASK, tools=tools, stream=True))
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds.count("response.function_call_arguments.done") == 2
    final = events[-1].response
    assert final.status == "completed" and final.usage.output_tokens_details.reasoning_tokens > 0
    assert [o.model_dump(exclude={"id", "call_id"}) for o in final.output] == \
        [o.model_dump(exclude={"id", "call_id"}) for o in r.output]
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == thought.content[0].text
    with client.responses.stream(model=MODEL, input=ASK, tools=tools) as s:
        assert [o.type for o in s.get_final_response().output] == ["reasoning", "function_call", "function_call"]


def test_reasoning_goes_back_and_effort(scripted):
    import openai

    srv, fake = scripted
    client = client_of(srv)
    with fake.answering("<think>\nhm\n</think>\n\nHello!"):
        r = client.responses.create(model=MODEL, input="Hi", include=["reasoning.encrypted_content"])
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Hello!"
        sealed = r.output[0].encrypted_content
        assert sealed and "hm" not in sealed
        with client.responses.stream(model=MODEL, input="Hi") as s:  # the SDK's helper completes it
            final = s.get_final_response()
        assert final.status == "completed" and final.output_text == "Hello!"
        assert [(o.type, o.status) for o in final.output] == [("reasoning", "completed"), ("message", "completed")]
        assert final.output[0].content[0].text == "hm" and final.output[0].encrypted_content is None
        # the reasoning goes back with the answer: as content, or sealed (store: false clients)
        for item in (r.output[0].model_dump(exclude_none=True),
                     {"type": "reasoning", "id": "rs_x", "summary": [], "encrypted_content": sealed}):
            client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hi"}, item,
                                                        r.output[1].model_dump(exclude_none=True),
                                                        {"role": "user", "content": "And?"}])
            assert fake.calls[-1]["messages"][1] == {"role": "assistant", "content": "Hello!",
                                                     "reasoning_content": "hm"}
        client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "none"})
        assert fake.calls[-1]["enable_thinking"] is False
        client.responses.create(model=MODEL, input="Hi", reasoning={"summary": "auto"})
        assert "enable_thinking" not in fake.calls[-1]
        for reasoning, param in (({"effort": "high"}, "reasoning.effort"),
                                 ({"summary": "detailed"}, "reasoning.summary")):
            with pytest.raises(openai.BadRequestError) as e:
                client.responses.create(model=MODEL, input="Hi", reasoning=reasoning)
            assert e.value.body["param"] == param, e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input=[
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA-from-elsewhere"},
                {"role": "user", "content": "Hi"}])
        assert e.value.body["param"] == "input[0].encrypted_content"


def test_a_failure_after_the_headers_is_an_error_event_then_failed(scripted, monkeypatch):
    import openai

    from edgeinfer.results import GenerationChunk

    srv, fake = scripted

    def slow(messages, *, stream=True, cancel=None, **kw):
        for i in range(50):
            yield GenerationChunk(text="word ", token=i)
            if cancel is not None and cancel.wait(0.05):
                return

    monkeypatch.setattr(srv.state.config, "timeout_s", 0.4)
    monkeypatch.setattr(fake.model, "chat", slow)
    client = client_of(srv)
    events = list(client.responses.create(model=MODEL, input="Hi", stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "timeout" and events[-1].response.status == "failed"
    assert events[-1].response.error.code == "timeout"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(model=MODEL, input="Hi")
    assert e.value.status_code == 504


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    import test_harmony as h

    path = write_tiny_model(tmp_path_factory.mktemp("srv-responses-harmony") / "gptoss.gguf", "gpt-oss", "F32",
                            vocab=h.harmony_vocab(), shape=h.SMALL, seed=11, chat_template=h.TEMPLATE)
    yield from served(_load(path), h.SCRIPT)


def test_harmony_channels_as_items(harmony):
    """gpt-oss: the analysis channel is a reasoning item, a commentary call a function_call,
    and both go back through the template; `reasoning.effort` is its level."""
    import openai
    from test_harmony import ANSWER

    srv, fake = harmony
    client = client_of(srv)
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], reasoning={"effort": "low"})
    assert fake.calls[-1]["reasoning_effort"] == "low" and r.reasoning.effort == "low"
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == "The user wants weather."
    call = r.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "unit": "celsius"})
    with fake.answering(ANSWER):
        history = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": ASK},
                   *[o.model_dump(exclude_none=True) for o in r.output],
                   {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 18}'}]
        final = client.responses.create(model=MODEL, input=history, tools=[WEATHER])
        assert final.output_text == "It is 18 °C." and final.output[0].content[0].text == "Easy one."
    sent = fake.calls[-1]["messages"]
    assert sent[0] == {"role": "developer", "content": "Be brief."}  # the template knows the role
    assert sent[2]["reasoning_content"] == "The user wants weather." and sent[2]["tool_calls"][0]["id"] == call.call_id
    assert sent[3]["role"] == "tool" and sent[3]["name"] == "get_weather"
    with pytest.raises(openai.BadRequestError) as e:  # gpt-oss always reasons
        client.responses.create(model=MODEL, input=ASK, reasoning={"effort": "none"})
    assert e.value.body["param"] == "reasoning.effort"


# -- truncation ------------------------------------------------------------------------------------

def test_truncation_auto_leaves_out_the_oldest_turns(paths):
    import openai

    model = _load(paths["qwen25"], n_ctx=256)
    srv = start_server(model)
    try:
        client = client_of(srv)
        words = " ".join(["pear apple plum"] * 4)
        items = [{"role": "system", "content": "Be brief."}]
        for i in range(6):
            items += [{"role": "user", "content": f"{i}: {words}"}, {"role": "assistant", "content": f"ok {i}"}]
        items.append({"role": "user", "content": "Last question?"})
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input=items, max_output_tokens=4)
        assert e.value.body["code"] == "context_length_exceeded"
        with Recorder(model) as rec:
            r = client.responses.create(model=MODEL, input=items, max_output_tokens=4, truncation="auto")
        assert r.truncation == "auto" and r.usage.input_tokens <= 256 - 4
        kept = rec.calls[0][0]
        assert kept[0] == {"role": "system", "content": "Be brief."} and kept[1]["role"] == "user"
        assert kept[-1]["content"] == "Last question?" and 4 <= len(kept) < len(items)
        assert kept[1:] == items[len(items) - len(kept) + 1:]
    finally:
        srv.stop()


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param, needle", [
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id", "not found"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]", "'web_search_call' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].image_url", "this model has no image input"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", "valid string"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "'user'"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]}, "input[0].arguments", "required"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}, "input[0].call_id",
     "no function_call"),
    ({"input": [{"type": "item_reference", "id": "msg_nope"}]}, "input[0].id", "no stored item"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "function tools only"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice",
     "allowed_tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text.format.schema", "invalid"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"input": "x", "temperature": 3}, "temperature", "less than or equal"),
    ({"input": "x", "seed": 1}, "seed", "unsupported field"),
    ({}, "input", "nothing to answer"),
])
def test_bad_requests_are_400s_in_openai_shape(live, body, param, needle):
    r = httpx.post(live.url + "/v1/responses", json={"model": MODEL, "max_output_tokens": 1, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and needle in err["message"], err


def test_the_sdk_sees_errors_and_the_endpoint_is_documented(live, client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")
    assert e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[{"type": "computer_call_output", "call_id": "c", "output": {}}])
    assert "computer_call_output" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-5", input="x")
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    doc = httpx.get(live.url + "/openapi.json", timeout=30).json()
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/ResponsesRequest")
    assert {"get", "delete"} <= set(doc["paths"]["/v1/responses/{response_id}"])


# -- the store: bounded, least recently used out ---------------------------------------------------

def test_the_store_is_bounded_least_recently_used_out():
    from edgeinfer.server.responses_store import ResponseStore

    def response(i: int, pad: int = 0) -> dict:
        return {"id": f"resp_{i}", "output": "x" * pad}

    store = ResponseStore(max_entries=3, max_bytes=9_050)
    for i in range(3):
        store.put(response(i), [{"id": f"msg_{i}"}])
    assert store.get("resp_0") is not None   # used: now the most recent
    store.put(response(3), [])
    assert [store.get(f"resp_{i}") is not None for i in range(4)] == [True, False, True, True]
    assert store.find_item("msg_1") is None and store.find_item("msg_0") == {"id": "msg_0"}
    # the byte bound: one large response pushes out the oldest until the rest fit
    store.put(response(4, pad=9_000), [])
    assert len(store) == 1 and store.get("resp_4") is not None
    store.put(response(5, pad=9_050), [])   # larger than the whole store: not kept, nothing lost
    assert store.get("resp_5") is None and store.get("resp_4") is not None
    store.put(response(4), [])   # the same id again: replaced, its bytes counted once
    for i in (6, 7):
        store.put(response(i), [])
    assert len(store) == 3 and store.delete("resp_4") and not store.delete("resp_4") and len(store) == 2


def test_an_evicted_response_cannot_be_continued(live, client, monkeypatch):
    import openai

    from edgeinfer.server.responses_store import ResponseStore, store_of

    monkeypatch.setattr(live.app.state, "responses", ResponseStore(max_entries=3), raising=False)
    first = client.responses.create(model=MODEL, input="one", max_output_tokens=1)
    second = client.responses.create(model=MODEL, input="two", max_output_tokens=1)
    client.responses.create(model=MODEL, input="three", previous_response_id=first.id, max_output_tokens=1)
    client.responses.create(model=MODEL, input="four", max_output_tokens=1)
    assert len(store_of(live.app)) == 3
    with pytest.raises(openai.BadRequestError) as e:   # "two", the least recently used, went out
        client.responses.create(model=MODEL, input="five", previous_response_id=second.id, max_output_tokens=1)
    assert e.value.body["code"] == "previous_response_not_found"
    again = client.responses.create(model=MODEL, input="six", previous_response_id=first.id, max_output_tokens=1)
    assert again.previous_response_id == first.id   # continued from, so kept
