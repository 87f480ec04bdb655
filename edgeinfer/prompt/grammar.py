"""Constrained decoding: JSON schemas, any JSON, GBNF, Lark and regexes as a per-token mask.

The grammar engine is llguidance (Rust; also behind llama.cpp's and vLLM's guidance): a
constraint compiles once (`json_schema`, `any_json`, `gbnf`, `lark`, `regex`, or
`from_request` for the keywords the API and the server take), and each generated
sequence gets its own `GrammarMatcher`, whose mask is computed incrementally from the
tokens consumed so far. The decode loop (edgeinfer.generate) calls, per token:

    logits = matcher.mask(logits)     # disallowed tokens -> -inf, before the sampler chain
    token = sample(logits, history)
    matcher.advance(token)            # then matcher.is_stopped(): the grammar is complete

A schema feature llguidance does not implement, a schema that is not one, a grammar
that does not parse: `GrammarError` naming the problem, never a silently looser grammar.

The token table comes from edgeinfer's tokenizer (the bytes each id stands for, EOG ids
as the end tokens), so SentencePiece and byte-level BPE vocabularies both work. Control
tokens and `<...>` user-defined tokens are marked special (a 0xff prefix, as llguidance's
llama.cpp binding does): grammar text never matches them; Lark's `<|name|>` syntax does.
"""

from __future__ import annotations

import json as _json
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from edgeinfer.errors import GrammarError
from edgeinfer.prompt.grammar_bounds import KIND_NAMES as _KIND_NAMES
from edgeinfer.prompt.grammar_bounds import check_bounds, check_grammar_bounds, check_schema_bounds
from edgeinfer.prompt.schema_rules import as_llama_cpp

__all__ = ["GrammarError", "Constraint", "GrammarMatcher", "json_schema", "any_json", "gbnf",
           "lark", "regex", "from_request", "lazy_tags", "check_bounds"]


def _llg():
    try:
        import llguidance
    except ImportError:  # a dependency, but say what is missing rather than a traceback
        raise GrammarError("constrained decoding needs the llguidance package "
                           "(pip install llguidance)") from None
    return llguidance


# JSON layout: llguidance's default lets whitespace run unbounded between tokens, which a
# small or uncertain model can fill forever. As llama.cpp's schema grammars: one space, or a
# newline and an indent of up to 20 (what pretty-printing needs). A schema's "x-guidance"
# options may change it.
JSON_LAYOUT = {"whitespace_pattern": r"( |\n[ \t]{0,20})?"}
# Where the answer must be JSON and nothing else (a forced tool call, strict json_schema
# output), at most one space or newline between tokens: `{"a": 1}`, `{"a":1}` and one value
# a line all pass, a run of two never does. A small model at temperature 1 otherwise spends
# much of its budget on indents (a newline and up to 20 more a gap, above and in llama.cpp's)
# before it closes the call. tool_choice "auto" (a call inside free text), non-strict schemas
# and json_object keep JSON_LAYOUT, as before: pretty-printed JSON stays possible there.
COMPACT_JSON_LAYOUT = {"whitespace_pattern": r"[ \n]?"}


@dataclass(frozen=True)
class Constraint:
    """A compiled, validated grammar (no per-sequence state: share it across requests)."""

    kind: str       # "json_schema", "json", "gbnf", "lark", "regex", "tools"
    source: str     # what the user gave, as text (for messages and /show)
    grammar: str    # llguidance's grammar definition

    def matcher(self, tokenizer) -> "GrammarMatcher":
        return GrammarMatcher(self, tokenizer)

    def describe(self) -> str:
        src = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"{self.kind}: {src}"


def _validated(kind: str, source: str, grammar: str) -> Constraint:
    llg = _llg()
    check_bounds(grammar, kind)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise GrammarError(f"invalid {_KIND_NAMES.get(kind, kind)}: {_one_line(messages[0])}")
    if kind in ("json_schema", "regex"):  # Lark may name token ids past a byte vocabulary's
        _check_satisfiable(kind, grammar)
    return Constraint(kind, source, grammar)


class _Bytes:
    """A vocabulary of the 256 bytes and an end token: enough to ask a grammar whether it
    admits anything at all."""

    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<end>"]
    special_token_ids = [256]

    def __call__(self, data: bytes | str) -> list[int]:
        return list(data.encode("utf-8") if isinstance(data, str) else data)


_byte_tokenizer = None


def _check_satisfiable(kind: str, grammar: str) -> None:
    """A grammar that admits no output at all (a schema that is only a reference to itself,
    an empty enum, minLength above maxLength) is a GrammarError, not an empty answer."""
    global _byte_tokenizer
    llg = _llg()
    if _byte_tokenizer is None:
        _byte_tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()), n_vocab=257, eos_token=[256])
    m = llg.LLMatcher(_byte_tokenizer, grammar)
    if m.is_error():
        raise GrammarError(f"invalid {_KIND_NAMES.get(kind, kind)}: {_one_line(m.get_error())}")
    if not m.is_accepting() and not any(m.validate_tokens([b]) == 1 for b in range(256)):
        raise GrammarError(f"invalid {_KIND_NAMES.get(kind, kind)}: it admits no output at all")




def _one_line(msg: str) -> str:
    lines = [ln.strip() for ln in str(msg).strip().splitlines() if ln.strip()]
    text = " | ".join(lines[:4])
    return text if len(text) <= 400 else text[:397] + "..."


def json_schema(schema: Mapping[str, Any] | str | bool, *, compact: bool = False) -> Constraint:
    """Output must be JSON valid against `schema` (a dict, or its JSON text), read as llama.cpp
    reads it (edgeinfer.prompt.schema_rules: an object with properties and no
    additionalProperties takes only those keys, an integer at most 16 digits); `compact`: at
    most one space or newline between its tokens (COMPACT_JSON_LAYOUT, for strict output)."""
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise GrammarError(f"invalid JSON schema: not JSON ({exc})") from None
    if schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise GrammarError(f"invalid JSON schema: expected an object, got {type(schema).__name__}")
    check_schema_bounds(schema)
    try:
        text = _json.dumps(schema, ensure_ascii=False)
        # as llama.cpp's converter: objects closed to their properties, integers of 16 digits
        read = _json.dumps(as_llama_cpp(schema), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None
    try:
        grammar = _llg().LLMatcher.grammar_from_json_schema(
            read, defaults=COMPACT_JSON_LAYOUT if compact else JSON_LAYOUT)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {_one_line(str(exc))}") from None
    return _validated("json_schema", text, grammar)


def any_json() -> Constraint:
    """Output must be one JSON object (OpenAI's json_object mode, Ollama's format: "json")."""
    grammar = _llg().LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
    return _validated("json", "json", grammar)


def gbnf(text: str) -> Constraint:
    """A llama.cpp GBNF grammar (`root ::= ...`); Lark text is accepted too."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("invalid GBNF grammar: it is empty")
    check_grammar_bounds(text, "gbnf")
    try:
        lark_text = gbnf_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the converter raises bare Exceptions
        raise GrammarError(f"invalid GBNF grammar: {_one_line(str(exc))}") from None
    return _validated("gbnf", text, _llg().LLMatcher.grammar_from_lark(lark_text))


def lark(text: str) -> Constraint:
    """A grammar in llguidance's Lark dialect (`start: ...`)."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("invalid Lark grammar: it is empty")
    return _validated("lark", text, _llg().LLMatcher.grammar_from_lark(text))


def regex(pattern: str) -> Constraint:
    """Output must match `pattern` entirely (Rust regex syntax: `\\d` is any Unicode digit)."""
    if not isinstance(pattern, str) or pattern == "":
        raise GrammarError("invalid regular expression: it is empty")
    return _validated("regex", pattern, _llg().LLMatcher.grammar_from_regex(pattern))


def lazy_tags(tags: list[dict[str, Any]], *, text_regex: str = r"(.|\n)*") -> Constraint:
    """Free text, then a structured segment each time a trigger appears.

    Each tag: {"trigger": "<tool_call>", "begin": "<tool_call>\\n", "grammar": schema or
    Lark text, "end": "\\n</tool_call>"}; a `<...>` trigger is matched as a special token
    (so the vocabulary must have it). Used for tool_choice "auto" (edgeinfer.prompt.tool_calls).
    """
    llg = _llg()
    try:
        st = [llg.StructTag(trigger=t["trigger"], begin=t["begin"], grammar=t["grammar"], end=t["end"])
              for t in tags]
        text = llg.StructTag.to_grammar(st, text_regex=text_regex)
    except (AssertionError, KeyError, ValueError) as exc:
        raise GrammarError(f"invalid tool-call grammar: {exc}") from None
    if text.lstrip().startswith("{"):
        return _validated("tools", text, text)  # several grammars: already llguidance JSON
    return _validated("tools", text, llg.LLMatcher.grammar_from_lark(text))


def from_request(*, json_schema: Mapping[str, Any] | str | None = None, grammar: str | None = None,
                 regex: str | None = None, json: bool = False,
                 lark: str | None = None, compact: bool = False) -> Constraint | None:
    """The constraint a request asks for (at most one of the keywords), or None.

    `json_schema`: a JSON schema (`compact`: strict output, see json_schema); `json=True`:
    any JSON object; `grammar`: GBNF text; `regex`: a regular expression; `lark`:
    llguidance Lark text.
    """
    given = [name for name, v in (("json_schema", json_schema), ("grammar", grammar),
                                  ("regex", regex), ("lark", lark)) if v is not None]
    if json:
        given.append("json")
    if len(given) > 1:
        raise GrammarError(f"give at most one of json_schema, grammar, regex, json "
                           f"(got {', '.join(given)})")
    if json_schema is not None:
        return _compile_schema(json_schema, compact=compact)
    if grammar is not None:
        return gbnf(grammar)
    if regex is not None:
        return _compile_regex(regex)
    if lark is not None:
        return _compile_lark(lark)
    if json:
        return any_json()
    return None


_compile_schema, _compile_regex, _compile_lark = json_schema, regex, lark  # names from_request shadows


def gbnf_to_lark(text: str) -> str:
    """llguidance's GBNF-to-Lark conversion (Lark text is returned as it is), with its
    fixed-point pass made linear: the library's re-scans every rule once per level of a rule
    chain, so 1000 chained rules took 2-25 s and 4000 took 42 s; this takes milliseconds."""
    from llguidance import gbnf_to_lark as g2l

    if g2l.is_lark_syntax(text):
        return text
    rules = g2l.GrammarParser().parse(text)
    _resolve_gbnf(rules, g2l)
    res, prev_nl = "%llguidance {}\n\n", True
    for r in sorted(rules.values(), key=lambda r: r.order):  # as g2l.gbnf_to_lark prints them
        s = str(r)
        if not prev_nl and "\n" in s:
            res += "\n"
        res += s + "\n"
        prev_nl = "\n" in s
        if prev_nl:
            res += "\n"
    return res


def _resolve_gbnf(rules: dict, g2l) -> None:
    """g2l.resolve: rule references bound, root renamed start, and the rules whose every
    reference is to such a rule marked terminal (a worklist, not repeated passes), renamed."""
    for i, r in enumerate(rules.values()):
        r.order = i
        r.alternatives = r.alternatives.simplify()
    uses: dict[str, set[str]] = {}
    for r in rules.values():
        targets: set[str] = set()
        todo = [r.alternatives]
        while todo:
            node = todo.pop()
            if isinstance(node, g2l.RuleRefNode):
                if node.name not in rules:
                    raise Exception(f"Rule '{node.name}' not found")
                node.target = rules[node.name]
                targets.add(node.name)
            todo.extend(node.children())
        uses[r.name] = targets
    if "root" not in rules:
        raise Exception("No 'root' rule found")
    root = rules.pop("root")
    if "start" in rules:
        raise Exception("Rule 'start' already exists")
    root.name = "start"
    rules["start"] = root
    uses["start"] = uses.pop("root")
    users: dict[str, list[str]] = {name: [] for name in rules}
    for name, targets in uses.items():
        for t in targets:
            users["start" if t == "root" else t].append(name)
    waiting = {name: len({"start" if t == "root" else t for t in targets}) for name, targets in uses.items()}
    ready = [name for name, left in waiting.items() if left == 0 and name != "start"]
    while ready:
        name = ready.pop()
        rules[name].rule_is_terminal = True
        for user in users[name]:
            waiting[user] -= 1
            if waiting[user] == 0 and user != "start":
                ready.append(user)
    for r in list(rules.values()):
        new_name = re.sub(r"([a-z])([A-Z])", r"\1_\2", r.name.replace("-", "_")).lower()
        new_name = new_name.upper() if r.rule_is_terminal else new_name
        if r.name != new_name:
            if new_name in rules:
                raise Exception(f"Rule '{new_name}' already exists")
            del rules[r.name]
            r.name = new_name
            rules[new_name] = r


# ---------------------------------------------------------------------------
# Tokenizer bridge
# ---------------------------------------------------------------------------

_tokenizers: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def _special(tok, tid: int, text: bytes) -> bool:
    from edgeinfer.tokenizer import TokenAttr

    attr = tok.token_attr(tid)
    if attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN):
        return True
    return bool(attr & TokenAttr.USER_DEFINED) and text.startswith(b"<") and text.endswith(b">")


class _Vocab:
    """What llguidance's TokenizerWrapper reads: token bytes, end ids, a tokenize function."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.eos_token_id = next(iter(sorted(tok.eog_ids)), None) if tok.eog_ids else tok.eos_id
        self.bos_token_id = tok.bos_id
        tokens, special = [], []
        for tid in range(tok.vocab_size):
            piece = tok.token_to_piece(tid, special=True)
            if piece and _special(tok, tid, piece):
                tokens.append(b"\xff" + piece)
                special.append(tid)
            else:
                tokens.append(piece)
        self.tokens = tokens
        self.special_token_ids = special
        self._byte_ids: dict[int, int] = {}
        for tid, piece in enumerate(tokens):
            if len(piece) == 1 and tid not in special:
                self._byte_ids.setdefault(piece[0], tid)

    def __call__(self, data: bytes | str) -> list[int]:
        if isinstance(data, str):
            data = data.encode("utf-8")
        ids = self._tok.tokenize(data, add_special=False, parse_special=False)
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        # A SentencePiece space prefix (or anything else that does not decode back exactly):
        # spell the bytes, so the ids always stand for exactly `data`.
        if all(b in self._byte_ids for b in data):
            return [self._byte_ids[b] for b in data]
        return ids


def ll_tokenizer(tok):
    """llguidance's LLTokenizer for an edgeinfer Tokenizer (built once per tokenizer: ~1 s
    for a 262k vocabulary)."""
    with _tokenizers_lock:
        cached = _tokenizers.get(tok)
        if cached is not None:
            return cached
        llg = _llg()
        vocab = _Vocab(tok)
        eos = sorted(tok.eog_ids) or ([tok.eos_id] if tok.eos_id is not None else [])
        if not eos:
            raise GrammarError("constrained decoding needs an end-of-generation token; "
                               "this vocabulary has none")
        lt = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=tok.vocab_size, eos_token=eos)
        _tokenizers[tok] = lt
        return lt


# ---------------------------------------------------------------------------
# Per-sequence state
# ---------------------------------------------------------------------------

class GrammarMatcher:
    """One sequence's position in a grammar: `mask`, `advance`, `is_accepting`, `is_stopped`."""

    def __init__(self, constraint: Constraint, tokenizer) -> None:
        llg = _llg()
        self.constraint = constraint
        self.tokenizer = tokenizer
        lt = ll_tokenizer(tokenizer)
        self.n_vocab = tokenizer.vocab_size
        self._m = llg.LLMatcher(lt, constraint.grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"invalid {_KIND_NAMES.get(constraint.kind, constraint.kind)}: "
                               f"{_one_line(self._m.get_error())}")
        n_words = (lt.vocab_size + 31) // 32
        self._bits = np.zeros(n_words, dtype=np.int32)
        self.tokens: list[int] = []

    def allowed(self) -> np.ndarray:
        """Boolean (n_vocab,) array of the tokens the grammar allows next."""
        if self._m.is_error():
            raise GrammarError(f"grammar matcher failed: {_one_line(self._m.get_error())}")
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[:self.n_vocab].view(np.bool_)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` with every token the grammar forbids at -inf."""
        logits = np.asarray(logits).reshape(-1)
        allowed = self.allowed()
        if not allowed.any():
            raise GrammarError("the grammar allows no token here (the vocabulary cannot spell it)")
        return np.where(allowed[:logits.shape[0]], logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)

    def advance(self, token: int) -> None:
        """Consume a sampled token (it must be one `mask` allowed)."""
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"token {token} does not fit the grammar: "
                               f"{_one_line(self._m.get_error())}")
        self.tokens.append(int(token))

    def is_accepting(self) -> bool:
        """The text so far is a complete match (the sequence may end here)."""
        return self._m.is_accepting()

    def is_stopped(self) -> bool:
        """Nothing but an end token may follow: the sequence is complete."""
        return self._m.is_stopped()

    def reset(self) -> None:
        self._m.reset()
        self.tokens.clear()
