"""Chat templates: real published templates against hand-written expected prompts, the
built-ins against llama.cpp's own formatter, selection rules and error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgeinfer.prompt.chat_template import BUILTIN_TEMPLATES, ChatTemplate
from edgeinfer.errors import TemplateError

DATA = Path(__file__).parent / "data" / "templates"
CASES = json.loads((DATA / "cases.json").read_text())
EXPECTED = json.loads((DATA / "expected.json").read_text())
TEMPLATES = [k for k in EXPECTED if not k.startswith("_")]


def _template(name: str) -> ChatTemplate:
    exp = EXPECTED[name]
    return ChatTemplate((DATA / f"{name}.jinja").read_text(), exp["bos_token"], exp["eos_token"],
                        name=name)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_published_template_renders_expected_prompt(name, case):
    assert _template(name).render(case["messages"], add_generation_prompt=True) == EXPECTED[name][case["name"]]


@pytest.mark.parametrize("name", TEMPLATES)
def test_no_generation_prompt_drops_only_the_assistant_header(name):
    msgs = CASES[0]["messages"]
    with_prompt = _template(name).render(msgs, add_generation_prompt=True)
    without = _template(name).render(msgs, add_generation_prompt=False)
    assert with_prompt.startswith(without) and len(without) < len(with_prompt)


def test_gemma_builtin_is_the_gemma3_template():
    assert ChatTemplate.builtin("gemma").source.strip() == (DATA / "gemma-3-it.jinja").read_text().strip()


LLAMA_CPP_RENDER = DATA / "llama_cpp_render.json"


@pytest.mark.skipif(not LLAMA_CPP_RENDER.exists(), reason="run scripts/make_tokenizer_goldens.py")
@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_builtin_matches_llama_cpp_formatter(name, case):
    """llama_chat_apply_template's C++ formats (which leave BOS to the tokenizer)."""
    oracle = json.loads(LLAMA_CPP_RENDER.read_text())[f"{name}/{case['name']}"]
    tmpl = ChatTemplate.builtin(name, bos_token="<BOS>", eos_token="<EOS>")
    ours = tmpl.render_prompt(case["messages"], add_bos=True, add_generation_prompt=True)
    assert ours == oracle


def test_tools_and_kwargs_pass_through():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    out = _template("qwen2.5-instruct").render(CASES[2]["messages"], tools=tools)
    assert '{"type": "function", "function": {"name": "get_weather", "parameters": {}}}' in out
    out = _template("llama-3.1-instruct").render(CASES[2]["messages"], date_string="01 Jan 2030")
    assert "Today Date: 01 Jan 2030" in out
    tmpl = ChatTemplate("{{ strftime_now('%Y') }}|{{ x | tojson }}")
    year, js = tmpl.render([], x={"k": "é<"}).split("|")
    assert len(year) == 4 and js == '{"k": "é<"}'


def test_for_model_selection():
    meta = {"general.architecture": "gemma3", "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>"],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}
    t = ChatTemplate.for_model(meta)
    assert t.name == "gemma" and t.bos_token == "<bos>" and t.eos_token == "<eos>"
    assert ChatTemplate.for_model({**meta, "general.architecture": "qwen2"}).name == "chatml"
    assert ChatTemplate.for_model({**meta, "general.architecture": "llama"}).name == "llama3"
    assert ChatTemplate.for_model({**meta, "tokenizer.chat_template": "{{ 'x' }}"}).render([]) == "x"
    assert ChatTemplate.for_model(meta, override="chatml").name == "chatml"
    assert ChatTemplate.for_model(meta, override="{{ bos_token }}!").render([]) == "<bos>!"
    with pytest.raises(TemplateError, match="unknown chat template 'nope'"):
        ChatTemplate.for_model(meta, override="nope")


def test_render_prompt_strips_bos_once():
    t = ChatTemplate.builtin("gemma", "<bos>", "<eos>")
    text = t.render_prompt([{"role": "user", "content": "x"}], add_bos=True)
    assert text.startswith("<start_of_turn>user\nx")
    assert t.render_prompt([{"role": "user", "content": "x"}], add_bos=False).startswith("<bos>")


@pytest.mark.parametrize("source, messages, pattern", [
    ("{% if %}", [], r"syntax error at line 1"),
    ("line one\n{% for x in %}", [], r"syntax error at line 2"),
    ("{{ foo.bar }}", [], r"UndefinedError: 'foo' is undefined"),
    ("ok\n{{ 1 // 0 }}", [], r"at line 2: ZeroDivisionError"),
    ("{{ raise_exception('roles must alternate') }}", [], r"roles must alternate$"),
    ("{{ ''.__class__.__mro__ }}", [], r"SecurityError|UndefinedError"),
])
def test_errors_are_one_line_template_errors(source, messages, pattern):
    with pytest.raises(TemplateError, match=pattern) as info:
        ChatTemplate(source).render(messages)
    assert "\n" not in str(info.value)


def test_gemma_rejects_non_alternating_roles():
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        _template("gemma-3-it").render(msgs)


def test_messages_must_be_dicts():
    with pytest.raises(TemplateError, match="list of"):
        ChatTemplate.builtin("chatml").render(["hello"])  # type: ignore[list-item]


def test_generation_tag_and_loopcontrols():
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                     "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"


@pytest.mark.skipif(not LLAMA_CPP_RENDER.exists(), reason="run scripts/make_tokenizer_goldens.py")
@pytest.mark.parametrize("name, builtin, cases", [
    ("gemma-3-it", "gemma", [c["name"] for c in CASES]),
    ("qwen2.5-instruct", "chatml", ["system_multi_turn"]),  # Qwen adds a default system turn
])
def test_published_template_matches_llama_cpp_formatter(name, builtin, cases):
    oracle = json.loads(LLAMA_CPP_RENDER.read_text())
    for case in (c for c in CASES if c["name"] in cases):
        ours = _template(name).render_prompt(case["messages"], add_bos=True)
        assert ours == oracle[f"{builtin}/{case['name']}"], case["name"]
