"""What every model family shares: reading the config from `{arch}.*` keys, tensor checks,
and the decoder-only transformer skeleton the family files fill in.

A family file (llama.py, qwen2.py, ...) subclasses `Transformer`, states its config
defaults, the tensors it needs, and its block (`layer`). Models see only a `Backend`
(edgeinfer.backends.base): they never touch numpy kernels or the GPU directly.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from edgeinfer.errors import GGUFError, MetadataError, UnsupportedModelError
from edgeinfer.metadata import (MAX_CTX, MAX_EMBD, MAX_FF, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS,
                                MAX_ROPE_BASE, MAX_VOCAB, REQUIRED, meta_float, meta_int,
                                meta_int_per_layer, meta_str, meta_str_array)
from edgeinfer.models.config import ModelConfig
from edgeinfer.rope import ROPE_NORM, RopeArgs, yarn_for

if TYPE_CHECKING:
    from edgeinfer.backends.base import Backend
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.kv.view import KVView


ROPE_SCALINGS = ("none", "linear", "yarn")  # rope.scaling.type values llama.cpp runs and edgeinfer does
_BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")


def blocks_in_file(gf: "GGUFFile") -> int:
    """How many distinct `blk.N.` blocks the file has tensors for (bounded by its tensor count)."""
    return len({m.group(1) for m in map(_BLOCK_INDEX.match, gf.tensors) if m})


class Transformer:
    """A decoder-only transformer over a Backend. Subclasses define the family's block."""

    # Defaults llama.cpp applies to this family when a key is absent.
    ROPE_MODE: ClassVar[str] = ROPE_NORM
    DEFAULT_NORM_EPS: ClassVar[float] = 1e-5
    DEFAULT_ROPE_BASE: ClassVar[float] = 10000.0
    GENERATES: ClassVar[bool] = True  # False for encoders: they only embed
    SWA_ROPE_SCALED: ClassVar[bool] = False  # whether sliding-window layers take the RoPE scaling too
    DEFAULT_FF: ClassVar[object] = REQUIRED  # feed_forward_length when absent (qwen35moe files have none)
    PER_LAYER_FF: ClassVar[bool] = False  # feed_forward_length may differ per layer (gemma4: config.n_ff_layers)
    PER_LAYER_KV_HEADS: ClassVar[bool] = False  # head_count_kv may too (gemma4: config.n_head_kv_layers)

    def __init__(self, config: ModelConfig, gguf: "GGUFFile", backend: "Backend") -> None:
        self.config = config
        self.gguf = gguf
        self.backend = backend

    # -- config and checks --------------------------------------------------------------
    @classmethod
    def read_config(cls, gf: "GGUFFile") -> ModelConfig:
        md, arch = gf.metadata, gf.architecture

        def key(name: str) -> str:
            return f"{arch}.{name}"

        n_embd = meta_int(md, key("embedding_length"), 1, MAX_EMBD)
        n_layer = meta_int(md, key("block_count"), 1, MAX_LAYERS)
        # Before anything is built per layer: the file must hold tensors for every block it claims.
        present = blocks_in_file(gf)
        if n_layer > present:
            raise MetadataError(f"{gf.path}: metadata key {key('block_count')!r} claims {n_layer} "
                                f"layers but the file has tensors for {present}")
        n_head = meta_int_per_layer(md, key("attention.head_count"), 1, MAX_HEADS, n_layer)
        n_head_kv = meta_int_per_layer(md, key("attention.head_count_kv"), 1, MAX_HEADS, n_layer, n_head)
        n_ff = meta_int_per_layer(md, key("feed_forward_length"), 1, MAX_FF, n_layer, cls.DEFAULT_FF)
        n_ff_layers: tuple[int, ...] = ()
        if cls.PER_LAYER_FF and isinstance(n_ff, np.ndarray) and len(set(n_ff.tolist())) > 1:
            n_ff_layers = tuple(int(f) for f in n_ff)
            n_ff = max(n_ff_layers)
        kv_heads_layers: tuple[int, ...] = ()
        if cls.PER_LAYER_KV_HEADS and isinstance(n_head_kv, np.ndarray) and len(set(n_head_kv.tolist())) > 1:
            kv_heads_layers = tuple(int(h) for h in n_head_kv)
            n_head_kv = max(kv_heads_layers)
        for label, value in (("attention.head_count", n_head), ("attention.head_count_kv", n_head_kv),
                             ("feed_forward_length", n_ff)):
            if isinstance(value, np.ndarray):  # per-layer arrays: supported only when uniform
                if len(set(value.tolist())) != 1:
                    raise UnsupportedModelError(f"{gf.path}: metadata key {key(label)!r}: per-layer values that "
                                                f"differ are not supported for {arch}")
        n_head, n_head_kv, n_ff = (int(np.asarray(v).ravel()[0]) for v in (n_head, n_head_kv, n_ff))
        for i, heads in enumerate(kv_heads_layers or (n_head_kv,)):
            if n_head % heads:
                where = f" (layer {i})" if kv_heads_layers else ""
                raise MetadataError(f"{gf.path}: {n_head} attention heads cannot share {heads} KV heads{where} "
                                    f"({key('attention.head_count')!r}, {key('attention.head_count_kv')!r})")
        head_dim = meta_int(md, key("attention.key_length"), 1, MAX_HEAD_DIM, n_embd // n_head)
        if head_dim < 1:
            raise MetadataError(f"{gf.path}: metadata key {key('attention.head_count')!r} is {n_head}, "
                                f"more heads than {key('embedding_length')!r} ({n_embd}) has dimensions")
        head_dim_v = meta_int(md, key("attention.value_length"), 1, MAX_HEAD_DIM, head_dim)
        n_vocab = _vocab_size(gf, arch)
        scaling = meta_str(md, key("rope.scaling.type"), "none")
        if scaling not in ROPE_SCALINGS:
            raise UnsupportedModelError(f"{gf.path}: metadata key {key('rope.scaling.type')!r} is {scaling!r}; "
                                        f"supported: {', '.join(ROPE_SCALINGS)}")
        factor = meta_float(md, key("rope.scaling.factor"), 0.0, 1e6, 0.0)
        freq_scale = 1.0 / factor if scaling != "none" and factor > 0 else 1.0
        n_ctx_train = meta_int(md, key("context_length"), 1, MAX_CTX, 2048)
        rope_dims = meta_int(md, key("rope.dimension_count"), 1, head_dim, head_dim)
        if rope_dims % 2:  # RoPE rotates pairs of dimensions
            raise MetadataError(f"{gf.path}: metadata key {key('rope.dimension_count')!r} must be even, "
                                f"got {rope_dims}")
        cfg = ModelConfig(
            arch=arch,
            n_vocab=n_vocab,
            n_ctx_train=n_ctx_train,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            n_ff=n_ff,
            norm_eps=meta_float(md, key("attention.layer_norm_rms_epsilon"), 0.0, 1.0, cls.DEFAULT_NORM_EPS),
            rope_mode=cls.ROPE_MODE,
            rope_dims=rope_dims,
            rope_base=meta_float(md, key("rope.freq_base"), 0.0, MAX_ROPE_BASE, cls.DEFAULT_ROPE_BASE,
                                 lo_exclusive=True),
            rope_freq_scale=freq_scale,
            rope_scaling=scaling,
            rope_ctx_orig=meta_int(md, key("rope.scaling.original_context_length"), 1, MAX_CTX, n_ctx_train),
            rope_attn_factor=meta_float(md, key("rope.scaling.attn_factor"), 0.0, 1e3, 1.0, lo_exclusive=True),
            tied_embeddings="output.weight" not in gf.tensors,
            n_ff_layers=n_ff_layers,
            n_head_kv_layers=kv_heads_layers,
        )
        return cls.adjust_config(cfg, gf)

    @classmethod
    def adjust_config(cls, cfg: ModelConfig, gf: "GGUFFile") -> ModelConfig:
        """Family-specific settings on top of the common keys."""
        return cfg

    @classmethod
    def expected_tensors(cls, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> GGML shape (row length first) that the family needs."""
        t = cls.global_tensors(cfg)
        for i in range(cfg.n_layer):
            t.update(cls.layer_tensors(cfg, i))
        return t

    @classmethod
    def global_tensors(cls, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The tensors outside the blocks."""
        t: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (cfg.n_embd, cfg.n_vocab),
            "output_norm.weight": (cfg.n_embd,),
        }
        if not cfg.tied_embeddings:
            t["output.weight"] = (cfg.n_embd, cfg.n_vocab)
        return t

    @classmethod
    def layer_tensors(cls, cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
        """The tensors of block `i`; families add theirs on top."""
        p = f"blk.{i}."
        return {
                p + "attn_norm.weight": (cfg.n_embd,),
                p + "attn_q.weight": (cfg.n_embd, cfg.q_dim),
                p + "attn_k.weight": (cfg.n_embd, cfg.kv_dim),
                p + "attn_v.weight": (cfg.n_embd, cfg.n_head_kv * cfg.head_dim_v),
                p + "attn_output.weight": (cfg.n_head * cfg.head_dim_v, cfg.n_embd),
                p + "ffn_norm.weight": (cfg.n_embd,),
                p + "ffn_gate.weight": (cfg.n_embd, cfg.n_ff),
                p + "ffn_up.weight": (cfg.n_embd, cfg.n_ff),
                p + "ffn_down.weight": (cfg.n_ff, cfg.n_embd),
        }

    @classmethod
    def optional_tensors(cls, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Tensors used when present (checked for shape, not required)."""
        return {"rope_freqs.weight": (cfg.rope_dims // 2,)}

    @classmethod
    def validate(cls, cfg: ModelConfig, gf: "GGUFFile") -> None:
        # one block at a time: memory stays flat whatever the layer count
        for part in (cls.global_tensors(cfg), *(cls.layer_tensors(cfg, i) for i in range(cfg.n_layer))):
            for name, shape in part.items():
                if name not in gf.tensors:
                    raise GGUFError(f"{gf.path}: required tensor {name!r} is missing")
                _check_shape(gf, name, shape)
        for name, shape in cls.optional_tensors(cfg).items():
            if name in gf.tensors:
                _check_shape(gf, name, shape)

    # -- forward --------------------------------------------------------------------------
    # Called by forward with (tokens, positions, final normed hidden state of every row) when set:
    # what a multi-token-prediction drafter reads (edgeinfer.speculative.mtp).
    hidden_sink = None

    def forward(self, tokens: np.ndarray, positions: np.ndarray, kv: "KVView",
                logits_for: np.ndarray | None = None) -> np.ndarray:
        """Run `tokens` at `positions`, appending their K/V to `kv`.

        Returns float32 logits of shape (len(logits_for), n_vocab) for the given row
        indices into `tokens` (default: the last one only).
        """
        cfg = self.config
        if logits_for is None:
            logits_for = np.array([len(tokens) - 1])
        be = self.backend
        if self.hidden_sink is None:
            x = self.hidden(tokens, positions, kv, logits_for)
        else:  # every row's normed hidden state for the sink, the same rows' bits for the head
            x = self.hidden(tokens, positions, kv, np.arange(len(tokens)))
            self.hidden_sink(tokens, positions, np.asarray(x))
            x = x[np.asarray(logits_for)]
        head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        return be.linear(head, x)

    def hidden(self, tokens: np.ndarray, positions: np.ndarray, kv: "KVView",
               rows: np.ndarray) -> np.ndarray:
        """The final normed hidden states (len(rows), n_embd) of the given rows: what the
        output head reads, and what embeddings pool (llama.cpp's `t_embd`)."""
        cfg, be = self.config, self.backend
        x = self.embed(tokens)
        slots = kv.append(positions)
        x = be.run_layers(cfg.n_layer, x, lambda i, h: self.layer(i, h, positions, slots, kv), positions, kv)
        be.at_layer(None)
        return be.rms_norm(x[rows], "output_norm.weight", cfg.norm_eps)

    # The image rows of the forward pass running now (edgeinfer.vision.media_ids.MediaStep),
    # set by the engine around a pass whose tokens include images; None otherwise.
    media_step = None

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """The input rows (n, n_embd) of `tokens`: what the first layer reads (and all a replayed
        CUDA graph step computes on the host, edgeinfer.backends.cuda_graph). Image rows come
        from the step's chunks, unscaled."""
        step = self.media_step
        x = self.backend.get_rows("token_embd.weight", tokens if step is None else step.token_ids(tokens))
        if self.config.embed_scale != 1.0:
            x *= np.float32(self.config.embed_scale)
        return x if step is None else step.place(x)

    def layer(self, i: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray,
              kv: "KVView") -> np.ndarray:
        raise NotImplementedError

    # Shared building blocks ----------------------------------------------------------------
    def rope_args(self, i: int) -> RopeArgs:
        """How layer i ropes Q and K: its attention and the context shift's re-rope use it."""
        cfg = self.config
        freq_factors = "rope_freqs.weight" if "rope_freqs.weight" in self.gguf.tensors else None
        scaled = self.SWA_ROPE_SCALED or not cfg.is_swa(i)
        scale = cfg.rope_freq_scale if scaled else 1.0
        base = cfg.rope_base_for(i)
        yarn = None
        if scaled and cfg.rope_scaling == "yarn" and scale != 1.0:
            yarn = yarn_for(cfg.rope_dims, cfg.rope_ctx_orig, base, scale, cfg.rope_attn_factor)
        return RopeArgs(cfg.rope_dims, base, scale, cfg.rope_mode, freq_factors, yarn)

    def attention(self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  positions: np.ndarray, slots: np.ndarray, kv: "KVView") -> np.ndarray:
        """RoPE q/k, store k/v in the cache, attend; q: (n, n_head, hd) -> (n, n_head*hd_v)."""
        cfg, be = self.config, self.backend
        q = be.rope_store(q, k, v, positions, self.rope_args(i), kv, i, slots)
        window = cfg.sliding_window if cfg.is_swa(i) else 0
        if cfg.attn_scale:  # Gemma scales Q itself before attention, as llama.cpp does
            q_scale, kq_scale = cfg.attn_scale, 1.0
        else:  # the others scale Q K^T inside the softmax
            q_scale, kq_scale = 1.0, 1.0 / math.sqrt(cfg.head_dim)
        out = self.attend(q, kv, i, positions, kq_scale, window, q_scale=q_scale, sinks=self.attention_sinks(i))
        return out.reshape(out.shape[0], -1)

    def attend(self, q: np.ndarray, kv: "KVView", layer: int, positions: np.ndarray, scale: float, window: int,
               **kw) -> np.ndarray:
        """The backend's causal attention, except that a non-causal image's rows see the whole
        image (edgeinfer.vision.image_attention)."""
        step = self.media_step
        if step is None or step.limits is None:
            return self.backend.attention(q, kv, layer, positions, scale, window, **kw)
        return self.backend.image_attention(q, kv, layer, positions, step.firsts, step.limits, scale, window, **kw)

    def attention_sinks(self, i: int) -> str | None:
        """The tensor of layer i's per-head attention sinks (gpt-oss), or None."""
        return None


def _vocab_size(gf: "GGUFFile", arch: str) -> int:
    """The embedding's row count; the vocabulary must have exactly one token per row (as in
    llama.cpp), or a token id could index past the embedding."""
    md = gf.metadata
    tokens = meta_str_array(md, "tokenizer.ggml.tokens", None)
    claimed = meta_int(md, f"{arch}.vocab_size", 1, MAX_VOCAB, None)
    embd = gf.tensors.get("token_embd.weight")
    n_vocab = embd.shape[1] if embd is not None and len(embd.shape) == 2 else None
    if n_vocab is None:
        n_vocab = len(tokens) if tokens is not None else meta_int(md, f"{arch}.vocab_size", 1, MAX_VOCAB, REQUIRED)
    if tokens is not None and len(tokens) != n_vocab:
        raise MetadataError(f"{gf.path}: metadata key 'tokenizer.ggml.tokens' has {len(tokens)} tokens "
                            f"but token_embd.weight has {n_vocab} rows")
    if claimed is not None and claimed != n_vocab:
        raise MetadataError(f"{gf.path}: metadata key {arch + '.vocab_size'!r} is {claimed} but "
                            f"token_embd.weight has {n_vocab} rows")
    return n_vocab


def _check_shape(gf: "GGUFFile", name: str, shape: tuple[int, ...]) -> None:
    got = gf.tensors[name].shape
    if tuple(got) != tuple(shape):
        raise GGUFError(f"{gf.path}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                        f"from the model's metadata")


__all__ = ["ModelConfig", "Transformer"]
