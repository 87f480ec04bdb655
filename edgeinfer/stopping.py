"""Stop strings over streamed text: never show a stop string, not even part of one."""

from __future__ import annotations

from typing import Sequence

from edgeinfer.results import FinishReason

__all__ = ["StopStringMatcher", "FinishReason"]


class StopStringMatcher:
    """Feed decoded text pieces; get back what is safe to show.

    A suffix of the text that could still grow into a stop string is held back;
    as soon as a stop string completes, the text before it is returned with
    stopped=True and everything after is dropped. (llama-server instead cuts at the
    earliest *start* among the stop strings complete in the current buffer, which
    depends on token boundaries when stop strings overlap.)
    """

    def __init__(self, stop: Sequence[str]):
        self.stop: list[str] = [s for s in stop if s]  # "" would match everywhere
        self._held = ""       # text not yet emitted; always shorter than the longest stop
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation

    def push(self, piece: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string completed)."""
        if self.stopped:
            return "", True
        buf = self._held + piece
        # Stop where a stop string first *completes*; if several complete at the same
        # character, cut at the one that starts first. Deciding by completion point
        # makes the result independent of how the text was split into pieces.
        best: tuple[int, int] | None = None      # (end, start)
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best, which = (i + len(s), i), s
        if best is not None:
            self._held, self.stopped, self.matched = "", True, which
            return buf[:best[1]], True
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """Release the held-back text when generation ends for another reason."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
