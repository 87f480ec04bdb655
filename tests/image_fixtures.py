"""A tiny Gemma 3 text model that takes images, and image chunks of random rows, for the text side's tests."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from gguf_factory import TinyShape, spm_vocab, write_tiny_model

from edgeinfer.vision.chunk import ImageChunk

IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<start_of_turn>", "<end_of_turn>")

GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}"
    "{% for item in m['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma3_image_vocab() -> dict:
    """spm_vocab plus Gemma 3's image and turn control tokens."""
    vocab = spm_vocab()
    vocab["tokens"] = list(vocab["tokens"]) + list(IMAGE_TOKENS)
    vocab["types"] = list(vocab["types"]) + [3] * len(IMAGE_TOKENS)
    vocab["scores"] = list(vocab["scores"]) + [0.0] * len(IMAGE_TOKENS)
    return vocab


def write_gemma3(path: Path, n_embd: int = 64, sliding_window: int = 16, seed: int = 0, n_layer: int = 2) -> Path:
    shape = TinyShape(n_embd=n_embd, n_layer=n_layer, n_head=2, n_head_kv=1, head_dim=32, n_ff=96,
                      n_ctx=256, extra={"sliding_window": sliding_window})
    return write_tiny_model(path, "gemma3", "F32", shape=shape, vocab=gemma3_image_vocab(), seed=seed,
                            chat_template=GEMMA3_TEMPLATE)


def random_chunk(n_tokens: int, n_embd: int, seed: int, non_causal: bool = True) -> ImageChunk:
    """An image chunk of rows about the size of Gemma's scaled token embeddings."""
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((n_tokens, n_embd)) * 2.0).astype(np.float32)
    digest = hashlib.sha256(f"image {seed} {n_tokens}".encode()).hexdigest()
    return ImageChunk(rows, digest, non_causal=non_causal)


class FakeProjector:
    """A stand-in projector: any image source -> a chunk of random rows seeded by the source."""

    projector_type = "gemma3"

    def __init__(self, n_embd: int, n_tokens: int = 6) -> None:
        self.n_embd, self.n_tokens, self.calls = n_embd, n_tokens, 0

    def encode(self, image) -> ImageChunk:
        self.calls += 1
        return random_chunk(self.n_tokens, self.n_embd, int(image.digest[:8], 16))
