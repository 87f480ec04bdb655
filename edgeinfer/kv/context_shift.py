"""Context shift: when a sequence fills its window, drop the oldest half after `n_keep` tokens.

As llama.cpp's context shift (`llama_kv_self_seq_rm` + `llama_kv_self_seq_add` + K-shift):
keep the first `n_keep` tokens, discard the next `n_discard = (n_used - n_keep) // 2`, and
move the rest back by `n_discard` positions. Cached keys carry RoPE of their old positions;
RoPE is a rotation by angle pos * freq, so rotating a key by `-n_discard` gives exactly the
key of its new position (`rope_shift`). Values carry no position and move unchanged.

The kept tokens' K/V were computed while the discarded ones were still visible, so after a
shift the cache is not what a fresh prompt would compute (llama.cpp accepts the same): the
session manager never registers post-shift blocks in the prefix cache.

Sliding-window layer groups keep only their window (edgeinfer.paged_kv): after the shift
they hold the moved rows the next queries can see; kept-prefix rows such a group had
already given back stay missing (masked), as in llama.cpp's SWA cache.
"""

from __future__ import annotations

import numpy as np

from edgeinfer.backend import Backend


def rope_shift(backend: Backend, config, gguf, layer: int, k: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Re-rotate roped keys k (n, n_head_kv, head_dim) by `delta` positions (per row).

    Uses the layer's RoPE base, frequency scale, mode and frequency factors, the same
    arguments `Transformer.attention` ropes with. Runs the numpy reference `Backend.rope`
    (the shift is rare and must be exact), whatever backend the model runs on.
    """
    freq_factors = "rope_freqs.weight" if "rope_freqs.weight" in gguf.tensors else None
    base = config.rope_base_for(layer)
    scale = 1.0 if config.is_swa(layer) else config.rope_freq_scale
    return Backend.rope(backend, np.asarray(k, dtype=np.float32), delta, config.rope_dims, base,
                        scale, config.rope_mode, freq_factors)


def shift_context(engine, seq, n_keep: int) -> int:
    """Shift a full `seq` (a SequenceKV) in place; returns the tokens discarded (0 = cannot).

    `seq.tokens` (the recorded ids, possibly one ahead of n_used) loses the same range. The
    block work (per layer group; sliding-window groups keep only what their window needs)
    is SequenceKV.shift's; the keys are re-roped here.
    """
    cfg, gguf, backend = engine.config, engine.model_file.gguf, engine.backend

    def rerope(layer: int, k: np.ndarray, delta: np.ndarray) -> np.ndarray:
        return rope_shift(backend, cfg, gguf, layer, k, delta)

    return seq.shift(n_keep, rerope)
