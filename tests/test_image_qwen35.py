"""Images in a Qwen3.5 text model (qwen35, qwen35moe: M-RoPE) against llama.cpp: a tiny one and a
tiny qwen3vl mmproj of its width; libmtmd tokenizes the prompt (the image wrapped in
<|vision_start|> ... <|vision_end|>), mtmd_helper_eval_chunks decodes it with the image's rows
at their (t, h, w) grid positions and the text after it max(rows, cols) positions on; then
greedy decoding, against edgeinfer.load(..., mmproj=...).generate(prompt, images=[png]).
Measured, max |ours - llama.cpp| / max |llama.cpp| of the first token's logits: 3e-6 and 1.1e-4
(qwen35; 3 x 5 and 5 x 3 grids), 4e-6 and 3.8e-5 (qwen35moe); with the image's rows at
sequential positions it is 4e-2, with t for h and w 4e-3."""

from __future__ import annotations

import io

import mtmd_oracle
import numpy as np
import pytest
from gguf_factory import TinyShape, bpe_vocab, write_tiny_model

from edgeinfer.vision.grid_positions import GridPositions

N_EMBD = 64
STEPS = 8
PROMPT = "the and <__media__> hello world"
VISION = ("<|vision_start|>", "<|vision_end|>")
SIZES = {1: (24, 40), 2: (40, 24)}  # (height, width) by seed: 3 x 5 and 5 x 3 tokens


def qwen35_image_vocab() -> dict:
    """bpe_vocab("qwen35") plus the control tokens libmtmd wraps a qwen3vl image in."""
    vocab = bpe_vocab("qwen35")
    vocab["tokens"] = list(vocab["tokens"]) + list(VISION)
    vocab["types"] = list(vocab["types"]) + [3] * len(VISION)
    return vocab


def _png(seed: int) -> bytes:
    from PIL import Image

    h, w = SIZES[seed]
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 6, y * 5, (x * y) % 256], -1)
    pixels = np.clip(base + rng.integers(-60, 60, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe"])
def files(tmp_path_factory, request):
    mmproj_factory = pytest.importorskip("mmproj_factory")
    root = tmp_path_factory.mktemp("qwen35img")
    shape = TinyShape(n_embd=N_EMBD, n_layer=2, n_head=2, n_head_kv=1, head_dim=32, n_ff=96, n_ctx=256,
                      ssm_state=16, rope_dims=16, n_ff_exp=32, n_ff_shexp=32)  # DeltaNet, then attention
    text = write_tiny_model(root / "text.gguf", request.param, "F32", shape=shape, vocab=qwen35_image_vocab())
    mmproj = mmproj_factory.write_qwen3vl_mmproj(root / "mmproj.gguf", N_EMBD, "F32")
    return text, mmproj


def test_greedy_tokens_after_an_image_match_llama_cpp(files):
    import edgeinfer
    from edgeinfer.vision.media_ids import image_runs

    text, mmproj = files
    if not mtmd_oracle.available():
        pytest.skip(mtmd_oracle.REASON)
    ref = mtmd_oracle.LlamaMtmd(text, mmproj, n_ctx=256)
    model = edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=256, backend="cpu")
    try:
        results = {}
        for seed in (1, 2):
            png = _png(seed)
            want, want_logits, place = ref.greedy(PROMPT, png, STEPS)
            seen = []
            got = model.generate(PROMPT, images=[png], max_tokens=STEPS, temperature=0, on_prompt=seen.append)
            ids = seen[0]
            # the same wrap and the same positions as libmtmd's
            (a, b), = image_runs(ids)
            assert model.tokenizer.decode([ids[a - 1], ids[b]]) == "".join(VISION)
            rows, cols = place["grid"]
            assert (rows, cols) == model.images.encode(png).grid and rows != cols
            assert place["n_pos"] == max(rows, cols) and a == place["start"]
            grid = GridPositions([(a, rows, cols)])
            np.testing.assert_array_equal(grid.at(np.arange(a, b)), place["thw"])
            assert grid.at(np.array([len(ids) - 1]))[0, 0] == place["n_past"] - 1  # the last prompt token
            model.reset()
            ours = _first_logits(model, ids, png)
            err = np.abs(ours - want_logits).max() / np.abs(want_logits).max()
            print(f"image {seed} ({rows} x {cols}): max |ours - llama.cpp| / max |llama.cpp| = {err:.1e}")
            assert err < 1e-3, (seed, err)
            assert got.tokens == want[:len(got.tokens)] and len(got.tokens) >= 1, (seed, got.tokens, want)
            results[seed] = (got.tokens, ours)
        # two different images: different answers
        assert np.abs(results[1][1] - results[2][1]).max() > 1e-3
        assert results[1][0] != results[2][0]
    finally:
        ref.close()


def _first_logits(model, ids, png) -> np.ndarray:
    """The logits after the prompt, prefilled on a fresh cache with the image."""
    from edgeinfer.vision.media_ids import MediaRows

    media = MediaRows([model.images.encode(png)], N_EMBD, mrope=True)
    return model.engine.prefill(ids, model.engine.new_cache(), media=media)


def test_resending_the_image_reuses_its_cached_rows(files):
    import edgeinfer
    from edgeinfer.vision.media_ids import image_runs

    text, mmproj = files
    model = edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=256, backend="cpu")
    png = _png(1)
    seen = []
    first = model.generate(PROMPT, images=[png], max_tokens=4, temperature=0, on_prompt=seen.append)
    again = model.generate(PROMPT, images=[png], max_tokens=4, temperature=0)
    (_, end), = image_runs(seen[0])
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens >= end  # the image's rows and the lag they leave come from the cache
    assert again.tokens == first.tokens
    # a longer prompt after the cached image: the text after it takes the positions libmtmd gives it
    longer = PROMPT + " the"
    after = model.generate(longer, images=[png], max_tokens=4, temperature=0)
    model.reset()
    cold = model.generate(longer, images=[png], max_tokens=4, temperature=0)
    assert after.usage.cached_tokens >= end and cold.usage.cached_tokens == 0
    assert after.tokens == cold.tokens


def test_grid_positions_are_libmtmds_rule():
    """Two images (3 x 5, then 2 x 2) between text: rows on their grids, text continuing
    max(rows, cols) after each image's first position."""
    grid = GridPositions([(2, 3, 5), (19, 2, 2)])
    got = grid.at(np.arange(26))
    assert got[:2].tolist() == [[0, 0, 0], [1, 1, 1]]
    assert got[2].tolist() == [2, 2, 2] and got[3].tolist() == [2, 2, 3] and got[7].tolist() == [2, 3, 2]
    assert got[16].tolist() == [2, 4, 6]   # the last row of 3 x 5
    assert got[17].tolist() == [7, 7, 7]   # text: 2 + max(3, 5)
    assert got[19].tolist() == [9, 9, 9] and got[22].tolist() == [9, 10, 10]
    assert got[23].tolist() == [11, 11, 11] and grid.lag == 12   # (15 - 5) + (4 - 2)
    assert GridPositions([]).at(np.array([4, 5])).tolist() == [[4, 4, 4], [5, 5, 5]]


def test_text_rows_rotate_as_without_a_grid(files):
    """Rows whose t, h and w are equal rotate bit for bit as a text row at that position; a
    different h or w turns some pairs (the sections' ones) and only those."""
    import edgeinfer

    model = edgeinfer.load(str(files[0]), n_ctx=64, backend="cpu").engine.model
    x = np.random.default_rng(0).standard_normal((4, 2, 32)).astype(np.float32)
    pos = np.array([3, 4, 9, 10])
    plain = model.mrope(1, x, pos)
    np.testing.assert_array_equal(model.mrope(1, x, pos, np.repeat(pos[:, None], 3, axis=1)), plain)
    grid = np.repeat(pos[:, None], 3, axis=1)
    grid[:, 1] += 2
    moved = model.mrope(1, x, pos, grid)
    changed = np.flatnonzero((moved != plain).any(axis=(0, 1)))
    half = model.config.rope_dims // 2
    hs = model._hw_pairs[0]
    assert sorted(changed.tolist()) == sorted(np.concatenate([hs, hs + half]).tolist())


def test_a_causal_image_may_be_cut_between_prefill_passes(files):
    """A qwen3vl image is causal: a prefill pass smaller than the image cuts it (as libmtmd's
    n_batch does) and the logits stay those of one pass."""
    import edgeinfer
    from edgeinfer.vision.media_ids import image_runs

    text, mmproj = files
    png = _png(1)
    logits = {}
    for chunk in (256, 4):
        model = edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=256, backend="cpu", prefill_chunk=chunk)
        seen = []
        model.generate(PROMPT, images=[png], max_tokens=1, temperature=0, on_prompt=seen.append)
        (a, b), = image_runs(seen[0])
        if chunk == 4:
            assert b - a > model.engine.max_prefill_rows
        logits[chunk] = _first_logits(model, seen[0], png)
    np.testing.assert_allclose(logits[4], logits[256], rtol=0, atol=1e-4 * np.abs(logits[256]).max())


def test_text_after_the_image_runs_alike_one_row_or_several_at_a_time(files):
    """What speculative verification runs: tokens after the image in one pass (decode_bits)
    give the logits decoding them one by one gives, at the same lagging positions."""
    import edgeinfer
    from edgeinfer.vision.media_ids import MediaRows

    text, mmproj = files
    model = edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=256, backend="cpu")
    png = _png(2)
    seen = []
    model.generate(PROMPT, images=[png], max_tokens=1, temperature=0, on_prompt=seen.append)
    ids, engine, after = seen[0], model.engine, [5, 17, 42]
    media = MediaRows([model.images.encode(png)], N_EMBD, mrope=True).placed(ids)
    one, many = engine.new_cache(), engine.new_cache()
    engine.prefill(ids, one, media=media)
    engine.prefill(ids, many, media=media)
    singles = np.stack([engine.decode(t, one, media) for t in after])
    rows = engine.forward(np.array(after), np.arange(len(ids), len(ids) + 3), many, logits_for=np.arange(3),
                          decode_bits=True, media=media)
    np.testing.assert_array_equal(rows, singles)
    unplaced = engine.new_cache()
    engine.prefill(ids, unplaced, media=media)
    assert np.abs(engine.decode(after[0], unplaced) - singles[0]).max() > 1e-4  # without the lag: another answer
