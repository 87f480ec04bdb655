"""uvicorn's h11 protocol with a read deadline: a request's headers and body must arrive in time.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but has no limit on
how long a client may take to send a request, so a client that trickles its headers
or body a byte at a time holds a connection (and a task) for ever (slowloris). Here a
deadline starts with the connection, or with the first byte of the next request on a
kept-alive one, and ends when the request is complete; a client that misses it gets a
408 (when no answer has started) and the connection is closed.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from edgeinfer.server.errors import error_body

log = logging.getLogger("edgeinfer.server")

DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_IDLE_TIMEOUT_S = 5.0
_READING = (h11.IDLE, h11.SEND_BODY)  # the client's states while its request is incomplete


class DeadlineH11Protocol(H11Protocol):
    """H11Protocol + a per-request read deadline of `read_timeout_s` seconds."""

    read_timeout_s = DEFAULT_READ_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._read_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._read_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state not in _READING:
            self._disarm()  # the request is complete (or the connection is done for)

    def _arm(self) -> None:
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if getattr(self, "_read_deadline", None) is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE and not self.conn.trailing_data[0]:
            self.transport.close()  # nothing sent at all: a silent close, like an idle timeout
            return
        message = f"the request did not arrive within {self.read_timeout_s:g}s"
        cycle = self.cycle
        reading_body = state is h11.SEND_BODY and cycle is not None
        if state is h11.IDLE or (reading_body and not cycle.response_started):
            path = cycle.scope["path"] if reading_body else "/"
            self.transport.write(_raw_response(408, error_body(path, 408, message)))
        client = "%s:%d " % self.client if self.client else ""
        log.warning("closed the connection from %s: %s", client or "a client", message)
        self.transport.close()  # a body reader sees http.disconnect


def _raw_response(status: int, body: dict) -> bytes:
    # written past h11: the connection closes right after, so its state no longer matters
    data = json.dumps(body).encode()
    head = (f"HTTP/1.1 {status} Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\nconnection: close\r\n\r\n").encode()
    return head + data


def protocol_class(read_timeout_s: float) -> type[DeadlineH11Protocol]:
    """A protocol class for `uvicorn.Config(http=...)` with this read deadline."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"read_timeout_s": float(read_timeout_s)})


def uvicorn_config(app, *, host: str = "127.0.0.1", port: int = 11434,
                   read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                   idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, **extra):
    """The uvicorn settings `edgeinfer serve` runs with (tests build their servers with it too)."""
    import uvicorn

    extra.setdefault("log_level", "warning")
    return uvicorn.Config(app, host=host, port=port, http=protocol_class(read_timeout_s),
                          timeout_keep_alive=idle_timeout_s, access_log=False,  # ours is access_log.py
                          timeout_graceful_shutdown=5, **extra)


_OUT_OF = {errno.EMFILE: "too many open files", errno.ENFILE: "too many open files in the system",
           errno.ENOBUFS: "no buffer space", errno.ENOMEM: "out of memory"}


class AcceptErrors:
    """The event loop's exception handler: asyncio reports each failed accept() (out of file
    descriptors, say) with a traceback, once per retry a second; this says it in one line,
    at most once per `every_s` seconds with a count, and hands everything else on."""

    def __init__(self, previous=None, every_s: float = 60.0) -> None:
        self.previous, self.every_s = previous, every_s
        self.last: float | None = None
        self.missed = 0

    def __call__(self, loop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF and "accept" in str(context.get("message", "")):
            now = time.monotonic()
            self.missed += 1
            if self.last is None or now - self.last >= self.every_s:
                log.error("cannot accept connections: %s (%d failed accepts since the last report); "
                          "retrying each second", _OUT_OF[exc.errno], self.missed)
                self.last, self.missed = now, 0
            return
        if self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)


def install_accept_errors(loop: asyncio.AbstractEventLoop) -> AcceptErrors:
    handler = AcceptErrors(loop.get_exception_handler())
    loop.set_exception_handler(handler)
    return handler
