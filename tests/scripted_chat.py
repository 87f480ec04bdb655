"""A real model whose chat replays a scripted answer: random weights cannot write a chat
format's structure (harmony's channels, Gemma 4's thought and calls), so the dialect tests
replay fixed answers through the real server and readers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from edgeinfer.results import GenerationChunk, Timings, Usage


class Scripted:
    """`model.chat` replaced: it replays `text` in `piece`-character pieces and records its keywords."""

    def __init__(self, model, text: str, piece: int = 3) -> None:
        self.model, self.text, self.piece, self.calls = model, text, piece, []
        model.chat = self.chat

    @contextmanager
    def answering(self, text: str) -> Iterator["Scripted"]:
        """Replay `text` instead while the block runs, then the script again."""
        saved, self.text = self.text, text
        try:
            yield self
        finally:
            self.text = saved

    def chat(self, messages, *, stream=True, cancel=None, **kw):
        self.calls.append({"messages": messages, **kw})
        n = self.piece
        pieces = [self.text[i:i + n] for i in range(0, len(self.text), n)]
        for i, p in enumerate(pieces):
            yield GenerationChunk(text=p, token=i)
        yield GenerationChunk("", None, "stop", Usage(10, len(pieces)), Timings.from_clock(0.0, 0.1, 0.2, 10, 3))


def served(model, text: str, piece: int = 3) -> Iterator[tuple]:
    """(server, Scripted) for a module fixture: `model` replaying `text`, served until the
    fixture ends (test_server.start_server)."""
    from test_server import start_server

    fake = Scripted(model, text, piece)
    srv = start_server(fake.model)
    yield srv, fake
    srv.stop()
