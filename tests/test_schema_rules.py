"""JSON schemas read as llama.cpp reads them (edgeinfer.prompt.schema_rules): objects with
properties closed unless they say otherwise, integers of at most 16 digits, given bounds kept."""

from __future__ import annotations

import pytest

from edgeinfer.prompt import grammar, schema_rules, tool_calls
from gguf_factory import bpe_vocab
from oracles import grammar_admits

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
D16, D17 = "9" * 15 + "8", "1" + "0" * 16  # 16 digits (the cap), 17


@pytest.fixture(scope="module")
def tok():
    from edgeinfer.tokenizer import Tokenizer

    vocab = bpe_vocab("qwen2")
    n = len(vocab["tokens"])
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": vocab["tokens"] + ["<|im_end|>", "<tool_call>", "</tool_call>"],
        "tokenizer.ggml.token_type": vocab["types"] + [3, 4, 4], "tokenizer.ggml.merges": vocab["merges"],
        "tokenizer.ggml.bos_token_id": vocab["bos"], "tokenizer.ggml.eos_token_id": n})


def test_objects_with_properties_are_closed_and_explicit_ones_followed():
    out = schema_rules.closed_objects({**PERSON, "properties": {
        **PERSON["properties"], "tags": {"type": "object", "additionalProperties": {"type": "integer"}},
        "any": {"type": "object"}, "loose": {"properties": {"a": {}}, "additionalProperties": True}}})
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["tags"]["additionalProperties"] == {"type": "integer"}  # followed, as written
    assert "additionalProperties" not in props["any"]  # no properties: any object (json_object's)
    assert props["loose"]["additionalProperties"] is True
    assert schema_rules.closed_objects({"type": "object"}, bare=True)["additionalProperties"] is False
    # allOf's parts are intersected: each keeps its own keys open to the others'
    both = schema_rules.closed_objects({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in part for part in both["allOf"])
    # $defs (pydantic's nested models) and anyOf branches are closed too; `not` is left alone
    nested = schema_rules.closed_objects({"$defs": {"P": PERSON}, "anyOf": [PERSON],
                                          "not": {"properties": {"x": {}}}})
    assert nested["$defs"]["P"]["additionalProperties"] is False and nested["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in nested["not"]
    assert "additionalProperties" not in PERSON  # the request's own schema is not changed


CAP = schema_rules.INTEGER_CAP  # 10**16 - 2: llguidance reads a bound as a float


@pytest.mark.parametrize("given, bounds", [
    ({}, (-CAP, CAP)),
    ({"minimum": 0}, (0, CAP)),
    ({"exclusiveMinimum": 0}, (None, CAP)),   # the exclusive bound kept, the open side bounded
    ({"maximum": 10}, (-CAP, 10)),
    ({"minimum": 1, "maximum": 5}, (1, 5)),
    ({"minimum": 10 ** 17}, (10 ** 17, None)),   # asks for longer numbers: left as it is
    ({"minimum": 0, "exclusiveMinimum": True}, (0, CAP)),   # draft 4's boolean is no bound
])
def test_integers_get_16_digits_on_each_open_side(given, bounds):
    out = schema_rules.bounded_integers({"type": ["integer", "null"], **given})
    assert (out.get("minimum"), out.get("maximum")) == bounds
    assert "minimum" not in schema_rules.bounded_integers({"type": "number"})


def test_a_json_schema_grammar_refuses_undeclared_keys_and_17_digits(tok):
    c = grammar.json_schema(PERSON)
    assert grammar_admits(c, tok, '{"name": "x", "age": ' + D16 + "}", complete=True)
    assert not grammar_admits(c, tok, '{"name": "x", "age": ' + D17)
    assert not grammar_admits(c, tok, '{"name": "x", "age": 1, "email"')
    assert grammar_admits(c, tok, '{"name": "x", "age": -' + D16 + "}", complete=True)
    assert c.source.count("additionalProperties") == 0  # shown as the request wrote it
    opened = grammar.json_schema({**PERSON, "additionalProperties": True})
    assert grammar_admits(opened, tok, '{"name": "x", "age": 1, "email": "y"}', complete=True)
    ranged = grammar.json_schema({"type": "integer", "minimum": 5, "maximum": 120})
    assert grammar_admits(ranged, tok, "120", complete=True) and not grammar_admits(ranged, tok, "121")
    assert not grammar_admits(ranged, tok, "4", complete=True)


def test_tool_arguments_are_bounded_too(tok):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}, "required": ["n"]}}}
    c = tool_calls.tool_constraint([tool], "required", "hermes", tok)
    call = '<tool_call>\n{"name": "f", "arguments": {"n": '
    assert grammar_admits(c, tok, call + D16 + "}}\n</tool_call>", complete=True)
    assert not grammar_admits(c, tok, call + D17)
    assert not grammar_admits(c, tok, call + "0")
