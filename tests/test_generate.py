"""The generation loop through the public API: stops, limits, streaming, prefix reuse."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import edgeinfer
from edgeinfer.errors import ContextOverflowError, EdgeInferError
from edgeinfer.results import FinishReason


@pytest.fixture(scope="module")
def model(tiny_models):
    return edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=96)


def _greedy(**kw):
    return dict(temperature=0, **kw)


def test_greedy_is_deterministic_and_matches_manual_argmax(model):
    result = model.generate("hello world", max_tokens=8, **_greedy())
    assert result.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert result.usage.completion_tokens == len(result.tokens)
    # Manual loop over the engine must give the same tokens.
    ids = model.tokenize("hello world")
    engine = model.engine
    kv = engine.new_cache()
    logits = engine.prefill(ids, kv)
    manual = []
    for _ in range(len(result.tokens)):
        tok = int(np.argmax(logits))
        manual.append(tok)
        logits = engine.decode(tok, kv)
    assert manual == result.tokens
    assert model.generate("hello world", max_tokens=8, **_greedy()).tokens == result.tokens


def test_stream_concatenation_equals_result(model):
    full = model.generate("the world", max_tokens=12, **_greedy())
    chunks = list(model.generate("the world", max_tokens=12, stream=True, **_greedy()))
    assert "".join(c.text for c in chunks) == full.text
    last = chunks[-1]
    assert last.finish_reason is not None and last.usage is not None and last.timings is not None
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert last.timings.ttft_s > 0


def test_max_tokens_gives_length(model):
    result = model.generate("hello", max_tokens=3, **_greedy())
    if result.finish_reason == FinishReason.LENGTH:
        assert len(result.tokens) == 3


def test_stop_string_is_never_shown(model):
    base = model.generate("hello world", max_tokens=16, **_greedy())
    if len(base.text) < 4:
        pytest.skip("tiny model produced too little text to pick a stop string from")
    stop = base.text[2:4]
    stopped = model.generate("hello world", max_tokens=16, stop=[stop], **_greedy())
    assert stopped.finish_reason == FinishReason.STOP
    assert stop not in stopped.text
    assert base.text.startswith(stopped.text)


def test_context_limit_is_a_finish_reason_not_a_crash(tiny_models):
    small = edgeinfer.load(str(tiny_models["qwen3"]), backend="reference", n_ctx=12)
    result = small.generate("hello world", max_tokens=100, **_greedy())
    assert result.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert result.usage.prompt_tokens + result.usage.completion_tokens <= 12 + 1


def test_prompt_longer_than_context_is_a_clear_error(tiny_models):
    small = edgeinfer.load(str(tiny_models["qwen3"]), backend="reference", n_ctx=8)
    with pytest.raises(ContextOverflowError) as err:
        small.generate("hello world " * 20, max_tokens=1)
    assert "--ctx-size" in str(err.value) and "\n" not in str(err.value)


def test_prefix_is_reused_between_requests(model):
    first = model.generate("hello world the of and", max_tokens=4, **_greedy())
    second = model.generate("hello world the of and to in", max_tokens=4, **_greedy())
    assert second.usage.cached_tokens >= first.usage.prompt_tokens - 1
    # Cached and uncached runs agree.
    model.reset()
    cold = model.generate("hello world the of and to in", max_tokens=4, **_greedy())
    assert cold.usage.cached_tokens == 0 and cold.tokens == second.tokens


def test_cancel_stops_generation(model):
    cancel = threading.Event()
    chunks = model.generate("hello", max_tokens=50, stream=True, cancel=cancel, **_greedy())
    next(chunks)
    cancel.set()
    rest = list(chunks)
    assert rest[-1].finish_reason == FinishReason.CANCELLED


def test_bad_parameters_are_one_line_errors(model):
    with pytest.raises(EdgeInferError):
        model.generate("hi", temperature=-1)
    with pytest.raises(EdgeInferError):
        model.generate("hi", bogus=1)


def test_seeded_sampling_reproduces(model):
    a = model.generate("hello", max_tokens=10, temperature=1.0, seed=42)
    b = model.generate("hello", max_tokens=10, temperature=1.0, seed=42)
    assert a.tokens == b.tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_chat_runs_for_every_family(tiny_models, arch):
    # The tiny vocabularies lack the templates' special tokens, so prompts are long.
    m = edgeinfer.load(str(tiny_models[arch]), backend="reference", n_ctx=400)
    result = m.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
                    max_tokens=4, temperature=0)
    assert result.usage.prompt_tokens > 4
    assert result.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_prefill_chunks_merge_a_short_tail():
    from edgeinfer.engine import Engine, EngineOptions

    class _Opts(EngineOptions):
        pass

    engine = Engine.__new__(Engine)
    engine.options = EngineOptions(prefill_chunk=256)
    assert engine.chunk_bounds(100) == [0, 100]
    assert engine.chunk_bounds(256) == [0, 256]
    assert engine.chunk_bounds(300) == [0, 300]          # a 44-token tail rides along
    assert engine.chunk_bounds(400) == [0, 256, 400]     # a 144-token tail is its own pass
    assert engine.chunk_bounds(576) == [0, 256, 576]
    assert max(b - a for a, b in zip(engine.chunk_bounds(10_000)[:-1], engine.chunk_bounds(10_000)[1:])) \
        <= engine.max_prefill_rows
