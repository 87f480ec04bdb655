"""Gemma 4's chat format: its thought channel and tool calls read (whole and streamed in every
chunking), its value notation, the history as its template reads it, the call grammar, and the
family through `edgeinfer run`, the TUI and the three API dialects.

The model is a tiny gemma4 with Gemma 4's markup as control tokens and a template in its format
(gguf_factory.GEMMA4_CHAT_TEMPLATE). Random weights cannot write the format, so the dialect
tests replay a scripted answer (as tests/test_harmony.py does); a forced call (tool_choice
"required") and plain answers run through the real pipeline.
"""

from __future__ import annotations

import io
import json

import pytest
from gguf_factory import GEMMA4_CHAT_TEMPLATE, GEMMA4_OLD_CHAT_TEMPLATE, gemma4_file, gemma4_vocab
from scripted_chat import served
from test_server import MODEL, start_server

import edgeinfer
from edgeinfer.prompt import gemma4_format, tool_calls
from edgeinfer.prompt.answer_parts import ToolCall
from edgeinfer.prompt.shown_answer import ShownAnswer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}},
        "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "<|channel>thought\nThe user wants weather.\n<channel|>"
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>'
SCRIPT = THOUGHT + CALL
ANSWER = "<|channel>thought\nEasy one.\n<channel|>It is 18 °C."


# -- reading answers -------------------------------------------------------------------------------

CASES = [  # name, text, tools, reasoning, content, calls
    ("plain", "Hello there.", True, None, "Hello there.", []),
    ("thought and answer", ANSWER, True, "Easy one.", "It is 18 °C.", []),
    ("thought and call", SCRIPT, True, "The user wants weather.", "",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("turn reopened", "<|turn>model\n" + ANSWER, True, "Easy one.", "It is 18 °C.", []),
    ("empty thought", "<|channel>thought\n<channel|>Hi.", True, None, "Hi.", []),
    ("stray close and empty channel", "Hi<channel|> there<|channel>", True, None, "Hi there", []),
    ("two calls and text", 'Sure.<|tool_call>call:a{}<tool_call|><|tool_call>call:b{x:[1,2.5,true,null]}<tool_call|>',
     True, None, "Sure.", [("a", {}), ("b", {"x": [1, 2.5, True, None]})]),
    ("no tools: a call is text", CALL, False, None, CALL, []),
    ("cut-off call dropped", 'Let me check.<|tool_call>call:get_weather{city:<|"|>Pa', True, None, "Let me check.", []),
    ("unreadable call dropped", "<|tool_call>call:get_weather{city Paris}<tool_call|>ok", True, None, "ok", []),
    ("cut-off thought", "<|channel>thought\nstill thinking", True, "still thinking", "", []),
]


def _events(text: str, pieces: list[str], tools: bool):
    s = tool_calls.answer_stream("gemma4", reasoning=True, tools=tools)
    events = [e for p in pieces for e in s.push(p)] + s.flush()
    reasoning = "".join(v for k, v in events if k == "reasoning")
    content = "".join(v for k, v in events if k == "content")
    return reasoning or None, content, [(c.name, c.arguments) for k, c in events if k == "tool_call"]


@pytest.mark.parametrize("name,text,tools,reasoning,content,calls", CASES, ids=[c[0] for c in CASES])
def test_parse_whole_and_every_chunking(name, text, tools, reasoning, content, calls):
    whole = tool_calls.parse_output(text, "gemma4", reasoning=True, tools=tools)
    assert (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.tool_calls]) == \
        (reasoning, content, calls)
    for size in (1, 2, 3, 5, 8):
        r, c, k = _events(text, [text[i:i + size] for i in range(0, len(text), size)], tools)
        assert (r, c.strip(), k) == (reasoning, content, calls), size
    for cut in range(1, len(text)):  # every two-piece split
        r, c, k = _events(text, [text[:cut], text[cut:]], tools)
        assert (r, c.strip(), k) == (reasoning, content, calls), cut


def test_the_stream_is_incremental():
    s = gemma4_format.Gemma4Stream()
    assert s.push("<|channel>thought\nLet me") == [("reasoning", "Let me")]
    assert s.push(" see.\n<chan") == [("reasoning", " see.")]  # the maybe-close is held
    assert s.push("nel|>It is") == [("content", "It is")]
    assert s.push(" <|tool_") == [("content", " ")]
    events = s.push('call>call:f{a:1}<tool_call|>') + s.flush()
    assert [k for k, _ in events] == ["tool_call"] and events[0][1].arguments == {"a": 1}


@pytest.mark.parametrize("text,value", [
    ('{a:<|"|>x, "y"<|"|>,b:-3,c:1.5e2,d:[],e:{},f:[{g:true}]}',
     {"a": 'x, "y"', "b": -3, "c": 150.0, "d": [], "e": {}, "f": [{"g": True}]}),
    ('{<|"|>quoted key<|"|>:null}', {"quoted key": None}),
    ('{s:"a JSON string\\n"}', {"s": "a JSON string\n"}),
    ("[ 1 , 2 ]", [1, 2]),
])
def test_values(text, value):
    assert gemma4_format.read_value(text)[0] == value


@pytest.mark.parametrize("text", ['{a:<|"|>open', "{a:1", "{:1}", "{a 1}", "[1,", "bare", "{a:@}",
                                  "[" * 5000 + "]" * 5000])
def test_bad_values_are_refused_not_crashes(text):
    with pytest.raises(gemma4_format.NotAValue):
        gemma4_format.read_value(text)


def test_calls_are_valid_openai_calls():
    call = gemma4_format.read_call('call:get_weather{city:<|"|>Paris<|"|>}')
    assert isinstance(call, ToolCall) and json.loads(call.openai()["function"]["arguments"]) == {"city": "Paris"}
    for bad in ("get_weather{}", "call:{}", "call:a b{}", "call:f[1]", "call:f{} trailing"):
        assert gemma4_format.read_call(bad) is None, bad


# -- the history -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("g4chat")
    return {name: gemma4_file(root, "Q8_0", name=f"{name}.gguf", vocab=gemma4_vocab(), chat_template=t)
            for name, t in (("new", GEMMA4_CHAT_TEMPLATE), ("old", GEMMA4_OLD_CHAT_TEMPLATE))}


def _load(path):
    return edgeinfer.load(str(path), n_ctx=1024, threads=1, download=False)


def test_the_format_and_its_markup_tokens(paths):
    model = _load(paths["new"])
    tok = model.tokenizer
    assert model.tool_format == "gemma4" and tool_calls.detect_format(GEMMA4_OLD_CHAT_TEMPLATE) == "gemma4"
    ids = tok.tokenize(SCRIPT, add_special=False, parse_special=True)
    assert tok.token_id("<|channel>") in ids and tok.token_id('<|"|>') in ids
    assert tok.detokenize(ids, skip_special=True) == "thought\nThe user wants weather.\ncall:get_weather" \
        "{city:Paris,unit:celsius}"  # control tokens: hidden unless shown
    shown = tool_calls.markup_token_ids(tok, "gemma4")
    assert shown == {tok.token_id(t) for t in gemma4_format.MARKUP}
    decoder = tok.stream(skip_special=True, as_pieces=True)
    decoder.shown = shown
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == SCRIPT


def test_tools_calls_and_results_render_in_gemmas_notation(paths):
    model = _load(paths["new"])
    history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"}]
    text = tool_calls.render_with_tools(model.template, history, [WEATHER], add_bos=False, enable_thinking=True)
    assert text.startswith("<bos><|turn>system\n<|think|>\n<|tool>declaration:get_weather")
    assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>' in text
    assert '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>' in text
    assert text.endswith("<|turn>model\n")


def test_a_kept_answer_goes_back_without_its_thought(paths):
    """`edgeinfer run` and the TUI keep the shown answer (`<think>` block first): the template gets
    the reasoning as reasoning_content, the content without it."""
    model = _load(paths["new"])
    kept = "<think>\nEasy one.\n</think>\n\nIt is 18 °C."
    history = ASK + [{"role": "assistant", "content": kept}, {"role": "user", "content": "And Rome?"}]
    msgs = gemma4_format.template_messages(history, GEMMA4_CHAT_TEMPLATE)
    assert msgs[1] == {"role": "assistant", "content": "It is 18 °C.", "reasoning_content": "Easy one."}
    text = tool_calls.render_with_tools(model.template, history, add_bos=False)
    assert "<|turn>model\nIt is 18 °C.<turn|>" in text and "<think>" not in text


def test_an_old_template_gets_tool_responses_and_the_turn_reopened(paths):
    """Templates before the official one read results only from the assistant's `tool_responses`
    (llama.cpp's convert_tool_responses_gemma4) and leave the model's turn closed after them."""
    model = _load(paths["old"])
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'}]
    folded = gemma4_format.template_messages(tool_calls.normalize_messages(history), GEMMA4_OLD_CHAT_TEMPLATE)
    assert len(folded) == 2 and folded[1]["tool_responses"] == [{"name": "get_weather", "response": {"temp": 18}}]
    text = tool_calls.render_with_tools(model.template, history, [WEATHER], add_bos=False)
    assert "<|tool_response>response:get_weather{value:{'temp': 18}}<tool_response|><turn|>\n<|turn>model\n" \
        in text and text.endswith("<|turn>model\n")


# -- the call grammar ------------------------------------------------------------------------------

def test_the_grammar_shapes_calls_by_the_schema(paths):
    """tool_choice "required": the schema's keys in order, required ones always, enums, bounded
    strings; "auto": free text until the call marker; "none": nothing."""
    from oracles import grammar_admits

    tok = _load(paths["new"]).tokenizer
    forced = tool_calls.tool_constraint([WEATHER], "required", "gemma4", tok)

    def accepts(constraint, text: str) -> bool:
        return grammar_admits(constraint, tok, text, complete=True)

    assert accepts(forced, CALL) and accepts(forced, THOUGHT + CALL)
    assert accepts(forced, '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>,days:3}<tool_call|>')
    for bad in ('<|tool_call>call:get_weather{unit:<|"|>celsius<|"|>}<tool_call|>',  # city is required
                '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>kelvin<|"|>}<tool_call|>',
                '<|tool_call>call:get_weather{unit:<|"|>celsius<|"|>,city:<|"|>Paris<|"|>}<tool_call|>',
                '<|tool_call>call:get_weather{city:<|"|>a much too long city<|"|>}<tool_call|>',
                '<|tool_call>call:other{}<tool_call|>', "Sure." + CALL):
        assert not accepts(forced, bad), bad
    auto = tool_calls.tool_constraint([WEATHER], "auto", "gemma4", tok)
    assert accepts(auto, "Just text.") and accepts(auto, "Let me look." + CALL)
    assert not accepts(auto, "Let me look." + '<|tool_call>call:get_weather{}<tool_call|>')
    assert tool_calls.tool_constraint([WEATHER], "none", "gemma4", tok) is None


def test_a_required_call_through_the_real_pipeline(paths):
    """The grammar makes random weights write a Gemma 4 call valid against the schema, its
    markup reaches the text, and the OpenAI dialect returns it as a call."""
    import jsonschema
    import openai

    model = _load(paths["new"])
    channel = model.tokenizer.token_id("<|channel>")
    srv = start_server(model)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        found = None
        for seed in range(24):
            r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                               seed=seed, temperature=1.0, max_tokens=80,
                                               logit_bias={str(channel): -100})  # no thought: straight to the call
            c = r.choices[0]
            assert c.finish_reason in ("tool_calls", "length")
            if c.finish_reason == "tool_calls":
                found = c
                break
        assert found is not None, "no seed finished a call"
        call, = found.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        assert "<|" not in (found.message.content or "")
    finally:
        srv.stop()


# -- the dialects, the CLI and the TUI with a scripted answer ----------------------------------------

@pytest.fixture(scope="module")
def scripted(paths):
    yield from served(_load(paths["new"]), SCRIPT)


@pytest.fixture
def answer_text(scripted):
    with scripted[1].answering(ANSWER) as fake:
        yield fake


@pytest.mark.parametrize("stream", [False, True])
def test_openai_reasoning_and_call(scripted, stream):
    import openai

    srv, fake = scripted
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    if stream:
        with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER]) as s:
            r = s.get_final_completion()
    else:
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content in (None, "")
    assert c.message.model_dump()["reasoning_content"] == "The user wants weather."
    call, = c.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    # the call and its result go back through the template in Gemma's notation
    history = ASK + [c.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER])
    text = tool_calls.render_with_tools(fake.model.template, fake.calls[-1]["messages"], [WEATHER], add_bos=False)
    assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>' in text


def test_openai_answer_streams_without_markup(scripted, answer_text):
    import openai

    srv, _ = scripted
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Easy one."
    assert "".join(d.content or "" for d in deltas) == "It is 18 °C."
    assert not any("<|" in (d.content or "") + (d.model_extra.get("reasoning_content") or "") for d in deltas)


def test_ollama_thinking_and_calls(scripted):
    import ollama

    srv, fake = scripted
    client = ollama.Client(host=srv.url)
    r = client.chat(model=MODEL, messages=ASK, tools=[WEATHER])
    assert r.message.thinking == "The user wants weather." and r.message.content == ""
    assert [(t.function.name, dict(t.function.arguments)) for t in r.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]
    with fake.answering(ANSWER):
        r = client.chat(model=MODEL, messages=ASK, think=True)
        assert (r.message.thinking, r.message.content) == ("Easy one.", "It is 18 °C.")
        assert fake.calls[-1]["enable_thinking"] is True
        client.chat(model=MODEL, messages=ASK, think=False)
        assert fake.calls[-1]["enable_thinking"] is False


def test_the_cli_shows_the_thought_as_a_think_block(scripted, answer_text):
    from edgeinfer.commands.answer import answer

    _, fake = scripted
    out = io.StringIO()
    text = answer(fake.model, ASK, {}, raw=False, verbose=False, out=out, err=io.StringIO())
    assert text == "<think>\nEasy one.\n</think>\n\nIt is 18 °C." and out.getvalue() == text + "\n"
    view = ShownAnswer(GEMMA4_CHAT_TEMPLATE)
    assert view.push("<|channel>thought\nstill") + view.finish() == "<think>\nstill\n</think>"


# -- the family through every front end, unscripted --------------------------------------------------

def test_run_the_tui_and_the_three_dialects_answer_as_the_python_api(paths, tmp_path, capsys):
    """Greedy plain answers: `edgeinfer run`, OpenAI and Ollama chat, and llama-server's
    /completion each give what the Python API gives; the TUI shows the same answer."""
    from starlette.testclient import TestClient

    from edgeinfer.cli import main
    from edgeinfer.server import ServerConfig, create_app

    path = paths["new"]
    direct = _load(path)
    want = direct.chat(ASK, max_tokens=6, temperature=0).text
    shown = ShownAnswer(GEMMA4_CHAT_TEMPLATE)
    want_shown = shown.push(want) + shown.finish()
    assert main(["run", path, ASK[0]["content"], "-n", "6", "--temp", "0", "-c", "1024", "--threads", "1"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == want_shown
    with TestClient(create_app(ServerConfig(model_name="g4"), _load(path)), base_url="http://127.0.0.1") as c:
        r = c.post("/v1/chat/completions", json={"model": "g4", "messages": ASK, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200
        p = tool_calls.parse_output(want, "gemma4", reasoning=True, tools=False)
        assert r.json()["choices"][0]["message"]["content"] == p.content
        r = c.post("/api/chat", json={"model": "g4", "messages": ASK, "stream": False,
                                       "options": {"num_predict": 6, "temperature": 0}})
        assert r.status_code == 200 and r.json()["message"]["content"] == p.content
        r = c.post("/completion", json={"prompt": "hello there", "n_predict": 6, "temperature": 0})
        assert r.status_code == 200
        assert r.json()["content"] == direct.generate("hello there", max_tokens=6, temperature=0).text
    _tui_answer(path, tmp_path, want_shown)


def _tui_answer(path, tmp_path, want: str) -> None:
    pytest.importorskip("textual")
    import anyio

    from edgeinfer.sessions.conversations import ConversationStore
    from edgeinfer.tui.app import ChatApp
    from edgeinfer.tui.widgets import PromptInput

    app = ChatApp(path, load_model=lambda name, n_ctx: _load(path), store=ConversationStore(tmp_path / "tui"),
                  sampling={"temperature": 0.0, "max_tokens": 6}, n_ctx=1024)

    async def run():
        async with app.run_test(size=(110, 36)) as pilot:
            for _ in range(3000):
                await pilot.pause()
                await app.workers.wait_for_complete()
                if app.model is not None and not app.loading:
                    break
            app.query_one(PromptInput).text = ASK[0]["content"]
            app.query_one(PromptInput).focus()
            await pilot.press("enter")
            for _ in range(3000):
                await pilot.pause()
                await app.workers.wait_for_complete()
                if not app.generating:
                    break
            assert app.conv.messages[-1]["content"] == want

    anyio.run(run)


def test_a_continued_final_message_shows_the_markup_too(paths):
    """llama-server's prefill (continue_final_message) generates from a prompt made outside
    Model.chat: the markup tokens are shown there too, so the reader sees them. A `<|tool_call>`
    pushed by logit_bias, with no tools in the request, is content the reader keeps."""
    from starlette.testclient import TestClient

    from edgeinfer.server import ServerConfig, create_app

    model = _load(paths["new"])
    call = model.tokenizer.token_id("<|tool_call>")
    msgs = ASK + [{"role": "assistant", "content": "Well"}]
    with TestClient(create_app(ServerConfig(model_name="g4"), model), base_url="http://127.0.0.1") as c:
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "temperature": 0,
                                                  "add_generation_prompt": False, "continue_final_message": True,
                                                  "logit_bias": {str(call): 100}})
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "<|tool_call><|tool_call>"
