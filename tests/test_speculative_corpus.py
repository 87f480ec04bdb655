"""The lookup corpus (`--lookup-cache-static` / `--lookup-cache-dynamic`), the session's
earlier requests as drafting source, the n-gram cache file's checks, and the draft length
chosen from measured batch costs."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import edgeinfer
from edgeinfer.cli import main
from edgeinfer.speculative import BatchCosts, DraftLength, LookupCorpus, NgramLookup, Speculation, SpeculativeParams
from edgeinfer.speculative.ngram_cache import MAGIC, NgramCache, NgramCacheError, vocab_digest

PROMPT = "hello world hello world hello world hello"  # the tiny model answers 40 tokens


@pytest.fixture(scope="module")
def model(tiny_models):
    return edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=160)


def _tokens(chunks):
    return [c.token for c in chunks if c.token is not None]


def _greedy(model, ids, spec=None, n=40):
    params = edgeinfer.sampling.SamplingParams(temperature=0, max_tokens=n)
    return _tokens(model.sessions.generate(ids, params, speculation=spec))


def _eager(spec: Speculation) -> Speculation:
    spec.length.next_k = lambda limit: min(spec.length.params.n_max, limit)
    return spec


# -- the n-gram cache and its file ------------------------------------------------------------
def test_cache_counts_and_round_trips(tmp_path):
    c = NgramCache(100, b"d" * 32)
    c.update([1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 5])
    assert c.best([2, 3, 4], 3) == (5, 2, 3)
    assert c.best([9], 1) is None
    c.save(tmp_path / "c.bin")
    back = NgramCache.load(tmp_path / "c.bin", 100, b"d" * 32)
    assert back.table == c.table
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temp file, renamed


def test_cache_memory_is_capped():
    c = NgramCache(1000, max_ngrams=200)
    c.update(np.random.default_rng(0).integers(0, 1000, 2000).tolist())
    assert 0 < len(c) <= 200
    c = NgramCache(1000)
    for t in range(100):  # one n-gram followed by 100 different tokens
        c.add(c.key([7]), t)
    assert len(c.successors(c.key([7]))) == 8 and 99 in c.successors(c.key([7]))


def _corrupt(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + struct.pack("<i", value) + data[offset + 4:]


@pytest.mark.parametrize("damage, message", [
    (lambda d: b"nonsense" + d[8:], "not an edgeinfer n-gram cache"),
    (lambda d: d[:-3], "truncated"),
    (lambda d: d + b"\0\0\0\0", "truncated"),
    (lambda d: _corrupt(d, 64, 5000), "outside the vocabulary"),      # first n-gram's first token
    (lambda d: _corrupt(d, 64 + 8, 7), "bad padding"),  # [1, -1, 7, -1]: a token after the padding
    (lambda d: _corrupt(d, len(d) - 4, 0), "count is out of range"),  # last count
    (lambda d: _corrupt(d, len(d) - 4, -3), "count is out of range"),
    (lambda d: d[:8] + struct.pack("<I", 99) + d[12:], "another vocabulary"),
    (lambda d: d[:12] + b"x" * 32 + d[44:], "another vocabulary"),
    (lambda d: d[:48] + struct.pack("<Q", 10 ** 9) + d[56:], "more than the cap"),
])
def test_a_damaged_cache_file_is_one_clear_error(tmp_path, damage, message):
    c = NgramCache(100, b"v" * 32)
    c.update([1, 2, 3, 1, 2, 4])
    data = c.to_bytes()
    assert data.startswith(MAGIC)
    path = tmp_path / "bad.bin"
    path.write_bytes(damage(data))
    with pytest.raises(NgramCacheError) as e:
        NgramCache.load(path, 100, b"v" * 32)
    text = str(e.value)
    assert "\n" not in text and str(path) in text and message in text


# -- drafting ---------------------------------------------------------------------------------
def test_static_text_corpus_drafts_what_it_holds(model, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("xx abcdefghijklmnop yy\n")
    lk = NgramLookup.for_model(model, LookupCorpus(static=str(corpus)))
    ids = model.tokenize("abcdef", add_special=False)
    rest = model.tokenize("abcdefghijklmnop", add_special=False)[len(ids):]
    assert len(rest) >= 6
    lk.begin(ids)
    assert lk.propose(ids, len(rest)) == rest
    assert PromptLookupFree(model).propose(ids, 4) == []  # the context alone has nothing


def PromptLookupFree(model):
    lk = NgramLookup(model.config.n_vocab)
    lk.begin([])
    return lk


def test_earlier_requests_feed_the_drafter():
    lk = NgramLookup(1000)
    first = [10, 11, 12, 13, 14, 15, 16, 17]
    lk.begin(first[:4])
    lk.observe(first)  # the loop's history, grown to the whole request
    lk.propose(first[:4], 2)
    second = [99, 12, 13, 14]
    lk.begin(second)
    assert lk.propose(second, 4) == [15, 16, 17]


def test_the_context_wins_over_a_cache_at_equal_length():
    lk = NgramLookup(1000)
    lk.begin([1, 2, 3, 4, 9])
    lk.observe([1, 2, 3, 4, 9])
    lk.begin([])
    ctx = [1, 2, 3, 4, 7, 1, 2, 3, 4]  # this request says 4 -> 7, the session 4 -> 9
    assert lk.propose(ctx, 1) == [7]


@pytest.mark.parametrize("n_max", [2, 5, 12])
def test_greedy_with_the_corpus_drafter_is_identical(model, tmp_path, n_max):
    ids = model.tokenize(PROMPT)
    want = _greedy(model, ids)
    assert len(want) == 40
    # a saved cache holding the prompt and the answer's first half, some of it wrong: the
    # first half is drafted right, the second half from the context only
    cache = NgramCache(model.config.n_vocab, vocab_digest(model.tokenizer))
    wrong = [(t + 1) % model.config.n_vocab for t in want[10:14]]
    cache.update(ids + want[:10] + wrong + want[14:20])
    cache.save(tmp_path / "answer.bin")
    lk = NgramLookup.for_model(model, LookupCorpus(static=str(tmp_path / "answer.bin")))
    spec = _eager(Speculation(lk, SpeculativeParams(n_max=n_max)))
    assert _greedy(model, ids, spec) == want
    assert spec.accepted >= 8 and spec.drafted > spec.accepted
    model.sessions.check_invariants()
    # the next request drafts the whole answer from the session's memory of this one
    spec2 = _eager(Speculation(lk, SpeculativeParams(n_max=n_max)))
    assert _greedy(model, ids, spec2) == want
    assert spec2.accepted >= len(want) // 2


def test_dynamic_cache_is_saved_and_used_by_the_next_session(tiny_models, tmp_path):
    path = str(tiny_models["llama"])
    dyn = tmp_path / "dyn.bin"
    m = edgeinfer.load(path, backend="reference", n_ctx=160, draft=LookupCorpus(dynamic=str(dyn)), draft_max=8)
    plain = m.generate(PROMPT, temperature=0, max_tokens=30, draft_max=0).text
    assert m.generate(PROMPT, temperature=0, max_tokens=30, draft_adaptive=False).text == plain
    assert not dyn.exists()
    m.drafter.close()
    assert dyn.exists() and dyn.read_bytes().startswith(MAGIC)
    m2 = edgeinfer.load(path, backend="reference", n_ctx=160, draft=LookupCorpus(dynamic=str(dyn)), draft_max=8)
    r = m2.generate(PROMPT, temperature=0, max_tokens=30, draft_adaptive=False)
    assert r.text == plain
    # the first session's answer, drafted from the file: nearly every draft is right
    assert r.timings.draft_n_accepted >= 25 and r.timings.draft_n_accepted >= 0.8 * r.timings.draft_n
    # a cache made with another vocabulary is refused in one line
    other = NgramCache(m2.config.n_vocab + 1)
    other.update([1, 2, 3])
    other.save(tmp_path / "other.bin")
    with pytest.raises(NgramCacheError, match="another vocabulary"):
        edgeinfer.load(path, backend="reference", n_ctx=64, draft=LookupCorpus(static=str(tmp_path / "other.bin")))
    same_size = NgramCache(m2.config.n_vocab, b"\1" * 32)
    same_size.update([1, 2, 3])
    same_size.save(tmp_path / "texts.bin")
    with pytest.raises(NgramCacheError, match="another vocabulary"):
        edgeinfer.load(path, backend="reference", n_ctx=64, draft=LookupCorpus(dynamic=str(tmp_path / "texts.bin")))


def test_a_saved_static_cache_matches_its_text(model, tmp_path):
    text = tmp_path / "c.py"
    text.write_text("def f(x):\n    return x + 1\n" * 3)
    toks = model.tokenize(text.read_text(), add_special=False)
    cache = NgramCache(model.config.n_vocab, vocab_digest(model.tokenizer))
    cache.update(toks)
    cache.save(tmp_path / "c.bin")
    a = NgramLookup.for_model(model, LookupCorpus(static=str(text)))
    b = NgramLookup.for_model(model, LookupCorpus(static=str(tmp_path / "c.bin")))
    assert a.static.table == b.static.table


# -- the command line -------------------------------------------------------------------------
FAST = ["--backend", "reference", "--temp", "0", "--raw", "-n", "4", "-c", "64"]


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_cli_bad_lookup_files_are_one_line_errors(tiny_models, tmp_path, capsys):
    path = str(tiny_models["llama"])
    err = _one_line_error(capsys, ["run", path, "hello", *FAST, "-lcs", str(tmp_path / "missing.txt")])
    assert "missing.txt" in err and "no such file" in err
    bad = tmp_path / "bad.bin"
    bad.write_bytes(MAGIC + b"\0" * 20)
    err = _one_line_error(capsys, ["run", path, "hello", *FAST, "--lookup-cache-static", str(bad)])
    assert "bad.bin" in err and "n-gram cache" in err
    err = _one_line_error(capsys, ["run", path, "hello", *FAST, "-lcd", str(bad)])
    assert "bad.bin" in err
    txt = tmp_path / "notes.txt"
    txt.write_text("some text")
    err = _one_line_error(capsys, ["run", path, "hello", *FAST, "-lcd", str(txt)])
    assert "notes.txt" in err and "not an edgeinfer n-gram cache" in err
    err = _one_line_error(capsys, ["run", path, "hello", *FAST, "-lcd", str(tmp_path / "no" / "dir.bin")])
    assert "no such directory" in err
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00\x01" * 10)
    err = _one_line_error(capsys, ["run", path, "hello", *FAST, "-lcs", str(binary)])
    assert "blob.bin" in err and "UTF-8" in err
    err = _one_line_error(capsys, ["run", path, "hello", *FAST, "-lcs", str(txt), "--draft", str(tiny_models["qwen2"])])
    assert "--draft lookup" in err


def test_cli_lookup_cache_flags_run_and_save(tiny_models, tmp_path):
    """`run` with -lcs/-lcd answers as without them, and its interpreter's exit writes the
    dynamic cache (a process of its own: the exit is what saves the file)."""
    import subprocess
    import sys

    path = str(tiny_models["llama"])
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PROMPT * 3)
    run = [sys.executable, "-m", "edgeinfer.cli", "run", path, PROMPT, *FAST, "-n", "12"]
    plain = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    dyn = tmp_path / "dyn.bin"
    spec = subprocess.run([*run, "-lcs", str(corpus), "-lcd", str(dyn)], capture_output=True, text=True,
                          timeout=300)
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert dyn.exists()
    NgramCache.load(dyn)  # a well-formed cache


def test_flags_make_a_lookup_corpus():
    import argparse

    from edgeinfer.commands.model_flags import add_model_options, model_kwargs

    p = argparse.ArgumentParser()
    add_model_options(p)
    kw = model_kwargs(p.parse_args(["-lcd", "/tmp/x-edgeinfer-test.bin"]))
    assert kw["draft"] == LookupCorpus(static=None, dynamic="/tmp/x-edgeinfer-test.bin")
    assert str(kw["draft"]) == "lookup"
    assert model_kwargs(p.parse_args([]))["draft"] is None


# -- the draft length from measured batch costs -----------------------------------------------
def _simulate(cost_rows, alpha_true: float, steps: int = 400, n_max: int = 16, seed: int = 0) -> list[int]:
    """Run DraftLength against a machine where n rows cost cost_rows(n) decode steps and each
    drafted token is right with probability alpha_true; the k it picks, step by step."""
    rng = np.random.default_rng(seed)
    dl = DraftLength(SpeculativeParams(n_max=n_max))
    t1 = 0.01
    picked = []
    for _ in range(steps):
        k = dl.next_k(n_max)
        picked.append(k)
        if k == 0:
            dl.plain_step(t1)
            continue
        acc = 0
        while acc < k and rng.random() < alpha_true:
            acc += 1
        dl.verified(k, acc, t1 * cost_rows(k + 1), 0.0)
    return picked


def test_cheap_rows_make_long_drafts():
    cheap = _simulate(lambda n: 1.0 + 0.05 * (n - 1), 0.9)
    dear = _simulate(lambda n: 1.0 + 0.8 * (n - 1), 0.9)
    tail = slice(-100, None)
    assert np.median(cheap[tail]) >= 8, cheap[tail]
    assert np.median(dear[tail]) <= 4, dear[tail]
    assert np.median(cheap[tail]) > np.median(dear[tail])
    # rows that cost as much as a decode step each: speculation never pays
    assert np.median(_simulate(lambda n: float(n), 0.6)[tail]) == 0


def test_a_cliff_in_batch_cost_is_learned():
    # rows are cheap up to 8, then each costs a whole decode step: the draft stays below it
    picked = _simulate(lambda n: 1.0 + 0.05 * (n - 1) if n <= 8 else 1.35 + 1.0 * (n - 8), 0.95)
    assert 5 <= np.median(picked[-100:]) <= 9


def test_batch_costs_interpolate_and_persist_across_requests(tiny_models):
    costs = BatchCosts()
    costs.t1 = 0.01
    for _ in range(2):   # each size's first verification runs cold and is not counted
        costs.verified(3, 0.012, 0.0)   # 3 rows: 1.2 steps
        costs.verified(9, 0.018, 0.0)   # 9 rows: 1.8 steps
    r = costs.ratios(12)
    assert r[0] == 1.0 and abs(r[2] - 1.2) < 1e-9 and abs(r[8] - 1.8) < 1e-9
    assert 1.2 < r[5] < 1.8 and r[11] > r[8]
    assert all(a <= b for a, b in zip(r, r[1:]))
    from edgeinfer.speculative.setup import speculation_for

    m = edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=64, draft="lookup")
    s1 = speculation_for(m.drafter, m.draft_defaults, {})
    s2 = speculation_for(m.drafter, m.draft_defaults, {})
    assert s1.length.costs is s2.length.costs


def test_a_tie_goes_to_the_source_that_has_been_right():
    # the session remembers 1 2 3 4 -> 9 (an earlier answer); this request's prompt says
    # 1 2 3 4 -> 7: the context wins a tie until its drafts keep being rejected
    lk = NgramLookup(1000)
    lk.begin([1, 2, 3, 4, 9, 9])
    lk.observe([1, 2, 3, 4, 9, 9])
    lk.begin([])
    ctx = [1, 2, 3, 4, 7, 5, 1, 2, 3, 4]
    assert lk.propose(ctx, 1) == [7]
    rejected = 0
    while lk.propose(ctx, 1) == [7] and rejected < 10:
        lk.accept(1, 0)  # rejected
        rejected += 1
    assert 1 <= rejected <= 3 and lk.propose(ctx, 1) == [9]
