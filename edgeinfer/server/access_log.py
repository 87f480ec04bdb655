"""One access-log line per request, as Ollama (gin) and llama-server print them.

The `edgeinfer.access` logger gets, for each HTTP request once its response has ended
(a stream when its last byte went out): time, client, method, path, status, duration,
and the prompt / generated token counts when a generation ran. `configure` puts it on
stderr as plain text or as one JSON object a line (`edgeinfer serve --log-format json`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime, timezone
from typing import Any, TextIO

log = logging.getLogger("edgeinfer.access")

RECORD_KEY = "edgeinfer.access"  # the scope entry the endpoints write token counts into
FORMATS = ("text", "json")


class Record:
    """What one request's line says; endpoints fill in the token counts."""

    __slots__ = ("prompt_tokens", "completion_tokens")

    def __init__(self) -> None:
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None


def note_usage(scope: dict, prompt_tokens: int, completion_tokens: int) -> None:
    """Called with a generation's final usage; a no-op outside the middleware."""
    record = scope.get(RECORD_KEY)
    if record is not None:
        record.prompt_tokens, record.completion_tokens = prompt_tokens, completion_tokens


class AccessLogMiddleware:
    """Pure ASGI middleware, outermost: it sees refusals and streams alike."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, start = time.perf_counter(), time.time()
        record = scope[RECORD_KEY] = Record()
        status: list[int] = []

        async def send_and_see(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        finally:
            client = scope.get("client")
            fields = {"time": datetime.fromtimestamp(start, timezone.utc).isoformat(timespec="milliseconds")
                      .replace("+00:00", "Z"),
                      "client": client[0] if client else "-",
                      "method": scope.get("method", "?"), "path": scope.get("path", ""),
                      "status": status[0] if status else 499,  # 499: the client left before an answer
                      "duration_s": round(time.perf_counter() - t0, 6),
                      "prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens}
            log.info("%s", text_line(fields), extra={"access": fields})


def text_line(f: dict[str, Any]) -> str:
    """gin's layout: `time | status | duration | client | METHOD "path"`, then the tokens."""
    line = f'{f["time"]} | {f["status"]:3d} | {_duration(f["duration_s"]):>10} | {f["client"]:>15} | ' \
           f'{f["method"]:<7} "{f["path"]}"'
    if f["prompt_tokens"] is not None:
        line += f' | prompt {f["prompt_tokens"]} | generated {f["completion_tokens"]}'
    return line


def _duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f}µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f}ms"
    return f"{seconds:.3f}s"


class JSONFormatter(logging.Formatter):
    """The access fields as one JSON object; other records as {"time", "level", "message"}."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "access", None)
        if fields is None:
            fields = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
                      "level": record.levelname.lower(), "message": record.getMessage()}
        return json.dumps(fields, ensure_ascii=False)


_installed: logging.Handler | None = None


def configure(fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Send access lines to `stream` (stderr) in `fmt`; calling again replaces the handler."""
    global _installed
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (choose from {', '.join(FORMATS)})")
    if _installed is not None:
        log.removeHandler(_installed)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    _installed = handler
    return handler
