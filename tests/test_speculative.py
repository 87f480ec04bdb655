"""Speculative decoding: greedy output identical to plain decoding, sampling unchanged,
K/V and prefix cache consistent after rejected drafts, vocabulary checks, request fields."""

from __future__ import annotations

import numpy as np
import pytest

import edgeinfer
from edgeinfer.errors import EdgeInferError
from edgeinfer.speculative import PromptLookup, Speculation, SpeculativeParams
from edgeinfer.speculative.drafter import DraftLength, accept_speculative
from edgeinfer.speculative.draft_model import DraftModel
from gguf_factory import bpe_vocab, spm_vocab, write_tiny_model

PROMPTS = [
    "a b c d a b c d a b c d a b",
    "hello world hello world hello world hello",
    "one two three four five one two three four five one two",
    "the cat sat on the mat. the cat sat on the mat. the cat",
    "x y z",
    "zebra quantum yellow lamp",
]


class OracleDrafter:
    """Proposes a known continuation, corrupted every `every`-th token: exercises every
    acceptance length, including full acceptance and immediate rejection."""

    name = "oracle"

    def __init__(self, truth: list[int], n_prompt: int, every: int, n_vocab: int) -> None:
        self.truth, self.n_prompt, self.every, self.n_vocab = truth, n_prompt, every, n_vocab
        self.calls = 0

    def begin(self, prompt):
        pass

    def propose(self, context, k):
        self.calls += 1
        i = len(context) - self.n_prompt
        out = list(self.truth[i:i + k])
        if self.every and out and self.calls % self.every == 0:
            j = self.calls % len(out)
            out[j] = (out[j] + 1) % self.n_vocab
        return out

    def accept(self, n_drafted, n_accepted):
        pass


def _eager(length: DraftLength) -> None:
    """Always draft as much as allowed (the tests want drafts, not the cost model's choice)."""
    length.next_k = lambda limit: min(length.params.n_max, limit)


def _spec(drafter, n_max=8, eager=True) -> Speculation:
    s = Speculation(drafter, SpeculativeParams(n_max=n_max))
    if eager:
        _eager(s.length)
    return s


@pytest.fixture(scope="module")
def model(tiny_models):
    return edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=128)


def _plain(model, ids, **kw):
    return list(model.sessions.generate(ids, edgeinfer.sampling.SamplingParams(**kw)))


def _tokens(chunks):
    return [c.token for c in chunks if c.token is not None]


def _run(model, ids, spec, **kw):
    return list(model.sessions.generate(ids, edgeinfer.sampling.SamplingParams(**kw), speculation=spec))


@pytest.mark.parametrize("n_max", [1, 2, 3, 5, 8, 16])
def test_greedy_lookup_is_identical(model, n_max):
    accepted = rejected = 0
    for text in PROMPTS:
        ids = model.tokenize(text)
        want = _tokens(_plain(model, ids, temperature=0, max_tokens=40))
        model.reset()
        spec = _spec(PromptLookup(), n_max=n_max)
        got = _run(model, ids, spec, temperature=0, max_tokens=40)
        assert _tokens(got) == want, text
        model.sessions.check_invariants()
        seq = model.sessions._resident
        assert seq is not None and seq.tokens[:seq.n_used] == (ids + want)[:seq.n_used]
        assert seq.n_used >= len(ids) + len(want) - 1
        accepted, rejected = accepted + spec.accepted, rejected + spec.drafted - spec.accepted
    assert accepted > 0 and rejected > 0  # both paths ran


@pytest.mark.parametrize("every", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("n_max", [1, 4, 9])
def test_greedy_with_oracle_drafts_is_identical(model, every, n_max):
    for text in PROMPTS[:4]:
        ids = model.tokenize(text)
        want = _tokens(_plain(model, ids, temperature=0, max_tokens=30))
        spec = _spec(OracleDrafter(want, len(ids), every, model.config.n_vocab), n_max=n_max)
        got = _run(model, ids, spec, temperature=0, max_tokens=30)
        assert _tokens(got) == want
        last = got[-1]
        assert last.timings.draft_n == spec.drafted and spec.accepted <= spec.drafted
        if every == 0 and len(want) > 1:
            assert spec.accepted > 0 and spec.accepted == spec.drafted
        model.sessions.check_invariants()


def test_seeded_sampling_draws_the_same_tokens(model):
    ids = model.tokenize(PROMPTS[0])
    for seed in range(4):
        kw = dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=30)
        want = _tokens(_plain(model, ids, **kw))
        spec = _spec(OracleDrafter(want, len(ids), 3, model.config.n_vocab), n_max=4)
        assert _tokens(_run(model, ids, spec, **kw)) == want
        assert _tokens(_run(model, ids, _spec(PromptLookup(), n_max=6), **kw)) == want


def test_prefix_cache_after_speculation_matches_a_fresh_prefill(model):
    ids = model.tokenize(PROMPTS[3])
    model.reset()
    got = _tokens(_run(model, ids, _spec(PromptLookup(), n_max=8), temperature=0, max_tokens=60))
    full = ids + got
    # the committed blocks give the same continuation as a cache-free run
    model.reset()
    want = _tokens(_plain(model, full, temperature=0, max_tokens=10))
    _run(model, ids, _spec(PromptLookup(), n_max=8), temperature=0, max_tokens=60)
    again = _plain(model, full, temperature=0, max_tokens=10)
    assert _tokens(again) == want
    assert again[-1].usage.cached_tokens > 0


def test_context_shift_with_speculation(tiny_models):
    m = edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=48, context_shift=True,
                       n_keep=4)
    ids = m.tokenize(PROMPTS[2])
    want = _tokens(_plain(m, ids, temperature=0, max_tokens=120))
    m.reset()
    spec = _spec(PromptLookup(), n_max=6)
    assert _tokens(_run(m, ids, spec, temperature=0, max_tokens=120)) == want
    m.sessions.check_invariants()


def test_draft_model_same_file_accepts_everything(tiny_models):
    m = edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=128,
                       draft=str(tiny_models["llama"]), draft_p_min=0.0)
    for text in PROMPTS[:3]:
        want = m.generate(text, temperature=0, max_tokens=30, draft_max=0).tokens
        got = m.generate(text, temperature=0, max_tokens=30, draft_max=6)
        assert got.tokens == want
    spec = _spec(m.drafter, n_max=6)
    ids = m.tokenize(PROMPTS[4])
    want = _tokens(_plain(m, ids, temperature=0, max_tokens=30))
    assert _tokens(_run(m, ids, spec, temperature=0, max_tokens=30)) == want
    assert spec.drafted > 0 and spec.accepted == spec.drafted


def test_draft_model_other_weights_is_identical(tiny_models, tmp_path):
    other = write_tiny_model(tmp_path / "other.gguf", "llama", "F32", vocab=spm_vocab(), seed=5)
    m = edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=128)
    from edgeinfer.engine import Engine, EngineOptions
    from edgeinfer.loader import open_model

    drafter = DraftModel(Engine(open_model(other), EngineOptions(n_ctx=128, backend="reference")), p_min=0.0)
    for n_max in (1, 3, 7):
        for text in PROMPTS:
            ids = m.tokenize(text)
            want = _tokens(_plain(m, ids, temperature=0, max_tokens=25))
            assert _tokens(_run(m, ids, _spec(drafter, n_max=n_max), temperature=0, max_tokens=25)) == want


def test_draft_model_vocabulary_mismatch_is_one_clear_error(tiny_models, tmp_path):
    with pytest.raises(EdgeInferError, match="same vocabulary"):
        edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=64, draft=str(tiny_models["qwen2"]))
    vocab = spm_vocab()
    vocab = dict(vocab, tokens=list(vocab["tokens"]))
    vocab["tokens"][40] = "zzzz-not-the-same"
    odd = write_tiny_model(tmp_path / "odd.gguf", "llama", "F32", vocab=vocab)
    with pytest.raises(EdgeInferError, match="token 40") as e:
        edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=64, draft=str(odd))
    assert "\n" not in str(e.value)


def test_lookup_proposals():
    lk = PromptLookup()
    lk.begin([1, 2, 3, 4, 5, 1, 2])
    assert lk.propose([1, 2, 3, 4, 5, 1, 2], 3) == [3, 4, 5]
    assert lk.propose([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 9], 2) == []
    lk.begin([7, 8, 7])
    assert lk.propose([7, 8, 7], 5) == [8, 7, 8, 7, 8]  # a loop drafts its next periods
    lk.begin([])
    assert lk.propose([5, 6, 7], 4) == []


def test_draft_length_backs_off_when_drafts_fail():
    dl = DraftLength(SpeculativeParams(n_max=16))
    dl.plain_step(0.01)
    assert dl.next_k(16) > 0
    for _ in range(10):
        dl.verified(dl.next_k(16) or 1, 0, 0.02, 0.0)
    assert dl.next_k(16) == 0
    for _ in range(10):
        dl.verified(4, 4, 0.012, 0.0)
    assert dl.next_k(16) >= 4


def test_speculative_params_are_checked():
    with pytest.raises(ValueError):
        SpeculativeParams(n_max=100).validate()
    with pytest.raises(ValueError):
        SpeculativeParams(n_max=4, n_min=5).validate()


def test_accept_speculative_keeps_the_target_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.6, 0.2, 0.1])
    for qq in (q, None):
        counts = np.zeros(4)
        n = 20000
        for _ in range(n):
            d = int(rng.choice(4, p=q)) if qq is not None else 1
            counts[accept_speculative(p, qq, d, rng)[1]] += 1
        assert 0.5 * np.abs(counts / n - p).sum() < 0.02


def test_completion_speculative_fields_and_timings(tiny_models):
    import httpx

    from test_server import start_server

    m = edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=128, draft="lookup")
    live = start_server(m)
    try:
        body = {"prompt": PROMPTS[0], "n_predict": 24, "temperature": 0}
        plain = httpx.post(live.url + "/completion", json={**body, "speculative.n_max": 0}).json()
        spec = httpx.post(live.url + "/completion", json={**body, "speculative.n_max": 8,
                                                          "speculative.n_min": 1, "speculative.p_min": 0.5}).json()
        assert spec["content"] == plain["content"]
        assert "draft_n" not in plain["timings"]
        t = spec["timings"]
        assert t.get("draft_n", 0) >= t.get("draft_n_accepted", 0) >= 0
        bad = httpx.post(live.url + "/completion", json={**body, "speculative.n_max": 99})
        assert bad.status_code == 400 and "speculative.n_max" in bad.text
    finally:
        live.stop()


def test_cli_draft_flags():
    import argparse

    from edgeinfer.commands.model_flags import add_model_options, model_kwargs

    p = argparse.ArgumentParser()
    add_model_options(p)
    kw = model_kwargs(p.parse_args(["--draft", "lookup", "--draft-max", "8", "--draft-min", "2"]))
    assert kw["draft"] == "lookup" and kw["draft_max"] == 8 and kw["draft_min"] == 2
    with pytest.raises(ValueError):
        model_kwargs(p.parse_args(["--draft-max", "64"]))


def test_sampled_distribution_matches_plain_sampling(model):
    """Independent seeds on both sides: the first three tokens' joint distribution under
    speculation (drafting the greedy path, so drafts are partly accepted) matches plain
    sampling's, by total variation distance over 300 draws each."""
    from collections import Counter

    ids = model.tokenize(PROMPTS[1])
    greedy = _tokens(_plain(model, ids, temperature=0, max_tokens=3))
    kw = dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0, max_tokens=3)
    n = 300
    plain = Counter(tuple(_tokens(_plain(model, ids, seed=s, **kw))) for s in range(n))
    spec_counts = Counter()
    drafted = accepted = 0
    for s in range(n):
        spec = _spec(OracleDrafter(greedy, len(ids), 0, model.config.n_vocab), n_max=2)
        spec_counts[tuple(_tokens(_run(model, ids, spec, seed=10_000 + s, **kw)))] += 1
        drafted, accepted = drafted + spec.drafted, accepted + spec.accepted
    assert 0 < accepted < drafted
    keys = set(plain) | set(spec_counts)
    tv = 0.5 * sum(abs(plain[k] - spec_counts[k]) for k in keys) / n
    # two samples of one distribution over <= 64 outcomes: TV about 0.1-0.2 at n=300
    same = Counter(tuple(_tokens(_plain(model, ids, seed=20_000 + s, **kw))) for s in range(n))
    tv_same = 0.5 * sum(abs(plain[k] - same[k]) for k in set(plain) | set(same)) / n
    assert tv < max(0.25, 1.6 * tv_same), (tv, tv_same)


def test_grammar_and_logprobs_work_with_speculation(model):
    """The grammar's mask and the logprobs are taken per sampled row, as without speculation."""
    from edgeinfer.prompt import grammar

    ids = model.tokenize(PROMPTS[0])
    for extra in (dict(constraint=grammar.from_request(regex="(a b )+c")), dict(logprobs=3),
                  dict(logprobs=2, post_sampling_probs=True)):
        kw = dict(temperature=0, max_tokens=20, **extra)
        want = _plain(model, ids, **kw)
        spec = _spec(PromptLookup(), n_max=5)
        got = _run(model, ids, spec, **kw)
        assert _tokens(got) == _tokens(want)
        assert [c.logprobs for c in got] == [c.logprobs for c in want]
        assert "".join(c.text for c in got) == "".join(c.text for c in want)


@pytest.mark.slow
def test_gemma_greedy_lookup_and_self_draft_are_identical(gemma_path):
    m = edgeinfer.load(str(gemma_path), n_ctx=512, draft="lookup")
    prompts = ["def add(a, b):\n    return a + b\n\n# the same function again:\ndef add(a, b):\n",
               "Roses are red, violets are blue. Roses are red, violets are",
               "The capital of France is"]
    for text in prompts:
        ids = m.tokenize(text)
        m.reset()   # every run prefills the whole prompt (a cached prefix re-evaluates its last token alone)
        want = _tokens(_plain(m, ids, temperature=0, max_tokens=24))
        for n_max in (3, 8):
            m.reset()
            spec = _spec(PromptLookup(), n_max=n_max)
            assert _tokens(_run(m, ids, spec, temperature=0, max_tokens=24)) == want, (text, n_max)
    from edgeinfer.speculative.setup import make_drafter

    drafter = make_drafter(m, str(gemma_path), m.engine.options)
    drafter.p_min = 0.0
    ids = m.tokenize(prompts[2])
    m.reset()
    want = _tokens(_plain(m, ids, temperature=0, max_tokens=16))
    m.reset()
    spec = _spec(drafter, n_max=4)
    assert _tokens(_run(m, ids, spec, temperature=0, max_tokens=16)) == want
    # the drafter prefilled the prompt and the first token as one batch, which the target
    # split (prompt, then a decoded token): a short prompt's GEMM sums in its own order, so
    # near ties may go the other way and a few drafts are rejected; the text is identical
    assert spec.drafted > 0 and spec.accepted >= 2 * spec.drafted // 3, (spec.accepted, spec.drafted)


def test_draft_length_recovers_from_one_noisy_measurement():
    dl = DraftLength(SpeculativeParams(n_max=16))
    dl.plain_step(0.01)
    dl.verified(1, 1, 0.05, 0.0)  # a size's first verification runs cold: not counted
    assert 2 not in dl.costs.ratio and dl.next_k(16) > 0
    dl.verified(1, 1, 0.05, 0.0)  # slow again (a busy machine): drafting stops
    assert dl.next_k(16) == 0
    for _ in range(200):
        dl.plain_step(0.01)
    assert dl.next_k(16) > 0


class _Oracle:
    """A drafter that knows the text: it proposes the true next tokens."""
    name = "oracle"

    def __init__(self, text, cheap):
        self.text, self.CHEAP, self.calls, self.feedback = text, cheap, 0, []

    def begin(self, prompt):
        pass

    def propose(self, context, k):
        self.calls += 1
        return self.text[len(context):len(context) + k]

    def accept(self, n_drafted, n_accepted):
        self.feedback.append((n_drafted, n_accepted))


@pytest.mark.parametrize("cheap", [True, False])
def test_shadow_proposals_while_decoding_plainly_bring_drafting_back(cheap):
    # two early rejections stop drafting; a cheap drafter keeps proposing one token a plain
    # step, unverified, and its hits bring drafting back within a few tokens. A draft model
    # (not cheap) is not run while drafting pays nothing
    text = list(range(100, 200))
    drafter = _Oracle(text, cheap)
    spec = Speculation(drafter, SpeculativeParams(n_max=8))
    spec.length.plain_step(0.01)
    for _ in range(3):   # measured: 2-row verifications cost 1.5 decode steps
        spec.length.costs.verified(2, 0.015, 0.0)
    spec.length.verified(1, 0, 0.015, 0.0)
    spec.length.verified(1, 0, 0.015, 0.0)
    n = 10
    assert spec.draft(text[:n], 8) == ([], 0.0)
    resumed = None
    for step in range(1, 12):
        spec.plain_step(0.01)
        got, _ = spec.draft(text[:n + step], 8)
        if got:
            resumed = step
            assert got == text[n + step:n + step + len(got)]
            break
    if cheap:
        assert resumed is not None and resumed <= 6, resumed
        assert drafter.feedback and all(f == (1, 1) for f in drafter.feedback)
        assert spec.drafted == 0 and spec.accepted == 0   # shadows are not drafts (draft_n)
    else:
        assert resumed is None and drafter.calls == 0


def test_a_shadow_is_settled_only_by_the_one_token_after_it():
    drafter = _Oracle(list(range(50)), True)
    spec = Speculation(drafter, SpeculativeParams(n_max=8))
    spec.length.accepted, spec.length.rejected = 0.0, 50.0   # drafting does not pay
    spec.length.plain_step(0.01)
    spec.draft(list(range(5)), 8)
    before = (spec.length.accepted, spec.length.rejected)
    spec.draft(list(range(7)), 8)    # two tokens later (a context shift, a new request): no evidence
    assert (spec.length.accepted, spec.length.rejected) == before and drafter.feedback == []
    spec.draft(list(range(8)), 8)    # one token after the last shadow: a hit
    assert spec.length.accepted > before[0] and drafter.feedback == [(1, 1)]
