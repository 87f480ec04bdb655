"""Qwen 3.5 / 3.6 (dense): three of every four layers are gated DeltaNet linear attention,
the fourth gated full attention, as llama.cpp's src/models/qwen35.cpp builds them.

Every block: x + mixer(rms_norm(x, attn_norm)), then x + ffn(rms_norm(x, post_attention_norm)).

- Gated DeltaNet layer (`attn_qkv`, `attn_gate`, `ssm_*`): qkv = attn_qkv(h) goes through
  the short causal conv (`ssm_conv1d`, its window kept per sequence) and SiLU, splits into
  q, k (ssm.group_count heads of ssm.state_size) and v (ssm.time_step_rank heads); q and k
  are L2-normed; beta = sigmoid(ssm_beta(h)), g = softplus(ssm_alpha(h) + ssm_dt.bias) *
  ssm_a (the file stores ssm_a as -exp(A_log)); the delta rule runs on the state (value
  head h reads key head h % n_k: tiled); the output is RMS-normed per head (`ssm_norm`),
  gated by silu(attn_gate(h)) and projected by `ssm_out`. Kernels: kernels_cpu/delta_net.py.
- Gated attention layer: attn_q gives q and a gate per head ([q | gate] in each head's
  2 * head_dim); q and k are RMS-normed per head, roped with the file's sections
  (interleaved M-RoPE: for text every section takes the token's position, a pair that
  falls in no section stays unrotated; an image's rows take their (t, h, w) on its grid,
  edgeinfer.vision.grid_positions), attention, then out * sigmoid(gate), attn_output.

Which layers are linear: `{arch}.attention.recurrent_layers` when the file has it, else
every layer but each `full_attention_interval`-th (4). `block_count` includes the
`nextn_predict_layers` multi-token-prediction blocks at the end; they are not run here.
The state lives with the sequence (edgeinfer.kv.recurrent); the model reads it as
`kv.recurrent`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from edgeinfer.errors import MetadataError, UnsupportedModelError
from edgeinfer.metadata import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, meta_int, meta_int_array
from edgeinfer.models.base import Transformer
from edgeinfer.models.config import DeltaNetShape
from edgeinfer.rope import ROPE_NEOX

FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default when the file says nothing


class Qwen35(Transformer):
    ROPE_MODE = ROPE_NEOX
    DEFAULT_NORM_EPS = 1e-6
    DEFAULT_ROPE_BASE = 10_000_000.0

    def __init__(self, config, gguf, backend) -> None:
        super().__init__(config, gguf, backend)
        from edgeinfer.kernels_cpu import delta_net  # Numba: not at import, the CLI and server start light

        self.delta_net = delta_net
        self.dn = delta_net.ops_for(backend.name)
        self._conv_w: dict[int, np.ndarray] = {}
        self._unrotated = _unrotated_pairs(config.rope_dims, config.rope_sections)
        self._hw_pairs = _section_pairs(config.rope_dims, config.rope_sections)[1:3]

    # -- config -----------------------------------------------------------------------------------
    @classmethod
    def adjust_config(cls, cfg, gf):
        md, arch, path = gf.metadata, cfg.arch, gf.path

        def key(name: str) -> str:
            return f"{arch}.{name}"

        n_all = cfg.n_layer
        nextn = meta_int(md, key("nextn_predict_layers"), 0, n_all - 1, 0)
        n_layer = n_all - nextn
        if key("attention.recurrent_layers") in md:
            value = md[key("attention.recurrent_layers")]
            if isinstance(value, (bool, np.bool_, int, np.integer)):
                flags = [bool(value)] * n_all
            elif isinstance(value, (list, tuple, np.ndarray)) and all(isinstance(v, (bool, np.bool_)) for v in value):
                flags = [bool(v) for v in value]
            else:
                flags = [bool(v) for v in meta_int_array(md, key("attention.recurrent_layers"), 0, 1)]
            if len(flags) != n_all:
                raise MetadataError(f"{path}: metadata key {key('attention.recurrent_layers')!r} has "
                                    f"{len(flags)} values for {n_all} blocks")
        else:
            interval = meta_int(md, key("full_attention_interval"), 1, MAX_LAYERS, FULL_ATTENTION_INTERVAL)
            flags = [(i + 1) % interval != 0 for i in range(n_all)]
        recurrent = tuple(flags[:n_layer])
        if all(recurrent):
            raise UnsupportedModelError(f"{path}: every layer is a linear-attention layer; edgeinfer needs "
                                        f"at least one attention layer")
        d_conv = meta_int(md, key("ssm.conv_kernel"), 2, 64)
        d_inner = meta_int(md, key("ssm.inner_size"), 1, 1 << 20)
        d_state = meta_int(md, key("ssm.state_size"), 1, MAX_HEAD_DIM)
        n_v = meta_int(md, key("ssm.time_step_rank"), 1, MAX_HEADS)
        n_k = meta_int(md, key("ssm.group_count"), 1, MAX_HEADS)
        if n_v % n_k:
            raise MetadataError(f"{path}: {n_v} value heads ({key('ssm.time_step_rank')!r}) cannot tile "
                                f"{n_k} key heads ({key('ssm.group_count')!r})")
        if d_inner != n_v * d_state:
            raise UnsupportedModelError(f"{path}: {key('ssm.inner_size')!r} is {d_inner}, not "
                                        f"{key('ssm.time_step_rank')!r} x {key('ssm.state_size')!r}: value and "
                                        f"key heads of different sizes are not supported (nor by llama.cpp)")
        sections = meta_int_array(md, key("rope.dimension_sections"), 0, 1 << 16)
        if len(sections) > 4:
            raise MetadataError(f"{path}: metadata key {key('rope.dimension_sections')!r} has "
                                f"{len(sections)} values, at most 4")
        sections = tuple(int(s) for s in sections) + (0,) * (4 - len(sections))
        if not any(sections[:3]) or sum(sections) > cfg.head_dim // 2:
            raise MetadataError(f"{path}: metadata key {key('rope.dimension_sections')!r} is {list(sections)}: "
                                f"sections must cover 1..{cfg.head_dim // 2} rotated pairs")
        if cfg.head_dim != cfg.head_dim_v:
            raise UnsupportedModelError(f"{path}: attention key and value heads of different sizes")
        shape = DeltaNetShape(conv_kernel=d_conv, n_k_heads=n_k, n_v_heads=n_v, head_k_dim=d_state,
                              head_v_dim=d_inner // n_v)
        return replace(cfg, n_layer=n_layer, n_layer_nextn=nextn, recurrent_layers=recurrent,
                       delta_net=shape, rope_sections=sections)

    @classmethod
    def layer_tensors(cls, cfg, i):
        p, e = f"blk.{i}.", cfg.n_embd
        t: dict[str, tuple[int, ...]] = {p + "attn_norm.weight": (e,), p + "post_attention_norm.weight": (e,)}
        if cfg.is_recurrent(i):
            dn = cfg.delta_net
            t.update({
                p + "attn_qkv.weight": (e, dn.conv_dim),
                p + "attn_gate.weight": (e, dn.value_dim),
                p + "ssm_conv1d.weight": (dn.conv_kernel, dn.conv_dim),
                p + "ssm_dt.bias": (dn.n_v_heads,),
                p + "ssm_a": (dn.n_v_heads,),
                p + "ssm_beta.weight": (e, dn.n_v_heads),
                p + "ssm_alpha.weight": (e, dn.n_v_heads),
                p + "ssm_norm.weight": (dn.head_v_dim,),
                p + "ssm_out.weight": (dn.value_dim, e),
            })
        else:
            t.update({
                p + "attn_q.weight": (e, 2 * cfg.q_dim),
                p + "attn_k.weight": (e, cfg.kv_dim),
                p + "attn_v.weight": (e, cfg.n_head_kv * cfg.head_dim_v),
                p + "attn_output.weight": (cfg.n_head * cfg.head_dim_v, e),
                p + "attn_q_norm.weight": (cfg.head_dim,),
                p + "attn_k_norm.weight": (cfg.head_dim,),
            })
        t.update(cls.ffn_tensors(cfg, i))
        return t

    @classmethod
    def ffn_tensors(cls, cfg, i):
        p = f"blk.{i}."
        return {p + "ffn_gate.weight": (cfg.n_embd, cfg.n_ff), p + "ffn_up.weight": (cfg.n_embd, cfg.n_ff),
                p + "ffn_down.weight": (cfg.n_ff, cfg.n_embd)}

    @classmethod
    def optional_tensors(cls, cfg):
        return {}

    # -- forward ----------------------------------------------------------------------------------
    def layer(self, i, x, positions, slots, kv):
        cfg, p = self.config, f"blk.{i}."
        h = self.backend.rms_norm(x, p + "attn_norm.weight", cfg.norm_eps)
        if cfg.is_recurrent(i):
            x = x + self.linear_attention(i, h, kv)
        else:
            grid = self.media_step.grid if self.media_step is not None else None  # images on their grid
            x = x + self.gated_attention(i, h, positions, slots, kv, grid)
        return self.feed_forward(i, x)

    def feed_forward(self, i, x):
        p = f"blk.{i}."
        return self.backend.norm_swiglu_residual(x, p + "post_attention_norm.weight", self.config.norm_eps,
                                                 p + "ffn_gate.weight", p + "ffn_up.weight", p + "ffn_down.weight")

    def gated_attention(self, i, h, positions, slots, kv, grid=None):
        """grid: (n, 3) M-RoPE (t, h, w) of the rows, None: each row's position in all three."""
        be, cfg, p = self.backend, self.config, f"blk.{i}."
        n, hd, eps = h.shape[0], cfg.head_dim, cfg.norm_eps
        qg, k, v = be.linear_many([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], h)
        qg = qg.reshape(n, cfg.n_head, 2 * hd)
        q = be.rms_norm(np.ascontiguousarray(qg[:, :, :hd]), p + "attn_q_norm.weight", eps)
        gate = np.ascontiguousarray(qg[:, :, hd:]).reshape(n, -1)
        k = be.rms_norm(k.reshape(n, cfg.n_head_kv, hd), p + "attn_k_norm.weight", eps)
        v = v.reshape(n, cfg.n_head_kv, cfg.head_dim_v)
        q, k = self.mrope(i, q, positions, grid), self.mrope(i, k, positions, grid)
        kv.store(i, slots, k, v)
        out = self.attend(q, kv, i, positions, 1.0 / math.sqrt(hd), 0)
        out = self.dn.sigmoid_mul(out.reshape(n, -1), gate)
        return be.linear(p + "attn_output.weight", out)

    def mrope(self, i: int, x: np.ndarray, positions: np.ndarray, grid: np.ndarray | None = None) -> np.ndarray:
        """ggml_rope_multi (IMROPE): NeoX pairs over rope_dims with the token's position in the
        t/h/w sections (`grid`: each row's own t, h, w); pairs in no section keep their values
        (position 0). A pair turns by its position alone, so each section's pairs are taken from
        a rotation by that section's positions."""
        if len(self._unrotated) or grid is not None:  # pairs set on the host
            x = np.asarray(x)
        half = self.config.rope_dims // 2
        out = self.backend.rope(x, positions if grid is None else grid[:, 0], *self.rope_args(i))
        for c, pairs in enumerate(self._hw_pairs if grid is not None else (), start=1):
            if len(pairs) and (grid[:, c] != grid[:, 0]).any():
                other = self.backend.rope(x, grid[:, c], *self.rope_args(i))
                out[..., pairs] = other[..., pairs]
                out[..., pairs + half] = other[..., pairs + half]
        if len(self._unrotated):
            out[..., self._unrotated] = x[..., self._unrotated]
            out[..., self._unrotated + half] = x[..., self._unrotated + half]
        return out

    def linear_attention(self, i, h, kv):
        be, cfg, dn, p = self.backend, self.config, self.config.delta_net, f"blk.{i}."
        n = h.shape[0]
        qkv, z, b, a = be.linear_many([p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight",
                                       p + "ssm_alpha.weight"], h)
        args = (kv.recurrent, i, qkv, b, a, be.vector(p + "ssm_dt.bias"), be.vector(p + "ssm_a"),
                self.conv_weight(i), cfg.norm_eps, dn)
        on_device = be.recurrence(i, dn.head_k_dim)  # an offloaded layer: the recurrence and its state in VRAM
        out = on_device.run_layer(*args) if on_device is not None else self.delta_net.run_layer(self.dn, *args)
        out = be.rms_norm(out, p + "ssm_norm.weight", cfg.norm_eps)
        out = be.silu_mul(z.reshape(n, dn.n_v_heads, dn.head_v_dim), out)
        return be.linear(p + "ssm_out.weight", out.reshape(n, -1))

    def conv_weight(self, i: int) -> np.ndarray:
        """ssm_conv1d of layer i as the conv kernels read it: float32 (conv_kernel, conv_dim)."""
        w = self._conv_w.get(i)
        if w is None:
            dn = self.config.delta_net
            w = self._conv_w[i] = self.delta_net.conv_weight_t(
                self.backend.vector(f"blk.{i}.ssm_conv1d.weight").reshape(dn.conv_dim, dn.conv_kernel))
        return w


def _unrotated_pairs(n_dims: int, sections: tuple[int, ...]) -> np.ndarray:
    """NeoX pair indices (< n_dims / 2) ggml's interleaved M-RoPE gives the 4th (extra)
    position, which is 0 for text and images alike (libmtmd): those pairs are not rotated."""
    return _section_pairs(n_dims, sections)[3]


def _section_pairs(n_dims: int, sections: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """NeoX pair indices (< n_dims / 2) ggml's interleaved M-RoPE turns by the t, h, w and
    4th (extra) position: pair j's sector j % sum(sections) goes to t, h, w by sector % 3 while
    below 3 x that section's size, else to the 4th."""
    s = tuple(sections) + (0,) * (4 - len(sections))
    total = sum(s)
    out: tuple[list[int], ...] = ([], [], [], [])
    for pair in range(n_dims // 2):
        sector = pair % total if total else 0
        c = sector % 3
        out[c if sector < 3 * s[c] else 3].append(pair)
    return tuple(np.array(p, dtype=np.int64) for p in out)
