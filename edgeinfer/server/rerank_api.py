"""llama-server's reranking endpoint: POST /rerank, /reranking, /v1/rerank, /v1/reranking.

Enabled by `serve --rerank` (llama-server's --rerank / --reranking); without it every path
answers 501 not_supported_error, as llama-server does. The Jina / Cohere form takes `query`
and `documents` (strings, or {"text": ...} objects) and answers {model, object: "list",
usage, results: [{index, relevance_score}]} sorted by score, cut to `top_n`, with each
`document` ({"text": ...}) when `return_documents`. The TEI form (`texts` instead of
`documents`) answers the bare list of {index, score}, with `text` when `return_text`.
Scores are the model's classifier output (edgeinfer.embedding.rerank), as llama.cpp's: raw
for a cross-encoder, P(yes) for Qwen3-Reranker.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from edgeinfer.embedding import Ranking, is_reranker, rerank
from edgeinfer.results import FinishReason, GenerationChunk, Timings, Usage
from edgeinfer.server.errors import APIError
from edgeinfer.server.requests import read_body
from edgeinfer.server.schemas import Body
from edgeinfer.server.streaming import collect

router = APIRouter()

MAX_DOCUMENTS = 4096
NOT_ENABLED = "This server does not support reranking. Start it with `--reranking`"


_DOCUMENT = {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"text": {"type": "string"}},
                                             "required": ["text"], "additionalProperties": False}]}


class RerankRequest(Body):
    # query and documents are checked below, with llama-server's messages; the schema says what they take
    query: Annotated[Any, Field(json_schema_extra={"type": "string"})] = None
    documents: Annotated[list[Annotated[Any, Field(json_schema_extra=_DOCUMENT)]],
                         Field(max_length=MAX_DOCUMENTS)] | None = None
    texts: Annotated[list[str], Field(max_length=MAX_DOCUMENTS)] | None = None   # the TEI form
    top_n: Annotated[int, Field(ge=0)] | None = None
    return_documents: bool = False
    return_text: bool = False         # the TEI form's
    model: str | None = None


def _documents(req: RerankRequest) -> list[str]:
    field = "documents" if req.documents is not None else "texts"
    given = req.documents if req.documents is not None else req.texts
    if not given:
        raise APIError(400, '"documents" must be a non-empty string array', param=field)
    out = []
    for i, d in enumerate(given):
        if isinstance(d, dict) and set(d) == {"text"}:
            d = d["text"]
        if not isinstance(d, str):
            raise APIError(400, f"invalid field '{field}[{i}]': a document is a string or an object "
                                f"{{\"text\": string}}", param=field)
        out.append(d)
    return out


async def _score(request: Request, model, query: str, documents: list[str]) -> Ranking:
    state, box = request.app.state.server, {}

    def start(cancel):
        t0 = time.perf_counter()
        box["result"] = got = rerank(model, query, documents, cancel=cancel)
        n = sum(got.token_counts)
        yield GenerationChunk(text="", token=None, finish_reason=FinishReason.STOP,
                              usage=Usage(prompt_tokens=n, completion_tokens=0),
                              timings=Timings.from_clock(t0, None, time.perf_counter(), n, 0))

    await collect(state.submit(start), request)
    return box["result"]


@router.post("/rerank")
@router.post("/reranking")
@router.post("/v1/rerank")
@router.post("/v1/reranking")
async def rerank_documents(request: Request) -> JSONResponse:
    """Rerank documents against a query (llama-server's endpoint; needs `serve --rerank`)."""
    state = request.app.state.server
    if not state.config.rerank:
        raise APIError(501, NOT_ENABLED, kind="not_supported_error")
    req = await read_body(request, RerankRequest)
    model = state.require_model()
    state.check_model_name(req.model)
    if req.query is None:
        raise APIError(400, '"query" must be provided', param="query")
    if not isinstance(req.query, str):
        raise APIError(400, '"query" must be a string', param="query")
    tei = req.texts is not None and req.documents is None
    documents = _documents(req)
    if not is_reranker(model):
        raise APIError(400, f"model {state.model_name!r} is not a reranker: its file declares no rank pooling "
                            f"(serve a cross-encoder with rank pooling)", param="model")
    got = await _score(request, model, req.query, documents)
    label = "score" if tei else "relevance_score"
    results = []
    for i, score in enumerate(got.scores):
        item: dict[str, Any] = {"index": i, label: score}
        if tei and req.return_text:
            item["text"] = documents[i]
        elif not tei and req.return_documents:
            item["document"] = {"text": documents[i]}
        results.append(item)
    results.sort(key=lambda r: -r[label])   # stable: equal scores keep the documents' order
    results = results[:len(results) if req.top_n is None else req.top_n]
    if tei:
        return JSONResponse(results)
    n = sum(got.token_counts)
    return JSONResponse({"model": req.model or state.model_name, "object": "list",
                         "usage": {"prompt_tokens": n, "total_tokens": n}, "results": results})
