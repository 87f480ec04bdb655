"""OpenAI's `n`: several choices from one request, sharing the prompt's K/V through the prefix
cache, each with its own seed; and seeded requests that give the same answer in another process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgeinfer.sampling import choice_seed
from test_server import MODEL, fim_model_path, load_tiny, start_server  # noqa: F401 - a fixture

HOT = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}   # every token possible
MSGS = [{"role": "user", "content": "tell me about the water"}]


@pytest.fixture(scope="module")
def tiny(fim_model_path):
    return load_tiny(fim_model_path)


@pytest.fixture(scope="module")
def live(tiny):
    srv = start_server(tiny, sampling={"max_tokens": 8})
    yield srv
    srv.stop()


@pytest.fixture()
def client(live):
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_choice_seeds_are_fixed_and_distinct():
    assert choice_seed(42, 0) == 42 and choice_seed(None, 3) is None and choice_seed(-1, 2) == -1
    seeds = [choice_seed(42, i) for i in range(16)]
    assert len(set(seeds)) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [choice_seed(42, i) for i in range(16)]
    assert choice_seed(7, 1) == 4042502035264064771  # the same on every machine and numpy version


def test_n_chat_choices_share_the_prompt_and_sum_usage(tiny, client):
    tiny.reset()
    before = tiny.stats()
    r = client.chat.completions.create(model=MODEL, messages=MSGS, n=3, seed=42, extra_body=HOT)
    after = tiny.stats()
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1          # own seed stream each
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    n_prompt = r.usage.prompt_tokens
    completion = [len(tiny.tokenize(c.message.content, add_special=False)) for c in r.choices]
    assert r.usage.completion_tokens >= sum(1 for n in completion if n) and r.usage.completion_tokens <= 24
    # choices 1 and 2 found the prompt cached: each evaluated only its last token again
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert after["requests"] - before["requests"] == 3
    assert after["cached_tokens"] - before["cached_tokens"] == 2 * (n_prompt - 1)
    # choice 0 keeps the request's seed: it answers as the same request with n = 1
    one = client.chat.completions.create(model=MODEL, messages=MSGS, seed=42, extra_body=HOT)
    assert one.choices[0].message.content == r.choices[0].message.content
    again = client.chat.completions.create(model=MODEL, messages=MSGS, n=3, seed=42, extra_body=HOT)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    assert again.usage.completion_tokens == r.usage.completion_tokens


def test_n_chat_stream_carries_each_choice_index(client):
    whole = client.chat.completions.create(model=MODEL, messages=MSGS, n=2, seed=5, extra_body=HOT)
    stream = client.chat.completions.create(model=MODEL, messages=MSGS, n=2, seed=5, extra_body=HOT, stream=True,
                                            stream_options={"include_usage": True})
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert set(finishes) == {0, 1}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_n_completions_with_echo_and_logprobs(tiny, client):
    r = client.completions.create(model=MODEL, prompt="hello world", n=2, seed=9, max_tokens=4, echo=True,
                                  logprobs=1, extra_body=HOT)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.text.startswith("hello world") for c in r.choices)
    n_prompt = len(tiny.tokenize("hello world")) - 1   # BOS has no text: not echoed
    generated = [len(c.logprobs.tokens) - n_prompt for c in r.choices]
    assert all(1 <= g <= 4 for g in generated) and r.usage.completion_tokens == sum(generated)
    assert r.choices[0].logprobs.token_logprobs[:n_prompt] == r.choices[1].logprobs.token_logprobs[:n_prompt]


SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import httpx
from test_server import load_tiny, start_server
srv = start_server(load_tiny({path!r}), sampling={{"max_tokens": 8}})
body = {{"messages": [{{"role": "user", "content": "tell me about the water"}}], "n": 2, "seed": 1234,
         "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}}
r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
print(json.dumps([c["message"]["content"] for c in r["choices"]]))
srv.stop()
"""


def _in_new_process(path: Path) -> list[str]:
    script = SCRIPT.format(tests=str(Path(__file__).parent), path=str(path))
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_seeded_request_answers_the_same_in_another_process(fim_model_path, client):
    here = client.chat.completions.create(model=MODEL, messages=MSGS, n=2, seed=1234, extra_body=HOT)
    first, second = _in_new_process(fim_model_path), _in_new_process(fim_model_path)
    assert first == second == [c.message.content for c in here.choices]
