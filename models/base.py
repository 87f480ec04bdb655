"""What every model family shares: the config read from `{arch}.*` keys, tensor checks,
and the decoder-only transformer skeleton the family files fill in.

A family file (llama.py, qwen2.py, ...) subclasses `Transformer`, states its config
defaults, the tensors it needs, and its block (`layer`). Models see only a `Backend`
(edgeinfer.backend): they never touch numpy kernels or the GPU directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from edgeinfer.errors import GGUFError, UnsupportedModelError

if TYPE_CHECKING:
    from edgeinfer.backend import Backend
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.kv_cache import KVCache

ROPE_NORM = "norm"  # rotate adjacent pairs (x0, x1), (x2, x3): llama
ROPE_NEOX = "neox"  # rotate halves (x0, x_{d/2}): qwen2, qwen3, gemma3


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters read from GGUF metadata, with llama.cpp's defaults when absent."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int  # per-head size of Q and K
    head_dim_v: int  # per-head size of V
    n_ff: int
    norm_eps: float
    rope_mode: str
    rope_dims: int
    rope_base: float
    rope_freq_scale: float = 1.0
    rope_base_swa: float = 0.0  # RoPE base of sliding-window layers (gemma3), 0 = same as global
    sliding_window: int = 0  # 0 = every layer attends to the whole context
    swa_layers: tuple[bool, ...] = ()
    attn_scale: float = 0.0  # multiplies Q before attention (Gemma); 0 = 1/sqrt(head_dim) on Q K^T
    embed_scale: float = 1.0  # gemma multiplies embeddings by sqrt(n_embd)
    tied_embeddings: bool = False
    final_logit_softcap: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    def rope_base_for(self, layer: int) -> float:
        if self.is_swa(layer) and self.rope_base_swa:
            return self.rope_base_swa
        return self.rope_base


def _key(gf: "GGUFFile", arch: str, name: str, default: Any = None, required: bool = False) -> Any:
    key = f"{arch}.{name}"
    if key in gf.metadata:
        return gf.metadata[key]
    if required:
        raise GGUFError(f"{gf.path}: missing metadata key {key!r}")
    return default


class Transformer:
    """A decoder-only transformer over a Backend. Subclasses define the family's block."""

    # Defaults llama.cpp applies to this family when a key is absent.
    ROPE_MODE: ClassVar[str] = ROPE_NORM
    DEFAULT_NORM_EPS: ClassVar[float] = 1e-5
    DEFAULT_ROPE_BASE: ClassVar[float] = 10000.0

    def __init__(self, config: ModelConfig, gguf: "GGUFFile", backend: "Backend") -> None:
        self.config = config
        self.gguf = gguf
        self.backend = backend

    # -- config and checks --------------------------------------------------------------
    @classmethod
    def read_config(cls, gf: "GGUFFile") -> ModelConfig:
        arch = gf.architecture
        n_embd = int(_key(gf, arch, "embedding_length", required=True))
        n_layer = int(_key(gf, arch, "block_count", required=True))
        n_head = _key(gf, arch, "attention.head_count", required=True)
        n_head_kv = _key(gf, arch, "attention.head_count_kv", n_head)
        n_ff = _key(gf, arch, "feed_forward_length", required=True)
        for label, value in (("attention.head_count", n_head), ("attention.head_count_kv", n_head_kv),
                             ("feed_forward_length", n_ff)):
            if isinstance(value, np.ndarray):  # per-layer arrays: supported only when uniform
                if len(set(value.tolist())) != 1:
                    raise UnsupportedModelError(f"{gf.path}: per-layer {label} values are not supported")
        n_head, n_head_kv, n_ff = (int(np.asarray(v).ravel()[0]) for v in (n_head, n_head_kv, n_ff))
        if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv:
            raise GGUFError(f"{gf.path}: {n_head} attention heads cannot share {n_head_kv} KV heads")
        head_dim = int(_key(gf, arch, "attention.key_length", n_embd // n_head))
        head_dim_v = int(_key(gf, arch, "attention.value_length", head_dim))
        n_vocab = _vocab_size(gf, arch)
        scaling = _key(gf, arch, "rope.scaling.type", "none")
        factor = float(_key(gf, arch, "rope.scaling.factor", 0.0) or 0.0)
        freq_scale = 1.0 / factor if scaling == "linear" and factor > 0 else 1.0
        cfg = ModelConfig(
            arch=arch,
            n_vocab=n_vocab,
            n_ctx_train=int(_key(gf, arch, "context_length", 2048)),
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            n_ff=n_ff,
            norm_eps=float(_key(gf, arch, "attention.layer_norm_rms_epsilon", cls.DEFAULT_NORM_EPS)),
            rope_mode=cls.ROPE_MODE,
            rope_dims=int(_key(gf, arch, "rope.dimension_count", head_dim)),
            rope_base=float(_key(gf, arch, "rope.freq_base", cls.DEFAULT_ROPE_BASE)),
            rope_freq_scale=freq_scale,
            tied_embeddings="output.weight" not in gf.tensors,
        )
        return cls.adjust_config(cfg, gf)

    @classmethod
    def adjust_config(cls, cfg: ModelConfig, gf: "GGUFFile") -> ModelConfig:
        """Family-specific settings on top of the common keys."""
        return cfg

    @classmethod
    def expected_tensors(cls, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> GGML shape (row length first) that the family needs."""
        t: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (cfg.n_embd, cfg.n_vocab),
            "output_norm.weight": (cfg.n_embd,),
        }
        if not cfg.tied_embeddings:
            t["output.weight"] = (cfg.n_embd, cfg.n_vocab)
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            t.update({
                p + "attn_norm.weight": (cfg.n_embd,),
                p + "attn_q.weight": (cfg.n_embd, cfg.q_dim),
                p + "attn_k.weight": (cfg.n_embd, cfg.kv_dim),
                p + "attn_v.weight": (cfg.n_embd, cfg.n_head_kv * cfg.head_dim_v),
                p + "attn_output.weight": (cfg.n_head * cfg.head_dim_v, cfg.n_embd),
                p + "ffn_norm.weight": (cfg.n_embd,),
                p + "ffn_gate.weight": (cfg.n_embd, cfg.n_ff),
                p + "ffn_up.weight": (cfg.n_embd, cfg.n_ff),
                p + "ffn_down.weight": (cfg.n_ff, cfg.n_embd),
            })
        return t

    @classmethod
    def optional_tensors(cls, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Tensors used when present (checked for shape, not required)."""
        return {"rope_freqs.weight": (cfg.rope_dims // 2,)}

    @classmethod
    def validate(cls, cfg: ModelConfig, gf: "GGUFFile") -> None:
        for name, shape in cls.expected_tensors(cfg).items():
            if name not in gf.tensors:
                raise GGUFError(f"{gf.path}: required tensor {name!r} is missing")
            _check_shape(gf, name, shape)
        for name, shape in cls.optional_tensors(cfg).items():
            if name in gf.tensors:
                _check_shape(gf, name, shape)

    # -- forward --------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, positions: np.ndarray, kv: "KVCache",
                logits_for: np.ndarray | None = None) -> np.ndarray:
        """Run `tokens` at `positions`, appending their K/V to `kv`.

        Returns float32 logits of shape (len(logits_for), n_vocab) for the given row
        indices into `tokens` (default: the last one only).
        """
        cfg = self.config
        if logits_for is None:
            logits_for = np.array([len(tokens) - 1])
        be = self.backend
        x = be.get_rows("token_embd.weight", tokens)
        if cfg.embed_scale != 1.0:
            x *= np.float32(cfg.embed_scale)
        slots = kv.append(positions)
        for i in range(cfg.n_layer):
            x = self.layer(i, x, positions, slots, kv)
        x = x[logits_for]
        x = be.rms_norm(x, "output_norm.weight", cfg.norm_eps)
        head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        logits = be.linear(head, x)
        if cfg.final_logit_softcap:
            cap = np.float32(cfg.final_logit_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits

    def layer(self, i: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray,
              kv: "KVCache") -> np.ndarray:
        raise NotImplementedError

    # Shared building blocks ----------------------------------------------------------------
    def attention(self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  positions: np.ndarray, slots: np.ndarray, kv: "KVCache") -> np.ndarray:
        """RoPE q/k, store k/v in the cache, attend; q: (n, n_head, hd) -> (n, n_head*hd_v)."""
        cfg, be = self.config, self.backend
        freq_factors = "rope_freqs.weight" if "rope_freqs.weight" in self.gguf.tensors else None
        base = cfg.rope_base_for(i)
        scale = 1.0 if cfg.is_swa(i) else cfg.rope_freq_scale
        q = be.rope(q, positions, cfg.rope_dims, base, scale, cfg.rope_mode, freq_factors)
        k = be.rope(k, positions, cfg.rope_dims, base, scale, cfg.rope_mode, freq_factors)
        kv.store(i, slots, k, v)
        window = cfg.sliding_window if cfg.is_swa(i) else 0
        if cfg.attn_scale:  # Gemma scales Q itself before attention, as llama.cpp does
            q_scale, kq_scale = cfg.attn_scale, 1.0
        else:  # the others scale Q K^T inside the softmax
            q_scale, kq_scale = 1.0, 1.0 / math.sqrt(cfg.head_dim)
        out = be.attention(q, kv, i, positions, kq_scale, window, q_scale=q_scale)
        return out.reshape(out.shape[0], -1)


def _vocab_size(gf: "GGUFFile", arch: str) -> int:
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    if "token_embd.weight" in gf.tensors:
        return gf.tensors["token_embd.weight"].shape[1]
    if tokens is not None:
        return len(tokens)
    return int(_key(gf, arch, "vocab_size", required=True))


def _check_shape(gf: "GGUFFile", name: str, shape: tuple[int, ...]) -> None:
    got = gf.tensors[name].shape
    if tuple(got) != tuple(shape):
        raise GGUFError(f"{gf.path}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                        f"from the model's metadata")


__all__ = ["ModelConfig", "Transformer", "ROPE_NORM", "ROPE_NEOX"]
