"""A model's hyperparameters (`ModelConfig`): what the backends, the K/V caches and the
family files all size themselves by. It imports nothing of edgeinfer's, so every layer
can use it; reading it from a file is edgeinfer.models.base's job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    rope_scaling: str = "none"  # rope.scaling.type: none | linear | yarn
    rope_ctx_orig: int = 0  # YaRN: the context the model was trained at before its extension
    rope_attn_factor: float = 1.0  # YaRN: rope.scaling.attn_factor
    rope_base_swa: float = 0.0  # RoPE base of sliding-window layers (gemma3), 0 = same as global
    sliding_window: int = 0  # 0 = every layer attends to the whole context
    swa_layers: tuple[bool, ...] = ()
    attn_scale: float = 0.0  # multiplies Q before attention (Gemma); 0 = 1/sqrt(head_dim) on Q K^T
    embed_scale: float = 1.0  # gemma multiplies embeddings by sqrt(n_embd)
    tied_embeddings: bool = False
    # mixtures of experts: experts per layer, chosen per token, rows of each (0: a dense FFN)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
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
