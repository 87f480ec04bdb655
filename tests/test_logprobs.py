"""Token log-probabilities: the model's distribution before any sampler, carried on the chunks,
for the prompt too (echo), in every dialect's shape, and against llama.cpp on Gemma 3 270M."""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
from llama_oracle import importorskip_oracle

import edgeinfer
from edgeinfer.generate import prompt_logprobs
from edgeinfer.sampling import SamplingParams, log_softmax, post_sampling_probs, token_logprobs
from test_server import MODEL, fim_model_path, load_tiny, start_server  # noqa: F401 - a fixture

PROMPT = "The capital of France is"


def test_token_logprobs_is_log_softmax_of_the_raw_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=500).astype(np.float32)
    logits[7] = logits[9] = 5.0  # a tie: the lower id comes first
    lp = token_logprobs(logits, 123, 5)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert lp.token == 123 and math.isclose(lp.logprob, ref[123], rel_tol=1e-12)
    assert [t for t, _ in lp.top][:2] == [7, 9]
    assert [t for t, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:5])
    assert sum(math.exp(v) for _, v in lp.top) <= 1.0
    assert token_logprobs(logits, 3, 0).top == []
    assert np.isneginf(log_softmax(np.array([0.0, -np.inf]))[1])


def test_post_sampling_probs_follow_the_chain():
    logits = np.array([3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    greedy = post_sampling_probs(logits, [], 0, SamplingParams(temperature=0), 3)
    assert greedy.logprob == 0.0 and greedy.top == [(0, 0.0)]
    p = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    lp = post_sampling_probs(logits, [], 1, p, 4)
    assert [t for t, _ in lp.top] == [0, 1]  # top-k cut the rest
    assert math.isclose(sum(math.exp(v) for _, v in lp.top), 1.0)
    assert math.isclose(lp.logprob, 2.0 - math.log(math.exp(3) + math.exp(2)))


@pytest.fixture(scope="module")
def tiny(fim_model_path):
    return load_tiny(fim_model_path)


def test_chunks_carry_logprobs_that_do_not_depend_on_the_sampler(tiny):
    greedy = tiny.generate("hello world", max_tokens=6, temperature=0, logprobs=3)
    assert len(greedy.logprobs) == len(greedy.tokens) == 6
    for token, lp in zip(greedy.tokens, greedy.logprobs):
        assert lp.token == token and lp.top[0] == (token, lp.logprob)  # greedy picks the likeliest
        assert len(lp.top) == 3 and sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-12
    # a hot sampler cut to one candidate picks the same tokens: the model's logprobs are the same
    hot = tiny.generate("hello world", max_tokens=6, temperature=1.7, top_k=1, seed=3, logprobs=3)
    assert hot.tokens == greedy.tokens
    assert [x.logprob for x in hot.logprobs] == pytest.approx([x.logprob for x in greedy.logprobs], abs=1e-9)
    assert tiny.generate("hello world", max_tokens=3, temperature=0).logprobs is None


def test_prompt_logprobs_match_per_position_logits(tiny):
    ids = tiny.tokenize("hello world the water")
    pairs = tiny.prompt_logprobs(ids, 2)
    assert [t for t, _ in pairs] == ids and pairs[0][1] is None
    engine = tiny.engine
    rows = engine.forward(np.array(ids), np.arange(len(ids)), engine.new_cache(), logits_for=np.arange(len(ids)))
    for j in range(1, len(ids)):
        expected = log_softmax(rows[j - 1])[ids[j]]
        assert math.isclose(pairs[j][1].logprob, expected, abs_tol=1e-6)
    # the last prompt row predicts the first generated token, as generate reports it
    first = tiny.generate(ids, max_tokens=1, temperature=0, logprobs=0).logprobs[0]
    assert math.isclose(first.logprob, float(log_softmax(rows[-1]).max()), abs_tol=1e-5)
    assert prompt_logprobs(engine, ids[:1], 0) == [None]


@pytest.fixture(scope="module")
def live(tiny):
    srv = start_server(tiny)
    yield srv
    srv.stop()


def test_openai_chat_logprobs_with_the_official_client(live):
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(bytes(c.bytes).decode("utf-8", "replace") for c in content).endswith(r.choices[0].message.content)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob for c in content)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [c for ch in stream for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, round(c.logprob, 6)) for c in streamed] == [(c.token, round(c.logprob, 6)) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_openai_completion_logprobs_and_echo(live):
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == len("hello world")
    assert all(top[tok] == v for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    e = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, temperature=0, logprobs=3,
                                  echo=True)
    assert e.choices[0].text == "hello world" + r.choices[0].text
    elp = e.choices[0].logprobs
    n_prompt = len(elp.tokens) - 5
    assert n_prompt >= 2 and elp.text_offset[0] == 0
    assert elp.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[:n_prompt])  # BOS went before
    assert elp.text_offset[n_prompt] == lp.text_offset[0]
    streamed = list(client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, temperature=0,
                                              logprobs=3, echo=True, stream=True))
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == e.choices[0].text
    got = [v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx(elp.token_logprobs, abs=1e-6)
    plain = client.completions.create(model=MODEL, prompt="hello world", max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith("hello world") and plain.choices[0].logprobs is None


def test_llama_server_n_probs(live):
    with httpx.Client(base_url=live.url, timeout=30) as http:
        body = {"prompt": "hello world", "n_predict": 4, "temperature": 0, "n_probs": 3}
        r = http.post("/completion", json=body).json()
        probs = r["completion_probabilities"]
        assert len(probs) == r["tokens_predicted"] == 4
        assert set(probs[0]) == {"id", "token", "bytes", "logprob", "top_logprobs"}
        assert len(probs[0]["top_logprobs"]) == 3 and probs[0]["top_logprobs"][0]["id"] == probs[0]["id"]
        post = http.post("/completion", json={**body, "post_sampling_probs": True}).json()["completion_probabilities"]
        assert post[0]["prob"] == 1.0 and post[0]["top_probs"] == [{k: v for k, v in post[0].items()
                                                                    if k != "top_probs"}]
        with http.stream("POST", "/completion", json={**body, "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        import json
        streamed = [p for e in map(json.loads, events) for p in e.get("completion_probabilities", [])]
        assert [p["id"] for p in streamed] == [p["id"] for p in probs]
        assert "completion_probabilities" not in http.post("/completion", json={**body, "n_probs": 0}).json()


def test_ollama_logprobs_with_the_official_client(live):
    import ollama

    client = ollama.Client(host=live.url)
    r = client.generate(model=MODEL, prompt="hello world", raw=True, stream=False, logprobs=True, top_logprobs=2,
                        options={"temperature": 0, "num_predict": 4})
    assert len(r.logprobs) == r.eval_count == 4
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob == x.logprob for x in r.logprobs)
    parts = list(client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                             logprobs=True, options={"temperature": 0, "num_predict": 4}))
    streamed = [x for p in parts for x in (p.logprobs or [])]
    assert len(streamed) == parts[-1].eval_count and all(not x.top_logprobs for x in streamed)
    whole = client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                        options={"temperature": 0, "num_predict": 4})
    assert [x.logprob for x in whole.logprobs] == pytest.approx([x.logprob for x in streamed])
    assert client.generate(model=MODEL, prompt="hi", raw=True, options={"num_predict": 1}).logprobs is None


@pytest.mark.slow
def test_gemma_logprobs_match_llama_cpp(gemma_path):
    """Greedy on Gemma 3 270M: our logprobs (generated and echoed prompt) against
    llama-cpp-python's create_completion(logprobs=..., echo=True) with logits_all, one token
    per batch so llama.cpp runs its decode path (and ours, prefill_chunk=1, too: a short
    prompt's GEMMs sum in another order, which can flip a near tie); within 1e-3, and the
    same top ids."""
    llama_cpp = importorskip_oracle()
    ref = llama_cpp.Llama(model_path=str(gemma_path), logits_all=True, n_ctx=256, n_batch=1, n_threads=2,
                          verbose=False)
    theirs = ref.create_completion(PROMPT, max_tokens=12, temperature=0, logprobs=3, echo=True)
    tlp = theirs["choices"][0]["logprobs"]
    model = edgeinfer.load(gemma_path, n_ctx=256, threads=2, prefill_chunk=1)
    ours = model.generate(PROMPT, max_tokens=12, temperature=0, logprobs=3)
    assert PROMPT + ours.text == theirs["choices"][0]["text"]
    n = len(ours.logprobs)
    diff = max(abs(a.logprob - b) for a, b in zip(ours.logprobs, tlp["token_logprobs"][-n:]))
    assert diff <= 1e-3, diff
    for a, top in zip(ours.logprobs, tlp["top_logprobs"][-n:]):
        for t, v in a.top:
            piece = model.tokenizer.token_to_piece(t).decode("utf-8", "replace")
            assert piece in top and abs(top[piece] - v) <= 1e-3
    # llama-cpp-python leaves BOS out of the echo and gives its first text token None;
    # ours reports that token's logprob after BOS: compare the rest
    prompt = [lp for _, lp in model.prompt_logprobs(PROMPT, 0)][2:]
    theirs_prompt = tlp["token_logprobs"][1:-n]
    assert len(prompt) == len(theirs_prompt)
    assert max(abs(a.logprob - b) for a, b in zip(prompt, theirs_prompt)) <= 1e-3
