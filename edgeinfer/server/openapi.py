"""/openapi.json: the three dialects' contract, so clients can be generated and contract-tested.

The endpoints read their bodies themselves (read_body: size-limited, strict, one-line 400s), so
FastAPI does not see the body models; this adds each route's request body from its pydantic
model (schemas under components/schemas) to the document FastAPI builds from the routes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema


def _bodies() -> dict[tuple[str, str], type]:
    from edgeinfer.server import anthropic_schemas as ant
    from edgeinfer.server import embeddings_api as emb
    from edgeinfer.server import models_api as mod
    from edgeinfer.server import rerank_api as rr
    from edgeinfer.server import responses_schemas as resp
    from edgeinfer.server import schemas as s

    return {
        ("post", "/v1/chat/completions"): s.ChatCompletionRequest, ("post", "/v1/completions"): s.CompletionRequest,
        ("post", "/api/generate"): s.OllamaGenerateRequest, ("post", "/api/chat"): s.OllamaChatRequest,
        ("post", "/api/show"): s.OllamaShowRequest,
        ("post", "/completion"): s.LlamaCompletionRequest, ("post", "/completions"): s.LlamaCompletionRequest,
        ("post", "/infill"): s.InfillRequest, ("post", "/tokenize"): s.TokenizeRequest,
        ("post", "/detokenize"): s.DetokenizeRequest, ("post", "/apply-template"): s.ApplyTemplateRequest,
        ("post", "/v1/embeddings"): emb.OpenAIEmbeddingRequest, ("post", "/api/embed"): emb.OllamaEmbedRequest,
        ("post", "/api/embeddings"): emb.OllamaEmbeddingsRequest, ("post", "/embedding"): emb.LlamaEmbeddingRequest,
        ("post", "/embeddings"): emb.LlamaEmbeddingRequest,
        ("post", "/api/pull"): mod.PullRequest, ("delete", "/api/delete"): mod.DeleteRequest,
        ("post", "/api/copy"): mod.CopyRequest, ("post", "/api/create"): mod.CreateRequest,
        ("post", "/v1/responses"): resp.ResponsesRequest,
        **{("post", p): rr.RerankRequest for p in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking")},
        ("post", "/v1/messages"): ant.AnthropicMessagesRequest,
        ("post", "/v1/messages/count_tokens"): ant.AnthropicCountTokensRequest,
    }


def install(app: FastAPI) -> None:
    """Serve /openapi.json with the request bodies filled in (built once, on first ask)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description="OpenAI, Ollama and llama-server dialects")
        bodies = _bodies()
        keys, defs = models_json_schema([(m, "validation") for m in set(bodies.values())],
                                        ref_template="#/components/schemas/{model}")
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        for (method, path), model in bodies.items():
            op = doc.get("paths", {}).get(path, {}).get(method)
            if op is None:
                continue
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": keys[(model, "validation")]}}}
            op.setdefault("responses", {})["400"] = {"description": "a bad request: one line naming the field"}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
