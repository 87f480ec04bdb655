"""A model's hyperparameters (`ModelConfig`): what the backends, the K/V caches and the
family files all size themselves by. It imports nothing of edgeinfer's, so every layer
can use it; reading it from a file is edgeinfer.models.base's job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DeltaNetShape:
    """The gated DeltaNet layers' sizes (qwen35: `{arch}.ssm.*` keys, as llama.cpp reads them).

    Value head h reads key head h % n_k_heads (tiled). The per-sequence state of one layer
    is a conv window (conv_kernel - 1, conv_dim) and an SSM state (n_v_heads, head_v_dim,
    head_k_dim), stored as ggml stores it: row j of head h is column j of the delta rule's S.
    """

    conv_kernel: int  # ssm.conv_kernel: taps of the short causal convolution
    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    head_k_dim: int  # ssm.state_size
    head_v_dim: int  # ssm.inner_size / n_v_heads

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_kernel - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.n_v_heads, self.head_v_dim, self.head_k_dim)

    @property
    def state_bytes(self) -> int:
        """float32 bytes of one layer's state (conv window + SSM state)."""
        c, s = self.conv_state_shape, self.ssm_state_shape
        return 4 * (c[0] * c[1] + s[0] * s[1] * s[2])


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters read from GGUF metadata, with llama.cpp's defaults when absent."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int  # K/V heads (the largest of n_head_kv_layers where they differ per layer)
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
    # hybrid recurrent models (qwen35): per layer, whether it is a gated DeltaNet layer (a
    # fixed-size state per sequence, edgeinfer.kv.recurrent) rather than attention over K/V
    recurrent_layers: tuple[bool, ...] = ()
    delta_net: DeltaNetShape | None = None
    rope_sections: tuple[int, ...] = ()  # multi-section RoPE (rope.dimension_sections)
    n_layer_nextn: int = 0  # multi-token-prediction blocks after the n_layer trunk (not run)
    # per-layer sizes (gemma4): sliding-window layers' head sizes and rotated dims (0 = as the
    # global layers'), and each layer's FFN rows (() = n_ff everywhere)
    head_dim_swa: int = 0
    head_dim_v_swa: int = 0
    rope_dims_swa: int = 0
    n_ff_layers: tuple[int, ...] = ()
    # shared K/V (gemma4's shared_kv_layers): per layer, the layer whose K/V it attends over
    # (itself, or an earlier layer whose K/V it reuses and never writes); () = its own
    kv_source_layers: tuple[int, ...] = ()
    # per-layer K/V head counts (gemma4's 26B-A4B, 31B: fewer on global layers); () = n_head_kv
    n_head_kv_layers: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def has_recurrent(self) -> bool:
        """Whether a sequence of this model is K/V for some layers and a state for others."""
        return any(self.recurrent_layers)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Layers that keep K/V of their own (every layer but the recurrent ones and those
        reading another layer's K/V)."""
        return tuple(i for i in range(self.n_layer) if not self.is_recurrent(i) and self.kv_source(i) == i)

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` attends over (itself unless it shares an earlier one's)."""
        return self.kv_source_layers[layer] if self.kv_source_layers else layer

    def owns_kv(self, layer: int) -> bool:
        """Whether `layer` stores K/V of its own (not recurrent, not shared)."""
        return not self.is_recurrent(layer) and self.kv_source(layer) == layer

    def n_head_kv_of(self, layer: int) -> int:
        """K/V heads of layer `layer` (its Q heads share them in groups of n_head // this)."""
        return self.n_head_kv_layers[layer] if self.n_head_kv_layers else self.n_head_kv

    def head_dim_of(self, layer: int) -> int:
        """Per-head size of layer `layer`'s Q and K."""
        return self.head_dim_swa if self.head_dim_swa and self.is_swa(layer) else self.head_dim

    def head_dim_v_of(self, layer: int) -> int:
        """Per-head size of layer `layer`'s V."""
        return self.head_dim_v_swa if self.head_dim_v_swa and self.is_swa(layer) else self.head_dim_v

    def rope_dims_of(self, layer: int) -> int:
        return self.rope_dims_swa if self.rope_dims_swa and self.is_swa(layer) else self.rope_dims

    def n_ff_of(self, layer: int) -> int:
        return self.n_ff_layers[layer] if self.n_ff_layers else self.n_ff

    def kv_values_of(self, layer: int) -> int:
        """K + V values `layer` stores per token (0 for recurrent and shared layers)."""
        if not self.owns_kv(layer):
            return 0
        return self.n_head_kv_of(layer) * (self.head_dim_of(layer) + self.head_dim_v_of(layer))

    def saved_kv_shapes(self, layer: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, size) of one saved K row and one V row of `layer`: size 0 for a layer
        whose K/V are another's (saved once, at their owner)."""
        heads = self.n_head_kv_of(layer)
        if not self.owns_kv(layer):
            return (heads, 0), (heads, 0)
        return (heads, self.head_dim_of(layer)), (heads, self.head_dim_v_of(layer))

    @property
    def kv_values_per_token(self) -> int:
        """K + V values the whole model stores per token (each shared K/V once)."""
        return sum(self.kv_values_of(i) for i in range(self.n_layer))

    @property
    def uniform_heads(self) -> bool:
        """Whether every K/V layer has the same K/V heads and head sizes (one row shape)."""
        shapes = {(self.n_head_kv_of(i), self.head_dim_of(i), self.head_dim_v_of(i)) for i in self.kv_layers}
        return len(shapes) <= 1

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    def rope_base_for(self, layer: int) -> float:
        if self.is_swa(layer) and self.rope_base_swa:
            return self.rope_base_swa
        return self.rope_base
