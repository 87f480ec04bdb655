"""Tiny random-weight embedding models for tests: `bert` and `nomic-bert` encoders with a
WordPiece vocabulary, and decoder families with a pooling type (through gguf_factory).

    path = write_tiny_encoder(tmp_path / "e.gguf", arch="nomic-bert", pooling=1)
    path = write_tiny_reranker(tmp_path / "r.gguf")   # a bert cross-encoder: pooling rank, `cls` head
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from gguf_factory import TinyShape, qtype_of, random_blocks

ENCODERS = ("bert", "nomic-bert")

_WORDS = ("the of and to in is you that it was for on are as with they at be this have from "
          "or one had by word but not what all were we when your can said there use each which "
          "hello world def return print import class self none true false code embed search "
          "un want ##ed ##ing ##s ##er ##ly ##able runn ##ning affable caf").split()


def wpm_vocab() -> dict:
    """A small WordPiece vocabulary as the converter writes it: word-initial pieces carry a
    U+2581 prefix, `##` continuation pieces lose theirs; [CLS]/[SEP] are control tokens."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,!?'-()[]{}:;\"=+*/_<>#")
    pieces: list[str] = []
    for c in chars:
        pieces += ["\u2581" + c, c]
    for w in _WORDS:
        pieces.append(w[2:] if w.startswith("##") else "\u2581" + w)
    pieces += ["\u2581caf\u00e9", "\u2581\u4e2d", "\u2581\u6587", "\u2581e\u0301"]
    tokens = list(specials)
    for p in pieces:
        if p not in tokens:
            tokens.append(p)
    return {"tokens": tokens, "types": [3, 2, 3, 3, 3] + [1] * (len(tokens) - 5),
            "pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def write_tiny_encoder(path: str | Path, arch: str = "bert", qtype: str = "F32", *,
                       shape: TinyShape | None = None, pooling: int | None = 1, seed: int = 0,
                       fused_qkv: bool | None = None, n_ctx_train: int = 128, classifier: bool = False,
                       n_cls_out: int = 1, add_eos: bool = False, rerank_template: str | None = None,
                       vocab: dict | None = None) -> Path:
    """A random-weight `bert` or `nomic-bert` GGUF; matrices in `qtype`, norms and biases F32.

    `classifier` adds a cross-encoder's head as llama.cpp loads it: `cls.weight`/`cls.bias`
    (n_embd -> n_embd, tanh) and `cls.output.weight`/`cls.output.bias` (n_embd -> n_cls_out;
    more than one output is declared by `{arch}.classifier.output_labels`).

    `vocab`: the WordPiece one of `wpm_vocab` unless given; one with a "write" entry (as
    `ugm_factory.ugm_vocab`: XLM-R's unigram SentencePiece) writes its own tokenizer keys."""
    if arch not in ENCODERS:
        raise ValueError(f"unknown encoder architecture {arch}")
    s = shape or TinyShape(n_embd=64, n_layer=2, n_head=4, n_head_kv=4, head_dim=16, n_ff=128)
    fused = (arch == "nomic-bert") if fused_qkv is None else fused_qkv
    vocab = vocab or wpm_vocab()
    rng = np.random.default_rng(seed)
    qt = qtype_of(qtype)
    e, n_vocab = s.n_embd, len(vocab["tokens"])

    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(e)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    if pooling is not None:
        w.add_uint32(f"{arch}.pooling_type", pooling)
    if arch == "nomic-bert":
        w.add_rope_freq_base(1000.0)
    w.add_file_type(0)
    w.add_token_type_count(2)
    if "write" in vocab:
        vocab["write"](w)
    else:
        w.add_tokenizer_model("bert")
        w.add_token_list(vocab["tokens"])
        w.add_token_types(vocab["types"])
        w.add_bos_token_id(vocab["cls"])
        w.add_sep_token_id(vocab["sep"])
        w.add_unk_token_id(vocab["unk"])
        w.add_pad_token_id(vocab["pad"])
        w.add_mask_token_id(vocab["mask"])
        w.add_add_bos_token(True)
        w.add_add_eos_token(add_eos)
    if n_cls_out > 1:
        w.add_array(f"{arch}.classifier.output_labels", [f"LABEL_{i}" for i in range(n_cls_out)])
    if rerank_template is not None:
        w.add_string("tokenizer.chat_template.rerank", rerank_template)

    t: dict = {"token_embd.weight": (e, n_vocab), "token_types.weight": (e, 2),
               "token_embd_norm.weight": (e,), "token_embd_norm.bias": (e,)}
    if arch == "bert":
        t["position_embd.weight"] = (e, n_ctx_train)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        if fused:
            t[p + "attn_qkv.weight"] = (e, 3 * e)
            if arch == "bert":
                t[p + "attn_qkv.bias"] = (3 * e,)
        else:
            for x in "qkv":
                t[p + f"attn_{x}.weight"], t[p + f"attn_{x}.bias"] = (e, e), (e,)
        t[p + "attn_output.weight"] = (e, e)
        t[p + "attn_output_norm.weight"], t[p + "attn_output_norm.bias"] = (e,), (e,)
        t[p + "ffn_up.weight"], t[p + "ffn_down.weight"] = (e, s.n_ff), (s.n_ff, e)
        if arch == "bert":
            t[p + "attn_output.bias"], t[p + "ffn_up.bias"], t[p + "ffn_down.bias"] = (e,), (s.n_ff,), (e,)
        else:
            t[p + "ffn_gate.weight"] = (e, s.n_ff)
        t[p + "layer_output_norm.weight"], t[p + "layer_output_norm.bias"] = (e,), (e,)
    if classifier:
        t.update({"cls.weight": (e, e), "cls.bias": (e,), "cls.output.weight": (e, n_cls_out),
                  "cls.output.bias": (n_cls_out,)})

    for name, gshape in t.items():
        if len(gshape) == 1:
            data = rng.standard_normal(gshape).astype(np.float32) * 0.1
            if name.endswith("norm.weight"):
                data += 1.0
            w.add_tensor(name, data)
            continue
        n_cols, n_rows = gshape
        std = 0.5 if name in ("token_embd.weight", "position_embd.weight", "token_types.weight") else 0.15
        blocks = random_blocks(qt, n_rows, n_cols, rng, std=std)
        if qt.name == "F32":
            w.add_tensor(name, blocks.view(np.float32).reshape(n_rows, n_cols))
        else:
            w.add_tensor(name, blocks, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_tiny_reranker(path: str | Path, **kw) -> Path:
    """A tiny bge-reranker-shaped cross-encoder: `bert`, pooling type rank (4), the classifier
    head, and EOS added (the vocabulary has none: llama.cpp closes each part with [SEP], so
    the pair reads [CLS] query [SEP] [SEP] document [SEP] as XLM-R's does)."""
    kw = {"pooling": 4, "classifier": True, "add_eos": True, "seed": 3, **kw}
    return write_tiny_encoder(path, "bert", **kw)
