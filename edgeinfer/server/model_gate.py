"""The model gate: picks the model a request names, loads it if it is not resident, and holds it for the request.

Pure ASGI middleware around the endpoints that use a model. It reads the JSON body's `model`
(`name` for /api/show) before the endpoint does and hands the same bytes on; a name that is
neither served nor in the local store leaves the request on the served model, whose endpoint
answers 404 as before. Names are looked up in the store, never read as paths.
"""

from __future__ import annotations

import json
import logging

import anyio

from edgeinfer.errors import EdgeInferError
from edgeinfer.server.errors import APIError, error_response
from edgeinfer.server.slots import current_slot

log = logging.getLogger("edgeinfer.server")

# Paths that read keep_alive first and then call `ensure_model` themselves: an Ollama
# unload request must not load an unloaded model just to drop it.
SELF_LOADING_PATHS = frozenset({"/api/generate", "/api/chat"})


class ModelGate:
    """Holds the request's model loaded for the whole request (a stream included), loads it
    if needed, and lets its keep-alive clock start once the answer is out."""

    def __init__(self, app, state, paths: set[str]) -> None:
        self.app, self.state, self.paths = app, state, paths

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or path not in self.paths:
            await self.app(scope, receive, send)
            return
        state = self.state
        if scope.get("method") == "POST":
            name, receive = await _peek_model_name(receive, state.config.max_body_bytes,
                                                   "name" if path == "/api/show" else None)
        else:
            name = None
        slot = await self._slot(name)
        await slot.wait_drained()  # emptied to make room or to reload: it takes no new requests meanwhile
        token = current_slot.set(slot)
        state.acquire()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                slot.release()

        async def send_and_release(message) -> None:
            # release before the last byte goes out: a client that has its answer (say to
            # keep_alive 0) and asks /api/ps next must already see the model gone
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()
            await send(message)

        try:
            if path not in SELF_LOADING_PATHS and slot.model is None and (slot.unloaded or slot is not state.default):
                try:
                    await state.ensure_model()
                except APIError as exc:
                    await error_response(path, exc)(scope, receive, send_and_release)
                    return
            await self.app(scope, receive, send_and_release)
        finally:
            release()
            current_slot.reset(token)

    async def _slot(self, name):
        """The slot for the request's model name: a known one, one for a local store model, or
        the served model's (whose endpoint then says 404 for a name it does not have)."""
        state = self.state
        slot = state.find_slot(name)
        if slot is not None:
            return slot
        from edgeinfer.store import model_names, registry

        try:
            path = await anyio.to_thread.run_sync(registry.resolve_stored, name)
            named = model_names.lookup(name) if path is not None else None
        except EdgeInferError as exc:  # an unreadable name table: the model is not found
            log.warning("looking up %r: %s", name, exc)
            path = None
        if path is None:
            return state.default
        return state.slot_for_file(model_names.canonical(name), path, named)


async def _peek_model_name(receive, limit: int, fallback: str | None):
    """(the JSON body's model name or None, a receive that replays what was read)."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if not message.get("more_body", False) or size > limit:
            break

    async def replay():
        if messages:
            return messages.pop(0)
        return await receive()

    name = None
    if size <= limit:
        try:
            data = json.loads(b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request"))
        except ValueError:  # the endpoint says what is wrong with it
            data = None
        if isinstance(data, dict):
            name = data.get("model") or (data.get(fallback) if fallback else None)
    return (name if isinstance(name, str) and name else None), replay
