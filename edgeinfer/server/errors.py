"""API errors and the three JSON shapes clients expect them in.

OpenAI clients read `{"error": {"message", "type", "param", "code"}}`, the Ollama client
reads `{"error": "message"}`, llama-server plugins read `{"error": {"code", "message",
"type"}}`. The shape follows the path, so one exception type serves every endpoint.
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
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def dialect(path: str) -> str:
    """Which API family a path belongs to: "ollama", "openai" or "llama"."""
    if path.startswith("/api/"):
        return "ollama"
    if path.startswith("/v1/"):
        return "openai"
    return "llama"


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    d = dialect(path)
    if d == "ollama":
        return {"error": message}
    if d == "openai":
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return {"error": {"code": status, "message": message, "type": kind}}


def error_response(path: str, err: APIError) -> JSONResponse:
    return JSONResponse(error_body(path, err.status, err.message, err.param, err.code),
                        status_code=err.status, headers=err.headers)
