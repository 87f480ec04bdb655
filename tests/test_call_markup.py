"""Call markup never reaches the content, streamed or not, in each family's call format.

An answer's readers (edgeinfer.prompt.tool_calls.answer_stream and parse_output) see calls
as each family writes them: two calls with a newline between, a next call cut off inside
its tag by max_tokens. Streamed in small pieces, the events give the same calls as the whole
answer's parse, and neither gives any content (the server's `content: null`, and no
`delta.content`). Under a forced call nothing at all is content.
"""

from __future__ import annotations

import pytest

from edgeinfer.prompt.tool_calls import answer_stream, parse_output

A = ("a", {})
B = ("b", {"x": 1})
# (family, answer): two calls, then (max_tokens) a third cut off inside its opening tag
ANSWERS = [
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
               '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>\n<tool_c', [A, B]),
    ("hermes", '\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<', [A]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n\n', [A]),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', [A, B]),
    ("llama3", '{"name": "a", "parameters": {}}\n', [A]),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]\n', [A, B]),
    ("harmony", '<|channel|>commentary to=functions.b <|constrain|>json<|message|>{"x": 1}<|call|>', [B]),
    ("harmony", '<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.a <|constrain|>json<|message|>{}', [A]),
    ("gemma4", "<|tool_call>call:a{}<tool_call|>\n<|tool_call>call:b{x:1}<tool_call|>\n<|tool_c", [A, B]),
    ("gemma4", "<|tool_call>call:a{}<tool_call|>\n\n", [A]),
]


def _streamed(fmt: str, text: str, forced: bool, piece: int) -> list:
    stream = answer_stream(fmt, tools=True, forced=forced)
    events = []
    for i in range(0, len(text), piece):
        events += stream.push(text[i:i + piece])
    return events + stream.flush()


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("fmt, text, calls", ANSWERS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(ANSWERS)])
def test_no_markup_in_content_streamed_or_not(fmt, text, calls, forced):
    whole = parse_output(text, fmt, tools=True, forced=forced)
    assert whole.content == "", whole.content
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    for piece in (1, 3, 7):
        events = _streamed(fmt, text, forced, piece)
        assert [v for k, v in events if k == "content"] == [], (piece, events)
        assert [(v.name, v.arguments) for k, v in events if k == "tool_call"] == calls


@pytest.mark.parametrize("fmt, text, content", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n', "Let me look."),
    ("hermes", "No call here.\n", "No call here.\n"),
    ("gemma4", "Let me look.<|tool_call>call:a{}<tool_call|>\n", "Let me look."),
])
def test_text_beside_calls_stays_content(fmt, text, content):
    """Under "auto", what the model wrote that is no call is still shown (and only under "auto")."""
    assert parse_output(text, fmt, tools=True).content == content
    for piece in (1, 4):
        shown = "".join(v for k, v in _streamed(fmt, text, False, piece) if k == "content")
        assert shown.strip() == content.strip()
        assert "".join(v for k, v in _streamed(fmt, text, True, piece) if k == "content") == ""
