"""Stored responses (`store: true`, the default): kept in this server's memory so a request can
go on from one by `previous_response_id`, and `GET`/`DELETE /v1/responses/{id}` find it.

Each entry holds the response object and its whole conversation as input items (the earlier
turns, this request's input, this answer's output; never the instructions, which OpenAI does
not carry over). Bounded, least recently used out: MAX_ENTRIES responses and MAX_BYTES of their
JSON (a conversation is counted whole in every response of it, so the bound is conservative).
Nothing is written to disk; a restart forgets them all.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_ENTRIES = 256
MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class Stored:
    response: dict
    conversation: list[dict]
    size: int


class ResponseStore:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        if size > self.max_bytes:
            return  # larger than the whole store: kept by no one
        with self._lock:
            old = self._entries.pop(response["id"], None)
            if old is not None:
                self._bytes -= old.size
            self._entries[response["id"]] = Stored(response, conversation, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.size

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            found = self._entries.get(response_id)
            if found is not None:
                self._entries.move_to_end(response_id)
            return found

    def delete(self, response_id: str) -> bool:
        with self._lock:
            gone = self._entries.pop(response_id, None)
            if gone is not None:
                self._bytes -= gone.size
            return gone is not None

    def find_item(self, item_id: str) -> dict | None:
        """An item with this id in a stored conversation (an `item_reference`), newest first."""
        with self._lock:
            entries = list(self._entries.values())
        for entry in reversed(entries):
            for item in entry.conversation:
                if item.get("id") == item_id:
                    return item
        return None


def store_of(app) -> ResponseStore:
    """The app's store, made on first use (the event loop is its only user)."""
    store = getattr(app.state, "responses", None)
    if store is None:
        store = app.state.responses = ResponseStore()
    return store
