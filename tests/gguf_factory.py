"""Write tiny GGUF checkpoints for tests: any supported architecture, random weights, any type.

`gguf` can quantize only the simple types (F16, BF16, Q4_0..Q8_0); for K-quants and IQ4
we write valid random blocks directly (random payload bytes, finite fp16 scales rescaled so
the dequantized weights have a chosen standard deviation).

    path = write_tiny_model(tmp_path / "m.gguf", arch="llama", qtype="Q4_K")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, RopeScalingType, quants

from edgeinfer.tokenizer.bpe import _bytes_to_unicode

T = GGMLQuantizationType

# Byte offsets of the fp16 scale fields (d, and dmin/m where present) inside one block.
_FP16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,),
    T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ1_S: (0,),
}
_FLOAT_TYPES = (T.F32, T.F16, T.BF16)
# Types random_blocks draws row by row from the stream (values, then a per-block quantizer):
# drawing their rows in slices gives the same bytes.
_ROW_SEPARABLE = (*_FLOAT_TYPES, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
_SLICE_ELEMENTS = 1 << 24
_CALIBRATION_BLOCKS = 1 << 16   # blocks random_blocks measures the spread of (tiny files: all of them)


def qtype_of(qtype: str | GGMLQuantizationType) -> GGMLQuantizationType:
    return qtype if isinstance(qtype, GGMLQuantizationType) else T[qtype]


def random_blocks(qtype, n_rows: int, n_cols: int, rng: np.random.Generator,
                  std: float = 0.05, negative_scales: bool = False) -> np.ndarray:
    """Random valid blocks of `qtype` as uint8 (n_rows, row_bytes), dequantizing to ~N(0, std).

    `negative_scales` also flips the sign of random fp16 scale fields of the written-as-bytes
    types, so kernels are exercised with negative d / dmin too.
    """
    qtype = qtype_of(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    assert n_cols % block_size == 0, (qtype.name, n_cols)
    if qtype in _FLOAT_TYPES or qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        values = rng.standard_normal((n_rows, n_cols)).astype(np.float32) * std
        if qtype == T.F32:
            return values.view(np.uint8).reshape(n_rows, n_cols * 4)
        return np.ascontiguousarray(quants.quantize(values, qtype)).view(np.uint8).reshape(n_rows, -1)
    n_blocks = n_rows * n_cols // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype == T.MXFP4:
        # random codes (both zeros and signs included) under E8M0 scale bytes: d = 2^(e-128),
        # the doubled E2M1 table's rms is 5.85, so e around 128 + log2(std / 5.85), spread
        # over 4 binades. Unsigned scales: negative_scales has nothing to flip.
        e = 128 + int(np.round(np.log2(std / 5.85)))
        blocks[:, 0] = np.clip(e + rng.integers(-2, 2, n_blocks), 0, 254)   # 0xFF: not a scale
        return blocks.reshape(n_rows, n_cols // block_size * type_size)
    if qtype == T.IQ1_M:
        return _iq1m_blocks(blocks, rng, std, negative_scales).reshape(n_rows, n_cols // block_size * type_size)
    fields = _FP16_FIELDS[qtype]
    for off in fields:
        scale = rng.uniform(0.5, 1.0, n_blocks).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    # Rescale every fp16 field by one factor: dequantized values scale linearly with it.
    got = quants.dequantize(blocks[:_CALIBRATION_BLOCKS], qtype).std()   # a big tensor: its first blocks
    factor = std / max(float(got), 1e-12)
    for off in fields:
        scale = blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32) * factor
        blocks[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if negative_scales:
        for off in fields:
            flip = rng.random(n_blocks) < 0.5
            blocks[flip, off + 1] ^= 0x80  # the fp16 sign bit
    return blocks.reshape(n_rows, n_cols // block_size * type_size)


def _iq1m_scale(blocks: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """IQ1_M's fp16 block scale, kept in the top nibbles of its four 16-bit scale words
    (bytes 48..56): read it, or write `scale` (float16) there first."""
    words = blocks[:, 48:56].copy().view("<u2")
    if scale is not None:
        bits = scale.astype(np.float16).view("<u2")
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 15) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    bits = sum(((words[:, k] >> 12) & 15) << (4 * k) for k in range(4))
    return bits.astype("<u2").view(np.float16)


def _iq1m_blocks(blocks, rng, std, negative_scales):
    """Random IQ1_M blocks (random indices, shifts and sub-scales) scaled to ~N(0, std)."""
    n = blocks.shape[0]
    _iq1m_scale(blocks, rng.uniform(0.5, 1.0, n).astype(np.float16))
    factor = std / max(float(quants.dequantize(blocks[:_CALIBRATION_BLOCKS], T.IQ1_M).std()), 1e-12)
    scale = _iq1m_scale(blocks).astype(np.float32) * factor
    if negative_scales:
        scale = np.where(rng.random(n) < 0.5, -scale, scale)
    _iq1m_scale(blocks, scale.astype(np.float16))
    return blocks


# -- tiny vocabularies ----------------------------------------------------------------

_WORDS = ("the of and to in is you that it he was for on are as with his they at be this "
          "have from or one had by word but not what all were we when your can said there "
          "use an each which she do how their if will up other about out many then them "
          "these so some her would make like him into time has look two more write go see "
          "number no way could people my than first water been call who oil its now find "
          "hello world def return print import class self none true false code").split()


def spm_vocab() -> dict:
    """A small SentencePiece-style vocabulary: control tokens, 256 byte tokens, word pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581" + w for w in _WORDS] + ["\u2581t", "\u2581a", "he", "in", "er", "on"]
    seen = set()
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(1)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return {
        "model": "llama", "pre": "default", "tokens": tokens, "scores": scores, "types": types,
        "bos": 1, "eos": 2, "unk": 0, "add_bos": True,
    }


def bpe_vocab(pre: str = "llama-bpe") -> dict:
    """A small byte-level BPE vocabulary (GPT-2 style) with merges for a few words."""
    b2u = _bytes_to_unicode()  # GPT-2's byte -> printable character table
    tokens = [b2u[b] for b in range(256)]
    merges = merge_chains(tokens, [w.replace("\u0120", b2u[32]) for w in
                                   ["\u0120the", "\u0120and", "he", "in", "\u0120hello", "\u0120world", "er", "on"]])
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    n_normal = len(tokens)
    tokens += specials
    return {
        "model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges,
        "types": [1] * n_normal + [3] * len(specials),
        "bos": n_normal, "eos": n_normal + 1, "eot": n_normal + 2, "add_bos": True,
    }


def merge_chains(tokens: list[str], words: list[str]) -> list[str]:
    """Left-to-right merges that build each word from its first character on; every new
    piece is appended to `tokens`. Returns the merges in rank order."""
    merges: list[str] = []
    for word in words:
        cur = word[0]
        for ch in word[1:]:
            merged = cur + ch
            if merged not in tokens:
                merges.append(f"{cur} {ch}")
                tokens.append(merged)
            cur = merged
    return merges


def gemma4_vocab() -> dict:
    """A small Gemma 4 vocabulary (`tokenizer.ggml.model = gemma4`): SentencePiece-style BPE
    with U+2581 for spaces, merges over raw UTF-8, `<0xXX>` byte fallback, newline tokens that
    the merges do not build ("\n\n" is taken whole), and add_bos_token false (llama.cpp forces it)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<turn|>"]
    types = [3, 3, 3, 2, 3, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    base = ["\n", "\n\n", "\u2581", "é"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(".,!?")
    tokens += base
    types += [1] * len(base)
    n_before = len(tokens)
    merges = merge_chains(tokens, ["\u2581the", "\u2581and", "he", "in", "\u2581hello", "\u2581world", "er", "on",
                                   "\u2581\u2581", "\u2581café", "world"])
    types += [1] * (len(tokens) - n_before)
    tokens += list(GEMMA4_MARKUP)  # last: the ids before them stay what they were
    types += [3] * len(GEMMA4_MARKUP)
    return {"model": "gemma4", "pre": "gemma4", "tokens": tokens, "types": types, "merges": merges,
            "bos": 2, "eos": 1, "unk": 3, "add_bos": False}


# Gemma 4's chat markup, control tokens as in its vocabulary (the answer's channels and calls,
# the system turn's thinking switch and tool declarations, tool results)
GEMMA4_MARKUP = ("<|turn>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|think|>",
                 "<|tool>", "<tool|>", "<|tool_response>", "<tool_response|>")

# A chat template in Gemma 4's format (written for these tests, after its published prompt
# format): a system turn with the thinking switch and the tool declarations, `<|turn>ROLE`
# turns closed by `<turn|>`, calls as `<|tool_call>call:NAME{...}<tool_call|>` in Gemma's value
# notation, and each call's results (the role "tool" messages after it) inside the model's
# turn. Without thinking, the generation prompt holds an empty thought.
GEMMA4_CHAT_TEMPLATE = """{{- bos_token -}}
{%- macro value(v) -%}
{%- if v is string -%}<|"|>{{ v }}<|"|>
{%- elif v is boolean -%}{{ 'true' if v else 'false' }}
{%- elif v is none -%}null
{%- elif v is mapping -%}{ {%- for k, x in v | dictsort -%}{{ k }}:{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%} }
{%- elif v is iterable -%}[{%- for x in v -%}{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%}]
{%- else -%}{{ v }}
{%- endif -%}
{%- endmacro -%}
{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}
{%- set turns = messages[1:] if system is not none else messages -%}
{%- if enable_thinking or tools or system is not none -%}
{{- '<|turn>system\n' -}}
{%- if enable_thinking %}{{ '<|think|>\n' }}{% endif -%}
{%- if system is not none %}{{ system | trim }}{% endif -%}
{%- for tool in tools or [] -%}
{{- '<|tool>declaration:' + tool['function']['name'] + '{description:<|"|>' + (tool['function']['description'] or '') + '<|"|>}<tool|>' -}}
{%- endfor -%}
{{- '<turn|>\n' -}}
{%- endif -%}
{#- OpenAI Chat Completions: the role "tool" messages after a call are its results -#}
{%- for m in turns -%}
{%- if m['role'] == 'assistant' -%}
{{- '<|turn>model\n' -}}
{%- for call in m['tool_calls'] or [] -%}
{{- '<|tool_call>call:' + call['function']['name'] + value(call['function']['arguments']) + '<tool_call|>' -}}
{%- endfor -%}
{%- set ns = namespace(open=true) -%}
{%- for later in turns[loop.index0 + 1:] -%}
{%- if later['role'] != 'tool' -%}{%- set ns.open = false -%}{%- endif -%}
{%- if ns.open and m['tool_calls'] -%}
{{- '<|tool_response>response:' + (later['name'] or 'tool') + '{value:' + value(later['content']) + '}<tool_response|>' -}}
{%- endif -%}
{%- endfor -%}
{{- (m['content'] or '') + '<turn|>\n' -}}
{%- elif m['role'] != 'tool' -%}
{{- '<|turn>' + m['role'] + '\n' + m['content'] + '<turn|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|turn>model\n' -}}
{%- if not enable_thinking %}{{ '<|channel>thought\n<channel|>' }}{% endif -%}
{%- endif -%}"""

# The same format as older Gemma 4 files have it: results only as the assistant message's
# `tool_responses` (what edgeinfer.prompt.gemma4_format.template_messages folds them into), and
# no generation prompt after a model turn with results (the answer continues that turn).
GEMMA4_OLD_CHAT_TEMPLATE = """{{- bos_token -}}
{%- if tools -%}
{{- '<|turn>system\n' -}}
{%- for tool in tools %}{{ '<|tool>declaration:' + tool['function']['name'] + '{}<tool|>' }}{% endfor -%}
{{- '<turn|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m['role'] == 'assistant' -%}
{{- '<|turn>model\n' -}}
{%- for call in m['tool_calls'] or [] -%}
{{- '<|tool_call>call:' + call['function']['name'] + '{}<tool_call|>' -}}
{%- endfor -%}
{%- for r in m['tool_responses'] or [] -%}
{{- '<|tool_response>response:' + r['name'] + '{value:' + (r['response'] | string) + '}<tool_response|>' -}}
{%- endfor -%}
{{- (m['content'] or '') + '<turn|>\n' -}}
{%- else -%}
{{- '<|turn>' + m['role'] + '\n' + m['content'] + '<turn|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not (messages and messages[-1]['role'] == 'assistant') -%}
{{- '<|turn>model\n' -}}
{%- endif -%}"""


# -- model shapes -----------------------------------------------------------------------

@dataclass
class TinyShape:
    n_embd: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 512
    n_ctx: int = 512
    extra: dict = field(default_factory=dict)
    # mixtures of experts (qwen3moe): experts per layer, chosen per token, rows of each
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 128
    # gated DeltaNet layers (qwen35, qwen35moe): heads of the state, their size, conv taps;
    # every full_attention_interval-th layer is attention (the rest linear attention)
    ssm_k_heads: int = 2
    ssm_v_heads: int = 4
    ssm_state: int = 32
    ssm_conv: int = 4
    full_attention_interval: int = 2
    rope_dims: int = 16  # qwen35: rotated dims of a head (Qwen3.5 rotates a quarter)
    rope_sections: tuple = (3, 1, 2, 0)  # qwen35's M-RoPE sections; pair 4 falls in none
    n_ff_shexp: int = 128  # qwen35moe's shared expert
    nextn: int = 0  # qwen35: multi-token-prediction blocks after the n_layer trunk (block_count counts them)
    # gemma4: sliding layers' head size, the per-layer sliding flags (() = every 4th layer is
    # global), the last layers reusing earlier K/V, per-layer embedding width (0 = none),
    # per-layer FFN rows (() = n_ff), a mixture of experts on every layer, the logit cap, and
    # whether global layers that keep K/V leave out attn_v (V = K); per-layer K/V head counts
    # (a `head_count_kv` array: 26B-A4B, 31B; () = n_head_kv everywhere)
    head_dim_swa: int = 32
    swa_pattern: tuple = ()
    shared_kv_layers: int = 0
    n_embd_per_layer: int = 0
    n_ff_layers: tuple = ()
    gemma4_moe: bool = False
    softcap: float = 30.0
    global_v_is_k: bool = True
    n_head_kv_layers: tuple = ()

    def n_head_kv_of(self, i: int) -> int:
        return self.n_head_kv_layers[i] if self.n_head_kv_layers else self.n_head_kv


ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gpt-oss", "qwen35", "qwen35moe", "gemma4")
MOE_ARCHITECTURES = ("qwen3moe", "gpt-oss")
HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe")  # gated DeltaNet + gated attention layers


def _qwen35_layer_tensors(arch: str, s: TinyShape, i: int) -> dict:
    """qwen35 / qwen35moe blocks as llama.cpp's qwen35.cpp loads them."""
    p, e = f"blk.{i}.", s.n_embd
    t: dict = {p + "attn_norm.weight": (e,), p + "post_attention_norm.weight": (e,)}
    if i >= s.n_layer:  # an MTP block: gated attention and the FFN, plus its nextn tensors
        t.update({p + "nextn.eh_proj.weight": (2 * e, e), p + "nextn.enorm.weight": (e,),
                  p + "nextn.hnorm.weight": (e,), p + "nextn.shared_head_norm.weight": (e,)})
    if i < s.n_layer and (i + 1) % s.full_attention_interval:  # linear attention (gated DeltaNet)
        key_dim, value_dim = s.ssm_k_heads * s.ssm_state, s.ssm_v_heads * s.ssm_state
        conv_dim = 2 * key_dim + value_dim
        t.update({p + "attn_qkv.weight": (e, conv_dim), p + "attn_gate.weight": (e, value_dim),
                  p + "ssm_conv1d.weight": (s.ssm_conv, conv_dim), p + "ssm_dt.bias": (s.ssm_v_heads,),
                  p + "ssm_a": (s.ssm_v_heads,), p + "ssm_beta.weight": (e, s.ssm_v_heads),
                  p + "ssm_alpha.weight": (e, s.ssm_v_heads), p + "ssm_norm.weight": (s.ssm_state,),
                  p + "ssm_out.weight": (value_dim, e)})
    else:  # gated attention: q and its gate from attn_q
        q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        t.update({p + "attn_q.weight": (e, 2 * q_dim), p + "attn_k.weight": (e, kv_dim),
                  p + "attn_v.weight": (e, kv_dim), p + "attn_output.weight": (q_dim, e),
                  p + "attn_q_norm.weight": (s.head_dim,), p + "attn_k_norm.weight": (s.head_dim,)})
    if arch == "qwen35moe":
        t.update({p + "ffn_gate_inp.weight": (e, s.n_expert),
                  p + "ffn_gate_exps.weight": (e, s.n_ff_exp, s.n_expert),
                  p + "ffn_up_exps.weight": (e, s.n_ff_exp, s.n_expert),
                  p + "ffn_down_exps.weight": (s.n_ff_exp, e, s.n_expert),
                  p + "ffn_gate_inp_shexp.weight": (e,), p + "ffn_gate_shexp.weight": (e, s.n_ff_shexp),
                  p + "ffn_up_shexp.weight": (e, s.n_ff_shexp), p + "ffn_down_shexp.weight": (s.n_ff_shexp, e)})
    else:
        t.update({p + "ffn_gate.weight": (e, s.n_ff), p + "ffn_up.weight": (e, s.n_ff),
                  p + "ffn_down.weight": (s.n_ff, e)})
    return t


def gemma4_swa(s: TinyShape) -> list[bool]:
    """gemma4's sliding flags: the shape's, else every extra["swa_period"]-th (4th) layer global."""
    period = s.extra.get("swa_period", 4)
    return list(s.swa_pattern) if s.swa_pattern else [(i + 1) % period != 0 for i in range(s.n_layer)]


def _gemma4_layer_tensors(s: TinyShape, i: int) -> dict:
    """gemma4 blocks as llama.cpp's gemma4.cpp loads them."""
    p, e = f"blk.{i}.", s.n_embd
    swa = gemma4_swa(s)[i]
    hd = s.head_dim_swa if swa else s.head_dim
    kv = s.n_head_kv_of(i) * hd
    ff = s.n_ff_layers[i] if s.n_ff_layers else s.n_ff
    t: dict = {p + "attn_norm.weight": (e,), p + "attn_q.weight": (e, s.n_head * hd),
               p + "attn_q_norm.weight": (hd,), p + "attn_output.weight": (s.n_head * hd, e),
               p + "post_attention_norm.weight": (e,), p + "layer_output_scale.weight": (1,)}
    if i < s.n_layer - s.shared_kv_layers:  # a layer keeping K/V
        t.update({p + "attn_k.weight": (e, kv), p + "attn_k_norm.weight": (hd,)})
        if swa or not s.global_v_is_k:
            t[p + "attn_v.weight"] = (e, kv)
    t.update({p + "ffn_norm.weight": (e,), p + "ffn_gate.weight": (e, ff), p + "ffn_up.weight": (e, ff),
              p + "ffn_down.weight": (ff, e), p + "post_ffw_norm.weight": (e,)})
    if s.gemma4_moe:
        t.update({p + "ffn_gate_inp.weight": (e, s.n_expert), p + "ffn_gate_inp.scale": (e,),
                  p + "pre_ffw_norm_2.weight": (e,), p + "post_ffw_norm_1.weight": (e,),
                  p + "post_ffw_norm_2.weight": (e,),
                  p + "ffn_gate_exps.weight": (e, s.n_ff_exp, s.n_expert),
                  p + "ffn_up_exps.weight": (e, s.n_ff_exp, s.n_expert),
                  p + "ffn_down_exps.weight": (s.n_ff_exp, e, s.n_expert),
                  p + "ffn_down_exps.scale": (s.n_expert,)})
    if s.n_embd_per_layer:
        t.update({p + "inp_gate.weight": (e, s.n_embd_per_layer), p + "proj.weight": (s.n_embd_per_layer, e),
                  p + "post_norm.weight": (e,)})
    return t


def _layer_tensors(arch: str, s: TinyShape, i: int) -> dict[str, tuple[int, int] | tuple[int]]:
    """GGUF tensor name -> GGML shape (row length first) for one block."""
    if arch in HYBRID_ARCHITECTURES:
        return _qwen35_layer_tensors(arch, s, i)
    if arch == "gemma4":
        return _gemma4_layer_tensors(s, i)
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    p = f"blk.{i}."
    t: dict = {
        p + "attn_norm.weight": (s.n_embd,),
        p + "attn_q.weight": (s.n_embd, q_dim),
        p + "attn_k.weight": (s.n_embd, kv_dim),
        p + "attn_v.weight": (s.n_embd, kv_dim),
        p + "attn_output.weight": (q_dim, s.n_embd),
        p + "ffn_norm.weight": (s.n_embd,),
        p + "ffn_gate.weight": (s.n_embd, s.n_ff),
        p + "ffn_up.weight": (s.n_embd, s.n_ff),
        p + "ffn_down.weight": (s.n_ff, s.n_embd),
    }
    if arch == "qwen2":
        t.update({p + "attn_q.bias": (q_dim,), p + "attn_k.bias": (kv_dim,),
                  p + "attn_v.bias": (kv_dim,)})
    if arch in ("qwen3", "gemma3", "qwen3moe"):
        t.update({p + "attn_q_norm.weight": (s.head_dim,), p + "attn_k_norm.weight": (s.head_dim,)})
    if arch in MOE_ARCHITECTURES:  # the dense FFN becomes a router and 3-D expert tensors
        for name in ("ffn_gate", "ffn_up", "ffn_down"):
            del t[p + name + ".weight"]
        t.update({p + "ffn_gate_inp.weight": (s.n_embd, s.n_expert),
                  p + "ffn_gate_exps.weight": (s.n_embd, s.n_ff_exp, s.n_expert),
                  p + "ffn_up_exps.weight": (s.n_embd, s.n_ff_exp, s.n_expert),
                  p + "ffn_down_exps.weight": (s.n_ff_exp, s.n_embd, s.n_expert)})
    if arch == "gpt-oss":  # biases nearly everywhere, attention sinks, the FFN norm renamed
        del t[p + "ffn_norm.weight"]
        t.update({p + "post_attention_norm.weight": (s.n_embd,), p + "attn_sinks.weight": (s.n_head,),
                  p + "attn_q.bias": (q_dim,), p + "attn_k.bias": (kv_dim,), p + "attn_v.bias": (kv_dim,),
                  p + "attn_output.bias": (s.n_embd,), p + "ffn_gate_inp.bias": (s.n_expert,),
                  p + "ffn_gate_exps.bias": (s.n_ff_exp, s.n_expert),
                  p + "ffn_up_exps.bias": (s.n_ff_exp, s.n_expert),
                  p + "ffn_down_exps.bias": (s.n_embd, s.n_expert)})
    if arch == "gemma3":
        t.update({p + "post_attention_norm.weight": (s.n_embd,),
                  p + "post_ffw_norm.weight": (s.n_embd,)})
    return t


def write_tiny_model(path: str | Path, arch: str = "llama", qtype: str = "F32", *,
                     shape: TinyShape | None = None, vocab: dict | None = None, seed: int = 0,
                     tie_embeddings: bool | None = None, chat_template: str | None = None,
                     extra_metadata: dict | None = None, omit_tensors: tuple[str, ...] = (),
                     embd_qtype: str | None = None,
                     shape_overrides: dict[str, tuple[int, ...]] | None = None,
                     tensor_qtypes: dict[str, str] | None = None) -> Path:
    """Write a random-weight GGUF of `arch`; matrices in `qtype`, norms and biases in F32.
    `tensor_qtypes` maps a tensor name's ending ("attn_q.weight") to its own type, as mixed
    files (Q4_K_M, Unsloth's UD quants) hold them."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown test architecture {arch}")
    s = shape or TinyShape()
    vocab = vocab or spm_vocab()
    rng = np.random.default_rng(seed)
    qt = qtype_of(qtype)
    path = Path(path)
    n_vocab = len(vocab["tokens"])
    tie = (arch in ("gemma3", "gemma4")) if tie_embeddings is None else tie_embeddings

    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{qt.name}")
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer + s.nextn)
    if arch == "gemma4" and s.n_ff_layers:
        w.add_array(f"{arch}.feed_forward_length", [int(f) for f in s.n_ff_layers])
    elif arch != "qwen35moe":  # llama.cpp's qwen35moe files have no feed_forward_length
        w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    if s.n_head_kv_layers:  # one per layer, as llama.cpp's get_key_or_arr reads it
        w.add_array(f"{arch}.attention.head_count_kv", [int(h) for h in s.n_head_kv_layers])
    else:
        w.add_head_count_kv(s.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6 if arch in ("gemma3", "gemma4") else 1e-5)
    w.add_rope_freq_base({"llama": 500_000.0, "gpt-oss": 150_000.0}.get(arch, 1_000_000.0))
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(s.head_dim)
    if arch == "gemma3":
        w.add_sliding_window(s.extra.get("sliding_window", 16))
    if arch == "gemma4":  # E4B's kinds of keys, at a tiny size
        w.add_sliding_window(s.extra.get("sliding_window", 16))
        w.add_array(f"{arch}.attention.sliding_window_pattern", gemma4_swa(s))
        w.add_uint32(f"{arch}.attention.key_length_swa", s.head_dim_swa)
        w.add_uint32(f"{arch}.attention.value_length_swa", s.head_dim_swa)
        w.add_rope_dimension_count(s.head_dim)
        w.add_uint32(f"{arch}.rope.dimension_count_swa", s.head_dim_swa)
        w.add_float32(f"{arch}.rope.freq_base_swa", 10_000.0)
        w.add_uint32(f"{arch}.embedding_length_per_layer_input", s.n_embd_per_layer)
        if s.shared_kv_layers:
            w.add_uint32(f"{arch}.attention.shared_kv_layers", s.shared_kv_layers)
        w.add_float32(f"{arch}.final_logit_softcapping", s.softcap)  # 0: off (absent: llama.cpp caps at 30)
        if s.gemma4_moe:
            w.add_expert_count(s.n_expert)
            w.add_expert_used_count(s.n_expert_used)
            w.add_expert_feed_forward_length(s.n_ff_exp)
    if arch == "gpt-oss":  # gpt-oss-20b's settings, its window scaled to the tiny context
        w.add_sliding_window(s.extra.get("sliding_window", 16))
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.extra.get("rope_factor", 32.0))
        w.add_rope_scaling_orig_ctx_len(s.extra.get("rope_ctx_orig", 64))
    if arch in HYBRID_ARCHITECTURES:
        w.add_rope_dimension_count(s.rope_dims)
        w.add_array(f"{arch}.rope.dimension_sections", list(s.rope_sections))
        w.add_uint32(f"{arch}.full_attention_interval", s.full_attention_interval)
        w.add_uint32(f"{arch}.ssm.conv_kernel", s.ssm_conv)
        w.add_uint32(f"{arch}.ssm.state_size", s.ssm_state)
        w.add_uint32(f"{arch}.ssm.group_count", s.ssm_k_heads)
        w.add_uint32(f"{arch}.ssm.time_step_rank", s.ssm_v_heads)
        w.add_uint32(f"{arch}.ssm.inner_size", s.ssm_v_heads * s.ssm_state)
        if s.nextn:
            w.add_uint32(f"{arch}.nextn_predict_layers", s.nextn)
    if arch == "qwen35moe":
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", s.n_ff_shexp)
    if arch in MOE_ARCHITECTURES:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_file_type(int(qt) if qt != T.F32 else 0)

    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre(vocab.get("pre", "default"))
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    if "unk" in vocab:
        w.add_unk_token_id(vocab["unk"])
    if "eot" in vocab:
        w.add_eot_token_id(vocab["eot"])
    w.add_add_bos_token(vocab.get("add_bos", True))
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (extra_metadata or {}).items():
        for kv in w.kv_data:  # a key given here replaces the one written above (None: drops it)
            kv.pop(key, None)
        if value is not None:
            _add_metadata(w, key, value)

    tensors: dict = {"token_embd.weight": (s.n_embd, n_vocab), "output_norm.weight": (s.n_embd,)}
    if not tie:
        tensors["output.weight"] = (s.n_embd, n_vocab)
    if arch == "gemma4":
        if s.n_embd_per_layer:
            tensors["per_layer_token_embd.weight"] = (s.n_embd_per_layer * s.n_layer, n_vocab)
            tensors["per_layer_model_proj.weight"] = (s.n_embd, s.n_embd_per_layer * s.n_layer)
            tensors["per_layer_proj_norm.weight"] = (s.n_embd_per_layer,)
        if not all(gemma4_swa(s)):
            tensors["rope_freqs.weight"] = (s.head_dim // 2,)
    for i in range(s.n_layer + s.nextn):
        tensors.update(_layer_tensors(arch, s, i))
    tensors.update(shape_overrides or {})  # hostile files: a tensor of another shape than the metadata says

    # Tensor infos first, then each tensor generated and written in turn (in the same order,
    # so from the same random stream): only one tensor is in memory at a time, and a
    # billions-of-weights F16 file (benchmarks/shaped_model.py) fits in RAM.
    plan = []
    for name, gshape in tensors.items():
        if name in omit_tensors:
            continue
        if len(gshape) == 1:  # norms and biases stay F32, as converters write them
            plan.append((name, T.F32, gshape))
            w.add_tensor_info(name, gshape, np.dtype(np.float32), gshape[0] * 4)
            continue
        n_cols, n_rows, outer = gshape[0], gshape[1], gshape[2:]  # outer: (n_expert,) of expert tensors
        tq = qtype_of(embd_qtype) if (embd_qtype and name == "token_embd.weight") else qt
        for ending, mixed in (tensor_qtypes or {}).items():
            if name.endswith(ending):
                tq = qtype_of(mixed)
        if name.endswith(("ffn_gate_inp.weight", ".bias", "ssm_conv1d.weight")):
            tq = T.F32  # routers, (per-expert) biases and conv kernels stay F32, as converters write them
        if n_cols % GGML_QUANT_SIZES[tq][0]:
            tq = T.F16
        plan.append((name, tq, gshape))
        block_size, type_size = GGML_QUANT_SIZES[tq]
        row_bytes = n_cols // block_size * type_size
        n_all = n_rows * int(np.prod(outer, dtype=np.int64))
        if tq == T.F32:
            w.add_tensor_info(name, (*outer[::-1], n_rows, n_cols), np.dtype(np.float32), n_all * row_bytes)
        else:
            w.add_tensor_info(name, (*outer[::-1], n_rows, row_bytes), np.dtype(np.uint8), n_all * row_bytes,
                              raw_dtype=tq)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, tq, gshape in plan:
        if len(gshape) == 1:
            data = rng.standard_normal(gshape).astype(np.float32) * 0.1
            if name.endswith("attn_sinks.weight"):
                data *= 30.0  # gpt-oss's sinks are logits of a few units: some heads lean on them
            if name.endswith(".ssm_a"):  # stored as -exp(A_log): a negative decay rate per head
                data = -np.exp(data * 5.0).astype(np.float32)
            if name.endswith("norm.weight"):
                # llama-style norms multiply by w; gemma's by (1 + w), baked in at conversion
                data += 1.0
            if arch == "gemma4" and name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
                data *= 0.3  # attention is unscaled (1.0): smaller Q/K keep a random model's softmax soft
            if name.endswith((".scale", "layer_output_scale.weight")):  # gemma4's scales: around 1
                data = (np.abs(data) + 0.75).astype(np.float32)
            if name == "rope_freqs.weight":  # gemma4's proportional RoPE: a quarter rotates, the rest not
                data = np.where(np.arange(gshape[0]) < gshape[0] // 4, 1.0, 1e30).astype(np.float32)
            w.write_tensor_data(data)
            continue
        n_cols, n_rows = gshape[0], gshape[1] * int(np.prod(gshape[2:], dtype=np.int64))
        if tq in _ROW_SEPARABLE:
            # rows drawn in slices: the same random stream as one call, without a
            # float64 copy of a whole 128k-vocabulary matrix in memory
            step = max(1, _SLICE_ELEMENTS // n_cols)
            blocks = np.concatenate([random_blocks(tq, min(step, n_rows - r), n_cols, rng, std=0.08)
                                     for r in range(0, n_rows, step)])
        else:
            blocks = random_blocks(tq, n_rows, n_cols, rng, std=0.08)
        w.write_tensor_data(blocks)
        del blocks
    w.close()
    return path


@dataclass(frozen=True)
class Typed:
    """A metadata value written with an explicit GGUF type (int32 -5, uint64 2**40, ...)."""

    vtype: GGUFValueType
    value: object
    sub_type: GGUFValueType | None = None


def replace_bytes(path: str | Path, old: bytes, new: bytes) -> None:
    """Overwrite every `old` in the file with `new` (same length): text no writer would emit,
    such as strings that are not UTF-8."""
    assert len(old) == len(new), (old, new)
    path = Path(path)
    data = path.read_bytes()
    assert old in data, old
    path.write_bytes(data.replace(old, new))


def _add_metadata(w: GGUFWriter, key: str, value) -> None:
    if isinstance(value, Typed):
        w.add_key_value(key, value.value, value.vtype, value.sub_type)
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


GEMMA4_SHAPE = dict(n_layer=8, shared_kv_layers=4, n_embd_per_layer=32)


def gemma4_file(tmp_path, qtype="Q8_0", moe=False, extra=None, name=None, vocab=None, chat_template=None,
                **shape) -> str:
    """A tiny Gemma 4 with everything it adds: 8 layers (every 4th global, head sizes 32 and
    64), the last 4 sharing K/V, per-layer embeddings, and (dense) the shared layers' wider
    MLP, as E2B's; `shape` overrides TinyShape fields."""
    s = {**GEMMA4_SHAPE, "gemma4_moe": moe, **shape}
    if not moe and "n_ff_layers" not in s:
        s["n_ff_layers"] = (256,) * 4 + (512,) * 4
    path = Path(tmp_path) / (name or f"gemma4-{'moe' if moe else 'dense'}-{qtype}.gguf")
    return str(write_tiny_model(path, "gemma4", qtype, vocab=vocab or spm_vocab(), shape=TinyShape(**s),
                                extra_metadata=extra, chat_template=chat_template))


# 26B-A4B, 31B and 12B at a tiny size: no per-layer embeddings or shared K/V, every third layer
# global with fewer K/V heads than the sliding ones (26B-A4B 8 -> 2, 31B 16 -> 4, 12B 8 -> 1)
# and V = K there; 26B-A4B is the MoE one
GEMMA4_SIZES = {
    "26B-A4B": dict(n_head_kv_layers=(4, 4, 2) * 2, gemma4_moe=True),
    "31B": dict(n_head_kv_layers=(4, 4, 1) * 2),
}


def gemma4_sized_file(tmp_path, size: str, qtype="Q8_0", name=None, **shape) -> str:
    """A tiny Gemma 4 of `size`'s kind (GEMMA4_SIZES): 6 layers, 8 Q heads, per-layer K/V heads."""
    s = dict(n_layer=6, n_head=8, n_head_kv=4, swa_pattern=(True, True, False) * 2, shared_kv_layers=0,
             n_embd_per_layer=0, n_ff_layers=(), **GEMMA4_SIZES[size])
    s.update(shape)
    moe = s.pop("gemma4_moe", False)
    return gemma4_file(tmp_path, qtype, moe, name=name or f"gemma4-{size}-{qtype}.gguf", **s)
