"""gpt-oss's harmony format: the parser (whole and streamed in every chunking), the official
template through our sandbox, and the answers' shapes in all three dialects, the CLI and the TUI.

The server tests run a tiny random-weight model carrying the official template and harmony's
special tokens; random weights cannot write harmony, so a scripted `chat` replays fixed
answers (as tests/test_server_tools.py does), and a constrained call (tool_choice
"required") runs through the real pipeline.
"""

from __future__ import annotations

import datetime
import io
import json
import random
import re
from pathlib import Path

import httpx
import pytest
from llama_oracle import importorskip_oracle

import edgeinfer
from edgeinfer.prompt import harmony, tool_calls
from edgeinfer.prompt.chat_template import ChatTemplate
from edgeinfer.prompt.shown_answer import ShownAnswer
from gguf_factory import TinyShape, bpe_vocab, write_tiny_model
from scripted_chat import served
from test_server import MODEL, start_server

DATA = Path(__file__).parent / "data"
TEMPLATE = (DATA / "templates" / "openai-gpt-oss-120b.jinja").read_text()
QWEN3 = (DATA / "templates" / "qwen3.jinja").read_text()
SMALL = TinyShape(n_embd=64, n_layer=1, n_head=2, n_head_kv=1, head_dim=32, n_ff=128, n_ctx=4096)
SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "the city", "maxLength": 12},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Web search",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

A, F = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"


# -- the parser ------------------------------------------------------------------------------------

def _call(name, args):
    return (name, args)


# (id, text, tools, reasoning, content, calls); llama.cpp's own cases (tests/test-chat.cpp) first
CASES = [
    ("final", "<|channel|>final<|message|>Hello, world!\nWhat's up?", True, None, "Hello, world!\nWhat's up?", []),
    ("preamble", "<|channel|>commentary<|message|>Hello, world!", True, None, "Hello, world!", []),
    ("analysis-final", A + "I'm\nthinking<|end|>" + F + "Hello, world!\nWhat's up?", True,
     "I'm\nthinking", "Hello, world!\nWhat's up?", []),
    ("analysis-partial", A + "I'm\nthinking", True, "I'm\nthinking", "", []),
    ("call-in-role", ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', True,
     None, "", [_call("special_function", {"arg1": 1})]),
    ("call-in-channel", '<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', True,
     None, "", [_call("special_function", {"arg1": 1})]),
    ("call-constrain", ' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}',
     True, None, "", [_call("special_function", {"arg1": 1})]),
    ("call-commentary", '<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', True,
     None, "", [_call("special_function", {"arg1": 1})]),
    ("reasoning-call", A + "I'm\nthinking<|end|><|start|>assistant to=functions.special_function"
     '<|channel|>analysis<|message|>{"arg1": 1}', True, "I'm\nthinking", "", [_call("special_function", {"arg1": 1})]),
    ("complex-call", A + "Thinking about edit...<|end|><|start|>assistant<|channel|>commentary to=functions.edit "
     '<|constrain|>json<|message|>{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", '
     '"replaceAll": false}', True, "Thinking about edit...", "",
     [_call("edit", {"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {",
                     "replaceAll": False})]),
    ("stray-before-analysis", "<|channel|>commentary to=assistant" + A + "I'm\nthinking<|end|>" + F + "Hi", True,
     "I'm\nthinking", "Hi", []),
    ("stray-before-final", A + "I'm\nthinking<|end|><|start|>assistant<|channel|>commentary to=assistant"
     "<|channel|>final<|message|>Hi", True, "I'm\nthinking", "Hi", []),
    # built-in tools are not functions: llama.cpp drops them, we keep them as written
    ("builtin-python", A + "run it<|end|><|start|>assistant to=container.exec<|channel|>commentary<|message|>ls",
     True, "run it", "<|start|>assistant to=container.exec<|channel|>commentary<|message|>ls", []),
    # -- beyond llama.cpp's cases
    ("final-only-ends", "<|channel|>final<|message|>Hi<|return|>", True, None, "Hi", []),
    ("call-ends", '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": [1, 2]}<|call|>', True,
     None, "", [_call("f", {"a": [1, 2]})]),
    ("call-no-constrain", '<|channel|>commentary to=functions.f json<|message|>{"a": 1}', True, None, "",
     [_call("f", {"a": 1})]),
    ("call-bare", '<|channel|>commentary to=functions.f<|message|> {"a": 1} ', True, None, "", [_call("f", {"a": 1})]),
    ("template-form", '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>', True,
     None, "", [_call("f", {"a": 1})]),
    ("several-calls", A + "two calls<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
     '<|constrain|>json<|message|>{"city": "Paris"}<|call|><|start|>assistant<|channel|>commentary '
     'to=functions.search <|constrain|>json<|message|>{"query": "news"}<|call|>', True, "two calls", "",
     [_call("get_weather", {"city": "Paris"}), _call("search", {"query": "news"})]),
    ("preamble-then-call", "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>commentary"
     ' to=functions.f <|constrain|>json<|message|>{}', True, None, "Let me look.", [_call("f", {})]),
    ("two-analyses", A + "one<|end|><|start|>assistant" + A + "two<|end|>" + F + "x", True, "onetwo", "x", []),
    ("empty-analysis", A + "<|end|>" + F + "x", True, None, "x", []),
    ("unicode", A + "héllo 【1†L2】<|end|>" + F + "日本語 ✓", True, "héllo 【1†L2】", "日本語 ✓", []),
    ("end-skipped", A + "r<|start|>assistant<|channel|>final<|message|>c", True, "r", "c", []),
    ("angle-brackets", "<|channel|>final<|message|>a < b <| c |> <|x", True, None, "a < b <| c |> <|x", []),
    # no harmony at all (another model's habit, random weights): all content
    ("no-channels", "Hello there, 2 < 3", True, None, "Hello there, 2 < 3", []),
    ("bad-start", "<|start|>something else", True, None, "<|start|>something else", []),
    ("too-long-header", "<|channel|>" + "x " * 400 + "<|message|>y", True, None,
     "<|channel|>" + "x " * 400 + "<|message|>y", []),
    # cut off inside a header: structure only, nothing to show
    ("cut-in-header", A + "r<|end|><|start|>assistant<|channel|>fin", True, "r", "", []),
    # unreadable calls stay content as written (the hermes path does the same)
    ("bad-json", '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ', True, None,
     '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ', []),
    ("not-an-object", "<|channel|>commentary to=functions.f<|message|>[1, 2]<|call|>", True, None,
     "<|channel|>commentary to=functions.f<|message|>[1, 2]", []),
    ("no-name", "<|channel|>commentary to=functions.<|message|>{}", True, None,
     "<|channel|>commentary to=functions.<|message|>{}", []),
    ("call-without-tools", A + "r<|end|><|start|>assistant<|channel|>commentary to=functions.f<|message|>{}", False,
     "r", "<|start|>assistant<|channel|>commentary to=functions.f<|message|>{}", []),
]


def _events_result(events):
    reasoning = [v for k, v in events if k == "reasoning"]
    return ("".join(reasoning) if reasoning else None, "".join(v for k, v in events if k == "content"),
            [(v.name, v.arguments) for k, v in events if k == "tool_call"])


def _streamed(text, pieces, tools):
    s = harmony.HarmonyStream(tools=tools)
    events = []
    for p in pieces:
        events += s.push(p)
    events += s.flush()
    assert all(k == "tool_call" or v for k, v in events), "no empty events"
    return _events_result(events)


def _chunkings(text):
    yield [text]
    yield list(text)  # a character at a time
    yield [p for p in re.split("(<\\|[a-z]+\\|>)", text) if p]  # a special token at a time
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("name, text, tools, reasoning, content, calls", CASES, ids=[c[0] for c in CASES])
def test_parse_whole_and_every_chunking(name, text, tools, reasoning, content, calls):
    p = harmony.parse(text, tools=tools)
    assert (p.reasoning, p.content, [(c.name, c.arguments) for c in p.tool_calls]) == (reasoning, content, calls)
    for pieces in _chunkings(text):
        assert _streamed(text, pieces, tools) == (reasoning, content, calls), pieces
    # the generic entry points pick harmony by format
    q = tool_calls.parse_output(text, "harmony", tools=tools)
    assert (q.reasoning, q.content, len(q.tool_calls)) == (reasoning, content, len(calls))


def test_calls_are_valid_openai_calls():
    p = harmony.parse(CASES[9][1])
    call = p.tool_calls[0].openai(0)
    assert call["type"] == "function" and call["id"].startswith("call_") and call["index"] == 0
    assert json.loads(call["function"]["arguments"])["newString"] == "if (part < 4) {"


def test_stream_is_incremental():
    """Reasoning and content come out as they are written, not at the end; a call once whole."""
    s = tool_calls.answer_stream("harmony", tools=True)
    assert s.push("<|channel|>analy") == []
    assert s.push("sis<|message|>I think") == [("reasoning", "I think")]
    assert s.push(" more<|e") == [("reasoning", " more")]  # "<|e" may be <|end|>: held
    assert s.push("nd|><|start|>assistant<|channel|>final<|message|>Hel") == [("content", "Hel")]
    assert s.push("lo<|end|><|start|>assistant<|channel|>commentary to=functions.f<|message|>{\"a\"") == \
        [("content", "lo")]
    assert s.push(": 1}") == []
    (kind, call), = s.flush()
    assert kind == "tool_call" and (call.name, call.arguments) == ("f", {"a": 1})


def test_detect_format_and_unconstrained_auto():
    assert tool_calls.detect_format(TEMPLATE) == "harmony" and harmony.is_harmony(TEMPLATE)
    assert tool_calls.detect_format(QWEN3) == "hermes" and not harmony.is_harmony(QWEN3)
    assert tool_calls.tool_constraint([WEATHER], "auto", "harmony") is None
    with pytest.raises(tool_calls.ToolCallError):
        tool_calls.ToolCallStream("harmony")


# -- the template ----------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'},
]


def _expected_prompt(effort: str) -> str:
    """The prompt the harmony spec gives for CONVERSATION (written out by hand)."""
    today = datetime.date.today().strftime("%Y-%m-%d")
    return (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: {effort}\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n"
        "# Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// Current weather in a city\ntype get_weather = (_: {\n// the city\ncity: string,\n"
        'unit: "celsius" | "fahrenheit",\n}) => any;\n\n} // namespace functions<|end|>'
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris", "unit": "celsius"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 18}"<|end|>'
        "<|start|>assistant")


def _ours(messages, **kw):
    return tool_calls.render_with_tools(ChatTemplate(TEMPLATE), messages, kw.pop("tools", [WEATHER]),
                                        add_bos=False, **kw)


@pytest.mark.parametrize("effort", ["low", "high"])
def test_template_renders_the_harmony_prompt(effort):
    ours = _ours(CONVERSATION, reasoning_effort=effort)
    assert ours == _expected_prompt(effort)
    # the date is the one moving part: without an effort the template says medium
    assert "Reasoning: medium" in _ours(CONVERSATION)


def test_template_matches_jinja2_as_hf_and_llama_cpp_python_run_it():
    formatter = importorskip_oracle("llama_cpp.llama_chat_format").Jinja2ChatFormatter
    f = formatter(template=TEMPLATE, eos_token="<|return|>", bos_token="<|startoftext|>")
    later = CONVERSATION + [{"role": "assistant", "content": "18 degrees.", "reasoning_content": "easy"},
                            {"role": "user", "content": "Thanks!"}]
    for messages, kw in ((CONVERSATION, {"reasoning_effort": "high"}), (later, {}), (ASK, {"tools": None})):
        theirs = f(messages=harmony.template_messages(tool_calls.normalize_messages(messages)),
                   tools=kw.get("tools", [WEATHER]), **{k: v for k, v in kw.items() if k != "tools"}).prompt
        assert _ours(messages, **kw) == theirs


def test_history_reasoning_goes_to_thinking():
    later = CONVERSATION + [{"role": "assistant", "content": "18 degrees.", "reasoning_content": "easy"},
                            {"role": "user", "content": "Thanks!"}]
    text = _ours(later)
    # a final answer's reasoning is dropped in later turns; a call's is kept until a final answer
    assert "<|start|>assistant<|channel|>final<|message|>18 degrees.<|end|>" in text
    assert "easy" not in text and "Need the tool." not in text
    assert "Need the tool." in _ours(CONVERSATION)
    # edgeinfer run / the TUI keep an answer as a <think> block and the answer
    shown = {"role": "assistant", "content": "<think>\nmulling\n</think>\n\nDone."}
    assert harmony.template_messages([shown]) == [{"role": "assistant", "content": "Done.", "thinking": "mulling"}]
    # as llama.cpp: no content beside reasoning and calls (the template refuses both)
    both = dict(CONVERSATION[2], content="I'll check.")
    m, = harmony.template_messages([both])
    assert "content" not in m and m["thinking"] == "Need the tool."
    assert "Need the tool." in _ours(CONVERSATION[:2] + [both] + CONVERSATION[3:])


# -- models and servers ----------------------------------------------------------------------------

def harmony_vocab() -> dict:
    """bpe_vocab plus harmony's special tokens (found by text, as llama.cpp marks them)."""
    vocab = bpe_vocab("qwen2")
    n = len(vocab["tokens"])
    vocab["tokens"] = vocab["tokens"] + list(SPECIALS)
    vocab["types"] = vocab["types"] + [3] * len(SPECIALS)
    vocab["eos"] = n + SPECIALS.index("<|return|>")
    return vocab


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("harmony")
    vocab = harmony_vocab()
    return {"gptoss": write_tiny_model(root / "gptoss.gguf", "gpt-oss", "F32", vocab=vocab, shape=SMALL, seed=11,
                                       chat_template=TEMPLATE),
            "qwen3": write_tiny_model(root / "qwen3.gguf", "qwen2", "F32", vocab=vocab, shape=SMALL, seed=12,
                                      chat_template=QWEN3)}


def _load(path):
    return edgeinfer.load(str(path), n_ctx=4096, threads=1, download=False)


SCRIPT = A + "The user wants weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather " \
    '<|constrain|>json<|message|>{"city": "Paris", "unit": "celsius"}'
ANSWER = A + "Easy one.<|end|><|start|>assistant<|channel|>final<|message|>It is 18 °C."


@pytest.fixture(scope="module")
def scripted(paths):
    yield from served(_load(paths["gptoss"]), SCRIPT)


@pytest.fixture
def answer_text(scripted):
    with scripted[1].answering(ANSWER) as fake:
        yield fake


def openai_client(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_vocabulary_reads_harmony(paths):
    model = _load(paths["gptoss"])
    tok = model.tokenizer
    ids = tok.tokenize(SCRIPT, add_special=False, parse_special=True)
    assert ids[0] == tok.token_id("<|channel|>") and tok.token_id("<|message|>") in ids
    # the structure tokens reach the streamed text; <|return|> and <|call|> end the generation
    assert tok.detokenize(ids, skip_special=True) == SCRIPT
    assert tok.is_eog(tok.token_id("<|return|>")) and tok.is_eog(tok.token_id("<|call|>"))
    assert not tok.is_eog(tok.token_id("<|end|>"))
    assert model.tool_format == "harmony"


def test_openai_reasoning_and_answer(scripted, answer_text):
    srv, fake = scripted
    r = openai_client(srv).chat.completions.create(model=MODEL, messages=ASK)
    c = r.choices[0]
    assert (c.message.content, c.message.model_extra["reasoning_content"], c.finish_reason) == \
        ("It is 18 °C.", "Easy one.", "stop")
    chunks = list(openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Easy one."
    assert "".join(d.content or "" for d in deltas) == "It is 18 °C."
    assert len([d for d in deltas if d.content]) > 1  # streamed, not at the end
    assert not any("<|" in (d.content or "") + (d.model_extra.get("reasoning_content") or "") for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_call(scripted, stream):
    srv, fake = scripted
    client = openai_client(srv)
    if stream:
        with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER, SEARCH]) as s:
            r = s.get_final_completion()
    else:
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, SEARCH])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content in (None, "")
    assert c.message.model_dump()["reasoning_content"] == "The user wants weather."
    call, = c.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert fake.calls[-1]["tools"][0]["function"]["name"] == "get_weather"
    # the call and its result go back through the template, the reasoning as `thinking`
    history = ASK + [c.message.model_dump(exclude_none=True),  # the reasoning echoed too
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 18}'}]
    client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER])
    text = tool_calls.render_with_tools(fake.model.template, fake.calls[-1]["messages"], [WEATHER], add_bos=False)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris", "unit": "celsius"}<|call|>') in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 18}"' in text
    assert "<|channel|>analysis<|message|>The user wants weather.<|end|>" in text


def test_malformed_call_is_content_not_a_crash(scripted):
    srv, fake = scripted
    with fake.answering(A + "hm<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{oops"):
        r = openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
        c = r.choices[0]
        assert c.finish_reason == "stop" and not c.message.tool_calls
        assert c.message.content.endswith("{oops")
        chunks = list(openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                                                 stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks).endswith("{oops")


def test_ollama_thinking_content_and_calls(scripted):
    import ollama

    srv, fake = scripted
    client = ollama.Client(host=srv.url)
    r = client.chat(model=MODEL, messages=ASK, tools=[WEATHER])
    assert r.message.thinking == "The user wants weather." and r.message.content == ""
    assert [(t.function.name, dict(t.function.arguments)) for t in r.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]
    parts = list(client.chat(model=MODEL, messages=ASK, tools=[WEATHER], stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "The user wants weather."
    assert [t.function.name for p in parts for t in (p.message.tool_calls or [])] == ["get_weather"]
    assert parts[-1].done
    with fake.answering(ANSWER):
        r = client.chat(model=MODEL, messages=ASK, think="high")
        assert (r.message.thinking, r.message.content) == ("Easy one.", "It is 18 °C.")
        assert fake.calls[-1]["reasoning_effort"] == "high" and "enable_thinking" not in fake.calls[-1]
        g = client.generate(model=MODEL, prompt="hi", think="low")
        assert (g.thinking, g.response) == ("Easy one.", "It is 18 °C.")
        assert fake.calls[-1]["reasoning_effort"] == "low"
        parts = list(client.generate(model=MODEL, prompt="hi", stream=True))
        assert "".join(p.response for p in parts) == "It is 18 °C."
        assert "".join(p.thinking or "" for p in parts) == "Easy one."
        r = client.chat(model=MODEL, messages=ASK, think=True)
        assert r.message.thinking == "Easy one." and "reasoning_effort" not in fake.calls[-1]
        # the echoed thinking goes back as the template's `thinking`
        back = ASK + [{"role": "assistant", "content": "It is 18 °C.", "thinking": "Easy one."}, ASK[0]]
        client.chat(model=MODEL, messages=back)
        assert harmony.template_messages(fake.calls[-1]["messages"])[1]["thinking"] == "Easy one."
        assert "thinking" in client.show(MODEL).capabilities


def test_reasoning_effort_fields(scripted, answer_text):
    srv, fake = scripted
    client = openai_client(srv)
    client.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="high")
    assert fake.calls[-1]["reasoning_effort"] == "high"
    client.chat.completions.create(model=MODEL, messages=ASK,
                                   extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}})
    assert fake.calls[-1]["reasoning_effort"] == "low"
    client.chat.completions.create(model=MODEL, messages=ASK)
    assert "reasoning_effort" not in fake.calls[-1]
    n = len(fake.calls)
    bad = [({"reasoning_effort": "extreme"}, "reasoning_effort"),
           ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
            "chat_template_kwargs.reasoning_effort"),
           ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking")]
    for extra, field in bad:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    for think in (False, "extreme"):
        r = httpx.post(srv.url + "/api/chat", json={"messages": ASK, "think": think})
        assert r.status_code == 400 and "'think'" in r.json()["error"], r.text
    assert len(fake.calls) == n  # refused before anything ran


def test_a_level_on_a_model_without_one_is_a_400(paths):
    srv = start_server(_load(paths["qwen3"]))
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "reasoning_effort": "low"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
        assert "takes no reasoning effort" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/api/chat", json={"messages": ASK, "think": "high"})
        assert r.status_code == 400 and "'think'" in r.json()["error"]
        r = httpx.post(srv.url + "/api/chat", json={"messages": ASK, "think": False, "stream": False,
                                                    "options": {"num_predict": 2}}, timeout=120)
        assert r.status_code == 200  # true and false keep working for <think> models
    finally:
        srv.stop()


def test_required_call_through_the_real_pipeline(paths):
    """tool_choice "required": the grammar makes random weights write a harmony call (maybe after
    an analysis message), the special tokens reach the text, and the server reads the call."""
    srv = start_server(_load(paths["gptoss"]))
    try:
        client = openai_client(srv)
        found = None
        for seed in range(24):  # (WEATHER's arguments are short: its strings are bounded)
            r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                               seed=seed, temperature=1.0, max_tokens=150)
            c = r.choices[0]
            assert c.finish_reason in ("tool_calls", "length")
            if c.finish_reason == "tool_calls":
                found = c
                break
        assert found is not None, "no seed finished a call"
        call, = found.message.tool_calls
        import jsonschema

        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        assert "<|" not in (found.message.content or "")
    finally:
        srv.stop()


# -- edgeinfer run and the TUI ---------------------------------------------------------------------

def test_shown_answer_is_qwens_shape():
    view = ShownAnswer(TEMPLATE)
    shown = "".join(view.push(ANSWER[i:i + 2]) for i in range(0, len(ANSWER), 2)) + view.finish()
    assert shown == "<think>\nEasy one.\n</think>\n\nIt is 18 °C."
    cut = ShownAnswer(TEMPLATE)
    assert cut.push(A + "still thinking") + cut.finish() == "<think>\nstill thinking\n</think>"
    qwen = ShownAnswer(QWEN3)  # any other model: its text as it is
    assert qwen.push("<think>\nx\n</think>\n\ny") + qwen.finish() == "<think>\nx\n</think>\n\ny"


def test_cli_answer_shows_reasoning_and_answer(scripted, answer_text):
    from edgeinfer.commands.answer import answer

    _, fake = scripted
    out = io.StringIO()
    text = answer(fake.model, ASK, {}, raw=False, verbose=False, out=out, err=io.StringIO())
    assert out.getvalue() == text + "\n" and text == "<think>\nEasy one.\n</think>\n\nIt is 18 °C."
    # the kept turn goes back to the template as its thinking and content
    history = ASK + [{"role": "assistant", "content": text}, {"role": "user", "content": "And Rome?"}]
    prompt = tool_calls.render_with_tools(fake.model.template, history, add_bos=False)
    assert "<|start|>assistant<|channel|>final<|message|>It is 18 °C.<|end|>" in prompt and "<think>" not in prompt


def test_tui_shows_the_answer(scripted, answer_text, tmp_path):
    pytest.importorskip("textual")
    import anyio

    from edgeinfer.sessions.conversations import ConversationStore
    from edgeinfer.tui.app import ChatApp
    from edgeinfer.tui.widgets import AssistantMessage, PromptInput

    _, fake = scripted
    app = ChatApp("gptoss", load_model=lambda name, n_ctx: fake.model, store=ConversationStore(tmp_path),
                  sampling={"temperature": 0.0, "max_tokens": 16}, n_ctx=4096)

    async def run():
        async with app.run_test(size=(110, 36)) as pilot:
            for _ in range(2000):
                await pilot.pause()
                await app.workers.wait_for_complete()
                if app.model is not None and not app.loading:
                    break
            app.query_one(PromptInput).text = "Weather?"
            app.query_one(PromptInput).focus()
            await pilot.press("enter")
            for _ in range(2000):
                await pilot.pause()
                await app.workers.wait_for_complete()
                if not app.generating:
                    break
            assert app.query_one(AssistantMessage).text == "<think>\nEasy one.\n</think>\n\nIt is 18 °C."
            assert app.conv.messages[-1]["content"] == "<think>\nEasy one.\n</think>\n\nIt is 18 °C."

    anyio.run(run)
