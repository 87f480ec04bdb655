"""Grammars (Lark, for edgeinfer.prompt.grammar) for Gemma 4 tool calls: what tool_choice
"required", a named function, or "auto" once `<|tool_call>` appears lets the model write.

A call is `<|tool_call>call:NAME{...}<tool_call|>` with the arguments in Gemma's notation
(edgeinfer.prompt.gemma4_format.read_value). llama.cpp's gemma4 grammar accepts any Gemma
object there (applying the parameter schema is a TODO in its parser); here the schema shapes
the arguments where it says something a grammar can hold:
- an object with `properties`: those keys, in sorted order (the order the template writes
  them), the `required` ones always, the others optionally; without properties, any object;
- `enum` / `const` values; strings (bounded by `maxLength` where the quote is one token),
  integers, numbers, booleans, null, arrays of their `items`; `anyOf` / `oneOf` and type lists
  as alternatives;
- anything else (`$ref`, `allOf`, pattern...) as any Gemma value.
A tool's object keys never go past its declared properties, like OpenAI's strict mode.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from edgeinfer.prompt.gemma4_format import CALL_CLOSE, CHANNEL_CLOSE, CHANNEL_OPEN, QUOTE

MAX_RULES = 2000  # schema rules one grammar may take (a bound for hostile schemas)
_SCALARS = {"integer": "G4_INT", "number": "G4_NUMBER", "boolean": '("true" | "false")', "null": '"null"'}


class _Rules:
    """The Lark rules a grammar collects, with fresh names."""

    def __init__(self, quote: str) -> None:
        self.quote = quote
        self.lines: list[str] = []

    def add(self, body: str) -> str:
        if len(self.lines) >= MAX_RULES:
            raise ValueError("the tool schemas need too large a grammar")
        name = f"g4s_{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def string(self, max_length: Any) -> str:
        q = self.quote
        if isinstance(max_length, int) and not isinstance(max_length, bool) and 0 <= max_length <= 10_000 \
                and q.startswith("<["):
            return f"{q} /(.|\\n){{0,{max_length}}}/ {q}"
        return "g4_string"


def _literal(value: Any, quote: str) -> str:
    """A constant in Gemma's notation, as Lark."""
    if isinstance(value, str):
        return f"{quote} {json.dumps(value, ensure_ascii=False)} {quote}" if value else f"{quote} {quote}"
    if value is None:
        return '"null"'
    if isinstance(value, bool):
        return '"true"' if value else '"false"'
    if isinstance(value, (int, float)):
        return json.dumps(json.dumps(value))
    return "g4_value"  # an object or array constant: any value (rare in tool schemas)


def value_expr(schema: Any, rules: _Rules, depth: int = 0) -> str:
    """The Lark expression of a value valid against `schema` (see the module doc)."""
    if not isinstance(schema, Mapping) or depth > 32:
        return "g4_value"
    if "const" in schema:
        return _literal(schema["const"], rules.quote)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "(" + " | ".join(_literal(v, rules.quote) for v in schema["enum"]) + ")"
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return "(" + " | ".join(value_expr(s, rules, depth + 1) for s in schema[key]) + ")"
    kind = schema.get("type")
    if isinstance(kind, list) and kind:
        return "(" + " | ".join(value_expr({**schema, "type": k}, rules, depth + 1) for k in kind) + ")"
    if kind == "string":
        return rules.string(schema.get("maxLength"))
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "array":
        item = value_expr(schema.get("items"), rules, depth + 1)
        return rules.add(f'"[" G4_WS? ({item} (G4_WS? "," G4_WS? {item})*)? G4_WS? "]"')
    if kind == "object" or "properties" in schema:
        return object_expr(schema, rules, depth)
    return "g4_value"


def object_expr(schema: Mapping, rules: _Rules, depth: int = 0) -> str:
    """`{key:value,...}` with the schema's properties in sorted order, required ones always."""
    props = schema.get("properties")
    if not isinstance(props, Mapping) or not props:
        return "g4_dict"
    required = set(schema.get("required") or []) if isinstance(schema.get("required"), list) else set()
    keys = sorted(props)
    kvs = [f'{json.dumps(k)} ":" G4_WS? {value_expr(props[k], rules, depth + 1)}' for k in keys]
    n = len(keys)
    need = [any(k in required for k in keys[i:]) for i in range(n)] + [False]
    # later[i]: the members from key i on, after at least one member (each begins with ",")
    later: list[str] = [""] * (n + 1)

    def tail(i: int) -> str:  # what may follow a member written at i - 1
        if i == n:
            return ""
        return later[i] if need[i] else f"{later[i]}?"

    for i in range(n - 1, -1, -1):
        alts = [f'G4_WS? "," G4_WS? {kvs[i]} {tail(i + 1)}']
        if keys[i] not in required and i + 1 < n:
            alts.append(later[i + 1])
        later[i] = rules.add(" | ".join(alts))
    first: list[str] = [""] * (n + 1)
    for i in range(n - 1, -1, -1):
        alts = [f"{kvs[i]} {tail(i + 1)}"]
        if keys[i] not in required and i + 1 < n:
            alts.append(first[i + 1])
        first[i] = rules.add(" | ".join(alts))
    members = first[0] if need[0] else f"{first[0]}?"
    return rules.add(f'"{{" G4_WS? {members} G4_WS? "}}"')


def calls_grammar(tools: Sequence[Mapping], marks: Mapping[str, str]) -> tuple[str, list[str]]:
    """(a call of one of `tools` after its `<|tool_call>`, as a Lark expression; the rules it
    uses). `marks`: each of gemma4_format.MARKUP as Lark (its token id where the vocabulary has
    it, else the text)."""
    quote = marks[QUOTE]
    rules = _Rules(quote)
    alts = []
    for tool in tools:
        fn = tool["function"]
        alts.append(f'{json.dumps(fn["name"])} {object_expr(fn.get("parameters") or {}, rules)}')
    body = f'"call:" ({" | ".join(alts)}) {marks[CALL_CLOSE]}'
    # a quote written as text: a string runs to it; as a token, any text (tokens are not text)
    text = "G4_TEXT: /(.|\\n)*/" + ("" if quote.startswith("<[") else ' & ~/(.|\\n)*<\\|"\\|>(.|\\n)*/')
    return body, rules.lines + [
        'g4_dict: "{" G4_WS? (g4_kv (G4_WS? "," G4_WS? g4_kv)*)? G4_WS? "}"',
        'g4_kv: G4_KEY ":" G4_WS? g4_value',
        'g4_list: "[" G4_WS? (g4_value (G4_WS? "," G4_WS? g4_value)*)? G4_WS? "]"',
        'g4_value: g4_string | g4_dict | g4_list | G4_NUMBER | "true" | "false" | "null"',
        f"g4_string: {quote} G4_TEXT {quote}",
        text,
        'G4_KEY: /[A-Za-z_$][A-Za-z0-9_.$\\-]*/',
        "G4_INT: /-?(0|[1-9][0-9]{0,15})/",  # 16 digits at most, as llama.cpp's integers
        "G4_NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/",
        "G4_WS: /[ \\t\\n]{1,4}/",  # Gemma writes none; a little is read, never unbounded
    ]


def thought_rule(marks: Mapping[str, str]) -> str:
    """Lark: `thought`, one thought channel (what may come before forced calls)."""
    return f'thought: {marks[CHANNEL_OPEN]} "thought" /(.|\\n)*/ {marks[CHANNEL_CLOSE]}'
