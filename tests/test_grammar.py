"""Constrained decoding: JSON schemas, any JSON, GBNF and regexes on tiny random-weight models."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

import edgeinfer
from edgeinfer.prompt import grammar
from edgeinfer.prompt.grammar import GrammarError
from edgeinfer.sampling import SamplingParams
from gguf_factory import TinyShape, bpe_vocab, spm_vocab, write_tiny_model

SMALL = TinyShape(n_embd=64, n_layer=1, n_head=2, n_head_kv=1, head_dim=32, n_ff=128, n_ctx=1024)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "array", "items": {"type": "number", "minimum": -90, "maximum": 90},
                        "minItems": 2, "maxItems": 2},
            },
            "required": ["city", "zip", "geo"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y", "z"]},
                 "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
        "note": {"type": ["string", "null"], "maxLength": 6},
    },
    "required": ["name", "age", "role", "code", "address", "tags"],
    "additionalProperties": False,
}

ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                       "kind": {"const": "item"},
                       "qty": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50}},
        "required": ["id", "kind"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}

CHOICE = {
    "type": "object",
    "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                        {"type": "string", "enum": ["yes", "no"]}]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar")
    out = {}
    for arch, vocab in (("qwen2", bpe_vocab("qwen2")), ("llama", spm_vocab())):
        path = write_tiny_model(root / f"{arch}.gguf", arch, "F32", vocab=vocab, shape=SMALL, seed=3)
        out[arch] = edgeinfer.load(str(path), n_ctx=1024, threads=1, download=False)
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_sampled_generations_always_validate(models, arch):  # ~10 s per vocabulary
    """temperature 1.0, no top-k/top-p/min-p: every sampled answer parses and validates."""
    model = models[arch]
    n = 0
    for schema, count in ((PERSON, 40), (ITEMS, 35), (CHOICE, 25)):
        constraint = grammar.json_schema(schema)  # compiled once, a fresh matcher per request
        for seed in range(count):
            r = model.generate("data:", constraint=constraint, temperature=1.0, top_k=0, top_p=1.0,
                               min_p=0.0, max_tokens=400, seed=seed)
            assert r.finish_reason == "stop", (seed, r.text)
            jsonschema.validate(json.loads(r.text), schema)
            n += 1
    assert n == 100  # x 2 vocabularies = 200 generations


def test_greedy_and_streamed_paths(models):
    model = models["qwen2"]
    r = model.generate("data:", json_schema=ITEMS, temperature=0, max_tokens=400)
    assert r.finish_reason == "stop"
    jsonschema.validate(json.loads(r.text), ITEMS)
    chunks = list(model.generate("data:", json_schema=ITEMS, temperature=0, max_tokens=400, stream=True))
    assert "".join(c.text for c in chunks) == r.text and chunks[-1].finish_reason == "stop"
    chat = model.chat([{"role": "user", "content": "hi"}], json_schema=json.dumps(PERSON),
                      temperature=0.9, seed=1, max_tokens=600)
    assert chat.finish_reason == "stop"
    jsonschema.validate(json.loads(chat.text), PERSON)


def test_unconstrained_output_does_not_validate(models):
    """The checks above can fail: without the grammar the same model writes no JSON."""
    r = models["qwen2"].generate("data:", temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                 max_tokens=40, seed=0)
    with pytest.raises(ValueError):
        jsonschema.validate(json.loads(r.text), PERSON)


def test_any_json_object(models):
    for seed in range(10):
        r = models["llama"].generate("x", json=True, temperature=1.0, seed=seed, max_tokens=300)
        if r.finish_reason == "length":  # free-form JSON may run long: it must still be a prefix
            assert r.text.lstrip().startswith("{")
            continue
        assert isinstance(json.loads(r.text), dict)


def test_gbnf_grammar(models):
    gbnf = r'''
root   ::= "move " dir " " num ("; " "move " dir " " num)?
dir    ::= "north" | "south" | "east" | "west"
num    ::= [1-9] [0-9]?
'''
    pat = re.compile(r"move (north|south|east|west) [1-9][0-9]?(; move (north|south|east|west) [1-9][0-9]?)?")
    for arch in ("qwen2", "llama"):
        for seed in range(15):
            r = models[arch].generate("go", grammar=gbnf, temperature=1.0, top_k=0, top_p=1.0,
                                      min_p=0.0, seed=seed, max_tokens=60)
            assert r.finish_reason == "stop" and pat.fullmatch(r.text), r.text


def test_regex(models):
    for seed in range(15):
        r = models["qwen2"].generate("id", regex=r"[A-F]{3}-[0-9]{2,4}(x|yy)?", temperature=1.0, top_k=0,
                                     top_p=1.0, min_p=0.0, seed=seed, max_tokens=30)
        assert re.fullmatch(r"[A-F]{3}-[0-9]{2,4}(x|yy)?", r.text), r.text


def test_matcher_state():
    c = grammar.regex("ab")
    from edgeinfer.tokenizer import Tokenizer

    vocab = bpe_vocab("qwen2")
    tok = Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": vocab["tokens"],
        "tokenizer.ggml.token_type": vocab["types"], "tokenizer.ggml.merges": vocab["merges"],
        "tokenizer.ggml.bos_token_id": vocab["bos"], "tokenizer.ggml.eos_token_id": vocab["eos"]})
    m = c.matcher(tok)
    logits = np.zeros(tok.vocab_size, np.float32)
    masked = m.mask(logits)
    allowed = np.flatnonzero(np.isfinite(masked))
    assert [tok.detokenize([int(i)]) for i in allowed] == ["a"]
    assert not m.is_accepting()
    m.advance(int(allowed[0]))
    b = tok.tokenize("b", add_special=False)[0]
    m.advance(b)
    assert m.is_accepting() and m.is_stopped()
    masked = m.mask(logits)
    assert set(np.flatnonzero(np.isfinite(masked))) <= set(tok.eog_ids)  # only an end token now
    with pytest.raises(GrammarError):
        c.matcher(tok).advance(b)  # "b" cannot come first


FLAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                        "role": {"enum": ["admin", "user"]},
                                        "tags": {"type": "array", "items": {"enum": ["x", "y"]}}},
        "required": ["name", "age", "role", "tags"], "additionalProperties": False}
# an answer to FLAT as its JSON tokens; a gap goes after one of them (single spaces elsewhere)
FLAT_TOKENS = ['{', '"name"', ':', '"Ann"', ',', '"age"', ':', '3', ',', '"role"', ':', '"user"', ',',
               '"tags"', ':', '[', '"x"', ',', '"y"', ']', '}']


def _flat_with(at: int, gap: str) -> str:
    return "".join(t + (gap if i == at else " ") for i, t in enumerate(FLAT_TOKENS[:-1])) + FLAT_TOKENS[-1]


def test_strict_schema_output_is_compact():
    """json_schema(compact=True), what strict json_schema output compiles to: at most one
    space or newline between two JSON tokens, anywhere; a run of two is refused. Without it
    (non-strict schemas) a newline and an indent still pass, for pretty-printing."""
    from edgeinfer.tokenizer import Tokenizer
    from oracles import grammar_admits

    vocab = bpe_vocab("qwen2")
    tok = Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": vocab["tokens"],
        "tokenizer.ggml.token_type": vocab["types"], "tokenizer.ggml.merges": vocab["merges"],
        "tokenizer.ggml.bos_token_id": vocab["bos"], "tokenizer.ggml.eos_token_id": vocab["eos"]})
    strict, loose = grammar.json_schema(FLAT, compact=True), grammar.json_schema(FLAT)
    for at in range(len(FLAT_TOKENS) - 1):
        for gap in ("", " ", "\n"):
            assert grammar_admits(strict, tok, _flat_with(at, gap), complete=True), (at, gap)
        for gap in ("  ", "\n\n", " \n", "\n ", "\n\t", "\t"):
            assert not grammar_admits(strict, tok, _flat_with(at, gap)), (at, gap)
        assert grammar_admits(loose, tok, _flat_with(at, "\n  "), complete=True), at
    assert not grammar_admits(strict, tok, " " + _flat_with(0, " "))  # nothing before the value either
    assert grammar.from_request(json_schema=FLAT, compact=True).grammar == strict.grammar
    assert grammar.from_request(json_schema=FLAT).grammar == loose.grammar != strict.grammar


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "if": {"type": "object"}, "then": {}}, "if"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"type": "wibble"}, "wibble"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ("{not json", "not JSON"),
    ([1, 2], "expected an object"),
    # schemas that admit no value at all: refused, never an empty answer
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "admits no output"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
    ({"enum": []}, "empty"),
])
def test_bad_schema(schema, words):
    with pytest.raises(GrammarError, match="JSON schema") as exc:
        grammar.json_schema(schema)
    assert words in str(exc.value)
    assert "\n" not in str(exc.value)


def test_bad_grammar_and_regex():
    with pytest.raises(GrammarError, match="GBNF grammar.*undefined_rule"):
        grammar.gbnf('root ::= "a" undefined_rule')
    with pytest.raises(GrammarError, match="GBNF grammar"):
        grammar.gbnf('root ::= "unterminated')
    with pytest.raises(GrammarError, match="GBNF grammar: it is empty"):
        grammar.gbnf("  ")
    with pytest.raises(GrammarError, match="regular expression.*unclosed group"):
        grammar.regex("a(b")
    with pytest.raises(GrammarError, match="at most one"):
        grammar.from_request(json_schema={}, regex="a")


def test_bad_constraint_through_the_api(models):
    with pytest.raises(GrammarError, match="Unimplemented keys"):
        models["qwen2"].generate("x", json_schema={"type": "object", "if": {}}, max_tokens=4)
    with pytest.raises(edgeinfer.errors.EdgeInferError, match="constraint must be"):
        SamplingParams(constraint="json").validate()


def test_mask_cost_on_a_large_vocabulary():
    """The mask of a 40k-token byte-level vocabulary costs well under a millisecond or so."""
    import time

    from edgeinfer.tokenizer import Tokenizer

    vocab = bpe_vocab("qwen2")
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz{}\":,0123456789 "))
    extra = {"".join(rng.choice(letters, rng.integers(2, 8))) for _ in range(40_000)}
    tokens = vocab["tokens"] + sorted(extra - set(vocab["tokens"]))
    tok = Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": vocab["types"] + [1] * (len(tokens) - len(vocab["types"])),
        "tokenizer.ggml.merges": vocab["merges"],
        "tokenizer.ggml.bos_token_id": vocab["bos"], "tokenizer.ggml.eos_token_id": vocab["eos"]})
    m = grammar.json_schema(PERSON).matcher(tok)
    times = []
    for _ in range(60):
        logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
        t0 = time.perf_counter()
        masked = m.mask(logits)
        times.append(time.perf_counter() - t0)
        token = int(np.argmax(masked))
        if tok.is_eog(token):
            break
        m.advance(token)
    assert np.median(times) < 0.02  # generous for a shared CI machine; measured ~0.3 ms


def test_run_format_and_grammar_file(tmp_path, models, capsys):
    from edgeinfer.cli import main

    path = str(models["qwen2"].path)
    schema = tmp_path / "items.schema.json"
    schema.write_text(json.dumps(ITEMS))
    assert main(["run", path, "data:", "--raw", "--format", str(schema), "-n", "400", "--seed", "2",
                 "-c", "1024", "-t", "1"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), ITEMS)
    gbnf = tmp_path / "yes.gbnf"
    gbnf.write_text('root ::= ("yes" | "no") "!"\n')
    assert main(["run", path, "q", "--raw", "--grammar-file", str(gbnf), "-n", "20", "-c", "1024"]) == 0
    assert capsys.readouterr().out.strip() in ("yes!", "no!")
    bad = tmp_path / "bad.schema.json"
    bad.write_text('{"type": "object", "if": {}}')
    assert main(["run", path, "x", "--raw", "--format", str(bad)]) != 0
    assert "Unimplemented keys" in capsys.readouterr().err
