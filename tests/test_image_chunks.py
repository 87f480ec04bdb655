"""Image chunks on the text side (Gemma 3): image rows in the sequence, their non-causal
attention, the prefix cache over them, and the API's checks."""

from __future__ import annotations

import numpy as np
import pytest
from image_fixtures import FakeProjector, gemma3_image_vocab, random_chunk, write_gemma3

from edgeinfer.api import Model
from edgeinfer.backends.base import ReferenceBackend
from edgeinfer.engine import Engine, EngineOptions
from edgeinfer.errors import EdgeInferError
from edgeinfer.loader import open_model
from edgeinfer.vision.chunk import ImageChunk
from edgeinfer.vision.media_ids import MediaRows, chunk_ids, image_runs, text_only

N_EMBD = 64
VOCAB = gemma3_image_vocab()["tokens"]
SOI, EOI = VOCAB.index("<start_of_image>"), VOCAB.index("<end_of_image>")
WORDS = [VOCAB.index("\u2581" + w) for w in ("the", "of", "and", "to", "in", "is", "you", "that", "it", "he")]


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    return write_gemma3(tmp_path_factory.mktemp("img") / "gemma3-img.gguf", n_embd=N_EMBD)


def _engine(path, backend="cpu", n_ctx=128, prefill_chunk=256) -> Engine:
    return Engine(open_model(path), EngineOptions(n_ctx=n_ctx, backend=backend, prefill_chunk=prefill_chunk))


def _prompt(n_before: int, chunk: ImageChunk, n_after: int) -> tuple[list[int], int]:
    """BOS, n_before words, the wrapped image, n_after words; and the image's first index."""
    before = [WORDS[i % len(WORDS)] for i in range(n_before)]
    after = [WORDS[(3 * i + 1) % len(WORDS)] for i in range(n_after)]
    ids = [1, *before, SOI, *chunk_ids(chunk), EOI, *after]
    return ids, 2 + n_before


def _all_logits(engine: Engine, ids: list[int], chunks) -> np.ndarray:
    kv = engine.new_cache()
    n = len(ids)
    return engine.forward(np.array(ids), np.arange(n), kv, logits_for=np.arange(n),
                          media=MediaRows(chunks, N_EMBD))


def _with_last_row_changed(chunk: ImageChunk) -> ImageChunk:
    rows = chunk.embeddings.copy()
    rows[-1] = -rows[-1]
    return ImageChunk(rows, chunk.digest, non_causal=chunk.non_causal)


# -- the ids -------------------------------------------------------------------------------

def test_image_ids_are_negative_keyed_by_digest_and_found_as_runs():
    a, b = random_chunk(4, N_EMBD, 1), random_chunk(4, N_EMBD, 2)
    assert chunk_ids(a) == chunk_ids(random_chunk(4, N_EMBD, 1))  # the same image, the same ids
    assert not set(chunk_ids(a)) & set(chunk_ids(b))
    assert all(t < 0 for t in chunk_ids(a))
    ids = [1, 5, *chunk_ids(a), *chunk_ids(b), 7, *chunk_ids(a)]
    assert image_runs(ids) == [(2, 6), (6, 10), (11, 15)]
    assert text_only(ids) == [1, 5, 7]
    # every row's id hashes the whole digest: digests that share a prefix share no id
    rows = a.embeddings
    x, y = ImageChunk(rows, "ab" * 32), ImageChunk(rows, "ab" * 31 + "cd")
    assert not set(chunk_ids(x)) & set(chunk_ids(y))
    with pytest.raises(EdgeInferError, match="digest"):
        chunk_ids(ImageChunk(rows, "not hex" * 8))


def test_prefill_never_cuts_an_image():
    a = random_chunk(6, N_EMBD, 1)
    ids, _ = _prompt(3, a, 4)   # image rows at 5..10
    media = MediaRows([a], N_EMBD)
    cuts = media.keep_whole(ids, list(range(0, len(ids), 4)) + [len(ids)], max_rows=8)
    assert cuts == [0, 4, 5, 12, len(ids)]  # the cut at 8 goes back to the image start
    with pytest.raises(EdgeInferError, match="does not fit one prefill pass"):
        media.keep_whole(ids, [0, len(ids)], max_rows=5)


# -- (a) the mask --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_image_rows_see_their_whole_image_and_text_stays_causal(gemma_path, backend):
    engine = _engine(gemma_path, backend)
    chunk = random_chunk(4, N_EMBD, 3)
    ids, at = _prompt(3, chunk, 3)
    base = _all_logits(engine, ids, [chunk])
    changed = _all_logits(engine, ids, [_with_last_row_changed(chunk)])
    last = at + chunk.n_tokens - 1
    np.testing.assert_array_equal(base[:at], changed[:at])  # text before the image: untouched
    for r in range(at, last):  # every earlier image row sees the last one
        assert np.abs(base[r] - changed[r]).max() > 1e-3, r
    # text stays causal: a later text token changes nothing before it
    later = list(ids)
    later[-1] = WORDS[-1] if later[-1] != WORDS[-1] else WORDS[0]
    np.testing.assert_array_equal(base[:-1], _all_logits(engine, later, [chunk])[:-1])


def test_a_causal_chunk_keeps_the_causal_mask(gemma_path):
    """The check above can fail: a chunk without non_causal gives rows blind to later ones."""
    engine = _engine(gemma_path, "reference")
    chunk = random_chunk(4, N_EMBD, 3, non_causal=False)
    ids, at = _prompt(3, chunk, 3)
    base = _all_logits(engine, ids, [chunk])
    changed = _all_logits(engine, ids, [_with_last_row_changed(chunk)])
    last = at + chunk.n_tokens - 1
    np.testing.assert_array_equal(base[:last], changed[:last])


def test_image_rows_are_not_scaled_like_token_embeddings(gemma_path):
    engine = _engine(gemma_path, "reference")
    chunk = random_chunk(4, N_EMBD, 5)
    ids, at = _prompt(2, chunk, 1)
    engine.model.media_step = MediaRows([chunk], N_EMBD).step(np.array(ids), np.arange(len(ids)))
    try:
        x = engine.model.embed(np.array(ids))
    finally:
        engine.model.media_step = None
    np.testing.assert_array_equal(x[at:at + 4], chunk.embeddings)
    plain = engine.model.embed(np.array(ids[:at]))
    np.testing.assert_array_equal(x[:at], plain)


# -- (c) the whole forward against a reference with the mask written out ----------------------

def _explicit_forward(path, ids: list[int], chunk: ImageChunk, at: int, causal_image: bool = False) -> np.ndarray:
    """Gemma 3 on the reference backend, its attention a float64 softmax under a mask written
    from the image's index range (not from edgeinfer's image ids): what the engine must give."""
    mf = open_model(path)
    model = mf.family(mf.config, mf.gguf, ReferenceBackend(mf.gguf))
    n = len(ids)
    lo, hi = at, at + chunk.n_tokens - 1

    def attend(q, kv, layer, positions, scale, window, q_scale=1.0, sinks=None):
        k, v, kpos = (np.asarray(a) for a in kv.layer_view(layer))
        p = np.asarray(positions)[:, None]
        kp = kpos[None, :]
        same_image = (p >= lo) & (p <= hi) & (kp >= lo) & (kp <= hi) & (not causal_image)
        allowed = (kp <= p) | same_image
        if window:
            allowed &= (p - kp) < window
        q64 = q.astype(np.float64) * q_scale
        group = q.shape[1] // k.shape[1]
        kk = np.repeat(k.astype(np.float64), group, axis=1)
        vv = np.repeat(v.astype(np.float64), group, axis=1)
        s = np.einsum("thd,shd->hts", q64, kk) * scale
        s = np.where(allowed[None], s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        return np.einsum("hts,shd->thd", w, vv).astype(np.float32)

    model.attend = attend
    model.media_step = MediaRows([chunk], N_EMBD).step(np.array(ids), np.arange(n))
    kv = ReferenceBackend(mf.gguf).new_cache(mf.config, n)
    return model.forward(np.array(ids), np.arange(n), kv, logits_for=np.arange(n))


@pytest.mark.parametrize("prefill_chunk, n_image", [(256, 6), (8, 6), (256, 20)])
def test_forward_with_an_image_matches_a_reference_with_the_mask_written_out(gemma_path, prefill_chunk, n_image):
    """A prefix longer than the sliding window (16), so windows cut into the text before the
    image; an image of 6 rows fits the window (its keys moved to its start), one of 20 does
    not (its rows run one by one, and their windows hide the image's own earliest keys)."""
    chunk = random_chunk(n_image, N_EMBD, 7)
    ids, at = _prompt(20, chunk, 5)
    want = _explicit_forward(gemma_path, ids, chunk, at)
    engine = _engine(gemma_path, "cpu", prefill_chunk=prefill_chunk)
    kv = engine.new_cache()
    got = []
    media = MediaRows([chunk], N_EMBD)
    cuts = media.keep_whole(ids, engine.chunk_bounds(len(ids)), engine.max_prefill_rows)
    for a, b in zip(cuts[:-1], cuts[1:]):
        got.append(engine.forward(np.array(ids[a:b]), np.arange(a, b), kv, logits_for=np.arange(b - a), media=media))
    got = np.concatenate(got)
    scale = np.abs(want).max()
    err = np.abs(got - want).max() / scale
    assert err < 5e-3, err
    # and the reference can tell: the causal mask is far off
    causal = _explicit_forward(gemma_path, ids, chunk, at, causal_image=True)
    assert np.abs(causal - want).max() / scale > 20 * err


# -- (b) the prefix cache, through the API -------------------------------------------------------

@pytest.fixture(scope="module")
def model(gemma_path):
    m = Model("tiny-gemma3", gemma_path, EngineOptions(n_ctx=256, backend="cpu"))
    m.use_projector(FakeProjector(N_EMBD))
    return m


def _ids_of(model, prompt, images, **kw):
    seen = []
    result = model.generate(prompt, images=images, max_tokens=6, temperature=0, on_prompt=seen.append, **kw)
    return seen[0], result


def test_a_resent_image_comes_from_the_prefix_cache(model):
    a = random_chunk(6, N_EMBD, 11)
    first = "the of and <__media__> to in"
    model.reset()
    ids1, r1 = _ids_of(model, first, [a])
    assert r1.usage.cached_tokens == 0
    image_end = ids1.index(EOI)
    _, r2 = _ids_of(model, first + " is you that", [a])
    assert r2.usage.cached_tokens > image_end  # the image's rows were not prefilled again
    model.reset()
    _, cold = _ids_of(model, first + " is you that", [a])
    assert cold.usage.cached_tokens == 0
    assert cold.tokens == r2.tokens
    # another image at the same place: only the text before it is reused
    b = random_chunk(6, N_EMBD, 12)
    ids3, r3 = _ids_of(model, first + " is you that", [b])
    assert r3.usage.cached_tokens <= ids3.index(SOI) + 1


def test_block_cache_reuse_of_an_image_matches_a_cold_run(model):
    """The resident sequence gone (another prompt ran), the blocks holding the image still hit."""
    a = random_chunk(6, N_EMBD, 21)
    prompt = "the of and to in is you that it he the of and to in is you <__media__> that it he"
    model.reset()
    _ids_of(model, prompt, [a])
    _ids_of(model, "he it that", None)  # another conversation becomes the resident one
    ids, warm = _ids_of(model, prompt + " the of", [a])
    assert warm.usage.cached_tokens >= 16 * (ids.index(EOI) // 16)
    assert warm.usage.cached_tokens > ids.index(SOI)
    model.reset()
    _, cold = _ids_of(model, prompt + " the of", [a])
    assert cold.tokens == warm.tokens


def test_markers_place_images_and_a_prompt_without_one_gets_them_first(model):
    a, b = random_chunk(6, N_EMBD, 31), random_chunk(6, N_EMBD, 32)
    ids, _ = _ids_of(model, "the <__media__> of <__media__> and", [a, b])
    (a0, a1), (b0, b1) = image_runs(ids)
    assert ids[a0:a1] == chunk_ids(a) and ids[b0:b1] == chunk_ids(b)
    assert ids[a0 - 1] == ids[b0 - 1] == SOI and ids[a1] == ids[b1] == EOI
    # each text piece tokenized on its own, BOS first (libmtmd's mtmd_tokenize)
    piece = model.tokenize(" of ", add_special=False)
    assert ids == [1, *model.tokenize("the ", add_special=False), SOI, *chunk_ids(a), EOI, *piece,
                   SOI, *chunk_ids(b), EOI, *model.tokenize(" and", add_special=False)]
    ids, _ = _ids_of(model, "the of", [a])
    assert ids == [1, SOI, *chunk_ids(a), EOI, *model.tokenize("the of", add_special=False)]


def test_chat_image_parts_go_where_the_template_puts_the_marker(model):
    pytest.importorskip("PIL")
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    seen = []
    messages = [{"role": "user", "content": [{"type": "text", "text": "the of"},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "and <__media__> to"}]}]
    model.chat(messages, max_tokens=2, temperature=0, on_prompt=seen.append)
    ids = seen[0]
    assert len(image_runs(ids)) == 1  # the text's own <__media__> stays text
    turn = VOCAB.index("<start_of_turn>")
    assert ids.index(turn) < ids.index(SOI) < ids.index(EOI) < ids.index(VOCAB.index("<end_of_turn>"))
    with pytest.raises(EdgeInferError, match="data URL"):
        model.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])


# -- (4) bad input -------------------------------------------------------------------------------

def test_bad_image_input_is_one_clear_error(gemma_path, model):
    a = random_chunk(6, N_EMBD, 41)
    with pytest.raises(EdgeInferError, match="marker"):
        model.generate("the <__media__> of", images=[a, a], max_tokens=1)
    with pytest.raises(EdgeInferError, match="marker"):
        model.generate("the <__media__> of <__media__>", images=[a], max_tokens=1)
    with pytest.raises(EdgeInferError, match="text model"):
        model.generate("the", images=[random_chunk(6, N_EMBD * 2, 1)], max_tokens=1)
    with pytest.raises(EdgeInferError, match="M-RoPE"):
        model.generate("the", images=[ImageChunk(a.embeddings, a.digest, grid=(2, 3))], max_tokens=1)
    plain = Model("tiny-gemma3", gemma_path, EngineOptions(n_ctx=64, backend="reference"))
    with pytest.raises(EdgeInferError, match="no images"):
        plain.generate("the", images=[a], max_tokens=1)
    with pytest.raises(EdgeInferError, match="belongs to another model"):
        plain.use_projector(FakeProjector(N_EMBD + 1))
    engine = plain.engine
    with pytest.raises(EdgeInferError, match="out of range"):  # image ids without their images
        engine.forward(np.array([1, *chunk_ids(a)]), np.arange(7), engine.new_cache())
    with pytest.raises(EdgeInferError, match="not given"):
        engine.forward(np.array([1, *chunk_ids(a)]), np.arange(7), engine.new_cache(),
                       media=MediaRows([random_chunk(6, N_EMBD, 42)], N_EMBD))
    with pytest.raises(EdgeInferError, match="one forward pass"):
        engine.forward(np.array([1, *chunk_ids(a)[:3]]), np.arange(4), engine.new_cache(),
                       media=MediaRows([a], N_EMBD))


def test_a_sequence_with_an_image_is_not_exported(gemma_path, model):
    a = random_chunk(6, N_EMBD, 51)
    model.reset()
    model.generate("the of", max_tokens=1, temperature=0)
    assert model.sessions.export_kv() is not None
    model.generate("the of", images=[a], max_tokens=1, temperature=0)
    assert model.sessions.export_kv() is None  # saved sessions hold text ids only
