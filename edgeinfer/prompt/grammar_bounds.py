"""Bounds on what llguidance is asked to compile, checked in linear time first.

llguidance compiles schemas and grammars recursively on the calling thread's native stack:
a chain of a few thousand rules, or of ~700 `$ref`s each nesting an array in an anyOf,
overflows an 8 MiB stack (SIGSEGV, the whole process), and the GBNF converter's cost grows
with rules x chain length. So every grammar is measured first, in linear time, and one past
these bounds is a GrammarError naming the bound. Measured crash points on an 8 MiB stack:
2000-3000 chained Lark rules, 600-800 chained `anyOf`/array `$ref`s (~2000 schema levels);
the bounds keep 4x (grammars) to 10x (schemas) below them, and stay far above what real
grammars (llama.cpp's json.gbnf: 10 rules) and pydantic schemas (tens of levels) use.
"""

from __future__ import annotations

import json as _json
import re
from typing import Any

from edgeinfer.errors import GrammarError

KIND_NAMES = {"json_schema": "JSON schema", "json": "JSON grammar", "gbnf": "GBNF grammar",
              "lark": "Lark grammar", "regex": "regular expression", "tools": "tool-call grammar"}
MAX_GRAMMAR_RULES = 2000      # rules and terminals of a Lark or GBNF grammar
MAX_GRAMMAR_DEPTH = 500       # rule references (and groups) one inside another, from the start rule
MAX_SCHEMA_DEPTH = 200        # schemas one inside another, `$ref`s followed, from the root
MAX_SCHEMA_NODES = 100_000    # schema objects in all


def check_bounds(grammar: str, kind: str = "grammar") -> None:
    """Raise GrammarError if llguidance's `grammar` (Lark text, or its JSON with json_schema /
    lark_grammar entries) is larger or deeper than the bounds above."""
    text = grammar.lstrip()
    if text.startswith("{"):
        try:
            spec = _json.loads(text)
        except (ValueError, RecursionError):
            return  # not JSON after all: llguidance says what is wrong with it
        for g in spec.get("grammars", []) if isinstance(spec, dict) else []:
            if not isinstance(g, dict):
                continue
            if g.get("json_schema") is not None:
                check_schema_bounds(g["json_schema"], kind)
            if isinstance(g.get("lark_grammar"), str):
                check_grammar_bounds(g["lark_grammar"], kind)
        return
    check_grammar_bounds(grammar, kind)


def _too(kind: str, what: str, limit: int) -> GrammarError:
    return GrammarError(f"invalid {KIND_NAMES.get(kind, kind)}: {what} (the limit is {limit})")


def check_schema_bounds(schema: Any, kind: str = "json_schema") -> None:
    """A JSON schema's nesting, local `$ref`s followed (each definition measured once, a
    reference back into the path being measured counted as a leaf), and its size."""
    if not isinstance(schema, (dict, list)):
        return
    memo: dict[int, int] = {}      # id(schema object) -> depth below it, included
    on_path: set[int] = set()
    nodes = 0
    # frames: [node, iterator over its children, deepest child so far]
    stack: list[list] = []

    def enter(node) -> None:
        nonlocal nodes
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _too(kind, f"it has more than {MAX_SCHEMA_NODES} schema objects", MAX_SCHEMA_NODES)
        on_path.add(id(node))
        stack.append([node, iter(_schema_children(schema, node)), 0])
        if sum(1 for f in stack if isinstance(f[0], dict)) > MAX_SCHEMA_DEPTH:
            raise _too(kind, f"its schemas nest (through $ref) more than {MAX_SCHEMA_DEPTH} deep",
                       MAX_SCHEMA_DEPTH)

    enter(schema)
    while stack:
        frame = stack[-1]
        child = next(frame[1], None)
        if child is None:
            stack.pop()
            node = frame[0]
            on_path.discard(id(node))
            depth = frame[2] + (1 if isinstance(node, dict) else 0)
            memo[id(node)] = depth
            if stack:
                stack[-1][2] = max(stack[-1][2], depth)
            continue
        if id(child) in on_path:
            continue  # recursion (a tree schema): a grammar rule refers back, nothing deeper
        if id(child) in memo:
            frame[2] = max(frame[2], memo[id(child)])
            if len(stack) + memo[id(child)] > MAX_SCHEMA_DEPTH:
                enter(child)  # measured deep enough to fail: walk it to raise with the path
            continue
        enter(child)


def _schema_children(root: Any, node: Any):
    """A schema node's sub-objects, and the target of its local `$ref`."""
    if isinstance(node, list):
        yield from (v for v in node if isinstance(v, (dict, list)))
        return
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            target = _pointer(root, value[1:])
            if isinstance(target, (dict, list)):
                yield target
        elif key in ("enum", "const", "default", "examples"):
            continue  # values, not schemas
        elif isinstance(value, (dict, list)):
            yield value


def _pointer(root: Any, pointer: str) -> Any:
    node = root
    for part in pointer.split("/")[1:] if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_RULE_HEAD = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_.-]*?)(?:\.-?\d+)?[ \t]*(::=|:)(?!:)", re.M)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_JSON_BLOCK = re.compile(r"%json\s*")


def check_grammar_bounds(text: str, kind: str = "grammar") -> None:
    """A Lark or GBNF grammar's rule count and depth (rule references one inside another,
    groups counted, from `start` / `root`), and the JSON schemas inside its `%json` blocks."""
    heads = list(_RULE_HEAD.finditer(text))
    gbnf = any(m.group(2) == "::=" for m in heads)
    if len(heads) > MAX_GRAMMAR_RULES:
        raise _too(kind, f"it has {len(heads)} rules", MAX_GRAMMAR_RULES)
    bodies: dict[str, str] = {}
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        bodies.setdefault(m.group(1), text[m.end():end])
    refs: dict[str, set[str]] = {}
    groups: dict[str, int] = {}
    for name, body in bodies.items():
        names, depth, schemas = _scan_body(body, gbnf)
        for schema in schemas:
            check_schema_bounds(schema, kind)
        refs[name] = {n for n in names if n in bodies and n != name}
        groups[name] = depth
    start = next((s for s in ("start", "root") if s in bodies), None)
    if start is None:
        return
    memo: dict[str, int] = {}
    on_path = {start}
    stack: list[list] = [[start, iter(sorted(refs[start])), 0]]
    while stack:
        frame = stack[-1]
        child = next(frame[1], None)
        if child is None:
            stack.pop()
            on_path.discard(frame[0])
            depth = frame[2] + 1 + groups[frame[0]]
            memo[frame[0]] = depth
            if stack:
                stack[-1][2] = max(stack[-1][2], depth)
            continue
        if child in on_path:
            continue
        if child in memo:
            frame[2] = max(frame[2], memo[child])
        else:
            on_path.add(child)
            stack.append([child, iter(sorted(refs[child])), 0])
        if len(stack) + sum(groups[f[0]] for f in stack) + (memo.get(child, 0)) > MAX_GRAMMAR_DEPTH:
            raise _too(kind, f"its rules nest more than {MAX_GRAMMAR_DEPTH} deep", MAX_GRAMMAR_DEPTH)


def _scan_body(body: str, gbnf: bool) -> tuple[set[str], int, list]:
    """(names a rule body refers to, its deepest group nesting, the schemas of its %json blocks),
    skipping string literals, regexes, character classes, special tokens and comments."""
    names: set[str] = set()
    schemas: list = []
    depth = deepest = 0
    i, n = 0, len(body)
    decoder = _json.JSONDecoder()
    while i < n:
        c = body[i]
        if c in "\"'":
            j = i + 1
            while j < n and body[j] != c:
                j += 2 if body[j] == "\\" else 1
            i = j + 1
        elif (c == "#" and gbnf) or (c == "/" and body.startswith("//", i)):
            j = body.find("\n", i)
            i = n if j < 0 else j
        elif c == "/" and not gbnf:
            j = i + 1
            while j < n and body[j] not in "/\n":
                j += 2 if body[j] == "\\" else 1
            i = j + 1
        elif c == "[" and gbnf:  # a character class (Lark's [...] is an optional group)
            j = i + 1
            while j < n and body[j] != "]":
                j += 2 if body[j] == "\\" else 1
            i = j + 1
        elif c == "<":
            j = body.find(">", i)
            i = n if j < 0 else j + 1
        elif c == "%":
            m = _JSON_BLOCK.match(body, i)
            if m is not None:
                try:
                    schema, end = decoder.raw_decode(body, m.end())
                except (ValueError, RecursionError):
                    end = m.end()
                else:
                    schemas.append(schema)
                i = end
            else:
                i += 1
        elif c in "([{":
            depth += 1
            deepest = max(deepest, depth)
            i += 1
        elif c in ")]}":
            depth -= 1
            i += 1
        elif c.isalpha() or c == "_":
            m = _NAME.match(body, i)
            names.add(m.group(0))
            i = m.end()
        else:
            i += 1
    return names, deepest, schemas
