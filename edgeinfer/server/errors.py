"""API errors and the four JSON shapes clients expect them in.

OpenAI clients read `{"error": {"message", "type", "param", "code"}}`, the Ollama client
reads `{"error": "message"}`, llama-server plugins read `{"error": {"code", "message",
"type"}}`, Anthropic clients `{"type": "error", "error": {"type", "message"}}`. The shape
follows the path, so one exception type serves every endpoint.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

# HTTP status -> OpenAI error "type"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "unavailable_error", 504: "timeout_error"}


class APIError(Exception):
    """A request the server refuses: status code + one-line message."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 kind: str | None = None, extra: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.kind = kind          # the error "type", where the status alone does not say it
        self.extra = extra or {}  # more fields beside message and type (llama-server's n_ctx...)


def context_exceeded(n_prompt: int, n_ctx: int) -> APIError:
    """A prompt longer than the window, as llama-server answers it: type
    exceed_context_size_error with the prompt's tokens and the context size."""
    return APIError(400, f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), "
                         "try increasing it", code="context_length_exceeded", kind="exceed_context_size_error",
                    extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


# HTTP status -> Anthropic error "type" (its Messages API: /v1/messages...)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error"}


def dialect(path: str) -> str:
    """Which API family a path belongs to: "ollama", "anthropic", "openai" or "llama"."""
    if path.startswith("/api/"):
        return "ollama"
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/v1/"):
        return "openai"
    return "llama"


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None, kind: str | None = None, extra: dict | None = None) -> dict:
    kind = kind or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    d = dialect(path)
    if d == "ollama":
        return {"error": message}
    if d == "anthropic":
        return anthropic_error(status, message, kind, extra)
    if d == "openai":
        return {"error": {"message": message, "type": kind, "param": param, "code": code, **(extra or {})}}
    return {"error": {"code": status, "message": message, "type": kind, **(extra or {})}}


def anthropic_error(status: int, message: str, kind: str, extra: dict | None) -> dict:
    """Anthropic's shape; a prompt past the window is worded as Anthropic words it ("prompt is
    too long"), which Claude Code reads to compact its conversation."""
    if kind == "exceed_context_size_error" and extra and "n_prompt_tokens" in extra:
        message = f"prompt is too long: {extra['n_prompt_tokens']} tokens > {extra['n_ctx']} maximum"
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_of(path: str, err: APIError) -> dict:
    return error_body(path, err.status, err.message, err.param, err.code, err.kind, err.extra)


def error_response(path: str, err: APIError) -> JSONResponse:
    return JSONResponse(error_of(path, err), status_code=err.status, headers=err.headers)
