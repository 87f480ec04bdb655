"""Tool calls: rendering through real templates, parsing each family's format, constrained calls."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest

import edgeinfer
from edgeinfer.prompt import tool_calls as tc
from edgeinfer.prompt.chat_template import ChatTemplate
from gguf_factory import TinyShape, bpe_vocab, write_tiny_model

DATA = Path(__file__).parent / "data"
CASES = json.loads((DATA / "tool_outputs" / "cases.json").read_text())
TEMPLATES = {name: (DATA / "templates" / f"{name}.jinja").read_text()
             for name in ("qwen2.5-instruct", "llama-3.1-instruct", "qwen3", "gemma-3-it")}
SMALL = TinyShape(n_embd=64, n_layer=1, n_head=2, n_head_kv=1, head_dim=32, n_ff=128, n_ctx=4096)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                           "unit": {"enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Web search",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20}},
                   "required": ["query"], "additionalProperties": False}}}


def _check(case, parsed):
    assert [[c.name, c.arguments] for c in parsed.tool_calls] == case["calls"], case["name"]
    assert parsed.content.strip() == case["content"].strip(), case["name"]
    assert parsed.reasoning == case.get("reasoning_text"), case["name"]
    if "ids" in case:
        assert [c.id for c in parsed.tool_calls] == case["ids"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_parse_recorded_outputs(case):
    parsed = tc.parse_output(case["text"], case["format"], reasoning=case.get("reasoning", False))
    _check(case, parsed)
    if not case["calls"] and not case.get("reasoning") and case["content"] == case["text"]:
        assert parsed.content == case["text"]  # unreadable text is kept whole
    # call markup never reaches the content (a call cut off by max_tokens is dropped)
    assert not any(tag in parsed.content for tag in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>"))


def test_forced_calls_leave_no_markup():
    """With a forced call, text that is not a readable call is a cut-off call: no content."""
    cut = '<tool_call>\n{"name": "a", "arguments": {"x": '
    assert tc.parse_output(cut, "hermes", forced=True).content == ""
    assert tc.parse_output('{"name": "a", "parameters": {', "llama3", forced=True).content == ""
    assert tc.parse_output('{"name": "a", "parameters": {', "llama3").content.startswith("{")  # auto: may be JSON text
    for fmt, text in (("hermes", cut), ("llama3", '{"name": "a", "para')):
        stream = tc.answer_stream(fmt, forced=True)
        events = stream.push(text[:9]) + stream.push(text[9:]) + stream.flush()
        assert all(kind != "content" or not value for kind, value in events), events


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_streaming_parser_matches(case):
    rng = random.Random(case["name"])
    for pieces in ([ch for ch in case["text"]], _random_split(case["text"], rng), [case["text"]]):
        stream = tc.ToolCallStream(case["format"], reasoning=case.get("reasoning", False))
        events = []
        for p in pieces:
            events += stream.push(p)
        events += stream.flush()
        content = "".join(v for k, v in events if k == "content")
        reasoning = "".join(v for k, v in events if k == "reasoning")
        calls = [v for k, v in events if k == "tool_call"]
        parsed = tc.ParsedOutput(content, calls, reasoning.strip() if "reasoning_text" in case else None)
        _check(case, parsed)


def test_streaming_holds_back_a_possible_call():
    s = tc.ToolCallStream("hermes")
    assert s.push("Checking <tool") == [("content", "Checking ")]
    assert s.push('_call>\n{"name": "search", "arguments": {"query": "a"}}') == []
    events = s.push("\n</tool_call>")
    assert [e[0] for e in events] == ["tool_call"] and events[0][1].name == "search"
    s = tc.ToolCallStream("hermes")
    assert s.push("a <tool") == [("content", "a ")]
    assert s.push("box> b") == [("content", "<toolbox> b")]  # not a call after all: released
    s = tc.ToolCallStream("llama3")
    assert s.push('{"name": "search", ') == []
    assert s.push('"parameters": {"query": "q"}}') == []
    assert [e[0] for e in s.flush()] == ["tool_call"]


def _random_split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


# -- rendering ----------------------------------------------------------------------------------

HISTORY = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 18}"},
]


@pytest.mark.parametrize("name, fmt", [("qwen2.5-instruct", "hermes"), ("llama-3.1-instruct", "llama3"),
                                       ("qwen3", "hermes")])
def test_render_tools_through_real_templates(name, fmt):
    tmpl = ChatTemplate(TEMPLATES[name], bos_token="<|begin_of_text|>" if "llama" in name else "")
    assert tc.supports_tools(tmpl.source) and tc.detect_format(tmpl.source) == fmt
    text = tc.render_with_tools(tmpl, HISTORY, [WEATHER], add_bos=True)
    assert '"name": "get_weather"' in text and "Current weather in a city" in text
    assert '"city": "Paris"' in text  # the call's JSON-string arguments rendered as an object
    assert "\\\"city\\\"" not in text  # ... not as an escaped string
    assert "temp" in text and "18" in text  # the tool result (Llama 3.1's template applies tojson)
    if fmt == "hermes":
        assert "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"" in text
        assert "<tool_response>\n{\"temp\": 18}\n</tool_response>" in text


def test_thinking_switch_and_no_tool_support():
    tmpl = ChatTemplate(TEMPLATES["qwen3"])
    msgs = [{"role": "user", "content": "hi"}]
    off = tc.render_with_tools(tmpl, msgs, None, add_bos=False, enable_thinking=False)
    on = tc.render_with_tools(tmpl, msgs, None, add_bos=False, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")
    # a template without tools (Gemma 3) gets them as text, and its turns still alternate
    gemma = ChatTemplate(TEMPLATES["gemma-3-it"])
    history = [{"role": "system", "content": "Be brief."}, *msgs,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18"},
               {"role": "user", "content": "Thanks"}]
    text = tc.render_with_tools(gemma, history, [WEATHER], add_bos=True)
    assert text.count("<start_of_turn>user") == 2 and text.count("<start_of_turn>model") == 2
    assert "Be brief.\n\nYou can call any of the following tools" in text and '"name": "get_weather"' in text
    assert '<start_of_turn>model\n{"name": "get_weather", "arguments": {"city": "Oslo"}}<end_of_turn>' in text
    assert '{"tool_response": {"name": "get_weather", "content": "18"}}\n\nThanks<end_of_turn>' in text
    bare = tc.render_with_tools(gemma, history[1:], None, add_bos=True)   # a history without tools
    assert "tool_response" in bare and "You can call" not in bare
    assert tc.parse_tool_calls('{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                               tc.detect_format(gemma.source)).tool_calls[0].name == "get_weather"
    with pytest.raises(tc.ToolCallError, match=r"tools\[0\]"):
        tc.normalize_tools([{"type": "function", "function": {"name": "bad name!"}}])
    with pytest.raises(tc.ToolCallError, match="not among the tools"):
        tc.select_tools(tc.normalize_tools([WEATHER]), {"type": "function", "function": {"name": "nope"}})


# -- constrained calls on tiny models ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tool_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    vocab = bpe_vocab("qwen2")
    n = len(vocab["tokens"])
    vocab["tokens"] = vocab["tokens"] + ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                                         "<|python_tag|>"]
    vocab["types"] = vocab["types"] + [3, 3, 4, 4, 3]
    qwen = write_tiny_model(root / "qwen.gguf", "qwen2", "F32", vocab=vocab, shape=SMALL, seed=5,
                            chat_template=TEMPLATES["qwen2.5-instruct"], extra_metadata={
                                "tokenizer.ggml.eos_token_id": n + 1})
    llama = write_tiny_model(root / "llama.gguf", "llama", "F32", vocab=vocab, shape=SMALL, seed=6,
                             chat_template=TEMPLATES["llama-3.1-instruct"])
    return {"hermes": edgeinfer.load(str(qwen), n_ctx=4096, threads=1, download=False),
            "llama3": edgeinfer.load(str(llama), n_ctx=4096, threads=1, download=False)}


SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_required_tool_calls_always_validate(tool_models, fmt):
    model = tool_models[fmt]
    assert model.tool_format == fmt and model.supports_tools
    msgs = [{"role": "user", "content": "weather?"}]
    for seed in range(12):
        choice = "required" if seed % 2 else {"type": "function", "function": {"name": "get_weather"}}
        r = model.chat(msgs, tools=[WEATHER, SEARCH], tool_choice=choice, temperature=1.0, top_k=0,
                       top_p=1.0, min_p=0.0, seed=seed, max_tokens=300, parallel_tool_calls=False)
        assert r.finish_reason == "stop", r.text
        parsed = tc.parse_output(r.text, fmt)
        assert len(parsed.tool_calls) == 1 and parsed.content == "", r.text
        call = parsed.tool_calls[0]
        if isinstance(choice, dict):
            assert call.name == "get_weather"
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_auto_is_free_text_until_the_trigger(tool_models):
    model = tool_models["hermes"]
    c = tc.tool_constraint([WEATHER], "auto", "hermes", model.tokenizer)
    assert c is not None and c.kind == "lark"
    m = c.matcher(model.tokenizer)
    tid = model.tokenizer.token_id("<tool_call>")
    hello = model.tokenizer.tokenize(" hello", add_special=False)
    for t in hello:
        m.advance(t)  # free text is allowed before a call
    m.advance(tid)
    allowed = [i for i, ok in enumerate(m.allowed()) if ok]
    assert [model.tokenizer.detokenize([i]) for i in allowed] == ["\n"]  # the call's syntax follows
    assert tc.tool_constraint([WEATHER], "none", "hermes", model.tokenizer) is None
    assert tc.tool_constraint([WEATHER], "auto", "generic", model.tokenizer) is None
    r = model.chat([{"role": "user", "content": "hi"}], tools=[WEATHER], temperature=1.0, seed=1,
                   max_tokens=40)
    tc.parse_output(r.text, "hermes")  # any text parses (calls or content)


# -- what the call grammars admit ---------------------------------------------------------------

@pytest.fixture(scope="module")
def call_tok():
    from edgeinfer.tokenizer import Tokenizer

    vocab = bpe_vocab("qwen2")
    n = len(vocab["tokens"])
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": vocab["tokens"] + ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                                                    "<|python_tag|>", "[TOOL_CALLS]"],
        "tokenizer.ggml.token_type": vocab["types"] + [3, 3, 4, 4, 3, 3], "tokenizer.ggml.merges": vocab["merges"],
        "tokenizer.ggml.bos_token_id": vocab["bos"], "tokenizer.ggml.eos_token_id": n + 1})


def _admits(constraint, tok, text: str) -> bool:
    from oracles import grammar_admits

    return grammar_admits(constraint, tok, text)


PYDANTIC = {"type": "function", "function": {"name": "book", "parameters": {
    "$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
    "type": "object", "properties": {"guest": {"$ref": "#/$defs/Guest"}}, "required": ["guest"]}}}
NO_PARAMS = {"type": "function", "function": {"name": "now"}}
OPEN = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"k": {"type": "string"}}, "additionalProperties": {"type": "integer"}}}}


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_forced_call_grammar_admits_only_declared_arguments(call_tok, fmt):
    """Arguments are closed to the declared properties (additionalProperties false unless the
    schema says otherwise), a tool without parameters takes {}, pydantic's $defs resolve
    against the parameters' own root, and whitespace inside the call is bounded."""
    key = "parameters" if fmt == "llama3" else "arguments"

    def call(name, args: str, gap: str = " ") -> str:
        body = '{"name": "%s",%s"%s": %s}' % (name, gap, key, args)
        return {"hermes": f"<tool_call>\n{body}\n</tool_call>", "llama3": body,
                "mistral": f"[TOOL_CALLS][{body}]"}[fmt]

    c = tc.tool_constraint([WEATHER, PYDANTIC, NO_PARAMS, OPEN], "required", fmt, call_tok)
    assert _admits(c, call_tok, call("get_weather", '{"city": "Oslo", "unit": "celsius"}'))
    assert not _admits(c, call_tok, call("get_weather", '{"city": "Oslo", "unit": "celsius", "zzz": 1}'))
    assert _admits(c, call_tok, call("now", "{}"))
    assert not _admits(c, call_tok, call("now", '{"properties": {}}'))
    assert _admits(c, call_tok, call("book", '{"guest": {"name": "Ann"}}'))
    assert not _admits(c, call_tok, call("book", '{"guest": {"name": "Ann", "age": 3}}'))
    assert _admits(c, call_tok, call("tag", '{"k": "a", "extra": 5}'))  # additionalProperties followed
    assert not _admits(c, call_tok, call("tag", '{"extra": "x"}'))
    assert not _admits(c, call_tok, call("get_weather", '{"city": "Oslo", "unit": "celsius"}', gap="\n" + "\t" * 30))
    assert _admits(c, call_tok, call("get_weather", '{"city": "Oslo", "unit": "celsius"}', gap="\n"))
    assert not _admits(c, call_tok, call("get_weather", '{"city": "Oslo", "unit": "celsius"}', gap="\n  "))


# a forced call with `gap` at one place between two JSON tokens (single spaces elsewhere)
CALL_TOKENS = ['{', '"name"', ':', '"get_weather"', ',', 'KEY', ':', '{', '"city"', ':', '"Oslo"', ',',
               '"unit"', ':', '"celsius"', '}', '}']
ONE_GAPS = ["", " ", "\n"]
RUNS = ["  ", "\n\n", " \n", "\n ", "\n\t", "\t"]


def _gapped(fmt: str, at: int, gap: str) -> str:
    key = '"parameters"' if fmt == "llama3" else '"arguments"'
    toks = [key if t == "KEY" else t for t in CALL_TOKENS]
    body = "".join(t + (gap if i == at else " ") for i, t in enumerate(toks[:-1])) + toks[-1]
    return {"hermes": f"<tool_call>\n{body}\n</tool_call>", "llama3": body, "mistral": f"[TOOL_CALLS][{body}]"}[fmt]


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_json_is_compact(call_tok, fmt, choice):
    """Under a forced call (tool_choice "required" or a named function: Anthropic's "any" /
    "tool" and the Responses API's map here) at most one space or newline between the call's
    JSON tokens, anywhere in it: a run of two is refused, so a small model cannot spend its
    budget on whitespace (llama.cpp's grammars take up to 20). "auto" keeps its layout."""
    from oracles import grammar_admits

    c = tc.tool_constraint([WEATHER], choice, fmt, call_tok, parallel=False)
    for at in range(len(CALL_TOKENS) - 1):
        for gap in ONE_GAPS:
            assert grammar_admits(c, call_tok, _gapped(fmt, at, gap), complete=True), (at, gap)
        for gap in RUNS:
            assert not grammar_admits(c, call_tok, _gapped(fmt, at, gap)), (at, gap)
    auto = tc.tool_constraint([WEATHER], "auto", fmt, call_tok)
    prefix = "<|python_tag|>" if fmt == "llama3" else ""
    assert grammar_admits(auto, call_tok, prefix + _gapped(fmt, 4, "\n  "))  # pretty-printing, as before


def _whitespace_runs(text: str) -> list[str]:
    """Runs of two or more whitespace characters in `text` outside JSON strings."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return re.findall(r"\s{2,}", bare)


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_forced_calls_sampled_at_temperature_1_are_compact(tool_models, fmt):
    """What a random-weight model samples under a forced call has no whitespace run between
    its JSON tokens (strings aside), and the call is done well within 120 tokens."""
    model = tool_models[fmt]
    for seed in range(8):
        r = model.chat([{"role": "user", "content": "weather?"}], tools=[WEATHER], tool_choice="required",
                       temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=120,
                       parallel_tool_calls=False)
        assert r.finish_reason == "stop", r.text
        body = r.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
        assert _whitespace_runs(body) == [], r.text
        assert len(tc.parse_output(r.text, fmt).tool_calls) == 1, r.text


@pytest.mark.parametrize("fmt, call", [
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": {}}]'),
    ("llama3", '<|python_tag|>{"name": "now", "parameters": {}}'),
])
def test_auto_grammar_takes_the_tags_as_the_model_writes_them(call_tok, fmt, call):
    """Under tool_choice "auto", free text, then a call opened and closed by the special
    tokens the vocabulary has (the model emits `</tool_call>` and `[TOOL_CALLS]` as one token
    each, not spelled out); undeclared arguments still refused. The answer ends after its one
    call (parallel_tool_calls false, the default); with parallel calls, free text may follow."""
    c = tc.tool_constraint([NO_PARAMS], "auto", fmt, call_tok)
    assert _admits(c, call_tok, "Sure. " + call)
    assert _admits(c, call_tok, "plain text only")
    assert not _admits(c, call_tok, "Sure. " + call.replace("{}", '{"x": 1}'))
    if fmt == "hermes":
        assert not _admits(c, call_tok, "Sure. " + call + " Done.")
        assert not _admits(c, call_tok, "Sure. " + call + "\n" + call)
        parallel = tc.tool_constraint([NO_PARAMS], "auto", fmt, call_tok, parallel=True)
        assert _admits(parallel, call_tok, "Sure. " + call + " Done.")
        assert _admits(parallel, call_tok, "Sure. " + call + "\n" + call)
