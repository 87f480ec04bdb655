"""Reranking: a tiny bert cross-encoder (pooling rank, `cls` / `cls.output` head) scores each
query + document pair as llama.cpp does (the pair as llama-server formats it, the [CLS] state
through the classifier), and the llama-server endpoint (`serve --rerank`): /v1/rerank,
/rerank, /v1/reranking with ordering, top_n, return_documents, the TEI form, and its 4xx/501."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import numpy as np
import pytest
from llama_oracle import importorskip_oracle
from gguf_factory import TinyShape, bpe_vocab, write_tiny_model
from gguf_factory_embed import write_tiny_encoder, write_tiny_reranker
from test_server import start_server
from ugm_factory import write_ugm_encoder

import edgeinfer
from edgeinfer.embedding import rerank, rerank_tokens
from edgeinfer.errors import EdgeInferError

QUERY = "what is the code"
DOCS = ["hello world", "def f(x): return x", "the code is here", "un want ##ed caf", "a", "import self class"]
TEMPLATE = "[CLS]q: {query}[SEP]d: {document}[SEP]"
QWEN_TEMPLATE = "<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"
QWEN = TinyShape(n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=128)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("rerank")
    return {
        "rank": write_tiny_reranker(d / "rank.gguf"),                    # [CLS] q [SEP] [SEP] d [SEP]
        "no-eos": write_tiny_reranker(d / "no-eos.gguf", add_eos=False, fused_qkv=True, seed=5),  # [CLS] q [SEP] d
        "labels": write_tiny_reranker(d / "labels.gguf", n_cls_out=3, seed=7),
        "template": write_tiny_reranker(d / "template.gguf", rerank_template=TEMPLATE, seed=9),
        "embed": write_tiny_encoder(d / "embed.gguf", "bert", pooling=1),
        # bge-reranker-v2-m3-shaped: XLM-R's unigram vocabulary (tokenizer.ggml.model t5, a charsmap)
        "xlmr": write_ugm_encoder(d / "xlmr.gguf", pooling=4, classifier=True, seed=11),   # <s> q </s></s> d </s>
        # Qwen3-Reranker-shaped: causal, its rerank template, `cls.output` = the yes / no rows
        "qwen3": write_tiny_model(d / "qwen3-rank.gguf", "qwen3", vocab=bpe_vocab("qwen2"), shape=QWEN,
                                  extra_metadata={"qwen3.pooling_type": 4,
                                                  "tokenizer.chat_template.rerank": QWEN_TEMPLATE,
                                                  "qwen3.classifier.output_labels": ["yes", "no"]},
                                  shape_overrides={"cls.output.weight": (QWEN.n_embd, 2)}),
    }


def oracle_scores(path, query, docs, n_ctx=128, flash_attn=False) -> tuple[list[float], list[list[int]]]:
    """llama-server's scores from llama.cpp: each pair formatted as format_prompt_rerank,
    decoded alone with rank pooling, the pooled output's first value."""
    llama_cpp = importorskip_oracle()
    ref = llama_cpp.Llama(model_path=str(path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK,
                          n_ctx=n_ctx, n_threads=1, verbose=False, flash_attn=flash_attn)
    vocab = llama_cpp.llama_model_get_vocab(ref.model)
    template = ref.metadata.get("tokenizer.chat_template.rerank")
    eos = llama_cpp.llama_vocab_eos(vocab)
    eos = llama_cpp.llama_vocab_sep(vocab) if eos == -1 else eos
    scores, pairs = [], []
    for doc in docs:
        if template:
            text = template.replace("{query}", query).replace("{document}", doc)
            ids = ref.tokenize(text.encode(), add_bos=False, special=True)
        else:
            ids = [llama_cpp.llama_vocab_bos(vocab)] if llama_cpp.llama_vocab_get_add_bos(vocab) else []
            ids += ref.tokenize(query.encode(), add_bos=False, special=False)
            ids += [eos] if llama_cpp.llama_vocab_get_add_eos(vocab) else []
            ids += [llama_cpp.llama_vocab_sep(vocab)] if llama_cpp.llama_vocab_get_add_sep(vocab) else []
            ids += ref.tokenize(doc.encode(), add_bos=False, special=False)
            ids += [eos] if llama_cpp.llama_vocab_get_add_eos(vocab) else []
        ref._ctx.kv_cache_clear()
        ref._batch.reset()
        ref._batch.add_sequence(ids, 0, False)
        ref._ctx.decode(ref._batch)
        scores.append(float(llama_cpp.llama_get_embeddings_seq(ref._ctx.ctx, 0)[0]))
        pairs.append(ids)
    return scores, pairs


XLMR_DOCS = DOCS + ["café naïve Zürich", "ﬁle ＡＢＣ ①  日本語", "Ω 😀 unknown", "  spaced\tout\n"]


@pytest.mark.parametrize("key", ["rank", "no-eos", "labels", "template", "qwen3", "xlmr"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_scores_match_llama_cpp(files, key, backend):
    n_ctx = 512 if key == "qwen3" else 128   # (the tiny byte-level vocabulary: long pairs)
    docs = XLMR_DOCS if key == "xlmr" else DOCS
    want, pairs = oracle_scores(files[key], QUERY, docs, n_ctx)
    model = edgeinfer.load(str(files[key]), n_ctx=n_ctx, backend=backend, threads=1)
    assert [rerank_tokens(model, QUERY, d) for d in docs] == pairs
    if key == "xlmr":   # XLM-R's pair: <s> query </s> </s> document </s>
        q = model.tokenizer.tokenize(QUERY, add_special=False)
        assert pairs[0] == [0, *q, 2, 2, *model.tokenizer.tokenize(docs[0], add_special=False), 2]
    got = rerank(model, QUERY, docs)
    assert got.token_counts == [len(p) for p in pairs]
    # as tests/oracles.py bounds the families: 1e-4, or twice llama.cpp's own disagreement
    # (flash attention on against off) where the random tiny model magnifies rounding more
    # (labels, doc "a": 2.2e-4 on an AVX-512 host, where we are 1.1e-4 from its default)
    spread = np.abs(np.subtract(oracle_scores(files[key], QUERY, docs, n_ctx, flash_attn=True)[0], want))
    off = np.abs(np.subtract(got.scores, want))
    assert np.all(off <= np.maximum(1e-4, 2 * spread)), (off, spread)   # each document its own bound
    assert np.ptp(want) > 0.05   # the documents really score apart


def test_one_at_a_time_equals_batched(files):
    model = edgeinfer.load(str(files["rank"]), n_ctx=128, backend="reference")
    together = rerank(model, QUERY, DOCS).scores
    alone = [rerank(model, QUERY, [d]).scores[0] for d in DOCS]
    np.testing.assert_allclose(together, alone, atol=1e-6)
    assert model.rerank(QUERY, DOCS) == together   # the Python API


def test_library_refusals(files, tmp_path):
    embedder = edgeinfer.load(str(files["embed"]), n_ctx=128, backend="reference")
    with pytest.raises(EdgeInferError, match="not a reranker"):
        rerank(embedder, QUERY, DOCS)
    model = edgeinfer.load(str(files["rank"]), n_ctx=16, backend="reference")
    with pytest.raises(EdgeInferError, match="too large"):
        rerank(model, QUERY, ["hello world " * 20])
    causal = write_tiny_model(tmp_path / "qwen3-rank.gguf", "qwen3", vocab=bpe_vocab("qwen2"), shape=QWEN,
                              extra_metadata={"qwen3.pooling_type": 4})
    with pytest.raises(EdgeInferError, match="cls.output.weight"):   # an old conversion: no yes / no head
        rerank(edgeinfer.load(str(causal), n_ctx=64, backend="reference"), QUERY, DOCS)
    with pytest.raises(EdgeInferError, match="rank pooling"):   # a reranker does not embed
        edgeinfer.load(str(files["no-eos"]), n_ctx=16, backend="reference").embed("hello")


# -- the endpoint ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reranker(files):
    return edgeinfer.load(str(files["rank"]), n_ctx=128, backend="reference")


@pytest.fixture(scope="module")
def servers(files, reranker):
    embedder = edgeinfer.load(str(files["embed"]), n_ctx=128, backend="reference")
    srv = {"on": start_server(reranker, rerank=True), "off": start_server(reranker),
           "embed": start_server(embedder, rerank=True)}
    yield srv
    for s in srv.values():
        s.stop()


@pytest.fixture(scope="module")
def http(servers):
    with httpx.Client(base_url=servers["on"].url, timeout=30) as c:
        yield c


def test_rerank_orders_and_cuts(http, reranker):
    want = rerank(reranker, QUERY, DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -want.scores[i])
    for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
        body = http.post(path, json={"query": QUERY, "documents": DOCS}).json()
        assert [r["index"] for r in body["results"]] == order, path
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                                   [want.scores[i] for i in order], atol=1e-6)
        assert all("document" not in r for r in body["results"])
        n = sum(want.token_counts)
        assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
        assert body["object"] == "list" and body["model"] == "tiny"
    top = http.post("/v1/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                        "return_documents": True, "model": "tiny"}).json()
    assert [r["index"] for r in top["results"]] == order[:2]
    assert [r["document"] for r in top["results"]] == [{"text": DOCS[i]} for i in order[:2]]
    assert top["usage"]["prompt_tokens"] == sum(want.token_counts)   # every document was scored
    assert http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 99}).json()["results"] \
        == http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()["results"]
    assert http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 0}).json()["results"] == []
    mixed = http.post("/v1/rerank", json={"query": QUERY, "documents": ["a", {"text": "hello world"}]}).json()
    assert sorted(r["index"] for r in mixed["results"]) == [0, 1]


def test_tei_form(http, reranker):
    want = rerank(reranker, QUERY, DOCS[:3]).scores
    body = http.post("/rerank", json={"query": QUERY, "texts": DOCS[:3], "return_text": True}).json()
    assert isinstance(body, list) and sorted(r["index"] for r in body) == [0, 1, 2]
    for r in body:
        assert r["score"] == pytest.approx(want[r["index"]], abs=1e-6) and r["text"] == DOCS[r["index"]]
    assert [r["score"] for r in body] == sorted(want, reverse=True)


@pytest.mark.parametrize("body,message", [
    ({"documents": DOCS}, '"query" must be provided'),
    ({"query": 3, "documents": DOCS}, '"query" must be a string'),
    ({"query": QUERY, "documents": []}, "non-empty"),
    ({"query": QUERY}, "non-empty"),
    ({"query": QUERY, "documents": "hello"}, "documents"),
    ({"query": QUERY, "documents": ["a", 3]}, "documents[1]"),
    ({"query": QUERY, "documents": [{"content": "a"}]}, "documents[0]"),
    ({"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "return_documents": "yes"}, "return_documents"),
    ({"query": QUERY, "documents": DOCS, "bogus": 1}, "bogus"),
    ({"query": QUERY, "documents": ["hello world " * 80]}, "too large"),
])
def test_bad_requests_are_one_line_400(http, body, message):
    r = http.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    line = r.json()["error"]["message"]
    assert message in line and "\n" not in line


def test_not_a_reranker_and_not_enabled(servers):
    r = httpx.post(servers["embed"].url + "/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 400 and "'tiny' is not a reranker" in r.json()["error"]["message"]
    for path in ("/v1/rerank", "/rerank"):   # without --rerank: llama-server's 501
        r = httpx.post(servers["off"].url + path, json={"query": QUERY, "documents": DOCS})
        assert r.status_code == 501
        error = r.json()["error"]
        assert error["type"] == "not_supported_error" and "--reranking" in error["message"]


def test_causal_reranker_on_the_endpoint(files):
    model = edgeinfer.load(str(files["qwen3"]), n_ctx=512, backend="reference")
    want = rerank(model, QUERY, DOCS[:3])
    srv = start_server(model, rerank=True)
    try:
        body = httpx.post(srv.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS[:3], "top_n": 2},
                          timeout=30).json()
    finally:
        srv.stop()
    order = sorted(range(3), key=lambda i: -want.scores[i])[:2]
    assert [r["index"] for r in body["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], [want.scores[i] for i in order],
                               atol=1e-6)
    assert body["usage"]["prompt_tokens"] == sum(want.token_counts)


def test_openapi_lists_the_endpoint(http):
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/rerank", "/rerank", "/v1/reranking", "/reranking"} <= set(paths)
    body = paths["/v1/rerank"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/RerankRequest")


def test_serve_rerank_flag(files):
    from test_server_cli import free_port, serve

    port = free_port()
    proc = serve(str(files["rank"]), "--rerank", "--port", str(port), "--backend", "reference", "-c", "128")
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        body = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCS[:2]}, timeout=30).json()
        assert sorted(r["index"] for r in body["results"]) == [0, 1]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        err = proc.stderr.read()
    assert proc.returncode in (0, 130) and "Traceback" not in err, err
