"""Embeddings: texts or token ids -> pooled, normalised vectors, as llama.cpp computes them.

Pooling follows the file's `{arch}.pooling_type` (llama.cpp's enum: 0 none, 1 mean, 2 cls,
3 last, 4 rank) over the final hidden state: an encoder's last block (`bert`, `nomic-bert`),
a decoder's normed output (`t_embd`). A file that declares no pooling (a generation model)
takes its last token, the state Ollama returns for such models. Vectors are L2-normalised
by default (llama-server's `embd_normalize` 2; `normalize_vector` has its other modes).

Rerankers (`rerank`): a cross-encoder whose file declares rank pooling scores each query +
document pair, formatted as llama-server formats it, by its classifier over the [CLS] state.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from edgeinfer.errors import ContextOverflowError, EdgeInferError
from edgeinfer.metadata import meta_int

if TYPE_CHECKING:
    from edgeinfer.engine import Engine
    from edgeinfer.models.config import ModelConfig
    from edgeinfer.session_manager import SessionManager
    from edgeinfer.tokenizer import Tokenizer


class LoadedModel(Protocol):
    """What embedding needs of a loaded model (edgeinfer.api.Model is one; a protocol here
    so that this module does not import the api that imports it)."""

    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    engine: Engine
    sessions: SessionManager  # its lock: one forward pass at a time

    @property
    def n_ctx(self) -> int: ...


POOLING_NONE, POOLING_MEAN, POOLING_CLS, POOLING_LAST, POOLING_RANK = range(5)
POOLING_NAMES = {POOLING_NONE: "none", POOLING_MEAN: "mean", POOLING_CLS: "cls",
                 POOLING_LAST: "last", POOLING_RANK: "rank"}
BATCH_TOKENS = 512  # encoder tokens per forward pass: several short inputs share one


@dataclass
class Embeddings:
    vectors: list[list[float]]
    token_counts: list[int]  # tokens each input was embedded from (after truncation)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)


def pooling_of(model: "LoadedModel", override: int | None = None) -> int:
    """The pooling this model's embeddings use (see the module docstring); `override` is
    llama.cpp's --pooling (POOLING_NONE: one vector per token)."""
    md = model.engine.model_file.gguf.metadata
    declared = meta_int(md, f"{model.config.arch}.pooling_type", 0, 4, None) if override is None else override
    if override == POOLING_NONE:
        return POOLING_NONE
    if declared == POOLING_RANK:
        raise EdgeInferError(f"{model.name}: rank pooling (a reranker) is not supported for embeddings")
    if declared in (None, POOLING_NONE):
        return POOLING_LAST if model.engine.model.GENERATES else POOLING_MEAN
    return declared


def normalize_vector(v: np.ndarray, mode: int = 2) -> np.ndarray:
    """llama.cpp's common_embd_normalize: -1 none, 0 max-abs scaled to int16, 1 taxicab,
    2 euclidean, p > 2 the p-norm."""
    v = np.asarray(v, np.float32)
    if mode < 0:
        return v
    if mode == 0:
        total = float(np.abs(v).max(initial=0.0)) / 32760.0
    elif mode == 2:
        total = float(np.sqrt(np.sum(np.square(v.astype(np.float64)))))
    else:
        total = float(np.sum(np.abs(v.astype(np.float64)) ** mode) ** (1.0 / mode))
    return (v * np.float32(1.0 / total if total > 0 else 0.0)).astype(np.float32)


def embed(model: "LoadedModel", inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *,
          truncate: bool = False, dimensions: int | None = None, normalize: int = 2,
          cancel: threading.Event | None = None, pooling: int | None = None) -> Embeddings:
    """Embed one input or a list of them: texts, one list of token ids, or lists of ids.

    `pooling` overrides the file's (llama.cpp's --pooling); POOLING_NONE gives each input a
    list of per-token vectors, not normalised (as llama-server sends them).

    A longer input than the model takes is cut to its first tokens (keeping a final [SEP] /
    EOS the tokenizer adds) with `truncate`, and otherwise is a ContextOverflowError.
    `dimensions` keeps the first N values (Matryoshka models), normalised after the cut."""
    items = _as_items(inputs)
    n_embd = model.config.n_embd
    if dimensions is not None and not 1 <= dimensions <= n_embd:
        raise EdgeInferError(f"dimensions must be between 1 and {n_embd}, got {dimensions}")
    limit = _max_tokens(model)
    seqs = []
    for k, item in enumerate(items):
        ids = list(item) if not isinstance(item, str) else \
            model.tokenizer.tokenize(item, add_special=True, parse_special=True, cancel=cancel)
        if not ids:
            raise EdgeInferError(f"input {k} is empty: nothing to embed")
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < model.config.n_vocab]
        if bad:
            raise EdgeInferError(f"input {k}: token id {bad[0]!r} is out of range 0..{model.config.n_vocab - 1}")
        if len(ids) > limit:
            if not truncate:
                raise ContextOverflowError(f"input {k} has {len(ids)} tokens: too large to process, more than "
                                           f"the {limit} this model embeds at once (truncate to cut it)")
            ids = _truncated(model, ids, limit)
        seqs.append([int(t) for t in ids])
    pooling = pooling_of(model, pooling)
    with model.sessions.lock:  # one forward pass at a time, as generation
        pooled = _run(model, seqs, pooling, cancel)
    vectors = []
    for v in pooled:
        if dimensions is not None:
            v = v[..., :dimensions]
        vectors.append(v.astype(np.float32).tolist() if pooling == POOLING_NONE
                       else normalize_vector(v, normalize).tolist())
    return Embeddings(vectors, [len(s) for s in seqs])


def _as_items(inputs) -> list:
    if isinstance(inputs, str):
        return [inputs]
    items = list(inputs)
    if items and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in items):
        return [items]  # one list of token ids
    for k, item in enumerate(items):
        if not isinstance(item, str) and not (isinstance(item, (list, tuple)) and
                                              all(isinstance(t, (int, np.integer)) for t in item)):
            raise EdgeInferError(f"input {k} must be a string or a list of token ids")
    return items


def _max_tokens(model: "LoadedModel") -> int:
    family = model.engine.model
    return family.max_tokens(model.n_ctx) if hasattr(family, "max_tokens") else model.n_ctx


def _truncated(model: "LoadedModel", ids: list[int], limit: int) -> list[int]:
    tok = model.tokenizer
    closing = {t for t in (tok.sep_id if getattr(tok, "add_sep", False) else None,
                           tok.eos_id if tok.add_eos else None) if t is not None}
    if ids[-1] in closing and limit > 1:
        return ids[:limit - 1] + [ids[-1]]
    return ids[:limit]


def _pool(hidden: np.ndarray, pooling: int) -> np.ndarray:
    if pooling == POOLING_NONE:
        return hidden
    if pooling == POOLING_MEAN:
        return hidden.astype(np.float64).mean(axis=0).astype(np.float32)
    if pooling == POOLING_CLS:
        return hidden[0]
    return hidden[-1]


def _run(model: "LoadedModel", seqs: list[list[int]], pooling: int,
         cancel: threading.Event | None) -> list[np.ndarray]:
    family = model.engine.model
    out: list[np.ndarray] = []
    if not family.GENERATES:  # encoders: several inputs share a pass, attention kept apart
        batch: list[list[int]] = []

        def flush() -> None:
            if batch:
                lens = [len(s) for s in batch]
                hidden = family.encode(np.array([t for s in batch for t in s], np.int64), lens)
                bounds = np.cumsum([0] + lens)
                out.extend(_pool(hidden[a:b], pooling) for a, b in zip(bounds[:-1], bounds[1:]))
                batch.clear()

        for s in seqs:
            if batch and sum(map(len, batch)) + len(s) > BATCH_TOKENS:
                flush()
            _check_cancel(cancel)
            batch.append(s)
        flush()
        return out
    engine = model.engine
    for s in seqs:  # decoders: each input through a fresh cache, in prefill chunks
        tokens = np.array(s, np.int64)
        kv = engine.backend.new_cache(model.config, len(s))
        cuts = engine.chunk_bounds(len(s))
        rows = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            _check_cancel(cancel)
            want = np.arange(hi - lo) if pooling != POOLING_LAST else np.array([hi - lo - 1])
            rows.append(family.hidden(tokens[lo:hi], np.arange(lo, hi), kv, want))
        out.append(_pool(np.concatenate(rows), pooling))
    return out


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise EdgeInferError("embedding stopped: the request was cancelled")


# -- reranking ------------------------------------------------------------------------------
@dataclass
class Ranking:
    scores: list[float]       # one relevance score per document, in the order given
    token_counts: list[int]   # tokens each query + document pair was scored from


def is_reranker(model: "LoadedModel") -> bool:
    """A cross-encoder with a classification head: the file declares rank pooling."""
    md = model.engine.model_file.gguf.metadata
    return meta_int(md, f"{model.config.arch}.pooling_type", 0, 4, None) == POOLING_RANK


def rerank_tokens(model: "LoadedModel", query: str, document: str, cancel: threading.Event | None = None) -> list[int]:
    """The pair as llama-server formats it (format_prompt_rerank): the file's rerank template
    (`tokenizer.chat_template.rerank`, {query} and {document} replaced) when it has one, else
    BOS query EOS SEP document EOS, each special token where the vocabulary adds it (EOS
    falls back to SEP where the vocabulary has none)."""
    tok = model.tokenizer
    template = model.engine.model_file.gguf.metadata.get("tokenizer.chat_template.rerank")
    if isinstance(template, str):
        text = template.replace("{query}", query).replace("{document}", document)
        return tok.tokenize(text, add_special=False, parse_special=True, cancel=cancel)
    q = tok.tokenize(query, add_special=False, parse_special=False, cancel=cancel)
    d = tok.tokenize(document, add_special=False, parse_special=False, cancel=cancel)
    eos = tok.eos_id if tok.eos_id is not None else tok.sep_id
    ids: list[int] = []
    if tok.add_bos and tok.bos_id is not None:
        ids.append(tok.bos_id)
    ids += q
    if tok.add_eos and eos is not None:
        ids.append(eos)
    if getattr(tok, "add_sep", False) and tok.sep_id is not None:
        ids.append(tok.sep_id)
    ids += d
    if tok.add_eos and eos is not None:
        ids.append(eos)
    return ids


def rerank(model: "LoadedModel", query: str, documents: Sequence[str], *,
           cancel: threading.Event | None = None) -> Ranking:
    """Score each document against the query as llama.cpp's rank pooling does, its first
    output being llama-server's score: an encoder's [CLS] state through its classifier; a
    causal reranker's (Qwen3-Reranker) last normed state through `cls.output` (its yes / no
    rows of the output matrix), softmaxed."""
    family = model.engine.model
    if not is_reranker(model):
        raise EdgeInferError(f"{model.name} is not a reranker (its file declares no rank pooling); "
                             f"reranking needs a cross-encoder")
    causal = family.GENERATES
    if causal and "cls.output.weight" not in model.engine.model_file.gguf.tensors:
        raise EdgeInferError(f"{model.name}: a causal reranker needs the cls.output.weight head "
                             f"(convert the model with a newer convert_hf_to_gguf.py)")
    if not causal and not hasattr(family, "classify"):
        raise EdgeInferError(f"{model.name}: reranking with {model.config.arch} is not supported")
    limit = _max_tokens(model)
    seqs = []
    for k, doc in enumerate(documents):
        ids = rerank_tokens(model, query, doc, cancel)
        if not ids:
            raise EdgeInferError(f"document {k}: the query and document are empty")
        if len(ids) > limit:
            raise ContextOverflowError(f"document {k} with the query has {len(ids)} tokens: too large to "
                                       f"process, more than the {limit} this model takes at once")
        seqs.append(ids)
    with model.sessions.lock:
        pooled = _run(model, seqs, POOLING_LAST if causal else POOLING_CLS, cancel) if seqs else []
        if not pooled:
            scores = np.zeros(0, np.float32)
        elif causal:
            scores = _causal_head(model, np.stack(pooled))[:, 0]
        else:
            scores = family.classify(np.stack(pooled))[:, 0]
    return Ranking([float(s) for s in scores], [len(s) for s in seqs])


def _causal_head(model: "LoadedModel", pooled: np.ndarray) -> np.ndarray:
    """llama.cpp's rank head of qwen3: `cls.output` (+ bias), then a softmax over its outputs."""
    be = model.engine.backend
    x = np.asarray(be.linear("cls.output.weight", np.ascontiguousarray(pooled, np.float32)), np.float32)
    if "cls.output.bias" in model.engine.model_file.gguf.tensors:
        x = x + be.vector("cls.output.bias")
    e = np.exp((x - x.max(axis=-1, keepdims=True)).astype(np.float64))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
