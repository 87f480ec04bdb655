"""A hybrid sequence (K/V for qwen35's attention layers, a recurrent state for its DeltaNet
layers) through the session features: every answer equals a cache-free greedy run, reuse
happens only where the state kept a snapshot, forks copy the state, speculative rejections
roll it back, and what cannot work (a context shift, saved K/V) is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_factory import TinyShape, bpe_vocab, write_tiny_model
from oracles import cold_greedy, greedy, random_ids

import edgeinfer
from edgeinfer.errors import EdgeInferError
from edgeinfer.generate import collect
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.kv.recurrent import RecurrentState, state_nbytes
from edgeinfer.sampling import SamplingParams
from edgeinfer.session_manager import SessionManager

N_CTX = 96


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("q35") / "qwen35.gguf", "qwen35", "F32",
                            vocab=bpe_vocab("qwen35"), shape=TinyShape(n_layer=4))
    return edgeinfer.load(str(path), backend="reference", n_ctx=N_CTX)


def _mgr(model, **kw) -> SessionManager:
    return SessionManager(model.engine, model.tokenizer, n_ctx=N_CTX, block_size=8, model_id="q35", **kw)


def _answer(mgr, ids, n=4, **kw):
    return collect(mgr.generate(ids, greedy(n), **kw))


def test_a_sequence_is_kv_for_attention_layers_and_state_for_the_others(model):
    cfg = model.engine.config
    assert cfg.recurrent_layers == (True, False, True, False)
    kv = KVCache(cfg, 16)
    assert kv.k[0].shape[0] == 0 and kv.k[1].shape[0] == 16  # no K/V for a recurrent layer
    assert isinstance(kv.recurrent, RecurrentState) and kv.recurrent.layers == (0, 2)
    mgr = _mgr(model)
    seq = mgr.cache.new_sequence(N_CTX)
    assert seq.recurrent is not None and [g.layers for g in mgr.cache.groups] == [(1, 3)]
    mgr.cache.release(seq)


def test_chat_turns_regenerate_and_edit_reuse_only_where_the_state_was_kept(model):
    mgr, eng, tok = _mgr(model), model.engine, model.tokenizer
    rng = np.random.default_rng(1)
    a = random_ids(rng, 20, eng.config.n_vocab)
    first = _answer(mgr, a)
    assert first.tokens == cold_greedy(eng, tok, a, 4) and first.usage.cached_tokens == 0
    # the next turn resends the history: only the new tokens are prefilled
    b = a + first.tokens + random_ids(rng, 5, eng.config.n_vocab)
    second = _answer(mgr, b)
    assert second.tokens == cold_greedy(eng, tok, b, 4)
    assert second.usage.cached_tokens == len(a) + len(first.tokens) - 1
    # regenerate: the prompt's last-but-one token was kept
    again = _answer(mgr, b)
    assert again.tokens == second.tokens and again.usage.cached_tokens == len(b) - 1
    # edit the last message: back to the last point with a state at or before the edit: the
    # block boundary (8) the second turn's prefill crossed, past the turn's start (23)
    edit_at = len(a) + len(first.tokens) + 2
    c = b[:edit_at] + [7, 8]
    edited = _answer(mgr, c)
    assert edited.tokens == cold_greedy(eng, tok, c, 4)
    assert edited.usage.cached_tokens == edit_at // 8 * 8 > len(a) + len(first.tokens) - 1
    # a branch from the middle of the first prompt: no snapshot there, prefilled from 0
    d = a[:11] + [9, 10, 11]
    branch = _answer(mgr, d)
    assert branch.tokens == cold_greedy(eng, tok, d, 4) and branch.usage.cached_tokens == 0
    mgr.check_invariants()


def test_cached_kv_blocks_are_used_only_as_far_as_a_cached_state(model):
    mgr, eng = _mgr(model), model.engine
    a = random_ids(np.random.default_rng(2), 30, eng.config.n_vocab)
    _answer(mgr, a)  # one prefill pass over 30 tokens: a state after block 3 (24 tokens), none before
    seq = mgr.cache.new_sequence(N_CTX)
    assert mgr.cache.reuse_prefix(seq, a) == 24 and seq.recurrent.n_tokens == 24
    mgr.cache.release(seq)
    seq = mgr.cache.new_sequence(N_CTX)
    assert mgr.cache.reuse_prefix(seq, a[:20]) == 0 and seq.n_used == 0  # blocks 0-1 cached, no state
    mgr.cache.release(seq)
    mgr.check_invariants()


def test_conversations_take_turns_through_the_state_cache(model):
    """Two chats with one system prompt, alternating (the resident sequence is always the
    other one): each resumes from the block-boundary state of its own last turn, the second
    from the shared prompt's, and every answer equals a cache-free run."""
    mgr, eng, tok = _mgr(model), model.engine, model.tokenizer
    mgr.cache.states.every_blocks = 2  # a state every 16 tokens (the default is every 256)
    rng = np.random.default_rng(7)
    system = random_ids(rng, 19, eng.config.n_vocab)
    chats = {name: system + random_ids(rng, 6, eng.config.n_vocab) for name in "AB"}
    first = {}
    for name, ids in chats.items():
        first[name] = got = _answer(mgr, ids)
        assert got.tokens == cold_greedy(eng, tok, ids, 4)
    assert first["B"].usage.cached_tokens == 16  # the system prompt's blocks and A's state after them
    for name in "AB":  # each chat resends its history plus a new message; the other one ran last
        ids = chats[name] + first[name].tokens + random_ids(rng, 3, eng.config.n_vocab)
        got = _answer(mgr, ids)
        assert got.tokens == cold_greedy(eng, tok, ids, 4)
        assert got.usage.cached_tokens == 24  # the block its own last turn completed while decoding
    stats = mgr.cache.stats()["states"]
    assert 0 < stats["snapshots"] <= stats["max_snapshots"]
    assert stats["bytes"] == stats["snapshots"] * state_nbytes(eng.config)
    mgr.check_invariants()


def test_the_state_cache_is_bounded(model):
    mgr, eng = _mgr(model), model.engine
    states = mgr.cache.states
    states.max_entries = 3
    rng = np.random.default_rng(8)
    for _ in range(6):  # six unrelated prompts of several blocks each
        _answer(mgr, random_ids(rng, 40, eng.config.n_vocab), n=2)
        assert len(states) <= 3
    assert len(states) == 3 and states.nbytes == 3 * states.snapshot_bytes


def test_n_choices_fork_the_state(model):
    mgr, eng, tok = _mgr(model), model.engine, model.tokenizer
    a = random_ids(np.random.default_rng(3), 17, eng.config.n_vocab)
    want = cold_greedy(eng, tok, a, 6)
    for i in range(3):  # as the server runs n choices: one after another on the same prompt
        got = _answer(mgr, a, 6)
        assert got.tokens == want
        assert got.usage.cached_tokens == (0 if i == 0 else len(a) - 1)
    parent = mgr._resident
    child = mgr.cache.fork(parent)
    assert child.recurrent is not parent.recurrent
    child.recurrent.ssm[0] += 1.0  # writing the child's state leaves the parent's alone
    assert not np.array_equal(child.recurrent.ssm[0], parent.recurrent.ssm[0])
    mgr.cache.release(child)


def test_speculative_rejections_roll_the_state_back(model):
    from edgeinfer.speculative import Speculation, SpeculativeParams

    eng, tok = model.engine, model.tokenizer
    a = random_ids(np.random.default_rng(4), 12, eng.config.n_vocab)
    want = cold_greedy(eng, tok, a, 24)

    class Drafter:  # the right continuation, one token in three corrupted
        name = "test"

        def __init__(self):
            self.calls = 0

        def begin(self, prompt):
            pass

        def propose(self, context, k):
            self.calls += 1
            i = len(context) - len(a)
            out = list(want[i:i + k])
            if out and self.calls % 3 == 0:
                out[self.calls % len(out)] = (out[self.calls % len(out)] + 1) % eng.config.n_vocab
            return out

        def accept(self, n_drafted, n_accepted):
            pass

    spec = Speculation(Drafter(), SpeculativeParams(n_max=5))
    spec.length.next_k = lambda limit: min(5, limit)
    mgr = _mgr(model)
    got = collect(mgr.generate(a, greedy(24), speculation=spec))
    assert got.tokens == want
    assert 0 < spec.accepted < spec.drafted  # both paths ran
    seq = mgr._resident
    assert seq.recurrent.n_tokens == seq.n_used and not seq.recurrent.rollback or \
        max(seq.recurrent.rollback) <= seq.n_used
    mgr.check_invariants()


def test_context_shift_is_refused_and_not_the_default(model):
    mgr = _mgr(model, context_shift=True)
    assert mgr.context_shift is False  # the constructor's default (run, chat) is dropped
    a = random_ids(np.random.default_rng(5), 20, model.engine.config.n_vocab)
    with pytest.raises(EdgeInferError, match="context shift is not supported for qwen35"):
        next(iter(mgr.generate(a, greedy(4), context_shift=True)))
    # a full window ends the answer (finish_reason length) instead of shifting
    long = random_ids(np.random.default_rng(6), N_CTX - 3, model.engine.config.n_vocab)
    out = collect(mgr.generate(long, SamplingParams(temperature=0, max_tokens=20)))
    assert out.finish_reason == "length" and len(out.tokens) == N_CTX - len(long) + 1


def test_saved_sessions_carry_the_state_and_resume_exactly(model, tmp_path):
    from edgeinfer.sessions.session_file import SavedSession, load_session, save_session

    rng = np.random.default_rng(7)
    prompt = random_ids(rng, 10, model.engine.config.n_vocab)
    mgr = _mgr(model)
    first = _answer(mgr, prompt)
    saved = mgr.export_kv()
    assert saved is not None and saved.state and len(saved.pos) == len(prompt) + len(first.tokens) - 1
    path = save_session(tmp_path / "s.npz", SavedSession(tokens=saved.tokens, k=saved.k, v=saved.v, pos=saved.pos,
                                                         state=saved.state), model.identity)
    back = load_session(path, model.identity, config=model.engine.config, n_ctx=N_CTX)
    assert back.kv_refused is None and set(back.state) == set(saved.state)
    more = random_ids(rng, 5, model.engine.config.n_vocab)
    follow = list(saved.tokens) + more
    want = _answer(mgr, follow).tokens  # the same manager, still holding the conversation
    fresh = _mgr(model)
    assert fresh.import_kv(back.tokens, back.k, back.v, back.pos, back.state) == len(back.pos)
    got = _answer(fresh, follow)
    assert got.tokens == want and got.usage.cached_tokens == len(back.pos)  # nothing before them re-run
    # without the state (a version 1 file) the K/V are refused with one line
    cfg = model.engine.config
    with pytest.raises(EdgeInferError, match="without its recurrent state"):
        _mgr(model).import_kv(back.tokens, back.k, back.v, back.pos)


def test_a_saved_state_of_the_wrong_shape_is_refused(model, tmp_path):
    from edgeinfer.sessions.session_file import SavedSession, load_session, save_session

    mgr = _mgr(model)
    _answer(mgr, random_ids(np.random.default_rng(8), 10, model.engine.config.n_vocab))
    saved = mgr.export_kv()
    bad = {name: (a[:-1] if name.startswith("ssm") else a) for name, a in saved.state.items()}
    path = save_session(tmp_path / "bad.npz", SavedSession(tokens=saved.tokens, k=saved.k, v=saved.v, pos=saved.pos,
                                                           state=bad), model.identity)
    warned: list[str] = []
    back = load_session(path, model.identity, config=model.engine.config, n_ctx=N_CTX, warn=warned.append)
    assert back.state is None and back.k is None and "ssm." in warned[0] and "\n" not in warned[0]


def test_streaming_and_the_api_run_the_family(model):
    model.reset()
    ids = random_ids(np.random.default_rng(8), 9, model.engine.config.n_vocab)
    chunks = list(model.sessions.generate(ids, greedy(5)))
    assert [c.token for c in chunks if c.token is not None] == cold_greedy(model.engine, model.tokenizer, ids, 5)


def test_a_failed_forward_leaves_a_state_that_is_cut_back(model):
    eng = model.engine
    kv = KVCache(eng.config, 32)
    eng.prefill([5, 6, 7, 8], kv)
    kv.recurrent.keep_at(4)
    boom = RuntimeError("mid-layer")
    real = eng.model.linear_attention
    eng.model.linear_attention = lambda *a, **k: (_ for _ in ()).throw(boom)
    try:
        with pytest.raises(RuntimeError):
            eng.decode(9, kv)
    finally:
        eng.model.linear_attention = real
    assert kv.n_used == 4 and kv.recurrent.n_tokens == 4  # back to the kept point
    want = cold_greedy(eng, model.tokenizer, [5, 6, 7, 8, 9], 3)
    logits = eng.decode(9, kv)
    assert int(np.argmax(logits)) == want[0]


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_the_three_api_dialects_serve_the_family(tmp_path, arch):
    """OpenAI, Ollama and llama-server requests on a qwen35 model: each answers as the Python
    API does, and a resent conversation reuses the prefix through the recurrent state."""
    from starlette.testclient import TestClient

    from edgeinfer.server import ServerConfig, create_app

    path = write_tiny_model(tmp_path / "q35-chat.gguf", arch, "F32", vocab=bpe_vocab("qwen35"),
                            shape=TinyShape(n_layer=4), chat_template=CHATML)
    model = edgeinfer.load(str(path), backend="reference", n_ctx=256)
    direct = edgeinfer.load(str(path), backend="reference", n_ctx=256)
    messages = [{"role": "user", "content": "hello there"}]
    want = direct.chat(messages, max_tokens=6, temperature=0).text
    with TestClient(create_app(ServerConfig(model_name="q35"), model), base_url="http://127.0.0.1") as c:
        r = c.post("/v1/chat/completions", json={"model": "q35", "messages": messages, "max_tokens": 6,
                                                  "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
        again = messages + [{"role": "assistant", "content": want}, {"role": "user", "content": "and then?"}]
        r = c.post("/api/chat", json={"model": "q35", "messages": again, "stream": False,
                                       "options": {"num_predict": 6, "temperature": 0}})
        assert r.status_code == 200
        assert r.json()["message"]["content"] == direct.chat(again, max_tokens=6, temperature=0).text
        r = c.post("/completion", json={"prompt": "hello there", "n_predict": 6, "temperature": 0,
                                         "cache_prompt": True})
        assert r.status_code == 200
        assert r.json()["content"] == direct.generate("hello there", max_tokens=6, temperature=0).text
    assert model.stats()["cached_tokens"] > 0  # the second chat turn reused the first's prefix
