"""`--draft mtp`: a qwen35 file's multi-token-prediction block drafts.

- The file with its MTP block still loads as llama.cpp loads it (the trunk's logits bit for
  bit on Q8_0, the block not run by the model itself).
- The drafter's proposals equal the block run from scratch over the whole context (the
  trunk's h of every position, one batch), whatever the passes before were: prefill
  chunks, a prefix served from the cache, decode steps, verify passes with rejections.
- Speculation with it changes nothing in the output: greedy tokens and seeded samples equal
  plain decoding (random weights accept few drafts; the guarantee is the verification's).
- A file without the block is refused in one line."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gguf_factory import TinyShape, bpe_vocab, write_tiny_model
from oracles import check_against_llama_cpp, engine_for, random_ids

import edgeinfer
from edgeinfer.errors import EdgeInferError
from edgeinfer.models.qwen35_mtp import MtpHead

N_CTX = 128


@pytest.fixture(scope="module")
def mtp_file(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("mtp") / "qwen35-mtp.gguf", "qwen35", "Q8_0",
                                vocab=bpe_vocab("qwen35"), shape=TinyShape(n_layer=4, nextn=1)))


def _load(path, **kw):
    return edgeinfer.load(path, n_ctx=N_CTX, **kw)


def _from_scratch(model, context: list[int], k: int, unseen: int | None = None) -> list[np.ndarray]:
    """The logits of k chained argmax drafts after `context`: the trunk's h of every position
    in one fresh pass, the block over every (token, h of the position before) in one batch,
    then each draft with the block's own h'. `unseen`: a position whose previous h the
    drafter never saw (the first one the model ran after a cached prefix): zero there."""
    eng = model.engine
    n = len(context)
    h = np.asarray(eng.model.hidden(np.array(context[:-1]), np.arange(n - 1), eng.new_cache(), np.arange(n - 1)))
    head = MtpHead(eng.model)
    kv = head.new_cache(N_CTX)
    h_prev = np.vstack([np.zeros((1, h.shape[1]), np.float32), h])
    if unseen is not None:
        h_prev[unseen] = 0.0
    logits, h_out = head.forward(np.array(context), np.arange(n), h_prev, kv)
    out = [logits[0]]
    for _ in range(k - 1):
        logits, h_out = head.forward(np.array([int(np.argmax(out[-1]))]), np.array([n + len(out) - 1]),
                                     h_out[-1:], kv)
        out.append(logits[0])
    return out


def _proposal_logits(drafter, context, k) -> tuple[list[int], list[np.ndarray]]:
    seen = []
    forward = drafter.head.forward

    def record(*a, **kw):
        logits, h = forward(*a, **kw)
        seen.extend(logits)
        return logits, h
    drafter.head.forward = record
    try:
        return drafter.propose(context, k), seen
    finally:
        drafter.head.forward = forward


def test_the_trunk_still_matches_llama_cpp(mtp_file):
    engine = engine_for(mtp_file, "cpu")
    assert engine.config.n_layer == 4 and engine.config.n_layer_nextn == 1
    got, want, _, _ = check_against_llama_cpp(mtp_file, engine, [1, 30, 40, 50, 60, 70, 80], floor=0.01)
    assert np.abs(got - want).max() == 0


def test_proposals_equal_the_block_run_from_scratch(mtp_file):
    model = _load(mtp_file, draft="mtp", draft_p_min=0.0, prefill_chunk=16)
    drafter = model.drafter
    rng = np.random.default_rng(4)
    prompt = random_ids(rng, 40, model.config.n_vocab)  # three prefill chunks
    out = model.generate(prompt, max_tokens=12, temperature=0)  # decode steps and verify passes
    assert out.timings.draft_n > 0  # drafts were made (and, random weights, mostly rejected)
    context = prompt + out.tokens
    drafts, logits = _proposal_logits(drafter, context, 4)
    want = _from_scratch(model, context, 4)
    assert drafts == [int(np.argmax(x)) for x in want]
    # equal up to the last bits a batch of a different size may change (the trunk's GEMMs)
    np.testing.assert_allclose(np.array(logits), np.array(want), rtol=0, atol=2e-3)
    # another request over a prefix served from the cache: the block keeps its entries for
    # the shared tokens; the first position the model runs pairs with a zero h (the model
    # did not compute the h before it in this request), as llama.cpp's driver pairs it with
    # whatever row it last kept
    prompt2 = prompt[:32] + random_ids(rng, 6, model.config.n_vocab)
    out2 = model.generate(prompt2, max_tokens=6, temperature=0)
    cached = out2.usage.cached_tokens
    assert 0 < cached <= 32
    context2 = prompt2 + out2.tokens
    drafts, logits = _proposal_logits(drafter, context2, 3)
    want = _from_scratch(model, context2, 3, unseen=cached)
    assert drafts == [int(np.argmax(x)) for x in want]
    np.testing.assert_allclose(np.array(logits), np.array(want), rtol=0, atol=2e-3)


@pytest.fixture(scope="module")
def moe_mtp_file(tmp_path_factory):  # qwen35moe: the MTP block's FFN is a mixture of experts
    return str(write_tiny_model(tmp_path_factory.mktemp("mtp") / "qwen35moe-mtp.gguf", "qwen35moe", "Q8_0",
                                vocab=bpe_vocab("qwen35"), shape=TinyShape(n_layer=4, nextn=1)))


@pytest.mark.parametrize("which", ["mtp_file", "moe_mtp_file"])
def test_speculation_keeps_greedy_and_seeded_output(which, request):
    path = request.getfixturevalue(which)
    plain, spec = _load(path), _load(path, draft="mtp", draft_p_min=0.0)
    rng = np.random.default_rng(5)
    for _ in range(3):
        prompt = random_ids(rng, 21, plain.config.n_vocab)
        assert spec.generate(prompt, max_tokens=32, temperature=0).tokens == \
            plain.generate(prompt, max_tokens=32, temperature=0).tokens
        kw = dict(max_tokens=24, temperature=0.9, seed=11)
        assert spec.generate(prompt, **kw).tokens == plain.generate(prompt, **kw).tokens
    assert spec.stats()["requests"] == 6


def test_a_file_without_the_block_is_refused(tmp_path):
    path = str(write_tiny_model(tmp_path / "q35.gguf", "qwen35", "F32", vocab=bpe_vocab("qwen35"),
                                shape=TinyShape(n_layer=4)))
    with pytest.raises(EdgeInferError, match="no multi-token-prediction layers"):
        _load(path, draft="mtp")
    r = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "run", path, "--raw", "-n", "2", "--draft", "mtp",
                        "hello"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no multi-token-prediction layers" in lines[0], r.stderr
