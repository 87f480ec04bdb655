"""Tokenizer work of a request on (at most two) threads, never on the event loop."""
from __future__ import annotations

import anyio
from fastapi import Request

from edgeinfer.errors import EdgeInferError
from edgeinfer.server.errors import APIError


async def off_loop(request: Request, fn):
    """Tokenizer work runs on (at most two) threads, never on the event loop."""
    state = request.app.state.server
    if state.tokenizer_limiter is None:
        state.tokenizer_limiter = anyio.CapacityLimiter(2)
    try:
        return await anyio.to_thread.run_sync(fn, limiter=state.tokenizer_limiter)
    except EdgeInferError as exc:
        raise APIError(400, str(exc)) from None
